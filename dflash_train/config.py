"""Typed run configuration: one dataclass per command, one CLI flag per field.

A config can come from a file (`--config run.toml` or `.json`) and flags override it.
Unknown keys, in a file or on the command line, are errors that name the key and the
closest valid one, so a typo never silently trains with a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError, UserError  # noqa: F401 - re-exported: most modules import them from here

C = TypeVar("C")

FP8_CHOICES = ("off", "head", "all")  # train --fp8 (fp8.py)
DECODERS = ("auto", "static", "hf")  # eval --decoder (decode.loop.make_decoder)
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # --dtype flags (target.dtype_from_name)
THINKING = {"auto": None, "on": True, "off": False}  # --thinking -> the templates' enable_thinking


def option(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    """A dataclass field carrying its CLI help text."""
    metadata = {"help": help}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return dataclasses.field(default=default, metadata=metadata, **kw)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a raw value (string from the CLI, or a parsed file value) to the field type."""
    base, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required")
    origin = typing.get_origin(base)
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if base in (int, float, str):
            if base is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return base(value)
        if origin in (list, tuple):
            (item_tp,) = typing.get_args(base)[:1] or (str,)
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            return [_convert(v, item_tp, key) for v in value]
        if origin is dict or base is dict:
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
        if base is Any:
            return value
    except (TypeError, ValueError, json.JSONDecodeError):
        raise ConfigError(f"{key}: cannot read {value!r} as {getattr(base, '__name__', base)}") from None
    return value


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def from_dict(cls: type[C], raw: dict[str, Any], where: str = "config") -> C:
    """Build `cls` from a mapping, converting types and refusing unknown keys."""
    types_by_name = _field_types(cls)
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in types_by_name:
            raise unknown_key_error(key, list(types_by_name), where)
        values[name] = _convert(value, types_by_name[name], f"{where}: {key}")
    try:
        config = cls(**values)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from None
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field; defaults stay unset so a config file can fill them."""
    parser.add_argument("--config", help="a .toml or .json file with any of the keys below; flags override it")
    for field, tp in zip(dataclasses.fields(cls), _field_types(cls).values()):
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        base, _ = _unwrap_optional(tp)
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        if base is bool:
            parser.add_argument(
                _flag(field.name), dest=field.name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=f"{help_text} (default: {shown})",
            )
        else:
            parser.add_argument(
                _flag(field.name), dest=field.name, default=argparse.SUPPRESS,
                metavar=field.name.upper(), help=f"{help_text} (default: {shown})",
            )


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    """Merge a config file (if any) with the flags given; flags win."""
    raw: dict[str, Any] = {}
    config_path = getattr(args, "config", None)
    if config_path:
        raw.update(load_file(config_path))
    raw.update({k: v for k, v in vars(args).items() if k not in ("config", "command", "func")})
    return from_dict(cls, raw, where=str(config_path) if config_path else "flags")


def load_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix == ".toml":
        return _read_toml(path)
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: line {error.lineno}: {error.msg}") from None
    raise ConfigError(f"{path}: use a .json or .toml config file")


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


@dataclasses.dataclass
class TrainConfig:
    """Everything one `dflash-train train` run needs; `run.json` in the run folder records it."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file")
    data: list[str] = option([], "training conversations: JSONL/Parquet files (comma-separated)")
    out: str = option("", "run folder: checkpoints, metrics, run.json")
    features: str = option("", "read target features from this cache (dflash-train cache-features) instead of running the target")
    steps: int = option(1000, "optimizer steps")
    batch_size: int = option(8, "sequences per micro-batch, per drafter replica")
    grad_accum: int = option(1, "micro-batches per optimizer step, per replica")
    max_seq_len: int = option(2048, "longer conversations are truncated")
    seq_buckets: list[int] = option([], "padded sequence lengths (one compile each); empty = automatic up to max_seq_len")
    min_supervised_tokens: int = option(2, "skip rows with fewer assistant tokens than this")
    block_size: int = option(16, "draft block size B (anchor + B-1 predicted tokens)")
    num_layers: int = option(5, "drafter decoder layers")
    num_anchors: int = option(512, "anchor slots per sequence (fixed, for static shapes)")
    target_layer_ids: list[int] = option([], "target layers to capture; empty = DESIGN rule with num_layers layers")
    mask_token_id: int | None = option(None, "MASK token id; empty = resolved from the tokenizer (see docs)")
    loss: str = option("decay", "decay (DFlash paper, weights exp(-(k-1)/gamma)) or dpace")
    gamma: float | None = option(None, "decay gamma; empty = paper value for the block size (7 for B=16)")
    dpace_alpha: float = option(0.5, "D-PACE smoothing alpha")
    loss_chunk_rows: int = option(0, "rows per frozen-head CE chunk; 0 = about 256 MiB of logits")
    lr: float = option(6e-4, "peak learning rate (AdamW)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.95, "AdamW beta2")
    warmup_ratio: float = option(0.04, "fraction of steps of linear warm-up")
    min_lr_ratio: float = option(0.0, "cosine decays to this fraction of the peak")
    clip_grad: float = option(1.0, "gradient-norm clip")
    seed: int = option(0, "seed for drafter init, data order and anchors")
    device: str = option("auto", "one device for target and drafter (auto = cuda:0 if present, else cpu)")
    target_devices: list[str] = option([], "devices of the target worker threads, e.g. cuda:0")
    drafter_devices: list[str] = option([], "devices of the drafter worker threads, e.g. cuda:1,cuda:2")
    mode: str = option("replicas", "replicas: one drafter data-parallel over drafter_devices; variants: one drafter per entry of `variants`")
    variants: list[dict] = option([], "variants mode: per-drafter overrides, e.g. [{name='b8', block_size=8}]")
    attention: str = option("auto", "auto (flex on CUDA, sdpa on CPU), flex or sdpa")
    precision: str = option("auto", "auto (bf16 autocast on CUDA, fp32 on CPU), bf16 or fp32")
    compile: str = option("auto", "torch.compile the drafter forward: auto (on CUDA), on, off")
    cuda_graphs: str = option("auto", "capture each bucket's training step and target forward in CUDA graphs before step 1: auto (on CUDA, eager where a capture is refused), on, off")
    fp8: str = option("off", "FP8 matmuls in training: off, head (frozen LM head), all (head and drafter linears); see docs/PERF.md")
    prefetch: int = option(2, "batches queued per drafter (backpressure bound)")
    save_every: int = option(500, "checkpoint every K steps (and always at the end)")
    keep_checkpoints: int = option(2, "complete checkpoints kept (older ones are deleted)")
    log_every: int = option(10, "a log line every K steps")
    resume: bool = option(False, "continue from the latest complete checkpoint in `out`")
    fail_on_recompile: bool = option(False, "error on any compile after a bucket's first step")
    export_dtype: str = option("bfloat16", "dtype of the exported weights at the end of training")
    eval_every: int = option(0, "every K steps, measure real tau by speculative decoding (0 = off)")
    eval_bench: str = option("mtbench", "prompts for --eval-every: a benchmark name or a prompts file")
    eval_limit: int = option(8, "prompts used by --eval-every")
    eval_max_new_tokens: int = option(64, "new tokens per prompt for --eval-every")

    def validate(self) -> None:
        if self.mode not in ("replicas", "variants"):
            raise ConfigError(f"mode {self.mode!r}: use replicas or variants")
        if self.mode == "variants" and not self.variants:
            raise ConfigError("mode variants needs at least one entry in `variants` (config file)")
        if self.loss not in ("decay", "dpace"):
            raise ConfigError(f"loss {self.loss!r}: use decay or dpace")
        for name in ("steps", "batch_size", "grad_accum", "max_seq_len", "num_anchors", "prefetch", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.block_size < 2:
            raise ConfigError(
                f"block_size {self.block_size}: must be at least 2 (position 0 is the anchor, so a block "
                "of 1 drafts nothing); DFlash uses 16"
            )
        if self.attention not in ("auto", "flex", "sdpa"):
            raise ConfigError(f"attention {self.attention!r}: use auto, flex or sdpa")
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f"compile {self.compile!r}: use auto, on or off")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ConfigError(f"cuda_graphs {self.cuda_graphs!r}: use auto, on or off")
        devices = [*(self.target_devices or [self.device]), *(self.drafter_devices or [self.device])]
        if self.cuda_graphs == "on" and "cpu" in devices:
            raise ConfigError("--cuda-graphs on: CUDA graphs need CUDA devices and this run uses the cpu "
                              "(use --cuda-graphs auto or off)")
        if self.fp8 not in FP8_CHOICES:
            raise ConfigError(f"fp8 {self.fp8!r}: use {', '.join(FP8_CHOICES)}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"precision {self.precision!r}: use auto, bf16 or fp32")
        if self.eval_every < 0 or self.eval_limit < 1 or self.eval_max_new_tokens < 1:
            raise ConfigError("eval_every must be >= 0, eval_limit and eval_max_new_tokens >= 1")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError("warmup_ratio must be in [0, 1)")
