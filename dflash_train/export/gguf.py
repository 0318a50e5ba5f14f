"""Export a trained drafter as the GGUF file llama.cpp serves (`llama-server -md drafter.gguf
--spec-type draft-dflash`), written with the `gguf` package: no llama.cpp checkout needed.

The file is the one llama.cpp's own converter (release b11434, `convert_hf_to_gguf.py EXPORT
--target-model-dir TARGET`, class `DFlashModel` in `conversion/qwen.py`) writes for our Hugging
Face export; tests/integration/test_export_gguf.py runs that converter and compares the two key by key,
tensor by tensor. What it holds:

- architecture `dflash`; the drafter's dims under `dflash.*` as for any transformer (block count,
  context, embedding, feed-forward, heads, RoPE base and scaling, RMS epsilon, head dim), plus
  `dflash.block_size` and `dflash.target_layers` = target layer ids + 1 (llama.cpp counts the
  embedding output as layer 0, like hidden_states[k + 1]);
- the target's tokenizer (`tokenizer.*`, copied from the target's GGUF: llama-server checks that
  draft and target vocabularies agree) and `tokenizer.ggml.mask_token_id`;
- tensors under llama.cpp's names (`fc`, `enc.output_norm` for hidden_norm, `blk.N.attn_q`, ...):
  matrices in the chosen dtype, norms, other 1-D tensors and bare tensors in float32 (llama.cpp
  reads norms only as float32);
- DFlash2 (the same converter class registers `DFlash2DraftModel`): `dflash.conv_kernel_size`,
  `conv_group_size`, `selector_rank`, `selector_top_k`, the convolutions as `blk.N.{attn,ffn}_conv_
  {base,proj}` and the selector as `selector_{predecessor,successor,hidden}.weight`.

The target must be given as its GGUF file (the one `llama-server -m` loads). A Hugging Face
folder is refused: naming its pre-tokenizer the way llama.cpp does takes the converter's own table.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import UserError
from ..core.drafter import DrafterConfig
from ..files import NewFileOutput, check_new_output
from ..target.gguf_header import GGUFField, read_gguf_header

__all__ = ["ARCH", "GGUFExportError", "check_gguf_output", "gguf_tensor_name", "read_target_vocabulary",
           "write_gguf_drafter", "write_gguf_from_export"]

ARCH = "dflash"  # llama.cpp's LLM_ARCH_DFLASH (src/llama-arch.cpp)

# Our export's weight names (export.rules.LAYER_WEIGHTS and TOP_WEIGHTS) -> llama.cpp's.
_TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
              "norm.weight": "output_norm.weight",
              # DFlash2's candidate selector; llama.cpp names the bare codebooks as .weight tensors
              "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
              "candidate_selector.successor_codebook": "selector_successor.weight",
              "candidate_selector.hidden_projection.weight": "selector_hidden.weight"}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # DFlash2's convolutions: the base kernel is a bare tensor (no .weight), its projection a linear
    "attention_conv.kernel_projection": "attn_conv_proj", "mlp_conv.kernel_projection": "ffn_conv_proj",
}
_LAYER_BARE = {"attention_conv.base_kernel": "attn_conv_base", "mlp_conv.base_kernel": "ffn_conv_base"}
# DFlash2's sizes, written as dflash.<key> (what llama.cpp's DFlash graph builds the convolutions
# and the selector from).
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# Export dtype -> (llama.cpp file type, tensor type of the matrices).
_FILE_TYPES = {torch.bfloat16: ("MOSTLY_BF16", "BF16"), torch.float16: ("MOSTLY_F16", "F16"),
               torch.float32: ("ALL_F32", "F32")}


class GGUFExportError(UserError, ValueError):
    pass


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name for one of our export's weights (`layers.3.mlp.up_proj.weight` ->
    `blk.3.ffn_up.weight`)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4 and parts[1].isdecimal() and ".".join(parts[2:]) in _LAYER_BARE:
        return f"blk.{parts[1]}.{_LAYER_BARE['.'.join(parts[2:])]}"
    if parts[0] == "layers" and len(parts) >= 4 and parts[1].isdecimal():
        module, kind = ".".join(parts[2:-1]), parts[-1]
        if module in _LAYER_NAMES and kind in ("weight", "bias"):
            return f"blk.{parts[1]}.{_LAYER_NAMES[module]}.{kind}"
    raise GGUFExportError(f"weight {name!r} has no llama.cpp DFlash tensor name")


def _field_value(field: GGUFField) -> tuple[Any, Any, Any]:
    """(value, value type, array element type) of a header field, as GGUFWriter takes them."""
    import gguf

    element = None if field.element_type is None else gguf.GGUFValueType(field.element_type)
    return field.value, gguf.GGUFValueType(field.type), element


def read_target_vocabulary(target_gguf: str | Path) -> dict[str, Any]:
    """The target GGUF's tokenizer keys and the dims the drafter must match:
    {"tokenizer": {key: (value, type, element type)}, "arch", "hidden", "layers", "vocab", "mrope"}."""
    from ..target.gguf import check_gguf_file

    check_gguf_file(target_gguf)
    try:
        fields = read_gguf_header(target_gguf).fields
    except (ValueError, OSError) as error:
        raise GGUFExportError(f"--target {target_gguf}: cannot be read as GGUF ({error})") from None

    def scalar(key: str) -> Any:
        return fields[key].value if key in fields else None

    arch = scalar("general.architecture")
    tokenizer = {key: _field_value(field) for key, field in fields.items() if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in tokenizer:
        raise GGUFExportError(f"--target {target_gguf}: has no tokenizer (no tokenizer.ggml.tokens)")
    sections = scalar(f"{arch}.rope.dimension_sections") or []
    return {
        "tokenizer": tokenizer,
        "arch": arch,
        "hidden": scalar(f"{arch}.embedding_length"),
        "layers": scalar(f"{arch}.block_count"),
        "vocab": len(tokenizer["tokenizer.ggml.tokens"][0]),
        "mrope": any(sections),
    }


def _check_pairing(config: DrafterConfig, vocabulary: dict[str, Any], target: str | Path) -> None:
    problems = []
    if vocabulary["vocab"] != config.vocab_size:
        problems.append(f"its vocabulary has {vocabulary['vocab']} tokens, the drafter's {config.vocab_size}")
    if vocabulary["hidden"] is not None and vocabulary["hidden"] != config.hidden_size:
        problems.append(f"its hidden size is {vocabulary['hidden']}, the drafter reads {config.hidden_size}")
    if vocabulary["layers"] is not None and vocabulary["layers"] != config.num_target_layers:
        problems.append(f"it has {vocabulary['layers']} layers, the drafter was trained on {config.num_target_layers}")
    if problems:
        raise GGUFExportError(f"--target {target}: not the target this drafter was trained on ({'; '.join(problems)})")


def _rope_keys(writer: Any, rope: dict[str, Any]) -> None:
    """RoPE as llama.cpp's converter writes it for a text model: base always, scaling only for the
    types llama.cpp's DFlash graph applies (linear, yarn, longrope); others are dropped there too."""
    import gguf

    rope_type, factor = rope.get("rope_type", "default"), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        for key, add in (("original_max_position_embeddings", writer.add_rope_scaling_orig_ctx_len),
                         ("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    elif rope_type in ("su", "longrope"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    elif rope_type != "default":
        print(f"[export] warning: RoPE type {rope_type!r} is not carried into llama.cpp's DFlash GGUF "
              "(its converter drops it too); llama.cpp drafts with plain RoPE", file=sys.stderr)
    writer.add_rope_freq_base(rope["rope_theta"])


def _metadata(writer: Any, config: DrafterConfig, model_dir: Path, file_type: Any, mrope: bool, parameters: int) -> None:
    import gguf

    # general.*: the gguf package's reading of the model folder (its name, a model card), as the
    # converter does it for the export folder.
    described = gguf.Metadata.load(None, model_dir, None, parameters)
    if described.name is None:
        described.name = model_dir.name
    if described.size_label is None:
        described.size_label = gguf.size_label(parameters, 0, 0, 0)
    described.set_gguf_meta_model(writer)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    _rope_keys(writer, dict(config.rope_parameters))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(file_type)
    writer.add_uint32(f"{ARCH}.block_size", config.block_size)
    if config.arch == "dflash2":
        for key in _DFLASH2_KEYS:
            writer.add_uint32(f"{ARCH}.{key}", int(getattr(config, key)))
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if config.input_embedding_scale != 1.0:
        writer.add_float32(f"{ARCH}.embedding_scale", float(config.input_embedding_scale))
    # llama.cpp counts the embedding output as layer 0: target layer k is its layer k + 1.
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in config.target_layer_ids])
    if mrope:  # the drafter ropes on the temporal section only
        writer.add_rope_dimension_sections([config.head_dim // 2, 0, 0, 0])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def check_gguf_output(out_path: str | Path, target: str | Path) -> None:
    """Refuse, before anything loads, an `--out` that exists and a `--target` that is no GGUF file."""
    from ..target.gguf import check_gguf_file

    check_new_output(out_path, "--out", [target])
    if Path(target).is_dir():
        raise GGUFExportError(
            f"--target {target}: is a folder; a GGUF drafter takes its tokenizer from the target's GGUF file, the "
            "one llama-server loads with -m (convert a Hugging Face folder with llama.cpp's convert_hf_to_gguf.py)")
    check_gguf_file(target, "--target")


def write_gguf_drafter(
    config: DrafterConfig,
    state_dict: dict[str, torch.Tensor],
    out_path: str | Path,
    *,
    target: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    model_dir: str | Path,
) -> Path:
    """Write the drafter as llama.cpp's DFlash GGUF at `out_path`, which must not exist.
    `target` is the target's GGUF file (its tokenizer is copied); `model_dir` (the run or export
    folder) names the model in general.name."""
    import gguf

    out_path = Path(out_path)
    check_gguf_output(out_path, target)
    if dtype not in _FILE_TYPES:
        raise GGUFExportError(f"dtype {dtype}: a GGUF drafter is written in bfloat16, float16 or float32")
    vocabulary = read_target_vocabulary(target)
    _check_pairing(config, vocabulary, target)
    if not 0 <= config.mask_token_id < vocabulary["vocab"]:
        raise GGUFExportError(f"mask token {config.mask_token_id} is not a token of {target}")

    file_type_name, matrix_type_name = _FILE_TYPES[dtype]
    file_type = getattr(gguf.LlamaFileType, file_type_name)
    matrix_type = getattr(gguf.GGMLQuantizationType, matrix_type_name)
    tensors = []
    for hf_name in sorted(state_dict):
        # Through the export dtype first: the values are those of the Hugging Face export.
        data = state_dict[hf_name].detach().to("cpu", dtype).float().numpy()
        gguf_name = gguf_tensor_name(hf_name)
        # float32: vectors, norms and bare tensors (not `.weight`: DFlash2's base kernels), as llama.cpp reads them
        plain = data.ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight")
        kind = gguf.GGMLQuantizationType.F32 if plain else matrix_type
        tensors.append((gguf_name, gguf.quants.quantize(np.ascontiguousarray(data), kind), kind))
    parameters = sum(math.prod(t.shape) for t in state_dict.values())

    # One live writer; a killed one's staging folder is cleaned.
    with NewFileOutput(out_path, "--out", say=lambda line: print(f"[export] {line}", file=sys.stderr)) as output:
        return _write_file(output, config, tensors, vocabulary, file_type, model_dir, parameters)


def _write_file(output: NewFileOutput, config: DrafterConfig, tensors: list, vocabulary: dict[str, Any],
                file_type: Any, model_dir: str | Path, parameters: int) -> Path:
    import gguf

    out_path = output.path
    # Staged in a hidden sibling folder (`.NAME.xxxxxxxx`, files.py's staging name) and published with
    # `output.write`, which never replaces a file that appeared meanwhile.
    with tempfile.TemporaryDirectory(prefix=f".{out_path.name}.", dir=out_path.parent) as staging:
        staged = Path(staging) / out_path.name
        writer = gguf.GGUFWriter(str(staged), ARCH)
        _metadata(writer, config, Path(model_dir).resolve(), file_type, vocabulary["mrope"], parameters)
        for key, (value, kind, element) in vocabulary["tokenizer"].items():
            writer.add_key_value(key, value, kind, sub_type=element)
        writer.add_mask_token_id(config.mask_token_id)
        for gguf_name, data, kind in tensors:
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tensors.clear()  # the file holds them now: one copy in memory, not two, while it is moved
        return output.write(staged.read_bytes())


def write_gguf_from_export(export_dir: str | Path, out_path: str | Path, *, target: str | Path,
                           dtype: torch.dtype = torch.bfloat16) -> Path:
    """The GGUF of an exported Hugging Face drafter folder (ours, or any with our layout)."""
    from .hf import load_exported_drafter

    drafter = load_exported_drafter(export_dir)
    return write_gguf_drafter(drafter.config, drafter.state_dict(), out_path, target=target, dtype=dtype,
                              model_dir=export_dir)
