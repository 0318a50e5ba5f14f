"""A logging sink that writes a run's step and pipeline records as TensorBoard scalars.

Same records as metrics.jsonl / pipeline.jsonl, same folder: OUT/tensorboard (variants:
OUT/<name>/tensorboard for each drafter's steps, OUT/tensorboard for the pipeline). Watch with
`tensorboard --logdir OUT`. Needs the `tensorboard` package (torch.utils.tensorboard writes
through it); `train --tensorboard auto` uses it where it is installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..config import ConfigError

SUBDIR = "tensorboard"

# Step-record keys written as train/<key>: the step line's numbers.
STEP_SCALARS = ("loss", "accuracy", "tau_sim", "lr", "grad_norm", "step_s", "compute_s", "wait_s", "skipped")
# In-training evaluation (real tau by speculative decoding), present on eval steps only.
EVAL_SCALARS = {"tau_real": "eval/tau_real", "tau_real_pooled": "eval/tau_real_pooled"}


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def tensorboard_enabled(setting: str) -> bool:
    """auto: on where the package is installed; on: required (an error names the install)."""
    if setting == "off":
        return False
    if setting == "on" and not tensorboard_available():
        raise ConfigError("--tensorboard on: the tensorboard package is not installed (pip install tensorboard), "
                          "or pass --tensorboard off")
    return setting == "on" or tensorboard_available()


class TensorBoardSink:
    """write_step(record) / write_pipeline(record) / close(), the interface of the run's sinks."""

    def __init__(self, run_dir: str | Path, flush_secs: int = 10):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / SUBDIR
        self.writer = SummaryWriter(str(self.log_dir), flush_secs=flush_secs)

    def write_step(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key in STEP_SCALARS:
            if record.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", float(record[key]), step)
        if record.get("step_s"):
            self.writer.add_scalar("train/samples_per_s", record["samples"] / record["step_s"], step)
            self.writer.add_scalar("train/tokens_per_s", record["tokens"] / record["step_s"], step)
        # Block position k (1..B-1) predicts the token k after the anchor.
        for k, accuracy in enumerate(record.get("position_accuracy") or (), start=1):
            self.writer.add_scalar(f"position_accuracy/k{k:02d}", float(accuracy), step)
        for key, tag in EVAL_SCALARS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, float(record[key]), step)

    def write_pipeline(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self.writer.add_scalar("pipeline/mean_queue_depth", float(record["mean_queue_depth"]), step)
        for name, worker in record.get("workers", {}).items():
            self.writer.add_scalar(f"pipeline/busy/{name}", float(worker["busy"]), step)

    def close(self) -> None:
        self.writer.close()


def open_sinks(setting: str, out: Path, run_dirs: dict[str, Path]) -> tuple[dict[str, TensorBoardSink], TensorBoardSink | None]:
    """One sink per drafter's run folder for its steps, and the one of OUT for the pipeline (the
    same sink when a run has one drafter in OUT). ({}, None) when TensorBoard is off."""
    if not tensorboard_enabled(setting):
        return {}, None
    by_folder: dict[Path, TensorBoardSink] = {}
    for folder in [out, *run_dirs.values()]:
        if Path(folder) not in by_folder:
            by_folder[Path(folder)] = TensorBoardSink(folder)
    return {name: by_folder[Path(folder)] for name, folder in run_dirs.items()}, by_folder[Path(out)]


def close_sinks(steps: dict[str, TensorBoardSink], pipeline: TensorBoardSink | None) -> None:
    for sink in {id(s): s for s in [*steps.values(), *([pipeline] if pipeline else [])]}.values():
        sink.close()
