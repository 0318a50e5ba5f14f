"""The top-p threshold of each row of probabilities, without sorting the row (Triton).

`sampling.choose_tokens` keeps the tokens at or above the probability where the sorted mass first
reaches top_p: the smallest probability v present in the row with mass(p > v) < top_p. Sorting
[1,024, 49,152] probabilities to find it took 4.2 of the 7.2 ms a sampled step's draw costs on an
H100. mass(p > t) is the same for every t between two present values, so over float32 bit
patterns (ordered as the non-negative floats they encode) the predicate mass(p > t) < top_p is
false below v and true from v on: one program per row bisects the bits between 0 and the row's
largest probability, each probe one masked sum over the row (which stays in L2 across the ~30
probes). Where even mass(p > 0), the whole row, is under top_p (rounding), the threshold is 0:
every token is kept, as the sort keeps them all.

The sums run in block order in float32 where the sort's cumulative sum runs in sorted order: the
two thresholds can differ only where some prefix of the sorted mass lies within rounding of top_p.
`sampling` uses the kernel on a device only after it kept the same tokens as the sort on a probe.

Triton is imported on first use (its interpreter runs the kernel on the CPU for the tests).
"""

from __future__ import annotations

import functools

import torch

from ..kernels import triton_available

available = triton_available
BLOCK = 2048  # probabilities a program reads at a time
PROBES = 31  # bisection steps: the bits of 1.0 are under 2**30


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def row_thresholds(probs_ptr, out_ptr, row_stride, vocab, top_p, BLOCK: tl.constexpr, PROBES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = probs_ptr + row * row_stride
        offsets = tl.arange(0, BLOCK)
        largest = tl.zeros((BLOCK,), dtype=tl.float32)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            p = tl.load(base + start + offsets, mask=start + offsets < vocab, other=0.0)
            largest = tl.maximum(largest, p)
            total += p
        # Invariant: the predicate is false at `low` and true at `high`.
        low = tl.zeros((), dtype=tl.int32)
        high = tl.max(largest, axis=0).to(tl.int32, bitcast=True)
        for _ in range(PROBES):
            middle = low + (high - low) // 2
            cut = middle.to(tl.float32, bitcast=True)
            above = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, vocab, BLOCK):
                p = tl.load(base + start + offsets, mask=start + offsets < vocab, other=0.0)
                above += tl.where(p > cut, p, 0.0)
            holds = tl.sum(above, axis=0) < top_p
            high = tl.where(holds, middle, high)
            low = tl.where(holds, low, middle)
        threshold = high.to(tl.float32, bitcast=True)
        threshold = tl.where(tl.sum(total, axis=0) < top_p, 0.0, threshold)
        tl.store(out_ptr + row, threshold)

    return row_thresholds


def top_p_thresholds(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[rows] float32: each row's top-p threshold (module doc) of `probs` [rows, vocab] float32."""
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probabilities must be [rows, vocab] float32, got {tuple(probs.shape)} {probs.dtype}")
    probs = probs.contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.float32, device=probs.device)
    _kernel()[(probs.shape[0],)](probs, out, probs.stride(0), probs.shape[1], float(top_p), BLOCK=BLOCK, PROBES=PROBES)
    return out
