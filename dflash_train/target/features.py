"""The target's feature forward as plain module calls, so it can be captured in a CUDA graph.

`Target.features` stops the Hugging Face forward after the deepest needed layer by raising from a
forward hook: an exception cannot be recorded in a graph, and the hooks are per-module state.
`FeatureForward` runs the same modules itself (embedding, rotary embedding, decoder layers
0..deepest, the final norm for the last layer) and stops there, with no mask (causal attention
over right-padded rows, as `Target.features` runs it), so its result is `Target.features`'.

Whether a model runs correctly this way is decided on behaviour (`feature_forward_unsupported`):
on a float32 2-layer replica of the model's class and config, random weights, on the CPU,
`FeatureForward` must reproduce `Target.features`. A model whose layers need a mask built by the model's forward
(eager attention, a sliding window shorter than the rows) does not, and keeps `Target.features`.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Callable

import torch
from torch import nn

from .model import Target, check_target_layer_ids


def sliding_window(config) -> int | None:
    """The model's sliding attention window in tokens, or None when it attends to everything."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def float32_replica(model: nn.Module, device: torch.device) -> nn.Module:
    """The model's own class and config with 2 layers (one of each kind where it has more kinds),
    a few experts (MoE) and a 512-token vocabulary, random float32
    weights drawn without touching the caller's random streams: a probe of behaviour that only
    the class and config decide (bf16 forwards differ in their last bits between any two shapes)."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers, config.vocab_size, config.pad_token_id = 2, 512, None
    if getattr(config, "layer_types", None):
        # One layer of each kind the model has (a hybrid's linear and full attention, sliding and
        # full windows), in the model's order: two layers of one kind would leave the other untested.
        kinds = list(dict.fromkeys(config.layer_types))
        config.layer_types = (kinds + list(config.layer_types))[: max(2, len(kinds))]
        config.num_hidden_layers = len(config.layer_types)
    per_token = getattr(config, "num_experts_per_tok", None)
    for name in ("num_experts", "num_local_experts"):
        # Routing is per token whatever the expert count: a few experts keep a replica of an MoE
        # model (Qwen3-Next: 512 experts a layer, ~13 GB in float32 for two layers) small.
        count = getattr(config, name, None)
        if isinstance(count, int) and isinstance(per_token, int) and count > max(per_token, 4):
            setattr(config, name, max(per_token, 4))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        return type(model)(config).float().eval()


class FeatureForward:
    """`Target.features(ids, layer_ids)` computed by calling the model's modules in order.

    `positions` are kept as a buffer per sequence length, so a captured call allocates nothing
    from the host and reads no host value."""

    def __init__(self, target: Target, layer_ids: list[int]):
        check_target_layer_ids(layer_ids, target.spec.num_hidden_layers)
        self.target = target
        self.body = target.model.model
        self.layer_ids = list(layer_ids)
        self.deepest = max(layer_ids)
        self.last = target.spec.num_hidden_layers - 1
        self._positions: dict[int, torch.Tensor] = {}

    def positions(self, length: int) -> torch.Tensor:
        if length not in self._positions:
            self._positions[length] = torch.arange(length, device=self.target.device)[None]
        return self._positions[length]

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = self.positions(input_ids.shape[1])
        x = self.body.embed_tokens(input_ids)
        rotary = self.body.rotary_emb(x, positions)
        wanted = set(self.layer_ids)
        captured: dict[int, torch.Tensor] = {}
        for index in range(self.deepest + 1):
            out = self.target.layers[index](x, attention_mask=None, position_ids=positions, position_embeddings=rotary,
                                            use_cache=False)
            x = out[0] if isinstance(out, tuple) else out
            if index in wanted:
                captured[index] = x
        # Layer id L-1 is Hugging Face's last hidden state, which is after the final norm.
        states = [self.body.norm(captured[k]) if k == self.last else captured[k] for k in self.layer_ids]
        return torch.cat(states, dim=-1)


class ProbeVerdicts:
    """A behaviour probe's verdict (why a model cannot be used, or None) computed once per
    model and forgotten with it; safe to ask from several threads."""

    def __init__(self, probe: Callable[[Target], str | None]):
        self.probe = probe
        self._verdicts: "weakref.WeakKeyDictionary[nn.Module, str | None]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, target: Target) -> str | None:
        with self._lock:
            if target.model not in self._verdicts:
                self._verdicts[target.model] = self.probe(target)
            return self._verdicts[target.model]


def feature_forward_unsupported(target: Target, length: int) -> str | None:
    """Why `FeatureForward` cannot stand in for `Target.features` on rows of `length` tokens, or
    None when it can (one behaviour probe per model, cached)."""
    window = sliding_window(target.model.config)
    if window is not None and length > window:
        return f"its {window}-token sliding window is shorter than the {length}-token rows"
    return _VERDICTS(target)


def _probe(target: Target) -> str | None:
    body = getattr(target.model, "model", None)
    missing = [name for name in ("embed_tokens", "rotary_emb", "norm") if getattr(body, name, None) is None]
    if missing:
        return f"{type(target.model).__name__} lacks model.{', model.'.join(missing)}"
    # On the CPU: the question is which modules run and in what order, not a kernel; and no CUDA
    # random numbers are drawn (another thread may be capturing a CUDA graph meanwhile).
    cpu = torch.device("cpu")
    try:
        replica = Target(float32_replica(target.model, cpu))
    except Exception as error:  # noqa: BLE001 - a config that cannot be shrunk: keep Target.features
        return f"a 2-layer replica of {type(target.model).__name__} could not be built ({type(error).__name__}: {error})"
    ids = (torch.arange(2 * 12) * 7919 % 512).view(2, 12)
    for layer_ids in ([0], [1, 0]):  # stopping early, and the last layer's final norm
        expected = replica.features(ids, layer_ids)
        try:
            got = FeatureForward(replica, layer_ids)(ids)
        except Exception as error:  # noqa: BLE001 - modules with other signatures
            return f"its decoder layers do not run without the model's forward ({type(error).__name__}: {error})"
        error = float((got - expected).abs().max()) / (float(expected.abs().max()) + 1e-6)
        if got.shape != expected.shape or not error <= 1e-5:
            return f"its features differ from Target.features' (relative error {error:.1e} in float32)"
    return None


_VERDICTS = ProbeVerdicts(_probe)
