"""Typed run configuration: one dataclass per command, one CLI flag per setting.

A config can come from a file (`--config run.toml` or `.json`) and flags override it.
Unknown keys, in a file or on the command line, are errors that name the key and the
closest valid one, so a typo never silently trains with a default. The configs of `train`,
`regenerate`, `eval`, `cache-features`, `self-prompts` and `quickstart` are made of typed
sections (`config.optimizer.lr`, a `SectionedConfig`), each checked where it is made; the other
commands' configs are flat and checked by `build`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError, UserError  # noqa: F401 - re-exported: most modules import them from here
from .files import check_folder_name

C = TypeVar("C")

FP8_CHOICES = ("off", "head", "all")  # train --fp8 (core/fp8.py)
DECODERS = ("auto", "static", "hf")  # eval --decoder (decode.loop.make_decoder)
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # --dtype flags (target.dtype_from_name)
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
THINKING = {"auto": None, "on": True, "off": False}  # --thinking -> the templates' enable_thinking
TOKEN_IDS = ("auto", "ignore")  # --token-ids: train on rows' generated answer ids where they fit, or never
DIST_BACKENDS = ("auto", "nccl", "gloo")  # train --dist-backend (parallel/launch.py)
MAX_SECONDS = 7 * 86400.0  # the longest timeout or interval a flag takes: a longer one is a typo, and inf overflows the timers


def option(default: Any = dataclasses.MISSING, help: str = "", *, at_least: float | None = None,
           above: float | None = None, at_most: float | None = None, below: float | None = None,
           choices: tuple | None = None, per_node: bool = False, fixed_by_checkpoint: bool = False,
           **kw: Any) -> Any:
    """A dataclass field carrying its CLI help text and, for a number (or a list of numbers), the
    range every value must lie in: `check_numbers` refuses a value outside it, and NaN or inf
    anywhere, for every command alike; `choices` are the only values `check_choices` accepts.
    For `train`: `per_node`, a setting each node of a multi-node run sets for itself (where its
    files are, how its own devices run; every other must be equal on every node, or the run stops
    at start); `fixed_by_checkpoint`, one a checkpoint's optimizer state fixes (a resume with
    another value is refused)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if per_node:
        metadata["per_node"] = True
    if fixed_by_checkpoint:
        metadata["fixed_by_checkpoint"] = True
    if (at_least, above, at_most, below) != (None, None, None, None):
        metadata["range"] = NumberRange(low=above if above is not None else at_least, low_open=above is not None,
                                        high=below if below is not None else at_most, high_open=below is not None)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return dataclasses.field(default=default, metadata=metadata, **kw)


@dataclasses.dataclass(frozen=True)
class NumberRange:
    """The values a numeric setting accepts: a finite number from `low` to `high` (either end
    may be open, or absent)."""

    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        low, high = _plain(self.low), _plain(self.high)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"> {low}" if self.low_open else f"at least {low}"
        return f"< {high}" if self.high_open else f"at most {high}"


def _plain(value: float | None) -> str:
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def numeric_fields(cls: type) -> dict[str, type]:
    """The fields of a config class that hold numbers (int or float, optional, or a list of
    them), with the number type."""
    found = {}
    for name, (_, tp, _) in leaf_fields(cls).items():
        base, _ = _unwrap_optional(tp)
        if typing.get_origin(base) in (list, tuple):
            base = (typing.get_args(base)[:1] or (str,))[0]
        if base in (int, float):
            found[name] = base
    return found


def check_numbers(config: Any, section: str = "") -> None:
    """The one rule for numbers, shared by every command's config: each numeric setting is a
    finite number inside the range its field declares (`option(..., at_least=1)`), checked
    before anything loads; the error names the flag (or, with `section`, the file's key:
    `[section] key`). A config of sections is checked section by section."""
    for name in section_classes(type(config)):
        check_numbers(getattr(config, name), section)
    if section_classes(type(config)):
        return
    fields = {f.name: f for f in dataclasses.fields(config)}
    label = (lambda name: f"[{section}] {name}") if section else _flag
    for name in numeric_fields(type(config)):
        value = getattr(config, name)
        for item in (value if isinstance(value, (list, tuple)) else [value]):
            if item is None:
                continue
            bounds = fields[name].metadata.get("range")
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                raise ConfigError(f"{label(name)} {item!r}: not a number")
            if not math.isfinite(item):
                rule = f" {bounds.describe()}" if bounds else ""
                raise ConfigError(f"{label(name)} must be a finite number{rule} (got {item})")
            if bounds is not None and not bounds.contains(item):
                raise ConfigError(f"{label(name)} must be {bounds.describe()} (got {item})")


def check_choices(config: Any) -> None:
    """Each setting declared with `choices` holds one of them (the error names the flag)."""
    for field in dataclasses.fields(config):
        if "choices" in field.metadata:
            _choice(field.name, getattr(config, field.name), field.metadata["choices"])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(value: Any, tp: Any, key: str, *, from_file: bool = False) -> Any:
    """Convert a raw value (a string from the command line, or, with `from_file`, a parsed
    TOML/JSON value) to the field's type. A flag's string converts to numbers, booleans and
    lists; a file's value must already be of the field's type (`cache = "yes"` is an error,
    not true: a file can say `true`, so a string there is a mistake, not a spelling), except
    that an optional field's "none" or "" is its empty value (TOML has no null). A bool never
    passes for a number (TOML `steps = true` is an error, not one step)."""
    base, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required")
    origin = typing.get_origin(base)
    if from_file and not _is_file_value_of(base, value):
        raise ConfigError(f"{key}: cannot read {value!r} as {_type_name(base)}{_file_type_hint(base, value)}")
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
        if base in (int, float):
            if isinstance(value, bool) or isinstance(value, (list, dict)):
                raise ValueError(value)
            if base is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return base(value)
        if base is str:
            if isinstance(value, (bool, list, dict)):
                raise ValueError(value)
            return str(value)
        if origin in (list, tuple):
            (item_tp,) = typing.get_args(base)[:1] or (str,)
            if dataclasses.is_dataclass(item_tp):  # tables (variants): their own type reads them, naming each
                value = json.loads(value) if isinstance(value, str) else value
                if not isinstance(value, (list, tuple)):
                    raise ValueError(value)
                for item in value:
                    if not isinstance(item, (dict, item_tp)):
                        raise ConfigError(f"{key}: cannot read {item!r} as a table")
                if from_file:  # converted here, where the file is known, so each table keeps the file's rule
                    return [item_tp.from_table(item, f"{key}[{i}]", from_file=True) for i, item in enumerate(value)]
                return list(value)
            if isinstance(value, str):
                value = [_expand_home(v.strip()) for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)):
                raise ValueError(value)
            return [_convert(v, item_tp, key, from_file=from_file) for v in value]
        if origin is dict or base is dict:
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
        if base is Any:
            return value
    except ConfigError:
        raise  # an item of a list, already named
    except (TypeError, ValueError, json.JSONDecodeError):
        raise ConfigError(f"{key}: cannot read {value!r} as {_type_name(base)}") from None
    return value


def _is_file_value_of(base: Any, value: Any) -> bool:
    """Whether a TOML/JSON value has the field's type (an integral float passes for an integer
    here and is checked as one by `_convert`; an int passes for a float)."""
    origin = typing.get_origin(base) or base
    if base is bool:
        return isinstance(value, bool)
    if base in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    return True


def _file_type_hint(base: Any, value: Any) -> str:
    if typing.get_origin(base) in (list, tuple):
        return " (a file writes a list in brackets: [a, b])"
    if isinstance(value, str):
        return " (a file's value keeps its type: write it without quotes)"
    return ""


_TYPE_NAMES = {bool: ("true or false", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
               str: ("a string", "strings"), dict: ("a table", "tables")}


ARCHS = ("dflash", "dflash2")  # the drafter architectures `--arch` names
# What a variants run writes at the top of --out beside its variants' folders: a variant of one of
# these names would write into them or fail on them. tests/integration/test_files_outputs.py checks
# this against what the trainer writes.
RUN_FOLDER_ENTRIES = ("pipeline.jsonl", "summary.json", "rows.cache", "compile_cache.bin", "tensorboard",
                      "run.json", "metrics.jsonl", "checkpoints", "export")
ATTENTION_BACKENDS = ("flex", "flash", "sdpa")  # what `--attention` names, besides auto


def _expand_home(item: str) -> str:
    """An item of a comma-separated list with its leading `~/` expanded: the shell expands `~` only
    at the start of a word, so in `--data ~/a.jsonl,~/b.jsonl` the second path arrives as typed."""
    return os.path.expanduser(item) if item == "~" or item.startswith("~/") else item


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (str,)
        return f"a list of {_TYPE_NAMES.get(typing.get_origin(item) or item, ('', 'values'))[1]}"
    return _TYPE_NAMES.get(tp, (getattr(tp, "__name__", str(tp)),))[0]


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def section_classes(cls: type) -> dict[str, type]:
    """A config made of sections (a `SectionedConfig`): section name -> its class; none for a
    flat config."""
    return {name: tp for name, tp in _field_types(cls).items() if isinstance(tp, type) and issubclass(tp, Section)}


def leaf_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any, str | None]]:
    """Every setting of a config by its flag's name: (field, type, its section or None)."""
    sections = section_classes(cls)
    if not sections:
        return {f.name: (f, tp, None) for f, tp in zip(dataclasses.fields(cls), _field_types(cls).values())}
    return {f.name: (f, tp, section) for section, inner in sections.items()
            for f, tp in zip(dataclasses.fields(inner), _field_types(inner).values())}


def unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(set(valid)))}"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def sections_of(cls: type) -> dict[str, tuple[str, ...]]:
    """A config's sections (section name -> its settings' names); none for a flat config."""
    return {name: tuple(f.name for f in dataclasses.fields(inner)) for name, inner in section_classes(cls).items()}


def convert_values(cls: type, raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Typed field values from a config file's mapping (TOML or JSON: each value must already be
    of its field's type, see `_convert`) with the flags' names (`-` or `_`), flat or grouped in
    the config's sections; unknown keys, keys in the wrong section and keys given twice are errors."""
    types_by_name = {name: tp for name, (_, tp, _) in leaf_fields(cls).items()}
    sections = sections_of(cls)
    home = {name: section for section, names in sections.items() for name in names}
    flat: dict[str, tuple[Any, str]] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        # A table under a section's name is that section (the field `data` is a list, the
        # section [data] a table, so the two never clash).
        if name in sections and (isinstance(value, dict) or name not in types_by_name):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{name}] must be a table of {name} settings, got {value!r}")
            for inner, inner_value in value.items():
                inner_name = inner.replace("-", "_")
                if inner_name not in types_by_name:
                    raise unknown_key_error(inner, list(sections[name]), f"{where}: [{name}]")
                if home.get(inner_name) != name:
                    raise ConfigError(f"{where}: [{name}] {inner}: {inner} belongs in [{home[inner_name]}]")
                if inner_name in flat:
                    raise ConfigError(f"{where}: {inner} is set twice ({flat[inner_name][1]} and [{name}] {inner})")
                flat[inner_name] = (inner_value, f"[{name}] {inner}")
            continue
        if name not in types_by_name:
            raise unknown_key_error(key, [*types_by_name, *sections], where)
        if name in flat:
            raise ConfigError(f"{where}: {key} is set twice ({flat[name][1]} and {key})")
        flat[name] = (value, key)
    return {name: _convert(value, types_by_name[name], f"{where}: {label}", from_file=True)
            for name, (value, label) in flat.items()}


def from_dict(cls: type[C], raw: dict[str, Any], where: str = "config") -> C:
    """Build `cls` from a mapping (see `convert_values`) and validate it."""
    return build(cls, convert_values(cls, raw, where), where)


def build(cls: type[C], values: dict[str, Any], where: str) -> C:
    """`cls` made from typed values and checked: a config of sections checks its sections where
    it is made, a flat one its numbers here; then the rules across settings (`validate()`, where
    the config has one)."""
    try:
        config = cls(**values)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from None
    if not section_classes(cls):
        check_numbers(config)
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
        return tomllib.loads(_config_text(path))
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from None


def _config_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start})") from None


def _default_shown(field: dataclasses.Field) -> Any:
    default = field.default if field.default is not dataclasses.MISSING else None
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = field.default_factory()  # type: ignore[misc]
    return ",".join(map(str, default)) if isinstance(default, list) else default


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field, listed by section; defaults stay unset so a config file
    can fill them."""
    sections = sections_of(cls)
    parser.add_argument("--config", help="a .toml or .json file with any of the keys below (flat, or in the "
                        "[section] each is listed under); flags override it")
    groups = {section: parser.add_argument_group(f"[{section}]") for section in sections}
    home = {name: groups[section] for section, names in sections.items() for name in names}
    for field, tp, _ in leaf_fields(cls).values():
        target = home.get(field.name, parser)
        help_text = f"{field.metadata.get('help', '')} (default: {_default_shown(field)})"
        base, _ = _unwrap_optional(tp)
        if base is bool:
            target.add_argument(_flag(field.name), dest=field.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            target.add_argument(_flag(field.name), dest=field.name, default=argparse.SUPPRESS,
                                metavar=field.name.upper(), help=help_text)


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    """Merge a config file (if any) with the flags given; flags win. Errors name the file and
    key, or the flag."""
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None)
    if config_path:
        values.update(convert_values(cls, load_file(config_path), str(config_path)))
    types_by_name = {name: tp for name, (_, tp, _) in leaf_fields(cls).items()}
    for name, value in vars(args).items():
        if name in types_by_name:
            values[name] = _convert(value, types_by_name[name], _flag(name))
    return build(cls, values, str(config_path) if config_path else "flags")


def load_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix == ".toml":
        return _read_toml(path)
    if path.suffix == ".json":
        def refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            keys = [key for key, _ in pairs]
            if twice := sorted({key for key in keys if keys.count(key) > 1}):
                raise ConfigError(f"{path}: {twice[0]} is set twice (JSON would keep the last one silently)")
            return dict(pairs)

        try:
            raw = json.loads(_config_text(path), object_pairs_hook=refuse_duplicates)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: line {error.lineno}: {error.msg}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config file holds one JSON object")
        return raw
    raise ConfigError(f"{path}: use a .json or .toml config file")


def canonical_dtype(name: str, key: str) -> str:
    """A dtype name from DTYPE_NAMES, accepting the short spellings in DTYPE_ALIASES."""
    canonical = DTYPE_ALIASES.get(name.lower(), name.lower())
    if canonical not in DTYPE_NAMES:
        raise ConfigError(f"{key} {name!r}: use {', '.join(DTYPE_NAMES)} (or {', '.join(DTYPE_ALIASES)})")
    return canonical


ON_OFF = ("auto", "on", "off")


def on_here(choice: str, device_type: str) -> bool:
    """An ON_OFF setting resolved for a device of `device_type`: `auto` means on for CUDA."""
    return choice == "on" or (choice == "auto" and device_type == "cuda")


class Section:
    """A typed section of a config (`[optimizer]`): its numbers and choices are checked where it
    is made, so a section that exists is valid; frozen, so it stays so."""

    def __post_init__(self) -> None:
        check_numbers(self)
        check_choices(self)
        self.check()

    def check(self) -> None:
        """The section's own rules beyond numbers and choices (errors name the flag)."""


@dataclasses.dataclass(frozen=True)
class DataSettings(Section):
    data: list[str] = option([], "training conversations: JSONL/Parquet files (comma-separated)", per_node=True)
    features: str = option("", "read target features from this cache (dflash-train cache-features) instead of running the target", per_node=True)
    thinking: str = option("auto", "thinking templates (Qwen3) when rendering --data and the eval prompts: auto (template default), on or off", choices=tuple(THINKING))
    token_ids: str = option("auto", "rows with their answer's generated token ids (regenerate writes them): auto = train on those ids where their tokenizer is the target's, ignore = re-tokenize the text", choices=TOKEN_IDS)
    max_seq_len: int = option(2048, "longer conversations are truncated", at_least=2, at_most=1 << 20)
    seq_buckets: list[int] = option([], "padded sequence lengths, increasing, at most max_seq_len (one compile each); empty = automatic up to max_seq_len", at_least=2)
    min_supervised_tokens: int = option(2, "skip rows with fewer assistant tokens than this", at_least=0)

    def check(self) -> None:
        if self.seq_buckets:
            if any(a >= b for a, b in zip(self.seq_buckets, self.seq_buckets[1:])):
                raise ConfigError(f"--seq-buckets {','.join(map(str, self.seq_buckets))}: lengths must be "
                                  "increasing and at least 2, e.g. 512,1024,2048")
            if self.seq_buckets[-1] > self.max_seq_len:
                raise ConfigError(f"--seq-buckets {self.seq_buckets[-1]} is longer than --max-seq-len {self.max_seq_len} "
                                  "(rows are truncated to max_seq_len, so it would never be used)")


@dataclasses.dataclass(frozen=True)
class ModelSettings(Section):
    target: str = option("", "target model: a Hugging Face folder or a .gguf file", per_node=True)
    block_size: int = option(16, "draft block size B (anchor + B-1 predicted tokens; at least 2: a block of 1 drafts nothing)", at_least=2, at_most=1024)
    num_layers: int = option(5, "drafter decoder layers", at_least=1, at_most=256)
    target_layer_ids: list[int] = option([], "target layers to capture; empty = the rule of docs/SEMANTICS.md with num_layers layers", at_least=0)
    mask_token_id: int | None = option(None, "MASK token id; empty = resolved from the tokenizer (see docs)", at_least=0)
    arch: str = option("dflash", "drafter architecture: dflash, or dflash2 (adds per-layer dynamic convolutions and a candidate selector; see README)", choices=ARCHS)
    conv_kernel_size: int = option(2, "dflash2: taps of each layer's causal convolutions (along the block); 2 as in the released drafters", at_least=1)
    conv_group_size: int = option(16, "dflash2: channels sharing one dynamic kernel; must divide the target's hidden size", at_least=1)
    selector_rank: int = option(64, "dflash2: rank of the selector's predecessor/successor codebooks (2 x vocab x rank parameters)", at_least=1)
    selector_top_k: int = option(16, "dflash2: candidates per draft position the selector chooses among", at_least=1)

    def check(self) -> None:
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ConfigError(f"--target-layer-ids {','.join(map(str, self.target_layer_ids))}: a layer is named twice")


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings(Section):
    loss: str = option("decay", "decay (DFlash paper, weights exp(-(k-1)/gamma)) or dpace", choices=("decay", "dpace"))
    gamma: float | None = option(None, "decay gamma (> 0); empty = paper value for the block size (7 for B=16)", above=0)
    dpace_alpha: float = option(0.5, "D-PACE smoothing alpha, in [0, 1]", at_least=0, at_most=1)
    num_anchors: int = option(512, "anchor slots per sequence (fixed, for static shapes); at most max_seq_len are used (a sequence has no more anchor positions)", at_least=1)
    loss_chunk_rows: int = option(0, "rows per frozen-head CE chunk; 0 = about 256 MiB of logits", at_least=0)
    selector_weight: float = option(1.0, "dflash2: weight of the selector's cross-entropy next to the backbone's (>= 0)", at_least=0)
    selector_miss: str = option("drop", "dflash2: a true token outside the top-k candidates: drop (leave the slot out of the selector loss) or insert (put it in place of the lowest candidate)", choices=("drop", "insert"))


@dataclasses.dataclass(frozen=True)
class OptimizerSettings(Section):
    steps: int = option(1000, "optimizer steps", at_least=1, at_most=10**9)
    batch_size: int = option(8, "sequences per micro-batch, per drafter replica", at_least=1)
    grad_accum: int = option(1, "micro-batches per optimizer step, per replica", at_least=1, at_most=1 << 16)
    lr: float = option(6e-4, "peak learning rate (AdamW), > 0", above=0, fixed_by_checkpoint=True)
    weight_decay: float = option(0.0, "AdamW weight decay, >= 0", at_least=0, fixed_by_checkpoint=True)
    adam_beta1: float = option(0.9, "AdamW beta1, in [0, 1)", at_least=0, below=1, fixed_by_checkpoint=True)
    adam_beta2: float = option(0.95, "AdamW beta2, in [0, 1)", at_least=0, below=1, fixed_by_checkpoint=True)
    warmup_ratio: float = option(0.04, "fraction of steps of linear warm-up", at_least=0, below=1)
    min_lr_ratio: float = option(0.0, "cosine decays to this fraction of the peak", at_least=0, at_most=1)
    clip_grad: float = option(1.0, "gradient-norm clip, > 0", above=0)
    stop_after_bad_steps: int = option(10, "stop the run (exit 1) after this many consecutive non-finite (skipped) or zero-gradient steps, or once more than half of at least 2K steps were skipped; 0 = never", at_least=0)
    seed: int = option(0, "seed for drafter init, data order and anchors", at_least=0)


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """One drafter of a variants run (`[[variants]]`): its name (its folder under --out) and the
    settings it sets for itself. A field left None takes the shared value; everything not listed
    here (data, target, devices, steps, batch) is shared by construction: one target stream
    feeds every drafter. Each field is the same-named field of a section of `TrainConfig`."""

    name: str = ""
    block_size: int | None = None
    num_layers: int | None = None
    target_layer_ids: list[int] | None = None
    arch: str | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    num_anchors: int | None = None
    loss: str | None = None
    gamma: float | None = None
    dpace_alpha: float | None = None
    selector_weight: float | None = None
    selector_miss: str | None = None
    lr: float | None = None
    weight_decay: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    warmup_ratio: float | None = None
    min_lr_ratio: float | None = None
    clip_grad: float | None = None
    seed: int | None = None
    fp8: str | None = None
    master_weights: str | None = None

    @classmethod
    def from_table(cls, table: Any, where: str, *, from_file: bool = False) -> DrafterSpec:
        """A variant's table (`{name = 'b8', block_size = 8}`), each value converted to its
        field's type like a flag's, or, `from_file`, by a file's rule (`_convert`); an unknown key
        names the closest one a variant may set."""
        if isinstance(table, cls):
            return table
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: a variant is a table of overrides, e.g. {{name = 'b8', block_size = 8}}")
        leaf_types = {name: tp for name, (_, tp, _) in leaf_fields(TrainConfig).items()}
        allowed = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in allowed:
                raise unknown_key_error(key, allowed, where)
            values[name] = _convert(value or "", str, f"{where}: {key}", from_file=from_file) if name == "name" \
                else _convert(value, leaf_types[name], f"{where}: {key}", from_file=from_file)
        return cls(**values)

    @classmethod
    def settings(cls) -> list[str]:
        """The settings a variant may set for itself (flat names)."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "name"]

    def overrides(self) -> dict[str, Any]:
        """The settings this drafter sets for itself (flat names)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) is not None}

    def table(self) -> dict[str, Any]:
        """As a config file writes it."""
        return {**({"name": self.name} if self.name else {}), **self.overrides()}

    def __repr__(self) -> str:
        return f"DrafterSpec({', '.join(f'{key}={value!r}' for key, value in self.table().items())})"


@dataclasses.dataclass(frozen=True)
class ParallelSettings(Section):
    device: str = option("auto", "one device for target and drafter (auto = cuda:0 if present, else cpu)", per_node=True)
    target_devices: list[str] = option([], "devices of the target worker threads, e.g. cuda:0", per_node=True)
    drafter_devices: list[str] = option([], "devices of the drafter worker threads, e.g. cuda:1,cuda:2", per_node=True)
    mode: str = option("replicas", "replicas: one drafter data-parallel over drafter_devices; variants: one drafter per entry of `variants`", choices=("replicas", "variants"))
    variants: list[DrafterSpec] = option([], "variants mode: per-drafter overrides, e.g. [{name='b8', block_size=8}]")
    attention: str = option("auto", "auto (flex on CUDA, sdpa on CPU), flex (CUDA only), flash (flex on FlashAttention-4's kernels: the flash-attn-4 package, Hopper or newer; docs/PERF.md) or sdpa", choices=("auto", *ATTENTION_BACKENDS), per_node=True)
    precision: str = option("auto", "auto (bf16 autocast on CUDA, fp32 on CPU), bf16 or fp32", choices=("auto", "bf16", "fp32"))
    compile: str = option("auto", "torch.compile the drafter forward: auto (on CUDA), on, off", choices=ON_OFF, per_node=True)
    compile_target: str = option("auto", "under CUDA graphs, torch.compile the target's feature forward before its capture (fewer, fused kernels; one compile per bucket): auto (wherever --compile compiles, dense targets only: a hybrid or MoE target's compile took minutes at real shapes and yielded no compiled graph), on (hybrids and MoE too), off", choices=("auto", "on", "off"), per_node=True)
    cuda_graphs: str = option("auto", "capture each bucket's training step and target forward in CUDA graphs before step 1: auto (on CUDA, eager where a capture is refused), on, off", choices=ON_OFF, per_node=True)
    fp8: str = option("off", "FP8 matmuls in training: off, head (frozen LM head), all (head and drafter linears); see docs/PERF.md", choices=FP8_CHOICES)
    master_weights: str = option("off", "bf16 drafter parameters with float32 master weights in the optimizer (needs bf16 and --grad-accum 1): on or off; saves the weight and gradient casts, 7-10 ms a step at the Qwen3-8B shape on an H100 (docs/PERF.md)", choices=("on", "off"))
    pack_anchors: str = option("off", "run each micro-batch's rows end to end with only their valid anchors (no padded anchor slots; the same loss, metrics and gradients to float summation order): on or off; one compiled and captured shape per whole rows' worth of anchor slots (docs/PERF.md)", choices=("on", "off"))
    prefetch: int = option(2, "batches queued per drafter (backpressure bound)", at_least=1, per_node=True)
    fail_on_recompile: bool = option(False, "error on any compile after the warm-up (default: that call runs eagerly)")
    # several nodes: one process per node under torchrun (parallel/nodes.py)
    dist_backend: str = option("auto", "under torchrun: the cross-node gradient all-reduce; auto (nccl when the drafters are on CUDA, else gloo), nccl or gloo", choices=DIST_BACKENDS)
    dist_timeout: float = option(300.0, "under torchrun: seconds a node may stop answering before the others stop with an error naming it (also the process groups' timeout); rank 0's evals and checkpoints are waited for without a limit", at_least=1, at_most=MAX_SECONDS)

    def __post_init__(self) -> None:
        specs = [DrafterSpec.from_table(table, f"variants[{i}]") for i, table in enumerate(self.variants)]
        object.__setattr__(self, "variants", specs)
        super().__post_init__()

    def check(self) -> None:
        if self.mode == "variants" and not self.variants:
            raise ConfigError("mode variants needs at least one entry in `variants` (config file)")
        if self.mode != "variants" and self.variants:
            raise ConfigError(f"`variants` is given but --mode is {self.mode}: add mode = \"variants\" to train them "
                              "(or remove `variants`)")
        devices = [*(self.target_devices or [self.device]), *(self.drafter_devices or [self.device])]
        if self.cuda_graphs == "on" and "cpu" in devices:
            raise ConfigError("--cuda-graphs on: CUDA graphs need CUDA devices and this run uses the cpu "
                              "(use --cuda-graphs auto or off)")


@dataclasses.dataclass(frozen=True)
class EvalSettings(Section):
    eval_every: int = option(0, "every K steps, measure real tau by speculative decoding (0 = off)", at_least=0)
    eval_bench: str = option("mtbench", "prompts for --eval-every: a benchmark name or a prompts file", per_node=True)
    eval_limit: int = option(8, "prompts used by --eval-every", at_least=1)
    eval_max_new_tokens: int = option(64, "new tokens per prompt for --eval-every", at_least=1)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings(Section):
    out: str = option("", "run folder: checkpoints, metrics, run.json", per_node=True)
    resume: bool = option(False, "continue from the latest complete checkpoint in `out` (needed to reuse a run folder)")
    save_every: int = option(500, "checkpoint every K steps (and always at the end)", at_least=1)
    keep_checkpoints: int = option(2, "complete checkpoints kept (older ones are deleted)", at_least=1)
    export_dtype: str = option("bfloat16", "dtype of the exported weights at the end of training (bfloat16, float16, float32; empty = no export)")

    def check(self) -> None:
        if self.export_dtype:
            object.__setattr__(self, "export_dtype", canonical_dtype(self.export_dtype, "--export-dtype"))
        if self.out and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out} is a file; the run folder must be a folder (new, or a run to --resume)")


@dataclasses.dataclass(frozen=True)
class LoggingSettings(Section):
    log_every: int = option(10, "a log line every K steps", at_least=1)
    tensorboard: str = option("auto", "TensorBoard event files next to metrics.jsonl: auto (where the tensorboard package is installed), on or off", choices=ON_OFF, per_node=True)


class SectionedConfig:
    """A command's config made of typed sections (`config.generation.seed`), each checked where
    it is made (so a config that exists has valid numbers and choices). Subclasses are frozen
    dataclasses with `init=False` whose fields are `Section`s. Python callers may pass flat
    keywords (`RegenerateConfig(out=..., seed=...)`) or whole sections; `replace(**flat)`
    derives one; `flat_values()` is every setting by its flag's name."""

    def __init__(self, **values: Any) -> None:
        given, changes = _sort_settings(type(self), values, f"{type(self).__name__}()")
        for section, cls in section_classes(type(self)).items():
            settings = given.get(section)
            if settings is None:
                settings = cls(**changes.get(section, {}))
            elif changes.get(section):
                settings = dataclasses.replace(settings, **changes[section])
            object.__setattr__(self, section, settings)

    def replace(self: C, **values: Any) -> C:
        """This config with some settings changed, by flat name (`replace(lr=1e-3)`), checked
        like any other."""
        cls = type(self)
        given, changes = _sort_settings(cls, values, f"{cls.__name__}.replace()")
        sections = {section: given.get(section) or getattr(self, section) for section in section_classes(cls)}
        for section, fields in changes.items():
            sections[section] = dataclasses.replace(sections[section], **fields)
        return cls(**sections)

    def flat_values(self) -> dict[str, Any]:
        """Every setting by its flag's name."""
        return {f.name: copy.deepcopy(getattr(getattr(self, section), f.name))
                for section in section_classes(type(self)) for f in dataclasses.fields(getattr(self, section))}

    def __getattr__(self, name: str) -> Any:
        # Only reached for a missing attribute: say where a flat name lives.
        cls = type(self).__name__
        if not name.startswith("_"):
            for section, inner in section_classes(type(self)).items():
                if name in _names(inner):
                    raise AttributeError(f"{cls} has no attribute {name!r}: it is config.{section}.{name}")
        raise AttributeError(f"{cls} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig(SectionedConfig):
    """Everything one `dflash-train train` run needs, in typed sections (`config.optimizer.lr`);
    `run.json` in the run folder records it (flat: `flat_values()`).

    Made in one place and checked there: flags, config files (`lr = 6e-4` or `[optimizer]` /
    `lr = 6e-4`), a recipe's `[train]` table and each variant all build a `TrainConfig`, and a
    `TrainConfig` that exists is valid (its sections are frozen). Python callers may pass flat
    keywords (`TrainConfig(out=..., lr=...)`) or whole sections; `replace(**flat)` derives one.
    """

    data: DataSettings
    model: ModelSettings
    objective: ObjectiveSettings
    optimizer: OptimizerSettings
    parallel: ParallelSettings
    eval: EvalSettings
    checkpoint: CheckpointSettings
    logging: LoggingSettings

    def __init__(self, **values: Any) -> None:
        given, changes = _sort_settings(TrainConfig, values, "TrainConfig()")
        if "data" in changes.get("data", {}) and set(given) == set(section_classes(TrainConfig)) - {"data"}:
            # dataclasses.replace(config, data=[...]) lands here with every other section: the
            # data section would be lost, so say which call keeps it.
            raise TypeError("TrainConfig: `data` names both the [data] section and its files; "
                            "use config.replace(data=[...]) to change the files")
        super().__init__(**values)
        if self.model.block_size > self.data.max_seq_len:
            raise ConfigError(f"--block-size {self.model.block_size} is longer than --max-seq-len {self.data.max_seq_len}: "
                              "no block fits in a row")
        if self.parallel.master_weights == "on":
            if self.parallel.precision == "fp32":
                raise ConfigError("--master-weights on keeps bf16 parameters: it needs bf16, --precision bf16 (or auto "
                                  "on CUDA), not fp32")
            if self.optimizer.grad_accum > 1:
                raise ConfigError(f"--master-weights on: --grad-accum {self.optimizer.grad_accum} would add the "
                                  "micro-batches' gradients in bf16; use --grad-accum 1 with a larger --batch-size or "
                                  "more --drafter-devices (replicas sum in float32; a resume keeps the micro-batches "
                                  "per step that way), or --master-weights off")
        object.__setattr__(self, "_drafters", self._make_drafters())

    def flat_values(self) -> dict[str, Any]:
        """Every setting by its flag's name (what run.json and the checkpoints record, and what
        the nodes of a run compare); variants as their tables."""
        values = super().flat_values()
        values["variants"] = [spec.table() for spec in values["variants"]]
        return values

    def anchor_slots(self) -> int:
        """The anchor slots trained: a sequence of max_seq_len tokens has fewer than max_seq_len
        anchor positions, so slots past that would only be padding (every valid position is
        drawn either way: the same loss, without the memory of the padded blocks)."""
        return min(self.objective.num_anchors, self.data.max_seq_len)

    def variant_configs(self) -> list[tuple[str, TrainConfig]]:
        """(name, settings) of each drafter of a variants run: the shared settings with its
        `DrafterSpec`, made (and so checked) when this config was; none in replicas mode."""
        return list(self._drafters)  # type: ignore[attr-defined]

    def _make_drafters(self) -> list[tuple[str, TrainConfig]]:
        drafters: list[tuple[str, TrainConfig]] = []
        folders: dict[str, str] = {}
        if self.parallel.mode != "variants":
            return drafters
        for i, spec in enumerate(self.parallel.variants):
            where = f"variants[{i}]"
            label = spec.name or f"variant{i}"
            folder = check_folder_name(label, f"{where}: name", RUN_FOLDER_ENTRIES)  # the variant trains into OUT/<name>
            if folder in folders:
                raise ConfigError(f"{where}: name {label!r} is used twice (names are folders: "
                                  f"{folders[folder]!r} is the same folder)")
            folders[folder] = label
            try:
                drafter = self.replace(mode="replicas", variants=[], **spec.overrides())
            except ConfigError as error:
                raise ConfigError(f"{where} ({label}): {error}") from None
            drafters.append((label, drafter))
        return drafters


def marked(cls: type, mark: str) -> tuple[str, ...]:
    """The settings of a config whose field carries `mark` (`option(per_node=True)`)."""
    return tuple(name for name, (field, _, _) in leaf_fields(cls).items() if field.metadata.get(mark))


PER_NODE_SETTINGS = marked(TrainConfig, "per_node")
FIXED_BY_CHECKPOINT = marked(TrainConfig, "fixed_by_checkpoint")


def _sort_settings(config_cls: type, values: dict[str, Any],
                   call: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Keywords given to a SectionedConfig: whole sections (by section name), and settings by
    flat name sorted into their sections."""
    classes = section_classes(config_cls)
    home = {name: section for section, cls in classes.items() for name in _names(cls)}
    given: dict[str, Any] = {}
    changes: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        if key in classes and isinstance(value, classes[key]):
            given[key] = value
        elif key in home:
            changes.setdefault(home[key], {})[key] = value
        else:
            raise TypeError(f"{call} got an unexpected keyword argument {key!r}")
    return given, changes


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        names = [str(c) for c in choices if c != ""]  # "" is a flag left out, not a value to offer
        raise ConfigError(f"{_flag(name)} {value!r}: use {', '.join(names[:-1])} or {names[-1]}")

