"""Worker threads, stop signalling and fault propagation shared by the pipeline's parts.

Every blocking call in the pipeline (queue get/put, barriers) waits in short slices and
checks the shared stop flag, so one failing worker stops all others within about a
second, and the coordinator can report which worker failed and where.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import RunFailed, UserError
from .streams import WorkerStream
from .utilisation import WorkerMeter

POLL_SECONDS = 0.2


class PipelineStopped(Exception):
    """Raised inside a worker when the pipeline is stopping; not an error of that worker."""


class PipelineError(RuntimeError):
    """A worker failed; the message names it and carries its traceback."""


@dataclass
class WorkerFailure:
    worker: str
    error: BaseException
    traceback: str


class StopSignal:
    """Shared by all workers: who asked to stop, why, and which workers failed."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason: str | None = None
        self.failures: list[WorkerFailure] = []
        self._on_stop: list[Any] = []

    @property
    def stopped(self) -> bool:
        return self._event.is_set()

    def on_stop(self, callback) -> None:
        self._on_stop.append(callback)

    def stop(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            already = self._event.is_set()
            self._event.set()
        if not already:
            for callback in self._on_stop:
                callback()

    def fail(self, worker: str, error: BaseException) -> None:
        with self._lock:
            self.failures.append(WorkerFailure(worker, error, traceback.format_exc()))
        self.stop(f"{worker} failed: {type(error).__name__}: {error}")

    def check(self) -> None:
        if self._event.is_set():
            raise PipelineStopped(self.reason)

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def error(self) -> BaseException | None:
        """What stopped the pipeline: the first worker's own error where its message explains it
        (bad input found mid-run, e.g. a damaged feature shard: one line and exit 2 at the
        command line; a run failure, e.g. a lost node: one line and exit 1), else a
        PipelineError carrying every failed worker's traceback (a bug: its traceback is wanted)."""
        if not self.failures:
            return None
        if isinstance(self.failures[0].error, (UserError, RunFailed)):
            return self.failures[0].error
        parts = [f"worker {f.worker} failed:\n{f.traceback}" for f in self.failures]
        return PipelineError("\n".join(parts))


def put(q: queue.Queue, item: Any, stop: StopSignal) -> float:
    """Blocking put that gives up when the pipeline stops; returns seconds spent waiting."""
    start = time.perf_counter()
    while True:
        stop.check()
        try:
            q.put(item, timeout=POLL_SECONDS)
            return time.perf_counter() - start
        except queue.Full:
            continue


def get(q: queue.Queue, stop: StopSignal) -> tuple[Any, float]:
    """Blocking get that gives up when the pipeline stops; returns (item, seconds waited)."""
    start = time.perf_counter()
    while True:
        stop.check()
        try:
            return q.get(timeout=POLL_SECONDS), time.perf_counter() - start
        except queue.Empty:
            continue


class StopBarrier:
    """A barrier for `parties` threads that the pipeline's stop can break.

    Unlike `threading.Barrier`, breaking it never reaches a thread whose generation was already
    released: `threading.Barrier.abort()` raises in every thread that has not yet woken up, so
    a replica that had passed the gradient sum could skip its update while its peers applied
    theirs. Here a released generation is final; only threads still waiting see the stop."""

    def __init__(self, parties: int):
        self.parties = parties
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._broken = False

    def wait(self) -> None:
        with self._cond:
            if self._broken:
                raise PipelineStopped("the pipeline stopped")
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.parties:
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            while self._generation == generation and not self._broken:
                self._cond.wait()
            if self._generation == generation:
                raise PipelineStopped("the pipeline stopped")

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()


@dataclass
class WorkerTimes:
    """Where a worker's wall time goes: waiting for input/output vs computing."""

    waiting: float = 0.0
    computing: float = 0.0
    items: int = 0
    started: float = field(default_factory=time.perf_counter)

    def busy_fraction(self) -> float:
        total = self.waiting + self.computing
        return self.computing / total if total > 0 else 0.0


class Worker(threading.Thread):
    """A pipeline thread: runs `work()` on its own CUDA stream (streams.py; nothing off CUDA),
    turns any exception into a pipeline-wide stop."""

    role = "worker"  # "target" or "drafter": how utilisation.bottleneck names it

    def __init__(self, name: str, stop: StopSignal, device: torch.device):
        super().__init__(name=name, daemon=True)
        self.stop_signal = stop
        self.times = WorkerTimes()
        self.meter = WorkerMeter()  # host and GPU busy fractions (utilisation.py)
        self.stream = WorkerStream(device)  # made here, in the building thread (see WorkerStream)

    def work(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self) -> None:
        try:
            with self.stream.running():
                self.work()
        except PipelineStopped:
            pass
        except BaseException as error:  # noqa: BLE001 - every failure must reach the coordinator
            self.stop_signal.fail(self.name, error)
