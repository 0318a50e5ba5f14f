"""core/head_kernel.py's fused softmax kernel on a GPU against the torch reference
(`objective.softmax_cross_entropy`) and the whole chunked frozen-head CE through it.

Without a GPU, Triton's interpreter runs them on the CPU (a minute: `./bootstrap.sh kernels`,
which CI runs), so a change to the kernel is checked before a GPU is at hand.

The interpreter has no libdevice, so the softcap cases (tanh) and the device probe skip there."""

import os

import pytest
import torch

from dflash_train.core.head_kernel import BLOCK, fused_softmax_cross_entropy
from dflash_train.core.objective import (
    candidate_segment,
    frozen_head_cross_entropy,
    frozen_head_cross_entropy_and_candidates,
    fused_head_unsupported,
    softmax_cross_entropy,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRETED else pytest.mark.gpu
DEVICE = torch.device("cpu" if INTERPRETED else "cuda:0")
needs_libdevice = pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter has no libdevice (the softcap's tanh)")


def _logits(rows, vocab, dtype, seed=0, scale=4.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * scale).to(dtype).to(DEVICE)


def _relative_entries(got, want, floor=1e-6):
    return float(((got.float() - want.float()).abs() / (want.float().abs() + floor)).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("softcap", [0.0, pytest.param(30.0, marks=needs_libdevice)])
def test_the_fused_kernel_equals_the_reference(dtype, softcap):
    """A vocabulary of SmolLM2's size plus 13 (no multiple of the kernel's sweep), rows written
    from an offset into longer outputs, exact ties in bf16: CE to 1e-5 relative, the gradient one
    rounding of its dtype apart per entry, top-1 correctness equal (first index on ties), the
    slice maxima DFlash2's candidates are ranked by equal to the logits' own."""
    rows, vocab, offset = 301, 49152 + 13, 5
    assert vocab % BLOCK
    logits = _logits(rows, vocab, dtype)
    logits[:, 7] = logits.max() + 2.0
    logits[:, vocab - 1] = logits[:, 7]
    labels = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    labels[0], labels[1] = 7, vocab - 1
    want_ce, want_correct, want_grad = softmax_cross_entropy(logits, labels, softcap, True, dtype)
    ce = torch.full((rows + offset,), -1.0, device=DEVICE)
    correct = torch.zeros(rows + offset, dtype=torch.bool, device=DEVICE)
    all_labels = torch.cat([torch.zeros(offset, dtype=torch.long, device=DEVICE), labels])
    segment = candidate_segment(vocab)
    maxima = torch.full((rows, vocab // segment), -1.0, device=DEVICE)
    grad = fused_softmax_cross_entropy(logits, all_labels, ce, correct, offset, softcap, True, dtype, maxima, segment)
    assert torch.equal(ce[:offset], torch.full((offset,), -1.0, device=DEVICE))  # rows before the offset untouched
    # The slice maxima of the raw logits (before any softcap), the ragged tail left out.
    assert torch.equal(maxima, logits[:, :maxima.shape[1] * segment].float().view(rows, -1, segment).amax(dim=-1))
    assert _relative_entries(ce[offset:], want_ce, 1e-3) <= 1e-5
    assert torch.equal(correct[offset:], want_correct)
    assert bool(correct[offset]) and not bool(correct[offset + 1])
    assert grad.dtype == dtype
    assert _relative_entries(grad, want_grad) <= max(2 * torch.finfo(dtype).eps, 1e-5)


def test_the_fused_kernel_without_gradient_and_with_a_non_finite_row():
    rows, vocab = 64, 5000
    logits = _logits(rows, vocab, torch.bfloat16)
    logits[3, 10] = float("nan")
    labels = torch.arange(rows, device=DEVICE)
    ce = torch.empty(rows, device=DEVICE)
    correct = torch.empty(rows, dtype=torch.bool, device=DEVICE)
    assert fused_softmax_cross_entropy(logits, labels, ce, correct, 0, 0.0, False, torch.bfloat16) is None
    want_ce, want_correct, _ = softmax_cross_entropy(logits, labels, 0.0, False, torch.bfloat16)
    finite = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    finite[3] = False
    assert not bool(torch.isfinite(ce[3]))  # a NaN logit must not vanish: the step's skip rule needs it
    assert _relative_entries(ce[finite], want_ce[finite], 1e-3) <= 1e-5
    assert torch.equal(correct[finite], want_correct[finite])


@needs_libdevice  # and the probe refuses a device that is not CUDA
def test_the_probe_passes_here():
    assert fused_head_unsupported(DEVICE) is None
    assert fused_head_unsupported(DEVICE, 30.0) is None
    for vocab in (49152, 151936):  # DFlash2's kernel at SmolLM2's and Qwen3's slice widths
        assert fused_head_unsupported(DEVICE, segment=candidate_segment(vocab)) is None
        assert fused_head_unsupported(DEVICE, 30.0, candidate_segment(vocab)) is None
    assert "not a CUDA device" in fused_head_unsupported(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_frozen_head_ce_through_the_fused_kernel_equals_the_eager_chunks(dtype):
    """Per-row CE, correctness and d(loss)/d(hidden) of 1,000 rows in chunks of 192 (the last one
    short), fused against the eager reference chunks."""
    generator = torch.Generator().manual_seed(2)
    hidden = (torch.randn(1000, 256, generator=generator)).to(dtype).to(DEVICE)
    head = (torch.randn(32000, 256, generator=generator) * 0.05).to(dtype).to(DEVICE)
    labels = torch.randint(0, 32000, (1000,), generator=generator).to(DEVICE)
    weights = torch.rand(1000, generator=generator).to(DEVICE)
    results = {}
    for fused in (False, True):
        x = hidden.clone().requires_grad_(True)
        ce, correct = frozen_head_cross_entropy(x, head, labels, chunk_rows=192, fused=fused)
        (ce * weights).sum().backward()
        results[fused] = (ce, correct, x.grad)
    (ce_e, correct_e, grad_e), (ce_f, correct_f, grad_f) = results[False], results[True]
    assert _relative_entries(ce_f, ce_e, 1e-3) <= 1e-5
    assert torch.equal(correct_f, correct_e)
    # The input gradient is a product over the vocabulary of gradients one rounding apart.
    scale = float(grad_e.float().abs().max())
    assert float((grad_f.float() - grad_e.float()).abs().max()) <= (2e-2 if dtype == torch.bfloat16 else 1e-5) * scale


@pytest.mark.parametrize("softcap", [None, pytest.param(30.0, marks=needs_libdevice)])
def test_dflash2_candidates_through_the_fused_kernel_equal_the_eager_chunks(softcap):
    """The selector's candidates from the fused kernel's slice maxima: the same values and label
    logits as the eager chunks', and ids that point at those values in each chunk's logits (whole
    chunks of 128 rows, so both paths run the same product shape and get the same logits)."""
    generator = torch.Generator().manual_seed(3)
    rows, chunk = 768, 128
    hidden = torch.randn(rows, 256, generator=generator).to(torch.bfloat16).to(DEVICE)
    head = (torch.randn(49152, 256, generator=generator) * 0.05).to(torch.bfloat16).to(DEVICE)
    labels = torch.randint(0, 49152, (rows,), generator=generator).to(DEVICE)
    eager = frozen_head_cross_entropy_and_candidates(hidden, head, labels, 16, chunk_rows=chunk, softcap=softcap)[2]
    fused = frozen_head_cross_entropy_and_candidates(hidden, head, labels, 16, chunk_rows=chunk, softcap=softcap,
                                                     fused=True)[2]
    assert torch.equal(fused.values, eager.values)
    assert torch.equal(fused.label_logits, eager.label_logits)
    logits = torch.cat([hidden[start:start + chunk] @ head.t() for start in range(0, rows, chunk)])
    assert torch.equal(logits.gather(1, fused.ids), logits.gather(1, eager.ids))  # ids may differ on ties
    assert all(len(set(row)) == 16 for row in fused.ids.tolist())
