"""Atomic checkpoints: a checkpoint folder appears complete or not at all.

Layout of a drafter's run folder:
    run.json                       the run's config and the drafter config
    metrics.jsonl                  one JSON line per logged step
    checkpoints/step-00001000/     drafter.safetensors, trainer.pt, state.json
    checkpoints/latest             name of the newest complete checkpoint
Each checkpoint is written into a hidden temporary folder and renamed into place, then
`latest` is replaced atomically, so a crash at any moment leaves the previous checkpoint
usable and `--resume` never sees a half-written one.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .drafter import DFlashDrafter, DrafterConfig
from .files import write_dir_atomically, write_text_atomic

STATE_FILE = "state.json"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    checkpoints = Path(run_dir) / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    final = checkpoints / f"step-{step:08d}"

    def build(staging: Path) -> None:
        weights = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
        save_file(weights, str(staging / "drafter.safetensors"))
        trainer_state = {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        torch.save(trainer_state, staging / "trainer.pt")
        full_state = {"step": step, "time": time.time(), "drafter_config": drafter.config.to_dict(), **state}
        # state.json last: its presence inside the folder marks the payload as complete.
        (staging / STATE_FILE).write_text(json.dumps(full_state, indent=2))

    write_dir_atomically(final, build)
    write_text_atomic(checkpoints / "latest", final.name + "\n")
    _prune(checkpoints, keep, final)
    return final


def _complete_checkpoints(checkpoints: Path) -> list[Path]:
    return sorted(
        p for p in checkpoints.glob("step-*") if p.is_dir() and (p / STATE_FILE).is_file()
    )


def _prune(checkpoints: Path, keep: int, newest: Path) -> None:
    complete = _complete_checkpoints(checkpoints)
    for old in complete[: max(0, len(complete) - max(1, keep))]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names, else the highest complete step."""
    checkpoints = Path(run_dir) / "checkpoints"
    pointer = checkpoints / "latest"
    if pointer.is_file():
        named = checkpoints / pointer.read_text().strip()
        if (named / STATE_FILE).is_file():
            return named
    complete = _complete_checkpoints(checkpoints) if checkpoints.is_dir() else []
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder or a checkpoint folder -> the checkpoint folder."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint (expected {path}/checkpoints/step-*/{STATE_FILE})")
    return found


def read_state(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def load_drafter(checkpoint: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    checkpoint = resolve_checkpoint(checkpoint)
    config = DrafterConfig.from_dict(read_state(checkpoint)["drafter_config"])
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(load_file(str(checkpoint / "drafter.safetensors")))
    return drafter.to(device)


def restore_trainer(checkpoint: str | Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    state = torch.load(Path(checkpoint) / "trainer.pt", map_location="cpu", weights_only=False)
    if state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
