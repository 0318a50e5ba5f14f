"""`dflash-train <command>`: a static table of commands, each resolved only when it is asked for.

Each command lives in `dflash_train.commands.<module>` as a config dataclass (one flag per
field) and a run function. `dflash-train --help` imports no command module; `dflash-train
train --help` imports only `commands/train.py`, whose config is torch-free, so neither loads
torch or transformers.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import NamedTuple

from . import __version__
from .config import add_arguments, from_args, leaf_fields
from .errors import RunFailed, StoppedAndKept, UserError, os_error_reason


class Command(NamedTuple):
    module: str  # under dflash_train.commands
    config: str  # the config dataclass in that module
    run: str  # its run function
    help: str
    positional: str | None = None  # a config field that may also be given as the first argument


COMMANDS: dict[str, Command] = {
    "quickstart": Command("quickstart", "QuickstartConfig", "run_quickstart",
                          "the whole product on SmolLM2 in ~10 minutes on a CPU: data, training, acceptance, export"),
    "pipeline": Command("pipeline", "PipelineConfig", "run_pipeline",
                        "train a drafter for your model by a recipe: prompts, answers, training, tau, export "
                        "(resumable stages) and the commands that serve it"),
    "regenerate": Command("regenerate", "RegenerateConfig", "run_regenerate",
                          "answer prompts with the target itself (resumable) to make training data"),
    "prompts": Command("prompts", "PromptsConfig", "run_prompts",
                       "build the default training prompts (decontaminated; train/dev split): counts, or a .jsonl file"),
    "self-prompts": Command("self_prompts", "SelfPromptsConfig", "run_self_prompts",
                            "let the target write user requests itself (open chat prompts, decontaminated) as a prompts .jsonl"),
    "cache-features": Command("cache_features", "CacheFeaturesConfig", "run_cache_features",
                              "store the target's hidden states for a data set (sharded, resumable) to train without running it"),
    "train": Command("train", "TrainConfig", "run_train", "train a drafter (or several) against a frozen target"),
    "export": Command("export", "ExportConfig", "run_export",
                      "write the Hugging Face folder of a trained drafter (--format gguf: llama.cpp's GGUF; --check DIR: judge a folder against SGLang's and vLLM's loaders)",
                      "checkpoint"),
    "eval": Command("eval", "EvalConfig", "run_eval",
                    "speculative decoding with an exported drafter: tau, its histogram, tokens/s, speed-up"),
    "eval-merge": Command("eval_merge", "EvalMergeConfig", "run_eval_merge",
                          "merge the --json files of `eval --offset --limit` shards into one run's numbers", "inputs"),
    "doctor": Command("doctor", "DoctorConfig", "run_doctor",
                      "will a run work here? versions, compile gate, GPUs (bf16, FP8, peers), flex, disk, a target's probe"),
}


def _module(command: Command):
    return importlib.import_module(f"dflash_train.commands.{command.module}")


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the `selected` command's module is imported to add its flags."""
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash block-diffusion drafters for lossless speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"dflash-train {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        if name != selected:
            continue
        if command.positional:
            child.add_argument(f"_{command.positional}", metavar=command.positional.upper(), nargs="?")
        add_arguments(child, getattr(_module(command), command.config))
    return parser


def _selected_command(argv: list[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_selected_command(argv))
    args, unknown = parser.parse_known_args(argv)
    command = COMMANDS[args.command]
    module = _module(command)
    config_class = getattr(module, command.config)
    if unknown:
        flags = ["--" + f.name.replace("_", "-") for f, _, _ in leaf_fields(config_class).values()] + ["--config"]
        first = unknown[0].split("=")[0]
        close = difflib.get_close_matches(first, flags, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; see dflash-train {args.command} --help"
        print(f"dflash-train {args.command}: unknown argument {unknown[0]!r}{hint}", file=sys.stderr)
        return 2
    if command.positional:
        value = getattr(args, f"_{command.positional}")
        delattr(args, f"_{command.positional}")
        flag = "--" + command.positional.replace("_", "-")
        if value is not None and getattr(args, command.positional, None) is not None:  # one would be dropped silently
            print(f"dflash-train {args.command}: {command.positional.upper()} is given twice, as the first argument "
                  f"and as {flag}; give it once", file=sys.stderr)
            return 2
        if value is not None:
            setattr(args, command.positional, value)
    try:
        config = from_args(config_class, args)
        return int(getattr(module, command.run)(config) or 0)
    except (UserError, FileNotFoundError) as error:
        print(f"dflash-train {args.command}: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        line = user_os_error(error)
        if line is None:
            raise
        print(f"dflash-train {args.command}: {line}", file=sys.stderr)
        return 2
    except RunFailed as error:
        print(f"dflash-train {args.command}: {error}", file=sys.stderr)
        return 1
    except StoppedAndKept:
        return 130
    except KeyboardInterrupt:
        print("aborted", file=sys.stderr)
        return 130


def user_os_error(error: OSError) -> str | None:
    """One line naming the path and what is wrong with it, for the OS errors a user's paths and
    disks give; None for any other (a bug: its traceback is wanted)."""
    reason = os_error_reason(error)
    if reason is None:
        return None
    where = error.filename if error.filename is not None else "writing the output"
    also = f" -> {error.filename2}" if error.filename2 is not None else ""
    return f"{where}{also}: {reason}"


if __name__ == "__main__":
    sys.exit(main())
