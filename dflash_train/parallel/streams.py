"""Each worker thread's own CUDA stream, and the hand-offs of tensors and gradients between streams.

Why: on the device's one default stream, the target and drafter threads of a GPU would interleave
their kernels, so the CUDA-event span a worker records around its item (utilisation.py) would hold
the other's work, and a slow target would be named a slow drafter. A worker therefore runs its
whole loop (warm-up included) on a stream of its own, and every hand-off says what it waits for:

  mark / wait_for   an event recorded on this thread's current stream (None off CUDA), and another
                    stream made to wait for it: the producer marks after writing, the consumer waits
                    on ITS stream before reading (the gradient sum of replicas, feature batches)
  receive           a tensor another worker's stream wrote, made usable on this thread's stream: the
                    event to wait for before reading it, and the tensor kept from the caching
                    allocator until this stream's reads ran (memory returns to the stream that
                    allocated it, which could otherwise reuse it while we still read it)

Off CUDA everything here is a no-op: a CPU op runs when called.

The caching allocator hands out pool streams round-robin, 32 per device: the workers' streams are
made one after another when the pipeline is built, so up to 32 workers on a device get distinct
ones (past that, two of them share a stream: still correct, their spans then hold each other).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


class WorkerStream:
    """One worker thread's stream on its device (nothing off CUDA).

    Made in the building thread; `running()` is entered in the worker's thread around its whole
    loop: the stream first waits for what the builder enqueued (weights, optimizer state, flat
    gradient buffers), and on exit the builder's stream waits for everything the worker enqueued,
    so whoever joins the thread and reads its results there (the export, a test) sees them done.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._builder = torch.cuda.current_stream(device) if self.stream is not None else None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(self._builder)
        try:
            with torch.cuda.stream(self.stream):
                yield
        except BaseException:
            # The worker's own error is the one to report, not a second one from a broken context.
            with contextlib.suppress(Exception):
                self._builder.wait_stream(self.stream)
            raise
        self._builder.wait_stream(self.stream)


def mark(device: torch.device) -> Any:
    """An event after everything this thread has enqueued on `device` so far (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_for(event: Any, device: torch.device) -> None:
    """This thread's stream on `device` runs nothing more until `event` has completed (None: no-op)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def receive(tensor: torch.Tensor, ready: Any, device: torch.device, side_streams: dict) -> tuple[torch.Tensor, Any]:
    """`tensor`, written by another thread's stream up to its event `ready`, on `device` for this
    thread's stream, and the event this thread's stream must wait for (`wait_for`) before it reads
    it: the caller waits only when it uses it, so taking a batch early never holds up the work
    enqueued before its use. Same device: the tensor itself. GPU to GPU: a peer copy on side
    streams of both devices (kept in `side_streams`, one per device, made once), overlapping this
    thread's compute. To or from the CPU: the copy once `ready` has completed (nothing to wait for)."""
    if tensor.device == device:
        if ready is not None:
            # Its memory returns to the producer's stream when freed: not reusable there before
            # the reads this stream has enqueued by then.
            tensor.record_stream(torch.cuda.current_stream(device))
        return tensor, ready
    if tensor.device.type == "cuda" and device.type == "cuda":
        send, take = _side_stream(side_streams, tensor.device), _side_stream(side_streams, device)
        with torch.cuda.stream(send), torch.cuda.stream(take):
            send.wait_event(ready)
            moved = tensor.to(device, non_blocking=True)
            copied = mark(device)
        tensor.record_stream(send)  # the producer may free it; keep it until the copy ran
        moved.record_stream(torch.cuda.current_stream(device))
        return moved, copied
    if ready is not None:
        ready.synchronize()
    return tensor.to(device), None


def _side_stream(side_streams: dict, device: torch.device) -> Any:
    if device not in side_streams:
        side_streams[device] = torch.cuda.Stream(device)
    return side_streams[device]
