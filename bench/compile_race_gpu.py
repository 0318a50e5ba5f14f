"""Proof on real GPUs that threads running compiled flex_attention race without
`dflash_train.pipeline.compile_safety` and do not with it (issue #3, item 1).

K worker threads (spread round-robin over the given devices, so several share a GPU,
as our drafter workers do) share ONE `torch.compile(flex_attention, dynamic=False)` and
for N iterations each: build a block mask eagerly, run the compiled flex forward +
backward (bf16 on CUDA) at a sequence length that changes every iteration (so every
new length is a compile, and threads missing the same length together each compile
it).  Each mode runs in a fresh process of this script (the fixes are process-wide):

    no-fixes   plain torch (only the per-thread compile counter is installed)
    fixes      install_compile_safety() + configure_worker_thread() + build_block_mask()

It prints progress lines, then per mode: error count, error types, compiles and
recompile-limit hits per thread, p50 step time after warm-up (a silent fallback to
flex's unfused eager path shows up here), wall time; `--json` writes the summary.

    python bench/compile_race_gpu.py --devices cuda:0,cuda:1 --threads 6 --iters 40 --json race.json
    python bench/compile_race_gpu.py --device cpu --forward-only --json /tmp/race.json   # CPU smoke test
    python bench/compile_race_gpu.py --no-fixes ...     # only the unfixed mode (also: --fixes)

On torch <= 2.12 the workers race by themselves: a compiling thread's AOTAutograd
(make_fx -> fx Tracer.trace) sets the process-global FX tracing flag, and another
thread's call of the compiled flex then raises "Detected that you are using FX to
symbolically trace a dynamo-optimized function".  (2.13 hides that by accident: its
process-global is_compiling() flag masks the check.)  `--fx-tracer` adds a thread that
runs make_fx in a loop - the same FX activity without dynamo's masking - to provoke it on
any torch.  A watchdog (faulthandler) dumps every thread's stack and exits if a mode
hangs for `--watchdog-s`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("no-fixes", "fixes")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", "--devices", dest="devices", default="cuda",
                        help="'cuda' (every visible GPU), 'cuda:0,cuda:1', or 'cpu'")
    parser.add_argument("--threads", type=int, default=None, help="worker threads, round-robin over devices (6; CPU 3)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per thread (40; CPU 8)")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated sequence lengths, cycled per iteration "
                             "(default 512..4096 on CUDA, 64..160 on CPU)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=128, help="flex BLOCK_SIZE of the masks")
    parser.add_argument("--forward-only", action="store_true", help="no backward (flex backward is not implemented on CPU)")
    parser.add_argument("--no-lockstep", action="store_true",
                        help="threads do not start each iteration together (fewer simultaneous cache misses)")
    parser.add_argument("--fx-tracer", action="store_true", help="add a thread that runs make_fx (FX tracing) in a loop")
    parser.add_argument("--recompile-limit", type=int, default=None,
                        help="recompile limit for the fixes mode (default: recompile_limit_for(lengths, threads))")
    parser.add_argument("--shared-cache", action="store_true",
                        help="reuse the on-disk inductor/triton caches (default: a cold cache per mode, so modes compare)")
    parser.add_argument("--watchdog-s", type=float, default=1800.0)
    parser.add_argument("--max-errors-per-thread", type=int, default=25, help="a thread stops after this many errors")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--no-fixes", action="store_true", help="run only the unfixed mode")
    only.add_argument("--fixes", action="store_true", help="run only the fixed mode")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cpu = args.devices == "cpu"
    args.lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        [64, 96, 128, 160] if cpu else [512, 1024, 1536, 2048, 3072, 4096])
    args.threads = args.threads or (3 if cpu else 6)
    args.iters = args.iters or (8 if cpu else 40)
    args.batch = args.batch or (1 if cpu else 2)
    args.heads = args.heads or (2 if cpu else 16)
    args.head_dim = args.head_dim or (16 if cpu else 128)
    return args


def resolve_devices(spec: str) -> list[torch.device]:
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible; use --device cpu --forward-only for a smoke test")
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device(d) for d in spec.split(",")]


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def traced_function(x: torch.Tensor) -> torch.Tensor:
    # Long enough that the tracing thread is preempted mid-trace (GIL switch interval 5 ms).
    for _ in range(100):
        x = x * 2 + 1
    return x


class Errors:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_type: collections.Counter[str] = collections.Counter()
        self.first_traceback: dict[str, str] = {}

    def add(self, error: BaseException) -> str:
        text = str(error).strip()
        kind = f"{type(error).__name__}: {text.splitlines()[0][:120] if text else ''}"
        with self._lock:
            self.by_type[kind] += 1
            self.first_traceback.setdefault(kind, "".join(traceback.format_exception(error))[-4000:])
        return kind

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.by_type.values())


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode, in this process (a fresh one: the fixes cannot be uninstalled)."""
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from dflash_train.pipeline import compile_safety as cs

    fixed = mode == "fixes"
    devices = resolve_devices(args.devices)
    recompile_limit = args.recompile_limit or cs.recompile_limit_for(len(args.lengths), args.threads)
    report = cs.install_compile_safety(fixes=fixed, recompile_limit=recompile_limit)
    print(f"[{mode}] torch {torch.__version__}, devices {[str(d) for d in devices]}, threads {args.threads}, "
          f"iters {args.iters}, lengths {args.lengths}, {'forward' if args.forward_only else 'forward+backward'}", flush=True)
    print(f"[{mode}] {report}", flush=True)

    build_mask = cs.build_block_mask if fixed else create_block_mask
    flex = torch.compile(flex_attention, dynamic=False)
    errors = Errors()
    stop = threading.Event()
    lockstep = None if args.no_lockstep else threading.Barrier(args.threads)
    warmup_iters = len(args.lengths)
    step_times: dict[str, list[float]] = collections.defaultdict(list)
    iters_done: collections.Counter[str] = collections.Counter()
    started = time.monotonic()

    def worker(index: int) -> None:
        name = threading.current_thread().name
        device = devices[index % len(devices)]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if fixed:
            cs.configure_worker_thread()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        generator = torch.Generator(device=device).manual_seed(index)
        thread_errors = 0
        for iteration in range(args.iters):
            offset = 0 if lockstep is not None else index
            length = args.lengths[(iteration + offset) % len(args.lengths)]
            if lockstep is not None:
                with contextlib.suppress(threading.BrokenBarrierError):  # another thread gave up: go on unsynchronised
                    lockstep.wait(timeout=args.watchdog_s)
            if fixed and iteration == warmup_iters:
                cs.mark_warmup_done(fail_on_recompile=False)
            t0 = time.perf_counter()
            try:
                mask = build_mask(causal, args.batch, None, length, length, device=device, BLOCK_SIZE=args.block_size)
                q, k, v = (
                    torch.randn(args.batch, args.heads, length, args.head_dim, device=device, dtype=dtype,
                                generator=generator, requires_grad=not args.forward_only)
                    for _ in range(3)
                )
                out = flex(q, k, v, block_mask=mask)
                if not args.forward_only:
                    out.float().sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                iters_done[name] += 1
                if iteration >= warmup_iters:
                    step_times[name].append(time.perf_counter() - t0)
            except Exception as error:  # noqa: BLE001 - counting them is the point
                kind = errors.add(error)
                thread_errors += 1
                print(f"[{mode}] {name} iter {iteration} L={length}: {kind}", flush=True)
                if thread_errors >= args.max_errors_per_thread:
                    print(f"[{mode}] {name}: {thread_errors} errors, giving up", flush=True)
                    if lockstep is not None:
                        lockstep.abort()
                    return
            if (iteration + 1) % max(1, args.iters // 5) == 0:
                print(f"[{mode}] {name} {iteration + 1}/{args.iters} iters, {thread_errors} errors, "
                      f"{time.monotonic() - started:.1f}s", flush=True)

    def tracer() -> None:
        # make_fx, as AOTAutograd runs it in a compiling thread (not fx.symbolic_trace, which also
        # patches nn.Module and `math` process-wide: unsafe next to other threads on any torch).
        from torch.fx.experimental.proxy_tensor import make_fx

        example = torch.randn(8)
        while not stop.is_set():
            try:
                make_fx(traced_function)(example)
            except Exception as error:  # noqa: BLE001
                errors.add(error)
            time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(args.threads)]
    extra = [threading.Thread(target=tracer, name="fx-tracer", daemon=True)] if args.fx_tracer else []
    for thread in threads + extra:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    for thread in extra:
        thread.join()
    wall = time.monotonic() - started
    faulthandler.cancel_dump_traceback_later()

    recompiles = {k: v for k, v in cs.recompile_snapshot().items() if k.startswith("worker-")}
    return {
        "mode": mode,
        "torch": torch.__version__,
        "devices": [str(d) for d in devices],
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
        "errors": errors.total,
        "error_types": dict(errors.by_type),
        "first_tracebacks": errors.first_traceback,
        "iters_done": dict(iters_done),
        "recompiles": recompiles,
        "compiles_total": sum(v["compiles"] for v in recompiles.values()),
        "limit_hits_total": sum(v["limit_hits"] for v in recompiles.values()),
        "step_ms_p50_after_warmup": {
            k: round(1000 * statistics.median(v), 2) for k, v in sorted(step_times.items()) if v
        },
        "wall_s": round(wall, 2),
        "report": report.as_dict(),
    }


def print_summary(result: dict[str, Any]) -> None:
    mode = result["mode"]
    print(f"\n=== {mode}: {result['errors']} errors, {result['compiles_total']} compiles, "
          f"{result['limit_hits_total']} recompile-limit hits, wall {result['wall_s']}s", flush=True)
    for kind, count in sorted(result["error_types"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d} x {kind}")
    no_compiles = {"compiles": 0, "after_warmup": 0, "limit_hits": 0}
    for index in range(result["config"]["threads"]):
        name = f"worker-{index}"
        stats = result["recompiles"].get(name, no_compiles)
        p50 = result["step_ms_p50_after_warmup"].get(name)
        print(f"  {name}: {result['iters_done'].get(name, 0)} iters ok, {stats['compiles']} compiles "
              f"({stats['after_warmup']} after warm-up), {stats['limit_hits']} limit hits, "
              f"p50 step {p50 if p50 is not None else '-'} ms")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_mode(args.child, args)
        args.json.write_text(json.dumps(result, indent=2))
        return 0

    modes = ["no-fixes"] if args.no_fixes else ["fixes"] if args.fixes else list(MODES)
    passthrough = list(argv if argv is not None else sys.argv[1:])
    passthrough = _without_option(_without_option(passthrough, "--json", takes_value=True), "--no-fixes", "--fixes")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            child_json = Path(tmp) / f"{mode}.json"
            env = dict(os.environ)
            if not args.shared_cache:
                env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"{mode}-inductor-cache")
                env["TRITON_CACHE_DIR"] = str(Path(tmp) / f"{mode}-triton-cache")
            print(f"--- mode {mode} (fresh process{'' if args.shared_cache else ', cold compile caches'}) ---", flush=True)
            completed = subprocess.run(
                [sys.executable, "-u", __file__, *passthrough, "--child", mode, "--json", str(child_json)],
                check=False,
                env=env,
            )
            if child_json.exists():
                results[mode] = json.loads(child_json.read_text())
            else:
                results[mode] = {"mode": mode, "crashed": True, "returncode": completed.returncode}
                print(f"=== {mode}: process exited with {completed.returncode} before writing results "
                      "(watchdog or crash: see the stacks above)", flush=True)
    for result in results.values():
        if not result.get("crashed"):
            print_summary(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    fixed = results.get("fixes")
    return 0 if fixed is None or (not fixed.get("crashed") and fixed["errors"] == 0) else 1


def _without_option(argv: list[str], *names: str, takes_value: bool = False) -> list[str]:
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in names:
            skip = takes_value
            continue
        if takes_value and any(arg.startswith(f"{n}=") for n in names):
            continue
        kept.append(arg)
    return kept


if __name__ == "__main__":
    sys.exit(main())
