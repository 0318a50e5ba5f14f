"""One CUDA-graph capture at a time in this process, on the caller's stream, with its device current.

Every capture in dflash-train goes through `capture` (the static decoder's steps, the training
step's graphs, the target's feature forward). How captures in different threads are kept from
invalidating each other:

- One capture at a time per process (`CAPTURE_LOCK`). Entering `torch.cuda.graph` synchronises
  the device and empties the allocator's cache, which would break a capture in flight in another
  thread; torch 2.11 serialises nothing itself (2.13 serialises only CUDA-graph trees).
- `capture_error_mode="thread_local"`: only this thread's unsafe calls (a sync, an event query)
  are errors during the capture; other threads may allocate, launch and wait meanwhile. Their
  work is not recorded: capture is per stream, and ours is private.
- A stream of the capturing device, that device current: `torch.cuda.graph`'s default stream is
  one per process, made on whichever device was current at the first capture, so a second GPU's
  graphs recorded none of its kernels. Whether a graph holds the step's kernels is judged by
  behaviour, never by warning text: every caller replays a new graph once and compares it with
  the eager result (decode/static.py, train/step_graphs.py, train/feature_graphs.py).
- No CUDA random numbers anywhere in the process during a capture: the generator is process-wide
  and in capture mode meanwhile. Training draws none on the GPU (anchors and shuffles use CPU
  generators).
- Graphs that share a memory pool belong to one thread and replay on one stream, one at a time.
  A pool is a `GraphPool`, never a bare `torch.cuda.graph_pool_handle()` (it says why).

`capture` raises on any failure; callers fall back to running the same function eagerly.
(`CaptureError` is what callers raise when their replay check fails.)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

CAPTURE_LOCK = threading.Lock()


class CaptureError(RuntimeError):
    """A captured graph did not reproduce its step (found by the caller's replay check)."""


class GraphPool:
    """The memory pool that graphs captured one after another share; made on first use.

    A pool id from `torch.cuda.graph_pool_handle()` has no lifetime of its own: the allocator's
    pool lives while some graph captured into it does, and once the last of them is destroyed
    (the graph of a capture whose replay check failed, graphs a caller dropped) every later
    capture into that id fails an internal assert of the caching allocator (`use_count > 0`).
    So a capture gets the current id only while a graph captured into it lives, a fresh one
    otherwise: one failed capture never turns into eager steps for every later shape."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._graphs: "weakref.WeakSet[torch.cuda.CUDAGraph]" = weakref.WeakSet()

    def handle(self) -> Any:
        if self._handle is None or not self._graphs:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def adopt(self, graph: "torch.cuda.CUDAGraph") -> None:
        self._graphs.add(graph)


def first_line(error: BaseException) -> str:
    """What a fallback warning says of `error`: its first line, and the next one where the first
    only introduces it (torch's BackendCompilerFailed reads "backend='...' raised:", the cause below)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def error_summary(error: BaseException) -> str:
    """"Type: first line" of `error`, as the fallback warnings list their reasons."""
    return f"{type(error).__name__}: {first_line(error)}"


def capture(
    fn: Callable[[], Any], device: torch.device, stream: "torch.cuda.Stream", pool: GraphPool | None = None
) -> tuple["torch.cuda.CUDAGraph", Any]:
    """`fn()` recorded into a new CUDA graph on `stream` (of `device`), sharing `pool` if given.
    Returns the graph and what `fn` returned (tensors owned by the graph). The work is recorded,
    not run: replay the graph to run it."""
    graph = torch.cuda.CUDAGraph()
    with CAPTURE_LOCK, torch.cuda.device(device):
        handle = pool.handle() if pool is not None else None
        with torch.cuda.graph(graph, pool=handle, stream=stream, capture_error_mode="thread_local"):
            outputs = fn()
        if pool is not None:
            pool.adopt(graph)
    return graph, outputs
