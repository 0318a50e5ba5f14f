"""Whether the layer walk (target/walk.py) reproduces the model's own forward: one behaviour probe
per model, one verdict for each use of the walk.

The probe runs on a float32 2-layer replica of the model's class and config (`float32_replica`),
random weights, on the CPU: which modules run and in what order is decided by the class and
config, not by a kernel, and bf16 forwards differ in their last bits between any two shapes, so
only float32 tells a rounding difference from a missing scale, softcap or rope variant. On the
CPU no CUDA random numbers are drawn (another thread may be capturing a CUDA graph meanwhile).

- `feature_forward_unsupported(target, length)`: `FeatureForward` must give `Target.features`
  (stopping early, and the last layer's final norm). A model whose layers need a mask built by
  the model's forward (eager attention, a sliding window shorter than the rows) keeps
  `Target.features`.
- `static_unsupported(target, capacity)`: `StaticTarget` must give the Hugging Face forward's
  logits and hidden states, prefilled in two chunks through its cache, and the batched
  generator's path (prompts started in swapped cache rows, then a step at each row's own
  position); for a hybrid also a verify step whose block is then kept in part (the
  linear-attention states advanced by exactly the kept tokens). Linear-attention layers laid out
  in a way `target.linear_attention` does not know, a block other than Llama/Qwen's (Gemma's
  rotary signature and scaled embeddings, a custom forward), or a sliding window shorter than the
  cache decode through Hugging Face instead.

Both verdicts come from one probe run, cached per model and forgotten with it (`ProbeVerdicts`).
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import torch
from torch import nn

from .linear_attention import (
    attention_layers,
    linear_attention_module,
    linear_attention_modules,
    linear_layer_unsupported,
)
from .model import Target, hidden_state_index
from .static_cache import StaticTarget, cache_capacity
from .walk import FeatureForward, rotary_sections

Verdict = TypeVar("Verdict")


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


class ProbeVerdicts(Generic[Verdict]):
    """A behaviour probe's verdict computed once per model and forgotten with it; safe to ask
    from several threads."""

    def __init__(self, probe: Callable[[Target], Verdict]):
        self.probe = probe
        self._verdicts: "weakref.WeakKeyDictionary[nn.Module, Verdict]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, target: Target) -> Verdict:
        with self._lock:
            if target.model not in self._verdicts:
                self._verdicts[target.model] = self.probe(target)
            return self._verdicts[target.model]


@dataclass(frozen=True)
class WalkVerdict:
    """Why each use of the walk cannot stand in for the model's own forward (None: it can)."""

    features: str | None  # FeatureForward for Target.features
    static: str | None  # StaticTarget for the Hugging Face forward


def feature_forward_unsupported(target: Target, length: int) -> str | None:
    """Why `FeatureForward` cannot stand in for `Target.features` on rows of `length` tokens, or
    None when it can."""
    window = sliding_window(target.model.config)
    if window is not None and length > window:
        return f"its {window}-token sliding window is shorter than the {length}-token rows"
    return _VERDICTS(target).features


def static_unsupported(target: Target, capacity: int) -> str | None:
    """Why `StaticTarget` cannot decode `target` with a cache of `capacity` positions, or None
    when it can."""
    window = sliding_window(target.model.config)
    smallest = cache_capacity(1)
    if window is not None and window < smallest:
        # No length fits: said against the smallest cache, so every command (doctor at its
        # typical length, eval at its prompts') names the same size.
        return f"its {window}-token sliding window is shorter than the smallest static cache ({smallest} positions)"
    if window is not None and capacity > window:
        return f"its {window}-token sliding window is shorter than the {capacity}-position cache"
    return _VERDICTS(target).static


def _probe(target: Target) -> WalkVerdict:
    """Structure first (the submodules each use calls), then behaviour on one replica."""
    features, static = _features_structure(target), _static_structure(target)
    if features is not None and static is not None:
        return WalkVerdict(features, static)
    try:
        replica = Target(float32_replica(target.model, torch.device("cpu")))
    except Exception as error:  # noqa: BLE001 - a config that cannot be shrunk: the model's own forward
        why = f"a 2-layer replica of {type(target.model).__name__} could not be built ({type(error).__name__}: {error})"
        return WalkVerdict(features or why, static or why)
    return WalkVerdict(features or _features_differ(replica), static or _static_differ(replica))


def _features_structure(target: Target) -> str | None:
    body = getattr(target.model, "model", None)
    missing = [name for name in ("embed_tokens", "rotary_emb", "norm") if getattr(body, name, None) is None]
    if missing:
        return f"{type(target.model).__name__} lacks model.{', model.'.join(missing)}"
    return _rotary_structure(body.rotary_emb)


def _rotary_structure(rotary: nn.Module) -> str | None:
    sections = rotary_sections(rotary)
    return sections if isinstance(sections, str) else None


def _static_structure(target: Target) -> str | None:
    body = getattr(target.model, "model", None)
    kinds = getattr(target.model.config, "layer_types", None) or [""] * len(target.layers)
    linear = linear_attention_modules(target.layers)
    stateful = sorted({str(kind) for layer, kind in zip(target.layers, kinds)
                       if getattr(layer, "self_attn", None) is None and linear_attention_module(layer) is None})
    if stateful:  # state the static forward does not know how to hold (an SSM, ...)
        return f"its {', '.join(stateful)} layers keep a state the static caches do not hold"
    for module in linear[:1]:  # one class and config for all of them
        refusal = linear_layer_unsupported(module)
        if refusal is not None:
            return refusal
    attention = attention_layers(target.layers)
    if not attention:
        return "it has no attention layer"
    attn = getattr(attention[0], "self_attn", None)
    needed = [(body, "embed_tokens"), (body, "rotary_emb"), (body, "norm"), (target.model, "lm_head")]
    needed += [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")]
    needed += [(attention[0], n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")]
    missing = [name for owner, name in needed if getattr(owner, name, None) is None]
    if missing:
        return f"{type(target.model).__name__} lacks {', '.join(missing)}"
    return _rotary_structure(body.rotary_emb)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max()) / (float(expected.abs().max()) + 1e-6)


def _features_differ(replica: Target) -> str | None:
    ids = (torch.arange(2 * 12) * 7919 % 512).view(2, 12)
    for layer_ids in ([0], [1, 0]):  # stopping early, and the last layer's final norm
        expected = replica.features(ids, layer_ids)
        try:
            got = FeatureForward(replica, layer_ids)(ids)
        except Exception as error:  # noqa: BLE001 - modules with other signatures
            return f"its decoder layers do not run without the model's forward ({type(error).__name__}: {error})"
        error = _relative_error(got, expected)
        if got.shape != expected.shape or not error <= 1e-5:
            return f"its features differ from Target.features' (relative error {error:.1e} in float32)"
    return None


def _static_differ(replica: Target) -> str | None:
    layers = len(replica.layers)
    ids = (torch.arange(12) * 7919 % 512)[None]
    other = (torch.arange(8) * 104729 % 512)[None]
    hybrid = bool(linear_attention_modules(replica.layers))
    with torch.no_grad():
        reference = replica.model(ids, output_hidden_states=True, use_cache=False)
        other_reference = replica.model(other, use_cache=False).logits[0]
        try:
            ours = StaticTarget(replica, 16, list(range(layers)), pending_tokens=4 if hybrid else 0)
            first = ours.single(ids[:, :7], torch.tensor(0))
            second = ours.single(ids[:, 7:], torch.tensor(7))
            if hybrid:
                # The prompt again from zero states, a verify step of 4 tokens of which 2 are
                # kept, then the rest from there: the states must hold exactly the kept tokens.
                ours.single(ids[:, :7], torch.tensor(0), features=False, fresh=True)
                verified = ours.single(ids[:, 7:11], torch.tensor(7), features=False, pending=True)[0]
                ours.commit(torch.tensor([2]), 4)
                after = ours.single(ids[:, 9:], torch.tensor(9), features=False)[0]
            # The batched generator's path: two prompts of other lengths started in swapped cache
            # rows (right-padded), then one step each at its own position.
            batched = StaticTarget(replica, 16, batch=2)
            padded = torch.cat([ids[:, :10], torch.cat([other[:, :6], other[:, :4]], dim=1)])
            started = batched.prefill_rows(padded, torch.tensor([10, 6]), torch.tensor([1, 0]))
            stepped = batched.forward(torch.stack([other[0, 6:7], ids[0, 10:11]]), torch.tensor([6, 10]),
                                      features=False)[0][:, 0]
        except Exception as error:  # noqa: BLE001 - a module with another signature: not our block
            return f"its modules do not run as a Llama/Qwen block ({type(error).__name__}: {error})"
    logits = torch.cat([first[0], second[0]])
    states = torch.cat([first[1], second[1]], dim=1)
    expected_states = torch.cat([reference.hidden_states[hidden_state_index(k)] for k in range(layers)], dim=-1)
    rows = torch.stack([started[0], started[1], stepped[0], stepped[1]])
    expected_rows = torch.stack([reference.logits[0, 9], other_reference[5], other_reference[6], reference.logits[0, 10]])
    checks = [("logits", logits, reference.logits[0]), ("hidden states", states, expected_states),
              ("batched logits", rows, expected_rows)]
    if hybrid:
        checks.append(("logits after a partly kept verify step", torch.cat([verified, after]),
                       torch.cat([reference.logits[0, 7:11], reference.logits[0, 9:]])))
    for name, got, expected in checks:
        error = _relative_error(got, expected)
        if not error <= 1e-4:
            return f"its {name} differ from the Hugging Face forward's (relative error {error:.1e} in float32)"
    return None


_VERDICTS: ProbeVerdicts[WalkVerdict] = ProbeVerdicts(_probe)
