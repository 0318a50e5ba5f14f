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

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says which and how to fix it."""


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
