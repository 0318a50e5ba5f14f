"""Between the worker threads: the feature batches and the queues they travel in.

    BatchPlanner ─▶ TargetWorker t (its GPU) ─▶ queue[t][d] (bounded) ─▶ DrafterWorker d (its GPU)

Target worker t handles every batch whose stream position g satisfies g % T == t, so several
target GPUs can feed the drafters; each (target, drafter) pair has its own bounded queue, so a
drafter always knows where its next batch comes from and backpressure cannot deadlock (the
`BatchRouter` owns that rule; a drafter thread reads its queues through its `Inbox`). Features
move GPU to GPU as a peer copy on side streams ordered by CUDA events, never through the host.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..parallel.threads import StopSignal, get
from .batches import HostBatch


class FeatureSource(Protocol):
    """Produces target features for a host batch (a live target, or a feature cache)."""

    device: torch.device
    layer_ids: list[int]

    def features(self, batch: HostBatch) -> torch.Tensor: ...


@dataclass
class FeatureBatch:
    host: HostBatch
    features: torch.Tensor  # [b, S, len(layer_ids) · hidden] on the producing device
    ready: Any  # an event on the target worker's stream after the features were written (None on CPU)
    layer_ids: list[int]


class BatchRouter:
    """Which target worker produces each batch of a step, and which queue it goes to.

    Batch j of step s sits at stream position s × batches_per_step + j; target worker
    position % num_targets produces it. In replicas mode it goes to the replica that trains it
    (batch j belongs to rank j // grad_accum); in variants mode every drafter trains every batch.
    """

    def __init__(self, num_targets: int, num_drafter_threads: int, *, batches_per_step: int, grad_accum: int,
                 every_drafter_trains_every_batch: bool, depth: int):
        self.num_targets = num_targets
        self.batches_per_step = batches_per_step
        self.grad_accum = grad_accum
        self.broadcast = every_drafter_trains_every_batch
        self.queues = [[queue.Queue(maxsize=depth) for _ in range(num_drafter_threads)] for _ in range(num_targets)]

    def producer_of(self, step: int, index: int) -> int:
        return (step * self.batches_per_step + index) % self.num_targets

    def produced_by(self, target_index: int, step: int) -> list[int]:
        return [j for j in range(self.batches_per_step) if self.producer_of(step, j) == target_index]

    def destinations(self, step: int, index: int) -> list[queue.Queue]:
        row = self.queues[self.producer_of(step, index)]
        return row if self.broadcast else [row[index // self.grad_accum]]

    def inbox(self, slot: int, batch_indices: list[int], stop: StopSignal) -> "Inbox":
        return Inbox(self, [row[slot] for row in self.queues], batch_indices, stop)

    def mean_depth(self) -> float:
        everything = [q for row in self.queues for q in row]
        return sum(q.qsize() for q in everything) / max(1, len(everything))


@dataclass
class Inbox:
    """Where one drafter thread's batches come from: one queue per target worker."""

    router: BatchRouter
    queues: list[queue.Queue]
    batch_indices: list[int]  # which batches of each step this thread trains on
    stop: StopSignal

    def receive(self, step: int) -> tuple[list[FeatureBatch], float]:
        """This thread's batches of `step` in order, and the seconds spent waiting for them."""
        items, waited = [], 0.0
        for j in self.batch_indices:
            item, seconds = get(self.queues[self.router.producer_of(step, j)], self.stop)
            waited += seconds
            if item.host.step != step or item.host.index != j:
                raise RuntimeError(f"expected batch ({step}, {j}), got ({item.host.step}, {item.host.index})")
            items.append(item)
        return items, waited
