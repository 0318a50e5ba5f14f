"""The recurrent state of a hybrid target's Hugging Face cache: snapshot, restore, row selection.

Hybrid targets (Qwen3.5, Qwen3-Next) mix full-attention layers with linear-attention (Gated
DeltaNet) layers. An attention layer's cache is a list of keys and values per position, so a
rejected draft is undone by cropping it. A linear-attention layer keeps a causal-convolution
window and a recurrent state that every token folds into: there is nothing per position to drop.
Hugging Face's `Cache.crop` rolls back the convolution window only, so crop-after-reject leaves
the recurrent state advanced by the rejected drafts and the next tokens come from a state the
target never reaches on its own (logits off by ~1e-2: lossy).

The HF decoder therefore snapshots these states before a verify step and, when the step keeps
fewer tokens than it verified, puts them back, crops the attention layers to where the step
started, and runs the kept tokens through the target again (`HFDecoder.keep`). The snapshot is a
copy of each linear-attention layer's states (a few MB per layer; keys and values are not copied).
The static decoder and the batched generator hold these states themselves, per cache row, and
never advance them by a rejected draft (target/linear_attention.py, decode/static.py).

transformers 5.25 added the missing half: with `activate_past_recording(recurrent_states_to_keep=n)`
a linear-attention cache layer keeps the recurrent state after each of a forward's last n tokens,
and `crop` puts back the one the kept tokens reach. Where it exists the HF decoder records a
block's worth and only crops (no snapshot, no re-run); the recorded states cost n copies of a
layer's state per verify step, where a snapshot costs one.

The states are found by what the cache holds (a layer's `conv_states` / `recurrent_states`
tables, as transformers 5.x lays them out); `rollback_unsupported` checks on a float32 replica
that snapshot, restore and re-run reproduce the target's own next-token logits, so a cache laid
out otherwise is refused, never decoded lossily.
"""

from __future__ import annotations

from typing import Any

import torch

STATE_TABLES = ("conv_states", "recurrent_states")


def state_slots(cache: Any) -> list[tuple[dict, Any]]:
    """(table, key) of every linear-attention state tensor the cache holds now."""
    return [slot for layer in getattr(cache, "layers", ()) or () for slot in _layer_slots(layer)]


def _layer_slots(layer: Any) -> list[tuple[dict, Any]]:
    slots = []
    for name in STATE_TABLES:
        table = getattr(layer, name, None)
        if isinstance(table, dict):
            slots += [(table, key) for key, value in table.items() if isinstance(value, torch.Tensor)]
    return slots


class StateSnapshot:
    """Copies of a cache's linear-attention states, to put back after a rejected draft."""

    def __init__(self, cache: Any):
        self.saved = [(table, key, table[key].clone()) for table, key in state_slots(cache)]

    def __bool__(self) -> bool:
        return bool(self.saved)

    def restore(self) -> None:
        # Assigned, not copied in: a convolution window recorded for cropping grows with each
        # forward, so the saved one may have another length than the current one.
        for table, key, value in self.saved:
            table[key] = value
        self.saved = []


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only batch rows `rows` of a cache: its attention layers through Hugging Face's own
    `batch_select_indices`, its linear-attention states here where that left them alone (the
    linear-attention layers of transformers 5.x do not select rows themselves)."""
    for layer in getattr(cache, "layers", ()) or ():
        slots = _layer_slots(layer)
        before = [table[key] for table, key in slots]
        select = getattr(layer, "batch_select_indices", None)
        if select is not None:
            select(rows)
        for (table, key), old in zip(slots, before):
            if table[key] is old:
                table[key] = old.index_select(0, rows.to(old.device))
