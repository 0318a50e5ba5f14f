"""What rank 0 of a drafter does besides training: checkpoints (`Checkpointer`) and the
in-training evaluation (`EvaluationSchedule`, shared by every drafter of the run)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..parallel.threads import StopSignal
from .checkpoint import checkpoint_snapshot, save_checkpoint, write_checkpoint
from .replicas import Replica


class LoggedSteps:
    """The newest step whose line each drafter's metrics log holds, written and flushed by the
    coordinator's thread, which may fall behind the drafters'. A periodic checkpoint waits for
    its step's line, so a run killed (-9) at any moment resumes with every step logged once:
    resuming drops the lines after the checkpoint, and none can be missing before it."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._through: dict[str, int] = {}
        self._closed = False

    def mark(self, drafter: str, step: int) -> None:
        with self._changed:
            self._through[drafter] = max(step, self._through.get(drafter, 0))
            self._changed.notify_all()

    def close(self) -> None:
        """The coordinator writes no more lines: nobody waits for them."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_through(self, drafter: str, step: int, give_up: Callable[[], bool]) -> None:
        with self._changed:
            while not self._closed and self._through.get(drafter, 0) < step and not give_up():
                self._changed.wait(timeout=0.5)


@dataclass
class Checkpointer:
    """Who checkpoints a drafter: its rank-0 thread, every `every` steps and when it stops.

    A periodic checkpoint is copied to host memory between two steps and written by a thread of
    its own while the training goes on: writing and fsyncing a SmolLM2 drafter with its optimizer
    state held the step loop ~0.75 s on an H100. One write is in flight at a time; one that
    failed is raised in the drafter's thread at its next step (`raise_if_failed`). The last
    save, when the drafter stops, is written before the thread goes on."""

    run_dir: Path
    every: int
    keep: int
    state: dict  # written into each checkpoint's state.json (the run's config, the layer union)
    saved_step: int  # the newest step saved or being written (the resumed step at start)
    logged: LoggedSteps  # the steps whose lines this process's metrics log holds
    last: Path | None = None  # the newest checkpoint on disk
    # On several nodes a step's line waits for its totals, which come with the next step's vote
    # (cast by this very thread after the save): a periodic save then waits for the step before.
    line_lag: int = 0
    _writing: threading.Thread | None = field(default=None, repr=False)
    _failure: BaseException | None = field(default=None, repr=False)

    def due(self, completed_step: int, end_step: int) -> bool:
        """A periodic save; the final one is `save` from the worker's exit path."""
        return completed_step % self.every == 0 and completed_step < end_step

    def save_periodic(self, step: int, replica: Replica, stop: StopSignal) -> None:
        """Copy the state of `step` and write it from another thread, once the metrics log holds
        the step's line (or the run is stopping: the coordinator then writes every line left
        before the process ends)."""
        self._wait_for_write()
        if step <= self.saved_step:
            return
        snapshot = checkpoint_snapshot(replica.drafter, replica.optimizer, replica.scheduler)
        self.saved_step = step

        def write() -> None:
            try:
                self.logged.wait_through(replica.name, step - self.line_lag, give_up=lambda: stop.stopped)
                self.last = write_checkpoint(self.run_dir, step, snapshot, self.state, keep=self.keep)
            except BaseException as error:  # raised in the drafter's thread
                self._failure = error

        # Not a daemon: a process that ends while a checkpoint is being written finishes it first.
        self._writing = threading.Thread(target=write, name=f"checkpoint-{replica.name}-{step}")
        self._writing.start()

    def raise_if_failed(self) -> None:
        """The error of a periodic write that failed, in the caller's thread (once)."""
        failure = self._failure  # set once, as the writer's last act: clearing it cannot lose another
        if failure is not None:
            self._failure = None
            raise failure

    def save(self, step: int, replica: Replica) -> None:
        """The drafter stopped after `step`: save it now, after the write in flight."""
        self._wait_for_write()
        if step <= self.saved_step:
            return
        self.last = save_checkpoint(self.run_dir, step, replica.drafter, replica.optimizer, replica.scheduler,
                                    self.state, keep=self.keep)
        self.saved_step = step

    def _wait_for_write(self) -> None:
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        self.raise_if_failed()


class Evaluator(Protocol):
    def measure(self, drafter: torch.nn.Module) -> dict: ...


class EvaluationSchedule:
    """Real tau every `every` steps and at the last step, one decode at a time (the
    evaluator's target is shared by every drafter of the run)."""

    def __init__(self, evaluator: Evaluator, every: int, end_step: int):
        self.evaluator = evaluator
        self.every = every
        self.end_step = end_step
        self._lock = threading.Lock()

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 or step + 1 == self.end_step

    def after_step(self, step: int, drafter: torch.nn.Module) -> dict | None:
        if not self.due(step):
            return None
        with self._lock:
            return self.evaluator.measure(drafter)


@dataclass
class RankZeroWork:
    """Whether rank 0 has work of its own after a step (a periodic checkpoint, an in-training
    eval): it says so in that step's vote, and the other nodes wait for it without a time limit."""

    checkpointer: Checkpointer | None
    evaluation: EvaluationSchedule | None
    end_step: int

    def busy_after(self, step: int) -> bool:
        return bool((self.checkpointer is not None and self.checkpointer.due(step + 1, self.end_step))
                    or (self.evaluation is not None and self.evaluation.due(step)))
