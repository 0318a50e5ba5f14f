"""The target worker thread: runs the frozen target (or reads the feature cache) on its device and
puts each batch's features into the queues of the drafter threads that train on it (routing.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..parallel.streams import mark
from ..parallel.threads import StopSignal, Worker, put
from .batches import BatchPlanner
from .resume import StepRange
from .routing import BatchRouter, FeatureBatch, FeatureSource

if TYPE_CHECKING:
    from .startup import Warmup


@dataclass
class TargetSetup:
    """Everything one target worker thread owns."""

    thread_name: str
    index: int  # which target worker (batch positions ≡ index mod the number of target workers)
    source: FeatureSource
    planner: BatchPlanner
    router: BatchRouter
    steps: StepRange
    stop: StopSignal
    warmup: "Warmup | None" = None  # the start-up gate: warm-ups one at a time, then all start


class TargetWorker(Worker):
    role = "target"

    def __init__(self, setup: TargetSetup):
        super().__init__(setup.thread_name, setup.stop, setup.source.device)
        self.setup = setup
        self.tokens = 0

    @property
    def device(self) -> torch.device:
        return self.setup.source.device

    def work(self) -> None:
        setup = self.setup
        if setup.source.device.type == "cuda":
            torch.cuda.set_device(setup.source.device)
        if setup.warmup is not None:
            setup.warmup.run(self, getattr(setup.source, "prepare", None))
        for step in setup.steps:
            mine = setup.router.produced_by(setup.index, step)
            if not mine:
                continue
            self.stop_signal.check()
            started = time.perf_counter()
            batches = setup.planner.step_batches(step)
            for j in mine:
                batch = batches[j]
                span = self.meter.begin(self.device)
                features = setup.source.features(batch)
                self.meter.end(span, self.device)
                item = FeatureBatch(batch, features, mark(features.device), setup.source.layer_ids)
                self.times.computing += time.perf_counter() - started
                self.times.items += 1
                self.tokens += int(batch.lengths.sum())
                for target_queue in setup.router.destinations(step, j):
                    self.times.waiting += put(target_queue, item, self.stop_signal)
                started = time.perf_counter()
