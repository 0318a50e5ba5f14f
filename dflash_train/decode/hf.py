"""The decode loop's operations through the Hugging Face model, eagerly: any architecture
transformers runs (sliding windows, Gemma, ...), any drafter subclass, the drafter on any device.

Target hidden states come from Hugging Face `output_hidden_states` (`target.hidden_state_index`),
as in the reference; no hook is ever registered on the target.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import UserError
from ..core.drafter import DFlashDrafter, DrafterCache, embed_block_tokens
from ..target.model import Target, cache_argument, has_recurrent_layers, hidden_state_index
from ..target.probe import ProbeVerdicts, float32_replica
from .recurrent import StateSnapshot
from .static import greedy_by_parts


def _selectable_hidden_states() -> bool:
    """Recent transformers accept `output_hidden_states=[indices]` and keep only those states."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


_SELECTABLE = _selectable_hidden_states()


def _records_recurrent_states() -> bool:
    """Whether transformers' linear-attention cache layers can record the recurrent state after
    each token of a forward (`activate_past_recording(recurrent_states_to_keep=n)`, 5.25) for
    `crop` to put back the one a kept count needs."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:
        return False
    recording = getattr(LinearAttentionCacheLayerMixin, "activate_past_recording", None)
    return recording is not None and "recurrent_states_to_keep" in inspect.signature(recording).parameters


RECORDS_RECURRENT_STATES = _records_recurrent_states()


def new_target_cache(model: nn.Module, rollback_tokens: int = 1) -> Any:
    """A DynamicCache that can be cropped: sliding-window layers (Gemma 3) keep their past
    until `crop` tells them how much to drop, as the reference does. Where transformers records
    linear-attention states, they are recorded for the last `rollback_tokens` tokens of each
    forward (a verify step's block), so cropping a verify step back is exact there too (5.25
    fails in the forward when recording is on with no count)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if RECORDS_RECURRENT_STATES:
        cache.activate_past_recording(recurrent_states_to_keep=rollback_tokens)
    else:
        cache.activate_past_recording()
    return cache


def _crop_takes_tokens_to_remove() -> bool:
    from transformers.cache_utils import DynamicLayer

    return "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters


_CROP_REMOVES = _crop_takes_tokens_to_remove()


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of the target's KV cache."""
    remove = cache.get_seq_length() - length
    if _CROP_REMOVES:
        # transformers ≥ 5.1x: crop(-n) removes n tokens; crop(0) lets sliding-window layers drop
        # the states they no longer need (as the reference does after every step).
        cache.crop(-remove)
    elif remove > 0:
        # Older releases: crop(max_length) keeps an absolute length, and crop(0) would empty it.
        cache.crop(length)


def _target_forward(
    target: Target, ids: torch.Tensor, start: int, cache: Any, layer_ids: Sequence[int] | None, last_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [n, vocab] (float32) for ids [1, n] at positions start.., appended to `cache`,
    and the concatenated hidden states of `layer_ids` [1, n, len·hidden] when asked."""
    model = target.model
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    kwargs: dict[str, Any] = {cache_argument(model): cache, "use_cache": True, "position_ids": positions}
    if last_only:
        kwargs["logits_to_keep"] = 1  # the prompt's logits are never needed, only the last row
    if layer_ids is not None:
        kwargs["output_hidden_states"] = [hidden_state_index(k) for k in layer_ids] if _SELECTABLE else True
    out = model(ids, **kwargs)
    features = None
    if layer_ids is not None:
        features = torch.cat([out.hidden_states[hidden_state_index(k)] for k in layer_ids], dim=-1)
    return out.logits[0].float(), features


def advance(target: Target, ids: torch.Tensor, start: int, cache: Any) -> None:
    """Run ids [1, n] at positions start.. through the target's decoder into `cache`, no head."""
    body = target.model.model
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    body(input_ids=ids, position_ids=positions, use_cache=True, **{cache_argument(body): cache})


def _draft_logits(
    drafter: DFlashDrafter,
    target: Target,
    cache: DrafterCache,
    new_features: torch.Tensor,
    start: int,
    bonus: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """Drafter logits [length − 1, vocab] (float32, on the target's device) for the block
    [bonus, MASK × (length − 1)] anchored at `start`; `new_features` are the context positions
    start − n .. start − 1 not yet in the drafter cache."""
    return _head_logits(drafter, target, _draft_hidden(drafter, target, cache, new_features, start, bonus, length))


def _draft_hidden(
    drafter: DFlashDrafter,
    target: Target,
    cache: DrafterCache,
    new_features: torch.Tensor,
    start: int,
    bonus: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """The drafter's hidden states [length − 1, hidden] (on its own device) behind `_draft_logits`.

    The drafter may live on another device or in another dtype than the target: features and
    block embeddings travel to it, and only its B − 1 output rows travel back, so the LM head
    (vocab × hidden, the largest tensor) never moves."""
    weight = drafter.fc.weight
    device, dtype = weight.device, weight.dtype
    count = new_features.shape[1]
    block_ids = torch.full((1, length), drafter.config.mask_token_id, dtype=torch.long, device=bonus.device)
    block_ids[0, 0] = bonus
    embeds = embed_block_tokens(block_ids, target.embed_weight, drafter.config.input_embedding_scale)
    hidden = drafter.draft(
        cache,
        new_features.to(device, dtype),
        torch.arange(start - count, start, device=device)[None],
        embeds.to(device, dtype),
        torch.arange(start, start + length, device=device)[None],
    )
    return hidden[0, 1:]


def _head_logits(drafter: DFlashDrafter, target: Target, hidden: torch.Tensor) -> torch.Tensor:
    head = target.head_weight
    logits = F.linear(hidden.to(head.device, head.dtype), head).float()
    softcap = drafter.config.final_logit_softcapping
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits



class _Verified:
    """What a verify step changed that cropping cannot undo: the block it ran, where, and the
    linear-attention states from before it."""

    def __init__(self, block: torch.Tensor, start: int, snapshot: StateSnapshot):
        self.block, self.start, self.snapshot = block, start, snapshot

    @property
    def end(self) -> int:
        return self.start + self.block.shape[1]


class HFDecoder:
    """The decode loop's operations (prefill, draft, verify, greedy, keep) through the Hugging
    Face model with a DynamicCache, run eagerly: any architecture transformers runs (sliding windows, Gemma, ...), any drafter
    subclass (its `draft` is called), the drafter on any device.

    Hybrid targets (linear-attention layers): where transformers records the recurrent state
    after each verified token (5.25 and later), cropping puts back the one the kept tokens reach;
    before that, a verify step's states are snapshotted first, and a step that keeps fewer tokens
    than it verified is rolled back and its kept tokens re-run (decode/recurrent.py says why
    cropping alone was lossy there). `rollback_unsupported` checks whichever runs."""

    kind = "hf"

    def __init__(self, target: Target, drafter: DFlashDrafter | None):
        self.target, self.drafter = target, drafter
        self.layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else None
        self.cache = new_target_cache(target.model, drafter.config.block_size if drafter is not None else 1)
        self.drafter_cache = DrafterCache(len(drafter.layers)) if drafter is not None else None
        self.recurrent = has_recurrent_layers(target.model.config)
        self.snapshots = self.recurrent and not RECORDS_RECURRENT_STATES
        if self.recurrent and drafter is not None:
            refusal = rollback_unsupported(target)
            if refusal is not None:
                raise UserError(f"speculative decoding on {type(target.model).__name__} cannot be lossless here: {refusal}")
        self.verified: _Verified | None = None

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, features = _target_forward(self.target, prompt, 0, self.cache, self.layer_ids, last_only=True)
        return logits[-1], features

    def draft(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> torch.Tensor:
        return _draft_logits(self.drafter, self.target, self.drafter_cache, features, start, bonus, length)

    def draft_hidden(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` with the drafter's hidden states [length − 1, hidden] (a DFlash2 selector's input)."""
        hidden = _draft_hidden(self.drafter, self.target, self.drafter_cache, features, start, bonus, length)
        return hidden, _head_logits(self.drafter, self.target, hidden)

    def greedy_drafts(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> torch.Tensor:
        selector = self.drafter.candidate_selector
        if selector is None:
            return self.draft(features, start, bonus, length).argmax(-1)
        hidden, logits = self.draft_hidden(features, start, bonus, length)
        anchor = bonus.to(hidden.device)
        return selector.select(hidden[None], logits[None].to(hidden.device), anchor, 0.0)[0][0].to(bonus.device)

    def verify(self, block: torch.Tensor, start: int, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.snapshots and block.shape[1] > 1:
            self.verified = _Verified(block, start, StateSnapshot(self.cache))
        return _target_forward(self.target, block, start, self.cache, self.layer_ids if features else None)

    def greedy(
        self, features: torch.Tensor | None, start: int, bonus: torch.Tensor, length: int
    ) -> tuple[list[int], torch.Tensor | None]:
        return greedy_by_parts(self, features, start, bonus, length)

    def keep(self, length: int) -> None:
        verified, self.verified = self.verified, None
        if verified is not None and length < verified.end:
            # Back to the states before the block, then forward by exactly the kept tokens.
            crop_cache(self.cache, verified.start)
            verified.snapshot.restore()
            if length > verified.start:
                advance(self.target, verified.block[:, : length - verified.start], verified.start, self.cache)
        crop_cache(self.cache, length)

    def prepare(self) -> None:
        """Nothing to capture: every forward runs eagerly."""



def rollback_note(target: Target, drafter: DFlashDrafter | None) -> str:
    """What a header line adds for a hybrid target decoded speculatively through this decoder."""
    if drafter is None or not has_recurrent_layers(target.model.config):
        return ""
    if RECORDS_RECURRENT_STATES:
        return "; linear-attention states recorded per verified token by transformers, a rejection cropped back to the kept tokens"
    return "; linear-attention states snapshotted per verify step, a rejection rolled back and its kept tokens re-run"


def rollback_unsupported(target: Target) -> str | None:
    """Why the HF decoder cannot roll a verify step of this hybrid target back exactly, or None
    (one behaviour probe per model, cached): on a float32 replica of the model's class and config,
    a 6-token prompt, a 4-token block verified, then rolled back to its first token, must leave
    the cache where a forward of the 7 kept tokens leaves it (next-token logits to 3e-6, relative)."""
    return _ROLLBACK_VERDICTS(target)


def _rollback_probe(target: Target) -> str | None:
    try:
        replica = Target(float32_replica(target.model, torch.device("cpu")))
    except Exception as error:  # noqa: BLE001 - a config that cannot be shrunk
        return f"a 2-layer replica of {type(target.model).__name__} could not be built ({type(error).__name__}: {error})"
    ids = (torch.arange(12) * 7919 % 512)[None]
    with torch.no_grad():
        expected = replica.model(ids[:, :8], use_cache=False).logits[0, -1]
        decoder = HFDecoder.__new__(HFDecoder)  # no drafter: only the target's cache is exercised
        decoder.target, decoder.layer_ids, decoder.recurrent = replica, None, True
        decoder.snapshots = not RECORDS_RECURRENT_STATES
        decoder.cache, decoder.verified = new_target_cache(replica.model, 4), None
        try:
            decoder.prefill(ids[:, :6])
            decoder.verify(ids[:, 6:10], 6, features=False)
            if decoder.snapshots and (not decoder.verified or not decoder.verified.snapshot):
                return "its cache holds no linear-attention states this decoder can snapshot (conv_states/recurrent_states)"
            decoder.keep(7)
            got = _target_forward(replica, ids[:, 7:8], 7, decoder.cache, None)[0][-1]
        except Exception as error:  # noqa: BLE001 - a cache laid out otherwise
            return f"its cache could not be rolled back ({type(error).__name__}: {error})"
    error = float((got - expected).abs().max()) / (float(expected.abs().max()) + 1e-6)
    # Measured on tiny replicas: an exact rollback ~3e-7 (chunked vs one-token recurrence), state
    # left advanced by the rejected drafts 1e-5 to 2e-3.
    if not error <= 3e-6:
        return f"a rolled-back verify step differs from the target's own forward (relative error {error:.1e} in float32)"
    return None


_ROLLBACK_VERDICTS = ProbeVerdicts(_rollback_probe)
