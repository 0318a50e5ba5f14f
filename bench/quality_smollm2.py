"""The SmolLM2 bar run (docs/RESULTS.md): train a drafter for SmolLM2-135M-Instruct on the regenerated data, then
measure tau by speculative decoding on HumanEval and MT-Bench, its speed-up over target-only
decoding, and a tau-vs-steps curve, all in one call of a lent GPU machine.

Recipe of the bar (SpecForge's run, docs/RESULTS.md): 5 layers, block 16, target layers [1, 8, 14, 20, 27], mask
token 16, batch 8, max length 768, 256 anchors, gamma 7, AdamW lr 6e-4, 4% warm-up, cosine,
clip 1.0, rows with >= 32 supervised tokens. A wall-clock guard stops training gracefully
(checkpoint, then export) if the step budget would overrun the machine's time.

Training runs on one GPU (--device). Decoding at batch 1 is launch-bound, so evaluation is
sharded: `dflash-train eval --offset O --limit N` subprocesses, --eval-procs-per-device of them
on each of --eval-devices, merged afterwards (`merge_eval_results`). Checkpoints saved every
--curve-every steps are exported and evaluated on the first --curve-limit prompts (no
baseline); while training runs, those curve shards use only the eval devices other than the
training device. A shard that fails is reported (with the end of its log) and the others go
on; at --deadline-seconds whatever still runs is stopped and what finished is merged.

    python3 bench/quality_smollm2.py --gguf smol.gguf --data smollm2-regenerated-4000.jsonl.gz \\
        --out /tmp/q --steps 1500 --train-seconds 240 --device cuda:0 --curve-every 250 \\
        --eval-devices cuda:0,cuda:1 --eval-procs-per-device 12 --eval-limit 40 --curve-limit 20 \\
        --mtbench-every-other --json-dir $OUT

Writes to --json-dir: train_summary.json, eval.json (merged, per prompt), curve.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_train.target.gguf import hf_folder_from_gguf  # noqa: E402
from dflash_train.target.model import resolve_device  # noqa: E402

from dflash_train.cli import main as cli_main  # noqa: E402
from dflash_train.config import DECODERS, FP8_CHOICES, TrainConfig  # noqa: E402
from dflash_train.eval.benchmarks import bench_label, load_benchmark  # noqa: E402
from dflash_train.eval.merge import MergeError, merge_eval_results  # noqa: E402
from dflash_train.eval.stats import PromptResult, format_benchmark, format_summary, summarize  # noqa: E402
from dflash_train.train.checkpoint import STATE_FILE, read_state  # noqa: E402
from dflash_train.train.trainer import train  # noqa: E402

FINAL = "final"


def say(message: str) -> None:
    print(f"[quality] {message}", flush=True)


def device_name(name: str) -> str:
    """One spelling per device ("cuda" and "cuda:0" are the same GPU), so slots can be matched
    against the training device."""
    device = resolve_device(name)
    return f"cuda:{device.index or 0}" if device.type == "cuda" else str(device)


# ---------------------------------------------------------------------------------------------
# Sharded evaluation in subprocesses
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ShardJob:
    group: str  # "final" or the checkpoint's name ("step-00000250"): shards of one group merge
    drafter: str
    offset: int
    limit: int
    baseline: bool
    priority: int  # lower starts first
    json_path: Path
    log_path: Path
    status: str = "pending"  # pending, running, ok, failed, killed, not run
    device: str = ""
    started: float = 0.0
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.group}-o{self.offset:03d}"


class ShardRunner:
    """Runs `dflash-train eval` shard subprocesses, at most one per slot; a slot is one place on
    one device. Not thread-safe: one thread at a time calls `submit` and `poll` (the checkpoint
    watcher during training, the main thread after it)."""

    def __init__(self, slot_devices: list[str], eval_args: list[str], deadline: float):
        self.slots: list[tuple[str, ShardJob | None, subprocess.Popen | None]] = [(d, None, None) for d in slot_devices]
        self.eval_args = eval_args
        self.deadline = deadline
        self.jobs: list[ShardJob] = []
        self.blocked_devices: set[str] = set()

    def submit(self, job: ShardJob) -> None:
        job.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.jobs.append(job)

    @property
    def idle(self) -> bool:
        return not any(job.status in ("pending", "running") for job in self.jobs)

    def poll(self) -> None:
        """Reap finished shards, stop everything at the deadline, start pending shards on free slots."""
        for index, (device, job, process) in enumerate(self.slots):
            if process is not None and process.poll() is not None:
                self._finish(job, process.returncode)
                self.slots[index] = (device, None, None)
        if time.monotonic() > self.deadline:
            self.stop("deadline reached")
            return
        pending = sorted((j for j in self.jobs if j.status == "pending"), key=lambda j: j.priority)
        for index, (device, job, _) in enumerate(self.slots):
            if job is None and device not in self.blocked_devices and pending:
                self._start(index, pending.pop(0))

    def wait(self, poll_seconds: float = 0.5) -> None:
        while not self.idle:
            self.poll()
            time.sleep(poll_seconds)

    def stop(self, reason: str) -> None:
        """Kill the shards still running (each by its own process) and drop the pending ones."""
        for index, (device, job, process) in enumerate(self.slots):
            if process is not None:
                process.kill()
                process.wait()
                job.status, job.seconds = "killed", time.monotonic() - job.started
                say(f"shard {job.name} on {device} stopped after {job.seconds:.0f}s: {reason}")
                self.slots[index] = (device, None, None)
        for job in self.jobs:
            if job.status == "pending":
                job.status = "not run"
        skipped = sum(job.status == "not run" for job in self.jobs)
        if skipped:
            say(f"{skipped} shard(s) not started: {reason}")

    def _start(self, index: int, job: ShardJob) -> None:
        device = self.slots[index][0]
        command = [
            sys.executable, "-m", "dflash_train.cli", "eval", *self.eval_args, "--drafter", job.drafter,
            "--offset", str(job.offset), "--limit", str(job.limit), "--device", device, "--json", str(job.json_path),
            "--baseline" if job.baseline else "--no-baseline",
        ]
        # One intra-op thread each: many decoders share the cores, and batch-1 decoding gains
        # nothing from more threads (on a GPU the CPU side only launches kernels).
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        job.json_path.unlink(missing_ok=True)  # a stale file from an earlier run must not pass as this shard's
        with open(job.log_path, "w") as log:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        job.status, job.device, job.started = "running", device, time.monotonic()
        self.slots[index] = (device, job, process)

    def _finish(self, job: ShardJob, returncode: int) -> None:
        job.seconds = time.monotonic() - job.started
        done = sum(j.status in ("ok", "failed") for j in self.jobs) + 1
        where = f"{job.device}, prompts {job.offset}..{job.offset + job.limit - 1}"
        try:
            # `eval` exits 1 when some prompts failed but still writes every prompt's record.
            benchmarks = json.loads(job.json_path.read_text())["benchmarks"]
        except (OSError, ValueError, KeyError):
            job.status = "failed"
            tail = job.log_path.read_text(errors="replace").splitlines()[-15:] if job.log_path.is_file() else []
            say(f"shard {job.name} ({where}) FAILED with exit code {returncode} after {job.seconds:.0f}s "
                f"[{done}/{len(self.jobs)}]; end of {job.log_path}:\n    " + "\n    ".join(tail))
            return
        job.status = "ok"
        taus = ", ".join(f"{name} tau {_fmt(b['summary']['tau_mean'])}" for name, b in benchmarks.items())
        errors = sum(b["summary"]["errors"] for b in benchmarks.values())
        say(f"shard {job.name} ({where}) done in {job.seconds:.0f}s [{done}/{len(self.jobs)}]: {taus}"
            + (f", {errors} prompt(s) FAILED (see {job.log_path})" if errors else ""))

    def finished_shards(self, group: str) -> list[Path]:
        return [job.json_path for job in self.jobs if job.group == group and job.status == "ok"]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs:
            counts[job.status] = counts.get(job.status, 0) + 1
        return counts


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def shard_jobs(group: str, drafter: str, prompts: int, per_shard: int, *, baseline: bool, priority: int,
               shard_dir: Path) -> list[ShardJob]:
    return [
        ShardJob(group, drafter, offset, min(per_shard, prompts - offset), baseline, priority,
                 shard_dir / f"{group}-o{offset:03d}.json", shard_dir / f"{group}-o{offset:03d}.log")
        for offset in range(0, prompts, per_shard)
    ]


# ---------------------------------------------------------------------------------------------
# Checkpoints of the curve
# ---------------------------------------------------------------------------------------------


class CurveCheckpoints:
    """Exports each checkpoint of the curve once it is complete on disk and queues its shards.
    During training a thread calls `scan` and `runner.poll` every second."""

    def __init__(self, run_dir: Path, export_dir: Path, every: int, last_step: int, since: float,
                 submit_shards: Callable[[int, Path], None]):
        self.run_dir, self.export_dir, self.every, self.last_step, self.since = run_dir, export_dir, every, last_step, since
        self.submit_shards = submit_shards
        self.exported: dict[int, Path] = {}

    def scan(self, exclude_step: int | None = None) -> None:
        for checkpoint in sorted((self.run_dir / "checkpoints").glob("step-*")):
            if not (checkpoint / STATE_FILE).is_file():
                continue  # still being written
            state = read_state(checkpoint)
            step = int(state["step"])
            if step in self.exported or step % self.every or step >= self.last_step or step == exclude_step:
                continue
            if state.get("time", 0) < self.since:
                continue  # left over from an earlier run in the same folder
            out = self.export_dir / checkpoint.name
            if cli_main(["export", str(checkpoint), "--out", str(out)]) != 0:
                say(f"export of {checkpoint} failed; the curve will miss step {step}")
                self.exported[step] = out
                continue
            self.exported[step] = out
            self.submit_shards(step, out)


def watch_during_training(curve: CurveCheckpoints, runner: ShardRunner, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            curve.scan()
            runner.poll()
        except Exception as error:  # the watcher must never take the training down with it
            say(f"curve watcher: {type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def curve_point(step: int, payload: dict[str, Any], ids_by_bench: dict[str, list[str]]) -> dict[str, Any]:
    """τ of the prompts in `ids_by_bench` among a merged payload's records: the final eval
    covers the curve's prompts too, so its records give the curve's last point."""
    known = {f.name for f in dataclasses.fields(PromptResult)}
    keys = ("prompts", "errors", "tau_mean", "tau_median", "tau_pooled", "steps")
    benchmarks = {}
    for name, ids in ids_by_bench.items():
        wanted = set(ids)
        records = payload["benchmarks"].get(name, {}).get("prompts", [])
        results = [PromptResult(**{k: v for k, v in r.items() if k in known}) for r in records if r["id"] in wanted]
        summary = summarize(results, payload["block_size"])
        benchmarks[name] = {k: summary[k] for k in keys}
    return {"step": step, "benchmarks": benchmarks}


def merge_group(runner: ShardRunner, group: str) -> dict[str, Any] | None:
    shards = runner.finished_shards(group)
    if not shards:
        return None
    try:
        return merge_eval_results(shards)
    except MergeError as error:
        say(f"cannot merge the shards of {group}: {error}")
        return None


def summary_lines(train_result: dict[str, Any], evaluation: dict[str, Any] | None, curve: list[dict[str, Any]],
                  runner: ShardRunner, expected: dict[str, int], settings: str) -> list[str]:
    entry = train_result["entry"]
    training = (
        f"training: {train_result['steps']} steps, {train_result['loop_seconds']:.1f}s of training loop"
        f" ({train_result['seconds']:.1f}s with loading the target and data; {train_result['stop_reason']});"
        f" accuracy {_fmt(entry.get('accuracy'), 3)}, simulated tau {_fmt(entry.get('tau_sim'))} (means of the last 50 steps)"
    )
    lines = ["=" * 96, training, f"eval: {settings}"]
    if evaluation is None:
        lines.append("  no final evaluation shard finished")
    else:
        summaries = {name: bench["summary"] for name, bench in evaluation["benchmarks"].items()}
        lines += ["  " + line for line in format_summary(summaries)]
        for name, s in summaries.items():
            missing = expected.get(name, 0) - s["prompts"]
            lines.append(
                f"  {name}: tau mean/median/pooled {_fmt(s['tau_mean'])}/{_fmt(s['tau_median'])}/{_fmt(s['tau_pooled'])}"
                f", decode speed-up {_fmt(s.get('decode_speedup'))}x"
                + (f", identical to target-only {s['identical_to_baseline']}/{s['compared']}" if "compared" in s else "")
                + (f", {s['errors']} prompt(s) FAILED" if s["errors"] else "")
                + (f", {missing} prompt(s) MISSING (shard failed or not run)" if missing > 0 else "")
            )
    if curve:
        names = list(curve[0]["benchmarks"])
        lines.append("curve (tau mean / pooled on the curve prompts):")
        lines.append("  " + f"{'step':>6}" + "".join(f"{name[:22]:>24}" for name in names))
        for point in curve:
            cells = []
            for name in names:
                b = point["benchmarks"].get(name)
                cells.append(f"{_fmt(b['tau_mean'])} / {_fmt(b['tau_pooled'])} ({b['prompts']})" if b else "n/a")
            lines.append("  " + f"{point['step']:>6}" + "".join(f"{c:>24}" for c in cells))
    counts = runner.counts()
    lines.append("shards: " + ", ".join(f"{count} {status}" for status, count in sorted(counts.items())))
    lines.append("=" * 96)
    return lines


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def quality_config(target_dir: str, data: str, out: str, *, steps: int, device: str, buckets: list[int] | None = None,
                   fp8: str = "off", cuda_graphs: str = "auto", smoke: bool = False, **values: Any) -> TrainConfig:
    """The bar recipe as a TrainConfig (also what bench/graphed_step.py times)."""
    config = TrainConfig(
        target=target_dir, data=[data], out=out, steps=steps, batch_size=8, max_seq_len=768,
        seq_buckets=[768] if buckets is None else buckets, min_supervised_tokens=32, block_size=16,
        num_layers=5, num_anchors=256, mask_token_id=16, gamma=7.0, lr=6e-4, warmup_ratio=0.04, clip_grad=1.0,
        device=device, fp8=fp8, cuda_graphs=cuda_graphs, **{"log_every": 100, **values},
    )
    if smoke:
        # The given buckets up to the smoke length (auto stays auto: 128, 192, 256).
        smoke_buckets = ([b for b in config.data.seq_buckets if b <= 256] or [256]) if config.data.seq_buckets else []
        config = config.replace(batch_size=2, num_anchors=8, num_layers=1, max_seq_len=256, seq_buckets=smoke_buckets,
                                min_supervised_tokens=8, log_every=min(config.logging.log_every, 5))
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True, help="run folder: checkpoints, exports, shard files and logs")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--train-seconds", type=float, default=300.0, help="stop training (gracefully) after this")
    parser.add_argument("--device", default="auto", help="the one device training runs on")
    parser.add_argument("--buckets", default="768")
    parser.add_argument("--bench", default="humaneval,mtbench")
    parser.add_argument("--mtbench-every-other", action="store_true",
                        help="MT-Bench as the bar measures it: first turns of every other question (81, 83, ...)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--decoder", default="auto", choices=DECODERS, help="`dflash-train eval --decoder`")
    parser.add_argument("--eval-limit", type=int, default=20, help="final drafter: prompts 0..N-1 of each benchmark")
    parser.add_argument("--eval-devices", default="", help="comma-separated; default: --device")
    parser.add_argument("--eval-procs-per-device", type=int, default=1, help="concurrent eval subprocesses per device")
    parser.add_argument("--eval-shard-prompts", type=int, default=0,
                        help="prompts of each benchmark per final-eval subprocess; 0 = spread over every slot")
    parser.add_argument("--curve-every", type=int, default=0, help="save, export and evaluate a checkpoint every K steps (0 = no curve)")
    parser.add_argument("--curve-limit", type=int, default=10, help="curve: prompts 0..N-1 of each benchmark, no baseline")
    parser.add_argument("--curve-shard-prompts", type=int, default=5, help="prompts of each benchmark per curve subprocess")
    parser.add_argument("--curve-during-training", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate curve checkpoints on the eval devices other than --device while training runs")
    parser.add_argument("--deadline-seconds", type=float, default=570.0,
                        help="from the start: stop shards still running, merge what finished")
    parser.add_argument("--fp8", default="off", choices=FP8_CHOICES, help="`train --fp8`")
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"], help="`train --cuda-graphs`")
    parser.add_argument("--arch", default="dflash", choices=["dflash", "dflash2"], help="`train --arch`")
    parser.add_argument("--selector-miss", default="drop", choices=["drop", "insert"], help="`train --selector-miss` (dflash2)")
    parser.add_argument("--json-dir", default="")
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny settings (1-layer drafter, batch 2, <= 24 new tokens), to check the script on a CPU")
    args = parser.parse_args(argv)
    for name in ("steps", "eval_limit", "eval_procs_per_device", "curve_limit", "curve_shard_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.curve_every < 0 or args.eval_shard_prompts < 0:
        parser.error("--curve-every and --eval-shard-prompts must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.deadline_seconds
    # Backstop for a hang outside the shards (the deadline handles the shards themselves).
    faulthandler.dump_traceback_later(args.deadline_seconds + 25, exit=True)
    out = Path(args.out)
    json_dir = Path(args.json_dir or args.out)
    json_dir.mkdir(parents=True, exist_ok=True)
    shard_dir = out / "eval_shards"
    if args.smoke:
        args.max_new_tokens = min(args.max_new_tokens, 24)

    # --- prompts: resolved before anything slow, so a typo fails at once ----------------------
    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    if args.mtbench_every_other:
        every_other = out / "mtbench_odd.jsonl"  # the label is the file name: odd question ids 81, 83, ..., 159
        out.mkdir(parents=True, exist_ok=True)
        with open(every_other, "w") as handle:
            handle.writelines(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in load_benchmark("mtbench")[::2])
        benches = [str(every_other) if b.lower() in ("mtbench", "mt-bench", "mt_bench") else b for b in benches]
    prompt_ids = {bench_label(b): [p.id for p in load_benchmark(b)] for b in benches}
    eval_prompts = min(args.eval_limit, max(len(ids) for ids in prompt_ids.values()))
    curve_prompts = min(args.curve_limit, max(len(ids) for ids in prompt_ids.values()))
    expected = {name: len(ids[:eval_prompts]) for name, ids in prompt_ids.items()}
    curve_ids = {name: ids[:curve_prompts] for name, ids in prompt_ids.items()}

    target_dir = hf_folder_from_gguf(args.gguf, cache_dir=args.cache_dir or None)
    say(f"target folder {target_dir} ({time.monotonic() - started:.0f}s)")

    train_device = device_name(args.device)
    eval_devices = [device_name(d) for d in (args.eval_devices or args.device).split(",") if d.strip()]
    slot_devices = [d for _ in range(args.eval_procs_per_device) for d in eval_devices]  # devices interleaved
    eval_args = ["--target", str(target_dir), "--bench", ",".join(benches), "--max-new-tokens", str(args.max_new_tokens),
                 "--decoder", args.decoder]
    runner = ShardRunner(slot_devices, eval_args, deadline)

    curve_groups: dict[int, str] = {}

    def submit_curve(step: int, export: Path) -> None:
        group = f"step-{step:08d}"
        curve_groups[step] = group
        for job in shard_jobs(group, str(export), curve_prompts, args.curve_shard_prompts, baseline=False,
                              priority=1, shard_dir=shard_dir):
            runner.submit(job)
        say(f"checkpoint step {step} exported; {curve_prompts} prompt(s) per benchmark queued for the curve")

    # --- training ----------------------------------------------------------------------------
    curve_every = args.curve_every or args.steps + 1  # past the last step: no intermediate checkpoint
    config = quality_config(
        str(target_dir), args.data, str(out), steps=args.steps, device=train_device,
        buckets=[int(b) for b in args.buckets.split(",")], fp8=args.fp8, cuda_graphs=args.cuda_graphs, smoke=args.smoke,
        save_every=min(curve_every, args.steps),
        keep_checkpoints=args.steps // curve_every + 2,  # every curve checkpoint stays until it is exported
        arch=args.arch, selector_miss=args.selector_miss,
    )
    curve = CurveCheckpoints(out, out / "curve_exports", curve_every, args.steps, time.time(), submit_curve)
    runner.blocked_devices = {train_device}
    watcher_stop = threading.Event()
    watcher = None
    if args.curve_every and args.curve_during_training and set(eval_devices) - {train_device}:
        watcher = threading.Thread(target=watch_during_training, args=(curve, runner, watcher_stop), daemon=True)
        watcher.start()
        say(f"curve checkpoints are evaluated on {', '.join(sorted(set(eval_devices) - {train_device}))} while training runs")

    train_started = time.monotonic()

    def time_guard(worker, step):
        if time.monotonic() - train_started > args.train_seconds:
            worker.stop_signal.stop(f"time budget of {args.train_seconds:.0f}s reached at step {step + 1}")

    try:
        summary = train(config, step_hook=time_guard)
    except BaseException:
        watcher_stop.set()
        if watcher is not None:
            watcher.join()
        runner.stop("training failed")
        raise
    train_seconds = time.monotonic() - train_started
    watcher_stop.set()
    if watcher is not None:
        watcher.join()
    final_step = int(summary["steps_done"]["drafter"])
    entry = summary["drafters"]["drafter"]
    export = entry.get("export")
    if not export:  # stopped by the time guard: the trainer exports only a finished run
        export = str(out / "export")
        cli_main(["export", str(out), "--out", export])
    say(f"trained {final_step} steps in {train_seconds:.0f}s; export {export} ({time.monotonic() - started:.0f}s)")
    (json_dir / "train_summary.json").write_text(json.dumps(
        {"train_summary": summary, "train_seconds": round(train_seconds, 1)}, indent=2))

    # --- evaluation ----------------------------------------------------------------------------
    runner.blocked_devices = set()
    per_shard = args.eval_shard_prompts or math.ceil(eval_prompts / len(slot_devices))
    for job in shard_jobs(FINAL, export, eval_prompts, per_shard, baseline=True, priority=0, shard_dir=shard_dir):
        runner.submit(job)
    if args.curve_every:
        curve.scan(exclude_step=final_step)  # checkpoints the watcher has not seen (or no watcher)
        if curve_prompts > eval_prompts:  # the final eval does not cover the curve's prompts
            submit_curve(final_step, Path(export))
    say(f"final eval: {eval_prompts} prompt(s) of {', '.join(prompt_ids)} with the target-only baseline, "
        f"{per_shard} per shard, on {len(slot_devices)} slot(s) over {', '.join(eval_devices)}")
    runner.wait()

    evaluation = merge_group(runner, FINAL)
    if evaluation is not None:
        (json_dir / "eval.json").write_text(json.dumps(evaluation, indent=1) + "\n")
        for name, bench in evaluation["benchmarks"].items():
            print("\n".join(format_benchmark(name, bench["summary"])), flush=True)

    points = []
    for step, group in sorted(curve_groups.items()):
        merged = merge_group(runner, group)
        if merged is not None:
            points.append(curve_point(step, merged, curve_ids))
    if evaluation is not None and final_step not in curve_groups:
        points.append(curve_point(final_step, evaluation, curve_ids))
    if args.curve_every:
        (json_dir / "curve.json").write_text(json.dumps(
            {"curve_prompts": curve_prompts, "prompt_ids": curve_ids, "points": points}, indent=1) + "\n")

    settings = (f"prompts 0..{eval_prompts - 1}, greedy, <= {args.max_new_tokens} new tokens, "
                f"{args.eval_procs_per_device} process(es) per device on {', '.join(eval_devices)} "
                "(timings under that sharing)")
    train_result = {"steps": final_step, "seconds": train_seconds, "loop_seconds": summary["elapsed_s"],
                    "stop_reason": summary["stop_reason"], "entry": entry}
    print("\n".join(summary_lines(train_result, evaluation, points, runner, expected, settings)), flush=True)
    say(f"done in {time.monotonic() - started:.0f}s; wrote {json_dir}")
    failed = runner.counts().get("failed", 0) + runner.counts().get("killed", 0) + runner.counts().get("not run", 0)
    return 1 if evaluation is None or failed else 0


if __name__ == "__main__":
    sys.exit(main())
