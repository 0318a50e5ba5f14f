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

The rotary embedding is called with the positions in the shape it takes (`rotary_sections`,
found once per module by calling a CPU copy of it): [b, q], or, for a multimodal rotary
(Qwen3.5's mRoPE) that wants one row of positions per section, the same [b, q] positions in each
section, as the model's own forward gives text. Whether the walk reproduces the model's own
forward is one behaviour probe, `target/probe.py`.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Callable

import torch
from torch import nn

from .model import Target, check_target_layer_ids

# What a walk does in decoder layer `index`: (index, hidden states in, the rotary embedding) -> out.
LayerStep = Callable[[int, torch.Tensor, object], torch.Tensor]


_SECTIONS: "weakref.WeakKeyDictionary[nn.Module, int | str]" = weakref.WeakKeyDictionary()
_SECTIONS_LOCK = threading.Lock()


def rotary_sections(rotary: nn.Module) -> int | str:
    """How `rotary(x, positions)` takes text positions: 0 = as [b, q]; n = as [n, b, q], the same
    positions in each of its n sections (`mrope_section`); a str = why neither shape runs (the
    walk's probe refuses the model with it). Found once per module, on a float32 CPU copy, so no
    device work is done and nothing of the model's is touched."""
    with _SECTIONS_LOCK:
        if rotary not in _SECTIONS:
            _SECTIONS[rotary] = _find_rotary_sections(rotary)
        return _SECTIONS[rotary]


def _find_rotary_sections(rotary: nn.Module) -> int | str:
    name = type(rotary).__name__
    try:
        replica = copy.deepcopy(rotary).to("cpu").float()
    except Exception as error:  # noqa: BLE001 - a module that cannot be copied cannot be probed
        return f"its {name} could not be copied to find the positions it takes ({type(error).__name__}: {error})"
    positions = torch.arange(6).view(2, 3)  # two rows of three positions
    x = torch.zeros(2, 3, 1)
    sections = getattr(rotary, "mrope_section", None)
    shapes = [0] + ([len(sections)] if isinstance(sections, (list, tuple)) and sections else [])
    for count in shapes:
        given = positions if count == 0 else positions.expand(count, -1, -1)
        try:
            with torch.no_grad():
                cos, sin = replica(x, given)
        except Exception:  # noqa: BLE001, S112 - not this shape: the next one is tried
            continue
        if cos.dim() == 3 and cos.shape[:2] == (2, 3) and sin.shape == cos.shape:
            return count
    return f"its {name} does not run as rotary(x, positions) with text positions [b, q] or [sections, b, q]"


class LayerWalk:
    """The embedding, decoder layers 0..`through`, and the final norm after the last layer."""

    def __init__(self, target: Target, final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.body: nn.Module = target.model.model
        self.layers = target.layers
        self.last = len(self.layers) - 1
        self.final_norm = final_norm if final_norm is not None else self.body.norm
        sections = rotary_sections(self.body.rotary_emb)
        if isinstance(sections, str):
            raise ValueError(f"{type(target.model).__name__}: {sections}")  # noqa: TRY004 - a model, not a type, is wrong
        self.sections = sections

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, step: LayerStep, through: int,
                 layer_ids: list[int], dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the final-normed hidden states [b, q, hidden] when `through` is the last layer, else
        None; the states of `layer_ids` concatenated [b, q, n·hidden], or None when none asked).
        With `dtype`, the states are cast to it after the embedding and the final norm runs as a
        copy in it (a reference in another precision: `step` casts its layers)."""
        x = self.body.embed_tokens(ids)
        if dtype is not None:
            x = x.to(dtype)
        rotary = self.body.rotary_emb(x, positions if not self.sections else positions.expand(self.sections, *positions.shape))
        wanted = set(layer_ids)
        states: dict[int, torch.Tensor] = {}
        for index in range(through + 1):
            x = step(index, x, rotary)
            if index in wanted:
                states[index] = x
        hidden = self._final_norm(dtype)(x) if through == self.last else None
        if self.last in states:  # Hugging Face's last hidden state is the normed one
            states[self.last] = hidden
        return hidden, (torch.cat([states[k] for k in layer_ids], dim=-1) if layer_ids else None)

    def _final_norm(self, dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor]:
        if dtype is None or not isinstance(self.final_norm, nn.Module):
            return self.final_norm
        return copy.deepcopy(self.final_norm).to(dtype)


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
            return _run_layer(layers[index], x, positions, rotary)

        return self.walk(input_ids, positions, whole_layer, self.deepest, self.layer_ids)[1]

    @torch.no_grad()
    def float32(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The same features in float32 arithmetic from the same weights: each layer copied to
        float32 in its turn, so the extra memory is one layer's, not a float32 target's. What a
        compiled forward's rounding is judged against (train/feature_graphs.py)."""
        positions = self.positions(input_ids.shape[1])
        layers = self.walk.layers

        def float32_layer(index: int, x: torch.Tensor, rotary: object) -> torch.Tensor:
            return _run_layer(copy.deepcopy(layers[index]).float(), x, positions, rotary)

        return self.walk(input_ids, positions, float32_layer, self.deepest, self.layer_ids, dtype=torch.float32)[1]


def _run_layer(layer: nn.Module, x: torch.Tensor, positions: torch.Tensor, rotary: object) -> torch.Tensor:
    """A decoder layer called whole, as the model's own forward calls it for features: no mask."""
    out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary, use_cache=False)
    return out[0] if isinstance(out, tuple) else out
