"""The frozen head's softmax cross-entropy over one chunk of logits as a single Triton kernel (CUDA).

`objective.softmax_cross_entropy` says what is computed: per row the float32 log-sum-exp, the CE
of the label, whether the first argmax is the label, and d(CE)/d(logits) = softmax − onehot
(times the softcap's derivative) in the dtype the head's input-gradient product takes. Compiled
by inductor, that is a reduction pass and an elementwise pass over the [rows, vocab] logits, and
the reduction reads them more than once; here one program per row reads its logits once for the
running max, sum and argmax (per lane, merged at the end), and once more, from L2 while the row
is still there, to write the gradient. On SmolLM2's 49,152-token vocabulary the two compiled
passes took 4.3 ms of a 27.4 ms graphed step, and this kernel takes 2.1 ms (docs/PERF.md).
For DFlash2's selector it can also write each row's slice maxima (the largest raw logit of every
whole `segment`-wide slice) from the same first read: `objective.row_top_k` ranks slices by them,
and as a separate reduction over the logits they cost more than the kernel's store of them.

Triton is imported on first use: the CPU suite never loads it. `objective.fused_head_unsupported`
checks this kernel against the reference on the device before a run uses it.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096  # logits per lane sweep: 16 per thread at 8 warps
NUM_WARPS = 8


@functools.cache
def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit(do_not_specialize=["first_row"])
    def softmax_ce_rows(
        logits_ptr, labels_ptr, ce_ptr, correct_ptr, grad_ptr, slice_max_ptr, first_row, vocab, logits_stride,
        grad_stride, slices, softcap, SOFTCAP: tl.constexpr, WITH_GRAD: tl.constexpr, SEGMENT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        local = tl.program_id(0).to(tl.int64)
        row = first_row + local  # in labels, ce and correct (the whole call's rows)
        logits_row = logits_ptr + local * logits_stride
        label = tl.load(labels_ptr + row).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        # A finite floor, not −inf: exp(floor − floor) stays 1 on lanes that never see a logit.
        lane_max = tl.full([BLOCK], -3.0e38, tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        lane_arg = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            inside = cols < vocab
            x = tl.load(logits_row + cols, mask=inside, other=0.0).to(tl.float32)
            if SEGMENT > 0:  # before the softcap: tanh may round distinct logits to one value
                raw = tl.where(inside, x, float("-inf"))
                slice_max = tl.max(tl.reshape(raw, (BLOCK // SEGMENT, SEGMENT)), 1)
                index = start // SEGMENT + tl.arange(0, BLOCK // SEGMENT)
                tl.store(slice_max_ptr + local * slices + index, slice_max, mask=index < slices)
            if SOFTCAP:
                x = libdevice.tanh(x / softcap) * softcap
            x = tl.where(inside, x, float("-inf"))
            lane_arg = tl.where(x > lane_max, cols, lane_arg)  # strict: a lane keeps its first maximum
            new_max = tl.maximum(lane_max, x)
            lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
            lane_max = new_max
        row_max = tl.max(lane_max, 0)
        lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), 0))
        first_arg = tl.min(tl.where(lane_max == row_max, lane_arg, vocab), 0)  # torch.argmax: the first
        label_logit = tl.load(logits_row + label).to(tl.float32)
        if SOFTCAP:
            label_logit = libdevice.tanh(label_logit / softcap) * softcap
        tl.store(ce_ptr + row, lse - label_logit)
        tl.store(correct_ptr + row, (first_arg == label).to(tl.uint8))
        if WITH_GRAD:
            grad_row = grad_ptr + local * grad_stride
            for start in range(0, vocab, BLOCK):
                cols = start + lanes
                inside = cols < vocab
                x = tl.load(logits_row + cols, mask=inside, other=0.0).to(tl.float32)
                if SOFTCAP:
                    capped = libdevice.tanh(x / softcap)
                    x = capped * softcap
                grad = tl.exp(x - lse)
                grad = tl.where(cols == label, grad - 1.0, grad)
                if SOFTCAP:
                    grad = grad * (1.0 - capped * capped)
                tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)

    return softmax_ce_rows


def fused_softmax_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ce: torch.Tensor, correct: torch.Tensor, first_row: int,
    softcap: float, with_grad: bool, grad_dtype: torch.dtype, slice_maxima: torch.Tensor | None = None,
    segment: int = 0,
) -> torch.Tensor | None:
    """CE and correctness of the chunk `logits` [rows, V] (rows first_row.. of `labels`) written into
    `ce` (float32) and `correct` (bool) at those rows; returns d(CE)/d(logits) [rows, V] in
    `grad_dtype`, or None without `with_grad`. `slice_maxima` [rows, V // segment] (float32,
    contiguous), where given, receives the largest logit of each whole `segment`-wide slice (before
    the softcap; a ragged tail is left out); `segment` must be a power of two dividing BLOCK."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if slice_maxima is None:
        segment = 0
    elif (segment <= 0 or segment & (segment - 1) or BLOCK % segment or slice_maxima.shape != (rows, vocab // segment)
          or slice_maxima.dtype != torch.float32 or not slice_maxima.is_contiguous()):
        raise ValueError(f"slice maxima {tuple(slice_maxima.shape)} {slice_maxima.dtype} of {segment}-wide slices for "
                         f"logits {tuple(logits.shape)}: need [rows, V // segment] float32, segment a power of two "
                         f"dividing {BLOCK}")
    grad = torch.empty(rows, vocab, dtype=grad_dtype, device=logits.device) if with_grad else None
    _kernel()[(rows,)](
        logits, labels, ce, correct.view(torch.uint8), grad if grad is not None else logits,
        slice_maxima if slice_maxima is not None else ce, first_row, vocab, logits.stride(0),
        grad.stride(0) if grad is not None else 0, slice_maxima.shape[1] if slice_maxima is not None else 0,
        float(softcap or 1.0), SOFTCAP=bool(softcap), WITH_GRAD=with_grad, SEGMENT=segment, BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return grad
