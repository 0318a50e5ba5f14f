"""decode/top_p_kernel.py's sort-free top-p threshold against the sort it replaces
(`sampling.sorted_thresholds`), alone and inside `choose_tokens`.

Without a GPU, Triton's interpreter runs them on the CPU (`./bootstrap.sh kernels`, which CI
runs), so a change to the kernel is checked before a GPU is at hand.
"""

import os

import pytest
import torch

from dflash_train.decode import sampling
from dflash_train.decode.sampling import choose_tokens, sorted_thresholds, thresholds_agree
from dflash_train.decode.top_p_kernel import top_p_thresholds

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRETED else pytest.mark.gpu
DEVICE = torch.device("cpu" if INTERPRETED else "cuda:0")


def _probs(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=generator) * scale, dim=-1).to(DEVICE)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 12.0])
def test_the_kernel_keeps_the_tokens_the_sort_keeps(scale, top_p):
    """Near-flat to one-token-peaked rows over a vocabulary that is no multiple of the block: the
    same kept tokens as the sort (or, where the sort's boundary is within rounding of top_p, a
    threshold that meets the rule), each threshold one of the row's own probabilities."""
    probs = _probs(12, 5003, scale, seed=int(scale * 100) + int(top_p * 1000))
    got = top_p_thresholds(probs, top_p)
    assert thresholds_agree(probs, top_p, got, sorted_thresholds(probs, top_p))
    assert (probs == got[:, None]).any(dim=-1).all()


def test_ties_zeros_and_a_row_whose_whole_mass_is_under_top_p():
    """Tied probabilities at the boundary are all kept, as the sort keeps them; probabilities that
    underflowed to 0 are never the threshold of a row whose mass reaches top_p; a row whose whole
    mass rounds under top_p keeps every token (threshold 0), as the sort does."""
    tied = torch.full((1, 1000), 1e-3)  # sums to 1: the nucleus of 0.5 is 500 tied tokens, all kept at their value
    zeros = torch.cat([torch.full((1, 10), 0.1), torch.zeros(1, 990)], dim=-1)
    short = torch.full((1, 1000), 0.9 / 1000)  # total 0.9 < 0.95
    for probs, top_p in ((tied, 0.5), (zeros, 0.95), (short, 0.95)):
        probs = probs.to(DEVICE)
        got, reference = top_p_thresholds(probs, top_p), sorted_thresholds(probs, top_p)
        assert torch.equal(probs >= got[:, None], probs >= reference[:, None]), (got, reference)
    assert top_p_thresholds(short.to(DEVICE), 0.95).item() == 0.0
    assert top_p_thresholds(zeros.to(DEVICE), 0.95).item() == pytest.approx(0.1)


def test_choose_tokens_draws_the_same_tokens_with_the_kernel_as_with_the_sort(monkeypatch):
    """The whole draw, tempered and top-p, one row per seed: the kernel's thresholds give the sort's tokens."""
    generator = torch.Generator().manual_seed(7)
    logits = (torch.randn(64, 3001, generator=generator) * 3).to(DEVICE)
    seeds = torch.arange(64, dtype=torch.int64, device=DEVICE)
    counters = torch.full((64,), 5, dtype=torch.int64, device=DEVICE)
    drawn = {}
    for uses_kernel in (True, False):
        monkeypatch.setitem(sampling._KERNEL_AGREES, DEVICE, uses_kernel)
        drawn[uses_kernel] = choose_tokens(logits, 0.8, 0.9, seeds, counters)
    assert torch.equal(drawn[True], drawn[False])


def test_the_probe_lets_the_kernel_run_here():
    """The probe `choose_tokens` makes once per device passes where the kernel runs."""
    assert sampling._kernel_agrees(DEVICE)
