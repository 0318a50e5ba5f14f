"""Attention over KV-cache rows that reads each row only up to its own last position (Triton).

`static_cache.matmul_attention` and SDPA attend over the same `span` of every cache row: the
furthest row sets it, and the masked positions of the others are still read. In the batched
generator's steady state that is the bulk of a decode step: 1,024 rows of SmolLM2 over 768
positions are 18 GB of keys and values, while the rows hold ~300 tokens on average. Here one
program per (cache row, KV head) streams that row's keys and values in blocks up to the last
position any of its queries sees (an online softmax, as flash attention), so the bytes read follow
the rows' own lengths. The visibility rule is the cache's: query i of row r sees the positions
≤ positions[r, i]. The grouped query heads of one KV head are folded into its program's rows
(query head h uses KV head h // groups, as `grouped_attention`), so each key is read once.

Scores and the softmax are float32; a float32 cache multiplies in IEEE float32 (no TF32), a
bf16/fp16 one multiplies its own dtype with float32 sums and rounds the probabilities to it for
the value product, as flash attention does (the matmul route rounds the scores too).

Triton is imported on first use: the CPU suite never loads it (its interpreter runs the kernel on
the CPU for the tests, `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import functools
import os

import torch

KEY_BLOCK_ELEMENTS = 4096  # keys a block × head dim: 64 keys of 64 dims, 16 of 256


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: CUDA with Triton importable (or Triton's CPU
    interpreter, which the tests turn on)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attend_rows(
        query_ptr, keys_ptr, values_ptr, positions_ptr, out_ptr, scale,
        query_row_stride, query_head_stride, query_fold_stride,
        keys_row_stride, keys_head_stride, keys_position_stride,
        values_row_stride, values_head_stride, values_position_stride,
        positions_row_stride, positions_query_stride,
        out_row_stride, out_head_stride, out_fold_stride,
        folded, queries, head_dim, span,
        FOLDED: tl.constexpr, DIM: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        fold = tl.arange(0, FOLDED)
        dims = tl.arange(0, DIM)
        fold_ok = fold < folded
        dim_ok = dims < head_dim
        # Folded row g·queries + i is query i of group g: it sees the positions ≤ its own.
        seen_up_to = tl.load(positions_ptr + row * positions_row_stride + (fold % queries) * positions_query_stride,
                             mask=fold_ok, other=-1)
        # A row's queries are consecutive positions: the last one sees furthest.
        limit = tl.minimum(tl.load(positions_ptr + row * positions_row_stride + (queries - 1) * positions_query_stride) + 1,
                           span)
        query = tl.load(query_ptr + row * query_row_stride + head * query_head_stride
                        + fold[:, None] * query_fold_stride + dims[None, :],
                        mask=fold_ok[:, None] & dim_ok[None, :], other=0.0)
        keys_row = keys_ptr + row * keys_row_stride + head * keys_head_stride
        values_row = values_ptr + row * values_row_stride + head * values_head_stride
        # A finite floor, not −inf: exp(floor − floor) is 1 for a padding row that never sees a key.
        running_max = tl.full([FOLDED], -3.0e38, tl.float32)
        running_sum = tl.zeros([FOLDED], tl.float32)
        total = tl.zeros([FOLDED, DIM], tl.float32)
        for start in range(0, limit, KEYS):
            positions = start + tl.arange(0, KEYS)
            inside = positions < limit
            block_ok = inside[:, None] & dim_ok[None, :]
            keys = tl.load(keys_row + positions[:, None] * keys_position_stride + dims[None, :], mask=block_ok, other=0.0)
            if IEEE:
                scores = tl.dot(query, tl.trans(keys), input_precision="ieee")
            else:
                scores = tl.dot(query, tl.trans(keys))
            seen = inside[None, :] & (positions[None, :] <= seen_up_to[:, None])
            scores = tl.where(seen, scores * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            probs = tl.exp(scores - new_max[:, None])
            correction = tl.exp(running_max - new_max)
            running_sum = running_sum * correction + tl.sum(probs, 1)
            values = tl.load(values_row + positions[:, None] * values_position_stride + dims[None, :],
                             mask=block_ok, other=0.0)
            if IEEE:
                total = total * correction[:, None] + tl.dot(probs, values, input_precision="ieee")
            else:
                total = total * correction[:, None] + tl.dot(probs.to(values.dtype), values)
            running_max = new_max
        out = total / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(out_ptr + row * out_row_stride + head * out_head_stride + fold[:, None] * out_fold_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=fold_ok[:, None] & dim_ok[None, :])

    return attend_rows


def _power_of_two_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def attend_cache_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """query [b, heads, q, d] over cache rows keys/values [b, kv_heads, span, d] (any row and head
    strides, unit stride along d), query i of row r seeing positions ≤ positions[r, i] ([b, q],
    increasing along q as a row's new tokens do) -> [b, q, heads·d], as
    `static_cache.grouped_attention` with the cache's causal bias. Nothing past `span` is read: a
    row whose last position lies beyond it (a finished row's stale one) sees the whole span, and
    its output means nothing, as under the bias."""
    batch, heads, length, dim = query.shape
    kv_heads = keys.shape[1]
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("attend_cache_rows needs keys and values contiguous along the head dimension")
    folded = heads // kv_heads * length
    query = query.reshape(batch, kv_heads, folded, dim)  # a copy only if the heads are not adjacent
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(batch, kv_heads, folded, dim, dtype=query.dtype, device=query.device)
    attend_rows = _kernel()
    dim_block = _power_of_two_at_least(dim, 16)
    attend_rows[(batch, kv_heads)](
        query, keys, values, positions, out, scale,
        query.stride(0), query.stride(1), query.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        folded, length, dim, keys.shape[2],
        FOLDED=_power_of_two_at_least(folded, 16), DIM=dim_block, KEYS=max(16, KEY_BLOCK_ELEMENTS // dim_block),
        IEEE=query.dtype == torch.float32, num_warps=4, num_stages=2,
    )
    return out.reshape(batch, heads, length, dim).transpose(1, 2).reshape(batch, length, heads * dim)
