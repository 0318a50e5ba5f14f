"""The training step with static shapes: what CUDA graphs capture, and the same functions eagerly.

`step.training_step`, restated so that nothing it runs depends on a host value that changes from
one step to the next (train/step_graphs.py captures these functions per bucket; on the CPU, and
wherever a capture is refused, they run as they are):

    StaticInputs       one set of device buffers per length bucket; each micro-batch is copied in
    rows               the host's scored-slot count rounded up to a rows bucket (`rows_bucket`):
                       padding rows go through the head on a real row's state and land in a dump
                       slot the loss never reads, so no real row's CE or gradient changes
    normaliser, lr     device tensors, filled before each step (the loss is Σ w·CE times the
                       normaliser's float32 reciprocal: what CUDA computes for `/ host number`)
    gradients          persistent buffers, never None: micro-batches add into them, the update zeroes them

    StaticStep.accumulate(inputs, rows)   forward, loss, backward of one micro-batch; its loss and
                                          metric sums are added into persistent accumulators
    StaticStep.update()                   clip, finiteness, fused AdamW (grad_scale / found_inf, lr
                                          tensor), zero the gradients; loss, grad norm, skip flag and
                                          metric sums land in one output buffer (`outputs`)

Between the two, the replicas' gradient sum (pipeline GradientReducer) works on the persistent
buffers. Nothing here knows about threads, streams or graphs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .drafter import DFlashDrafter, unwrap_drafter
from .objective import ObjectiveConfig, block_metrics, loss_weights
from .step import (
    DrafterBatch,
    FrozenTargetParts,
    block_predictions,
    dflash2_loss,
    fused_clip_and_step,
    head_cross_entropy,
    selector_cross_entropy,
)

METRICS = ("position_correct", "position_count", "accepted_sum", "blocks")  # block_metrics' sums, in output order


def rows_bucket(count: int, granule: int) -> int:
    """The rows a micro-batch with `count` scored slots is padded to: the next multiple of `granule`
    (the head's chunk rows: a compiled head pads its last chunk to that size anyway)."""
    return max(1, -(-count // granule)) * granule


def rows_buckets(max_rows: int, granule: int) -> list[int]:
    """Every rows bucket a micro-batch of at most `max_rows` scored slots can fall into."""
    return [granule * k for k in range(1, rows_bucket(max_rows, granule) // granule + 1)]


def inverse_normalizer(normalizer: float) -> float:
    """1 / max(normaliser, 1e-12) rounded as float32 arithmetic rounds it."""
    one = torch.ones((), dtype=torch.float32)
    return float(one / torch.tensor(max(normalizer, 1e-12), dtype=torch.float32))


@dataclass(frozen=True)
class InputShape:
    """What one length bucket's buffers hold."""

    batch_size: int
    length: int
    num_anchors: int
    feature_width: int
    feature_dtype: torch.dtype


class StaticInputs:
    """One length bucket's device buffers, read by every captured step of that bucket; attribute
    names are DrafterBatch's, so `block_predictions` reads either."""

    def __init__(self, shape: InputShape, device: torch.device):
        b, length, n = shape.batch_size, shape.length, shape.num_anchors
        self.shape = shape
        self.target_features = torch.zeros(b, length, shape.feature_width, dtype=shape.feature_dtype, device=device)
        self.input_ids = torch.zeros(b, length, dtype=torch.long, device=device)
        self.loss_mask = torch.zeros(b, length, dtype=torch.bool, device=device)
        self.anchors = torch.zeros(b, n, dtype=torch.long, device=device)
        self.anchor_valid = torch.zeros(b, n, dtype=torch.bool, device=device)
        self.inverse_normalizer = torch.ones((), dtype=torch.float32, device=device)

    def holds(self, batch: DrafterBatch) -> bool:
        return (tuple(batch.target_features.shape) == tuple(self.target_features.shape)
                and tuple(batch.anchors.shape) == tuple(self.anchors.shape))

    def fill(self, batch: DrafterBatch) -> None:
        """Copy a micro-batch in, in stream order (no host sync)."""
        if not self.holds(batch):
            raise ValueError(f"a micro-batch of features {tuple(batch.target_features.shape)} and anchors "
                             f"{tuple(batch.anchors.shape)} does not fit buffers of {self.shape}")
        for name in ("target_features", "input_ids", "loss_mask", "anchors", "anchor_valid"):
            getattr(self, name).copy_(getattr(batch, name), non_blocking=True)
        self.inverse_normalizer.fill_(inverse_normalizer(batch.loss_normalizer))


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


def static_drafter_loss(
    drafter: DFlashDrafter,
    frozen: FrozenTargetParts,
    inputs: StaticInputs,
    rows: int,
    objective: ObjectiveConfig,
    attention_backend: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`step.drafter_loss` with `rows` (>= the scored slots) rows through the head."""
    hidden, labels, label_valid = block_predictions(drafter, frozen, inputs, attention_backend)
    slots = label_valid.numel()
    # The scored slots, then `slots` (one past the last) for the padding rows: their CE goes to a
    # dump slot that is sliced off, so the loss gives them zero gradient.
    into = padded_slot_index(label_valid.flatten(), rows)
    source = into.clamp(max=slots - 1)  # padding rows read a real row's state: finite, never used
    scored_ce, scored_correct = head_cross_entropy(hidden, labels, source, frozen, objective)
    ce = torch.zeros(slots + 1, dtype=scored_ce.dtype, device=scored_ce.device)
    ce = ce.index_copy(0, into, scored_ce)[:slots].view(label_valid.shape)
    correct = torch.zeros(slots + 1, dtype=torch.bool, device=into.device)
    correct = correct.index_copy(0, into, scored_correct)[:slots].view(label_valid.shape)
    if unwrap_drafter(drafter).candidate_selector is None:
        loss = (loss_weights(ce, label_valid, objective) * ce).sum() * inputs.inverse_normalizer
        return loss, block_metrics(correct, label_valid, inputs.anchor_valid)
    # DFlash2: the selector's rows go through the same dump slot (step.drafter_loss has the why).
    row_ce, row_correct = selector_cross_entropy(drafter, hidden, labels, source, frozen, objective)
    selector_ce = torch.zeros(slots + 1, dtype=row_ce.dtype, device=into.device).index_copy(0, into, row_ce)
    selector_correct = torch.zeros(slots + 1, dtype=torch.bool, device=into.device).index_copy(0, into, row_correct)
    loss = dflash2_loss(ce, selector_ce[:slots].view(label_valid.shape), label_valid, objective) * inputs.inverse_normalizer
    return loss, block_metrics(selector_correct[:slots].view(label_valid.shape), label_valid, inputs.anchor_valid)


def tensor_lr_step(
    optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor], grads: list[torch.Tensor], clip_grad: float,
    skip: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`step.fused_clip_and_step` with each param group's lr read from a device tensor (so a
    captured update follows the schedule). The param groups hold the tensors only while this
    runs; between steps they hold the schedule's floats, so checkpoints and the LR scheduler see
    nothing else. Returns the gradient norm and the skip flag."""
    groups = optimizer.param_groups
    saved = [(group["lr"], group.get("capturable", False)) for group in groups]
    capturing = grads[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
        group["capturable"] = group.get("capturable", False) or capturing  # the optimizer refuses capture otherwise
    try:
        return fused_clip_and_step(optimizer, grads, clip_grad, skip)
    finally:
        for group, (lr, capturable) in zip(groups, saved):
            group["lr"], group["capturable"] = lr, capturable


class StaticStep:
    """One replica's persistent step state (gradients, accumulators, lr, outputs) and the two
    functions a step is made of. Needs a fused AdamW (its grad_scale / found_inf hooks)."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        frozen: FrozenTargetParts,
        objective: ObjectiveConfig,
        *,
        attention_backend: str,
        clip_grad: float,
        autocast_dtype: torch.dtype | None,
    ):
        if not optimizer.defaults.get("fused"):
            raise ValueError("the static step needs a fused AdamW (grad_scale / found_inf)")
        self.drafter, self.optimizer, self.frozen, self.objective = drafter, optimizer, frozen, objective
        self.attention_backend, self.clip_grad, self.autocast_dtype = attention_backend, clip_grad, autocast_dtype
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        first = self.params[0]
        self.device = first.device
        with torch.no_grad():
            for param in self.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        self.grads = [p.grad for p in self.params]
        zeros = dict(device=self.device, dtype=torch.float32)
        block = drafter.config.block_size
        self.loss_sum = torch.zeros((), **zeros)
        self.metric_sums = {"position_correct": torch.zeros(block, **zeros), "position_count": torch.zeros(block, **zeros),
                            "accepted_sum": torch.zeros((), **zeros), "blocks": torch.zeros((), **zeros)}
        self.lrs = [torch.zeros((), **zeros) for _ in optimizer.param_groups]
        self.force_skip = torch.zeros((), **zeros)  # 1.0 makes the update a no-op (warm-ups)
        self.outputs = torch.zeros(3 + 2 * block + 2, **zeros)  # loss, grad norm, skipped, METRICS

    def accumulate(self, inputs: StaticInputs, rows: int) -> None:
        """Forward, loss and backward of the micro-batch in `inputs`; gradients, loss and metric
        sums are added to what earlier micro-batches of the step left."""
        device_type = self.device.type
        autocast = (torch.autocast(device_type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else contextlib.nullcontext())
        with autocast:
            loss, metrics = static_drafter_loss(self.drafter, self.frozen, inputs, rows, self.objective,
                                                self.attention_backend)
        loss.backward()
        with torch.no_grad():
            self.loss_sum += loss.detach()
            for name in METRICS:
                self.metric_sums[name] += metrics[name]

    @torch.no_grad()
    def update(self) -> None:
        """Clip, check finite, AdamW at the lr in `lrs`, zero the gradients; the step's numbers into
        `outputs`, the accumulators back to zero."""
        norm, skipped = tensor_lr_step(self.optimizer, self.lrs, self.grads, self.clip_grad, self.force_skip)
        torch._foreach_zero_(self.grads)
        metrics = [self.metric_sums[name].flatten() for name in METRICS]
        self.outputs.copy_(torch.cat([self.loss_sum.view(1), norm.float().view(1), skipped.view(1), *metrics]))
        self.reset_sums()

    def set_lr(self) -> None:
        """The schedule's current lr (a host float per group) into the lr tensors, in stream order."""
        for group, lr in zip(self.optimizer.param_groups, self.lrs):
            lr.fill_(group["lr"])

    @torch.no_grad()
    def reset_sums(self) -> None:
        self.loss_sum.zero_()
        for value in self.metric_sums.values():
            value.zero_()

    @torch.no_grad()
    def reset(self) -> None:
        """Gradients and accumulators back to zero (after warm-ups)."""
        torch._foreach_zero_(self.grads)
        self.reset_sums()

    @torch.no_grad()
    def fingerprint(self) -> torch.Tensor:
        """What a micro-batch left behind, in quantities that are continuous or exact: per-parameter
        gradient norms, the loss, the scored-slot counts per position, the block count (last).
        Top-1 counts are left out: a near-tie may flip between two kernels' roundings."""
        norms = torch.stack(torch._foreach_norm(self.grads)).float()
        sums = self.metric_sums
        return torch.cat([norms, self.loss_sum.view(1), sums["position_count"].flatten(), sums["blocks"].view(1)])


@dataclass
class StepOutputs:
    """`StaticStep.outputs` read back on the host."""

    loss: float
    grad_norm: float
    skipped: bool
    metric_sums: dict[str, torch.Tensor]

    @classmethod
    def parse(cls, host: torch.Tensor, block_size: int) -> "StepOutputs":
        values = host.clone()
        b = block_size
        metrics = {"position_correct": values[3:3 + b], "position_count": values[3 + b:3 + 2 * b],
                   "accepted_sum": values[3 + 2 * b], "blocks": values[4 + 2 * b]}
        return cls(float(values[0]), float(values[1]), bool(values[2] > 0), metrics)
