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

It prints progress lines, then per mode: error count (FX-tracing errors apart), error
types, compiles and recompile-limit hits per thread, p50 step time after warm-up (a
silent fallback to flex's unfused eager path shows up here), wall time; `--json` writes
the summary.

    python bench/compile_race_gpu.py --smoke --devices cuda:0,cuda:1 --json race.json   # <= 150 s, 2 lengths
    python bench/compile_race_gpu.py --devices cuda:0,cuda:1 --threads 6 --iters 40 --json race.json
    python bench/compile_race_gpu.py --device cpu --forward-only --smoke --json /tmp/race.json  # CPU smoke, ~100 s
    python bench/compile_race_gpu.py --no-fixes ...     # only the unfixed mode (also: --fixes)

Time.  Compiles are serialised by dynamo's compile lock, and on a cold cache every
thread compiles every length (forward, and backward lazily), so a mode needs about
threads x lengths x (1 + backward) compiles.  The watchdog of each mode scales with that
(`--compile-s` seconds per compile, plus start-up), capped by its share of `--budget-s`
(total for all modes; `--smoke` on CUDA: 150 s).  A mode that runs out of time still
reports: every few seconds, at its watchdog, and when this script is sent SIGTERM (e.g.
by `timeout`), the errors seen so far (FX-tracing RuntimeErrors counted apart), the
compiles started so far, and where each worker thread was, go to the JSON.

Schedules.  By default threads start every iteration together (`lockstep`): they miss
each new length together and each compiles it - the recompile-limit pressure - but they
also pass dynamo's FX-tracing check together, before any of them traces, so the FX-flag
race cannot show between them (nor, in practice, with `--no-lockstep`: a free-running
thread calls the compiled flex once per step, and the make_fx part of a compile is
short).  What shows it is a thread in steady state next to a compiling one, as a
warmed-up drafter next to one that meets a new shape: `--warm-caller` (on with
`--smoke`) adds a thread that calls the compiled flex at the first length in a loop.
On torch <= 2.12 (no is_compiling() masking) its calls during another thread's
AOTAutograd make_fx raise "Detected that you are using FX to symbolically trace a
dynamo-optimized function" (2.11 CPU smoke: 25 of 25 allowed errors without the fixes,
0 in 9530 calls with them).  2.13 hides it by accident: its process-global
is_compiling() flag masks the check.  `--fx-tracer` adds a thread that runs make_fx in
a loop - the same FX activity without dynamo's masking - to provoke it on any torch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import json
import os
import signal
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
FX_TRACING_ERROR = "symbolically trace a dynamo-optimized function"
SNAPSHOT_EVERY_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", "--devices", dest="devices", default="cuda",
                        help="'cuda' (every visible GPU), 'cuda:0,cuda:1', or 'cpu'")
    parser.add_argument("--smoke", action="store_true",
                        help="small defaults: 3 threads, 8 iters, 2 lengths on CUDA (512,1024), --budget-s 150 on CUDA")
    parser.add_argument("--threads", type=int, default=None, help="worker threads, round-robin over devices (6; smoke/CPU 3)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per thread (40; smoke/CPU 8)")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated sequence lengths, cycled per iteration "
                             "(default 512..4096 on CUDA, 512,1024 with --smoke, 64..160 on CPU)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=128, help="flex BLOCK_SIZE of the masks")
    parser.add_argument("--forward-only", action="store_true", help="no backward (flex backward is not implemented on CPU)")
    parser.add_argument("--no-lockstep", action="store_true",
                        help="threads run freely from different lengths (compiles overlap other threads' calls)")
    parser.add_argument("--fx-tracer", action="store_true", help="add a thread that runs make_fx (FX tracing) in a loop")
    parser.add_argument("--warm-caller", action="store_true",
                        help="add a thread that calls the compiled flex at the first length in a loop while the workers "
                             "compile (a warmed-up drafter next to a compiling one; --smoke turns it on)")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend (inductor; aot_eager: compiles that are mostly AOTAutograd's "
                             "make_fx, so the FX-flag window is most of each compile - a quick CPU check)")
    parser.add_argument("--recompile-limit", type=int, default=None,
                        help="recompile limit for the fixes mode (default: recompile_limit_for(lengths, threads))")
    parser.add_argument("--shared-cache", action="store_true",
                        help="reuse the on-disk inductor/triton caches (default: a cold cache per mode, so modes compare)")
    parser.add_argument("--watchdog-s", type=float, default=None,
                        help="per-mode time limit (default: start-up + expected compiles x --compile-s)")
    parser.add_argument("--compile-s", type=float, default=None,
                        help="expected seconds per compile, for the default watchdog (CUDA 8, CPU 6)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="total seconds for all modes: each mode's watchdog is capped by its share")
    parser.add_argument("--max-errors-per-thread", type=int, default=25, help="a thread stops after this many errors")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here (also partial results)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--no-fixes", action="store_true", help="run only the unfixed mode")
    only.add_argument("--fixes", action="store_true", help="run only the fixed mode")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cpu = args.devices == "cpu"
    small = cpu or args.smoke
    if args.lengths:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    else:
        args.lengths = [64, 96, 128, 160] if cpu else [512, 1024] if args.smoke else [512, 1024, 1536, 2048, 3072, 4096]
    args.threads = args.threads or (3 if small else 6)
    args.iters = args.iters or (8 if small else 40)
    args.batch = args.batch or (1 if cpu else 2)
    args.heads = args.heads or (2 if cpu else 16)
    args.head_dim = args.head_dim or (16 if cpu else 128)
    args.compile_s = args.compile_s or (6.0 if cpu else 8.0)
    if args.budget_s is None and args.smoke and not cpu:
        args.budget_s = 150.0
    args.warm_caller = args.warm_caller or args.smoke
    return args


def expected_compiles(args: argparse.Namespace) -> int:
    """Upper bound on a cold cache: every thread compiles every length, forward + backward."""
    return args.threads * len(args.lengths) * (1 if args.forward_only else 2)


def auto_watchdog_s(args: argparse.Namespace) -> float:
    startup = 15.0 if args.devices == "cpu" else 30.0  # imports, CUDA init, install
    return startup + expected_compiles(args) * args.compile_s


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

    def snapshot(self) -> tuple[dict[str, int], dict[str, str]]:
        with self._lock:
            return dict(self.by_type), dict(self.first_traceback)


def write_json(path: Path, data: Any) -> None:
    """Atomically: a reader (the parent, after a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


COMPILE_FRAMES = ("compile_fx_backward", "compile_fx", "aot_", "make_fx", "_compile", "compile_lock")


def where(frames: list[str]) -> str:
    """The innermost frame, and the innermost compile-stage frame if that is another."""
    if not frames:
        return "-"
    stage = next((f for f in frames if f.startswith(COMPILE_FRAMES)), None)
    return frames[0] if stage in (None, frames[0]) else f"{frames[0]}, inside {stage}"


def thread_stacks(names: set[str], depth: int = 60) -> dict[str, list[str]]:
    """Innermost ``depth`` frames (innermost first) of the named live threads."""
    frames = sys._current_frames()
    stacks: dict[str, list[str]] = {}
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if thread.name in names and frame is not None:
            summary = traceback.extract_stack(frame)[::-1][:depth]
            stacks[thread.name] = [
                f"{f.name} ({Path(f.filename).name}:{f.lineno}{': ' + f.line[:60] if i == 0 and f.line else ''})"
                for i, f in enumerate(summary)
            ]
    return stacks


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode, in this process (a fresh one: the fixes cannot be uninstalled).  Writes
    ``args.json`` every few seconds, at the watchdog (then exits 124) and on SIGTERM."""
    faulthandler.enable()  # a crash (SIGSEGV/abort) prints every thread's stack
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from dflash_train.pipeline import compile_safety as cs

    fixed = mode == "fixes"
    devices = resolve_devices(args.devices)
    recompile_limit = args.recompile_limit or cs.recompile_limit_for(len(args.lengths), args.threads)
    report = cs.install_compile_safety(fixes=fixed, recompile_limit=recompile_limit)
    notes: list[str] = []
    if not fixed and torch.cuda._is_compiled() and not torch.cuda.is_available():
        # A CUDA wheel without a GPU (CPU smoke): concurrent first compiles can SIGSEGV in
        # torch._C._ensureCUDADeviceGuardSet (compile_safety's cuda_guard_prime). Not what this
        # benchmark measures, and it would hide the races that it does: primed here too.
        torch._C._ensureCUDADeviceGuardSet()
        notes.append("CUDA build without a GPU: primed the CUDA device guard (its first concurrent use SIGSEGVs)")
    watchdog_s = args.watchdog_s or auto_watchdog_s(args)
    print(f"[{mode}] torch {torch.__version__}, devices {[str(d) for d in devices]}, threads {args.threads}, "
          f"iters {args.iters}, lengths {args.lengths}, {'forward' if args.forward_only else 'forward+backward'}, "
          f"{'free-running' if args.no_lockstep else 'lockstep'}, backend {args.backend}, watchdog {watchdog_s:.0f}s "
          f"(up to {expected_compiles(args)} compiles)", flush=True)
    print(f"[{mode}] {report}", flush=True)
    for note in notes:
        print(f"[{mode}] {note}", flush=True)

    build_mask = cs.build_block_mask if fixed else create_block_mask
    flex = torch.compile(flex_attention, backend=args.backend, dynamic=False)
    errors = Errors()
    stop = threading.Event()
    lockstep = None if args.no_lockstep else threading.Barrier(args.threads)
    warmup_iters = len(args.lengths)
    step_times: dict[str, list[float]] = collections.defaultdict(list)
    iters_done: collections.Counter[str] = collections.Counter()
    worker_names = {f"worker-{i}" for i in range(args.threads)} | {"warm-caller"}
    started = time.monotonic()
    write_lock = threading.RLock()  # save() may run in the SIGTERM handler, on top of the main thread's save()

    def result(status: str) -> dict[str, Any]:
        by_type, first_tracebacks = errors.snapshot()
        recompiles = {k: v for k, v in cs.recompile_snapshot().items() if k.startswith(("worker-", "warm-caller"))}
        data: dict[str, Any] = {
            "mode": mode,
            "status": status,  # finished | running (periodic snapshot) | timed_out | terminated | race_shown
            "partial": status != "finished",
            "timed_out": status == "timed_out",
            "torch": torch.__version__,
            "devices": [str(d) for d in devices],
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
            "watchdog_s": watchdog_s,
            "expected_compiles_max": expected_compiles(args),
            "errors": sum(by_type.values()),
            "fx_tracing_errors": sum(n for kind, n in by_type.items() if FX_TRACING_ERROR in kind),
            "error_types": by_type,
            "first_tracebacks": first_tracebacks,
            "iters_done": dict(iters_done),
            "warm_caller_calls": dict(warm_calls),
            "recompiles": recompiles,
            "compiles_total": sum(v["compiles"] for v in recompiles.values()),  # started, finished or not
            "limit_hits_total": sum(v["limit_hits"] for v in recompiles.values()),
            "step_ms_p50_after_warmup": {
                k: round(1000 * statistics.median(v), 2) for k, v in sorted(step_times.items()) if v
            },
            "wall_s": round(time.monotonic() - started, 2),
            "report": report.as_dict(),
            "notes": notes,
        }
        if status != "finished":
            data["stacks"] = thread_stacks(worker_names)
        return data

    def save(status: str) -> dict[str, Any]:
        data = result(status)
        with write_lock:
            write_json(args.json, data)
        return data

    def give_up(status: str, code: int) -> None:
        data = save(status)
        print(f"\n[{mode}] {status} after {data['wall_s']}s: {data['errors']} errors "
              f"({data['fx_tracing_errors']} FX-tracing), {data['compiles_total']} compiles started; "
              "worker stacks:", flush=True)
        for name, frames in sorted(data["stacks"].items()):
            print(f"  {name}: {where(frames)}", flush=True)
        os._exit(code)

    def watchdog() -> None:
        deadline = started + watchdog_s
        while not stop.wait(timeout=max(0.0, min(SNAPSHOT_EVERY_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                give_up("timed_out", 124)
            save("running")

    signal.signal(signal.SIGTERM, lambda signum, frame: give_up("terminated", 143))
    # Last resort if the watchdog thread cannot get the GIL: stacks, then exit (no JSON).
    faulthandler.dump_traceback_later(watchdog_s + 30, exit=True)

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
                    lockstep.wait(timeout=watchdog_s)
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

    warm_calls = collections.Counter()

    def warm_caller() -> None:
        # Steady state at one warmed length (its first call may compile it, like any thread's).
        device = devices[0]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if fixed:
            cs.configure_worker_thread()
        length = args.lengths[0]
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        q, k, v = (torch.randn(args.batch, args.heads, length, args.head_dim, device=device, dtype=dtype) for _ in range(3))
        own_errors = 0
        with torch.no_grad():
            mask = build_mask(causal, args.batch, None, length, length, device=device, BLOCK_SIZE=args.block_size)
            while not stop.is_set() and own_errors < args.max_errors_per_thread:
                try:
                    flex(q, k, v, block_mask=mask)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    warm_calls["ok"] += 1
                except Exception as error:  # noqa: BLE001
                    kind = errors.add(error)
                    own_errors += 1
                    warm_calls["errors"] += 1
                    if own_errors == 1:
                        print(f"[{mode}] warm-caller: {kind}", flush=True)
                time.sleep(0.001)
        if own_errors >= args.max_errors_per_thread and not fixed:
            # The unfixed mode has shown the race: end it now so the fixed mode gets the rest of
            # the time budget instead of waiting here for the workers' compiles to finish.
            give_up("race_shown", 0)

    threads = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(args.threads)]
    extra = [threading.Thread(target=tracer, name="fx-tracer", daemon=True)] if args.fx_tracer else []
    if args.warm_caller:
        extra.append(threading.Thread(target=warm_caller, name="warm-caller", daemon=True))
    watcher = threading.Thread(target=watchdog, name="watchdog", daemon=True)
    watcher.start()
    for thread in threads + extra:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    for thread in extra:
        thread.join()
    watcher.join()
    faulthandler.cancel_dump_traceback_later()
    return save("finished")


def print_summary(result: dict[str, Any]) -> None:
    mode = result["mode"]
    if result.get("crashed"):
        print(f"\n=== {mode}: process exited with {result['returncode']} before writing any results "
              "(crash: see the stacks above)", flush=True)
        return
    status = "" if result["status"] in ("finished", "race_shown") else f" [{result['status'].upper()}: partial]"
    print(f"\n=== {mode}{status}: {result['errors']} errors ({result['fx_tracing_errors']} FX-tracing RuntimeErrors), "
          f"{result['compiles_total']} compiles, {result['limit_hits_total']} recompile-limit hits, "
          f"wall {result['wall_s']}s (watchdog {result['watchdog_s']:.0f}s)", flush=True)
    for kind, count in sorted(result["error_types"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d} x {kind}")
    if result.get("warm_caller_calls"):
        calls = result["warm_caller_calls"]
        print(f"  warm-caller: {calls.get('ok', 0)} calls ok, {calls.get('errors', 0)} errors")
    no_compiles = {"compiles": 0, "after_warmup": 0, "limit_hits": 0}
    for index in range(result["config"]["threads"]):
        name = f"worker-{index}"
        stats = result["recompiles"].get(name, no_compiles)
        p50 = result["step_ms_p50_after_warmup"].get(name)
        location = f", at the end in {where(result['stacks'][name])}" if name in result.get("stacks", {}) else ""
        print(f"  {name}: {result['iters_done'].get(name, 0)} iters ok, {stats['compiles']} compiles "
              f"({stats['after_warmup']} after warm-up), {stats['limit_hits']} limit hits, "
              f"p50 step {p50 if p50 is not None else '-'} ms{location}")


class Terminated(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        run_mode(args.child, args)
        return 0

    modes = ["no-fixes"] if args.no_fixes else ["fixes"] if args.fixes else list(MODES)
    passthrough = list(argv if argv is not None else sys.argv[1:])
    passthrough = _without_option(passthrough, "--json", "--watchdog-s", "--budget-s", takes_value=True)
    passthrough = _without_option(passthrough, "--no-fixes", "--fixes")
    began = time.monotonic()

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    results: dict[str, Any] = {}

    def save_summary() -> None:
        if args.json:
            write_json(args.json, results)

    with tempfile.TemporaryDirectory() as tmp:
        for position, mode in enumerate(modes):
            watchdog_s = args.watchdog_s or auto_watchdog_s(args)
            if args.budget_s is not None:
                share = (args.budget_s - (time.monotonic() - began) - 5.0) / (len(modes) - position)
                if share < watchdog_s:
                    print(f"--- {mode}: watchdog {share:.0f}s (its share of --budget-s {args.budget_s:.0f}); up to "
                          f"{expected_compiles(args)} compiles x ~{args.compile_s:.0f}s may need {auto_watchdog_s(args):.0f}s: "
                          "results may be partial", flush=True)
                watchdog_s = max(10.0, min(watchdog_s, share))
            child_json = Path(tmp) / f"{mode}.json"
            env = dict(os.environ)
            if not args.shared_cache:
                env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"{mode}-inductor-cache")
                env["TRITON_CACHE_DIR"] = str(Path(tmp) / f"{mode}-triton-cache")
            print(f"--- mode {mode} (fresh process{'' if args.shared_cache else ', cold compile caches'}, "
                  f"watchdog {watchdog_s:.0f}s) ---", flush=True)
            child = subprocess.Popen(
                [sys.executable, "-u", __file__, *passthrough, "--child", mode, "--json", str(child_json),
                 "--watchdog-s", str(watchdog_s)],
                env=env,
            )
            terminated = None
            try:
                returncode = child.wait(timeout=watchdog_s + 60)
            except (Terminated, subprocess.TimeoutExpired) as stop:
                terminated = stop
                child.send_signal(signal.SIGTERM)  # the child writes what it has, then exits
                try:
                    returncode = child.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    child.kill()
                    returncode = child.wait()
            if child_json.exists():
                results[mode] = json.loads(child_json.read_text())
                results[mode]["returncode"] = returncode
            else:
                results[mode] = {"mode": mode, "crashed": True, "returncode": returncode}
            save_summary()
            if isinstance(terminated, Terminated):
                print(f"--- {terminated}: stopping after mode {mode}", flush=True)
                break
    for result in results.values():
        print_summary(result)
    if args.json:
        print(f"\nwrote {args.json}")
    fixed = results.get("fixes")
    if fixed is None:
        return 0 if len(results) == len(modes) else 2
    if fixed.get("crashed") or fixed["errors"]:
        return 1
    return 0 if fixed["status"] == "finished" else 2


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
