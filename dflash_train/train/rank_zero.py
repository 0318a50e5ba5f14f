"""What rank 0 of a drafter does besides training: checkpoints (`Checkpointer`) and the
in-training evaluation (`EvaluationSchedule`, shared by every drafter of the run)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .checkpoint import save_checkpoint
from .replicas import Replica


@dataclass
class Checkpointer:
    """Who checkpoints a drafter: its rank-0 thread, every `every` steps and when it stops."""

    run_dir: Path
    every: int
    keep: int
    state: dict  # written into each checkpoint's state.json (the run's config, the layer union)
    saved_step: int  # the newest step on disk (the resumed step at start)
    last: Path | None = None

    def due(self, completed_step: int, end_step: int) -> bool:
        """A periodic save; the final one is `save` from the worker's exit path."""
        return completed_step % self.every == 0 and completed_step < end_step

    def save(self, step: int, replica: Replica) -> None:
        if step <= self.saved_step:
            return
        self.last = save_checkpoint(self.run_dir, step, replica.drafter, replica.optimizer, replica.scheduler,
                                    self.state, keep=self.keep)
        self.saved_step = step


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
