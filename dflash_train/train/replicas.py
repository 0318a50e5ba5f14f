"""A replica: what one drafter thread trains (its weights, optimizer and schedule on one device)
and how one step of it is taken; the drafter's first weights (`init_drafter`) or its checkpoint's,
copied to each of its devices (`build_replicas`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..config import TrainConfig
from ..core.dflash2 import GroupedDynamicCausalConv
from ..core.drafter import DFlashDrafter, DrafterConfig
from ..core.fp8 import use_fp8_linears
from ..core.objective import ObjectiveConfig
from ..core.step import DrafterBatch, FrozenTargetParts, Step, StepResult, make_optimizer, warmup_cosine
from ..parallel.nodes import NodeGroup
from ..target.model import Target
from .checkpoint import load_drafter, restore_trainer
from .layout import DrafterPlan
from .precision import autocast_dtype, compiles_drafter, compute_dtype
from .resume import ResumePoint

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
    graphed: "GraphedStep | None" = None  # --cuda-graphs: the step's phases as CUDA graphs (step_graphs.py)
    prepare: Callable[[Callable[[str], None]], str] | None = None  # its warm-up before step 1 (startup.py)
    step: Step = field(init=False)  # the step's phases and persistent state, made from the fields above

    def __post_init__(self) -> None:
        self.step = Step(self.drafter, self.optimizer, self.scheduler, self.frozen, self.objective,
                         attention_backend=self.attention_backend, clip_grad=self.clip_grad,
                         autocast_dtype=self.autocast_dtype)

    def accumulate(self, micro_batches: list[DrafterBatch]) -> None:
        """Forward, loss and backward of this step's micro-batches: their gradients add up."""
        for batch in micro_batches:
            (self.graphed or self.step).accumulate(batch)

    def update(self) -> StepResult:
        """Clip, AdamW and the LR schedule on the (summed) gradients; the step's numbers."""
        if self.graphed is not None:
            return self.graphed.update()
        return self.step.result(self.step.update())

    def take_gpu_wait(self) -> float:
        """Seconds the last steps waited for the GPU to catch up (graphed steps run ahead of it)."""
        return self.graphed.take_gpu_wait() if self.graphed is not None else 0.0


def init_drafter(config: DrafterConfig, seed: int) -> DFlashDrafter:
    """Weights drawn from N(0, 0.02) (norms at 1), as Hugging Face initialises Qwen3 layers."""
    generator = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        for module in drafter.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_to_identity()  # DFlash2 starts as the DFlash drafter with these weights
    return drafter


class FrozenPartsByDevice:
    """The target's embedding and head on each drafter device, copied once per device (once if
    tied), in the drafter's compute dtype there (`compute_dtype`): the head multiplies the
    drafter's hidden states, so a float32 run (`--precision fp32`) needs a float32 head even
    when the target is bf16."""

    def __init__(self, target: Target, config: TrainConfig):
        self.target = target
        self.config = config
        self._on: dict[torch.device, FrozenTargetParts] = {}

    def on(self, device: torch.device) -> FrozenTargetParts:
        if device not in self._on:
            dtype = compute_dtype(self.config, device)
            embed = self.target.embed_weight.detach()
            head = self.target.head_weight.detach()
            tied = embed.data_ptr() == head.data_ptr()
            embed = embed.to(device=device, dtype=dtype)
            head = embed if tied else head.to(device=device, dtype=dtype)
            spec = self.target.spec
            self._on[device] = FrozenTargetParts(embed, head, spec.input_embedding_scale, spec.final_logit_softcapping)
        return self._on[device]


def build_replicas(
    plan: DrafterPlan, config: TrainConfig, resume: ResumePoint, frozen: FrozenPartsByDevice,
    backends: dict[torch.device, str], nodes: NodeGroup | None = None,
) -> list[Replica]:
    """The drafter's weights (fresh or from its checkpoint) on each of its devices, with an
    optimizer and LR schedule each (restored on resume)."""
    checkpoint = resume.checkpoints.get(plan.name)
    if checkpoint is not None:
        base = load_drafter(checkpoint)  # its config was checked against the plan by `check_resumable`
    else:
        base = init_drafter(plan.drafter_config, plan.config.optimizer.seed)
    if nodes is not None:
        nodes.share_weights(base)
    replicas = []
    for rank, device in enumerate(plan.devices):
        model = copy.deepcopy(base).to(device)
        if compiles_drafter(config, device):
            # One graph per bucket for the whole drafter forward (flex inside it), so the
            # elementwise work around the matmuls fuses; the module itself stays
            # uncompiled, so checkpoints keep plain parameter names.
            model.forward = torch.compile(model.forward, dynamic=False)
        if plan.config.parallel.fp8 == "all":
            use_fp8_linears(model)
        optimizer = make_optimizer(model, plan.config.optimizer.lr, plan.config.optimizer.weight_decay,
                                   (plan.config.optimizer.adam_beta1, plan.config.optimizer.adam_beta2),
                                   master_weights=plan.config.parallel.master_weights == "on",
                                   compiled=compiles_drafter(config, device))
        scheduler = warmup_cosine(optimizer, config.optimizer.steps, plan.config.optimizer.warmup_ratio, plan.config.optimizer.min_lr_ratio)
        if checkpoint is not None:
            restore_trainer(checkpoint, optimizer, scheduler)
        replicas.append(Replica(
            name=plan.name, rank=rank, device=device, drafter=model, optimizer=optimizer, scheduler=scheduler,
            frozen=frozen.on(device), objective=plan.objective, layer_ids=plan.drafter_config.target_layer_ids,
            attention_backend=backends[device], autocast_dtype=autocast_dtype(config, device),
            clip_grad=plan.config.optimizer.clip_grad,
        ))
    return replicas
