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
  the eager result (decode/static.py, pipeline/step_graphs.py, pipeline/feature_graphs.py).
- No CUDA random numbers anywhere in the process during a capture: the generator is process-wide
  and in capture mode meanwhile. Training draws none on the GPU (anchors and shuffles use CPU
  generators).
- Graphs that share a memory pool belong to one thread and replay on one stream, one at a time.

`capture` raises on any failure; callers fall back to running the same function eagerly.
(`CaptureError` is what callers raise when their replay check fails.)
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

CAPTURE_LOCK = threading.Lock()


class CaptureError(RuntimeError):
    """A captured graph did not reproduce its step (found by the caller's replay check)."""


def capture(
    fn: Callable[[], Any], device: torch.device, stream: "torch.cuda.Stream", pool: Any = None
) -> tuple["torch.cuda.CUDAGraph", Any]:
    """`fn()` recorded into a new CUDA graph on `stream` (of `device`), sharing `pool` if given.
    Returns the graph and what `fn` returned (tensors owned by the graph). The work is recorded,
    not run: replay the graph to run it."""
    graph = torch.cuda.CUDAGraph()
    with CAPTURE_LOCK, torch.cuda.device(device):
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outputs = fn()
    return graph, outputs
