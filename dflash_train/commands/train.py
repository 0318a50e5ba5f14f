"""`dflash-train train`: train one drafter (replicas) or several (variants) against a frozen target."""

from __future__ import annotations

import signal

from ..config import TrainConfig


def run_train(config: TrainConfig) -> int:
    """0 when the run finished; 128 + the signal's number (130 Ctrl-C, 143 SIGTERM) when a
    signal stopped it after its checkpoint was saved, so `train && next` does not run `next`."""
    from ..train.trainer import train

    summary = train(config)
    return exit_code(summary)


def exit_code(summary: dict) -> int:
    interrupted = summary.get("interrupted_by")
    return 128 + signal.Signals[interrupted].value if interrupted else 0
