"""A GGUF target's weights and config, read straight from the file, for the architectures whose
mapping to Hugging Face names we know exactly (llama, qwen2, qwen3); anything else is refused.

Why not transformers' GGUF loader: a conversion through it parses the whole metadata with gguf-py's
`GGUFReader` three times (the tokenizer's config, the model's config, the weights; ~2.1 s each for
SmolLM2's 49k tokens and merges) and rebuilds gguf-py's tensor-name table once per module of the
model (397 times, ~4 s): most of its ~20 s (2-core CPU, 2026-12-07), where the dequantization is
~1 s. Here the header is read once (`gguf_header`, 0.06 s), names are mapped by a table of a dozen
entries, and gguf-py's own dequantization runs on large pieces in threads (~0.3 s).

What must stay identical to transformers' loader, so that a folder converted here equals one
converted through it (the tests compare them tensor for tensor, bit for bit, on real files):
- the dequantized values: both call gguf-py's `gguf.quants.dequantize` on the same bytes;
- llama's Q and K rows: llama.cpp's converter interleaves the two rotary halves of every head
  (`LlamaModel.permute` in convert_hf_to_gguf.py) so that its own rope can pair neighbouring
  rows; transformers' rope pairs row i with row i + head_dim/2, so the interleaving is undone.
  qwen2 and qwen3 files are written without it;
- the config: the same GGUF keys become the same config attributes, with the same defaults.

Failing closed: a file is read here only if every metadata key of its architecture is one we
map (or one that restates the head size the config implies), no key of an unknown namespace is
present, and its tensors are exactly the parameters of the Hugging Face model that config builds
(names and shapes, a tied head absent). Anything else (rope scaling, an extra rope_freqs tensor,
a llama file named as a Mistral, a block type gguf-py cannot dequantize) raises UnsupportedGGUF,
and the caller converts that file the slow way, through transformers.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..processes import available_cores
from .gguf_header import ARRAY, STRING, GGUFHeader, GGUFTensorInfo

__all__ = ["SUPPORTED_ARCHITECTURES", "DirectPlan", "UnsupportedGGUF", "gguf_config_dict", "plan_direct_read",
           "read_state_dict"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# "<arch>.<key>" -> config attribute, as transformers' GGUF loader (integrations/ggml.py,
# GGUF_CONFIG_MAPPING) names them for these three architectures.
_ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# transformers reads llama's rotary dimension as the head size; for qwen it ignores the key.
_LLAMA_KEYS = {**_ARCH_KEYS, "rope.dimension_count": "head_dim"}
# Keys transformers ignores that llama.cpp writes anyway; harmless only while they agree with the
# head size the config ends up with (else transformers would build a model of another shape).
_HEAD_SIZE_KEYS = {"llama": ("attention.key_length", "attention.value_length"),
                   "qwen2": ("rope.dimension_count", "attention.key_length", "attention.value_length"),
                   "qwen3": ("rope.dimension_count", "attention.key_length", "attention.value_length")}
_TOKENIZER_KEYS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
                   "tokenizer.ggml.unknown_token_id": "unk_token_id",
                   "tokenizer.ggml.padding_token_id": "pad_token_id"}
# Namespaces that describe the file, not the model: names, licence, quantization provenance,
# and the tokenizer (which transformers builds from these keys itself).
_DESCRIPTIVE_PREFIXES = ("general.", "tokenizer.", "quantize.imatrix.")
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ARCH_BLOCK_TENSORS = {
    "llama": {},
    "qwen2": {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
              "attn_v.bias": "self_attn.v_proj.bias"},
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_SCALAR_TYPES = frozenset(range(8)) | {10, 11, 12}  # every GGUF value type but string (8) and array (9)
# Dequantization runs in pieces of ~1 MB of float32 (gguf-py's numpy temporaries stay in cache)
# spread over threads (numpy lets go of the GIL). Each block is unpacked on its own, from its own
# bytes, so where the pieces are cut changes no bit of the result.
_PIECE_ELEMENTS = 1 << 18
_MAX_WORKERS = 8


class UnsupportedGGUF(ValueError):
    """The file is not one this module maps exactly; convert it through transformers instead."""


@dataclass(frozen=True)
class TensorPlan:
    info: GGUFTensorInfo
    hf_name: str
    shape: tuple[int, ...]  # torch order (slowest-varying dimension first)
    unpermute_heads: int | None  # llama's Q/K: the head count whose rotary halves to de-interleave


@dataclass(frozen=True)
class DirectPlan:
    architecture: str
    config: Any  # the transformers config the GGUF loader would build (before dflash-train's tidying)
    tensors: tuple[TensorPlan, ...]


def _scalar(header: GGUFHeader, key: str) -> Any:
    field = header.fields[key]
    if field.type not in _SCALAR_TYPES:
        raise UnsupportedGGUF(f"{key} is {'an array' if field.type == ARRAY else 'a string'}, not a number")
    return field.value


def gguf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The config dict transformers' GGUF loader derives from this header (load_gguf_checkpoint's
    "config"), for the supported architectures; UnsupportedGGUF for any key it cannot vouch for."""
    fields = header.fields
    architecture = fields["general.architecture"].value if "general.architecture" in fields else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUF(f"architecture {architecture!r} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    name = fields["general.name"].value if "general.name" in fields else None
    if architecture == "llama" and isinstance(name, str) and "mistral" in name.lower():
        # transformers turns a llama file named "mistral" into a Mistral model.
        raise UnsupportedGGUF(f"a llama file named {name!r} (transformers may read it as Mistral)")
    arch_keys = _LLAMA_KEYS if architecture == "llama" else _ARCH_KEYS
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, field in fields.items():
        if key == "general.architecture":
            config["model_type"] = architecture
        elif key == "general.name":
            if field.type != STRING:
                raise UnsupportedGGUF("general.name is not a string")
            config["_model_name_or_path"] = field.value
        elif key in _TOKENIZER_KEYS:
            config[_TOKENIZER_KEYS[key]] = _scalar(header, key)
        elif key.startswith(_DESCRIPTIVE_PREFIXES):
            continue
        elif key.startswith(f"{architecture}."):
            short = key[len(architecture) + 1:]
            if short in arch_keys:
                config[arch_keys[short]] = _scalar(header, key)
            elif short not in _HEAD_SIZE_KEYS[architecture]:
                raise UnsupportedGGUF(f"metadata key {key} is not one transformers' mapping is known to match")
        else:
            raise UnsupportedGGUF(f"metadata key {key} is outside the namespaces read here")
    for required in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv"):
        # Without head_count_kv transformers skips llama's Q/K de-interleaving altogether.
        if f"{architecture}.{required}" not in fields:
            raise UnsupportedGGUF(f"{architecture}.{required} is missing")
    if "vocab_size" not in config:
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is None or tokens.type != ARRAY:
            raise UnsupportedGGUF("no vocabulary size (neither a vocab_size key nor tokenizer.ggml.tokens)")
        config["vocab_size"] = len(tokens.value)
    return config


def _config_object(config_dict: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(**config_dict)


def _model_parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor the Hugging Face model of `config` loads, with its shape; a tied head left out.
    Built on the meta device: no memory, no initialization."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _hf_name(architecture: str, gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    layer, rest = match.groups()
    hf_rest = _BLOCK_TENSORS.get(rest) or _ARCH_BLOCK_TENSORS[architecture].get(rest)
    return f"model.layers.{int(layer)}.{hf_rest}" if hf_rest else None


def _check_dequantizable(info: GGUFTensorInfo, row: int) -> None:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    if info.ggml_type not in GGML_QUANT_SIZES:
        raise UnsupportedGGUF(f"tensor {info.name} has ggml type {info.ggml_type}, unknown to gguf-py")
    block_elements, block_bytes = GGML_QUANT_SIZES[info.ggml_type]
    if row % block_elements:
        raise UnsupportedGGUF(f"tensor {info.name}: rows of {row} are not whole blocks of {block_elements}")
    try:  # one block of zeros: says whether gguf-py can unpack this block type at all
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), GGMLQuantizationType(info.ggml_type))
    except NotImplementedError as error:
        raise UnsupportedGGUF(f"tensor {info.name}: {error}") from None


def plan_direct_read(header: GGUFHeader) -> DirectPlan:
    """What to read from the file and where it goes; UnsupportedGGUF unless the file's tensors are
    exactly the parameters (names and shapes) of the model its config describes."""
    config_dict = gguf_config_dict(header)
    architecture = config_dict["model_type"]
    config = _config_object(config_dict)
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    for short in _HEAD_SIZE_KEYS[architecture]:
        key = f"{architecture}.{short}"
        if key in header.fields and _scalar(header, key) != head_dim:
            raise UnsupportedGGUF(f"{key} is {header.fields[key].value}, but transformers builds heads of {head_dim}")
    expected = _model_parameter_shapes(config)
    plans, seen = [], set()
    for info in header.tensors:
        hf_name = _hf_name(architecture, info.name)
        if hf_name is None or hf_name not in expected:
            raise UnsupportedGGUF(f"tensor {info.name} has no place in {type(config).__name__}'s model")
        shape = tuple(reversed(info.shape))
        if shape != expected[hf_name]:
            raise UnsupportedGGUF(f"tensor {info.name} is {shape}, the model's {hf_name} is {expected[hf_name]}")
        _check_dequantizable(info, shape[-1])
        unpermute = None
        if architecture == "llama" and info.name.endswith((".attn_q.weight", ".attn_k.weight")):
            unpermute = heads if ".attn_q." in info.name else config.num_key_value_heads
            if shape[0] % (2 * unpermute):
                raise UnsupportedGGUF(f"tensor {info.name}: {shape[0]} rows do not split into {unpermute} heads")
        plans.append(TensorPlan(info, hf_name, shape, unpermute))
        seen.add(hf_name)
    if missing := sorted(set(expected) - seen):
        raise UnsupportedGGUF(f"the file lacks {len(missing)} of the model's tensors, e.g. {missing[0]}")
    return DirectPlan(architecture, config, tuple(plans))


def _unpermute_rows(weights: Any, heads: int) -> Any:
    """Inverse of llama.cpp's `permute`: within each head the file holds rows in the order
    (0, h, 1, h+1, ...) for h = head_dim/2; put them back as (0, 1, ..., h-1, h, ..., 2h-1)."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def read_state_dict(gguf_path: str | Path, plan: DirectPlan) -> dict[str, Any]:
    """{Hugging Face name: float32 torch tensor} for every tensor of the plan, dequantized."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    # A plain ndarray over the mapping: numpy's memmap subclass makes every slice and temporary a
    # memmap too, which costs more than unpacking small pieces.
    mapped = np.memmap(gguf_path, dtype=np.uint8, mode="r").view(np.ndarray)
    outputs, pieces = [], []
    for tensor in plan.tensors:
        block_elements, block_bytes = GGML_QUANT_SIZES[tensor.info.ggml_type]
        columns = tensor.shape[-1]
        rows = int(np.prod(tensor.shape[:-1], dtype=np.int64))
        row_bytes = columns // block_elements * block_bytes
        if tensor.info.offset + rows * row_bytes > mapped.size:
            raise ValueError(f"tensor {tensor.info.name} runs past the end of the file ({mapped.size} bytes)")
        raw = mapped[tensor.info.offset:tensor.info.offset + rows * row_bytes].reshape(rows, row_bytes)
        out = np.empty((rows, columns), dtype=np.float32)
        outputs.append(out)
        step = max(1, _PIECE_ELEMENTS // columns)
        kind = GGMLQuantizationType(tensor.info.ggml_type)
        pieces += [(raw[start:start + step], out[start:start + step], kind) for start in range(0, rows, step)]

    def unpack(piece: tuple[Any, Any, Any]) -> None:
        raw, out, ggml_type = piece
        # One row of many blocks: gguf-py unpacks it in one vectorized call instead of 16 rows at a time.
        out[...] = dequantize(raw.reshape(1, -1), ggml_type).reshape(out.shape)

    with ThreadPoolExecutor(min(available_cores(), _MAX_WORKERS)) as pool:
        for _ in pool.map(unpack, pieces):
            pass
    state_dict = {}
    for tensor, out in zip(plan.tensors, outputs):
        weights = out.reshape(tensor.shape)
        if tensor.unpermute_heads is not None:
            weights = np.ascontiguousarray(_unpermute_rows(weights, tensor.unpermute_heads))
        state_dict[tensor.hf_name] = torch.from_numpy(weights)
    return state_dict
