"""`dflash-train <command>`: each command is one typed config dataclass; each field one flag.

Commands are listed in COMMANDS as (config class, runner, help); the runner imports lazily so
`dflash-train --help` stays fast and a command's heavy imports load only when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import sys
from typing import Any, Callable

from . import __version__
from .config import ConfigError, TrainConfig, UserError, add_arguments, from_args, option


@dataclasses.dataclass
class ExportConfig:
    checkpoint: str = option("", "a run folder (its latest checkpoint) or a checkpoint folder")
    out: str = option("", "the Hugging Face folder to write")
    dtype: str = option("bfloat16", "weight dtype: bfloat16, float16 or float32")
    force: bool = option(False, "replace a non-empty --out that is not an earlier export of this run")

    def validate(self) -> None:
        if not self.checkpoint or not self.out:
            raise ConfigError("export needs RUN_DIR_OR_CHECKPOINT and --out DIR")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype {self.dtype!r}: use bfloat16, float16 or float32")


def run_train(config: TrainConfig) -> int:
    from .pipeline.trainer import train

    train(config)
    return 0


def run_export(config: ExportConfig) -> int:
    import torch

    from .checkpoint import load_drafter, resolve_checkpoint
    from .export import export_model

    checkpoint = resolve_checkpoint(config.checkpoint)
    drafter = load_drafter(checkpoint)
    out = export_model(drafter, config.out, dtype=getattr(torch, config.dtype), run_dir=checkpoint.parent.parent,
                       source=checkpoint, force=config.force)
    cfg = drafter.config
    print(f"exported {checkpoint} -> {out}")
    print(f"  DFlashDraftModel: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, block {cfg.block_size}, "
          f"target layers {cfg.target_layer_ids}, mask token {cfg.mask_token_id}, {config.dtype}")
    return 0


# name -> (config class, "module:function" or callable, help, positional field or None)
COMMANDS: dict[str, tuple[type, Any, str, str | None]] = {
    "train": (TrainConfig, run_train, "train a drafter (or several) against a frozen target", None),
    "export": (ExportConfig, run_export, "write the Hugging Face folder of a trained drafter", "checkpoint"),
}


def register(name: str, config_class: type, runner: str | Callable, help: str, positional: str | None = None) -> None:
    COMMANDS[name] = (config_class, runner, help, positional)


def _load_optional_commands() -> None:
    """Commands owned by other modules register themselves here (keeps this file small)."""
    for module in ("dflash_train.data.commands", "dflash_train.evaluate", "dflash_train.quickstart"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_optional_commands()
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash block-diffusion drafters for lossless speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"dflash-train {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (config_class, _runner, help_text, positional) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if positional:
            command.add_argument(f"_{positional}", metavar=positional.upper(), nargs="?")
        add_arguments(command, config_class)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    config_class, runner, _help, positional = COMMANDS[args.command]
    if unknown:
        flags = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(config_class)] + ["--config"]
        first = unknown[0].split("=")[0]
        close = difflib.get_close_matches(first, flags, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; see dflash-train {args.command} --help"
        print(f"dflash-train {args.command}: unknown argument {unknown[0]!r}{hint}", file=sys.stderr)
        return 2
    if positional:
        value = getattr(args, f"_{positional}")
        delattr(args, f"_{positional}")
        if value is not None:
            setattr(args, positional, value)
    try:
        config = from_args(config_class, args)
        if isinstance(runner, str):
            module, function = runner.split(":")
            runner = getattr(importlib.import_module(module), function)
        return int(runner(config) or 0)
    except (UserError, FileNotFoundError) as error:
        print(f"dflash-train {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aborted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Under `python -m` this file runs as __main__; commands register into the importable
    # module, so dispatch through it.
    from dflash_train.cli import main as package_main

    sys.exit(package_main())
