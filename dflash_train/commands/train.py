"""`dflash-train train`: train one drafter (replicas) or several (variants) against a frozen target."""

from __future__ import annotations

from ..config import TrainConfig


def run_train(config: TrainConfig) -> int:
    from ..pipeline.trainer import train

    train(config)
    return 0
