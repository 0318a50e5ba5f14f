"""Conversation files → training samples (token ids + assistant-only loss mask).

A row becomes a sample only if, after truncation to `max_length`, it has at least one valid
anchor (a position p with loss_mask[p] and loss_mask[p + 1]: the drafter must be shown a token
the assistant wrote and asked for the next one) and at least `min_supervised_tokens` supervised
tokens. Every other row is counted in the returned RowStats with its reason.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch

from ..progress import Progress
from .readers import RowStats, read_conversations
from .render import RenderError, render_conversation

NO_VALID_ANCHOR = "no valid anchor"
# Reads shorter than this print no progress line.
_QUIET_SECONDS = 2.0


@dataclass(frozen=True)
class TrainingSample:
    sample_id: int  # the row's position among all rows read (0-based, across files, bad rows included): stable when filters change
    input_ids: torch.Tensor  # LongTensor [S]
    loss_mask: torch.Tensor  # BoolTensor [S], True on tokens the assistant wrote
    source: str  # file:line


def has_valid_anchor(loss_mask: Sequence[int]) -> bool:
    return any(loss_mask[p] and loss_mask[p + 1] for p in range(len(loss_mask) - 1))


def load_training_samples(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Any,
    *,
    max_length: int,
    min_supervised_tokens: int = 1,
    enable_thinking: bool | None = None,
    progress_stream: TextIO | None = None,
) -> tuple[list[TrainingSample], RowStats]:
    """Render every conversation of `paths` (in order) with `tokenizer`'s chat template."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one anchor and its next token), got {max_length}")
    too_few = f"fewer than {min_supervised_tokens} supervised tokens (after truncation to {max_length})"
    stats = RowStats()
    samples: list[TrainingSample] = []
    for path in paths:
        progress = Progress(0, f"rendering {Path(path).name}", stream=progress_stream or sys.stderr, every_seconds=10.0)
        progress.last_draw = progress.started  # first line after `every_seconds`, not on row 1: short reads stay quiet
        for conversation in read_conversations(path, stats):
            sample_id = stats.read - 1  # the reader has counted this row
            progress.update()
            try:
                rendered = render_conversation(tokenizer, conversation.messages, enable_thinking=enable_thinking, max_length=max_length)
            except RenderError as error:
                stats.skip("chat template error", f"{conversation.source}: {error}")
                continue
            if not has_valid_anchor(rendered.loss_mask):
                stats.skip(NO_VALID_ANCHOR, conversation.source)
            elif rendered.num_supervised < min_supervised_tokens:
                stats.skip(too_few, conversation.source)
            else:
                samples.append(
                    TrainingSample(
                        sample_id=sample_id,
                        input_ids=torch.tensor(rendered.input_ids, dtype=torch.long),
                        loss_mask=torch.tensor(rendered.loss_mask, dtype=torch.bool),
                        source=conversation.source,
                    )
                )
        if time.monotonic() - progress.started > _QUIET_SECONDS:
            progress.close()
    return samples, stats
