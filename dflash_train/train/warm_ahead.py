"""Warm a training run's compile caches before its data exists, in a process of its own.

A run's warm-up (train/startup.py) compiles the target's feature forward and the drafter's step
and captures their CUDA graphs: about a minute for the SmolLM2 recipe, during which nothing
trains. None of it depends on the data, only on the run's shapes (its length buckets, batch size,
anchors, drafter and target). So `dflash-train pipeline` starts this process while the target is
still regenerating the answers (its GPU busy, its host mostly waiting): it trains the run's
settings for one step on stand-in rows of those shapes, into a scratch folder, and exits. What it
compiled is left in inductor's local caches (FX graphs, AOTAutograd, Triton kernels) and in the
scratch folder's `compile_cache.bin`, and the train stage's own warm-up then loads instead of
compiling (the SmolLM2 recipe on an H100: 4.3 s, where this process's cold warm-up took 32.0 s).

    python -m dflash_train.train.warm_ahead SETTINGS.json SCRATCH_DIR

SETTINGS.json holds the run's `TrainConfig.flat_values()`. Nothing it writes is a result: the
caller deletes SCRATCH_DIR, and a failure here only means the train stage compiles as usual.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..config import TrainConfig
from ..data.samples import TrainingSample
from ..target.model import declared_config, positive_size
from .trainer import train

# Stand-in rows: this many micro-batches' worth (a step of several replicas or nodes takes one
# micro-batch each; fewer rows than a step needs would only repeat them).
MICRO_BATCHES = 8


def warm_up_settings(config: TrainConfig, scratch: str | Path) -> TrainConfig:
    """The run's settings as the warm-up ahead trains them: the same shapes, models and compile
    choices, into `scratch`, with nothing that reads data or writes results (no data files, no
    feature cache, no in-training eval, no export, no TensorBoard)."""
    return config.replace(data=[], features="", out=str(scratch), resume=False, eval_every=0, export_dtype="",
                          tensorboard="off")


def stand_in_samples(config: TrainConfig, vocab_size: int) -> list[TrainingSample]:
    """Rows of the run's longest length, each with its second half supervised (at least
    --min-supervised-tokens of it), with token ids spread over the target's vocabulary."""
    length = config.data.max_seq_len
    supervised = min(length - 1, max(length // 2, config.data.min_supervised_tokens))
    count = config.optimizer.batch_size * MICRO_BATCHES
    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(count):
        ids = torch.randint(0, vocab_size, (length,), generator=generator)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length - supervised:] = True
        samples.append(TrainingSample(sample_id=index, input_ids=ids, loss_mask=mask, source=f"stand-in:{index + 1}"))
    return samples


def warm_caches(config: TrainConfig, scratch: str | Path) -> dict:
    """Train the run's settings for one step on stand-in rows in `scratch`: every compile and
    capture of its warm-up, left in the compile caches. The run's summary."""
    settings = warm_up_settings(config, scratch)
    vocab_size = positive_size(declared_config(config.model.target), "vocab_size")
    if vocab_size is None:
        raise ValueError(f"{config.model.target}: no vocab_size declared")
    return train(settings, samples=stand_in_samples(settings, vocab_size), stop_at=1, save_checkpoints=False)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m dflash_train.train.warm_ahead SETTINGS.json SCRATCH_DIR", file=sys.stderr)
        return 2
    settings, scratch = argv
    started = time.monotonic()
    with contextlib.suppress(OSError):  # the host's cores go to the regeneration beside it first
        os.nice(10)
    config = TrainConfig(**json.loads(Path(settings).read_text()))
    summary = warm_caches(config, scratch)
    startup = summary.get("startup") or {}
    warmup = startup.get("warmup_s")
    print(f"warm-up ahead: done in {time.monotonic() - started:.1f}s"
          + (f" (the warm-up itself {warmup:.1f}s)" if warmup is not None else " (nothing to compile or capture)"),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
