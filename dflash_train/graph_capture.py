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
  graphs recorded none of its kernels. A graph that comes out empty is refused (`CaptureError`).
- No CUDA random numbers anywhere in the process during a capture: the generator is process-wide
  and in capture mode meanwhile. Training draws none on the GPU (anchors and shuffles use CPU
  generators).
- Graphs that share a memory pool belong to one thread and replay on one stream, one at a time.

`capture` raises on any failure; callers fall back to running the same function eagerly.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import torch

CAPTURE_LOCK = threading.Lock()


class CaptureError(RuntimeError):
    """The capture produced no usable graph; the message says why."""


def capture(
    fn: Callable[[], Any], device: torch.device, stream: "torch.cuda.Stream", pool: Any = None
) -> tuple["torch.cuda.CUDAGraph", Any]:
    """`fn()` recorded into a new CUDA graph on `stream` (of `device`), sharing `pool` if given.
    Returns the graph and what `fn` returned (tensors owned by the graph). The work is recorded,
    not run: replay the graph to run it."""
    graph = torch.cuda.CUDAGraph()
    # warnings.catch_warnings swaps process-global state: only under the lock.
    with CAPTURE_LOCK, torch.cuda.device(device), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outputs = fn()
    empty = [w for w in caught if "graph is empty" in str(w.message).lower()]
    for w in caught:
        if w not in empty:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if empty:  # the kernels ran somewhere else: replays would return stale outputs
        raise CaptureError(str(empty[0].message))
    return graph, outputs
