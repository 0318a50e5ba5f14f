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
exceeds u × (kept mass). The threshold comes from a sort-free Triton kernel where it runs and
agrees with the sort on a probe (`top_p_kernel.py`), else from the sort. Without top-p neither runs. Greedy (temperature 0) is argmax. A draw moves only when the logits' rounding (which batching can
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


def sorted_thresholds(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[rows]: where the smallest prefix of each row's sorted probabilities whose mass reaches
    top_p ends (the first token always stays in it)."""
    ranked = probs.sort(dim=-1, descending=True).values
    kept = ((ranked.cumsum(dim=-1) - ranked) < top_p).sum(dim=-1, keepdim=True)
    return ranked.gather(-1, kept - 1)[:, 0]


# Per device: whether the sort-free kernel (top_p_kernel.py) kept the sort's tokens on the probe.
_KERNEL_AGREES: dict[torch.device, bool] = {}


def top_p_thresholds(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[rows]: each row's top-p threshold, from the sort-free kernel where it runs and agreed with
    the sort on a probe (made once per device, never inside a CUDA graph capture), else the sort."""
    device = probs.device
    if device not in _KERNEL_AGREES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return sorted_thresholds(probs, top_p)
        _KERNEL_AGREES[device] = _kernel_agrees(device)
    if _KERNEL_AGREES[device]:
        from .top_p_kernel import top_p_thresholds as kernel_thresholds

        return kernel_thresholds(probs, top_p)
    return sorted_thresholds(probs, top_p)


def _kernel_agrees(device: torch.device) -> bool:
    """Whether the kernel runs on `device` and keeps the sort's tokens on probe rows: peaked,
    flat, tied and tiny-tailed distributions at several top_p."""
    from .top_p_kernel import available, top_p_thresholds as kernel_thresholds

    if not available(device):
        return False
    generator = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(8, 4099, generator=generator) * scale for scale in (0.1, 1.0, 4.0, 12.0)])
    logits[:4, ::3] = 2.0  # ties
    probs = torch.softmax(logits, dim=-1).to(device)
    try:
        return all(thresholds_agree(probs, top_p, kernel_thresholds(probs, top_p), sorted_thresholds(probs, top_p))
                   for top_p in (0.1, 0.5, 0.9, 0.99))
    except Exception:  # noqa: BLE001 - a kernel that does not build here leaves the sort in place
        return False


def thresholds_agree(probs: torch.Tensor, top_p: float, got: torch.Tensor, reference: torch.Tensor,
                     tolerance: float = 1e-5) -> bool:
    """Whether thresholds `got` keep the tokens `reference` (the sort's) keeps on every row of
    `probs`, except on rows where the sort's own boundary lies within `tolerance` of top_p (float
    sums in another order may round across it): there `got` must still meet the rule, the mass
    above it under top_p and the mass kept reaching it (float64, within `tolerance`)."""
    p = probs.double()

    def above(threshold: torch.Tensor) -> torch.Tensor:
        return torch.where(p > threshold[:, None].double(), p, 0.0).sum(dim=-1)

    def kept(threshold: torch.Tensor) -> torch.Tensor:
        return torch.where(p >= threshold[:, None].double(), p, 0.0).sum(dim=-1)

    same = (probs >= got[:, None]).eq(probs >= reference[:, None]).all(dim=-1)
    near = ((above(reference) - top_p).abs() < tolerance) | ((kept(reference) - top_p).abs() < tolerance)
    rule = (above(got) < top_p + tolerance) & (kept(got) >= top_p - tolerance)
    return bool((same | (near & rule)).all())


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
        # Every token at or above the threshold is kept. Draws run over vocabulary order, not the
        # sorted one: near-equal probabilities swap places in a sort at the slightest rounding
        # difference, vocabulary order never moves.
        probs = probs.masked_fill(probs < top_p_thresholds(probs, top_p)[:, None], 0.0)
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
