"""The gradient sum of a drafter's replicas (and, on several nodes, across nodes) after every backward."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..core.step import StepResult
from ..parallel.nodes import FlatGradients, NodeStep
from ..parallel.streams import mark, wait_for
from ..parallel.threads import StopBarrier, StopSignal


class GradientReducer:
    """Sums gradients across this node's replicas after every backward, and across nodes.

    Every replica copies its gradients into its own persistent flat buffers, on its own stream;
    all meet at a barrier; replica 0 sums the buffers into its own (NCCL when every replica has its
    own GPU, else copy-add); on several nodes it then votes and all-reduces that sum across nodes
    (`NodeStep`); it hands the total back into every buffer, and all meet again; each replica then
    copies the total back into its gradients, on its own stream. The first barrier is aborted when
    the pipeline stops, so no replica waits forever for a dead peer; the second only when replica 0
    fails: once it is passed, every replica finishes the step.

    On CUDA each replica's thread runs on its own stream (streams.py), and the barriers order only
    the hosts, so the GPU order is explicit: replica 0's streams wait for an event each replica
    recorded after loading its buffer (`loaded`), and each replica's stream waits for the event
    replica 0 recorded on its device after the sum (`summed`) before it reads its buffer back; its
    next step's gradients come after that read on its stream, so they cannot overwrite a gradient
    the sum has not read yet.
    """

    def __init__(self, replicas: list[torch.nn.Module], stop: StopSignal, across: NodeStep | None = None):
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
        self.stop = stop
        self.across = across
        self.seconds = 0.0

    def sync(self, rank: int) -> None:
        device = self.devices[rank]
        self.flats[rank].load()
        self.loaded[rank] = mark(device)
        self.gather.wait()
        if rank == 0:
            try:
                if self.across is not None:
                    self.across.continue_or_stop()
                started = time.perf_counter()
                self._reduce()
                self.seconds += time.perf_counter() - started
            except BaseException:
                self.release.abort()
                raise
        self.release.wait()
        wait_for(self.summed.get(device), device)
        self.flats[rank].store()

    def abort(self) -> None:
        """A replica failed outside a pipeline (no StopSignal to stop): release every peer waiting
        in either barrier."""
        self.gather.abort()
        self.release.abort()

    def record(self, step: int, result: StepResult, samples: int, tokens: int) -> None:
        """A replica's step result, for the node totals the next vote carries."""
        if self.across is not None:
            self.across.record(step, result.loss, result.metric_sums, samples, tokens)

    def leave(self, rank: int, completed_step: int, failure: str | None = None) -> None:
        """Replica 0 is exiting (`failure`: why, if its own thread failed): the other nodes learn
        it in the vote they wait for next."""
        if rank == 0 and self.across is not None:
            self.across.leave(completed_step, failure)

    @torch.no_grad()
    def _reduce(self) -> None:
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
                self.across.all_reduce(total)
            if self.use_nccl:
                torch.cuda.nccl.broadcast(buffers, root=0)
            else:
                for buffer in buffers[1:]:
                    buffer.copy_(total)
        self.summed = {device: mark(device) for device in set(self.devices)}
