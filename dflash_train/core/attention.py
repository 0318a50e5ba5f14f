"""The DFlash attention mask: one definition, two backends computing the same function.

Keys/values are laid out as [context (S positions) ; blocks (N blocks of B tokens)] and
queries are the N·B block tokens. A query in block n (anchored at position a_n):
  - sees context position j only if j < a_n (strictly before its anchor: the anchor's own
    target state does not exist yet when the drafter runs at inference time);
  - sees every token of its own block (bidirectional), and no other block.
Padded anchor slots get a_n = 0, so they see only their own block: no empty rows, no NaN.

A packed micro-batch (`step.pack_rows`) lays its rows end to end in one context of rows of
`row_length` positions, its anchors numbered in that context: then a query sees context
position j only if j is also in its anchor's row, a_n − (a_n mod row_length) <= j < a_n.

Backends: flex_attention with a BlockMask (compiled; GPU; its backward does not exist on
CPU) on Triton's kernels (`flex`) or on FlashAttention-4's CuTe DSL kernels (`flash`: the
`flash-attn-4` package, Hopper or newer), and SDPA with a dense boolean mask evaluated from the
very same `mask_mod`.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKENDS

try:  # flex_attention is in every supported torch; guarded so a broken build still imports
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dflash_mask_mod(anchors: torch.Tensor, context_len: int, block_size: int, row_length: int | None = None) -> MaskMod:
    """`anchors`: [batch, N] anchor positions (0 for padded slots); `row_length`: the length of
    the rows a packed context holds (None: the context is one row)."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[b, block]
        sees_context = kv_idx < anchor  # anchors < context_len, so kv_idx is context
        if row_length is not None:
            sees_context = sees_context & (kv_idx >= anchor - anchor % row_length)
        in_own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return sees_context | in_own_block

    return mask_mod


def dense_mask(anchors: torch.Tensor, context_len: int, block_size: int, row_length: int | None = None) -> torch.Tensor:
    """The mask as a dense boolean tensor [batch, 1, N·B, S + N·B] for SDPA."""
    batch, num_blocks = anchors.shape
    queries = num_blocks * block_size
    device = anchors.device
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(queries, device=device)[None, :, None]
    kv = torch.arange(context_len + queries, device=device)[None, None, :]
    mask = dflash_mask_mod(anchors, context_len, block_size, row_length)(b, None, q, kv)
    return mask[:, None]


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int, tile: int = 128,
               row_length: int | None = None) -> "BlockMask":
    """The mask as a flex BlockMask, computed from the anchors in closed form.

    `create_block_mask` would evaluate the mask over every (query, key) pair each step and, in
    eager mode, write global FX state that races other threads' compiles. The tile structure
    follows directly from the sorted anchors instead: for the queries of one tile, with lo/hi
    the smallest/largest anchor among them and first/last the starts of their rows, context
    tiles inside [last, lo) are fully visible, the other tiles meeting [first, hi) are partially
    visible, and the tiles holding the queries' own blocks are partial. `mask_mod` still decides
    inside partial tiles, so the result is exactly the mask of `dflash_mask_mod` (tests compare
    it with create_block_mask). No host synchronisation, no FX tracing.
    """
    batch, num_blocks = anchors.shape
    queries = num_blocks * block_size
    keys = context_len + queries
    device = anchors.device
    q_tiles, kv_tiles = -(-queries // tile), -(-keys // tile)
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    pad = q_tiles * tile - queries

    def per_tile(values: torch.Tensor, fill: int, reduce: str) -> torch.Tensor:
        padded = F.pad(values, (0, pad), value=fill).view(batch, q_tiles, tile)
        return padded.amin(-1) if reduce == "min" else padded.amax(-1)

    lo, hi = per_tile(query_anchor, context_len, "min"), per_tile(query_anchor, 0, "max")  # fills beyond any anchor
    if row_length is None:  # one row: every query's row starts at 0
        first = last = torch.zeros_like(lo)
    else:
        row_start = query_anchor - query_anchor % row_length
        first, last = per_tile(row_start, context_len, "min"), per_tile(row_start, 0, "max")
    # Own-block key tiles of each query tile (same for every row): static, from shapes only.
    first_query = torch.arange(q_tiles, device=device) * tile
    last_query = torch.clamp(first_query + tile, max=queries) - 1
    first_own = (context_len + first_query // block_size * block_size) // tile
    last_own = (context_len + last_query // block_size * block_size + block_size - 1) // tile
    # Context tiles [full_start, full_end) are entirely inside every query's visible span.
    full_start, full_end = -(-last // tile), lo // tile
    has_full = full_end > full_start
    full_start, full_end = torch.where(has_full, full_start, first // tile), torch.where(has_full, full_end, first // tile)
    full = full_end - full_start
    # Partial context tiles: those of [first, hi) before and after the full ones.
    partial_start = torch.minimum(first // tile, full_start)
    partial_end = torch.minimum(-(-hi // tile), first_own.expand_as(hi))
    before = full_start - partial_start
    after = (partial_end - full_end).clamp(min=0)
    partial = before + after
    own = (last_own - first_own + 1).expand_as(partial)
    slot = torch.arange(kv_tiles, device=device)
    kv_indices = torch.where(
        slot < before[..., None], partial_start[..., None] + slot,
        torch.where(slot < partial[..., None], full_end[..., None] + slot - before[..., None],
                    first_own[None, :, None] + slot - partial[..., None]),
    ).clamp(max=kv_tiles - 1)
    full_indices = (full_start[..., None] + slot).clamp(max=kv_tiles - 1)
    return BlockMask.from_kv_blocks(
        (partial + own)[:, None].int(), kv_indices[:, None].int(),
        full[:, None].int(), full_indices[:, None].int(),
        BLOCK_SIZE=tile, mask_mod=dflash_mask_mod(anchors, context_len, block_size, row_length),
        seq_lengths=(queries, keys),
    )


class FlexMask(NamedTuple):
    """A BlockMask with the flex kernel options it runs under, e.g. FLASH_KERNELS for
    FlashAttention-4's kernels (same mask, same function; bf16 results differ in rounding only).
    A plain BlockMask runs on Triton's kernels."""

    block_mask: "BlockMask"
    kernel_options: tuple[tuple[str, str], ...]


FLASH_KERNELS = (("BACKEND", "FLASH"),)
FLEX_BACKENDS = ("flex", "flash")  # the backends that run flex_attention (compiled, CUDA only)

# Triton tile / pipelining choices passed to every flex call (None: the torch release's own
# defaults for the GPU); `bench/flex_tuning.py` measures candidates on the DFlash mask.
flex_kernel_options: dict | None = None


@functools.cache
def _flex():
    return torch.compile(flex_attention, dynamic=False)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "FlexMask | BlockMask | torch.Tensor | None", scale: float
) -> torch.Tensor:
    """q: [b, heads, Q, d]; k, v: [b, kv_heads, K, d] (grouped-query heads allowed)."""
    if isinstance(mask, FlexMask) or (BlockMask is not None and isinstance(mask, BlockMask)):
        block, kernels = (mask.block_mask, dict(mask.kernel_options)) if isinstance(mask, FlexMask) else (mask, {})
        # Inside a compiled drafter forward the surrounding graph compiles flex itself;
        # called eagerly, flex must go through torch.compile to get its fused kernel.
        flex = flex_attention if torch.compiler.is_compiling() else _flex()
        options = {**(flex_kernel_options or {}), **kernels}
        return flex(q, k, v, block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                    **({"kernel_options": options} if options else {}))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> flex on CUDA, sdpa elsewhere (flex has no CPU backward)."""
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: use auto, {', '.join(ATTENTION_BACKENDS[:-1])} or {ATTENTION_BACKENDS[-1]}")
    return backend


def flash_kernels_missing() -> str | None:
    """Why flex cannot run on FlashAttention-4's kernels here (its package is not importable), else None."""
    try:
        if importlib.util.find_spec("flash_attn.cute") is not None:
            return None
    except ImportError:
        pass
    return "the flash-attn-4 package is not installed (pip install flash-attn-4; for CUDA 13: flash-attn-4[cu13])"


def make_mask(backend: str, anchors: torch.Tensor, context_len: int, block_size: int, row_length: int | None = None):
    if backend == "flex":
        return block_mask(anchors, context_len, block_size, row_length=row_length)
    if backend == "flash":
        return FlexMask(block_mask(anchors, context_len, block_size, row_length=row_length), FLASH_KERNELS)
    return dense_mask(anchors, context_len, block_size, row_length)
