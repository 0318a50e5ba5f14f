"""Export a trained drafter as the Hugging Face folder that the reference and serving engines load.

config.json carries `architectures: ["DFlashDraftModel"]` (DFlash2: `["DFlash2DraftModel"]`, with
`conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k` in dflash_config), the drafter dims, `block_size`,
`num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids, block_size,
num_target_layers}`; weights are safetensors named `layers.*`, `fc.weight`,
`hidden_norm.weight`, `norm.weight` (DFlash2 adds `layers.*.{attention,mlp}_conv.*` and
`candidate_selector.*`) — no embedding and no LM head (they stay the target's).
Serving engines skip unknown weight names and fill missing keys with their own defaults, so the
staged folder is checked against every rule of `export.rules.RULES` before it takes its name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors.torch import save_file

from ..config import UserError
from ..errors import named_by_flag
from ..core.drafter import DFlashDrafter, DrafterConfig
from ..files import hold_output, recover_interrupted_write, write_dir_atomically
from .rules import DFLASH2_KEYS, TargetShape, architecture_name, check_folder, expected_weight_names, failures

__all__ = ["ExportError", "check_export_target", "expected_weight_names", "export_drafter", "export_model",
           "hf_config", "load_exported_drafter"]

# Written into every export: which run it came from, so a later export of the same run may
# replace it while any other non-empty folder is refused (see check_export_target).
PROVENANCE_FILE = "export.json"

class ExportError(UserError, ValueError):
    pass


def hf_config(config: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    rope = dict(config.rope_parameters)
    # Every key both in dflash_config and at the top level: SGLang and the reference read
    # dflash_config first, older readers only the top level (export/rules.py).
    dflash_config: dict[str, Any] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
    }
    if config.input_embedding_scale != 1.0:
        dflash_config["input_embedding_scale"] = config.input_embedding_scale
    if config.final_logit_softcapping:
        dflash_config["final_logit_softcapping"] = config.final_logit_softcapping
    architecture = architecture_name(config.arch)
    if config.arch == "dflash2":
        dflash_config.update({key: getattr(config, key) for key in DFLASH2_KEYS})
    legacy_scaling = None if rope.get("rope_type", "default") == "default" else {
        k: v for k, v in rope.items() if k != "rope_theta"
    }
    return {
        "architectures": [architecture],
        "auto_map": {"AutoModel": f"dflash.{architecture}"},
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": dflash_config,
    }


def check_export_target(
    out_dir: str | Path, run_dir: str | Path | None, *, source: str | Path | None = None, force: bool = False
) -> None:
    """Refuse an `--out` whose contents an export would destroy.

    Never (not even with `force`): a file, a folder holding `source` (the checkpoint being
    exported: its run folder, `checkpoints/`, the current directory above them), a folder
    holding the current directory (replacing it would leave the shell in a deleted folder).
    Without `force`: any non-empty folder that is not an earlier export of the same run."""
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out_dir}: is a file, not a folder")
    if source is not None:
        held = Path(source).resolve()
        if out == held or out in held.parents:
            raise ExportError(f"--out {out_dir}: holds the checkpoint {source} being exported, which would be "
                              "replaced; choose a new folder")
    try:
        here = Path.cwd().resolve()
    except OSError:  # the current folder was deleted: nothing to protect
        here = None
    if here is not None and (out == here or out in here.parents):
        raise ExportError(f"--out {out_dir}: holds the current folder, which the export would replace; "
                          "name a new folder (e.g. --out exp) or run the command from elsewhere")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if run_dir is not None and _exported_run(out) == str(Path(run_dir).resolve()):
        return
    if force:
        return
    what = "an export of another run" if _exported_run(out) else "not an export of this run"
    raise ExportError(f"--out {out_dir}: the folder is not empty and is {what}; nothing was written. "
                      "Choose a new or empty folder, or pass --force to replace it")


def _exported_run(folder: Path) -> str | None:
    try:
        return json.loads((folder / PROVENANCE_FILE).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def export_drafter(
    drafter_config: DrafterConfig,
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    extra_files: dict[str, str] | None = None,
    run_dir: str | Path | None = None,
    source: str | Path | None = None,
    force: bool = False,
    log: TextIO | None = None,
) -> Path:
    """Write the HF folder atomically (staging folder, fsync, rename; an old export is renamed
    aside, not deleted, until the new one is in place). `run_dir` is recorded as the export's
    provenance; `check_export_target` decides (with `source` and `force`) whether `out_dir` may
    be replaced. One live process exports to `out_dir` at a time; what an export killed midway
    left beside it is cleaned first (an old folder it had hidden is put back, and so judged by
    `check_export_target` like any other), each said on `log`."""
    with hold_output(out_dir, "--out"):
        for line in recover_interrupted_write(Path(out_dir).resolve()):
            print(f"export: {line}", file=log or sys.stdout)
        check_export_target(out_dir, run_dir, source=source, force=force)
        # Resolved: `--out .` or `x/..` cannot be renamed by those names.
        _write_export(drafter_config, state_dict, Path(out_dir).resolve(), dtype=dtype, extra_files=extra_files,
                      run_dir=run_dir)
    return Path(out_dir)


def _write_export(
    drafter_config: DrafterConfig, state_dict: dict[str, torch.Tensor], out_dir: Path, *, dtype: torch.dtype,
    extra_files: dict[str, str] | None, run_dir: str | Path | None,
) -> Path:
    # The drafter's own target dims: the written folder is checked against what it was trained on.
    target = TargetShape(drafter_config.hidden_size, drafter_config.num_target_layers, drafter_config.vocab_size)

    def build(staging: Path) -> None:
        tensors = {name: state_dict[name].detach().to("cpu", dtype).contiguous() for name in sorted(state_dict)}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(hf_config(drafter_config, dtype), indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        provenance = {"run": str(Path(run_dir).resolve()) if run_dir is not None else None}
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")
        broken = failures(check_folder(staging, target))  # before the rename: a failure writes nothing
        if broken:
            rules = "; ".join(f"{v.rule.name}: {v.detail}" for v in broken)
            raise ExportError(f"the export breaks the serving engines' loader rules ({rules}); nothing was written")

    return write_dir_atomically(out_dir, build)


def export_model(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    *,
    run_dir: str | Path | None = None,
    source: str | Path | None = None,
    force: bool = False,
    log: TextIO | None = None,
) -> Path:
    return export_drafter(drafter.config, drafter.state_dict(), out_dir, dtype=dtype, run_dir=run_dir,
                          source=source, force=force, log=log)


def read_export_config(folder: Path, flag: str = "") -> dict[str, Any]:
    """config.json of a DFlash drafter export; ExportError for anything else (a target model's
    folder, a damaged file), naming `flag` when given."""
    config_path, where = folder / "config.json", named_by_flag(folder, flag)
    if not config_path.is_file():
        raise ExportError(f"{where}: no config.json; expected an exported DFlash drafter folder")
    try:
        raw = json.loads(config_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ExportError(f"{config_path}: expected a JSON object")
    if not isinstance(raw.get("dflash_config"), dict):
        architectures = raw.get("architectures") or []
        what = f"architectures {architectures}" if architectures else f"model_type {raw.get('model_type')!r}"
        raise ExportError(
            f"{where}: not a DFlash drafter (its config.json has {what} and no dflash_config; a target model's "
            "folder?); pass the folder `dflash-train export` wrote"
        )
    for weights in sorted(folder.glob("*.safetensors")):
        weights.open("rb").close()  # unreadable: the OS error names it now (safetensors calls it missing, and later)
    return raw


def read_drafter_config(folder: str | Path, flag: str = "") -> DrafterConfig:
    """The DrafterConfig of an exported HF folder, read without its weights; ExportError naming
    the file for a config a drafter cannot be made from."""
    folder = Path(folder)
    raw = read_export_config(folder, flag)
    try:
        return _drafter_config_from_hf(raw)
    except KeyError as error:
        raise ExportError(f"{folder / 'config.json'}: no {error.args[0]!r}, which a DFlash drafter config needs") from None
    except (TypeError, ValueError) as error:
        raise ExportError(f"{folder / 'config.json'}: {error}") from None


def load_exported_drafter(folder: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """Read back an exported HF folder (ours, or any DFlash drafter with the same layout)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_drafter_config(folder)
    drafter = DFlashDrafter(config)
    weights = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            weights.update(load_file(str(path)))
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
            raise ExportError(f"{path}: cannot be read as safetensors ({error})") from None
    expected = expected_weight_names(config.num_hidden_layers, dflash2=config.arch == "dflash2")
    unknown, missing = set(weights) - expected, expected - set(weights)
    if unknown:
        raise ExportError(f"{folder}: weights this drafter layout does not have: {sorted(unknown)[:5]}")
    if missing:
        raise ExportError(f"{folder}: weights missing from the export: {sorted(missing)[:5]}"
                          f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
    drafter.load_state_dict({k: v.float() for k, v in weights.items()})
    return drafter.to(device)


def _drafter_config_from_hf(raw: dict[str, Any]) -> DrafterConfig:
    dflash = raw["dflash_config"]
    rope = dict(raw.get("rope_parameters") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", (raw.get("rope_scaling") or {}).get("rope_type", "default"))
    if raw.get("rope_scaling"):
        rope.update({k: v for k, v in raw["rope_scaling"].items() if k != "type"})
    heads = raw["num_attention_heads"]
    return DrafterConfig(
        hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        vocab_size=raw["vocab_size"],
        rope_parameters=rope,
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        block_size=int(dflash.get("block_size", raw.get("block_size", 16))),
        target_layer_ids=list(dflash["target_layer_ids"]),
        num_target_layers=int(raw.get("num_target_layers", max(dflash["target_layer_ids"]) + 1)),
        mask_token_id=int(dflash["mask_token_id"]),
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        final_logit_softcapping=dflash.get("final_logit_softcapping"),
        **_dflash2_fields(raw),
    )


def _dflash2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """arch and DFlash2's sizes from a DFlash2 config (dflash_config first, then the top level)."""
    if "DFlash2DraftModel" not in (raw.get("architectures") or []):
        return {}
    dflash = raw["dflash_config"]
    return {"arch": "dflash2", **{key: int(dflash[key] if key in dflash else raw[key]) for key in DFLASH2_KEYS}}
