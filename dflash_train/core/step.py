"""One training step of a DFlash drafter, top to bottom: the phases a loop calls, eagerly or captured.

A step takes one or more micro-batches of target features (already on this drafter's device),
runs the drafter over every anchored block under the DFlash mask, scores block slots 1..B−1
through the frozen LM head, and updates the drafter. `Step` holds one replica's persistent state
(gradients, sums, lr tensors, the output buffer) and its phases:

    Step.accumulate(batch)      for each micro-batch:
        (packed)       its rows end to end with only their valid anchors (`pack_rows`)
        block inputs   = embed([anchor, MASK, ...]) at positions a, a+1, ..., a+B−1
        hidden         = drafter(target features, block inputs, DFlash mask)
        CE per slot    = chunked cross-entropy through the frozen head (scored slots only)
        (DFlash2)      + selector_weight · the candidate selector's CE over the head's top-k
        loss           = Σ w·CE × the float32 reciprocal of the global normaliser
                         (so micro-batches and replicas add)
        backward       (the gradients add into persistent buffers, or the first backward's
                        own gradient tensors become them: `Step.hand_over_gradients`)
    the loop sums the gradients across replicas and nodes here, and votes whether to go on
    Step.update()               clip, check finite, AdamW, zero (or drop) the gradients, LR schedule step
    Step.result(lr)             the step's numbers, read back on the host

Eagerly these run as they are (`Step.run`: every phase in order, no reduction). CUDA graphs
(train/step_graphs.py) capture the same two phases per shape bucket; for that nothing in them may
depend on a host value that changes between steps:

    StaticInputs   one set of device buffers per length bucket; each micro-batch is copied in
    rows           the head rows: the host's scored-slot count rounded up to a rows bucket
                   (`rows_bucket`); padding rows go through the head on a real row's state and
                   land in a dump slot the loss never reads, so no real row's CE or gradient changes
    normaliser     its reciprocal is a device tensor filled per micro-batch
    lr             read from device tensors (`Step.lr_from_tensors`), filled before each update

Nothing here knows about threads, files, graphs or the CLI.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention import make_mask
from .dflash2 import CandidateSelector
from .drafter import DFlashDrafter, embed_block_tokens, unwrap_drafter
from .fp8 import Fp8Weight
from .master_weights import MasterWeightAdamW
from .objective import (
    HeadCandidates,
    ObjectiveConfig,
    block_labels,
    block_metrics,
    block_token_ids,
    frozen_head_cross_entropy_and_candidates,
    loss_weights,
)

METRICS = ("position_correct", "position_count", "accepted_sum", "blocks")  # block_metrics' sums, in output order


def inverse_normalizer(normalizer: float) -> float:
    """1 / max(normaliser, 1e-12) rounded as float32 arithmetic rounds it (what CUDA multiplies by
    for `/ host number`), so a host float and a device tensor scale the loss alike."""
    one = torch.ones((), dtype=torch.float32)
    return float(one / torch.tensor(max(normalizer, 1e-12), dtype=torch.float32))


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
    row_length: int | None = None  # packed (`pack_rows`): one row holding rows of this length end to end
    anchor_count: int | None = None  # number of valid anchors, counted on the host (None: count on the device)

    @property
    def inverse_normalizer(self) -> float:
        return inverse_normalizer(self.loss_normalizer)


def pack_rows(batch: DrafterBatch, capacity: int) -> DrafterBatch:
    """The micro-batch as one row: its b rows of S positions end to end (b·S context positions,
    each row's positions starting again at 0) and only its valid anchors, row r's anchor a as
    r·S + a, in `capacity` slots. Padded anchor slots cost the drafter a whole block each; packed,
    the drafter runs capacity blocks instead of b·N. The mask keeps each query inside its own row,
    so the loss, metrics and gradients are the padded layout's (to float summation order).

    `capacity` must hold the valid anchors (more are dropped: the caller knows the count on the
    host); the rest of the slots are padding as before (anchor 0, invalid). No host sync."""
    b, length = batch.input_ids.shape
    device = batch.anchors.device
    valid = batch.anchor_valid.flatten()
    numbered = (batch.anchors + torch.arange(b, device=device)[:, None] * length).flatten()
    take = padded_slot_index(valid, capacity)  # valid slots in order, then one past the last
    anchors = torch.cat([numbered, numbered.new_zeros(1)]).index_select(0, take)
    anchor_valid = torch.cat([valid, valid.new_zeros(1)]).index_select(0, take)
    return DrafterBatch(
        target_features=batch.target_features.reshape(1, b * length, batch.target_features.shape[-1]),
        input_ids=batch.input_ids.reshape(1, b * length),
        loss_mask=batch.loss_mask.reshape(1, b * length),
        anchors=anchors[None], anchor_valid=anchor_valid[None],
        loss_normalizer=batch.loss_normalizer, scored_rows=batch.scored_rows, row_length=length,
        anchor_count=batch.anchor_count,
    )


def anchor_capacity(valid_anchors: int, num_anchors: int) -> int:
    """The anchor slots a packed micro-batch runs: whole rows' worth of N slots, the fewest that hold
    its valid anchors, so a batch of b rows has at most b packed shapes to compile and capture."""
    return max(1, -(-valid_anchors // num_anchors)) * num_anchors


def packed(batch: DrafterBatch, num_anchors: int) -> DrafterBatch:
    """`pack_rows` at the capacity the batch's valid anchors need (counted on the host where given)."""
    count = batch.anchor_count if batch.anchor_count is not None else int(batch.anchor_valid.sum())
    return pack_rows(batch, anchor_capacity(count, num_anchors))


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


# --- static shapes -----------------------------------------------------------------------------

def rows_bucket(count: int, granule: int) -> int:
    """The rows a micro-batch with `count` scored slots is padded to: the next multiple of `granule`
    (the head's chunk rows: a compiled head pads its last chunk to that size anyway)."""
    return max(1, -(-count // granule)) * granule


def rows_buckets(max_rows: int, granule: int) -> list[int]:
    """Every rows bucket a micro-batch of at most `max_rows` scored slots can fall into."""
    return [granule * k for k in range(1, rows_bucket(max_rows, granule) // granule + 1)]


@dataclass(frozen=True)
class InputShape:
    """What one shape bucket's buffers hold: a length bucket's micro-batches, or (packed) one row
    of batch_size rows of `row_length` with `num_anchors` slots."""

    batch_size: int
    length: int
    num_anchors: int
    feature_width: int
    feature_dtype: torch.dtype
    row_length: int | None = None

    @classmethod
    def of(cls, batch: "DrafterBatch") -> "InputShape":
        features = batch.target_features
        return cls(features.shape[0], features.shape[1], batch.anchors.shape[1], features.shape[-1], features.dtype,
                   batch.row_length)


class StaticInputs:
    """One length bucket's device buffers, read by every captured step of that bucket; attribute
    names are DrafterBatch's, so `drafter_loss` reads either (the head rows are given with them)."""

    scored_rows = None  # a captured step's rows are its rows bucket, passed to `accumulate`

    def __init__(self, shape: InputShape, device: torch.device):
        b, length, n = shape.batch_size, shape.length, shape.num_anchors
        self.shape, self.row_length = shape, shape.row_length
        self.target_features = torch.zeros(b, length, shape.feature_width, dtype=shape.feature_dtype, device=device)
        self.input_ids = torch.zeros(b, length, dtype=torch.long, device=device)
        self.loss_mask = torch.zeros(b, length, dtype=torch.bool, device=device)
        self.anchors = torch.zeros(b, n, dtype=torch.long, device=device)
        self.anchor_valid = torch.zeros(b, n, dtype=torch.bool, device=device)
        self.inverse_normalizer = torch.ones((), dtype=torch.float32, device=device)

    def holds(self, batch: DrafterBatch) -> bool:
        return (tuple(batch.target_features.shape) == tuple(self.target_features.shape)
                and tuple(batch.anchors.shape) == tuple(self.anchors.shape) and batch.row_length == self.row_length)

    def fill(self, batch: DrafterBatch) -> None:
        """Copy a micro-batch in, in stream order (no host sync)."""
        if not self.holds(batch):
            raise ValueError(f"a micro-batch of features {tuple(batch.target_features.shape)} and anchors "
                             f"{tuple(batch.anchors.shape)} does not fit buffers of {self.shape}")
        for name in ("target_features", "input_ids", "loss_mask", "anchors", "anchor_valid"):
            getattr(self, name).copy_(getattr(batch, name), non_blocking=True)
        self.inverse_normalizer.fill_(batch.inverse_normalizer)


# --- the loss ----------------------------------------------------------------------------------

def drafter_loss(
    drafter: DFlashDrafter,
    frozen: FrozenTargetParts,
    batch: DrafterBatch | StaticInputs,
    objective: ObjectiveConfig,
    attention_backend: str,
    rows: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFlash training loss of one micro-batch and its metric sums. `rows`: how many rows go
    through the head (>= the scored slots; default the batch's host count, else counted on the
    device, which waits for it)."""
    hidden, labels, label_valid = block_predictions(drafter, frozen, batch, attention_backend)
    # Only scored slots go through the head: slot 0, padded anchors and unsupervised targets
    # would cost vocabulary-sized matmuls for a zero weight. Padding rows (past the scored
    # slots) read a real row's state and their CE lands in a dump slot, sliced off: zero gradient.
    slots = label_valid.numel()
    rows = batch.scored_rows if rows is None else rows
    into = padded_slot_index(label_valid.flatten(), rows) if rows is not None else torch.nonzero(label_valid.flatten()).squeeze(1)
    source = into.clamp(max=slots - 1)
    selector = unwrap_drafter(drafter).candidate_selector
    scored_ce, scored_correct, candidates = head_cross_entropy(
        hidden, labels, source, frozen, objective, top_k=0 if selector is None else selector.top_k)
    ce = slot_grid(scored_ce, into, label_valid)
    if selector is None:
        loss = (loss_weights(ce, label_valid, objective) * ce).sum() * batch.inverse_normalizer
        return loss, block_metrics(slot_grid(scored_correct, into, label_valid), label_valid, batch.anchor_valid)
    selector_ce, selector_correct = selector_cross_entropy(selector, hidden, labels, source, candidates, objective)
    loss = dflash2_loss(ce, slot_grid(selector_ce, into, label_valid), label_valid, objective) * batch.inverse_normalizer
    # The selector's teacher-forced top-1 is the proposal while the block's drafts are right so far,
    # so its leading correct slots are exactly what a greedy verify accepts (simulated τ).
    return loss, block_metrics(slot_grid(selector_correct, into, label_valid), label_valid, batch.anchor_valid)


def padded_slot_index(scored: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows]: the positions of the True entries of `scored` in order (what nonzero_static gives),
    then `scored.numel()` (one past the last: the dump slot) for the padding rows. Elementwise ops
    and one scatter, so it captures on any torch; a host count above `rows` would drop rows, so
    the caller's rows bucket must hold it."""
    slots = scored.numel()
    rank = torch.cumsum(scored, 0) - 1  # each scored slot's place among the scored ones
    place = torch.where(scored & (rank < rows), rank, rows)  # unscored slots: the extra entry, dropped
    index = torch.full((rows + 1,), slots, dtype=torch.long, device=scored.device)
    index.scatter_(0, place, torch.arange(slots, device=scored.device))
    return index[:rows]


def slot_grid(values: torch.Tensor, into: torch.Tensor, label_valid: torch.Tensor) -> torch.Tensor:
    """Per-row values laid out as label_valid's grid [b, N, B] at the flat slots `into` (zeros
    elsewhere; rows aimed at the dump slot one past the last are dropped)."""
    grid = torch.zeros(label_valid.numel() + 1, dtype=values.dtype, device=values.device)
    return grid.index_copy(0, into, values)[:-1].view(label_valid.shape)


def dflash2_loss(ce: torch.Tensor, selector_ce: torch.Tensor, label_valid: torch.Tensor, objective: ObjectiveConfig) -> torch.Tensor:
    """Σ w·(CE + selector_weight · selector CE), w the backbone's slot weights (decay or D-PACE)."""
    weights = loss_weights(ce, label_valid, objective)
    return (weights * (ce + objective.selector_weight * selector_ce)).sum()


def selector_cross_entropy(
    selector: CandidateSelector, hidden: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor,
    candidates: HeadCandidates, objective: ObjectiveConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFlash2 selector's CE and top-1 correctness on the block slots `rows` (flat indices
    into hidden [b, N·B, H] and labels [b, N, B]; `candidates` are the head's for those rows),
    with the true previous token (for slot 1, the anchor) as predecessor; a slot whose token is
    outside the head's top-k follows `objective.selector_miss` (CE 0 and never correct when dropped)."""
    slot_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    slot_labels = labels.flatten()[rows]
    predecessors = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1).flatten()[rows]
    ce, correct, _ = selector.teacher_forced(slot_hidden, candidates.values, candidates.ids, predecessors, slot_labels,
                                             candidates.label_logits, objective.selector_miss)
    return ce, correct


def head_cross_entropy(
    hidden: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, frozen: FrozenTargetParts, objective: ObjectiveConfig,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, HeadCandidates]:
    """CE and top-1 correctness of the block slots `rows` (flat indices into hidden [b, N·B, H]
    and labels [b, N, B]) through the frozen head, as the objective runs it, and for `top_k` the
    DFlash2 selector's candidates from the same logits."""
    return frozen_head_cross_entropy_and_candidates(
        hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), frozen.head_weight, labels.flatten()[rows], top_k,
        chunk_rows=objective.loss_chunk_rows, softcap=frozen.logit_softcap, compiled=objective.compiled_head,
        fused=objective.fused_head, fp8_head=frozen.head_fp8() if objective.fp8_head else None,
    )


def block_predictions(
    drafter: DFlashDrafter, frozen: FrozenTargetParts, batch: DrafterBatch | StaticInputs, attention_backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's final hidden states [b, N·B, hidden] for every anchored block, with the
    labels [b, N, B] they predict and which of those are scored."""
    block_size = drafter.config.block_size
    context_len, row_length = batch.input_ids.shape[1], batch.row_length

    block_ids = block_token_ids(batch.input_ids, batch.anchors, block_size, drafter.config.mask_token_id)
    block_embeds = embed_block_tokens(block_ids.flatten(1), frozen.embed_weight, frozen.embedding_scale)
    offsets = torch.arange(block_size, device=batch.anchors.device)
    positions_in_row = batch.anchors % row_length if row_length is not None else batch.anchors
    block_positions = (positions_in_row[..., None] + offsets).flatten(1)

    mask = make_mask(attention_backend, batch.anchors, context_len, block_size, row_length)
    hidden = drafter(batch.target_features, block_embeds, block_positions, mask, row_length)

    labels, label_valid = block_labels(batch.input_ids, batch.loss_mask, batch.anchors, batch.anchor_valid, block_size,
                                       row_length)
    return hidden, labels, label_valid


# --- the update --------------------------------------------------------------------------------

def fused_clip_and_step(
    optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], clip_grad: float, skip: torch.Tensor | None = None,
    lrs: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip by global norm and skip non-finite steps inside the fused AdamW kernel, no host sync:
    returns the gradient norm and the skip flag (1.0: the update was not applied). `skip` forces
    a skip; `lrs` (one device tensor per param group) replace the groups' float lrs while it runs.

    The fused kernel divides every gradient by `grad_scale` and leaves parameters and moments
    untouched where `found_inf` is set (the hooks mixed-precision loss scaling uses), so the
    clip costs no extra pass over the gradients and the update needs no host sync first.
    Same result as clip_grad_norm_ (scale min(1, clip / (norm + 1e-6))) then step-or-skip.
    Between steps the groups hold the schedule's floats, so checkpoints and the LR scheduler see
    nothing else.
    """
    groups = optimizer.param_groups
    saved = [(group["lr"], group.get("capturable", False)) for group in groups]
    if lrs is not None:
        capturing = grads[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
            group["capturable"] = group.get("capturable", False) or capturing  # the optimizer refuses capture otherwise
    # In float32 whatever the gradients' dtype: bf16 gradients (master weights) would round the clip.
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
    found_inf = (~torch.isfinite(norm)).float()
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / clip_grad, min=1.0)
    optimizer.found_inf = found_inf if skip is None else torch.maximum(found_inf, skip)
    try:
        optimizer.step()
        return norm, optimizer.found_inf
    finally:
        del optimizer.grad_scale, optimizer.found_inf
        for group, (lr, capturable) in zip(groups, saved):
            group["lr"], group["capturable"] = lr, capturable


@dataclass
class StepResult:
    loss: float  # this replica's share: replicas' losses add up to the global batch loss
    grad_norm: float
    skipped: bool  # non-finite gradients: the update was not applied
    lr: float
    metric_sums: dict[str, torch.Tensor]

    @classmethod
    def parse(cls, outputs: torch.Tensor, lr: float, block_size: int) -> "StepResult":
        """A step from `Step.outputs` (on the host)."""
        values, b = outputs.clone(), block_size
        metrics = {"position_correct": values[3:3 + b], "position_count": values[3 + b:3 + 2 * b],
                   "accepted_sum": values[3 + 2 * b], "blocks": values[4 + 2 * b]}
        return cls(float(values[0]), float(values[1]), bool(values[2] > 0), lr, metrics)


# --- the step ----------------------------------------------------------------------------------

class Step:
    """One replica's persistent step state (gradients, sums, lr tensors, outputs) and the phases a
    step is made of (the module docstring). `apply` is the update's device part: `apply_update`,
    or a captured replay of it. The gradients are the parameters' own `.grad` tensors, made once
    and zeroed by each update: captured graphs hold them, so nothing may set them to None
    (`zero_grad(set_to_none=True)`) while the Step is in use, unless `hand_over_gradients` made
    it an eager step that drops them itself."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        frozen: FrozenTargetParts,
        objective: ObjectiveConfig,
        *,
        attention_backend: str,
        clip_grad: float,
        autocast_dtype: torch.dtype | None,
    ):
        self.drafter, self.optimizer, self.scheduler, self.frozen, self.objective = (
            drafter, optimizer, scheduler, frozen, objective)
        self.attention_backend, self.clip_grad, self.autocast_dtype = attention_backend, clip_grad, autocast_dtype
        self.fused = bool(optimizer.defaults.get("fused"))  # else the update checks finiteness on the host
        self.lr_from_tensors = False  # the update reads its lr from `lrs` (captured updates; needs fused AdamW)
        # The drafter's own parameters (their gradients), not the optimizer's tensors: with master
        # weights those are float32 masters of these bf16 parameters.
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.gradient_buffers = True  # False: hand_over_gradients
        self.fill_missing_gradients()  # the persistent buffers, made once
        zeros = dict(device=self.device, dtype=torch.float32)
        block = drafter.config.block_size
        self.loss_sum = torch.zeros((), **zeros)
        self.metric_sums = {"position_correct": torch.zeros(block, **zeros), "position_count": torch.zeros(block, **zeros),
                            "accepted_sum": torch.zeros((), **zeros), "blocks": torch.zeros((), **zeros)}
        self.lrs = [torch.zeros((), **zeros) for _ in optimizer.param_groups]
        self.force_skip = torch.zeros((), **zeros)  # 1.0 makes the update a no-op (warm-ups)
        self.outputs = torch.zeros(3 + 2 * block + 2, **zeros)  # loss, grad norm, skipped, METRICS
        self.apply: Callable[[], None] = self.apply_update

    def hand_over_gradients(self) -> None:
        """Eager steps only: the update drops the gradients instead of zeroing them, so the next
        backward's gradient tensors become the parameters' `.grad` without a copy (autograd keeps
        a new gradient as it is where `.grad` is None). Saves a zeroing pass and an add over
        every parameter per step (4 bytes read twice and written twice each, float32 master
        weights); the values are the same (0 + g = g). Captured graphs need the buffers."""
        self.gradient_buffers = False
        self.drop_gradients()

    def fill_missing_gradients(self) -> None:
        """A zero gradient for each parameter without one: the buffers at the start, and, with
        handed-over gradients, one this step's backward did not reach, as a buffer would be (AdamW
        skips a parameter whose gradient is None, and its moments and decay would then differ)."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    @property
    def grads(self) -> list[torch.Tensor]:
        """The parameters' gradients now (`fill_missing_gradients`)."""
        self.fill_missing_gradients()
        return [p.grad for p in self.params]

    @torch.no_grad()
    def drop_gradients(self) -> None:
        """Gradients to zero: the buffers zeroed, or (handed-over gradients) released."""
        if self.gradient_buffers:
            torch._foreach_zero_(self.grads)
        else:
            for param in self.params:
                param.grad = None

    def run(self, micro_batches: list[DrafterBatch]) -> StepResult:
        """One whole step with nothing between the phases (one replica, one node), read back now."""
        for batch in micro_batches:
            self.accumulate(batch)
        return self.result(self.update())

    def accumulate(self, batch: DrafterBatch | StaticInputs, rows: int | None = None) -> None:
        """Forward, loss and backward of one micro-batch (`rows`: see `drafter_loss`); gradients,
        loss and metric sums add to what earlier micro-batches of the step left."""
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else contextlib.nullcontext())
        if isinstance(batch, DrafterBatch):
            batch = self.layout(batch)
        with autocast:
            loss, metrics = drafter_loss(self.drafter, self.frozen, batch, self.objective, self.attention_backend, rows)
        loss.backward()
        with torch.no_grad():
            self.loss_sum += loss.detach()
            for name in METRICS:
                self.metric_sums[name] += metrics[name]

    def layout(self, batch: DrafterBatch) -> DrafterBatch:
        """The micro-batch as this step runs it: packed where the objective packs anchors."""
        if self.objective.pack_anchors and batch.row_length is None:
            return packed(batch, self.objective.num_anchors)
        return batch

    def update(self) -> float:
        """Clip, check finite, AdamW, zero the gradients (`apply`), then the schedule's next lr;
        returns the lr this step used."""
        lr = self.optimizer.param_groups[0]["lr"]
        if self.lr_from_tensors:
            for group, tensor in zip(self.optimizer.param_groups, self.lrs):
                tensor.fill_(group["lr"])  # in stream order
        self.apply()
        self.scheduler.step()
        return lr

    @torch.no_grad()
    def apply_update(self) -> None:
        """The update on the device: the step's numbers into `outputs`, the gradients and sums to zero."""
        grads = self.grads
        if self.fused:
            norm, skipped = fused_clip_and_step(self.optimizer, grads, self.clip_grad, self.force_skip,
                                                self.lrs if self.lr_from_tensors else None)
        else:  # an unfused AdamW cannot skip on the device: the host looks at the norm
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad)
            skipped = (~torch.isfinite(norm) | (self.force_skip > 0)).float()
            if not skipped:
                self.optimizer.step()
        self.drop_gradients()
        metrics = [self.metric_sums[name].flatten() for name in METRICS]
        self.outputs.copy_(torch.cat([self.loss_sum.view(1), norm.float().view(1), skipped.view(1), *metrics]))
        self.reset_sums()

    @torch.no_grad()
    def skip_update(self) -> None:
        """`apply_update` with the skip forced: the optimizer's state exists and its update has
        compiled (master weights), and no weight, moment or step count changed."""
        self.force_skip.fill_(1.0)
        try:
            self.apply_update()
        finally:
            self.force_skip.zero_()

    def result(self, lr: float) -> StepResult:
        """The last update's numbers, read now (the host waits for the device)."""
        return StepResult.parse(self.outputs.cpu(), lr, self.drafter.config.block_size)

    @torch.no_grad()
    def reset_sums(self) -> None:
        self.loss_sum.zero_()
        for value in self.metric_sums.values():
            value.zero_()

    @torch.no_grad()
    def reset(self) -> None:
        """Gradients and sums back to zero (after warm-ups)."""
        self.drop_gradients()
        self.reset_sums()

    @torch.no_grad()
    def fingerprint(self) -> torch.Tensor:
        """What a micro-batch left behind, in quantities that are continuous or exact: per-parameter
        gradient norms, the loss, the scored-slot counts per position, the block count (last).
        Top-1 counts are left out: a near-tie may flip between two kernels' roundings."""
        norms = torch.stack(torch._foreach_norm(self.grads)).float()
        sums = self.metric_sums
        return torch.cat([norms, self.loss_sum.view(1), sums["position_count"].flatten(), sums["blocks"].view(1)])


# --- optimizer and schedule --------------------------------------------------------------------

def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """Linear warm-up then cosine decay to min_lr_ratio × peak."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(drafter: DFlashDrafter, lr: float, weight_decay: float, betas: tuple[float, float], *,
                   master_weights: bool = False, compiled: bool = True) -> torch.optim.Optimizer:
    """AdamW over the drafter's parameters; with `master_weights` the parameters become bf16 and
    the optimizer keeps their float32 masters (core/master_weights.py; its update `compiled`)."""
    if master_weights:
        return MasterWeightAdamW.taking_over(drafter, compiled=compiled, lr=lr, weight_decay=weight_decay, betas=betas)
    # Fused AdamW where the device supports it: one kernel per step instead of one per tensor.
    fused = next(drafter.parameters()).device.type == "cuda"
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
