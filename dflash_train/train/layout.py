"""Who runs where: the devices of the worker threads (`Layout`), one plan per drafter to train
(`DrafterPlan`), and how many micro-batches of a step each node trains (`step_share`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig
from ..core.attention import FLEX_BACKENDS, flash_kernels_missing
from ..core.drafter import DrafterConfig
from ..core.objective import ObjectiveConfig
from ..parallel.launch import Launch, place_devices
from ..parallel.nodes import NodeGroup
from ..target.model import resolve_device


@dataclass(frozen=True)
class Layout:
    """Devices of the target worker threads and of the drafter worker threads (several threads
    may share a device; a one-device run is one target thread and one drafter thread on it)."""

    target_devices: list[torch.device]
    drafter_devices: list[torch.device]

    @property
    def uses_cuda(self) -> bool:
        return any(d.type == "cuda" for d in [*self.target_devices, *self.drafter_devices])


def resolve_layout(config: TrainConfig, launch: Launch | None = None) -> Layout:
    targets, drafters = place_devices([
        [resolve_device(d) for d in (config.parallel.target_devices or [config.parallel.device])],
        [resolve_device(d) for d in (config.parallel.drafter_devices or [config.parallel.device])],
    ], launch)
    layout = Layout(targets, drafters)
    attention = config.parallel.attention
    if attention == "flash" and (missing := flash_kernels_missing()):
        raise ConfigError(f"--attention flash: {missing}; use --attention flex or auto")
    on_cpu = [str(d) for d in layout.drafter_devices if d.type != "cuda"]
    if attention in FLEX_BACKENDS and on_cpu:
        raise ConfigError(f"--attention {attention}: flex attention has no backward pass on {', '.join(on_cpu)} (it "
                          "trains on CUDA only); use --attention sdpa or auto")
    if attention == "flash" and (before_hopper := [str(d) for d in layout.drafter_devices
                                                   if torch.cuda.get_device_capability(d)[0] < 9]):
        raise ConfigError(f"--attention flash: FlashAttention-4 trains on Hopper or newer GPUs, not "
                          f"{', '.join(before_hopper)}; use --attention flex or auto")
    master = [config.parallel.master_weights, *(v.master_weights for v in config.parallel.variants)]
    if "on" in master and config.parallel.precision == "auto" and on_cpu:
        raise ConfigError(f"--master-weights on keeps bf16 parameters, and --precision auto trains in float32 on "
                          f"{', '.join(on_cpu)}; use --precision bf16 or --master-weights off")
    return layout


@dataclass
class DrafterPlan:
    """One drafter to train: its settings, folder, and the devices of its replicas."""

    name: str
    config: TrainConfig
    run_dir: Path
    devices: list[torch.device]
    drafter_config: DrafterConfig | None = None  # set by `describe_drafters`
    objective: ObjectiveConfig | None = None


def plan_drafters(config: TrainConfig, layout: Layout) -> list[DrafterPlan]:
    out = Path(config.checkpoint.out)
    if config.parallel.mode == "replicas":
        return [DrafterPlan("drafter", config, out, list(layout.drafter_devices))]
    devices = layout.drafter_devices
    return [DrafterPlan(name, variant, out / name, [devices[i % len(devices)]])
            for i, (name, variant) in enumerate(config.variant_configs())]


def layer_union(plans: list[DrafterPlan]) -> list[int]:
    """Every target layer some drafter reads: what the target workers capture."""
    return sorted({k for plan in plans for k in plan.drafter_config.target_layer_ids})


def step_share(config: TrainConfig, plans: list[DrafterPlan], nodes: NodeGroup) -> tuple[int, range]:
    """Micro-batches per step over every node (nodes × replicas × grad_accum), and the
    contiguous range of them this node trains."""
    local = (len(plans[0].devices) if config.parallel.mode == "replicas" else 1) * config.optimizer.grad_accum
    return local * nodes.world_size, range(nodes.rank * local, (nodes.rank + 1) * local)
