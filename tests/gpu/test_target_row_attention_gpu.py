"""target/row_attention_kernel.py's attention over cache rows (each read up to its own position)
against the biased attention it replaces (`static_cache.matmul_attention`), alone and inside
`StaticTarget`.

Without a GPU, Triton's interpreter runs them on the CPU (`./bootstrap.sh kernels`, which CI
runs), so a change to the kernel is checked before a GPU is at hand. The interpreter mishandles
bf16, so there the half-precision case is float16.
"""

import os

import pytest
import torch

from dflash_train.target.row_attention_kernel import attend_cache_rows
from dflash_train.target.static_cache import StaticTarget, attention_bias, matmul_attention

from tiny import tiny_target

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRETED else pytest.mark.gpu
DEVICE = torch.device("cpu" if INTERPRETED else "cuda:0")
HALF = torch.float16 if INTERPRETED else torch.bfloat16


def _biased(query, keys, values, positions, scale):
    """The reference: the cache's causal bias over the whole span, in float32."""
    span = keys.shape[2]
    visible = torch.arange(span, device=keys.device) <= positions[:, :, None]
    bias = attention_bias(visible, query.shape[1] // keys.shape[1], torch.float32)
    return matmul_attention(query.float(), keys.float(), values.float(), bias, scale)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("heads,kv_heads,queries,dim", [(9, 3, 1, 64), (4, 2, 5, 32), (6, 6, 1, 80), (8, 2, 3, 256)])
def test_rows_attend_as_the_causal_bias_does(dtype, heads, kv_heads, queries, dim):
    """Grouped heads folded (and not), one query and several (a verify block), a head size that
    is no power of two, keys and values as strided slices of a longer cache, a row at position 0,
    one at the span's end, a stale row past the span (it sees the whole span, as under the bias),
    and positions shared by every row (a stride-0 expand): float32 to 1e-5, half one rounding."""
    generator = torch.Generator().manual_seed(heads * dim + queries)
    batch, capacity, span = 6, 192, 160
    query = torch.randn(batch, heads, queries, dim, generator=generator).to(dtype).to(DEVICE)
    cache_keys, cache_values = (torch.randn(batch, kv_heads, capacity, dim, generator=generator).to(dtype).to(DEVICE)
                                for _ in range(2))
    keys, values = cache_keys[:, :, :span], cache_values[:, :, :span]
    start = torch.randint(0, span - queries + 1, (batch,), generator=generator)
    start[0], start[1], start[2] = 0, span - queries, capacity - queries  # row 2: stale, past the span
    positions = (start[:, None] + torch.arange(queries)).to(DEVICE)
    want = _biased(query, keys, values, positions.clamp(max=span - 1), 0.125)
    got = attend_cache_rows(query, keys, values, positions, 0.125)
    assert got.dtype == dtype and got.shape == (batch, queries, heads * dim)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tolerance)
    shared = (torch.tensor([37]) + torch.arange(queries)).to(DEVICE)[None].expand(batch, -1)
    torch.testing.assert_close(attend_cache_rows(query, keys, values, shared, 0.125).float(),
                               _biased(query, keys, values, shared, 0.125), **tolerance)


def test_a_wrong_row_length_is_seen():
    """The test above can fail: a row attended one position short differs from the reference."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 1, 16, generator=generator).to(DEVICE)
    keys, values = (torch.randn(2, 2, 64, 16, generator=generator).to(DEVICE) for _ in range(2))
    positions = torch.tensor([[20], [41]], device=DEVICE)
    got = attend_cache_rows(query, keys, values, positions - 1, 0.25)
    assert not torch.allclose(got, _biased(query, keys, values, positions, 0.25), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_target_with_the_row_kernel_gives_the_biased_logits(family):
    """A tiny model's batched forward over the cache: a prefill, then decode steps of rows at
    different positions over a span shorter than the capacity, logits with the kernel equal to
    those with the matmul attention (float32)."""
    target = tiny_target(family, head_scale=8)
    target.model.to(DEVICE)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 17, 9])
    ids = torch.randint(0, 90, (3, 17), generator=generator).to(DEVICE)
    logits = {}
    for attention in ("matmul", "rows"):
        model = StaticTarget(target, 256, batch=3, attention=attention)
        model.prefill_rows(ids, lengths.to(DEVICE), torch.arange(3, device=DEVICE))
        steps = []
        positions = lengths.clone().to(DEVICE)
        for step in range(4):
            tokens = torch.randint(0, 90, (3, 1), generator=torch.Generator().manual_seed(step)).to(DEVICE)
            out, _ = model.forward(tokens, positions, last_only=True, features=False, attend=64)
            steps.append(out)
            positions += 1
        logits[attention] = torch.stack(steps)
    torch.testing.assert_close(logits["rows"], logits["matmul"], rtol=1e-4, atol=1e-4)
