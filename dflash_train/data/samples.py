"""Conversation files → training samples (token ids + assistant-only loss mask).

A row becomes a sample only if, after truncation to `max_length`, it has at least one valid
anchor (a position p with loss_mask[p] and loss_mask[p + 1]: the drafter must be shown a token
the assistant wrote and asked for the next one) and at least `min_supervised_tokens` supervised
tokens. Every other row is counted in the returned RowStats with its reason.

A row that carries its answer's generated token ids (`regenerate` writes them) is rendered from
them when `token_ids` is "auto" and their tokenizer's fingerprint is the target tokenizer's
(render.py: the template around the answer, the answer's ids as generated); otherwise from its
text. `RowStats.answers` counts the used rows of each kind, and why text was used.
"""

from __future__ import annotations

import sys
import time
import warnings
from array import array
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple, Sequence, TextIO, Union

from ..config import TOKEN_IDS
from ..processes import WorkerError, default_workers, map_in_processes
from ..progress import Progress
from .readers import (FROM_TOKEN_IDS, MAX_CHARS_PER_TOKEN, WITHOUT_TOKEN_IDS, Conversation, DataError, RowStats,
                      conversation_of, conversation_rows)
from .render import RenderError, render_conversation, tokenizer_fingerprint

if TYPE_CHECKING:
    import torch

# torch is imported where samples become tensors, not at the top: the worker processes that
# render rows import this module (for _RenderRule) and need only the tokenizer, and 16 of them
# importing torch at once is most of their start-up.

NO_VALID_ANCHOR = "no valid anchor"
# Reads shorter than this print no progress line.
_QUIET_SECONDS = 2.0
# Files with fewer rows render faster in this process than worker processes start (~3 s).
PARALLEL_MIN_ROWS = 8192
IDS_IGNORED = "token ids ignored (--token-ids ignore)"
OTHER_TOKENIZER = "token ids of another tokenizer"


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
    workers: int | None = None,
    parallel_min_rows: int = PARALLEL_MIN_ROWS,
    token_ids: str = "auto",
) -> tuple[list[TrainingSample], RowStats]:
    """Render every conversation of `paths` (in order) with `tokenizer`'s chat template
    (`token_ids`: see the module doc).

    A file of `parallel_min_rows` rows or more is rendered by `workers` processes (None: one per
    core, at most processes.MAX_WORKERS; see dflash_train/processes.py). Same samples, order and stats either way;
    if the workers fail, the file is rendered here (with a warning)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one anchor and its next token), got {max_length}")
    if token_ids not in TOKEN_IDS:
        raise ValueError(f"token_ids must be one of {', '.join(TOKEN_IDS)}, got {token_ids!r}")
    import torch

    workers = default_workers() if workers is None else workers
    fingerprint = tokenizer_fingerprint(tokenizer) if token_ids == "auto" else None
    rule = _RenderRule(max_length, min_supervised_tokens, enable_thinking, fingerprint)
    stats = RowStats()
    samples: list[TrainingSample] = []
    for path in paths:
        progress = Progress(0, f"rendering {Path(path).name}", stream=progress_stream or sys.stderr, every_seconds=10.0)
        progress.last_draw = progress.started  # first line after `every_seconds`, not on row 1: short reads stay quiet
        rows = _read_rows(path, stats)
        progress.total = len(rows)
        outcomes: Iterable[Outcome] | None = None
        if workers > 1 and len(rows) >= parallel_min_rows:
            outcomes = _render_in_workers(tokenizer, str(path), rows, rule, workers, progress)
        if outcomes is None:
            outcomes = _render_here(tokenizer, str(path), rows, rule, progress)  # one row at a time
        for (sample_id, where, _), outcome in zip(rows, outcomes):
            if isinstance(outcome, Skipped):
                stats.skip(outcome.reason, outcome.example)
            else:
                input_ids, loss_mask, truncated, answer = outcome
                stats.truncated += truncated
                stats.answers[answer] += 1
                samples.append(
                    TrainingSample(
                        sample_id=sample_id,
                        # the tensors keep the compact buffers (a valid anchor means >= 2 tokens)
                        input_ids=torch.frombuffer(input_ids, dtype=torch.long),
                        loss_mask=torch.frombuffer(loss_mask, dtype=torch.bool),
                        source=where,
                    )
                )
        if time.monotonic() - progress.started > _QUIET_SECONDS:
            progress.close()
    return samples, stats


class Skipped(NamedTuple):
    """Why a row is not a sample, and the example RowStats keeps for that reason."""

    reason: str
    example: str


# (input_ids, loss_mask, whether the row was longer than max_length, where the answer's tokens came
# from) of a sample, compact (8 + 1 bytes a token: a worker's share of 100k rows waits whole in
# memory), or why not.
Outcome = Union[tuple[array, bytearray, bool, str], Skipped]


@dataclass(frozen=True)
class _RenderRule:
    """What makes a conversation a training sample; picklable, so worker processes apply the same rule."""

    max_length: int
    min_supervised_tokens: int
    enable_thinking: bool | None
    fingerprint: str | None  # the tokenizer's, whose answer ids are used; None: ids are ignored

    def render(self, tokenizer: Any, path: str, row: tuple[str, Any]) -> Outcome:
        """The outcome of one row `conversation_rows` read from `path` (parsed here: in a worker
        process, the parsing is spread over the workers too)."""
        where, content = row
        if isinstance(content, Skipped):  # a row the reader could not parse at all (a bad Parquet cell)
            return content
        try:
            conversation = conversation_of(content, where, path)
        except DataError as error:
            return Skipped(error.reason, str(error))
        return self._render_conversation(tokenizer, conversation)

    def _render_conversation(self, tokenizer: Any, conversation: Conversation) -> Outcome:
        answer_ids, answer = None, WITHOUT_TOKEN_IDS
        if conversation.answer_ids is not None:
            if self.fingerprint is None:
                answer = IDS_IGNORED
            elif conversation.tokenizer_fingerprint != self.fingerprint:
                answer = OTHER_TOKENIZER
            else:
                answer_ids = conversation.answer_ids
        # Tokens past max_length are dropped, so text past max_length tokens' worth of characters
        # is never tokenized: a 50 MB row costs what its first characters cost (a cut answer no
        # longer matches its ids, and renders from the text).
        keep = self.max_length * MAX_CHARS_PER_TOKEN
        messages = [{**m, "content": m["content"][:keep]} for m in conversation.messages]
        cut = any(len(m["content"]) > keep for m in conversation.messages)
        try:
            rendered = render_conversation(tokenizer, messages, enable_thinking=self.enable_thinking,
                                           answer_ids=answer_ids)
        except RenderError as error:
            return Skipped("chat template error", f"{conversation.source}: {error}")
        truncated = cut or len(rendered.input_ids) > self.max_length
        rendered = dataclasses.replace(rendered, input_ids=rendered.input_ids[: self.max_length],
                                       loss_mask=rendered.loss_mask[: self.max_length])
        if not has_valid_anchor(rendered.loss_mask):
            return Skipped(NO_VALID_ANCHOR, conversation.source)
        if rendered.num_supervised < self.min_supervised_tokens:
            return Skipped(f"fewer than {self.min_supervised_tokens} supervised tokens (after truncation to "
                           f"{self.max_length})", conversation.source)
        if answer_ids is not None:
            answer = FROM_TOKEN_IDS if rendered.from_ids else rendered.text_because
        return array("q", rendered.input_ids), bytearray(rendered.loss_mask), truncated, answer


# A row as read: (sample_id, location, the row unparsed or as a reader gave it).
ReadRow = tuple[int, str, Any]


def _read_rows(path: str | Path, stats: RowStats) -> list[ReadRow]:
    """Every row of `path` as read (counted in `stats.read`), to be parsed where it is rendered;
    one the reader already found bad (`DataError`) stands as its Skipped outcome."""
    rows = []
    for where, row in conversation_rows(path, stats):
        if isinstance(row, DataError):
            row = Skipped(row.reason, str(row))
        rows.append((stats.read - 1, where, row))  # the reader has counted this row
    return rows


def _render_here(tokenizer: Any, path: str, rows: list[ReadRow], rule: _RenderRule,
                 progress: Progress) -> Iterator[Outcome]:
    for _, where, row in rows:
        yield rule.render(tokenizer, path, (where, row))
        progress.update()


def _render_in_workers(tokenizer: Any, path: str, rows: list[ReadRow], rule: _RenderRule, workers: int,
                       progress: Progress) -> list[Outcome] | None:
    """Outcomes of `rows` in order, parsed and rendered by worker processes; None (with a
    warning) if they failed."""
    progress.print(f"rendering {len(rows)} rows in {workers} worker processes")
    try:
        outcomes = map_in_processes(rule.render, [(where, row) for _, where, row in rows], workers,
                                    fixed=(tokenizer, path))
    except WorkerError as error:
        warnings.warn(f"rendering in worker processes failed ({error}); rendering in this process", stacklevel=3)
        return None
    progress.update(len(rows))
    return outcomes
