"""One walk of the target's decoder layers: features for training, the static-cache forward for
decoding and regeneration.

`LayerWalk` runs the model's embedding and rotary embedding, then decoder layers 0..k in order,
keeping the states of the layer ids asked for (layer id k = the output of decoder layer k, as
Hugging Face's `hidden_states[k + 1]`; the last layer's is after the final norm, as Hugging Face's
last hidden state is). It registers no hook, raises no early-exit exception and reads no host
value, so it can be captured in a CUDA graph. What a layer does is the caller's:

- `FeatureForward` (training features, `Target.features` without hooks): each layer is the
  model's own module called whole, with no mask (causal attention over right-padded rows, as
  `Target.features` runs it), and the walk stops after the deepest layer id. Any layer the module
  runs by itself works: a hybrid's Gated DeltaNet layers, an MoE block.
- `target.static_cache.StaticTarget` (decoding, regeneration): every layer, its attention over
  preallocated key/value caches (the Llama/Qwen block), a hybrid's linear-attention layers over
  per-row states (target/linear_attention.py).

Whether the walk reproduces the model's own forward is one behaviour probe, `target/probe.py`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .model import Target, check_target_layer_ids

# What a walk does in decoder layer `index`: (index, hidden states in, the rotary embedding) -> out.
LayerStep = Callable[[int, torch.Tensor, object], torch.Tensor]


class LayerWalk:
    """The embedding, decoder layers 0..`through`, and the final norm after the last layer."""

    def __init__(self, target: Target, final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.body: nn.Module = target.model.model
        self.layers = target.layers
        self.last = len(self.layers) - 1
        self.final_norm = final_norm if final_norm is not None else self.body.norm

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, step: LayerStep, through: int,
                 layer_ids: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the final-normed hidden states [b, q, hidden] when `through` is the last layer, else
        None; the states of `layer_ids` concatenated [b, q, n·hidden], or None when none asked)."""
        x = self.body.embed_tokens(ids)
        rotary = self.body.rotary_emb(x, positions)
        wanted = set(layer_ids)
        states: dict[int, torch.Tensor] = {}
        for index in range(through + 1):
            x = step(index, x, rotary)
            if index in wanted:
                states[index] = x
        hidden = self.final_norm(x) if through == self.last else None
        if self.last in states:  # Hugging Face's last hidden state is the normed one
            states[self.last] = hidden
        return hidden, (torch.cat([states[k] for k in layer_ids], dim=-1) if layer_ids else None)


class FeatureForward:
    """`Target.features(ids, layer_ids)` by `LayerWalk`, each layer the model's own module.

    `positions` are kept as a buffer per sequence length, so a captured call allocates nothing
    from the host and reads no host value."""

    def __init__(self, target: Target, layer_ids: list[int]):
        check_target_layer_ids(layer_ids, target.spec.num_hidden_layers)
        self.target = target
        self.walk = LayerWalk(target)
        self.layer_ids = list(layer_ids)
        self.deepest = max(layer_ids)
        self._positions: dict[int, torch.Tensor] = {}

    def positions(self, length: int) -> torch.Tensor:
        if length not in self._positions:
            self._positions[length] = torch.arange(length, device=self.target.device)[None]
        return self._positions[length]

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = self.positions(input_ids.shape[1])
        layers = self.walk.layers

        def whole_layer(index: int, x: torch.Tensor, rotary: object) -> torch.Tensor:
            out = layers[index](x, attention_mask=None, position_ids=positions, position_embeddings=rotary, use_cache=False)
            return out[0] if isinstance(out, tuple) else out

        return self.walk(input_ids, positions, whole_layer, self.deepest, self.layer_ids)[1]
