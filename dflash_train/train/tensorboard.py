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
    """A run's Sink (see reporting.Sink): one event-file writer per folder, each drafter's steps
    in its run folder, the pipeline's records in OUT (the same writer when they coincide)."""

    def __init__(self, out: str | Path, run_dirs: dict[str, Path], flush_secs: int = 10):
        from torch.utils.tensorboard import SummaryWriter

        writers: dict[Path, Any] = {}
        for folder in [Path(out), *map(Path, run_dirs.values())]:
            if folder not in writers:
                writers[folder] = SummaryWriter(str(folder / SUBDIR), flush_secs=flush_secs)
        self._writers = list(writers.values())
        self._steps = {name: writers[Path(folder)] for name, folder in run_dirs.items()}
        self._pipeline = writers[Path(out)]

    def write_step(self, drafter: str, record: dict[str, Any]) -> None:
        writer, step = self._steps[drafter], int(record["step"])
        for key in STEP_SCALARS:
            if record.get(key) is not None:
                writer.add_scalar(f"train/{key}", float(record[key]), step)
        if record.get("step_s"):
            writer.add_scalar("train/samples_per_s", record["samples"] / record["step_s"], step)
            writer.add_scalar("train/tokens_per_s", record["tokens"] / record["step_s"], step)
        # Block position k (1..B-1) predicts the token k after the anchor.
        for k, accuracy in enumerate(record.get("position_accuracy") or (), start=1):
            writer.add_scalar(f"position_accuracy/k{k:02d}", float(accuracy), step)
        for key, tag in EVAL_SCALARS.items():
            if record.get(key) is not None:
                writer.add_scalar(tag, float(record[key]), step)

    def write_pipeline(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self._pipeline.add_scalar("pipeline/mean_queue_depth", float(record["mean_queue_depth"]), step)
        for name, worker in record.get("workers", {}).items():
            self._pipeline.add_scalar(f"pipeline/busy/{name}", float(worker["busy"]), step)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
