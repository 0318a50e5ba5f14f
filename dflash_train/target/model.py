"""The frozen target: load a Hugging Face causal LM, capture the hidden states a drafter needs.

Contract (docs/SEMANTICS.md): layer id k is the output of decoder layer k, i.e. Hugging Face
`hidden_states[k + 1]` (index 0 is the embedding output; the last index is after the final
norm, so asking for the last layer gives the normed state, exactly as HF reports it). The
forward stops after the deepest requested layer. The drafter shares the target's input
embedding and LM head; they are exposed here and never copied into a drafter checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import pickle
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..config import UserError
from ..errors import named_by_flag, os_error_reason
from ..files import file_sha256

# Model types whose decoder is `model.model.layers` of pre-norm blocks, which is what the DFlash
# drafter (Qwen3-style layers) is built to pair with: dense attention-only families, MoE ones
# (an expert MLP in each block), and hybrids whose blocks mix Gated DeltaNet (linear attention)
# with full attention. The drafter is a plain Qwen3 stack for all of them (`drafter_rope`).
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
MOE_MODEL_TYPES = ("qwen3_moe", "gpt_oss")
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES + HYBRID_MODEL_TYPES
# Multimodal wrappers whose language model is one of the above: load the text model alone.
_WRAPPED_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

# Rope settings of a target that a drafter must never copy: its layers rotate the whole head
# (partial rotary), by one position axis (mRoPE). Copying either collapses acceptance to ~1.
TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal wrapper's `text_config` (Qwen3.5 releases are
    image-text models; Hugging Face loads their language model alone as a causal LM)."""
    inner = getattr(config, "text_config", None)
    if getattr(config, "model_type", None) in _WRAPPED_TEXT_TYPES and inner is not None:
        return inner
    return config


def has_recurrent_layers(config: Any) -> bool:
    """Whether a model's layers keep state that cropping cannot undo (linear attention, SSM)."""
    kinds = set(getattr(config, "layer_types", None) or ())
    return bool(kinds - {"full_attention", "sliding_attention", "attention", "chunked_attention"})


def family_kind(model_config: Any) -> str:
    """'hybrid' (linear and full attention layers), 'moe' (expert MLPs) or 'dense'."""
    model_type = text_config(model_config).model_type
    if model_type in HYBRID_MODEL_TYPES or has_recurrent_layers(model_config):
        return "hybrid"
    return "moe" if model_type in MOE_MODEL_TYPES else "dense"


def drafter_rope(config: Any) -> dict[str, Any]:
    """The rope a drafter for this target uses: plain RoPE over the whole head with the target's
    theta and its scaling (YaRN for gpt-oss), never the target's partial rotary factor or mRoPE
    sections (those belong to the target's own attention, not to a Qwen3 drafter)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):
        # Gemma 3 keeps one rope per layer type; the drafter's layers are full attention.
        rope = dict(rope["full_attention"])
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    for key in TARGET_ONLY_ROPE_KEYS:
        rope.pop(key, None)
    if rope.get("rope_type") in (None, "mrope"):
        rope["rope_type"] = "default"
    return rope


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding by halves (Llama's and Qwen's, the drafter's): x [b, heads, L, d],
    cos/sin [b, L, d]. Here because the target's static forward (target/static_cache.py) and
    the drafter both rotate with it."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def _intermediate_size(config: Any) -> int:
    """The drafter's MLP width: the target's dense MLP width where it has one (MoE models keep
    it for their dense layers); else, for MoE models without one, the width the experts of one
    token span together."""
    size = getattr(config, "intermediate_size", None)
    if size:
        return int(size)
    experts, per_token = getattr(config, "moe_intermediate_size", None), getattr(config, "num_experts_per_tok", None)
    if experts and per_token:
        return int(experts) * int(per_token)
    raise TargetError(f"{getattr(config, 'model_type', '?')}: the config has neither intermediate_size nor "
                      "moe_intermediate_size with num_experts_per_tok")


class TargetError(UserError, ValueError):
    """The target model or a target-related setting cannot be used; the message says why."""


@dataclass(frozen=True)
class TargetSpec:
    """The target dimensions the drafter copies (hidden size, heads, head_dim, rope, vocab)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    hidden_act: str
    input_embedding_scale: float
    final_logit_softcapping: float | None

    @classmethod
    def from_hf_config(cls, config: Any, embedding: nn.Module | None = None) -> "TargetSpec":
        config = text_config(config)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise TargetError(
                f"unknown architecture {model_type!r}: dflash-train supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}. Convert the target to one of these families, "
                "or open an issue with the model's config.json."
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = drafter_rope(config)
        scale = float(getattr(embedding, "embed_scale", 1.0)) if embedding is not None else 1.0
        if isinstance(getattr(embedding, "embed_scale", None), torch.Tensor):
            scale = float(embedding.embed_scale.item())
        return cls(
            model_type=model_type,
            hidden_size=config.hidden_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=_intermediate_size(config),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            vocab_size=config.vocab_size,
            rope_parameters=rope,
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 32768)),
            hidden_act=getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", "silu"),
            input_embedding_scale=scale,
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        )


def hidden_state_index(layer_id: int) -> int:
    """Where layer id k (the output of decoder layer k) sits in Hugging Face's `hidden_states`:
    index 0 is the embedding output, so layer k is index k + 1."""
    return layer_id + 1


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The rule of docs/SEMANTICS.md: n = 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1))."""
    if num_draft_layers < 1:
        raise TargetError("the number of target layers to capture must be at least 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def check_target_layer_ids(layer_ids: list[int], num_target_layers: int) -> None:
    if not layer_ids:
        raise TargetError("target_layer_ids is empty: give at least one decoder layer index")
    bad = [k for k in layer_ids if not 0 <= k < num_target_layers]
    if bad:
        raise TargetError(
            f"target_layer_ids {bad} out of range: the target has {num_target_layers} decoder layers, "
            f"so valid ids are 0..{num_target_layers - 1} (id k = output of decoder layer k)."
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise TargetError(f"target_layer_ids {layer_ids} repeats a layer")


_MASK_NAME = re.compile(r"reserved|unused|empty_output|mask", re.IGNORECASE)


def resolve_mask_token_id(requested: int | None, tokenizer: Any, embedding_rows: int) -> int:
    """Pick the drafter's MASK token id; it must be a row of the target's embedding table.

    Rule, first match wins:
      1. the id the user asked for (`--mask-token-id`);
      2. the tokenizer's own mask token;
      3. the first embedding row past the tokenizer's vocabulary (tables are often padded,
         e.g. Qwen3 has 151,936 rows for 151,669 tokens): a row no text ever produces;
      4. the lowest-id special token whose name marks it unused (reserved / unused /
         empty_output / mask), e.g. Llama-3 `<|reserved_special_token_0|>`, SmolLM2 `<empty_output>`.
    A brand-new row is never added: it would be untrained and missing from the export.
    """

    def check(token_id: int, origin: str) -> int:
        if not 0 <= token_id < embedding_rows:
            raise TargetError(
                f"mask token id {token_id} ({origin}) is outside the target's embedding table "
                f"(rows 0..{embedding_rows - 1}); pass --mask-token-id with an unused row in that range."
            )
        return token_id

    if requested is not None:
        return check(int(requested), "--mask-token-id")
    if tokenizer is None:
        raise TargetError("no tokenizer next to the target: pass --mask-token-id explicitly")
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return check(tokenizer.mask_token_id, "tokenizer.mask_token")
    if len(tokenizer) < embedding_rows:
        return check(len(tokenizer), "first embedding row past the tokenizer vocabulary")
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    specials = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token_id in sorted(specials):
        if token_id not in used and _MASK_NAME.search(str(specials[token_id])):
            return check(token_id, f"unused special token {specials[token_id]}")
    raise TargetError(
        "could not find an unused token for the drafter's MASK: pass --mask-token-id with the id "
        "of a token that never occurs in your data (a reserved special token is ideal)."
    )


class _StopForward(Exception):
    """Raised from a forward hook once the deepest needed layer ran."""


def default_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype a target runs in unless told otherwise: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def dtype_from_name(name: str, device: str | torch.device) -> torch.dtype:
    """A --dtype flag's value: "auto" (bfloat16 on CUDA, float32 elsewhere) or a name in
    config.DTYPE_NAMES."""
    from ..config import DTYPE_NAMES

    if name == "auto":
        return default_dtype(device)
    if name not in DTYPE_NAMES:
        raise UserError(f"dtype {name!r}: use auto, {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def resolve_device(name: str | torch.device) -> torch.device:
    """`auto` -> cuda:0 when CUDA is available, else cpu; any other name must exist on this machine."""
    if str(name) == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TargetError(f"device {name!r}: use auto, cpu, cuda or cuda:N") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and device.index is None and count:
        # `cuda` means the current device; torch.cuda.set_device and streams need the index.
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and (device.index or 0) >= count:
        raise TargetError(f"device {name}: not available here ({count} CUDA devices); use --device cpu")
    return device


_CACHE_ARGUMENT: dict[type, str] = {}


def cache_argument(model: nn.Module) -> str:
    """The name of the KV-cache argument of a Hugging Face model's forward: transformers ≥ 5.2x
    calls it `cache` (and warns on `past_key_values`); earlier 5.x releases only know
    `past_key_values`."""
    kind = type(model)
    if kind not in _CACHE_ARGUMENT:
        _CACHE_ARGUMENT[kind] = _named_cache_argument(kind) or "past_key_values"
    return _CACHE_ARGUMENT[kind]


def _named_cache_argument(kind: type) -> str | None:
    """The first forward along the class's bases that names a cache argument: a subclass whose
    forward takes only *args, **kwargs (as remote code often does) passes it to its base's."""
    for klass in kind.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        names = inspect.signature(forward).parameters
        for name in ("cache", "past_key_values"):
            if name in names:
                return name
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TargetError(
            f"{type(model).__name__} has no `model.layers`: dflash-train needs a decoder-only causal LM"
        )
    return layers


class Target:
    """A frozen causal LM plus what the drafter borrows from it.

    Not safe to call `features` from two threads at once on the same Target (its hooks are
    per-module); the pipeline gives each target worker thread its own Target.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, path: str | None = None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.path = path
        self.layers = decoder_layers(model)
        self.spec = TargetSpec.from_hf_config(model.config, model.get_input_embeddings())

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def head_weight(self) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        if head is None:
            raise TargetError(f"{type(self.model).__name__} has no LM head")
        return head.weight

    @torch.no_grad()  # not inference_mode: the features feed the drafter's autograd graph
    def features(
        self, input_ids: torch.Tensor, layer_ids: list[int], attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Concatenated hidden states of `layer_ids`, shape [batch, seq, len(layer_ids) * hidden].

        Sequences are right-padded; with causal attention the padding never reaches a real
        token, so no mask is needed (passing one forces a slower attention path).
        """
        check_target_layer_ids(layer_ids, self.spec.num_hidden_layers)
        deepest = max(layer_ids)
        captured: dict[int, torch.Tensor] = {}

        def hook(index: int):
            def capture(_module, _inputs, output):
                captured[index] = output[0] if isinstance(output, tuple) else output
                if index == deepest:
                    raise _StopForward

            return capture

        handles = [self.layers[k].register_forward_hook(hook(k)) for k in set(layer_ids)]
        try:
            self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        last = self.spec.num_hidden_layers - 1
        states = [self.model.model.norm(captured[k]) if k == last else captured[k] for k in layer_ids]
        return torch.cat(states, dim=-1)


def _check_all_weights_loaded(loaded: Any, path: Path) -> nn.Module:
    """The model of `from_pretrained(..., output_loading_info=True)`, refused when a weight was
    missing from the files: transformers then initialises it at random and says so only in a
    log line. A frozen target with a random part (most often an LM head saved without
    `lm_head.weight` while `tie_word_embeddings` is false) would train a drafter against noise."""
    if not (isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[1], dict)
            and {"missing_keys", "mismatched_keys"} <= set(loaded[1])):
        raise TargetError(f"{path}: this transformers does not report which weights it loaded "
                          "(from_pretrained(output_loading_info=True)); cannot tell whether the target is complete")
    model, info = loaded
    mismatched = list(info["mismatched_keys"])
    if mismatched:
        # Loaded with ignore_mismatched_sizes so that this is named here, shapes and all, instead of
        # a RuntimeError pointing at a report transformers logged above it.
        shown = ", ".join(f"{name} (file {list(stored)}, config {list(wanted)})" for name, stored, wanted in mismatched[:3])
        more = f" and {len(mismatched) - 3} more" if len(mismatched) > 3 else ""
        raise TargetError(f"{path}: weights whose shapes differ from what config.json describes: {shown}{more}; "
                          "the config.json does not belong to these weights")
    missing = sorted(info["missing_keys"])
    if not missing:
        return model
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    head = model.get_output_embeddings()
    head_missing = head is not None and any(name.endswith("lm_head.weight") for name in missing)
    why = (" The LM head is not stored and tie_word_embeddings is false, so it is not the input embedding either; "
           "save the model with its head (or, if the head really is the embedding, set tie_word_embeddings: true "
           "in config.json)." if head_missing else " Save the model with all its weights.")
    raise TargetError(f"{path}: weights missing from the model files: {shown}; transformers would fill them with "
                      f"random values.{why}")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE_BYTES = 1 << 20


def _sampled_fingerprint(paths: list[Path]) -> str:
    """sha256 over each file's name, size, first and last MiB: tells apart two fine-tunes of one
    model (every tensor differs) without reading a target's many GB."""
    digest = hashlib.sha256()
    for path in paths:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(_SAMPLE_BYTES))
            handle.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def target_identity(path: str | Path) -> dict[str, str]:
    """Which target a path holds, without loading it: its config.json (sha256) and a sampled
    fingerprint of its weight files (a .gguf: the file). What `eval --json` records, what a
    checkpoint records for `--resume`, and what the nodes of a run compare; the path itself is
    left out (another node, or a later run, may mount the same model elsewhere)."""
    path = Path(path).resolve()
    if path.is_file():
        return {"weights_fingerprint": _sampled_fingerprint([path])}
    return {
        "config_sha256": file_sha256(path / "config.json"),
        "weights_fingerprint": _sampled_fingerprint(
            sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))),
    }


def identity_differences(before: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """The fields of two `target_identity` records that differ (none: one target; a record's path,
    where it keeps one, is not compared: the same model may be mounted elsewhere)."""
    before, now = before or {}, now or {}
    return [name for name in ("config_sha256", "weights_fingerprint") if before.get(name) != now.get(name)]


def target_config(path: str | Path) -> Any:
    """A target's Hugging Face config, read without its weights (a .gguf from its header, not
    converted); what its files hold that transformers cannot read is a TargetError naming it."""
    from transformers import AutoConfig

    path = Path(path)
    with _load_errors_named(path):
        if path.suffix == ".gguf" and path.is_file():
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoConfig.from_pretrained(str(path))


def model_folder(path: str | Path) -> Path:
    """The Hugging Face folder of a target: `path` itself, or a `.gguf` file's converted folder
    (converted once, cached)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from .gguf import hf_folder_from_gguf

        return hf_folder_from_gguf(path)
    return path


# Either file lets `load_target` load a folder's tokenizer (a .gguf file carries its own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_tokenizer_beside(path: str | Path, flag: str, needed_for: str) -> None:
    """A folder target's tokenizer is there, checked before it loads: a command that renders
    text with it would otherwise load the model only to stop."""
    path = Path(path)
    if path.is_dir() and not any((path / name).exists() for name in TOKENIZER_FILES):
        raise TargetError(f"{named_by_flag(path, flag)}: no tokenizer next to the model ({' or '.join(TOKENIZER_FILES)}); "
                          f"it is needed to {needed_for}")


def check_layer_ids_fit(layer_ids: list[int], target: str | Path) -> None:
    """Layer ids beyond a target's depth, refused from its declared config before any weight loads."""
    layers = declared_size(target, "num_hidden_layers") if layer_ids else None
    if layers:
        check_target_layer_ids(list(layer_ids), layers)


def check_target_path(path: str | Path, flag: str = "") -> None:
    """A target path that can load: a .gguf file whose header reads, or a folder whose config.json
    is a JSON object naming a model_type this transformers knows, beside the weight files
    `from_pretrained` looks for (every shard an index lists). Commands check it before anything
    loads, naming their `flag`: what transformers would say only as a traceback, minutes in."""
    path = Path(path)
    where = named_by_flag(path, flag)
    if not path.exists():
        raise TargetError(f"{where}: no such file or folder")
    if path.suffix == ".gguf" and path.is_file():
        from .gguf import check_gguf_file
        from .gguf_header import read_gguf_header

        check_gguf_file(path, flag)  # 4 bytes: not a GGUF file at all
        try:  # its header, not its data: a copy cut short is named now, not by a struct.error mid-conversion
            header = read_gguf_header(path)
        except ValueError as error:  # transformers' reader refuses the same files (little-endian v2/v3 only)
            raise TargetError(f"{where}: not a readable GGUF file ({path.stat().st_size} bytes): {error}; "
                              "an unfinished copy or download?") from None
        if "general.architecture" not in header.fields:
            raise TargetError(f"{where}: its GGUF metadata names no general.architecture, so no model can be built from it")
        return
    if not (path / "config.json").is_file():
        raise TargetError(f"{where}: not a Hugging Face model folder (no config.json) and not a .gguf file")
    _check_model_config(path / "config.json", where)
    _check_weight_files(path, where)


def _check_model_config(path: Path, where: str) -> None:
    """config.json parses as a JSON object whose model_type transformers has a config class for
    (the architecture rule itself, `TargetSpec.from_hf_config`, runs on that class once it loads)."""
    from transformers import CONFIG_MAPPING, __version__

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise TargetError(f"{where}: {path.name} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise TargetError(f"{where}: {path.name} is not valid JSON ({error.msg} at line {error.lineno} "
                          f"column {error.colno})") from None
    if not isinstance(raw, dict):
        raise TargetError(f"{where}: {path.name} is not a JSON object (it is a {type(raw).__name__})")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise TargetError(f"{where}: {path.name} names no model_type, so transformers cannot tell which "
                          "architecture it is")
    if model_type not in CONFIG_MAPPING:
        raise TargetError(f"{where}: {path.name} has model_type {model_type!r}, which transformers {__version__} "
                          f"does not know; dflash-train supports {', '.join(SUPPORTED_MODEL_TYPES)}")


def _check_weight_files(folder: Path, where: str) -> None:
    """The weights `from_pretrained` reads are there: one of the files it looks for and, for a
    sharded model, every shard its index lists (a download cut short often lacks some)."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    present = [name for name in names if (folder / name).is_file()]
    if not present:
        raise TargetError(f"{where}: no weights (none of {', '.join(names)}); an unfinished download or copy?")
    if present[0] not in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        _check_safetensors_header(folder / present[0], where)  # transformers reads this file, whatever index lies beside it
        return
    index = folder / present[0]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise TargetError(f"{where}: {index.name} is not a shard index (a JSON object with a weight_map of file names)")
    missing = sorted({shard for shard in weight_map.values() if not (folder / shard).is_file()})
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise TargetError(f"{where}: {index.name} lists {len(missing)} weight file{'s' * (len(missing) > 1)} "
                          f"the folder lacks: {shown}; an unfinished download or copy?")
    for shard in sorted(set(weight_map.values())):
        _check_safetensors_header(folder / shard, where)


def _check_safetensors_header(path: Path, where: str) -> None:
    """A .safetensors file's header reads (safetensors' own reader; the tensor data is not read):
    a file cut short or not safetensors at all is named now, not as a deserializing error at load.
    Other formats (pickled .bin) cannot be checked without unpickling them: left to the load."""
    if path.suffix != ".safetensors":
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as error:
        raise TargetError(f"{where}: {path.name} is not a readable safetensors file ({path.stat().st_size} bytes): "
                          f"{_first_line(error)}; an unfinished download or copy?") from None


# What a .gguf file's header names each config value the checks before loading read.
_GGUF_DECLARED = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                  "embedding_length": "hidden_size", "vocab_size": "vocab_size"}


def declared_config(path: str | Path) -> dict[str, Any]:
    """The language model's config values a target declares, read without loading it: its
    config.json (a multimodal wrapper's text_config over the top level), or a .gguf header's
    `ARCH.*` values by their config names (the vocabulary counted from its token list where no
    vocab_size is given). Empty where it cannot be read: the load that follows names that."""
    path = Path(path)
    try:
        if path.suffix == ".gguf" and path.is_file():
            from .gguf_header import read_gguf_header

            fields = read_gguf_header(path).fields
            architecture = fields["general.architecture"].value
            declared = {name: fields[f"{architecture}.{key}"].value for key, name in _GGUF_DECLARED.items()
                        if f"{architecture}.{key}" in fields}
            if "vocab_size" not in declared and "tokenizer.ggml.tokens" in fields:
                declared["vocab_size"] = len(fields["tokenizer.ggml.tokens"].value)
            return declared
        raw = json.loads((path / "config.json").read_text())
        inner = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        return {**raw, **inner}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return {}


def positive_size(declared: dict[str, Any], name: str) -> int | None:
    """One positive whole number of a `declared_config` (None where it is not one)."""
    value = declared.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def declared_size(path: str | Path, name: str) -> int | None:
    """One positive whole number the target at `path` declares (`declared_config`)."""
    return positive_size(declared_config(path), name)


def declared_context(path: str | Path) -> int | None:
    """The context length a target declares (max_position_embeddings), read without loading it."""
    return declared_size(path, "max_position_embeddings")


def load_target(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    load_tokenizer: bool = True,
) -> Target:
    """Load a target from a Hugging Face folder or a `.gguf` file (converted once, cached). What
    the files hold that transformers cannot load is a TargetError naming the path."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_target_path(path)
    with _load_errors_named(path):  # the path as given: a .gguf, not the folder it converts into
        path = model_folder(path)
        config = AutoConfig.from_pretrained(path)
        TargetSpec.from_hf_config(config)  # refuse unknown architectures before loading weights
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or default_dtype(device), output_loading_info=True,
                                                      ignore_mismatched_sizes=True)  # refused below, naming the shapes
        model = _check_all_weights_loaded(loaded, path)
        tokenizer = None
        if load_tokenizer and any((path / name).exists() for name in TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(path)
    # Outside: a device that fails (CUDA out of memory, a driver error) is not the files' fault.
    return Target(model.to(device), tokenizer, str(path))


@contextlib.contextmanager
def _load_errors_named(path: str | Path) -> Iterator[None]:
    """Turn what transformers, safetensors or the GGUF readers raise about a target's files (a
    config value it rejects, a weights file that is no safetensors, a shard of the wrong shape)
    into one TargetError naming `path` and the cause's first line. Left alone: our own errors
    (already one line), OS errors the CLI names by path and errno, and running out of memory."""
    from safetensors import SafetensorError

    try:
        yield
    except (UserError, torch.OutOfMemoryError):
        raise
    except OSError as error:
        if os_error_reason(error) is not None:
            raise
        raise TargetError(f"target {path}: cannot be loaded: {_first_line(error)}") from error
    except pickle.UnpicklingError as error:
        # torch's own first line advises weights_only=False, i.e. running whatever code the file holds: not that.
        raise TargetError(f"target {path}: cannot be loaded: a pickled weights file (.bin) does not load as plain "
                          "tensors (damaged, or it holds more than tensors); use the model's safetensors files") from error
    except (ValueError, KeyError, TypeError, RuntimeError, struct.error, SafetensorError) as error:
        raise TargetError(f"target {path}: cannot be loaded: {_first_line(error)}") from error


def _first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message; a KeyError's (only the key) after its type."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return f"{type(error).__name__} {first}".strip() if isinstance(error, KeyError) or not first else first

