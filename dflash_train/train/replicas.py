"""A replica: what one drafter thread trains (its weights, optimizer and schedule on one device)
and how one step of it is taken."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core.objective import ObjectiveConfig
from ..core.step import DrafterBatch, FrozenTargetParts, StepResult, training_step

if TYPE_CHECKING:
    from .step_graphs import GraphedStep


@dataclass
class Replica:
    """What one drafter thread trains, and how one step of it is taken."""

    name: str  # run name (variants) or "drafter"
    rank: int  # replica rank within its drafter (0 checkpoints and evaluates)
    device: torch.device
    drafter: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    frozen: FrozenTargetParts
    objective: ObjectiveConfig
    layer_ids: list[int]  # this drafter's target layers, in its order
    attention_backend: str
    autocast_dtype: torch.dtype | None
    clip_grad: float
    graphed: "GraphedStep | None" = None  # --cuda-graphs: the step as CUDA graphs (step_graphs.py)
    prepare: Callable[[Callable[[str], None]], str] | None = None  # its warm-up before step 1 (startup.py)

    def step(self, micro_batches: list[DrafterBatch], sync_gradients: Callable[[], None] | None) -> StepResult:
        if self.graphed is not None:
            return self.graphed.step(micro_batches, sync_gradients)
        return training_step(
            self.drafter, self.optimizer, self.scheduler, micro_batches, self.frozen, self.objective,
            attention_backend=self.attention_backend, clip_grad=self.clip_grad,
            autocast_dtype=self.autocast_dtype, sync_gradients=sync_gradients,
        )

    def take_gpu_wait(self) -> float:
        """Seconds the last steps waited for the GPU to catch up (graphed steps run ahead of it)."""
        return self.graphed.take_gpu_wait() if self.graphed is not None else 0.0
