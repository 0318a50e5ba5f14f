"""The numeric policy of a run, per device: what compiles (the drafter, the target's feature
forward), which attention backend runs, the dtype the drafter computes in, whether the frozen
head runs as the fused kernel, and whether --fp8 can run."""

from __future__ import annotations

from typing import TextIO

import torch

from ..config import ConfigError, TrainConfig, on_here
from ..core.attention import resolve_backend
from ..core.fp8 import check_fp8_dims, fp8_unsupported
from ..core.objective import fused_head_segment, fused_head_unsupported
from ..target.model import Target, family_kind
from .layout import DrafterPlan, Layout


def compiles_drafter(config: TrainConfig, device: torch.device) -> bool:
    return on_here(config.parallel.compile, device.type)


def compiles_target(config: TrainConfig, device: torch.device, target: Target) -> bool:
    """Whether the target's feature forward on `device` is compiled before its capture (only
    under CUDA graphs: train/feature_graphs.py): wherever --compile compiles, under auto only
    for a dense target (a hybrid's or MoE's compile took minutes at real shapes and yielded no
    compiled graph: the MoE's was refused, the hybrid's pure-torch delta rule never finished)."""
    if config.parallel.compile_target == "off" or not compiles_drafter(config, device):
        return False
    return config.parallel.compile_target == "on" or family_kind(target.model.config) == "dense"


def uncompiled_target_note(config: TrainConfig, devices: list[torch.device], target: Target) -> str | None:
    """The start line's note where --compile-target auto alone keeps the target's feature forward
    on `devices` uncompiled (its family is not dense), else None."""
    kind = family_kind(target.model.config)
    if config.parallel.compile_target != "auto" or kind == "dense" or not any(compiles_drafter(config, d) for d in devices):
        return None
    return (f"target feature forward: captured uncompiled (--compile-target auto compiles dense targets only; "
            f"this target is {kind}; --compile-target on compiles it)")


def attention_backends(config: TrainConfig, layout: Layout) -> dict[torch.device, str]:
    return {d: resolve_backend(config.parallel.attention, d) for d in layout.drafter_devices}


def autocast_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    use_bf16 = config.parallel.precision == "bf16" or (config.parallel.precision == "auto" and device.type == "cuda")
    return torch.bfloat16 if use_bf16 else None


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype the drafter computes in on `device`: bf16 under autocast, else float32."""
    return autocast_dtype(config, device) or torch.float32


def uses_fused_head(plan: DrafterPlan, softcap: float | None, log: TextIO) -> bool:
    """Whether the frozen head's softmax runs as core/head_kernel.py's fused kernel: on every CUDA device
    of the drafter where it matched the reference (objective.fused_head_unsupported), else the
    compiled chunk, with the reason in the log. A DFlash2 drafter's kernel also writes the slice
    maxima its selector's candidates are ranked by, and is checked with them."""
    segment = fused_head_segment(plan.config.model.arch, plan.drafter_config.vocab_size)
    for device in plan.devices:
        reason = fused_head_unsupported(device, softcap, segment)
        if reason is not None:
            if device.type == "cuda":
                print(f"{plan.name}: frozen head: the compiled softmax, not the fused kernel ({reason})", file=log)
            return False
    print(f"{plan.name}: frozen head: the fused softmax kernel", file=log)
    return True


def check_fp8_support(plan: DrafterPlan, target: Target) -> None:
    """--fp8 needs FP8 products on every device of the drafter and 16-aligned model dims."""
    spec = target.spec
    dims = {"hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size}
    if plan.config.parallel.fp8 == "all":
        dims.update(intermediate_size=spec.intermediate_size, **{
            "num_attention_heads × head_dim": spec.num_attention_heads * spec.head_dim,
            "num_key_value_heads × head_dim": spec.num_key_value_heads * spec.head_dim,
        })
        if plan.config.model.arch == "dflash2":  # its kernel projections and selector projection are linears too
            dims.update({"2 × conv_kernel_size × hidden_size / conv_group_size":
                         2 * plan.config.model.conv_kernel_size * (spec.hidden_size // plan.config.model.conv_group_size),
                         "selector_rank": plan.config.model.selector_rank})
    try:
        check_fp8_dims(dims)
    except ValueError as error:
        raise ConfigError(f"{plan.name}: {error}") from None
    for device in plan.devices:
        reason = fp8_unsupported(device)
        if reason:
            raise ConfigError(f"{plan.name}: --fp8 {plan.config.parallel.fp8}: {reason}; use --fp8 off")
