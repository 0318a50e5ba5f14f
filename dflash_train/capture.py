"""Every CUDA graph in dflash-train: captured one at a time, checked by a replay, or run eagerly.

`checked_capture` is the one way a graph is made: `capture` records a function, a check replays
the graph and compares it with the eager result, and a graph that fails either is dropped with a
reason, so its caller runs the same function eagerly (slower, never wrong). `CapturedStep` is the
form decoding and regeneration use: captured on its first call (its warm-up is the eager result
the replay must reproduce), replayed afterwards, eager for good after a failure, with one warning.
Training's graphs (train/step_graphs.py, train/feature_graphs.py) check a replay on data the
capture never saw against an eager run on that data.

How captures in different threads are kept from invalidating each other:

- One capture at a time per process (`CAPTURE_LOCK`). Entering `torch.cuda.graph` synchronises
  the device and empties the allocator's cache, which would break a capture in flight in another
  thread; torch 2.11 serialises nothing itself (2.13 serialises only CUDA-graph trees).
- `capture_error_mode="thread_local"`: only this thread's unsafe calls (a sync, an event query)
  are errors during the capture; other threads may allocate, launch and wait meanwhile. Their
  work is not recorded: capture is per stream, and ours is private.
- A stream of the capturing device, that device current: `torch.cuda.graph`'s default stream is
  one per process, made on whichever device was current at the first capture, so a second GPU's
  graphs recorded none of its kernels. Whether a graph holds the step's kernels is judged by
  behaviour, never by warning text: every graph is replayed once and compared with the eager
  result before it is used (`checked_capture`).
- No CUDA random numbers anywhere in the process during a capture: the generator is process-wide
  and in capture mode meanwhile. Training draws none on the GPU (anchors and shuffles use CPU
  generators).

The pool policy: graphs that one owner captures one after another, replays one at a time on one
stream and whose outputs are consumed before the next of them replays share a `GraphPool` (a
training replica's step graphs, the target's feature graphs, a decoder's prefills, a batched
generator's steps); any other graph gets a private pool (`pool=None`). A pool is a `GraphPool`,
never a bare `torch.cuda.graph_pool_handle()` (it says why).

Out of memory is never a reason to run eagerly: it is raised, and the caller frees memory and
retries or gives up.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import torch

CAPTURE_LOCK = threading.Lock()
Outputs = TypeVar("Outputs")


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


# A replay check: replays the graph (given with what the captured function returned) and says
# where it differs from the eager result, or None when it agrees.
ReplayCheck = Callable[["torch.cuda.CUDAGraph", Any], "str | None"]


@dataclass
class Captured:
    """What `checked_capture` made: a graph its check accepted, or the reason there is none."""

    graph: "torch.cuda.CUDAGraph | None"
    outputs: Any  # what the captured function returned: tensors the graph rewrites on each replay
    reason: str | None  # why the function runs eagerly instead; None when `graph` is good


def checked_capture(fn: Callable[[], Any], device: torch.device, stream: "torch.cuda.Stream",
                    check: ReplayCheck | None, pool: GraphPool | None = None) -> Captured:
    """`fn()` captured (`capture`, after the caller's eager warm-up on `stream`), then judged by
    `check`. A failed capture or check gives no graph and the reason: a capture error as
    "Type: first line", a check's finding as it says it. `check` None only for a graph whose
    function was checked at another size (a rows bucket of a checked length). Out of memory is
    raised (module doc)."""
    try:
        graph, outputs = capture(fn, device, stream, pool)
        mismatch = check(graph, outputs) if check is not None else None
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - any other failure means: this function runs eagerly
        return Captured(None, None, error_summary(error))
    if mismatch is not None:
        return Captured(None, None, mismatch)
    return Captured(graph, outputs, None)


def _output_tensors(outputs: object) -> list[torch.Tensor]:
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _unlike(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of `tensor`'s shape that differs from it at every element."""
    if tensor.dtype == torch.bool:
        return ~tensor
    if tensor.is_floating_point():
        return torch.where(torch.isnan(tensor), torch.zeros_like(tensor), torch.full_like(tensor, float("nan")))
    return tensor + 1


def _replay_mismatch(outputs: object, expected: object) -> str | None:
    """Where the replayed outputs differ from the eager result (None when they agree: floats to
    rounding, integers exactly)."""
    for index, (got, want) in enumerate(zip(_output_tensors(outputs), _output_tensors(expected))):
        want = want.to(got.device)
        same = torch.allclose(got, want, rtol=1e-3, atol=1e-5, equal_nan=True) if got.is_floating_point() else torch.equal(got, want)
        if not same:
            return f"output {index} {tuple(got.shape)}"
    return None


class CapturedStep(Generic[Outputs]):
    """`fn()` (reading and writing only tensors it owns) captured in a CUDA graph on first use
    and replayed afterwards; a plain call on CPU. Outputs are the graph's own tensors: read them
    before the next call.

    Capture needs one eager warm-up run first (lazy cuBLAS/attention workspaces must not be
    allocated inside the capture). That run computes the real result; cache writes are
    idempotent (same slots from the same inputs), and `restore` names the tensors the step
    overwrites that it also reads, which are put back before the captured graph's first replay.

    If capture or its check fails (an operation that syncs with the host, ...), the step runs
    eagerly from then on, with one warning: slower, never wrong. Steps given one `pool` share
    their graphs' memory (the pool policy in the module doc)."""

    def __init__(self, fn: Callable[[], Outputs], device: torch.device, name: str, restore: tuple[torch.Tensor, ...] = (),
                 *, graphs: bool = True, pool: GraphPool | None = None):
        self.fn, self.device, self.name, self.restore, self.pool = fn, device, name, restore, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Outputs | None = None
        self.eager = device.type != "cuda" or not graphs

    def __call__(self) -> Outputs:
        if self.eager:
            return self.fn()
        # Capture and replay on the model's device: a graph captured on another device's stream
        # records none of our kernels (they run eagerly on their own device's stream), and
        # every replay would silently return stale outputs.
        with torch.cuda.device(self.device):
            if self.graph is not None:
                self.graph.replay()
                return self.outputs  # type: ignore[return-value]
            return self._capture()

    def milliseconds_per_call(self, repeats: int) -> float:
        """GPU milliseconds per call over `repeats` calls, timed with CUDA events (CUDA only)."""
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                self()
            end.record()
            end.synchronize()
        return start.elapsed_time(end) / repeats

    def _capture(self) -> Outputs:
        saved = [t.clone() for t in self.restore]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            result = self.fn()
            expected = [t.clone() for t in _output_tensors(result)]  # a copy: an output may be a buffer the step reuses
        torch.cuda.current_stream(self.device).wait_stream(stream)

        def reproduces_the_warm_up(graph: torch.cuda.CUDAGraph, outputs: Outputs) -> str | None:
            # Judged by what the graph does, not by warnings: replayed from the warm-up's inputs
            # it must overwrite every output with the warm-up's result. Kernels that ran outside
            # the capture (an empty or partial graph) leave the poison in place.
            for tensor, value in zip(self.restore, saved):
                tensor.copy_(value)
            for tensor in _output_tensors(outputs):
                tensor.copy_(_unlike(tensor))
            graph.replay()
            mismatch = _replay_mismatch(outputs, expected)
            if mismatch is None:
                return None
            return (f"its first replay did not reproduce the eager result ({mismatch} differs): "
                    "the graph holds none or only part of the step's kernels")

        captured = checked_capture(self.fn, self.device, stream, reproduces_the_warm_up, self.pool)
        if captured.reason is not None:
            warnings.warn(f"CUDA graph capture of the {self.name} step failed, running it eagerly: {captured.reason}",
                          stacklevel=2)
            self.eager = True
            # Whatever the capture or replay wrote is overwritten by one more eager run from the
            # warm-up's inputs (its cache writes are the warm-up's own).
            for tensor, value in zip(self.restore, saved):
                tensor.copy_(value)
            return self.fn()
        self.graph, self.outputs = captured.graph, captured.outputs
        return captured.outputs
