"""The training objective: anchors, labels, weights, chunked frozen-head cross-entropy, metrics.

Anchors: position p is valid when loss_mask[p] and loss_mask[p + 1]. Each sequence gets a
fixed number N of anchor slots (static shapes), drawn from (seed, sample id, epoch) alone so
the draw is identical on any number of GPUs; sorted, padded slots masked out.

Labels are same-position: block slot k (k = 1..B−1) of anchor a predicts the token at a + k;
slot 0 is the anchor itself and is never scored. Weights (decay CE):
    w_k = exp(−(k − 1) / γ) · loss_mask[a + k] · [a + k < S],   loss = Σ w·CE / Σ w
with Σ w taken over the whole global batch (all replicas, all micro-batches), computed on
the host from the masks before any GPU work, so no cross-device reduction of the
denominator is needed. D-PACE (arXiv 2605.18810) is offered as an alternative weighting.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .fp8 import Fp8Weight, frozen_forward, frozen_input_grad
from .head_kernel import BLOCK as HEAD_KERNEL_BLOCK, fused_softmax_cross_entropy

# γ per block size from the DFlash paper; other sizes interpolate as 0.4375·B (=7 at B=16).
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, round(0.4375 * block_size, 3))


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] and loss_mask[p + 1] (1-D mask of one sequence)."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def anchor_seed(seed: int, sample_id: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{sample_id}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw_anchors(
    loss_mask: torch.Tensor, num_anchors: int, *, seed: int, sample_id: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sorted anchor slots for one sequence: (positions [N] long, valid [N] bool).

    Fewer valid positions than N: all are used and the rest are padded (position 0, invalid).
    """
    candidates = valid_anchor_positions(loss_mask)
    generator = torch.Generator().manual_seed(anchor_seed(seed, sample_id, epoch))
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:num_anchors]]
    chosen, _ = torch.sort(chosen)
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: len(chosen)] = chosen
    valid[: len(chosen)] = True
    return anchors, valid


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int,
    row_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [b, N, B] (token at a + k) and label_valid [b, N, B] (scored slots). `row_length`:
    the rows a packed micro-batch lays end to end (`step.pack_rows`); a label past its anchor's
    row is not scored (None: each row of input_ids is one row)."""
    seq_len = input_ids.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors[..., None] + offsets  # [b, N, B]
    if row_length is None:
        inside = positions < seq_len
    else:
        inside = (anchors % row_length)[..., None] + offsets < row_length
    clamped = positions.clamp(max=seq_len - 1)
    labels = torch.gather(input_ids, 1, clamped.flatten(1)).view_as(positions)
    supervised = torch.gather(loss_mask.bool(), 1, clamped.flatten(1)).view_as(positions)
    valid = supervised & inside & anchor_valid[..., None] & (offsets > 0)
    return labels, valid


def block_token_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """[b, N, B]: the anchor token then MASK × (B − 1)."""
    block = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block[..., 0] = torch.gather(input_ids, 1, anchors)
    return block


def decay_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B] with w_0 = 0 and w_k = exp(−(k − 1)/γ)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    # Masked rather than `weights[0] = 0.0`: assigning a Python number copies a host scalar to
    # the device, which waits for the GPU (found by the sync-free-step GPU test).
    return torch.exp(-(k - 1).clamp(min=0) / gamma) * (k > 0)


def decay_weight_sum(label_valid: torch.Tensor, gamma: float) -> float:
    """Σ w over a batch, on the host: the global normaliser is the sum of these."""
    weights = decay_weights(label_valid.shape[-1], gamma, label_valid.device)
    return float((label_valid.float() * weights).sum())


def dpace_weights(target_prob: torch.Tensor, label_valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [b, N, B] from detached target-token probabilities.

    Smoothed acceptance s_k = (1 − α)·q_k + α on scored slots (1 elsewhere); prefix
    acceptance P_k = Π_{j≤k} s_j; the weight of slot k is the expected-length contribution of
    everything from k on: Σ_{m≥k} P_m · valid_m. Positions that limit acceptance gain weight.
    """
    valid = label_valid.to(target_prob.dtype)
    smooth = torch.where(label_valid, (1 - alpha) * target_prob + alpha, torch.ones_like(target_prob))
    prefix = torch.cumprod(smooth, dim=-1)
    contribution = prefix * valid
    return contribution.flip(-1).cumsum(-1).flip(-1) * valid


def softmax_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, softcap: float, with_grad: bool, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of logits [rows, V]: float32 CE of the label, whether the first argmax is the label,
    and d(CE)/d(logits) in `grad_dtype` (None without `with_grad`). The reference that
    core/head_kernel.py's fused kernel is checked against."""
    logits = logits.float()
    if softcap:
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, labels[:, None]).squeeze(1)
    correct = logits.argmax(dim=-1) == labels
    if not with_grad:
        return ce, correct, None
    grad_logits = torch.exp(logits - lse[:, None])
    grad_logits[torch.arange(labels.shape[0], device=labels.device), labels] -= 1.0
    if softcap:
        grad_logits *= 1.0 - capped.square()
    return ce, correct, grad_logits.to(grad_dtype)


def _head_logits(hidden: torch.Tensor, head: torch.Tensor | Fp8Weight) -> torch.Tensor:
    return frozen_forward(head, hidden, hidden.dtype) if isinstance(head, Fp8Weight) else hidden @ head.t()


def _head_input_grad(head: torch.Tensor | Fp8Weight, grad_logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(head, Fp8Weight):
        return frozen_input_grad(head, grad_logits, dtype)
    return (grad_logits @ head).to(dtype)


def _logits_grad_dtype(head: torch.Tensor | Fp8Weight) -> torch.dtype:
    # The FP8 product quantises the float32 gradient itself: one rounding, not two.
    return torch.float32 if isinstance(head, Fp8Weight) else head.dtype


def _head_chunk(
    hidden: torch.Tensor, head: torch.Tensor | Fp8Weight, labels: torch.Tensor, softcap: float, with_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """CE, top-1 correctness and d(CE)/d(hidden) of one chunk of rows through the frozen head
    (a weight [V, H], or its FP8 copy)."""
    ce, correct, grad_logits = softmax_cross_entropy(
        _head_logits(hidden, head), labels, softcap, with_grad, _logits_grad_dtype(head))
    return ce, correct, None if grad_logits is None else _head_input_grad(head, grad_logits, hidden.dtype)


@functools.cache
def _head_chunk_compiled():
    """The chunk compiled once per shape: the float32 casts, log-sum-exp, argmax, softmax and
    one-hot subtraction fuse into a few kernels around the two matmuls, so the [rows, vocab]
    logits are written once in the matmul's dtype instead of passing through ~7 float32 copies.
    Built on first use: importing this module must not pull in the compiler."""
    return torch.compile(_head_chunk, dynamic=False)


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """Cross-entropy through a frozen LM head, in row chunks, gradient computed in the forward.

    Peak extra memory is one chunk of logits (rows × vocab) plus a [rows, hidden] gradient
    buffer, independent of how many rows there are in total. Because the head is frozen,
    d(CE)/d(hidden) = (softmax − onehot) · W needs nothing else, so the backward only scales
    the stored rows by the incoming per-row gradient; logits are never kept.
    A chunk runs one of three ways (`kernel`): "eager" (the reference), "compiled" or "fused"
    (the two head products around core/head_kernel.py's single softmax kernel). The last two pad the
    rows with zeros to whole chunks, so the number of scored rows, which changes every step,
    never triggers a recompile, and every product has the shape a graphed step's has.
    With `top_k` > 0 each chunk's logits also give the DFlash2 selector's candidates (`HeadCandidates`,
    no gradient); outputs: CE, correctness, candidate values, ids, label logits.
    """

    @staticmethod
    def forward(ctx, hidden, head, labels, chunk_rows, softcap, kernel, top_k):
        rows = hidden.shape[0]
        if kernel != "eager" and rows % chunk_rows:
            # Zero rows up to whole chunks: one compiled shape, and the products a graphed step
            # (whose rows are whole chunks) runs too, so both round alike.
            pad = chunk_rows - rows % chunk_rows
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
            labels = torch.nn.functional.pad(labels, (0, pad))
        padded_rows = hidden.shape[0]
        ce = torch.empty(padded_rows, dtype=torch.float32, device=hidden.device)
        correct = torch.empty(padded_rows, dtype=torch.bool, device=hidden.device)
        with_grad = ctx.needs_input_grad[0]
        grad_rows = torch.empty_like(hidden) if with_grad else None
        labels = labels.contiguous()
        top_values = torch.empty(padded_rows, top_k, dtype=torch.float32, device=hidden.device)
        top_ids = torch.empty(padded_rows, top_k, dtype=torch.long, device=hidden.device)
        label_logits = torch.empty(padded_rows if top_k else 0, dtype=torch.float32, device=hidden.device)
        chunk_fn = _head_chunk_compiled() if kernel == "compiled" else _head_chunk
        vocab = (head.rows if isinstance(head, Fp8Weight) else head).shape[0]
        # The fused kernel writes the slice maxima row_top_k ranks, from its own read of the logits.
        segment = candidate_segment(vocab) if top_k and kernel == "fused" else 0
        slice_maxima = (torch.empty(chunk_rows, vocab // segment, dtype=torch.float32, device=hidden.device)
                        if segment else None)
        for start in range(0, padded_rows, chunk_rows):
            end = min(start + chunk_rows, padded_rows)
            chunk_hidden = hidden[start:end]
            # The fused kernel's logits serve the selector's candidates too; the other two kernels
            # make theirs inside the chunk, so the candidates cost them a product of their own.
            logits = _head_logits(chunk_hidden, head) if kernel == "fused" or top_k else None
            maxima = None if slice_maxima is None else slice_maxima[:end - start]
            if kernel == "fused":
                grad_logits = fused_softmax_cross_entropy(
                    logits, labels, ce, correct, start, softcap, with_grad, _logits_grad_dtype(head), maxima, segment)
                chunk_grad = None if grad_logits is None else _head_input_grad(head, grad_logits, hidden.dtype)
            else:
                ce[start:end], correct[start:end], chunk_grad = chunk_fn(
                    chunk_hidden, head, labels[start:end], softcap, with_grad)
            if top_k:
                top_values[start:end], top_ids[start:end], label_logits[start:end] = _candidates(
                    logits, labels[start:end], top_k, softcap, maxima, segment)
            if grad_rows is not None:
                grad_rows[start:end] = chunk_grad
        ce, correct = ce[:rows], correct[:rows]
        ctx.save_for_backward(None if grad_rows is None else grad_rows[:rows])
        outputs = (correct, top_values[:rows], top_ids[:rows], label_logits[:rows])
        ctx.mark_non_differentiable(*outputs)
        return (ce,) + outputs

    @staticmethod
    def backward(ctx, grad_ce, *_non_differentiable):
        (grad_rows,) = ctx.saved_tensors
        return grad_rows * grad_ce[:, None].to(grad_rows.dtype), None, None, None, None, None, None


class HeadCandidates(NamedTuple):
    """The DFlash2 selector's candidates of each scored row, from the logits its CE used: the
    top-k logits [T, k] (float32, softcapped as the drafter's logits are, largest first), their
    ids [T, k], and the label's logit [T]. No gradient: the backbone learns the logits from its
    own CE; the selector re-scores them."""

    values: torch.Tensor
    ids: torch.Tensor
    label_logits: torch.Tensor


def _candidates(logits: torch.Tensor, labels: torch.Tensor, k: int, softcap: float,
                slice_maxima: torch.Tensor | None = None, segment: int = 0) -> HeadCandidates:
    # Ranked in the logits' dtype, as a serving engine ranks them; only k + 1 values per row are
    # widened and softcapped (tanh is increasing: the top-k of capped logits is the same).
    values, ids = row_top_k(logits, k, segment or TOP_K_SEGMENT, slice_maxima)
    label = logits.gather(1, labels[:, None])[:, 0]
    return HeadCandidates(_softcapped(values.float(), softcap), ids, _softcapped(label.float(), softcap))


def head_chunk_rows(vocab_size: int, chunk_rows: int = 0, compiled: bool = False) -> int:
    """Rows per frozen-head CE chunk: `chunk_rows`, or for 0 about 256 MiB of float32 logits
    (a multiple of 64 rows when compiled, where every chunk is padded to that size)."""
    if chunk_rows > 0:
        return chunk_rows
    rows = max(16, (256 << 20) // (4 * vocab_size))
    return max(64, rows // 64 * 64) if compiled else rows


def frozen_head_cross_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_rows: int = 0,
    softcap: float | None = None,
    compiled: bool = False,
    fused: bool = False,
    fp8_head: Fp8Weight | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE (float32) and top-1 correctness for hidden [T, H] against a frozen head [V, H].

    chunk_rows = 0 picks about 256 MiB of float32 logits per chunk (a multiple of 64 rows when
    compiled, where every chunk is padded to that size). `compiled` runs each chunk through
    torch.compile (GPU training; the eager path is the reference and the CPU default); `fused`
    (CUDA, where `fused_head_unsupported` found nothing wrong) runs core/head_kernel.py's kernel instead.
    `fp8_head` (the same head quantised, see core/fp8.py) runs both vocabulary-sized products in FP8.
    """
    ce, correct, _ = frozen_head_cross_entropy_and_candidates(
        hidden, head_weight, labels, 0, chunk_rows=chunk_rows, softcap=softcap, compiled=compiled, fused=fused,
        fp8_head=fp8_head)
    return ce, correct


def frozen_head_cross_entropy_and_candidates(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    top_k: int,
    *,
    chunk_rows: int = 0,
    softcap: float | None = None,
    compiled: bool = False,
    fused: bool = False,
    fp8_head: Fp8Weight | None = None,
) -> tuple[torch.Tensor, torch.Tensor, HeadCandidates]:
    """`frozen_head_cross_entropy` and, for `top_k` > 0, the DFlash2 selector's candidates of the
    same rows from the same chunks of logits (never T × V logits at once): with the fused kernel
    one head product serves both."""
    chunk_rows = head_chunk_rows(head_weight.shape[0], chunk_rows, compiled or fused)
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, head_weight = hidden.to(dtype), head_weight.to(dtype)
    kernel = "fused" if fused else "compiled" if compiled else "eager"
    with torch.autocast(hidden.device.type, enabled=False):
        head = fp8_head if fp8_head is not None else head_weight
        ce, correct, *candidates = _FrozenHeadCrossEntropy.apply(hidden, head, labels, chunk_rows, softcap or 0.0,
                                                                 kernel, top_k)
    return ce, correct, HeadCandidates(*candidates)


TOP_K_SEGMENT = 256
# torch.topk ranks rows up to about this wide in one pass per row; wider ones it radix-selects
# in several passes over the data (its heuristic in aten's TensorTopK.cu).
TOP_K_ONE_PASS = 384


def candidate_segment(vocab: int) -> int:
    """The slice width the fused head kernel takes maxima over for `row_top_k`: the narrowest
    power of two from 64 whose slice count torch.topk still ranks in one pass."""
    segment = 64
    while vocab // segment > TOP_K_ONE_PASS and segment < HEAD_KERNEL_BLOCK:
        segment *= 2
    return segment


def fused_head_segment(arch: str, vocab: int) -> int:
    """The slice width a drafter's fused head kernel writes maxima at, and is probed with: a
    DFlash2 drafter's `candidate_segment`; 0 for DFlash, which ranks no candidates."""
    return candidate_segment(vocab) if arch == "dflash2" else 0


def row_top_k(logits: torch.Tensor, k: int, segment: int = TOP_K_SEGMENT,
              slice_maxima: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(logits, k, dim=-1)` of rows [T, V], sorted: the same values, found through each
    row's `segment`-wide slices. A row's k largest entries lie in the k slices with the largest
    maxima (any entry of another slice has k larger slice maxima above it), so only those k ×
    `segment` entries, and the ragged tail, are ranked, the same way while still wide. Among tied
    values the ids may be others than torch.topk's. `slice_maxima` [T, V // segment], where given,
    are those maxima already found (the fused head kernel writes them while it reads the logits).
    Why: over a 49k-wide row torch's multi-pass select took 12 ms of the 51 ms DFlash2 step of the
    SmolLM2 recipe on an H100."""
    rows, vocab = logits.shape
    slices = vocab // segment
    if vocab <= TOP_K_ONE_PASS or slices <= k:
        return torch.topk(logits, k, dim=-1)
    whole = logits[:, :slices * segment].view(rows, slices, segment)
    if slice_maxima is None:
        slice_maxima = whole.amax(dim=-1)
    elif slice_maxima.shape != (rows, slices):
        raise ValueError(f"slice maxima {tuple(slice_maxima.shape)} for {rows} rows of {slices} slices")
    best_slices = torch.topk(slice_maxima, k, dim=-1).indices  # [T, k]
    picked = whole.gather(1, best_slices[..., None].expand(rows, k, segment)).flatten(1)
    picked_ids = (best_slices[..., None] * segment + torch.arange(segment, device=logits.device)).flatten(1)
    if slices * segment < vocab:
        picked = torch.cat([picked, logits[:, slices * segment:]], dim=1)
        tail_ids = torch.arange(slices * segment, vocab, device=logits.device).expand(rows, -1)
        picked_ids = torch.cat([picked_ids, tail_ids], dim=1)
    values, order = row_top_k(picked, k, max(2 * k, segment // 8))
    return values, picked_ids.gather(1, order)


def _softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return torch.tanh(logits / softcap) * softcap if softcap else logits


_FUSED_PROBES: dict[tuple[torch.device, float, int], str | None] = {}


def fused_head_unsupported(device: torch.device, softcap: float | None = None, segment: int = 0) -> str | None:
    """Why core/head_kernel.py's fused kernel must not be used on `device`, or None: on a CUDA device
    with Triton, its CE, correctness and gradients on bfloat16 and float32 logits (ties, a label
    at the vocabulary's last entry, a vocabulary that is no multiple of the kernel's sweep)
    are checked against `softmax_cross_entropy` once per device and softcap. `segment` > 0 (a
    DFlash2 drafter's `candidate_segment`) checks the kernel that also writes the slice maxima of
    that width, against the logits' own; a DFlash drafter's kernel (0) does not depend on it."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"not a CUDA device ({device})"
    key = (device, float(softcap or 0.0), segment)
    if key not in _FUSED_PROBES:
        try:
            _FUSED_PROBES[key] = _probe_fused_head(*key)
        except Exception as error:  # noqa: BLE001 - any failure (no Triton, a compile error) means: do not use it
            _FUSED_PROBES[key] = f"the fused head kernel failed its probe ({type(error).__name__}: {error})"
    return _FUSED_PROBES[key]


def _probe_fused_head(device: torch.device, softcap: float, segment: int) -> str | None:
    rows, vocab = 37, 9000
    # Made on the CPU from a formula: no CUDA random numbers (another thread may be capturing).
    grid = torch.arange(rows * vocab, dtype=torch.float64).view(rows, vocab)
    base = (torch.sin(grid * 0.7311) * 6.0).float()
    base[:, 5000] = base.max() + 1.0  # a tie with the last entry: the first index wins
    base[:, vocab - 1] = base[:, 5000]
    labels = (torch.arange(rows) * 997) % vocab
    labels[0], labels[1] = 5000, vocab - 1
    for dtype in (torch.bfloat16, torch.float32):
        logits = base.to(dtype).to(device)
        want_ce, want_correct, want_grad = softmax_cross_entropy(logits, labels.to(device), softcap, True, dtype)
        ce = torch.zeros(rows + 3, dtype=torch.float32, device=device)
        correct = torch.zeros(rows + 3, dtype=torch.bool, device=device)
        padded_labels = torch.cat([labels[:3], labels]).to(device)
        maxima = torch.zeros(rows, vocab // segment, dtype=torch.float32, device=device) if segment else None
        grad = fused_softmax_cross_entropy(logits, padded_labels, ce, correct, 3, softcap, True, dtype, maxima, segment)
        ce_error = float(((ce[3:] - want_ce).abs() / want_ce.abs().clamp(min=1e-3)).max())
        # Entry by entry, one rounding of the gradient's dtype apart at most.
        rounding = max(2.0 * torch.finfo(dtype).eps, 1e-5)  # float32: exp and log-sum-exp orders differ
        grad_error = float(((grad.float() - want_grad.float()).abs() / (want_grad.float().abs() + 1e-6)).max())
        if not ce_error <= 1e-5:
            return f"its CE differs from the reference on {dtype} logits (relative {ce_error:.1e})"
        if not grad_error <= rounding:
            return f"its gradient differs from the reference on {dtype} logits (relative {grad_error:.1e})"
        if not torch.equal(correct[3:], want_correct):
            return f"its top-1 correctness differs from the reference on {dtype} logits"
        if maxima is not None and not torch.equal(
                maxima, logits[:, :maxima.shape[1] * segment].float().view(rows, -1, segment).amax(dim=-1)):
            return f"its slice maxima differ from the logits' on {dtype} logits"
    return None


@dataclass
class ObjectiveConfig:
    block_size: int
    num_anchors: int
    loss: str = "decay"  # "decay" or "dpace"
    gamma: float | None = None
    dpace_alpha: float = 0.5
    loss_chunk_rows: int = 0
    compiled_head: bool = False  # compile the frozen-head CE chunk (GPU training)
    fused_head: bool = False  # core/head_kernel.py's softmax kernel instead (GPU training, where its probe passed)
    fp8_head: bool = False  # frozen-head products in FP8 (core/fp8.py)
    pack_anchors: bool = False  # the step runs each micro-batch packed (step.pack_rows): no padded anchor slots
    # DFlash2 drafters: the candidate selector's cross-entropy over the head's top-k, teacher forced
    # (the true previous token as predecessor), weighted like the slot's backbone CE times this.
    selector_weight: float = 1.0
    selector_miss: str = "drop"  # a true token outside the top-k: "drop" the slot or "insert" the token

    def __post_init__(self) -> None:
        if self.loss not in ("decay", "dpace"):
            raise ValueError(f"loss {self.loss!r}: use 'decay' (DFlash paper) or 'dpace'")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha {self.dpace_alpha}: must be in [0, 1]")
        if self.num_anchors < 1:
            raise ValueError("num_anchors must be at least 1")
        if self.selector_miss not in ("drop", "insert"):
            raise ValueError(f"selector_miss {self.selector_miss!r}: use 'drop' or 'insert'")
        if not self.selector_weight >= 0:
            raise ValueError(f"selector_weight {self.selector_weight}: must be >= 0")
        if self.gamma is None:
            self.gamma = default_gamma(self.block_size)

    def normalizer(self, label_valid: torch.Tensor) -> float:
        """This batch's share of the global loss denominator (summed over the global batch)."""
        if self.loss == "decay":
            return decay_weight_sum(label_valid, self.gamma)
        return float(label_valid.shape[0])  # D-PACE: per sequence, as its authors normalise


def loss_weights(ce: torch.Tensor, label_valid: torch.Tensor, objective: ObjectiveConfig) -> torch.Tensor:
    """w [b, N, B] of each slot: decay weights on scored slots, or D-PACE's from the detached CE."""
    if objective.loss == "decay":
        return decay_weights(ce.shape[-1], objective.gamma, ce.device) * label_valid
    return dpace_weights(torch.exp(-ce.detach()), label_valid, objective.dpace_alpha)


def weighted_loss(
    ce: torch.Tensor, label_valid: torch.Tensor, objective: ObjectiveConfig, normalizer: float
) -> torch.Tensor:
    """ce, label_valid: [b, N, B]; returns Σ w·CE / normalizer."""
    return (loss_weights(ce, label_valid, objective) * ce).sum() / max(normalizer, 1e-12)


def block_metrics(correct: torch.Tensor, label_valid: torch.Tensor, anchor_valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums (not means) so they add across micro-batches and replicas without host syncs.

    position_correct/position_count [B]: per-position top-1 accuracy. accepted_sum/blocks:
    simulated τ = 1 + mean number of leading correct scored slots per block — exactly what a
    greedy verify would accept if the block's context were the training context.
    """
    scored_correct = correct & label_valid
    leading = torch.cumprod(scored_correct[..., 1:].int(), dim=-1).sum(-1)  # [b, N]
    return {
        "position_correct": scored_correct.sum(dim=(0, 1)).float(),
        "position_count": label_valid.sum(dim=(0, 1)).float(),
        "accepted_sum": (leading * anchor_valid).sum().float(),
        "blocks": anchor_valid.sum().float(),
    }


def summarize_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    count = sums["position_count"].clamp(min=1)
    accuracy = (sums["position_correct"] / count)[1:]
    blocks = float(sums["blocks"])
    return {
        "accuracy": float(sums["position_correct"].sum() / count[1:].sum().clamp(min=1)),
        "position_accuracy": [round(float(a), 4) for a in accuracy],
        "tau_sim": 1.0 + float(sums["accepted_sum"]) / blocks if blocks else math.nan,
    }
