"""One training step of a DFlash drafter, top to bottom.

A step takes one or more micro-batches of target features (already on this drafter's
device), runs the drafter over every anchored block under the DFlash mask, scores block
slots 1..B−1 through the frozen LM head, and updates the drafter:

    zero grads
    for each micro-batch:
        block inputs   = embed([anchor, MASK, ...]) at positions a, a+1, ..., a+B−1
        hidden         = drafter(target features, block inputs, DFlash mask)
        CE per slot    = chunked cross-entropy through the frozen head (scored slots only)
        (DFlash2)      + selector_weight · the candidate selector's CE over the head's top-k
        loss           = Σ w·CE / global normaliser            (so micro-batches and replicas add)
        backward
    sum gradients across replicas (if any)
    clip, check finite, AdamW step, LR schedule step

Nothing here knows about threads, files or the CLI.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention import make_mask
from .drafter import DFlashDrafter, embed_block_tokens, unwrap_drafter
from .fp8 import Fp8Weight
from .objective import (
    ObjectiveConfig,
    block_labels,
    block_metrics,
    block_token_ids,
    frozen_head_cross_entropy,
    frozen_head_top_k,
    loss_weights,
    weighted_loss,
)


@dataclass
class DrafterBatch:
    """One micro-batch as a drafter sees it, every tensor on the drafter's device."""

    target_features: torch.Tensor  # [b, S, n·hidden], the captured target layers, concatenated
    input_ids: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S] bool: tokens the target wrote (assistant tokens)
    anchors: torch.Tensor  # [b, N] sorted anchor positions, 0 in padded slots
    anchor_valid: torch.Tensor  # [b, N] bool
    loss_normalizer: float  # the global batch's Σ w (decay) or sequence count (D-PACE)
    scored_rows: int | None = None  # number of scored block slots, counted on the host (None: count on the device)


@dataclass
class FrozenTargetParts:
    """What the drafter borrows from the target, on the drafter's device; never trained or saved."""

    embed_weight: torch.Tensor  # [V, hidden]
    head_weight: torch.Tensor  # [V, hidden]
    embedding_scale: float = 1.0
    logit_softcap: float | None = None
    _head_fp8: Fp8Weight | None = field(default=None, init=False, repr=False)

    def head_fp8(self) -> Fp8Weight:
        """The head quantised for FP8 products, once (it never changes)."""
        if self._head_fp8 is None:
            self._head_fp8 = Fp8Weight.of(self.head_weight)
        return self._head_fp8


def drafter_loss(
    drafter: DFlashDrafter,
    frozen: FrozenTargetParts,
    batch: DrafterBatch,
    objective: ObjectiveConfig,
    attention_backend: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFlash training loss of one micro-batch and its metric sums."""
    hidden, labels, label_valid = block_predictions(drafter, frozen, batch, attention_backend)
    # Only scored slots go through the head: slot 0, padded anchors and unsupervised
    # targets would cost vocabulary-sized matmuls for a zero weight.
    rows = scored_slot_index(label_valid, batch.scored_rows)
    scored_ce, scored_correct = head_cross_entropy(hidden, labels, rows, frozen, objective)
    ce = slot_grid(scored_ce, rows, label_valid)
    correct = slot_grid(scored_correct, rows, label_valid)

    if unwrap_drafter(drafter).candidate_selector is None:
        loss = weighted_loss(ce, label_valid, objective, batch.loss_normalizer)
        return loss, block_metrics(correct, label_valid, batch.anchor_valid)
    selector_ce, selector_correct = selector_cross_entropy(drafter, hidden, labels, rows, frozen, objective)
    loss = dflash2_loss(ce, slot_grid(selector_ce, rows, label_valid), label_valid, objective) / max(batch.loss_normalizer, 1e-12)
    # The selector's teacher-forced top-1 is the proposal while the block's drafts are right so far,
    # so its leading correct slots are exactly what a greedy verify accepts (simulated τ).
    return loss, block_metrics(slot_grid(selector_correct, rows, label_valid), label_valid, batch.anchor_valid)


def slot_grid(values: torch.Tensor, rows: torch.Tensor, label_valid: torch.Tensor) -> torch.Tensor:
    """Per-row values of the scored slots `rows` laid out as label_valid's grid [b, N, B] (zeros elsewhere)."""
    grid = torch.zeros(label_valid.numel(), dtype=values.dtype, device=values.device)
    return grid.index_copy(0, rows, values).view(label_valid.shape)


def dflash2_loss(ce: torch.Tensor, selector_ce: torch.Tensor, label_valid: torch.Tensor, objective: ObjectiveConfig) -> torch.Tensor:
    """Σ w·(CE + selector_weight · selector CE), w the backbone's slot weights (decay or D-PACE)."""
    weights = loss_weights(ce, label_valid, objective)
    return (weights * (ce + objective.selector_weight * selector_ce)).sum()


def selector_cross_entropy(
    drafter: DFlashDrafter, hidden: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, frozen: FrozenTargetParts,
    objective: ObjectiveConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFlash2 selector's CE and top-1 correctness on the block slots `rows` (flat indices
    into hidden [b, N·B, H] and labels [b, N, B]), with the true previous token (for slot 1, the
    anchor) as predecessor; a slot whose token is outside the head's top-k follows
    `objective.selector_miss` (CE 0 and never correct when dropped)."""
    selector = unwrap_drafter(drafter).candidate_selector
    slot_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    slot_labels = labels.flatten()[rows]
    predecessors = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1).flatten()[rows]
    unary, candidates, label_logits = frozen_head_top_k(
        slot_hidden.detach(), frozen.head_weight, slot_labels, selector.top_k, chunk_rows=objective.loss_chunk_rows,
        softcap=frozen.logit_softcap)
    ce, correct, _ = selector.teacher_forced(slot_hidden, unary, candidates, predecessors, slot_labels, label_logits,
                                             objective.selector_miss)
    return ce, correct


def head_cross_entropy(
    hidden: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, frozen: FrozenTargetParts, objective: ObjectiveConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """CE and top-1 correctness of the block slots `rows` (flat indices into hidden [b, N·B, H]
    and labels [b, N, B]) through the frozen head, as the objective runs it."""
    return frozen_head_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), frozen.head_weight, labels.flatten()[rows],
        chunk_rows=objective.loss_chunk_rows, softcap=frozen.logit_softcap, compiled=objective.compiled_head,
        fused=objective.fused_head, fp8_head=frozen.head_fp8() if objective.fp8_head else None,
    )


def block_predictions(
    drafter: DFlashDrafter, frozen: FrozenTargetParts, batch: DrafterBatch, attention_backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's final hidden states [b, N·B, hidden] for every anchored block, with the
    labels [b, N, B] they predict and which of those are scored."""
    block_size = drafter.config.block_size
    context_len = batch.input_ids.shape[1]

    block_ids = block_token_ids(batch.input_ids, batch.anchors, block_size, drafter.config.mask_token_id)
    block_embeds = embed_block_tokens(block_ids.flatten(1), frozen.embed_weight, frozen.embedding_scale)
    offsets = torch.arange(block_size, device=batch.anchors.device)
    block_positions = (batch.anchors[..., None] + offsets).flatten(1)

    mask = make_mask(attention_backend, batch.anchors, context_len, block_size)
    hidden = drafter(batch.target_features, block_embeds, block_positions, mask)

    labels, label_valid = block_labels(batch.input_ids, batch.loss_mask, batch.anchors, batch.anchor_valid, block_size)
    return hidden, labels, label_valid


def scored_slot_index(label_valid: torch.Tensor, count: int | None) -> torch.Tensor:
    """Flat indices of the scored slots. With the count known on the host the output size is
    static, so the compaction does not stall the host on the device mid-step."""
    flat = label_valid.flatten()
    if count is None:
        return torch.nonzero(flat).squeeze(1)
    return torch.nonzero_static(flat, size=count).squeeze(1)


@dataclass
class StepResult:
    loss: float  # this replica's share: replicas' losses add up to the global batch loss
    grad_norm: float
    skipped: bool  # non-finite gradients: the update was not applied
    lr: float
    metric_sums: dict[str, torch.Tensor]


def training_step(
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[DrafterBatch],
    frozen: FrozenTargetParts,
    objective: ObjectiveConfig,
    *,
    attention_backend: str,
    clip_grad: float,
    autocast_dtype: torch.dtype | None,
    sync_gradients: Callable[[], None] | None = None,
) -> StepResult:
    optimizer.zero_grad(set_to_none=True)
    device_type = micro_batches[0].input_ids.device.type
    total_loss = torch.zeros((), device=micro_batches[0].input_ids.device)
    sums: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        autocast = (
            torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        )
        with autocast:
            loss, metrics = drafter_loss(drafter, frozen, batch, objective, attention_backend)
        loss.backward()
        total_loss += loss.detach()
        for name, value in metrics.items():
            sums[name] = sums[name] + value if name in sums else value

    if sync_gradients is not None:
        sync_gradients()
    if optimizer.defaults.get("fused"):
        grad_norm = clipped_fused_step(optimizer, drafter, clip_grad)
    else:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), clip_grad))
        if math.isfinite(grad_norm):
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
    skipped = not math.isfinite(grad_norm)
    lr = optimizer.param_groups[0]["lr"]
    scheduler.step()
    return StepResult(float(total_loss), grad_norm, skipped, lr, {k: v.detach().cpu() for k, v in sums.items()})


def clipped_fused_step(optimizer: torch.optim.Optimizer, drafter: DFlashDrafter, clip_grad: float) -> float:
    """Clip by global norm and skip non-finite steps inside the fused AdamW kernel.

    The fused kernel divides every gradient by `grad_scale` and leaves parameters and moments
    untouched where `found_inf` is set (the hooks mixed-precision loss scaling uses), so the
    clip costs no extra pass over the gradients and the update needs no host sync first.
    Same result as clip_grad_norm_ (scale min(1, clip / (norm + 1e-6))) then step-or-skip.
    """
    norm, _ = fused_clip_and_step(optimizer, [p.grad for p in drafter.parameters() if p.grad is not None], clip_grad)
    return float(norm)


def fused_clip_and_step(
    optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], clip_grad: float, skip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clip and finiteness rule of `clipped_fused_step` on the device, no host sync: returns
    the gradient norm and the skip flag (1.0: the update was not applied). `skip` forces a skip."""
    norm = torch.nn.utils.get_total_norm(grads)
    found_inf = (~torch.isfinite(norm)).float()
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / clip_grad, min=1.0)
    optimizer.found_inf = found_inf if skip is None else torch.maximum(found_inf, skip)
    try:
        optimizer.step()
        return norm, optimizer.found_inf
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """Linear warm-up then cosine decay to min_lr_ratio × peak."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(drafter: DFlashDrafter, lr: float, weight_decay: float, betas: tuple[float, float]):
    # Fused AdamW where the device supports it: one kernel per step instead of one per tensor.
    fused = next(drafter.parameters()).device.type == "cuda"
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
