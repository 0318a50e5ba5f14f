"""The coordinator: runs a built pipeline, reports every step, finishes the run.

    run      start the workers (signals handled), then the report loop until every drafter
             thread has exited and every report it queued has been read
    report   complete steps become records: sinks (metrics.jsonl, pipeline.jsonl, ...), the
             progress bar, a step line every --log-every steps, and the health watch, which
             stops a run whose steps stopped teaching the drafter anything
    finish   stop and join the workers, write summary.json, export finished drafters, print the
             summary; raise what stopped the run (a worker's error, or RunFailed)

If the coordinator itself fails (a sink cannot write, a bug), it stops the workers and waits for
them before the error leaves `run`: nothing trains or writes after `train()` has failed.

On several nodes every node runs a coordinator; a step is complete once the node totals of the
step (`NodeTotals`, from the vote) have arrived too, and only rank 0 prints steps, writes the
summary and exports; every rank waits for the others before it leaves.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.drafter import DrafterConfig
from ..core.master_weights import trained_weights
from ..errors import RunFailed
from ..export.hf import export_drafter
from ..files import write_json_atomic
from ..parallel.threads import POLL_SECONDS, StopSignal, Worker
from ..parallel.vote import interrupt_target
from ..progress import Progress
from ..target.model import dtype_from_name
from .build import Pipeline, Run, cpu_threads_per_worker
from .drafter_worker import StepReport
from .layout import DrafterPlan
from .reporting import (
    RunningStats,
    Sink,
    StepAssembler,
    eval_line,
    pipeline_bottleneck,
    pipeline_note,
    step_line,
    step_record,
    summary_text,
    worker_stats,
)
from .startup import StartupClock

JOIN_SECONDS = 30.0  # how long workers may take to stop once asked


# A SIGINT this soon after the first is the same Ctrl-C delivered twice: torchrun forwards the
# terminal's to its workers, and `timeout -s INT` signals the process and then its process group.
SIGNAL_ECHO_SECONDS = 2.0


class InterruptHandler:
    """Ctrl-C / SIGTERM: finish the current step, checkpoint, exit. A second Ctrl-C (not its echo,
    see SIGNAL_ECHO_SECONDS) aborts. Installed only in the main thread (signals can only be
    handled there)."""

    def __init__(self, stop: StopSignal):
        self.stop = stop
        self.signal_name: str | None = None  # the first signal received
        self._first_at: float | None = None
        self._previous: dict = {}

    def __enter__(self) -> "InterruptHandler":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            for sig in self._previous:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self.stop.stopped and signum == signal.SIGINT:
            if self._first_at is not None and now - self._first_at <= SIGNAL_ECHO_SECONDS:
                return
            raise KeyboardInterrupt
        self._first_at = self._first_at if self._first_at is not None else now
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping after the current step and saving a checkpoint (Ctrl-C again to abort)",
              file=sys.stderr)
        self.signal_name = self.signal_name or name
        self.stop.stop(f"interrupted by {name}")

    def __exit__(self, *_exc) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)


@dataclass
class _Health:
    steps: int = 0
    skipped: int = 0
    skipped_in_a_row: int = 0
    zero_in_a_row: int = 0


class HealthWatch:
    """Stops a run whose steps stopped teaching its drafter anything. With limit K
    (--stop-after-bad-steps, 0 = never), a drafter fails when
      - K steps in a row were skipped for non-finite gradients (the run diverged), or
      - K steps in a row had a gradient norm of exactly 0 (the gradients collapsed), or
      - more than half of its steps were skipped, once it ran 2K steps (or at its end).
    """

    def __init__(self, limit: int, names: list[str]):
        self.limit = limit
        self.state = {name: _Health() for name in names}
        self.prefix = {name: f"{name}: " if len(names) > 1 else "" for name in names}

    def after_step(self, name: str, record: dict) -> str | None:
        state = self.state[name]
        state.steps += 1
        skipped = bool(record["skipped"])
        state.skipped += skipped
        state.skipped_in_a_row = state.skipped_in_a_row + 1 if skipped else 0
        state.zero_in_a_row = state.zero_in_a_row + 1 if not skipped and record["grad_norm"] == 0.0 else 0
        if not self.limit:
            return None
        step, limit, prefix = record["step"], self.limit, self.prefix[name]
        if state.skipped_in_a_row >= limit:
            return (f"{prefix}{limit} steps in a row (up to step {step}) had non-finite gradients and were skipped: "
                    "the run diverged (lower --lr, check the data, or resume from an earlier checkpoint)")
        if state.zero_in_a_row >= limit:
            return (f"{prefix}the gradient norm was 0 for {limit} steps in a row (up to step {step}): nothing reaches "
                    "the drafter (check the target's LM head and the loss mask of the data)")
        if state.steps >= 2 * limit:
            return self._mostly_skipped(name)
        return None

    def at_end(self, name: str) -> str | None:
        return self._mostly_skipped(name) if self.limit else None

    def _mostly_skipped(self, name: str) -> str | None:
        state = self.state[name]
        if state.skipped * 2 > state.steps:
            return (f"{self.prefix[name]}{state.skipped} of {state.steps} steps had non-finite gradients and were "
                    "skipped: the run diverged (lower --lr, check the data)")
        return None


class Coordinator:
    def __init__(self, run: Run, pipeline: Pipeline, sinks: list[Sink]):
        self.config = config = run.config
        self.plans = plans = run.plans
        self.pipeline = pipeline
        self.steps = steps = run.steps
        self.sinks = sinks
        self.log = log = run.log
        self.stop = pipeline.stop
        self.nodes = run.nodes
        self.stats = {plan.name: RunningStats() for plan in plans}
        node_totals = 1 if self.nodes.distributed else 0  # one NodeTotals per step besides the replicas' reports
        self.assembler = StepAssembler({plan.name: len(plan.devices) + node_totals for plan in plans})
        self.progress = Progress(len(steps), "train", stream=log if log is not sys.stdout else sys.stderr)
        self.queue_depth_sum = 0.0
        self.queue_samples = 0
        self.started = time.monotonic()
        self.interrupts = InterruptHandler(interrupt_target(self.nodes, self.stop))
        self.health = HealthWatch(config.optimizer.stop_after_bad_steps, [plan.name for plan in plans])
        self.failure: str | None = None  # why the health watch stopped the run
        self.clock = StartupClock(pipeline.warmup)

    # --- run -------------------------------------------------------------------------------------

    def run(self) -> dict:
        threads_before = torch.get_num_threads()
        threads = cpu_threads_per_worker(self.pipeline)
        if threads is not None:
            torch.set_num_threads(threads)
        self.started = time.monotonic()
        try:
            with self.interrupts:
                for worker in self.pipeline.workers:
                    worker.start()
                self._report_loop()
        except BaseException as error:
            # The workers must not outlive a failed train(): stop them (they save their last
            # completed step) and wait, then let the error go.
            self.stop.stop(f"the coordinator failed: {type(error).__name__}: {error}")
            wait_for_workers(self.pipeline.workers, self.stop, timeout=JOIN_SECONDS)
            raise
        finally:
            torch.set_num_threads(threads_before)
            self.pipeline.logged.close()
            for sink in self.sinks:
                sink.close()
        self.stop.stop("finished")
        hung = wait_for_workers(self.pipeline.workers, self.stop, timeout=JOIN_SECONDS)
        if self.nodes.writes:
            self.progress.close()
        if hung:
            raise RuntimeError(f"workers did not stop within {JOIN_SECONDS:.0f} s after the pipeline stopped: "
                               f"{', '.join(hung)}")
        return self.finish()

    def _report_loop(self) -> None:
        """Until every drafter thread has exited and its last report was read (a report is
        queued before its thread can exit, so none is left behind)."""
        drafters = self.pipeline.drafter_workers
        while True:
            alive = any(w.is_alive() for w in drafters)
            try:
                # Once every drafter has exited, what they queued last (the final NodeTotals of a
                # multi-node run come from the last vote) is still read, without waiting.
                report = self.pipeline.reports.get(timeout=0.2) if alive else self.pipeline.reports.get_nowait()
            except queue.Empty:
                if not alive:
                    self._report_steps_without_totals()
                    return
                report = None
            self.queue_depth_sum += self.pipeline.router.mean_depth()
            self.queue_samples += 1
            if report is None:
                continue
            complete = self.assembler.add(report)
            if complete is not None:
                self.report_step(complete)

    def _report_steps_without_totals(self) -> None:
        """A node lost before the vote that sums a step over the nodes: the step's line is still
        written, with this node's sums (`this_node_only`), since its checkpoint may be the one a
        resume continues from, and the resumed log would otherwise lack that step for good."""
        if self.nodes.distributed:
            for reports in self.assembler.awaiting_totals():
                self.report_step(reports, this_node_only=True)

    # --- report ----------------------------------------------------------------------------------

    def report_step(self, reports, this_node_only: bool = False) -> None:
        name = reports[0].drafter
        many = len(self.plans) > 1
        record = step_record(reports, time.monotonic() - self.started)
        if this_node_only:
            record["this_node_only"] = True
        self.stats[name].add(record)
        if not self.nodes.writes:
            return
        measured = next((r.evaluation for r in reports if isinstance(r, StepReport) and r.evaluation), None)
        if measured:
            self.progress.print(eval_line(record, measured, name if many else None))
        first = name == self.plans[0].name
        if first:
            startup = self.clock.observe(record, self.compiles)
            if startup:
                self.progress.print(startup)
        for sink in self.sinks:
            sink.write_step(name, record)
        self.pipeline.logged.mark(name, record["step"])
        self._watch_health(self.health.after_step(name, record))
        if first:
            self.progress.update(1, note=f"loss {record['loss']:.3f} acc {record['accuracy']:.3f}")
        step = record["step"]
        if step % self.config.logging.log_every == 0 or step == self.steps.end:
            elapsed = time.monotonic() - self.started
            eta = (self.steps.end - step) * elapsed / max(1, step - self.steps.start)
            depth = self.mean_queue_depth()
            workers = self.pipeline.workers
            limit = pipeline_bottleneck(workers, depth, self.config.parallel.prefetch)
            self.progress.print(step_line(record, name if many else None, self.config.optimizer.steps, eta)
                                + pipeline_note(workers, depth, limit, self.pipeline.gate))
            if first:
                pipeline_record = {"step": step, "elapsed_s": round(elapsed, 2), "mean_queue_depth": round(depth, 3),
                                   "workers": worker_stats(workers, self.pipeline.gate), "bottleneck": limit.label,
                                   "bottleneck_detail": limit.detail, "compiles": self.compile_snapshot()}
                for sink in self.sinks:
                    sink.write_pipeline(pipeline_record)

    def _watch_health(self, verdict: str | None) -> None:
        if verdict and self.failure is None:
            self.failure = verdict
            self.progress.print(f"stopping: {verdict}")
            self.stop.stop(f"failed: {verdict}")

    @property
    def compiles(self) -> int:
        """Compiles so far (warm-up included); 0 when nothing compiles."""
        return self.pipeline.gate.compiles if self.pipeline.gate is not None else 0

    def compile_snapshot(self) -> dict:
        return self.pipeline.gate.snapshot() if self.pipeline.gate is not None else {}

    def mean_queue_depth(self) -> float:
        return self.queue_depth_sum / max(1, self.queue_samples)

    # --- finish ----------------------------------------------------------------------------------

    def finish(self) -> dict:
        error = self.stop.error()
        for plan in self.plans:
            self._watch_health(self.health.at_end(plan.name))
        elapsed = time.monotonic() - self.started
        pipeline = self.pipeline
        summary = {
            "steps_done": {p.name: pipeline.rank0(p).completed_step for p in self.plans},
            "stop_reason": self.stop.reason,
            "interrupted_by": self.interrupts.signal_name,
            "elapsed_s": round(elapsed, 2),
            "drafters": {},
            "workers": worker_stats(pipeline.workers, pipeline.gate),
            "mean_queue_depth": round(self.mean_queue_depth(), 2),
            "gradient_sync_s": round(sum(r.seconds for r in pipeline.reducers), 2),
            **self.nodes_summary(),
            "compiles": self.compile_snapshot(),
            "startup": self.clock.summary(),
            "bottleneck": str(pipeline_bottleneck(pipeline.workers, self.mean_queue_depth(), self.config.parallel.prefetch)),
        }
        for plan in self.plans:
            rank0 = pipeline.rank0(plan)
            stats = self.stats[plan.name]
            tail = stats.history[-min(50, len(stats.history)):]
            entry = {
                "run_dir": str(plan.run_dir),
                "checkpoint": str(rank0.last_checkpoint) if rank0.last_checkpoint else None,
                "samples_per_s": round(stats.samples / elapsed, 3) if elapsed > 0 else None,
                "skipped_steps": stats.skipped,
            }
            if tail:
                entry.update({k: round(sum(r[k] for r in tail) / len(tail), 4) for k in ("loss", "accuracy", "tau_sim")})
                entry["first_loss"] = stats.history[0]["loss"]
            measured = [r for r in stats.history if "tau_real" in r]
            if measured:
                entry["tau_real"] = {"step": measured[-1]["step"], "tau": measured[-1]["tau_real"],
                                     "tau_pooled": measured[-1]["tau_real_pooled"]}
            finished = error is None and self.failure is None and rank0.completed_step >= self.config.optimizer.steps
            if finished and self.config.checkpoint.export_dtype and self.nodes.writes:
                weights = trained_weights(rank0.replica.drafter, rank0.replica.optimizer)
                bad = [name for name, tensor in weights.items() if not bool(torch.isfinite(tensor).all())]
                if bad:
                    self._watch_health(f"{plan.name}: weights are not finite after step {rank0.completed_step} "
                                       f"({', '.join(bad[:3])}): not exported")
                else:
                    entry["export"] = str(self.export(plan, rank0.replica.drafter.config, weights))
            summary["drafters"][plan.name] = entry
        if self.failure is not None:
            summary["stop_reason"] = f"failed: {self.failure}"
        if self.nodes.writes:
            write_json_atomic(Path(self.config.checkpoint.out) / "summary.json", summary, indent=2)
        print(summary_text(summary, self.config.optimizer.steps), file=self.log)
        self.nodes.finish()
        if error is not None:
            raise error
        if self.failure is not None:
            kept = ", ".join(str(self.pipeline.rank0(p).last_checkpoint) for p in self.plans
                             if self.pipeline.rank0(p).last_checkpoint)
            raise RunFailed(f"{self.failure}; kept: {kept or 'no checkpoint'}")
        return summary

    def nodes_summary(self) -> dict:
        if not self.nodes.distributed:
            return {}
        timers = [r.across.timer for r in self.pipeline.reducers if r.across is not None]
        seconds = sum(t.seconds for t in timers)
        count = sum(t.count for t in timers)
        return {"nodes": self.nodes.world_size, "rank": self.nodes.rank, "cross_node_all_reduce_s": round(seconds, 3),
                "cross_node_all_reduce_ms_per_step": round(1000 * seconds / count, 3) if count else None}

    def export(self, plan: DrafterPlan, drafter_config: DrafterConfig, weights: dict[str, torch.Tensor]) -> Path:
        return export_drafter(drafter_config, weights, plan.run_dir / "export",
                              dtype=dtype_from_name(self.config.checkpoint.export_dtype, "cpu"),
                              run_dir=plan.run_dir, force=True, log=self.log)  # OUT/export belongs to the run


def wait_for_workers(workers: list[Worker], stop: StopSignal, timeout: float) -> list[str]:
    """Join workers; returns the names of those still alive after `timeout` seconds of stop."""
    deadline = None
    while True:
        alive = [w for w in workers if w.is_alive()]
        if not alive:
            return []
        if stop.stopped and deadline is None:
            deadline = time.monotonic() + timeout
        if deadline is not None and time.monotonic() > deadline:
            return [w.name for w in alive]
        alive[0].join(POLL_SECONDS)
