"""What a run reports: one record per completed step, the sinks records go to, the lines a
person reads (step line, pipeline note) and the end-of-run summary.

A step is complete when every replica of its drafter has reported it (`StepAssembler`), and on
several nodes the step's `NodeTotals` (every node's sums, from the vote) have arrived; its record
(`step_record`) is the one thing every sink receives. Sinks share a three-method
interface, so another sink (TensorBoard, a database) is one class and one line in
`open_sinks`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from ..core.objective import summarize_metrics
from ..files import write_text_atomic
from ..parallel.vote import NodeTotals
from ..parallel.utilisation import Bottleneck, bottleneck, worker_load
from ..progress import format_seconds
from .tensorboard import TensorBoardSink, tensorboard_enabled
from .drafter_worker import DrafterWorker, StepReport


class Sink(Protocol):
    """Where step and pipeline records go; every method is called from the coordinator's thread."""

    def write_step(self, drafter: str, record: dict) -> None: ...

    def write_pipeline(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """`metrics.jsonl` in each drafter's run folder (one line per step) and `pipeline.jsonl` in
    the run folder (one line per logged step of the first drafter).

    A resumed run continues from its checkpoint's step: lines of later steps (written after that
    checkpoint by a run that was then killed) are dropped first, so every step has one line."""

    def __init__(self, metrics_paths: dict[str, Path], pipeline_path: Path, resumed_at: int | None = None):
        if resumed_at is not None:
            for path in [*metrics_paths.values(), pipeline_path]:
                keep_lines_through_step(path, resumed_at)
        self._metrics = {name: _open_append(path) for name, path in metrics_paths.items()}
        self._pipeline = _open_append(pipeline_path)

    def write_step(self, drafter: str, record: dict) -> None:
        _write_line(self._metrics[drafter], record)

    def write_pipeline(self, record: dict) -> None:
        _write_line(self._pipeline, record)

    def close(self) -> None:
        for handle in [*self._metrics.values(), self._pipeline]:
            handle.close()


def _open_append(path: Path) -> TextIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a")


def _write_line(handle: TextIO, record: dict) -> None:
    handle.write(json.dumps(record) + "\n")
    handle.flush()


def keep_lines_through_step(path: Path, step: int) -> None:
    """Rewrite a JSONL log (atomically) without the records of steps after `step` and without a
    torn last line."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_text_atomic(path, "".join(line + "\n" for line in kept))


def open_sinks(out: Path, run_dirs: dict[str, Path], resumed_at: int | None = None, tensorboard: str = "off") -> list[Sink]:
    """The sinks a run writes to: metrics.jsonl / pipeline.jsonl always, TensorBoard event
    files next to them unless `tensorboard` ("auto" | "on" | "off") turns them off."""
    sinks: list[Sink] = [JsonlSink({name: folder / "metrics.jsonl" for name, folder in run_dirs.items()},
                                   out / "pipeline.jsonl", resumed_at)]
    if tensorboard_enabled(tensorboard):
        sinks.append(TensorBoardSink(out, run_dirs))
    return sinks


class StepAssembler:
    """Collects the replicas' reports of a step; hands them over once all have arrived."""

    def __init__(self, replicas_per_drafter: dict[str, int]):
        self.expected = replicas_per_drafter
        self._pending: dict[tuple[str, int], list[StepReport]] = {}

    def add(self, report: StepReport | NodeTotals) -> list | None:
        key = (report.drafter, report.step)
        reports = self._pending.setdefault(key, [])
        reports.append(report)
        if len(reports) < self.expected[report.drafter]:
            return None
        return self._pending.pop(key)

    def awaiting_totals(self) -> list[list[StepReport]]:
        """The steps every replica here finished whose NodeTotals never came (a node was lost
        before the vote that carries them), in order: handed over as they are."""
        waiting = [key for key, reports in self._pending.items()
                   if len(reports) == self.expected[key[0]] - 1 and not any(isinstance(r, NodeTotals) for r in reports)]
        return [self._pending.pop(key) for key in sorted(waiting, key=lambda key: key[1])]


def step_record(reports: list, elapsed: float) -> dict:
    """One completed step of one drafter, summed over its replicas (over every node's, when the
    step's NodeTotals are among the reports): what every sink receives. Timings are this node's."""
    totals = next((r for r in reports if isinstance(r, NodeTotals)), None)
    reports = [r for r in reports if not isinstance(r, NodeTotals)]
    if totals is not None:
        sums, loss = totals.metric_sums, totals.loss
    else:
        sums = {k: sum(r.result.metric_sums[k] for r in reports) for k in reports[0].result.metric_sums}
        loss = sum(r.result.loss for r in reports)
    metrics = summarize_metrics(sums)
    record = {
        "step": reports[0].step + 1,
        "loss": loss,
        "accuracy": metrics["accuracy"],
        "tau_sim": metrics["tau_sim"],
        "position_accuracy": metrics["position_accuracy"],
        "lr": reports[0].result.lr,
        "grad_norm": reports[0].result.grad_norm,
        "skipped": reports[0].result.skipped,
        "step_s": round(max(r.seconds + r.waited for r in reports), 4),
        "compute_s": round(max(r.seconds for r in reports), 4),
        "wait_s": round(max(r.waited for r in reports), 4),
        "samples": totals.samples if totals is not None else sum(r.samples for r in reports),
        "tokens": totals.tokens if totals is not None else sum(r.tokens for r in reports),
        "elapsed_s": round(elapsed, 2),
    }
    measured = next((r.evaluation for r in reports if r.evaluation), None)
    if measured:
        record["tau_real"] = measured["tau"]
        record["tau_real_pooled"] = measured["tau_pooled"]
        record["tau_real_decoder"] = measured["decoder"]
    return record


@dataclass
class RunningStats:
    """Per drafter: what the summary shows."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    skipped: int = 0
    history: list[dict] = field(default_factory=list)

    def add(self, record: dict) -> None:
        self.steps += 1
        self.samples += record["samples"]
        self.tokens += record["tokens"]
        self.skipped += int(record["skipped"])
        self.history.append(record)


def eval_line(record: dict, measured: dict, name: str | None) -> str:
    return (f"{'[' + name + '] ' if name else ''}eval at step {record['step']}: "
            f"real tau {measured['tau']:.3f} (pooled {measured['tau_pooled']:.3f}, "
            f"{measured['tokens']} tokens in {measured['seconds']:.1f}s, {measured['decoder']} decoder) "
            f"| simulated tau {record['tau_sim']:.3f}")


def step_line(record: dict, name: str | None, total: int, eta: float) -> str:
    prefix = f"[{name}] " if name else ""
    throughput = record["samples"] / record["step_s"] if record["step_s"] > 0 else 0.0
    tokens = record["tokens"] / record["step_s"] if record["step_s"] > 0 else 0.0
    return (
        f"{prefix}step {record['step']}/{total} | loss {record['loss']:.4f} | acc {record['accuracy']:.3f} | "
        f"tau_sim {record['tau_sim']:.2f} | lr {record['lr']:.2e} | gnorm {record['grad_norm']:.2f} | "
        f"{record['step_s']:.3f} s/step (wait {record['wait_s']:.3f}) | {throughput:.1f} samples/s | "
        f"{tokens / 1000:.1f}k tok/s | eta {format_seconds(eta)}"
    )


def worker_stats(workers, gate=None) -> dict:
    """Each worker's load; a drafter's compiles too when the run compiles (`gate`: its CompileGate)."""
    stats = {}
    for w in workers:
        load = worker_load(w)
        entry = {"busy": round(w.times.busy_fraction(), 3), "host_busy": round(load.host, 3),
                 "gpu_busy": None if load.gpu is None else round(load.gpu, 3), "items": w.times.items,
                 "computing_s": round(w.times.computing, 2), "waiting_s": round(w.times.waiting, 2),
                 "gpu_wait_s": round(w.meter.gpu_wait_seconds, 2)}
        if isinstance(w, DrafterWorker) and gate is not None:
            counts = gate.worker_compiles(w.name)
            entry.update(compiles=counts["warm_up"] + counts["after_warmup"], recompiles_after_warmup=counts["after_warmup"])
        stats[w.name] = entry
    return stats


def pipeline_bottleneck(workers, depth: float, queue_bound: int) -> Bottleneck:
    return bottleneck([worker_load(w) for w in workers], depth, queue_bound)


def _short(name: str) -> str:
    return name.split("[")[0].replace("target-", "t").replace("drafter-", "d")


def pipeline_note(workers, depth: float, limit: Bottleneck | None = None, gate=None) -> str:
    """Who is the bottleneck at a glance: host and GPU busy fraction per worker, mean queue depth,
    the verdict of `utilisation.bottleneck`, and the run's compiles (`gate`: its CompileGate)."""
    loads = [worker_load(w) for w in workers]
    busy = " ".join(f"{_short(load.name)} host {load.host:.2f}" + (f" gpu {load.gpu:.2f}" if load.gpu is not None else "")
                    for load in loads)
    note = f" | busy {busy} | queue {depth:.1f}" + (f" | limit {limit.label}" if limit is not None else "")
    if gate is None:
        return note
    return note + f" | compiles {gate.compiles} (recompiles {gate.compiles_after_warmup})"


def summary_text(summary: dict, total_steps: int) -> str:
    lines = ["", "=" * 72, f"training summary ({summary['stop_reason']}, {format_seconds(summary['elapsed_s'])})"]
    for name, entry in summary["drafters"].items():
        lines.append(f"  {name}: steps {summary['steps_done'].get(name)}/{total_steps}")
        if "loss" in entry:
            lines.append(
                f"    loss {entry['first_loss']:.3f} -> {entry['loss']:.3f} (mean of last steps) | "
                f"accuracy {entry['accuracy']:.3f} | simulated tau {entry['tau_sim']:.2f}"
            )
        if entry.get("tau_real"):
            real = entry["tau_real"]
            lines.append(f"    real tau at step {real['step']}: {real['tau']:.3f} (pooled {real['tau_pooled']:.3f}), "
                         "by speculative decoding")
        lines.append(f"    {entry['samples_per_s']} samples/s | skipped (non-finite) steps: {entry['skipped_steps']}")
        lines.append(f"    checkpoint: {entry['checkpoint']}")
        if entry.get("export"):
            lines.append(f"    exported HF folder: {entry['export']}")
    lines.append("  workers (host = not waiting on queues or the GPU; gpu = CUDA-event time of its work, per wall time):")
    for name, w in summary["workers"].items():
        compiles = f"  compiles {w['compiles']} (after warm-up {w['recompiles_after_warmup']})" if "compiles" in w else ""
        gpu = f"  gpu {w['gpu_busy']:.2f}" if w.get("gpu_busy") is not None else ""
        lines.append(f"    {name:<24} host {w['host_busy']:.2f}{gpu}  compute {w['computing_s']}s  wait {w['waiting_s']}s  "
                     f"items {w['items']}{compiles}")
    lines.append(f"  mean queue depth {summary['mean_queue_depth']} | gradient sync {summary['gradient_sync_s']}s"
                 + (f" | limit: {summary['bottleneck']}" if summary.get("bottleneck") else ""))
    startup = summary.get("startup") or {}
    if startup.get("time_to_first_step_s") is not None:
        warmup = f", warm-up (compile + capture before step 1) {startup['warmup_s']}s" if startup.get("warmup_s") else ""
        lines.append(f"  startup: first step after {startup['time_to_first_step_s']}s, full speed after "
                     f"{startup['time_to_full_speed_s']}s{warmup}")
    lines.append("=" * 72)
    return "\n".join(lines)
