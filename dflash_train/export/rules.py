"""What SGLang and vLLM need from a DFlash drafter folder, as one table of named rules.

Read in the released sources of the versions in ENGINES (the PyPI wheels of vLLM 0.34.0 and
SGLang 0.5.23, the reference `dflash` 0.1.0, llama.cpp b11434's converter). Every rule's `source`
cites where: "ENGINE VERSION path symbol", one per reader, `;`-separated
(tests/integration/test_export_rules.py checks that every rule has one). Re-read them when a version moves.
Both engines parse config.json through transformers' AutoConfig and fill anything missing with
*their* defaults, and both skip or mis-map weights silently in places, so a folder that loads is
not yet a folder that drafts. A rule passes only where every loader reads the same value we
wrote. `check_folder` reads config.json and the safetensors headers (no tensor data, no torch),
so it checks any folder: ours, a z-lab release, another trainer's output.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # the reference's class; vLLM and SGLang register the same name


def architecture_name(arch: str) -> str:
    """The class an export of a drafter of `arch` ('dflash' or 'dflash2') names in config.json."""
    return DFLASH2_ARCHITECTURE if arch == "dflash2" else ARCHITECTURE

# The releases the rules were read in (a rule's citations name one of these each).
ENGINES = {"vLLM": "0.34.0", "SGLang": "0.5.23", "dflash": "0.1.0", "llama.cpp": "b11434"}
LAYER_TYPES = ("full_attention", "sliding_attention")

# Per drafter layer, the names both loaders map (SGLang stacks q/k/v into qkv_proj and gate/up
# into gate_up_proj; vLLM's WeightsMapper does the same).
LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
BIAS_WEIGHTS = tuple(f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
TOP_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# DFlash2 (DFlash2DraftModel): the convolutions of every layer and the candidate selector; the
# codebooks are bare [vocab, rank] tensors (see the dflash2_* rules below).
DFLASH2_LAYER_WEIGHTS = tuple(f"{conv}.{name}" for conv in ("attention_conv", "mlp_conv")
                              for name in ("base_kernel", "kernel_projection.weight"))
DFLASH2_TOP_WEIGHTS = ("candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                       "candidate_selector.successor_codebook")

_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "max_position_embeddings")


def expected_weight_names(num_layers: int, attention_bias: bool = False, dflash2: bool = False) -> set[str]:
    per_layer = LAYER_WEIGHTS + (BIAS_WEIGHTS if attention_bias else ()) + (DFLASH2_LAYER_WEIGHTS if dflash2 else ())
    top = TOP_WEIGHTS + (DFLASH2_TOP_WEIGHTS if dflash2 else ())
    return set(top) | {f"layers.{i}.{key}" for i in range(num_layers) for key in per_layer}


@dataclass(frozen=True)
class TargetShape:
    """What the rules compare against when the target is known (its rope when its config.json
    was read: theta and scaling, which the drafter must share)."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rope: dict[str, Any] | None = None


def target_shape_from_config(raw: dict[str, Any]) -> TargetShape:
    text = raw.get("text_config") or raw  # multimodal wrappers keep the LM's dims there
    rope = _rope_settings(text)
    return TargetShape(int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"]), rope)


def _rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A config's rope in one dict: rope_parameters (transformers 5), else rope_scaling (4.x),
    with the theta from the top level where the dict has none."""
    params = config.get("rope_parameters")
    rope = dict(params) if isinstance(params, dict) else {}
    scaling = config.get("rope_scaling")
    if not rope and isinstance(scaling, dict):
        rope = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
    if "rope_theta" not in rope and config.get("rope_theta") is not None:
        rope["rope_theta"] = config["rope_theta"]
    return rope


@dataclass
class DraftFolder:
    path: Path
    config: dict[str, Any]
    weights: dict[str, tuple[int, ...]] | None  # name -> shape; None when no safetensors file
    target: TargetShape | None = None

    @property
    def dflash(self) -> dict[str, Any]:
        value = self.config.get("dflash_config")
        return value if isinstance(value, dict) else {}

    def resolved(self, key: str) -> Any:
        """dflash_config first, then the top level: the order SGLang's parse_dflash_draft_config,
        vLLM's DFlashQwen3Model and the reference all read."""
        return self.dflash.get(key, self.config.get(key))


class _Skip(Exception):
    """The rule cannot be judged because something another rule reports is missing."""


@dataclass(frozen=True)
class Rule:
    name: str
    what: str  # one line: what a passing folder has
    source: str  # citations: "ENGINE VERSION path symbol; ..." (ENGINES), where each reader reads it
    check: Callable[[DraftFolder], str | None]  # None = passes, else why not


@dataclass(frozen=True)
class Verdict:
    rule: Rule
    status: str  # "ok", "FAIL" or "skip"
    detail: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _need(folder: DraftFolder, *keys: str) -> list[Any]:
    values = [folder.config.get(k) for k in keys]
    if any(not _is_int(v) or v < 1 for v in values):
        raise _Skip("needs config_keys")
    return values


def _layer_ids(folder: DraftFolder) -> list[int]:
    ids = folder.dflash.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        raise _Skip("needs valid target_layer_ids")
    return ids


def _layer_types(folder: DraftFolder) -> list[str]:
    (layers,) = _need(folder, "num_hidden_layers")
    types = folder.config.get("layer_types")
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise _Skip("needs valid layer_types")
    return types


# ----------------------------------------------------------------------------- the rules


def _architecture(folder: DraftFolder) -> str | None:
    # vLLM registry: "DFlashDraftModel" -> qwen3_dflash.DFlashQwen3ForCausalLM; SGLang:
    # models/dflash.py EntryClass = DFlashDraftModel. Both build the config with AutoConfig,
    # and DFlashQwen3Model (like the reference's config_class) expects a Qwen3Config.
    architectures = folder.config.get("architectures")
    if architectures not in ([ARCHITECTURE], [DFLASH2_ARCHITECTURE]):
        return (f"architectures is {architectures!r}; both engines dispatch on [{ARCHITECTURE!r}] "
                f"(DFlash2: [{DFLASH2_ARCHITECTURE!r}])")
    if folder.config.get("model_type") != "qwen3":
        return (f"model_type is {folder.config.get('model_type')!r}; the engines read the drafter config as "
                "transformers' Qwen3Config (model_type 'qwen3')")
    return None


def _config_keys(folder: DraftFolder) -> str | None:
    # Every dim the loaders read with getattr(config, ..., default): a missing one becomes
    # Qwen3Config's default (hidden 4096, head_dim 128, ...) instead of an error.
    missing = [k for k in (*_DIMS, "rms_norm_eps") if k not in folder.config]
    if missing:
        return f"config.json lacks {', '.join(missing)} (an engine would use its own default)"
    wrong = [k for k in _DIMS if not _is_int(folder.config[k]) or folder.config[k] < 1]
    if wrong:
        return f"not positive integers: {', '.join(f'{k}={folder.config[k]!r}' for k in wrong)}"
    eps = folder.config["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        return f"rms_norm_eps={eps!r} is not a small positive number"
    heads, kv_heads = folder.config["num_attention_heads"], folder.config["num_key_value_heads"]
    if heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    return None


def _dflash_config(folder: DraftFolder) -> str | None:
    # Every reader takes dflash_config first: vLLM (get_eagle3_aux_layers_from_config,
    # get_parallel_drafting_token_id, DFlashQwen3Model), SGLang's parse_dflash_draft_config and the
    # reference, then the top level. llama.cpp's converter reads the mask id only from
    # dflash_config (DFlashModel.set_vocab): without it the GGUF has no mask token.
    if not isinstance(folder.config.get("dflash_config"), dict):
        return "no dflash_config object"
    problems = [f"dflash_config lacks {k}" for k in ("target_layer_ids", "mask_token_id") if k not in folder.dflash]
    problems += [f"neither dflash_config nor the top level has {k}" for k in ("block_size", "num_target_layers")
                 if folder.resolved(k) is None]
    problems += [f"{k} is {folder.dflash[k]!r} in dflash_config but {folder.config[k]!r} at the top level"
                 for k in ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers")
                 if k in folder.dflash and k in folder.config and folder.dflash[k] != folder.config[k]]
    if folder.dflash.get("use_aux_hidden_state", folder.config.get("use_aux_hidden_state", True)) is False:
        problems.append("use_aux_hidden_state is false: vLLM would build no fc and ignore the target's states")
    return "; ".join(problems) or None


def _target_layer_ids(folder: DraftFolder) -> str | None:
    # SGLang DFlashDraftConfig.resolve_target_layer_ids: a non-empty int list, every id in
    # [0, num_target_layers); without num_target_layers DFlashDraftModel bounds them by
    # max(ids) + 1, which every id passes.
    ids = folder.dflash.get("target_layer_ids")
    if ids is None:
        raise _Skip("needs dflash_config")
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        return f"target_layer_ids {ids!r} is not a non-empty list of integers"
    bound = folder.resolved("num_target_layers")
    if bound is not None and (not _is_int(bound) or bound < 1):
        return f"num_target_layers {bound!r} is not a positive integer"
    outside = [i for i in ids if i < 0 or (bound is not None and i >= bound)]
    if outside:
        return f"target layer ids {outside} are outside [0, {bound if bound is not None else 'inf'}) (num_target_layers)"
    # vLLM prefers eagle_aux_hidden_state_layer_ids (already shifted by one) when present.
    aux = folder.config.get("eagle_aux_hidden_state_layer_ids")
    if aux and list(aux) != [i + 1 for i in ids]:
        return f"eagle_aux_hidden_state_layer_ids {aux} is not target_layer_ids + 1 = {[i + 1 for i in ids]}"
    return None


def _mask_token_id(folder: DraftFolder) -> str | None:
    # SGLang parse_dflash_draft_config: an int >= 0 (else it looks up the "<|MASK|>" token);
    # the id indexes the target's embedding table in every engine (vLLM embed_input_ids).
    value = folder.resolved("mask_token_id")
    if value is None:
        raise _Skip("needs dflash_config")
    (vocab,) = _need(folder, "vocab_size")
    if not _is_int(value) or not 0 <= value < vocab:
        return f"mask_token_id {value!r} is not a row of the {vocab}-row embedding table"
    return None


def _block_size(folder: DraftFolder) -> str | None:
    # SGLang _handle_dflash sets --speculative-num-draft-tokens from it (16 when absent, with a
    # warning); llama.cpp's converter writes it as dflash.block_size (16 when absent). The block
    # the drafter was trained for; 1 would draft nothing.
    value = folder.resolved("block_size")
    if value is None:
        raise _Skip("needs dflash_config")
    if not _is_int(value) or value < 2:
        return f"block_size {value!r} is not an integer >= 2"
    return None


def _layer_types_rule(folder: DraftFolder) -> str | None:
    # SGLang _get_dflash_layer_attention_params: one entry per draft layer, full_attention or
    # sliding_attention (the latter needs config.sliding_window); vLLM _resolve_layer_attention
    # takes the window from dflash_config.swa_window_size, else sliding_window.
    (layers,) = _need(folder, "num_hidden_layers")
    types = folder.config.get("layer_types")
    if not isinstance(types, list):
        return f"layer_types is {types!r}; write one entry per drafter layer (full_attention = non-causal)"
    if len(types) != layers:
        return f"layer_types has {len(types)} entries for {layers} drafter layers"
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        return f"layer types {unknown} are neither of {', '.join(LAYER_TYPES)}"
    if "sliding_attention" in types:
        window = folder.config.get("sliding_window")
        if not _is_int(window) or window < 1:
            return "sliding_attention layers need a top-level sliding_window (SGLang reads only that)"
        swa = folder.dflash.get("swa_window_size")
        if swa is not None and swa != window:
            return f"dflash_config.swa_window_size {swa} (vLLM) differs from sliding_window {window} (SGLang)"
    return None


def _causality(folder: DraftFolder) -> str | None:
    # SGLang _get_dflash_attention_type: is_causal, else full_attention -> ENCODER_ONLY
    # (non-causal), sliding_attention -> DECODER (causal); dflash_config.causal is not read.
    # vLLM _dflash_layer_causal: is_causal, then dflash_config.causal, then
    # layer_types[i] == sliding_attention; dflash_config.use_swa forces sliding everywhere
    # (_resolve_layer_attention). The reference: is_causal, then the layer type. llama.cpp's
    # converter writes is_causal, else dflash_config.causal. Every layer must agree in all.
    types = _layer_types(folder)
    is_causal = folder.config.get("is_causal")
    override = folder.dflash.get("causal")
    disagree = []
    for i, layer_type in enumerate(types):
        by_type = layer_type == "sliding_attention"
        sglang = bool(is_causal) if is_causal is not None else by_type
        vllm = bool(is_causal) if is_causal is not None else bool(override) if override is not None else by_type
        reference = bool(is_causal) if is_causal is not None else by_type
        if not sglang == vllm == reference:
            disagree.append(f"layer {i} ({layer_type}): SGLang {'causal' if sglang else 'non-causal'}, "
                            f"vLLM {'causal' if vllm else 'non-causal'}, reference {'causal' if reference else 'non-causal'}")
    if folder.dflash.get("use_swa") and "sliding_attention" not in types:
        disagree.append("dflash_config.use_swa makes vLLM slide every layer; SGLang attends fully")
    return "; ".join(disagree[:3]) or None


def _hidden_act(folder: DraftFolder) -> str | None:
    # SGLang DFlashMLP takes silu (and swigluoai); vLLM's Qwen2MLP raises for anything but silu.
    act = folder.config.get("hidden_act")
    if act != "silu":
        return f"hidden_act is {act!r}; 'silu' is the one activation both engines implement (write it explicitly)"
    return None


def _rope(folder: DraftFolder) -> str | None:
    # SGLang get_rope_config: rope_parameters["rope_theta"], else rope_theta, else 10000. vLLM
    # DFlashQwen3DecoderLayer: set_default_rope_theta(config, 1e6) puts 1e6 into
    # rope_parameters when no theta was given. Scaling: rope_parameters (transformers 5) or
    # rope_scaling (4.x, null = none). Style: SGLang reads rope_is_neox_style, then
    # is_neox_style; vLLM only is_neox_style; both default to neox, and a mismatch with training
    # fails silently (acceptance collapses).
    params = folder.config.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    thetas = {k: v for k, v in (("rope_parameters.rope_theta", params.get("rope_theta")),
                                ("rope_theta", folder.config.get("rope_theta"))) if v is not None}
    if not thetas:
        return "no rope_theta (vLLM would use 1e6, SGLang 1e4): write rope_theta and rope_parameters"
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in thetas.values()):
        return f"rope theta is not a positive number: {thetas}"
    if len(set(thetas.values())) > 1:
        return f"rope theta disagrees between places: {thetas}"
    if "rope_type" not in params and "rope_scaling" not in folder.config:
        return "rope scaling is not written (rope_parameters.rope_type or rope_scaling: null)"
    scaling = folder.config.get("rope_scaling")
    scaled = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else "default"
    if "rope_type" in params and "rope_scaling" in folder.config and params["rope_type"] != scaled:
        return f"rope_parameters.rope_type is {params['rope_type']!r} but rope_scaling says {scaled!r}"
    sglang_neox = folder.config.get("rope_is_neox_style", folder.config.get("is_neox_style", True))
    vllm_neox = folder.config.get("is_neox_style", True)
    if bool(sglang_neox) != bool(vllm_neox):
        return f"rope_is_neox_style {sglang_neox} (SGLang) but is_neox_style {vllm_neox} (vLLM)"
    return None


def _rope_places(folder: DraftFolder) -> list[tuple[str, dict[str, Any]]]:
    places = [("", folder.config)]
    places += [(f"{name}.", folder.config[name]) for name in ("rope_parameters", "rope_scaling")
               if isinstance(folder.config.get(name), dict)]
    return places


def _partial_rotary(folder: DraftFolder) -> str | None:
    # vLLM and SGLang get_rope: rotary_dim = head_dim × partial_rotary_factor, read from the
    # config or its rope dict. Hybrid targets (Qwen3.5, Qwen3-Next) rotate a quarter of each head;
    # a drafter config copying that trains and serves at τ ≈ 1 (speculators#613, #797). The DFlash
    # drafter rotates the whole head.
    found = {f"{where}partial_rotary_factor": place["partial_rotary_factor"] for where, place in _rope_places(folder)
             if place.get("partial_rotary_factor") not in (None, 1, 1.0)}
    if found:
        return f"{found}: the drafter rotates the whole head; a copied target factor makes engines rotate part of it"
    return None


def _mrope(folder: DraftFolder) -> str | None:
    # vLLM get_rope builds MRotaryEmbedding when the rope dict has mrope_section (SGLang likewise),
    # rotating by 3-axis multimodal positions: never what a text drafter was trained with.
    found = [f"{where}{key}" for where, place in _rope_places(folder) if where
             for key in ("mrope_section", "mrope_interleaved") if key in place]
    found += [f"{where}rope_type {place['rope_type']!r}" for where, place in _rope_places(folder) if where
              and "mrope" in str(place.get("rope_type", "")).lower()]
    if found:
        return f"{', '.join(found)}: multimodal rope settings of the target; the drafter uses plain RoPE"
    return None


def _target_rope(folder: DraftFolder) -> str | None:
    # The drafter's positions are the target's: its theta and its scaling (YaRN for gpt-oss,
    # whose context is extended 32x) must be the target's, or every rotation beyond the
    # original context is off.
    if folder.target is None or not folder.target.rope:
        raise _Skip("no target config given (export --check DIR --target TARGET_DIR compares its rope)")
    ours, theirs = _rope_settings(folder.config), folder.target.rope
    if ours.get("rope_theta") is None:
        raise _Skip("needs rope")
    problems = []
    if theirs.get("rope_theta") is not None and ours.get("rope_theta") != theirs.get("rope_theta"):
        problems.append(f"rope_theta {ours.get('rope_theta')} but the target's is {theirs['rope_theta']}")
    kind = theirs.get("rope_type", "default")
    if kind not in ("default", "mrope") and "mrope" not in str(kind):
        if ours.get("rope_type", "default") != kind:
            problems.append(f"rope_type {ours.get('rope_type', 'default')!r} but the target's is {kind!r}")
        else:
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                if key in theirs and ours.get(key) != theirs[key]:
                    problems.append(f"{kind} {key} {ours.get(key)} but the target's is {theirs[key]}")
    return "; ".join(problems) or None


def _weight_names(folder: DraftFolder) -> str | None:
    # SGLang DFlashDraftModel.load_weights skips any name it cannot resolve ("Ignore unexpected
    # weights"); vLLM's DFlashQwen3ForCausalLM.load_weights
    # prefixes "model." to every name (a stored "model." prefix would not map), loads its own
    # embedding / LM head when names contain embed_tokens / lm_head, and asserts on mask_hidden.
    if folder.weights is None:
        return f"no *.safetensors weights in {folder.path}"
    names = set(folder.weights)
    for pattern, why in (("mask_hidden", "vLLM refuses it"), ("embed_tokens", "the target's embedding is used"),
                         ("lm_head", "the target's LM head is used")):
        found = sorted(n for n in names if pattern in n)
        if found:
            return f"{pattern} weights {found[:3]}: {why}; the drafter must not carry them"
    prefixed = sorted(n for n in names if n.startswith("model."))
    if prefixed:
        return f"names start with 'model.' ({prefixed[:2]}): vLLM adds that prefix itself"
    (layers,) = _need(folder, "num_hidden_layers")
    expected = expected_weight_names(layers, bool(folder.config.get("attention_bias", False)), _is_dflash2(folder))
    missing, unknown = sorted(expected - names), sorted(names - expected)
    if missing or unknown:
        return (f"weights do not match the DFlash layout the loaders map: missing {missing[:4]}, "
                f"unknown {unknown[:4]} (SGLang skips unknown names silently)")
    return None


def _fc_shape(folder: DraftFolder) -> str | None:
    # SGLang: fc = ReplicatedLinear(len(target_layer_ids) * hidden_size, hidden_size), checked at
    # load ("fc.weight shape mismatch"). vLLM _get_dflash_fc_input_size: (target_hidden_size or
    # hidden_size) * number of aux layers ("incompatible draft/target pair" at run time).
    if folder.weights is None or "fc.weight" not in folder.weights:
        raise _Skip("needs weight_names")
    ids = _layer_ids(folder)
    (hidden,) = _need(folder, "hidden_size")
    target_hidden = folder.config.get("target_hidden_size") or hidden
    if target_hidden != hidden:
        return (f"target_hidden_size {target_hidden} differs from hidden_size {hidden}: vLLM would project "
                f"{len(ids)} x {target_hidden}, SGLang {len(ids)} x {hidden}")
    want = (hidden, len(ids) * hidden)
    if tuple(folder.weights["fc.weight"]) != want:
        return f"fc.weight is {list(folder.weights['fc.weight'])}, not [hidden {hidden}, {len(ids)} ids x {hidden}]"
    return None


def _projection_shapes(folder: DraftFolder) -> str | None:
    # The shapes SGLang's QKVParallelLinear / MergedColumnParallelLinear / RMSNorm and vLLM's
    # equivalents allocate from the config; a weight of another shape fails to load or, for a
    # norm, broadcasts wrongly.
    if folder.weights is None:
        raise _Skip("needs weight_names")
    hidden, layers, heads, kv_heads, head_dim, inter = _need(
        folder, "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size")
    per_layer = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "self_attn.q_proj.bias": (heads * head_dim,), "self_attn.k_proj.bias": (kv_heads * head_dim,),
        "self_attn.v_proj.bias": (kv_heads * head_dim,), "self_attn.o_proj.bias": (hidden,),
    }
    want = {"hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    want.update({f"layers.{i}.{k}": shape for i in range(layers) for k, shape in per_layer.items()})
    wrong = [f"{name} {list(folder.weights[name])} (expected {list(shape)})"
             for name, shape in want.items() if name in folder.weights and tuple(folder.weights[name]) != shape]
    return f"{len(wrong)} weights of the wrong shape: {'; '.join(wrong[:3])}" if wrong else None


# --- DFlash2 (architectures ["DFlash2DraftModel"]); a DFlash folder passes these as "skip".
# Read in: the reference, PyPI dflash 0.1.0 dflash/model.py (GroupedDynamicCausalConv,
# CandidateSelector, DFlash2DraftModel); vLLM vllm/model_executor/models/qwen3_dflash2.py
# (DFlashGroupedConv, CandidateSelector, DFlash2Qwen3Model); SGLang
# python/sglang/srt/models/dflash.py (CandidateSelector, DFlash2DraftModel).

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _is_dflash2(folder: DraftFolder) -> bool:
    return folder.config.get("architectures") == [DFLASH2_ARCHITECTURE]


def _dflash2_config(folder: DraftFolder) -> str | None:
    # vLLM DFlash2Qwen3DecoderLayer / DFlash2Qwen3Model read int(config.dflash_config[key]) for the
    # four keys, with no top-level fallback (a KeyError at load); SGLang DFlash2DraftModel raises
    # without dflash_config.selector_rank; the reference reads dflash_config, then the top level.
    # vLLM DFlashGroupedConv raises unless conv_group_size divides hidden_size; the reference's
    # view(..., groups, group_size) fails the same way; top-k over the vocabulary needs k <= vocab.
    if not _is_dflash2(folder):
        raise _Skip("not a DFlash2 folder")
    missing = [k for k in DFLASH2_KEYS if k not in folder.dflash]
    if missing:
        return f"dflash_config lacks {', '.join(missing)} (vLLM reads them only there)"
    wrong = [f"{k}={folder.dflash[k]!r}" for k in DFLASH2_KEYS if not _is_int(folder.dflash[k]) or folder.dflash[k] < 1]
    if wrong:
        return f"not positive integers: {', '.join(wrong)}"
    hidden, vocab = _need(folder, "hidden_size", "vocab_size")
    if hidden % folder.dflash["conv_group_size"]:
        return f"conv_group_size {folder.dflash['conv_group_size']} does not divide hidden_size {hidden}"
    if folder.dflash["selector_top_k"] > vocab:
        return f"selector_top_k {folder.dflash['selector_top_k']} is more than the vocabulary ({vocab})"
    # vLLM 0.34's hf_config_override serves a DFlash2DraftModel config with a truthy top-level
    # no_rope_layers as DFlash2RicursiveDraftModel (those layers without RoPE); SGLang and the
    # reference rotate every layer, so the engines would decode different drafters.
    if folder.config.get("no_rope_layers"):
        return (f"no_rope_layers {folder.config['no_rope_layers']!r}: vLLM serves it as another drafter "
                "(DFlash2RicursiveDraftModel, no RoPE in those layers), SGLang and the reference do not")
    return None


def _dflash2_shapes(folder: DraftFolder) -> str | None:
    # The shapes every loader allocates: base_kernel [2, taps, hidden], kernel_projection
    # [2 * taps * hidden / group_size, hidden] (vLLM ReplicatedLinear, the reference nn.Linear),
    # hidden_projection [rank, hidden], and the codebooks as bare [vocab, rank] parameters (vLLM
    # and SGLang nn.Parameter; the reference maps the bare name onto its nn.Embedding's .weight).
    if not _is_dflash2(folder):
        raise _Skip("not a DFlash2 folder")
    if folder.weights is None or _dflash2_config(folder) is not None:
        raise _Skip("needs weight_names and dflash2_config")
    hidden, layers, vocab = _need(folder, "hidden_size", "num_hidden_layers", "vocab_size")
    taps, group, rank = (folder.dflash[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank"))
    want = {"candidate_selector.hidden_projection.weight": (rank, hidden),
            "candidate_selector.predecessor_codebook": (vocab, rank),
            "candidate_selector.successor_codebook": (vocab, rank)}
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            want[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
            want[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (hidden // group), hidden)
    wrong = [f"{name} {list(folder.weights[name])} (expected {list(shape)})"
             for name, shape in want.items() if name in folder.weights and tuple(folder.weights[name]) != shape]
    return f"{len(wrong)} DFlash2 weights of the wrong shape: {'; '.join(wrong[:3])}" if wrong else None


def _target(folder: DraftFolder) -> str | None:
    # The drafter reads the target's states (fc input), embeds with the target's table (mask id,
    # vocab) and decodes with its head (vLLM maps a different draft vocabulary through d2t).
    if folder.target is None:
        raise _Skip("no target given (export --check DIR --target TARGET_DIR compares it)")
    target = folder.target
    hidden, vocab = _need(folder, "hidden_size", "vocab_size")
    problems = []
    if hidden != target.hidden_size:
        problems.append(f"hidden_size {hidden} but the target's is {target.hidden_size}")
    if vocab != target.vocab_size:
        problems.append(f"vocab_size {vocab} but the target's is {target.vocab_size}")
    layers = folder.resolved("num_target_layers")
    if layers is not None and layers != target.num_hidden_layers:
        problems.append(f"num_target_layers {layers} but the target has {target.num_hidden_layers} layers")
    return "; ".join(problems) or None


# Exponent bits of the float formats safetensors stores: all set = inf or NaN.
_EXPONENT_BITS = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00),
                  "BF16": ("<u2", 0x7F80)}


def _finite(folder: DraftFolder) -> str | None:
    # The engines load NaN or inf weights without a word and accept nothing they draft: a
    # trainer's diverged run exported anyway. Read from the files' bytes (no torch for --check).
    import numpy

    if folder.weights is None:
        raise _Skip("no weights")
    bad = []
    for file in sorted(folder.path.glob("*.safetensors")):
        try:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            data = numpy.memmap(file, dtype=numpy.uint8, mode="r", offset=8 + length) if file.stat().st_size > 8 + length else None
        except (OSError, ValueError, struct.error):
            raise _Skip(f"{file.name} cannot be read") from None
        for name, entry in header.items():
            if name == "__metadata__" or entry.get("dtype") not in _EXPONENT_BITS or data is None:
                continue
            view, mask = _EXPONENT_BITS[entry["dtype"]]
            start, end = entry["data_offsets"]
            bits = numpy.frombuffer(data[start:end], dtype=view)
            if numpy.any((bits & numpy.array(mask, dtype=view)) == mask):
                bad.append(name)
    return f"NaN or inf in {len(bad)} weights ({', '.join(sorted(bad)[:3])})" if bad else None


RULES: tuple[Rule, ...] = (
    Rule("architecture", f"architectures [{ARCHITECTURE!r}], model_type 'qwen3'",
         "vLLM 0.34.0 vllm/model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS; "
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py EntryClass", _architecture),
    Rule("config_keys", "every drafter dim written explicitly (no engine default)",
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3DecoderLayer.__init__; "
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashDraftModel.__init__", _config_keys),
    Rule("dflash_config", "target_layer_ids and mask_token_id in dflash_config; block_size, num_target_layers resolvable; no disagreement",
         "SGLang 0.5.23 python/sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config; "
         "vLLM 0.34.0 vllm/v1/worker/gpu/spec_decode/utils.py get_parallel_drafting_token_id; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3Model.__init__; "
         "dflash 0.1.0 dflash/model.py DFlashDraftModel.__init__; llama.cpp b11434 conversion/qwen.py DFlashModel.set_vocab", _dflash_config),
    Rule("target_layer_ids", "ids in [0, num_target_layers)",
         "SGLang 0.5.23 python/sglang/srt/speculative/dflash_utils.py DFlashDraftConfig.resolve_target_layer_ids; "
         "vLLM 0.34.0 vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config", _target_layer_ids),
    Rule("mask_token_id", "an embedding row",
         "SGLang 0.5.23 python/sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3Model.embed_input_ids", _mask_token_id),
    Rule("block_size", "an integer >= 2",
         "SGLang 0.5.23 python/sglang/srt/arg_groups/speculative_hook.py _handle_dflash; llama.cpp b11434 conversion/qwen.py DFlashModel.set_gguf_parameters",
         _block_size),
    Rule("layer_types", "one allowed type per drafter layer",
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py _get_dflash_layer_attention_params; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py _resolve_layer_attention", _layer_types_rule),
    Rule("causality", "every layer equally causal in SGLang, vLLM and the reference",
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py _get_dflash_attention_type; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py _dflash_layer_causal; dflash 0.1.0 dflash/model.py Qwen3DFlashAttention.__init__", _causality),
    Rule("hidden_act", "silu", "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashMLP.__init__; vLLM 0.34.0 vllm/model_executor/models/qwen2.py Qwen2MLP.__init__",
         _hidden_act),
    Rule("rope", "rope theta, scaling and style written explicitly and consistently",
         "SGLang 0.5.23 python/sglang/srt/utils/hf_transformers/common.py get_rope_config; SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashAttention.__init__; "
         "vLLM 0.34.0 vllm/transformers_utils/config.py set_default_rope_theta; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3DecoderLayer.__init__", _rope),
    Rule("partial_rotary", "no partial rotary factor: the drafter rotates whole heads",
         "vLLM 0.34.0 vllm/model_executor/layers/rotary_embedding/__init__.py get_rope; "
         "SGLang 0.5.23 python/sglang/srt/layers/rotary_embedding.py get_rope", _partial_rotary),
    Rule("mrope", "no mRoPE sections: the drafter uses plain RoPE",
         "vLLM 0.34.0 vllm/model_executor/layers/rotary_embedding/__init__.py get_rope; "
         "SGLang 0.5.23 python/sglang/srt/layers/rotary_embedding.py get_rope", _mrope),
    Rule("target_rope", "the target's rope theta and scaling (YaRN for gpt-oss)",
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3DecoderLayer.__init__; "
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashAttention.__init__", _target_rope),
    Rule("weight_names", "exactly the names the loaders map",
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashDraftModel.load_weights; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights", _weight_names),
    Rule("fc_shape", "fc.weight [hidden, n_ids x hidden]",
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashDraftModel.load_weights; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py _get_dflash_fc_input_size", _fc_shape),
    Rule("projection_shapes", "every layer weight shaped from the config",
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashAttention._build_qkv_proj; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3Attention.__init__", _projection_shapes),
    Rule("dflash2_config", "conv_kernel_size, conv_group_size (divides hidden_size), selector_rank, selector_top_k in dflash_config; no no_rope_layers",
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash2.py DFlash2Qwen3DecoderLayer.__init__; "
         "vLLM 0.34.0 vllm/config/speculative.py SpeculativeConfig.hf_config_override; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash2.py DFlash2Qwen3Model.__init__; "
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlash2DraftModel.__init__; dflash 0.1.0 dflash/model.py DFlash2DraftModel.__init__", _dflash2_config),
    Rule("dflash2_shapes", "conv kernels, projections and [vocab, rank] codebooks shaped from the config",
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash2.py DFlashGroupedConv.__init__; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash2.py CandidateSelector.__init__; "
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py CandidateSelector.__init__; dflash 0.1.0 dflash/model.py CandidateSelector.__init__", _dflash2_shapes),
    Rule("target", "hidden size, vocabulary and layer count of the target",
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashDraftModel.__init__; "
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py _get_dflash_fc_input_size", _target),
    Rule("finite", "every weight a finite number (no NaN, no inf)",
         "vLLM 0.34.0 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights; "
         "SGLang 0.5.23 python/sglang/srt/models/dflash.py DFlashDraftModel.load_weights", _finite),
)


# ----------------------------------------------------------------------------- reading a folder


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def read_folder(path: str | Path, target: TargetShape | None = None) -> DraftFolder:
    """The config and weight shapes of a drafter folder (FileNotFoundError if it is not there)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}  # reported by architecture/config_keys, not raised: --check judges any folder
    files = sorted(path.glob("*.safetensors"))
    weights = None
    if files:
        weights = {}
        for file in files:
            try:
                weights.update(safetensors_shapes(file))
            except (OSError, ValueError, struct.error):
                weights[f"<unreadable safetensors file {file.name}>"] = ()
    return DraftFolder(path, config if isinstance(config, dict) else {}, weights, target)


def check_folder(path: str | Path, target: TargetShape | None = None) -> list[Verdict]:
    folder = read_folder(path, target)
    verdicts = []
    for rule in RULES:
        try:
            problem = rule.check(folder)
        except _Skip as skip:
            verdicts.append(Verdict(rule, "skip", str(skip)))
            continue
        verdicts.append(Verdict(rule, "FAIL" if problem else "ok", problem or rule.what))
    return verdicts


def failures(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.status == "FAIL"]


def render_verdicts(path: str | Path, verdicts: list[Verdict]) -> str:
    read_in = ", ".join(f"{name} {version}" for name, version in ENGINES.items())
    lines = [f"{path}: the SGLang and vLLM loader rules (read in {read_in})"]
    lines += [f"  {v.status:<4}  {v.rule.name:<18} {v.detail}" for v in verdicts]
    counts = {s: sum(v.status == s for v in verdicts) for s in ("ok", "FAIL", "skip")}
    lines.append(f"{len(verdicts)} rules: {counts['ok']} ok, {counts['FAIL']} failed, {counts['skip']} skipped")
    return "\n".join(lines)
