"""`dflash-train export`: write the Hugging Face folder of a trained drafter from a run or checkpoint
(or, `--format gguf`, the GGUF file llama.cpp serves), or (`--check DIR`) judge any drafter folder
against the serving engines' loader rules."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from ..config import DTYPE_NAMES, ConfigError, UserError, option

EXPORT_FORMATS = ("hf", "gguf")


@dataclasses.dataclass
class ExportConfig:
    checkpoint: str = option("", "a run folder (its latest checkpoint) or a checkpoint folder")
    out: str = option("", "the Hugging Face folder to write (new, empty, or an earlier export of this run); "
                          "with --format gguf a new .gguf file")
    format: str = option("hf", "hf: the Hugging Face folder SGLang, vLLM and Transformers load; gguf: the file "
                               "llama.cpp serves (llama-server -md FILE --spec-type draft-dflash), needs --target")
    dtype: str = option("bfloat16", "weight dtype: bfloat16, float16 or float32")
    force: bool = option(False, "replace a non-empty --out that is not an earlier export of this run")
    check: str = option("", "write nothing: check this drafter folder (ours, a z-lab release, another trainer's) "
                            "against the SGLang and vLLM loader rules; exit 1 if one fails")
    target: str = option("", "with --check: the target's Hugging Face folder, to compare hidden size, vocabulary "
                             "and layer count against; with --format gguf: the target's GGUF file (the one "
                             "llama-server -m loads), whose tokenizer the drafter file carries")

    def validate(self) -> None:
        if self.format not in EXPORT_FORMATS:
            raise ConfigError(f"--format {self.format!r}: use {' or '.join(EXPORT_FORMATS)}")
        if self.check:
            if self.checkpoint or self.out or self.force or self.format != "hf":
                raise ConfigError("--check DIR writes nothing: pass it without RUN_DIR_OR_CHECKPOINT, --out, --force "
                                  "or --format")
            return
        if self.format == "gguf":
            if not self.target:
                raise ConfigError("--format gguf needs --target TARGET.gguf: the target's GGUF file, whose tokenizer "
                                  "the drafter file carries")
            if self.force:
                raise ConfigError("--format gguf writes a new file and never replaces one: pass it without --force")
            if self.out.endswith(("/", os.sep)):
                raise ConfigError(f"--out {self.out} names a folder; --format gguf writes one file: name it "
                                  f"(e.g. --out {self.out.rstrip('/' + os.sep) or '.'}/drafter.gguf)")
        elif self.target:
            raise ConfigError("--target is only for --check and --format gguf (an export takes the target's dims from "
                              "the checkpoint)")
        if not self.checkpoint or not self.out:
            raise ConfigError("export needs RUN_DIR_OR_CHECKPOINT and --out DIR (or --check DIR)")
        here = Path.cwd().resolve()
        if Path(self.out).resolve() in (here, *here.parents):
            raise ConfigError(f"--out {self.out} is the current folder or one above it; name the folder the export "
                              "is written to, e.g. --out export")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype {self.dtype!r}: use {', '.join(DTYPE_NAMES)}")


def run_export(config: ExportConfig) -> int:
    if config.check:
        return run_check(config.check, config.target)
    from ..files import hold_output

    # Inside a training run, the export is written only while no live `train` holds that run: its
    # own end would replace the folder without a word.
    with contextlib.ExitStack() as held:
        for run in _runs_around(config.out):
            held.enter_context(hold_output(run, "--out"))
        return _export_gguf(config) if config.format == "gguf" else _export_folder(config)


def _runs_around(out: str) -> list[Path]:
    """The folders a live `train` writing where `out` lies would hold: the drafter's folder (one
    with checkpoints/) and, where it is a variant's folder OUT/<name> as `train` reads a run
    folder (`held_run`), the variants run OUT, whose --out the trainer holds. Both: a drafter's
    folder that records no mode (no run.json) may be either."""
    from ..train.resume import held_run

    drafter = next((folder for folder in Path(out).resolve().parents if (folder / "checkpoints").is_dir()), None)
    if drafter is None:
        return []
    above = held_run(drafter.parent)
    return [drafter, drafter.parent] if above is not None and drafter.name in above.variants else [drafter]


def _export_folder(config: ExportConfig) -> int:
    import torch
    from safetensors import SafetensorError

    from ..export.hf import export_model
    from ..export.rules import architecture_name
    from ..train.checkpoint import load_drafter, resolve_checkpoint

    checkpoint = resolve_checkpoint(config.checkpoint)
    drafter = load_drafter(checkpoint)
    try:
        out = export_model(drafter, config.out, dtype=getattr(torch, config.dtype), run_dir=checkpoint.parent.parent,
                           source=checkpoint, force=config.force)
    except SafetensorError as error:  # safetensors writes the weights itself: a full disk arrives as its error
        raise UserError(f"--out {config.out}: cannot write the export's weights ({error}); the export is written "
                        "whole or not at all") from None
    cfg = drafter.config
    print(f"exported {checkpoint} -> {out} (passes every SGLang/vLLM loader rule: dflash-train export --check {out})")
    print(f"  {architecture_name(cfg.arch)}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, block {cfg.block_size}, "
          f"target layers {cfg.target_layer_ids}, mask token {cfg.mask_token_id}, {config.dtype}")
    return 0


def _export_gguf(config: ExportConfig) -> int:
    import torch

    from ..export.gguf import check_gguf_output, write_gguf_drafter
    from ..train.checkpoint import load_drafter, resolve_checkpoint

    check_gguf_output(config.out, config.target)  # before the checkpoint is read
    checkpoint = resolve_checkpoint(config.checkpoint)
    drafter = load_drafter(checkpoint)
    cfg = drafter.config
    out = write_gguf_drafter(cfg, drafter.state_dict(), config.out, target=config.target,
                             dtype=getattr(torch, config.dtype), model_dir=checkpoint.parent.parent)
    kind = "DFlash2" if cfg.arch == "dflash2" else "DFlash"
    print(f"exported {config.checkpoint} -> {out} (llama.cpp {kind} GGUF, tokenizer of {config.target})")
    print(f"  dflash: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, block {cfg.block_size}, "
          f"target layers {cfg.target_layer_ids} (+1 in the file), mask token {cfg.mask_token_id}, {config.dtype}")
    print(f"  serve: llama-server -m {config.target} -md {out} --spec-type draft-dflash "
          f"--spec-draft-n-max {cfg.block_size - 1}")
    return 0


def run_check(folder: str, target: str = "") -> int:
    """Print every rule's verdict; 0 when none fails, 1 otherwise (a missing folder is an input error)."""
    import json
    from pathlib import Path

    from ..errors import UserError
    from ..export.rules import check_folder, failures, render_verdicts, target_shape_from_config

    if not Path(folder).is_dir():
        raise UserError(f"--check {folder}: no such folder")
    if not (Path(folder) / "config.json").is_file():
        run = (Path(folder) / "checkpoints").is_dir() or (Path(folder) / "state.json").is_file()
        hint = f"; a training run or checkpoint: export it first (dflash-train export {folder} --out DIR)" if run else ""
        raise UserError(f"--check {folder}: no config.json, so not a drafter folder{hint}")
    try:
        config = json.loads((Path(folder) / "config.json").read_bytes())
    except (OSError, ValueError) as error:  # each rule would fail on it, none would say why
        raise UserError(f"--check {folder}: its config.json cannot be read as JSON ({type(error).__name__}: {error})") from None
    if not isinstance(config, dict):
        raise UserError(f"--check {folder}: its config.json holds {type(config).__name__}, not a JSON object")
    shape = None
    if target:
        try:
            shape = target_shape_from_config(json.loads((Path(target) / "config.json").read_text()))
        except (OSError, ValueError, KeyError) as error:
            raise UserError(f"--target {target}: not a Hugging Face model folder with a readable config.json "
                            f"({type(error).__name__}: {error})") from None
    verdicts = check_folder(folder, shape)
    print(render_verdicts(folder, verdicts))
    return 1 if failures(verdicts) else 0
