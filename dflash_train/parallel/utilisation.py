"""Where each worker's time goes (host, GPU, waiting), and which of them limits the pipeline.

Host busy: the share of wall time a worker thread spends neither waiting on a queue nor waiting
for its GPU to catch up. GPU busy: the share of wall time its GPU spent on its work, from CUDA
events recorded around each item on the worker's own stream (every worker thread runs on a stream
of its own: streams.py; start before, end after) and read only once both have completed (`query`,
never a wait), so measuring costs no synchronisation. Another worker's kernels on the same GPU are
on another stream, so they are not in this worker's span; they can still slow its kernels down
(the two share the GPU's SMs), which a saturated device's sum then shows. For a graphed step (one
launch) the span between the events is kernel time; for eager work it also holds the GPU's idle
gaps between launches: an upper bound there.

`bottleneck` turns those fractions and the mean queue depth into one label: a saturated GPU
first (its biggest user, "target GPU" / "drafter GPU"), then a saturated host ("target host",
"drafter host"), then the side the other one waits for, else "queue".
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

SATURATED = 0.85  # a fraction at or above this is the limit


class WorkerMeter:
    """One worker's GPU time (CUDA event spans) and host time spent waiting for its GPU."""

    def __init__(self) -> None:
        self.started: float | None = None  # wall clock of the first measured item
        self.gpu_seconds = 0.0
        self.gpu_wait_seconds = 0.0
        self.waiting_at_start = 0.0  # the worker's queue waits before `start` (warm-up, first input)
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.measures_gpu = False

    def start(self, waited_so_far: float = 0.0) -> None:
        """Measuring begins (after the warm-up); `waited_so_far` is the worker's queue wait until now."""
        if self.started is None:
            self.started = time.perf_counter()
            self.waiting_at_start = waited_so_far

    def begin(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def end(self, begun: Any, device: torch.device) -> None:
        if begun is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        with self._lock:
            self.measures_gpu = True
            self._pending.append((begun, event))

    def add_gpu_wait(self, seconds: float) -> None:
        self.gpu_wait_seconds += seconds

    def collect(self) -> None:
        """Add the spans whose events have completed (in order; never waits)."""
        with self._lock:
            while self._pending and self._pending[0][1].query():
                begun, ended = self._pending.popleft()
                self.gpu_seconds += begun.elapsed_time(ended) / 1000.0

    def fractions(self, waiting: float, now: float | None = None) -> tuple[float, float | None]:
        """(host busy, GPU busy or None without CUDA events) since `start`; `waiting` is the
        worker's total queue wait."""
        if self.started is None:
            return 0.0, None
        self.collect()
        elapsed = max(1e-9, (now or time.perf_counter()) - self.started)
        idle = max(0.0, waiting - self.waiting_at_start) + self.gpu_wait_seconds
        host = min(1.0, max(0.0, 1.0 - idle / elapsed))
        gpu = min(1.0, self.gpu_seconds / elapsed) if self.measures_gpu else None
        return host, gpu


@dataclass(frozen=True)
class WorkerLoad:
    name: str
    role: str  # "target" or "drafter"
    device: str
    host: float
    gpu: float | None


@dataclass(frozen=True)
class Bottleneck:
    label: str  # "target GPU", "drafter GPU", "target host", "drafter host" or "queue"
    detail: str

    def __str__(self) -> str:
        return f"{self.label} ({self.detail})" if self.detail else self.label


def bottleneck(loads: list[WorkerLoad], mean_queue_depth: float, queue_bound: int) -> Bottleneck:
    """The pipeline's limit, from each worker's host and GPU busy fractions and the queue depth."""
    if not loads:
        return Bottleneck("queue", "no workers")
    by_device: dict[str, list[WorkerLoad]] = collections.defaultdict(list)
    for load in loads:
        if load.gpu is not None:
            by_device[load.device].append(load)
    for device, users in sorted(by_device.items(), key=lambda item: -sum(u.gpu for u in item[1])):
        busy = min(1.0, sum(u.gpu for u in users))
        if busy >= SATURATED:
            top = max(users, key=lambda u: u.gpu)
            shares = ", ".join(f"{u.name} {u.gpu:.2f}" for u in users)
            return Bottleneck(f"{top.role} GPU", f"{device} busy {busy:.2f}: {shares}")
    busiest = max(loads, key=lambda u: u.host)
    if busiest.host >= SATURATED:
        return Bottleneck(f"{busiest.role} host", f"{busiest.name} host busy {busiest.host:.2f}")
    # Nobody saturated: the side the other waits for. Drafters starve on an empty queue (the
    # target is slow), the target blocks on a full one (the drafters are slow).
    if mean_queue_depth <= 0.25 * queue_bound:
        side = "target"
    elif mean_queue_depth >= 0.75 * queue_bound:
        side = "drafter"
    else:
        return Bottleneck("queue", f"mean depth {mean_queue_depth:.2f} of {queue_bound}, no resource saturated")
    users = [u for u in loads if u.role == side] or loads
    top = max(users, key=lambda u: max(u.host, u.gpu or 0.0))
    resource = "GPU" if (top.gpu or 0.0) > top.host else "host"
    return Bottleneck(f"{side} {resource}", f"queue depth {mean_queue_depth:.2f} of {queue_bound}; "
                                            f"{top.name} host {top.host:.2f}"
                                            + (f", GPU {top.gpu:.2f}" if top.gpu is not None else ""))


def worker_load(worker: Any) -> WorkerLoad:
    """A pipeline worker's load now (needs `name`, `role`, `device`, `times`, `meter`)."""
    host, gpu = worker.meter.fractions(worker.times.waiting)
    return WorkerLoad(worker.name, worker.role, str(worker.device), host, gpu)
