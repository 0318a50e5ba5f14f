"""The pipeline's warm-up ahead: the train stage's compiles done while the target regenerates.

With the regenerate stage, the pipeline starts `python -m dflash_train.train.warm_ahead` (its
own process: compiling and capturing beside another thread's CUDA graphs is what the training's
warm-up gate exists to prevent). It trains the recipe's [train] settings for one step on stand-in
rows in a scratch folder (at a lower CPU priority: the regeneration's host work goes first), and
so fills the compile caches the train stage's warm-up reads. Before
the train stage starts, the pipeline waits for it. Its output goes to WORK/warm-ahead.log; a
failure is reported in one line and the train stage compiles as it would have.

`--warm-ahead auto` runs it where it can only help: on a CUDA device (a CPU run's compiles
would take the cores regeneration uses), for a training that reads a live target (not a feature
cache) and has no compile cache of its own yet, and where the target's weights, held twice for a
few minutes, take at most 1/16 of the GPU's memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from ..config import TrainConfig
from ..progress import format_seconds

LOG_NAME = "warm-ahead.log"
CHOICES = ("auto", "on", "off")
MAX_TARGET_SHARE = 1 / 16  # of the GPU's memory, for the second copy of the target's weights
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def target_weight_bytes(target: str) -> int:
    """Bytes of the target's weight files (a GGUF target: of its converted folder)."""
    folder = Path(target)
    if folder.suffix == ".gguf":
        from ..target.gguf import hf_folder_from_gguf

        folder = hf_folder_from_gguf(folder)
    return sum(path.stat().st_size for path in folder.iterdir() if path.suffix in _WEIGHT_SUFFIXES and path.is_file())


def skip_reason(stages: list[str], choice: str, *, features_cached: bool, run_dir: Path, target: str,
                device: str) -> str | None:
    """Why the warm-up ahead does not run with this invocation's `stages` (the train stage's run
    folder `run_dir`, its target and device); None where it runs."""
    if choice == "off":
        return "--warm-ahead off"
    if "train" not in stages or "regenerate" not in stages:
        return "the train stage does not follow a regenerate stage in this run"
    if features_cached:
        return "the recipe trains from cached features"
    from ..train.compile_cache import CACHE_FILE

    if (run_dir / CACHE_FILE).is_file():
        return f"the run's own compile cache is there ({run_dir / CACHE_FILE})"
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return "a torchrun launch: each node warms up its own run"
    if choice == "on":
        return None
    from ..target.model import resolve_device

    resolved = resolve_device(device)
    if resolved.type != "cuda":
        return f"auto: {resolved} is not a CUDA device"
    import torch

    weights, memory = target_weight_bytes(target), torch.cuda.get_device_properties(resolved).total_memory
    if weights > memory * MAX_TARGET_SHARE:
        return (f"auto: the target's weights ({weights / 1e9:.1f} GB) would be held twice, over 1/16 of "
                f"{resolved}'s {memory / 1e9:.0f} GB")
    return None


class WarmAhead:
    """The warm-up ahead's process: `start`, then `finish` (waits) or `abandon` (stops it)."""

    def __init__(self, process: subprocess.Popen, scratch: Path, log_path: Path, log_file: TextIO, started: float):
        self.process, self.scratch, self.log_path, self._log, self.started = process, scratch, log_path, log_file, started

    @classmethod
    def start(cls, config: TrainConfig, log_path: Path) -> WarmAhead:
        """Start it for the train stage's settings `config`, its output in `log_path`."""
        from ..processes import child_environment

        target = config.model.target
        if target.endswith(".gguf"):  # converted here first: two processes converting one file would race
            from ..target.gguf import hf_folder_from_gguf

            hf_folder_from_gguf(target)
        scratch = Path(tempfile.mkdtemp(prefix="dflash-warm-ahead-"))
        settings = scratch / "settings.json"
        settings.write_text(json.dumps(config.flat_values()))
        log_file = open(log_path, "w", encoding="utf-8")
        try:
            process = subprocess.Popen([sys.executable, "-m", "dflash_train.train.warm_ahead", str(settings),
                                        str(scratch / "run")], stdout=log_file, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=child_environment(PYTHONUNBUFFERED="1"),
                                       start_new_session=True)
        except OSError:
            log_file.close()
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return cls(process, scratch, log_path, log_file, time.monotonic())

    def finish(self) -> str:
        """Wait for it to end; one line saying how it ended."""
        if self.process.poll() is None:
            print(f"[pipeline] waiting for the warm-up ahead to finish (running for "
                  f"{format_seconds(time.monotonic() - self.started)}; its log: {self.log_path})", flush=True)
        code = self.process.wait()
        spent = format_seconds(time.monotonic() - self.started)
        self._close()
        if code == 0:
            return f"warm-up ahead: done after {spent}; the train stage's warm-up reads its compile caches"
        last = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return (f"warm-up ahead: failed after {spent} (exit {code}: {last[0] if last else 'no output'}); the train "
                f"stage compiles as usual (log: {self.log_path})")

    def abandon(self) -> None:
        """Stop it (the pipeline ended early) and remove its scratch folder."""
        if self.process.poll() is None:
            self.process.terminate()  # its training saves nothing: a step it is in need not finish
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close()

    def _close(self) -> None:
        self._log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
