"""Per-row sampling on the device whose draws depend only on the row's seed and token index.

Batched generation must give a row the answer it would get alone: its random draws may not
depend on which rows share its batch, on its slot, or on how many steps ran before it was
admitted. A torch.Generator per row would need one kernel per row and a host sync each step,
and cannot live inside a CUDA graph. Instead the draw for token k of a row with seed s is a
counter-based hash, computed with integer tensor operations (exact, the same bits on CPU and
CUDA, capturable in a graph):

    h = fmix32(fmix32(fmix32(fmix32(s_lo ^ A) ^ s_hi) ^ k_lo) ^ k_hi)      (murmur3's finaliser)
    u = h / 2**32                                                          uniform in [0, 1)

with s_lo/s_hi and k_lo/k_hi the 32-bit halves of s and k, and A = 0x9E3779B9. The token is then drawn by inverse
CDF from the tempered, top-p-filtered distribution: the tokens kept are those at or above the
probability where the sorted mass first reaches top_p (the most likely token always), and the
token drawn is the first, in vocabulary order, whose cumulative kept mass (summed in float64)
exceeds u × (kept mass). Without top-p nothing is sorted. Greedy (temperature 0) is argmax. A draw moves only when the logits' rounding (which batching can
change in the last bits) moves a cumulative boundary across u: about as rare as a greedy near-tie.

Multiplications mod 2**32 are done on 16-bit halves so no intermediate leaves int64's range.
"""

from __future__ import annotations

import torch

_LOW32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x · constant) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    high = ((x >> 16) * constant) & 0xFFFF
    return ((x & 0xFFFF) * constant + (high << 16)) & _LOW32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_draws(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row (float64) from non-negative int64 `seeds` and `counters`
    (the index of the token being drawn); a pure function of each row's own pair."""
    h = _fmix32((seeds & _LOW32) ^ _SEED_SALT)
    h = _fmix32(h ^ ((seeds >> 32) & _LOW32))
    h = _fmix32(h ^ (counters & _LOW32))
    h = _fmix32(h ^ ((counters >> 32) & _LOW32))
    return h.double() / 2.0**32


def choose_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, seeds: torch.Tensor | None, counters: torch.Tensor | None
) -> torch.Tensor:
    """The next token of each row of `logits` [rows, vocab]: argmax when temperature <= 0, else
    a draw as in the module doc (seeds and counters [rows], int64)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    if seeds is None or counters is None:
        raise ValueError("sampling needs a seed and a token index per row")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        # The smallest prefix of the sorted probabilities whose mass reaches top_p (the first
        # token always stays) ends at a threshold; every token at or above it is kept. Draws run
        # over vocabulary order, not the sorted one: near-equal probabilities swap places in a
        # sort at the slightest rounding difference, vocabulary order never moves.
        ranked = probs.sort(dim=-1, descending=True).values
        kept = ((ranked.cumsum(dim=-1) - ranked) < top_p).sum(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < ranked.gather(-1, kept - 1), 0.0)
    # In float64: a float32 running sum over a flat 50k-token distribution drifts by about a
    # token's width, so the last-bit differences batching makes in the logits would move draws.
    cumulative = probs.double().cumsum(dim=-1)
    total = cumulative[:, -1:]
    # u × total may round to total itself; stay strictly below it.
    target = torch.minimum(uniform_draws(seeds, counters)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cumulative, target, right=True).clamp_(max=probs.shape[-1] - 1)
    # A parallel cumulative sum may round a zero-probability token's entry above its
    # predecessor's; never emit such a token (it would have probability ~1e-7): take the
    # most likely one instead.
    index = torch.where(probs.gather(-1, index) > 0, index, probs.argmax(dim=-1, keepdim=True))
    return index[:, 0]
