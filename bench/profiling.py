"""Timing and torch.profiler helpers shared by the bench scripts: mean time per call, the tables
they write, and how busy the GPU was.

    python bench/profiling.py kernels TRACE.json --steps N    # kernel ms per step per stream, as JSON
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch


def mean_ms(call: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Mean milliseconds of `call()` over `iters` calls after `warmup` more: CUDA events on a CUDA
    device (the GPU's time, one synchronize at the end), the host's clock elsewhere."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    began = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - began) * 1000 / iters


def write_tables(prof, path: Path, extra: str = "") -> None:
    """The kernel table (by GPU time) and the host table (by self CPU time) of a finished
    `torch.profiler.profile`, to `path` (after `extra`, a header line or two)."""
    table = prof.key_averages()
    path.write_text(extra + table.table(sort_by="cuda_time_total", row_limit=40) + "\n\n"
                    + table.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")


def gpu_busy(prof) -> tuple[float, float]:
    """(seconds some kernel or copy ran on the GPU, seconds from the first to the last of them)
    from a profile's device events, overlaps merged: their ratio is the GPU's busy fraction, and
    the difference is the time it sat idle between them (waiting for the host)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not spans:
        return 0.0, 0.0
    busy, (start, end) = 0.0, spans[0]
    for left, right in spans[1:]:
        if left > end:
            busy += end - start
            start, end = left, right
        else:
            end = max(end, right)
    busy += end - start
    return busy / 1e6, (max(r for _, r in spans) - spans[0][0]) / 1e6  # profiler times are µs


def kernels_by_stream(trace: Path, steps: int, top: int = 12) -> dict:
    """Kernel time per CUDA stream in a Chrome trace written by `prof.export_chrome_trace`, in ms
    per step (`steps` steps were profiled), with each stream's `top` kernels by time. Graph replays
    show their kernels one by one, so this splits a step into the target's and the drafter's work
    (each worker has its own stream) and, within each, says which kernels cost the time."""
    import json

    events = json.loads(trace.read_text()).get("traceEvents", [])
    streams: dict[str, dict] = {}
    for event in events:
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        stream, name, ms = str(event.get("args", {}).get("stream", "?")), event.get("name", "?"), event["dur"] / 1000
        entry = streams.setdefault(stream, {"ms": 0.0, "kernels": 0, "names": {}})
        entry["ms"] += ms
        entry["kernels"] += 1
        entry["names"][name] = entry["names"].get(name, 0.0) + ms
    report = {}
    for stream, entry in sorted(streams.items(), key=lambda item: -item[1]["ms"]):
        names = sorted(entry["names"].items(), key=lambda item: -item[1])[:top]
        report[stream] = {"ms_per_step": round(entry["ms"] / steps, 3), "kernels_per_step": round(entry["kernels"] / steps, 1),
                          "top": [(name[:120], round(ms / steps, 3)) for name, ms in names]}
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Kernel time per CUDA stream of a Chrome trace, in ms per step.")
    commands = parser.add_subparsers(dest="command", required=True)
    kernels = commands.add_parser("kernels", help="kernels_by_stream of a trace written by prof.export_chrome_trace")
    kernels.add_argument("trace", type=Path)
    kernels.add_argument("--steps", type=int, required=True, help="how many steps the trace profiled")
    kernels.add_argument("--top", type=int, default=12, help="kernels listed per stream")
    args = parser.parse_args(argv)
    print(json.dumps(kernels_by_stream(args.trace, args.steps, args.top), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
