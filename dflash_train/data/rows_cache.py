"""Rendered training rows kept in the run folder (`rows.cache`), so a restarted or resumed run
reads them back instead of rendering every conversation again (137k rows took 29 s on 16 cores).

The file holds one rendering and the key it was made under: the data files' names and bytes,
the tokenizer (its fingerprint and chat template), the rendering settings, the source of the
code that renders and the versions of transformers and tokenizers. Any of them changing means a new rendering, which replaces the file; a file
that cannot be read is rendered again with a warning. So a cached row is always the row the
renderer would give now.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import tokenizers
import torch
import transformers

from ..files import file_sha256, write_file_atomic
from . import readers, render, samples
from .readers import RowStats
from .samples import TrainingSample, load_training_samples

CACHE_NAME = "rows.cache"
_FORMAT = 1


def rows_key(paths: Sequence[str | Path], tokenizer: Any, settings: dict[str, Any]) -> str:
    """What a rendering depends on, hashed: see the module doc."""
    digest = hashlib.sha256(f"rows cache {_FORMAT}".encode())
    for path in paths:
        digest.update(f"{path}\n".encode())  # a row's source names its file as given
        digest.update(file_sha256(path).encode())
    digest.update(render.tokenizer_fingerprint(tokenizer).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for module in (readers, render, samples):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(f"transformers {transformers.__version__} tokenizers {tokenizers.__version__}".encode())
    return digest.hexdigest()


def write_rows(path: Path, key: str, rows: list[TrainingSample], stats: RowStats) -> None:
    """The rendering under `key`, replacing whatever `path` held (atomically)."""
    record = {
        "key": key,
        "sample_ids": [row.sample_id for row in rows],
        "sources": [row.source for row in rows],
        "lengths": [len(row.input_ids) for row in rows],
        # int32 (every vocabulary fits): 5 bytes a token on disk with the mask, not 9.
        "input_ids": torch.cat([row.input_ids.int() for row in rows]) if rows else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([row.loss_mask for row in rows]) if rows else torch.zeros(0, dtype=torch.bool),
        "stats": {"read": stats.read, "skipped_by_reason": dict(stats.skipped_by_reason), "truncated": stats.truncated,
                  "first_example": dict(stats.first_example), "answers": dict(stats.answers)},
    }
    write_file_atomic(path, lambda handle: torch.save(record, handle))


def read_rows(path: Path, key: str) -> tuple[list[TrainingSample], RowStats] | None:
    """The rendering `path` holds if it was made under `key`; None if there is none, or another."""
    if not path.is_file():
        return None
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
        if record["key"] != key:
            return None
        ids = torch.split(record["input_ids"], record["lengths"])
        masks = torch.split(record["loss_mask"], record["lengths"])
        # Each row owns its memory, as a rendered one does: a view would carry the whole file's
        # tensor wherever a row is pickled.
        rows = [TrainingSample(sample_id, row_ids.long(), row_mask.clone(), source)
                for sample_id, source, row_ids, row_mask in zip(record["sample_ids"], record["sources"], ids, masks)]
        saved = record["stats"]
        stats = RowStats(read=saved["read"], skipped_by_reason=Counter(saved["skipped_by_reason"]),
                         truncated=saved["truncated"], first_example=dict(saved["first_example"]),
                         answers=Counter(saved["answers"]))
    except Exception as error:  # noqa: BLE001 - any unreadable file: render again (it is replaced)
        warnings.warn(f"{path}: the rendered rows could not be read back ({type(error).__name__}: {error}); "
                      "rendering them again", stacklevel=2)
        return None
    if len(rows) != len(record["lengths"]) or stats.used != len(rows):
        warnings.warn(f"{path}: the rendered rows are incomplete; rendering them again", stacklevel=2)
        return None
    return rows, stats


@dataclass
class Rendering:
    """Training rows and their counts, read back from a run folder or rendered under `key`."""

    rows: list[TrainingSample]
    stats: RowStats
    key: str
    read_back: bool

    def keep(self, folder: Path) -> None:
        """Store a fresh rendering in `folder` for the next start (call it once the run is
        under way: a run that fails before then leaves nothing behind)."""
        if not self.read_back and self.rows:
            write_rows(Path(folder) / CACHE_NAME, self.key, self.rows, self.stats)


def cached_training_samples(folder: Path, paths: Sequence[str | Path], tokenizer: Any, **settings: Any) -> Rendering:
    """`load_training_samples(paths, tokenizer, **settings)`, read back from `folder`'s
    `rows.cache` when it holds this rendering, else rendered (`Rendering.keep` stores it)."""
    key = rows_key(paths, tokenizer, settings)
    kept = read_rows(Path(folder) / CACHE_NAME, key)
    if kept is not None:
        return Rendering(kept[0], kept[1], key, read_back=True)
    rows, stats = load_training_samples(paths, tokenizer, **settings)
    return Rendering(rows, stats, key, read_back=False)
