"""The gradient sum of one step: over this node's replicas, then over the nodes.

    FlatGradients    a replica's gradients in persistent flat buffers (no allocation per step)
    NodeReduce       the all-reduce of a node's sum across nodes, timed (ReduceTimer)
    GradientReducer  the sum over the replicas of one drafter, in two calls the step loop makes
                     between accumulate and update: `arrive` (this replica's gradients are in;
                     every local replica is here), then `reduce` (the total is back in every
                     replica's gradients). Between the two, on several nodes, the node's first
                     replica votes (vote.py): a node never enters the all-reduce unless every
                     node voted to go on, so none waits in it for a node that left.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import torch

from .nodes import NodeGroup
from .streams import mark, wait_for
from .threads import StopBarrier, StopSignal


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients of `dtype` are summed in: float32 for 16-bit ones (bf16 parameters with
    master weights), whose sum over replicas would otherwise round at every addition."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class FlatGradients:
    """A replica's gradients in persistent flat buffers, one per dtype they are summed in
    (`reduction_dtype`): filled from the parameters' .grad after the backward, copied back after
    the reduction; no allocation per step."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        self.groups = [
            (group, torch.empty(sum(p.numel() for p in group), dtype=reduction_dtype(dtype), device=group[0].device))
            for dtype, group in by_dtype.items()
        ]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [buffer for _, buffer in self.groups]

    @torch.no_grad()
    def load(self) -> None:
        for params, buffer in self.groups:
            grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            if buffer.dtype == params[0].dtype:
                torch.cat(grads, out=buffer)
            else:  # widened on the way in
                torch._foreach_copy_(list(buffer.split([g.numel() for g in grads])), grads)

    @torch.no_grad()
    def store(self) -> None:
        for params, buffer in self.groups:
            views = [v.view_as(p) for p, v in zip(params, buffer.split([p.numel() for p in params]))]
            for param, view in zip(params, views):
                if param.grad is None:
                    param.grad = view.to(param.dtype, copy=True)
            # One kernel launch per dtype and device, not one per tensor; narrowed back where widened.
            torch._foreach_copy_([p.grad for p in params], views)


class ReduceTimer:
    """Time in the cross-node all-reduce: host time on CPU; on CUDA, events read once they have
    completed, so timing never makes the host wait for the GPU."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self.count = 0
        self._pending: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def measure(self, tensor: torch.Tensor) -> Iterator[None]:
        self.count += 1
        if tensor.device.type != "cuda":
            started = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - started
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((start, end))
        self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        pending = []
        for start, end in self._pending:
            if wait:
                end.synchronize()
            if end.query():
                self._seconds += start.elapsed_time(end) / 1000
            else:
                pending.append((start, end))
        self._pending = pending

    @property
    def seconds(self) -> float:
        self._collect(wait=True)
        return self._seconds


class NodeReduce:
    """The all-reduce of a node's gradient sum across every node (a NodeLost names a node that left)."""

    def __init__(self, nodes: NodeGroup):
        self.nodes = nodes
        self.timer = ReduceTimer()

    def all_reduce(self, buffer: torch.Tensor, step: int) -> None:
        import torch.distributed as dist

        with self.nodes.collective(f"the gradient all-reduce of step {step + 1}"), self.timer.measure(buffer):
            dist.all_reduce(buffer, group=self.nodes.gradients)


class GradientReducer:
    """Sums gradients across this node's replicas after every backward, and across nodes.

    Every replica copies its gradients into its own persistent flat buffers, on its own stream,
    and arrives at a barrier; replica 0 sums the buffers into its own (NCCL when every replica
    has its own GPU, else copy-add); on several nodes it then all-reduces that sum across nodes
    (`NodeReduce`); it hands the total back into every buffer, and all meet again; each replica
    then copies the total back into its gradients, on its own stream. The first barrier is
    aborted when the pipeline stops, so no replica waits forever for a dead peer; the second only
    by replica 0 (it failed, or the vote stopped every node: `cancel`): once it is passed, every
    replica finishes the step.

    On CUDA each replica's thread runs on its own stream (streams.py), and the barriers order only
    the hosts, so the GPU order is explicit: replica 0's streams wait for an event each replica
    recorded after loading its buffer (`loaded`), and each replica's stream waits for the event
    replica 0 recorded on its device after the sum (`summed`) before it reads its buffer back; its
    next step's gradients come after that read on its stream, so they cannot overwrite a gradient
    the sum has not read yet.
    """

    def __init__(self, replicas: list[torch.nn.Module], stop: StopSignal, across: NodeReduce | None = None):
        self.params = [[p for p in model.parameters() if p.requires_grad] for model in replicas]
        self.flats = [FlatGradients(params) for params in self.params]
        # StopBarrier: a stop never reaches a replica its generation already released.
        self.gather = StopBarrier(len(replicas))
        self.release = StopBarrier(len(replicas))
        self.devices = devices = [ps[0].device for ps in self.params]
        self.use_nccl = (
            len(devices) > 1
            and all(d.type == "cuda" for d in devices)
            and len(set(devices)) == len(devices)
            and hasattr(torch.cuda, "nccl")
            and torch.cuda.nccl.is_available([torch.empty(1, device=d) for d in devices])
        )
        self.loaded: list[Any] = [None] * len(replicas)  # per replica: its buffer is written (an event, or None)
        self.summed: dict[torch.device, Any] = {}  # per device: every buffer there holds the total
        stop.on_stop(self.gather.abort)
        self.across = across
        self.seconds = 0.0

    def arrive(self, rank: int) -> None:
        """This replica's gradients are in its buffer; returns once every local replica's are."""
        self.flats[rank].load()
        self.loaded[rank] = mark(self.devices[rank])
        self.gather.wait()

    def reduce(self, rank: int, step: int) -> None:
        """After `arrive`: the total over every replica (and node) back in this replica's gradients."""
        device = self.devices[rank]
        if rank == 0:
            try:
                started = time.perf_counter()
                self._reduce(step)
                self.seconds += time.perf_counter() - started
            except BaseException:
                self.release.abort()
                raise
        self.release.wait()
        wait_for(self.summed.get(device), device)
        self.flats[rank].store()

    def sync(self, rank: int, step: int = 0) -> None:
        """`arrive` then `reduce`: the gradient sum with nothing between (one node)."""
        self.arrive(rank)
        self.reduce(rank, step)

    def cancel(self) -> None:
        """Replica 0 leaves the step after `arrive` (the vote stopped every node): the others
        leave it too, without the update."""
        self.release.abort()

    def abort(self) -> None:
        """A replica failed outside a pipeline (no StopSignal to stop): release every peer waiting
        in either barrier."""
        self.gather.abort()
        self.release.abort()

    @torch.no_grad()
    def _reduce(self, step: int) -> None:
        """In replica 0's thread, on its current stream of each device, after every replica's load."""
        for event, device in zip(self.loaded, self.devices):
            wait_for(event, device)
        for group in range(len(self.flats[0].buffers)):
            buffers = [flat.buffers[group] for flat in self.flats]
            total = buffers[0]
            if self.use_nccl and self.across is None:
                torch.cuda.nccl.all_reduce(buffers)
                continue
            if self.use_nccl:
                torch.cuda.nccl.reduce(buffers, root=0)
            else:
                for buffer in buffers[1:]:
                    total += buffer.to(total.device)
            if self.across is not None:
                self.across.all_reduce(total, step)
            if self.use_nccl:
                torch.cuda.nccl.broadcast(buffers, root=0)
            else:
                for buffer in buffers[1:]:
                    buffer.copy_(total)
        self.summed = {device: mark(device) for device in set(self.devices)}
