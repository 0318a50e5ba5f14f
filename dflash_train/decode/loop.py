"""Speculative decoding with a DFlash drafter: the reference decode loop, whichever decoder runs it.

The decoder follows the reference inference loop (docs/SEMANTICS.md, PyPI `dflash.dflash_generate`) step
for step, so τ measured here is the τ a serving engine sees:

    prefill the target on the prompt (keeping hidden states)   -> first token (the first "bonus")
    repeat while fewer than max_new_tokens and no stop token:
        V      = min(B, room left)                               the last block may be shorter
        block  = [last bonus, MASK × (V − 1)]
        drafts = one drafter pass over the block, with the context features added since
                 the last step                                   argmax (T = 0) or samples (T > 0)
        verify = one target pass over the block (KV cache)
        accept the longest prefix of drafts the target agrees with, then the target's own next
        token (the new bonus); keep at most the room left, cut after a stop token
        crop the target cache to the kept tokens; only those kept positions' hidden states
        become new context for the drafter

At T = 0 "agrees" means draft == target argmax, so the output is exactly target-only greedy
decoding. At T > 0 it is exact rejection sampling (accept with probability min(1, p/q), on
rejection sample normalised max(0, p − q), after a full accept sample the bonus from p), so the
output is distributed as the target's own samples. `generate(target, None, ...)` runs the same
loop with a block of one token: plain target-only decoding through the same KV-cache code path,
our speed-up baseline and losslessness oracle.

τ per verify step is the number of tokens that step added (accepted + 1, clipped at
max_new_tokens and at a stop token), exactly what the reference records as its acceptance length.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..config import DECODERS, ConfigError, UserError
from ..core.drafter import DFlashDrafter, unwrap_drafter
from ..target.model import Target, target_config
from ..target.probe import float32_replica, static_unsupported
from .hf import HFDecoder, rollback_note
from .static import StaticDecoder, static_capacity, static_state


@dataclass
class Generation:
    """One decoded prompt. `tokens` are the new tokens only (a final stop token included)."""

    prompt_length: int
    tokens: list[int]
    acceptance_lengths: list[int]  # tokens added per verify step (reference semantics); empty for target-only
    prefill_seconds: float
    decode_seconds: float
    stopped: bool  # ended on a stop token (else on max_new_tokens)
    decoder: str = "hf"  # which decoder ran the forwards: "static" or "hf" (see make_decoder)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tau(self) -> float | None:
        """Mean tokens per verify step, or None when no verify step ran (e.g. a stop at token 1)."""
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)



def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [..., vocab] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def rejection_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Exact speculative sampling of one verify step.

    draft_tokens [n] were drawn from draft_probs [n, vocab] (row i: the drafter's distribution
    at block position i + 1); target_probs [n + 1, vocab] (row i: the target's distribution of
    the token after block position i). Returns (accepted, next_token): draft i is accepted with
    probability min(1, p/q) while all before it were; after the first rejection the next token is
    drawn from normalised max(0, p − q); after a full accept it is drawn from the last p row.
    Every emitted token is then distributed as under the target alone.
    """
    n = draft_tokens.shape[0]
    rows = torch.arange(n, device=draft_tokens.device)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    u = torch.rand(n, generator=generator, device=target_probs.device)
    # u·q < p  <=>  u < p/q (q > 0: the token was drawn from q), i.e. accept w.p. min(1, p/q).
    accepted = int((u * q < p).int().cumprod(0).sum())
    if accepted == n:
        return n, int(_sample(target_probs[n], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    # p == q exactly leaves no residual mass; a rejection is then impossible, but float rounding
    # could still produce one: fall back to p, which is the right distribution in that case.
    dist = residual / total if float(total) > 0 else target_probs[accepted]
    return accepted, int(_sample(dist, generator))


def selector_drafts(
    runner, drafter: DFlashDrafter, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int,
    temperature: float, generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash2 drafter's sampled path [length − 1] and, for `rejection_sample`, each draft's
    distribution given the drafts before it, as dense rows [length − 1, vocab] (q over the
    selector's k candidates, zero elsewhere), on the target's device."""
    hidden, logits = runner.draft_hidden(features, start, bonus, length)
    device = hidden.device
    path, candidates, q = drafter.candidate_selector.select(
        hidden[None], logits[None].to(device), bonus.to(device), temperature, generator)
    dense = torch.zeros_like(logits).scatter_(1, candidates[0].to(logits.device), q[0].to(logits.device))
    return path[0].to(bonus.device), dense


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return _sample(torch.softmax(logits / temperature, dim=-1), generator)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()




def static_refusal(target: Target, drafter: DFlashDrafter | None, capacity: int) -> str | None:
    """Why the static decoder cannot run this pair at this cache size, or None when it can."""
    if drafter is not None:
        if type(drafter).draft is not DFlashDrafter.draft:
            return f"{type(drafter).__name__} overrides draft()"
        if drafter.fc.weight.device != target.device:
            return f"the drafter is on {drafter.fc.weight.device}, the target on {target.device}"
    return static_unsupported(target, capacity)


def _static_capacity(drafter: DFlashDrafter | None, tokens: int) -> int:
    return static_capacity(tokens, drafter.config.block_size if drafter is not None else 1)


def static_refusal_of_config(config: Any, tokens: int, block_size: int) -> str | None:
    """Why the static decoder cannot run a target of this Hugging Face `config` on `tokens`
    (prompt + new) in blocks of `block_size`, or None when it can, judged on a random replica of
    its class and config: no weights load, so `doctor` can say it and `eval --decoder static` can
    refuse before any model loads, in the words the decoder itself would use."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # class and config only, no memory
    replica = Target(float32_replica(skeleton, torch.device("cpu")))
    return static_unsupported(replica, static_capacity(tokens, block_size))


def check_static_before_loading(target_path: str | Path, tokens: int, block_size: int) -> None:
    """`--decoder static` refused before any model loads where the target's class and config
    refuse it at `tokens` (a run's shortest length: a refusal there holds at every longer one).
    A sliding window only the longest prompt overruns is refused by `make_decoder`, in the same words."""
    refusal = static_refusal_of_config(target_config(target_path), tokens, block_size)
    if refusal is not None:
        raise _static_refused(refusal)


def _static_refused(refusal: str) -> UserError:
    return UserError(f"the static decoder cannot run this target/drafter: {refusal}; use --decoder hf")


def make_decoder(
    target: Target, drafter: DFlashDrafter | None, max_length: int, choice: str = "auto", cache_tokens: int = 0,
    compile_draft: bool = False,
):
    """`static` (preallocated caches, CUDA graphs on GPU; see decode/static.py), `hf` (Hugging
    Face eagerly) or `auto`: static where the model passes its probe, else hf. Static caches hold
    at least max(max_length, cache_tokens) tokens: a run that passes its longest prompt + new
    tokens as `cache_tokens` captures its graphs once, not once per cache size. `compile_draft`:
    the static decoder's drafter block forward compiled first (decode/static.py); hf ignores it."""
    if choice not in DECODERS:
        raise ConfigError(f"decoder {choice!r}: choose one of {', '.join(DECODERS)}")
    if choice != "hf":
        capacity = _static_capacity(drafter, max(max_length, cache_tokens))
        refusal = static_refusal(target, drafter, capacity)
        if refusal is None:
            return StaticDecoder(static_state(target, drafter, capacity, compile_draft), drafter.config.block_size if drafter else 1)
        if choice == "static":
            raise _static_refused(refusal)
    return HFDecoder(target, drafter)


def describe_decoder(target: Target, drafter: DFlashDrafter | None, max_length: int, choice: str,
                     compile_draft: bool = False) -> str:
    """One line for a run's header: which decoder a prompt of `max_length` tokens gets, and why."""
    if choice == "hf":
        return f"decoder: hf (Hugging Face, eager; asked for){rollback_note(target, drafter)}"
    capacity = _static_capacity(drafter, max_length)
    refusal = static_refusal(target, drafter, capacity)
    if refusal is not None and choice == "static":  # asked for: refused, never described as hf
        raise _static_refused(refusal)
    if refusal is not None:
        return f"decoder: hf (Hugging Face, eager), the static one cannot: {refusal}{rollback_note(target, drafter)}"
    graphs = "CUDA graphs" if target.device.type == "cuda" else "no CUDA graphs on CPU"
    compiled = ", the drafter's block forward compiled first" if compile_draft and drafter is not None else ""
    return f"decoder: static ({capacity}-position caches, {graphs}{compiled})"


@torch.no_grad()
def generate(
    target: Target,
    drafter: DFlashDrafter | None,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    decoder: str = "auto",
    cache_tokens: int = 0,
    compile_draft: bool = False,
) -> Generation:
    """Decode one prompt: speculatively with `drafter`, or target-only with `drafter=None`.

    The loop is the reference's (module docstring). `generator` seeds sampling at T > 0; it
    must live on the target's device. The drafter is used as it is (call `.eval()` first).
    `decoder` picks how the forwards run (`make_decoder`, also for `cache_tokens` and
    `compile_draft`); the loop is the same for all.
    """
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number ≥ 0, got {temperature}")
    device = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(1, -1).to(device)
    prompt_length = prompt.shape[1]
    if prompt_length == 0:
        raise ValueError("empty prompt: the target needs at least one token to start from")
    if max_new_tokens <= 0:
        return Generation(prompt_length, [], [], 0.0, 0.0, False)
    stops = {int(t) for t in (stop_token_ids or ())}
    max_length = prompt_length + max_new_tokens
    if drafter is not None:
        drafter = unwrap_drafter(drafter)
    block_size = drafter.config.block_size if drafter is not None else 1
    runner = make_decoder(target, drafter, max_length, decoder, cache_tokens, compile_draft)

    started = _clock(device)
    logits, features = runner.prefill(prompt)
    bonus = _choose(logits, temperature, generator).view(1)
    tokens = [int(bonus)]
    prefill_done = _clock(device)

    acceptance: list[int] = []
    start = prompt_length  # position of the last emitted token, which the target has not seen yet
    stopped = tokens[-1] in stops
    while start + 1 < max_length and not stopped:
        length = min(block_size, max_length - start)
        if temperature == 0:
            # [accepted, the target's own token after each block position] in one host transfer;
            # the accepted drafts equal the target's choices, so the new tokens are choice[:accepted + 1].
            host, step_features = runner.greedy(features, start, bonus, length)
            new = host[1 : host[0] + 2]
        else:
            if length > 1 and drafter.candidate_selector is not None:
                drafts, draft_probs = selector_drafts(runner, drafter, features, start, bonus, length, temperature, generator)
                block = torch.cat([bonus, drafts])[None]
            elif length > 1:
                draft_logits = runner.draft(features, start, bonus, length)
                draft_probs = torch.softmax(draft_logits / temperature, dim=-1)
                drafts = _sample(draft_probs, generator)
                block = torch.cat([bonus, drafts])[None]
            else:
                block = bonus[None]
            logits, step_features = runner.verify(block, start, features=length > 1)
            target_probs = torch.softmax(logits / temperature, dim=-1)
            if length > 1:
                accepted, next_token = rejection_sample(drafts, target_probs, draft_probs, generator)
                new = drafts[:accepted].tolist() + [next_token]
            else:
                new = [int(_sample(target_probs[0], generator))]

        new = new[: max_length - start - 1]  # never past max_new_tokens
        for i, token in enumerate(new):
            if token in stops:
                new, stopped = new[: i + 1], True
                break
        produced = len(new)
        tokens.extend(new)
        start += produced
        runner.keep(start)  # the target has now seen every kept token but the last
        if drafter is not None:
            acceptance.append(produced)
            # Only the kept (verified) positions start..start+produced-1 become drafter context.
            features = step_features[:, :produced]
        # A fill kernel, not a copy from host memory: the copy would wait for the GPU each step.
        bonus = torch.full((1,), tokens[-1], dtype=torch.long, device=device)
    finished = _clock(device)
    return Generation(prompt_length, tokens, acceptance, prefill_done - started, finished - prefill_done, stopped, runner.kind)


def generate_target_only(
    target: Target,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Generation:
    """Plain greedy / sampled decoding through the same KV-cache loop (baseline and oracle)."""
    return generate(target, None, prompt_ids, max_new_tokens, stop_token_ids, temperature=temperature, generator=generator)

