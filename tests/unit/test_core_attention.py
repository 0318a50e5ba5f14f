"""One mask, two backends: flex (BlockMask) and SDPA (dense) compute the same function."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash_train.core.attention import attend, dense_mask, dflash_mask_mod


def _anchors(batch, num_anchors, context_len, valid_counts, seed):
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    for b, count in enumerate(valid_counts):
        anchors[b, :count] = torch.sort(torch.randperm(context_len - 1, generator=generator)[:count])[0]
    return anchors  # padded slots stay at 0


def test_mask_semantics_by_hand():
    # context of 6, two blocks of 3 anchored at 2 and 4
    mask = dense_mask(torch.tensor([[2, 4]]), context_len=6, block_size=3)[0, 0]
    ctx, blocks = mask[:, :6], mask[:, 6:]
    assert ctx[:3].tolist() == [[True, True, False, False, False, False]] * 3  # strictly before anchor 2
    assert ctx[3:].tolist() == [[True, True, True, True, False, False]] * 3
    assert blocks.tolist() == [[True] * 3 + [False] * 3] * 3 + [[False] * 3 + [True] * 3] * 3


def _random_qkv(batch, heads, kv_heads, queries, keys, dim, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, dim, generator=generator)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator)
    v = torch.randn(batch, kv_heads, keys, dim, generator=generator)
    return q, k, v


CASES = [  # (context_len, block_size, num_anchors, valid anchors per row)
    (37, 4, 5, [5, 2]),
    (128, 8, 16, [16, 0]),  # a row with no valid anchor: only padded slots
    (200, 16, 9, [3, 9]),
]


@pytest.mark.parametrize("context_len,block_size,num_anchors,valid", CASES)
@pytest.mark.parametrize("compiled", [False, True])
def test_flex_forward_equals_sdpa(context_len, block_size, num_anchors, valid, compiled):
    anchors = _anchors(2, num_anchors, context_len, valid, seed=context_len)
    queries = num_anchors * block_size
    q, k, v = _random_qkv(2, 4, 2, queries, context_len + queries, 16, seed=1)
    dense = dense_mask(anchors, context_len, block_size)
    block = create_block_mask(
        dflash_mask_mod(anchors, context_len, block_size), 2, None, queries, context_len + queries, device="cpu"
    )
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    expected = attend(q, k, v, dense, scale=0.25)
    got = flex(q, k, v, block_mask=block, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_len,block_size,num_anchors,valid", CASES)
def test_sdpa_input_gradients_equal_explicit_softmax(context_len, block_size, num_anchors, valid):
    """flex has no CPU backward; on CPU the SDPA path is checked against an explicit
    masked softmax (the GPU test below compares flex and SDPA gradients directly)."""
    anchors = _anchors(2, num_anchors, context_len, valid, seed=7)
    queries = num_anchors * block_size
    q, k, v = (t.requires_grad_() for t in _random_qkv(2, 4, 4, queries, context_len + queries, 8, seed=2))
    mask = dense_mask(anchors, context_len, block_size)
    weights = torch.ones_like(q[..., :1]).expand(*q.shape[:-1], 8) * torch.linspace(-1, 1, 8)
    out = attend(q, k, v, mask, scale=0.3)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * 0.3
    reference = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    reference_grads = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("context_len,block_size,num_anchors,valid", CASES)
def test_flex_gradients_equal_sdpa_on_gpu(context_len, block_size, num_anchors, valid):
    device = "cuda"
    anchors = _anchors(2, num_anchors, context_len, valid, seed=3).to(device)
    queries = num_anchors * block_size
    tensors = [t.to(device).requires_grad_() for t in _random_qkv(2, 4, 2, queries, context_len + queries, 64, seed=4)]
    from dflash_train.core.attention import block_mask

    block = block_mask(anchors, context_len, block_size)  # the production path (closed form)
    dense = dense_mask(anchors, context_len, block_size)
    flex_out = torch.compile(flex_attention, dynamic=False)(*tensors, block_mask=block, scale=0.125, enable_gqa=True)
    flex_grads = torch.autograd.grad(flex_out.square().sum(), tensors)
    sdpa_out = attend(*tensors, dense, scale=0.125)
    sdpa_grads = torch.autograd.grad(sdpa_out.square().sum(), tensors)
    torch.testing.assert_close(flex_out, sdpa_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(flex_grads, sdpa_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def _effective_mask(mask, anchors, context_len, block_size, tile, row_length=None):
    """What flex computes with `mask`: full tiles all True, partial tiles filtered by mask_mod,
    unlisted tiles False. Fails on a listed tile twice or a 'full' tile that is not full."""
    batch, num = anchors.shape
    queries, keys = num * block_size, context_len + num * block_size
    dense = dense_mask(anchors, context_len, block_size, row_length)[:, 0]
    out = torch.zeros(batch, queries, keys, dtype=torch.bool)
    for b in range(batch):
        for qt in range(mask.kv_num_blocks.shape[2]):
            rows = slice(qt * tile, min((qt + 1) * tile, queries))
            partial = mask.kv_indices[b, 0, qt, : mask.kv_num_blocks[b, 0, qt]].tolist()
            full = mask.full_kv_indices[b, 0, qt, : mask.full_kv_num_blocks[b, 0, qt]].tolist()
            assert len(set(partial + full)) == len(partial + full), "a key tile listed twice"
            for j in partial:
                cols = slice(j * tile, min((j + 1) * tile, keys))
                out[b, rows, cols] |= dense[b, rows, cols]
            for j in full:
                cols = slice(j * tile, min((j + 1) * tile, keys))
                assert dense[b, rows, cols].all(), "a tile marked full is not"
                out[b, rows, cols] = True
    return out, dense


def test_closed_form_block_mask_equals_the_mask_definition():
    from dflash_train.core.attention import block_mask

    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        block = int(torch.randint(2, 20, (1,), generator=generator))
        context = int(torch.randint(2, 600, (1,), generator=generator))
        num = int(torch.randint(1, 40, (1,), generator=generator))
        counts = [int(torch.randint(0, min(num, context - 1) + 1, (1,), generator=generator)) for _ in range(2)]
        anchors = _anchors(2, num, context, counts, seed=int(torch.randint(0, 10**6, (1,), generator=generator)))
        for tile in (128, 16):
            got, want = _effective_mask(block_mask(anchors, context, block, tile=tile), anchors, context, block, tile)
            assert torch.equal(got, want), (block, context, num, tile)


def _packed_anchors(rows, row_length, slots, counts, seed):
    """Every row's anchors numbered in the packed context (row r's anchor a as r·row_length + a),
    in order, then padded slots (0) up to `slots`: what step.pack_rows makes."""
    per_row = _anchors(rows, max(max(counts), 1), row_length, counts, seed)
    numbered = [per_row[r, :count] + r * row_length for r, count in enumerate(counts)]
    anchors = torch.zeros(1, slots, dtype=torch.long)
    packed = torch.cat(numbered)
    anchors[0, : len(packed)] = packed
    return anchors


def test_packed_mask_keeps_each_query_inside_its_own_row():
    # two rows of 5; anchors at 3 (row 0) and 5 + 2 (row 1), blocks of 2
    mask = dense_mask(torch.tensor([[3, 7]]), context_len=10, block_size=2, row_length=5)[0, 0]
    assert mask[:2, :10].tolist() == [[True] * 3 + [False] * 7] * 2
    assert mask[2:, :10].tolist() == [[False] * 5 + [True] * 2 + [False] * 3] * 2
    assert mask[:, 10:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


def test_closed_form_block_mask_of_packed_rows_equals_the_mask_definition():
    """Query tiles inside one row, across rows, with padded slots after the last row's; rows of
    lengths that are and are not multiples of the tile."""
    from dflash_train.core.attention import block_mask

    generator = torch.Generator().manual_seed(1)
    for _ in range(40):
        block = int(torch.randint(2, 20, (1,), generator=generator))
        rows = int(torch.randint(1, 5, (1,), generator=generator))
        row_length = int(torch.randint(3, 300, (1,), generator=generator))
        counts = [int(torch.randint(0, min(30, row_length - 1) + 1, (1,), generator=generator)) for _ in range(rows)]
        slots = sum(counts) + int(torch.randint(0, 6, (1,), generator=generator))
        if slots == 0:
            continue
        anchors = _packed_anchors(rows, row_length, slots, counts, seed=int(torch.randint(0, 10**6, (1,), generator=generator)))
        context = rows * row_length
        for tile in (128, 16):
            mask = block_mask(anchors, context, block, tile=tile, row_length=row_length)
            got, want = _effective_mask(mask, anchors, context, block, tile, row_length)
            assert torch.equal(got, want), (block, rows, row_length, counts, tile)


def test_closed_form_block_mask_of_packed_rows_in_flex_equals_sdpa():
    from dflash_train.core.attention import block_mask

    row_length, block_size, counts = 200, 16, [9, 2, 0, 7]
    anchors = _packed_anchors(len(counts), row_length, 20, counts, seed=21)
    context, queries = len(counts) * row_length, 20 * block_size
    q, k, v = _random_qkv(1, 4, 2, queries, context + queries, 16, seed=8)
    mask = block_mask(anchors, context, block_size, row_length=row_length)
    got = flex_attention(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)
    want = attend(q, k, v, dense_mask(anchors, context, block_size, row_length), scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_len,block_size,num_anchors,valid", CASES)
def test_closed_form_block_mask_in_flex_equals_sdpa(context_len, block_size, num_anchors, valid):
    from dflash_train.core.attention import block_mask

    anchors = _anchors(2, num_anchors, context_len, valid, seed=11)
    queries = num_anchors * block_size
    q, k, v = _random_qkv(2, 4, 2, queries, context_len + queries, 16, seed=5)
    got = flex_attention(q, k, v, block_mask=block_mask(anchors, context_len, block_size), scale=0.25, enable_gqa=True)
    want = attend(q, k, v, dense_mask(anchors, context_len, block_size), scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_flash_backend_runs_the_flex_mask_on_flashattention_kernels():
    """`--attention flash`: the same closed-form BlockMask as flex, carried with the kernel option
    that selects FlashAttention-4's kernels; the option reaches flex (a wrong one is refused there;
    the CPU's flex ignores a valid one), and a compiled caller takes new anchors without a recompile."""
    from dflash_train.core.attention import FLASH_KERNELS, FlexMask, make_mask

    context_len, block_size, num_anchors = 200, 16, 9
    queries = num_anchors * block_size
    q, k, v = _random_qkv(2, 4, 2, queries, context_len + queries, 16, seed=6)
    masks = [make_mask("flash", _anchors(2, num_anchors, context_len, valid, seed=seed), context_len, block_size)
             for seed, valid in ((12, [3, 9]), (13, [9, 0]))]
    flex = make_mask("flex", _anchors(2, num_anchors, context_len, [3, 9], seed=12), context_len, block_size)
    assert isinstance(masks[0], FlexMask) and masks[0].kernel_options == FLASH_KERNELS
    assert torch.equal(masks[0].block_mask.kv_indices, flex.kv_indices)
    with pytest.raises(ValueError, match="BACKEND"):
        attend(q, k, v, FlexMask(masks[0].block_mask, (("BACKEND", "CUTLASS"),)), scale=0.25)

    compiled = torch.compile(lambda q, k, v, mask: attend(q, k, v, mask, scale=0.25), dynamic=False)
    for i, (mask, valid) in enumerate(zip(masks, ([3, 9], [9, 0]))):
        want = attend(q, k, v, dense_mask(_anchors(2, num_anchors, context_len, valid, seed=12 + i), context_len, block_size), scale=0.25)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            torch.testing.assert_close(compiled(q, k, v, mask), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("context_len,block_size,num_anchors,valid", CASES)
def test_flash_kernels_gradients_equal_sdpa_on_gpu(context_len, block_size, num_anchors, valid):
    """FlashAttention-4's kernels (needs the flash-attn-4 package and a Hopper GPU; skipped without
    them, where it proves nothing) against SDPA on the dense mask, in bf16 as training runs them."""
    pytest.importorskip("flash_attn.cute")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention-4 trains on Hopper or newer")
    from dflash_train.core.attention import make_mask

    anchors = _anchors(2, num_anchors, context_len, valid, seed=3).cuda()
    queries = num_anchors * block_size
    tensors = [t.cuda().bfloat16().requires_grad_() for t in _random_qkv(2, 4, 2, queries, context_len + queries, 64, seed=4)]
    flash_out = torch.compile(attend, dynamic=False)(*tensors, make_mask("flash", anchors, context_len, block_size), scale=0.125)
    flash_grads = torch.autograd.grad(flash_out.float().square().sum(), tensors)
    exact = [t.detach().float().requires_grad_() for t in tensors]
    sdpa_out = attend(*exact, dense_mask(anchors, context_len, block_size), scale=0.125)
    sdpa_grads = torch.autograd.grad(sdpa_out.square().sum(), exact)
    torch.testing.assert_close(flash_out.float(), sdpa_out, rtol=2e-2, atol=2e-2)
    for got, want in zip(flash_grads, sdpa_grads):
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)
