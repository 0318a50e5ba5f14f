"""What DFlash2 adds to the DFlash drafter: grouped dynamic causal convolutions and a candidate selector.

Parameter names and arithmetic are those of the reference (PyPI `dflash` 0.1.0, `dflash/model.py`),
so an export loads there and in the serving engines unchanged.

Convolution (one around attention, one around the MLP, in every draft layer):

    kernels = kernel_projection(h)                      H -> 2 · taps · groups, from the sub-block's input
    h'      = conv(h,   base_kernel[0] + kernels[0])    before the sub-block ("prepare")
    out'    = conv(out, base_kernel[1] + kernels[1])    after it ("finish")
    conv(x, w)[t] = Σ_{j < taps} w[j] ⊙ x[t − j]        causal along the block; a dynamic kernel is
                                                        shared by the `group_size` channels of a group

The convolution runs along the tokens of one block and never crosses into another block (at
inference a block is alone; in training the N blocks of a sequence lie side by side).
`reset_to_identity` makes it the identity (tap 0 = 1, no dynamic part): a fresh DFlash2 drafter
then computes exactly what a DFlash drafter with the same weights computes.

Candidate selector: at each draft position the head's top-k logits are the candidates, re-scored
by a rank-r bilinear term between the token before it (the predecessor) and each candidate:

    score(c | p, h) = logit(c) + Σ_r P[p, r] · (W h)[r] · S[c, r]

The draft path is chosen left to right from the anchor (the predecessor of position 1): argmax at
T = 0, a sample from softmax(score / T) at T > 0 (the q that rejection sampling needs is that
distribution over the k candidates). P and S are free vocab × rank tables (docs/ARCHITECTURE.md
says why), stored as bare parameters named as vLLM and SGLang declare them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("dflash", "dflash2")
SELECTOR_MISS_RULES = ("drop", "insert")  # a true token outside the top-k: leave the position out, or put it in


def grouped_causal_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, segment: int
) -> torch.Tensor:
    """x [b, L, H]; dynamic [b, L, taps, groups]; base [taps, H]; L a multiple of `segment` (the
    block length): tap j adds (base[j] + dynamic[..., j, group]) ⊙ x[t − j] within each segment.
    Summed in the reference's order (base term, then dynamic term, per tap)."""
    b, length, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    blocks = x.view(b, length // segment, segment, groups, group_size)
    dynamic = dynamic.reshape(b, length // segment, segment, taps, groups, 1)
    # Each tap's input, shifted right by its offset inside the segment, is a view of one padded
    # copy (one pad, not one per tap; a tap longer than the segment sees only the zeros).
    padded = F.pad(blocks, (0, 0, 0, 0, taps - 1, 0))
    out = None
    for offset in range(taps):
        values = padded[:, :, taps - 1 - offset:taps - 1 - offset + segment]
        term = base[offset].view(1, 1, 1, groups, group_size).to(x.dtype) * values
        # The reference starts from zeros; 0 + term is term, so the sums are its sums.
        out = term if out is None else out + term
        out = torch.addcmul(out, dynamic[:, :, :, offset], values)
    return out.reshape(x.shape)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sub-block's input convolved, and the kernel `finish` applies to its output."""
        dynamic = self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel_size, self.groups)
        return (grouped_causal_conv(h, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, segment),
                dynamic[..., 1, :, :])

    def finish(self, out: torch.Tensor, dynamic: torch.Tensor, segment: int) -> torch.Tensor:
        return grouped_causal_conv(out, dynamic, self.base_kernel[1], self.group_size, segment)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(
        self, projected: torch.Tensor, predecessors: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """Rows of projected hidden [n, r], predecessor ids [n], candidate logits and ids [n, k]
        -> scores [n, k] (the reference's einsum, so the sums round alike)."""
        return unary + torch.einsum(
            "br,bkr->bk",
            F.embedding(predecessors, self.predecessor_codebook) * projected,
            F.embedding(candidates, self.successor_codebook),
        )

    def select(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The draft path of one block per row: hidden [b, n, H] and logits [b, n, V] of draft
        positions 1..n, anchor ids [b] -> (path [b, n], candidates [b, n, k], q [b, n, k] or None
        at T = 0). Row i of q is the distribution path[:, i] was drawn from, given path[:, :i]."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        if temperature == 0:
            return self.greedy_path(projected, unary, candidates, anchor), candidates, None
        path, q = self.walk(projected, unary, candidates, anchor, temperature, generator)
        return path, candidates, q

    def walk(
        self,
        projected: torch.Tensor,
        unary: torch.Tensor,
        candidates: torch.Tensor,
        anchor: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's loop, one position at a time: each choice is the next predecessor;
        drawn at T > 0 (-> path, q), the argmax at T = 0 (-> path, None: `greedy_path`'s check)."""
        predecessor = anchor
        path, q_rows = [], []
        for position in range(projected.shape[1]):
            scores = self.scores(projected[:, position], predecessor, unary[:, position], candidates[:, position])
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                # Drawn where the generator lives (a decoder's may sit on the target's device).
                where = generator.device if generator is not None else q.device
                index = torch.multinomial(q.to(where), 1, generator=generator)[:, 0].to(q.device)
                q_rows.append(q)
            else:
                index = scores.argmax(dim=-1)
            predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1), torch.stack(q_rows, dim=1) if q_rows else None

    def greedy_path(
        self, projected: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, anchor: torch.Tensor
    ) -> torch.Tensor:
        """`walk` at T = 0 in a fixed number of kernels, not ~8 per position: a position's
        predecessor is the anchor or one of the previous position's k candidates, so every score
        the walk can need is one `scores` call over b·n·k rows, and the walk only follows the
        argmaxes. Each row goes through the walk's own einsum (`scores`), one row per
        predecessor, so its sums round as the walk's: the tests compare the paths."""
        b, n, k = candidates.shape
        predecessors = torch.cat([anchor[:, None, None].expand(b, 1, k), candidates[:, :-1]], dim=1)
        rows = b * n * k
        scores = self.scores(
            projected[:, :, None].expand(b, n, k, -1).reshape(rows, -1),
            predecessors.reshape(rows),
            unary[:, :, None].expand(b, n, k, k).reshape(rows, k),
            candidates[:, :, None].expand(b, n, k, k).reshape(rows, k),
        )
        # reach[:, p, j] starts as position p's pick after position p-1 picked j (position 0's
        # row: the anchor's pick, repeated). Each pass composes it with the map `span` positions
        # back, so after log2(n) gathers (not n) it is position p's pick on the path, whatever j.
        reach = scores.argmax(dim=-1).view(b, n, k)
        span = 1
        while span < n:
            reach = torch.cat([reach[:, :span], reach[:, span:].gather(-1, reach[:, :-span])], dim=1)
            span *= 2
        return candidates.gather(-1, reach[:, :, :1])[:, :, 0]

    def teacher_forced(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        candidates: torch.Tensor,
        predecessors: torch.Tensor,
        labels: torch.Tensor,
        label_logits: torch.Tensor,
        miss_rule: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The training form of `select`: every row scored with the true previous token as its
        predecessor. hidden [n, H]; unary, candidates [n, k] (the head's top-k); predecessors,
        labels, label_logits [n] (the label's own logit) -> (CE over the k candidates [n],
        the argmax is the label [n], the row counts [n]).

        A label outside the top-k: `drop` leaves the row out (it counts 0, correct False: the
        selector cannot propose a token it is not offered, as at inference); `insert` puts the
        label in place of the lowest candidate, so every scored row teaches the selector."""
        present = candidates == labels[:, None]
        hit = present.any(dim=-1)
        if miss_rule == "insert":
            lowest = unary.argmin(dim=-1, keepdim=True)
            replace = ~hit[:, None] & (torch.arange(unary.shape[1], device=unary.device) == lowest)
            candidates = torch.where(replace, labels[:, None], candidates)
            unary = torch.where(replace, label_logits[:, None].to(unary.dtype), unary)
            present = present | replace
        scores = self.scores(self.hidden_projection(hidden), predecessors, unary, candidates).float()
        target = present.float().argmax(dim=-1)  # the label's column (0 where absent: masked below)
        ce = F.cross_entropy(scores, target, reduction="none")
        counts = torch.ones_like(hit) if miss_rule == "insert" else hit
        correct = (scores.argmax(dim=-1) == target) & counts
        return ce * counts, correct, counts

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Small codebooks: the bilinear term starts near zero, so the first choices are the
        head's own (a DFlash drafter's), and the selector learns corrections from there."""
        for table in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            table.copy_(torch.randn(table.shape, generator=generator) * std)


def check_dflash2_dims(hidden_size: int, vocab_size: int, kernel_size: int, group_size: int, rank: int, top_k: int) -> str | None:
    """Why these DFlash2 sizes cannot build a drafter, or None."""
    if kernel_size < 1:
        return f"conv_kernel_size {kernel_size}: must be at least 1"
    if group_size < 1 or hidden_size % group_size:
        return f"conv_group_size {group_size}: must divide the hidden size {hidden_size}"
    if rank < 1:
        return f"selector_rank {rank}: must be at least 1"
    if not 1 <= top_k <= vocab_size:
        return f"selector_top_k {top_k}: must be in 1..{vocab_size} (the vocabulary)"
    return None
