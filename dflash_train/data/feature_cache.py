"""Offline target features: run the target once, train many drafters from the files.

`write_feature_cache` renders the conversations (the same `load_training_samples` as training),
runs the target and stores, per sample, the concatenated hidden states of the captured layers
together with the sample's input_ids and loss_mask, so that training from the cache needs
neither the target's forward nor the chat template. `FeatureCache` reads it back, memory-mapped,
and `CachedFeatures` is the trainer's FeatureSource over it.

On-disk format (version 1), all little-endian:

    CACHE_DIR/cache.json         header: format, version, target, target dims, target_identity
                                 (the record `train --resume` and `eval --json` keep: config.json
                                 sha256, sampled weights fingerprint), layer_ids, dtype,
                                 width (= len(layer_ids) * hidden_size), rendering settings, data
                                 files, expected samples and tokens, rows accounting, complete
    CACHE_DIR/shard-00000.bin    records, one per sample, each starting at a 64-byte boundary:
                                     features  [length, width] in `dtype` (row-major)
                                     input_ids [length] int32
                                     loss_mask [length] uint8 (0/1)
    CACHE_DIR/shard-00000.json   the shard's index, written (atomically) only after the .bin is
                                 complete and fsync'ed: {"shard", "bytes", "samples": [{"id",
                                 "source", "length", "offset", "crc_features", "crc_tokens"}]}

`id` is the TrainingSample's sample_id (the row's position among all rows read), so anchors drawn
from a cache equal those drawn from live rendering. The checksums are zlib CRC-32 (~4 GB/s): of
the feature bytes, and of the input_ids + loss_mask bytes.

Completion and resume. A shard counts as written when its index exists and the .bin has the
size the index states; anything else (a .bin without index, a size mismatch, a temporary file) is
what an interrupted writer leaves and is deleted and rewritten. `complete: true` is set in the
header after the last shard. A restart with the same settings keeps every written shard whose
checksums verify (reading it whole: a shard damaged on disk is removed and rewritten, said in one
line) and whose samples still render to the stored tokens, and writes the rest; a restart on a
complete cache is how it is verified and repaired. Other settings are refused.

Verification on read: opening checks the header, the shard sizes and the token checksums of every
sample; a sample's feature checksum is checked the first time its features are read (a full scan
would read the whole cache before the first step). A mismatch raises FeatureCacheError naming
the shard and the sample.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import sys
import threading
import time
import zlib
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch

from ..config import DTYPE_NAMES, ConfigError
from ..files import fsync_dir as _fsync_dir
from ..files import write_json_atomic as _write_json
from ..progress import Progress, format_seconds
from ..target.model import check_target_layer_ids, default_dtype, identity_differences, target_identity
from .readers import RowStats
from .samples import TrainingSample, has_valid_anchor

FORMAT = "dflash-feature-cache"
VERSION = 1
ALIGN = 64
HEADER = "cache.json"
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the stored dtypes, by name
# The rendering and capture settings a resumed write must share with the first one.
_SETTINGS = ("target", "target_identity", "layer_ids", "dtype", "width", "max_seq_len", "min_supervised_tokens",
             "enable_thinking", "data", "token_ids", "answers")
# What a cache written before a setting was recorded had, in effect. A setting absent from an
# older header and not listed here (target_identity) is unknown, so not compared.
_UNRECORDED = {"token_ids": "auto", "answers": {}}
# Sorting samples by length inside windows of this many batches keeps padding low.
_WINDOW_BATCHES = 16
_MiB = 1 << 20


class FeatureCacheError(ConfigError):
    """A feature cache that cannot be used as asked (incomplete, other settings, corrupt)."""


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _record_bytes(length: int, width: int, element_size: int) -> tuple[int, int]:
    """(bytes of the record's features, bytes of the whole record before alignment padding)."""
    features = length * width * element_size
    return features, features + 5 * length


def _token_bytes(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> bytes:
    return input_ids.to(torch.int32).numpy().tobytes() + loss_mask.to(torch.uint8).numpy().tobytes()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def recorded_target_identity(path: str | Path | None) -> dict[str, str] | None:
    """What a cache records of the target at `path` (the --target given: a folder or a .gguf): its
    resolved path and its `target_identity`, the record `eval --json` keeps; None for a target
    that is not on disk (given in memory)."""
    if not path or not Path(path).exists():
        return None
    return {"path": str(Path(path).resolve()), **target_identity(path)}


def _identity_differences(before: dict[str, Any] | None, now: dict[str, Any] | None) -> str:
    """Which parts of two target identities differ, in words ("" when they are one target)."""
    return " and ".join("config.json" if name == "config_sha256" else "sampled weights"
                        for name in identity_differences(before, now))


def check_made_from(header: dict[str, Any], directory: str | Path, target: str | Path, flag: str = "--target") -> None:
    """A target other than the one a cache's features came from is refused: the same shape is not
    enough (a fine-tune, a base model and its instruct tune), the drafter would learn another
    model's features under this model's head. A cache made before the identity was recorded is not
    checked (`FeatureCache.identity_note` says so)."""
    recorded = header.get("target_identity")
    if not isinstance(recorded, dict):
        return
    what = _identity_differences(recorded, target_identity(target))
    if what:
        made_from = recorded.get("path") or header.get("target")
        raise FeatureCacheError(f"{flag} {target} is not the target the feature cache {directory} was made from "
                                f"({made_from}): their {what} differ; train with --target {made_from}, or make a cache "
                                "from this target with dflash-train cache-features")


def read_header(directory: str | Path) -> dict[str, Any]:
    """The header of a complete feature cache (what training reads before the target loads);
    FeatureCacheError naming what is missing, damaged or unfinished."""
    directory = Path(directory)
    header_path = directory / HEADER
    if not header_path.is_file():
        raise FeatureCacheError(f"{directory}: not a feature cache (no {HEADER}); make one with dflash-train cache-features")
    header = _read_json(header_path)
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise FeatureCacheError(f"{header_path}: format {header.get('format')} v{header.get('version')}, "
                                f"this version reads {FORMAT} v{VERSION}")
    if not header.get("complete"):
        raise FeatureCacheError(f"{directory}: the feature cache is incomplete (its writer was interrupted); "
                                "run the same dflash-train cache-features command again to finish it")
    return header


def _change(key: str, before: Any, now: Any) -> str:
    """One setting that differs between a cache on disk and this write, in words; "" if none."""
    if key == "target_identity":  # the model's files (its path is the `target` setting)
        what = _identity_differences(before, now)
        where = (before or {}).get("path"), (now or {}).get("path")
        return f"the target's {what}: {where[0]} before, {where[1]} now" if what else ""
    return f"{key}: {before!r} before, {now!r} now" if before != now else ""


def check_cache_folder(out: str | Path, settings: dict[str, Any]) -> None:
    """`out` can take a cache made with `settings`: it is new, empty, or holds a cache (complete or
    interrupted) made with the same settings. `settings` may hold only some of the header's keys:
    cache-features checks those it knows before the target loads, and all of them after."""
    out = Path(out)
    header_path = out / HEADER
    if header_path.is_file():
        before = _read_json(header_path, "restore it, or write the cache to another --out")
        changed = [_change(k, before.get(k, _UNRECORDED.get(k)), settings[k]) for k in _SETTINGS
                   if k in settings and (k in before or k in _UNRECORDED)]
        changed = [change for change in changed if change]
        if before.get("format") != FORMAT or before.get("version") != VERSION:
            changed.insert(0, f"format {before.get('format')} v{before.get('version')}")
        if changed:
            raise FeatureCacheError(
                f"{out} holds a feature cache made with other settings ({'; '.join(changed)}); "
                "use the same settings to resume it, or another --out"
            )
    elif out.is_dir() and any(out.iterdir()):
        raise FeatureCacheError(f"{out} is not empty and holds no feature cache ({HEADER}); choose an empty or new folder")


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class _ShardWriter:
    """Appends records to the current shard; closes it into a .bin + index when it is full."""

    def __init__(self, directory: Path, first_index: int, shard_bytes: int):
        self.directory = directory
        self.index = first_index
        self.shard_bytes = shard_bytes
        self.handle = None
        self.entries: list[dict] = []
        self.position = 0
        self.shards_written = 0
        self.bytes_written = 0

    def add(self, sample: TrainingSample, features: torch.Tensor) -> None:
        if self.handle is None:
            self.handle = open(self.directory / f"{_shard_name(self.index)}.bin", "wb")
            self.entries, self.position = [], 0
        feature_bytes = memoryview(features.contiguous().view(-1).view(torch.uint8).numpy())
        token_bytes = _token_bytes(sample.input_ids, sample.loss_mask)
        padding = -(len(feature_bytes) + len(token_bytes)) % ALIGN
        self.handle.write(feature_bytes)
        self.handle.write(token_bytes + b"\0" * padding)
        self.entries.append({
            "id": sample.sample_id, "source": sample.source, "length": len(sample.input_ids), "offset": self.position,
            "crc_features": zlib.crc32(feature_bytes), "crc_tokens": zlib.crc32(token_bytes),
        })
        size = len(feature_bytes) + len(token_bytes) + padding
        self.position += size
        self.bytes_written += size
        if self.position >= self.shard_bytes:
            self.close()

    def close(self) -> None:
        if self.handle is None:
            return
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.handle = None
        name = _shard_name(self.index)
        _write_json(self.directory / f"{name}.json", {"shard": f"{name}.bin", "bytes": self.position, "samples": self.entries})
        _fsync_dir(self.directory)
        self.index += 1
        self.shards_written += 1


def _shard_damage(data_file: Path, index: dict, width: int, element: int) -> str | None:
    """Why a written shard's bytes are not those its index recorded (the first sample whose
    checksum fails), or None: the whole shard is read, at about the disk's speed."""
    size = data_file.stat().st_size
    if size == 0:
        return "empty" if index["samples"] else None
    with open(data_file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for entry in index["samples"]:
                features, record = _record_bytes(entry["length"], width, element)
                start = entry["offset"]
                if start + record > size:
                    return f"sample {entry['id']} does not fit the shard"
                if zlib.crc32(view[start : start + features]) != entry["crc_features"]:
                    return f"sample {entry['id']}: feature checksum mismatch"
                if zlib.crc32(view[start + features : start + record]) != entry["crc_tokens"]:
                    return f"sample {entry['id']}: token checksum mismatch"
        finally:
            view.release()  # before the mapping closes
    return None


def _written_shards(directory: Path, log: TextIO, width: int, element: int) -> dict[int, dict]:
    """Complete shards whose checksums verify, by number; removes what an interrupted writer left
    and any shard damaged since it was written (its samples are written again)."""
    complete: dict[int, dict] = {}
    indexes = sorted(directory.glob("shard-*.json"))
    if indexes:
        held = sum(p.with_suffix(".bin").stat().st_size for p in indexes if p.with_suffix(".bin").is_file())
        print(f"{directory}: verifying the checksums of {len(indexes)} written shards ({_human(held)})", file=log)
    for index_file in indexes:
        number = int(index_file.stem.split("-")[1])
        data_file = index_file.with_suffix(".bin")
        try:
            index = json.loads(index_file.read_text())
        except json.JSONDecodeError:
            index = None
        try:
            fits = index is not None and data_file.is_file() and data_file.stat().st_size == index["bytes"]
            damage = _shard_damage(data_file, index, width, element) if fits else None
        except (KeyError, TypeError):  # an index without the fields a writer gives it
            fits, damage = False, None
        if fits and damage is None:
            complete[number] = index
        elif damage is not None:
            print(f"{directory}: {data_file.name} is damaged ({damage}); rewriting it", file=log)
            index_file.unlink()
            data_file.unlink()
        else:
            print(f"{directory}: {index_file.name} does not match its shard; rewriting it", file=log)
            index_file.unlink()
    for leftover in [*directory.glob("shard-*.bin"), *directory.glob("*.tmp")]:
        if leftover.suffix == ".tmp" or int(leftover.stem.split("-")[1]) not in complete:
            print(f"{directory}: removing {leftover.name} (left by an interrupted write)", file=log)
            leftover.unlink()
    return complete


@dataclass
class CacheWriteReport:
    directory: Path
    stats: RowStats
    samples_written: int = 0
    samples_kept: int = 0  # already in the cache from an earlier run
    tokens_written: int = 0
    bytes_written: int = 0
    shards_written: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.bytes_written / _MiB / self.seconds if self.seconds > 0 else 0.0
        tokens = self.tokens_written / self.seconds if self.seconds > 0 else 0.0
        lines = [
            "=" * 72,
            "cache-features summary",
            f"  cache       {self.directory} ({self.samples_written + self.samples_kept} samples)",
            f"  this run    {self.samples_written} samples, {self.tokens_written} tokens, {_human(self.bytes_written)} in "
            f"{self.shards_written} shards, {format_seconds(self.seconds)} ({self.seconds:.1f} s): "
            f"{rate:.1f} MiB/s, {tokens:.0f} tokens/s",
            f"  resumed     {self.samples_kept} samples were already written",
            "=" * 72,
            self.stats.summary(),
        ]
        return "\n".join(lines)


def write_feature_cache(
    target: Any,
    samples: Sequence[TrainingSample],
    stats: RowStats,
    out: str | Path,
    *,
    layer_ids: list[int],
    dtype: torch.dtype,
    batch_size: int = 8,
    shard_size_mb: float = 1024.0,
    settings: dict[str, Any] | None = None,
    log: TextIO | None = None,
    progress_stream: TextIO | None = None,
) -> CacheWriteReport:
    """Run `target` (a dflash_train Target) over `samples` and store their features in `out`.

    `stats` is the accounting of the rows the samples came from (stored in the header, printed
    by training). `settings` (max_seq_len, min_supervised_tokens, enable_thinking, data) describe
    how the samples were made; a resume must use the same. Prints a size estimate first.
    """
    log = log or sys.stdout
    out = Path(out)
    spec = target.spec
    check_target_layer_ids(layer_ids, spec.num_hidden_layers)
    if dtype not in DTYPES.values():
        raise FeatureCacheError(f"dtype {dtype}: use one of {', '.join(DTYPES)}")
    width = len(layer_ids) * spec.hidden_size
    settings = dict(settings or {})
    if "target_identity" not in settings:
        # What `train --features --target` compares its target with. cache-features passes the
        # identity of the --target the user named (a .gguf, where target.path is its converted
        # folder), taken before the target loaded: not fingerprinted twice.
        settings["target_identity"] = recorded_target_identity(target.path)
    header = {
        "format": FORMAT, "version": VERSION, "target": str(target.path),
        "target_spec": {"model_type": spec.model_type, "hidden_size": spec.hidden_size,
                        "num_hidden_layers": spec.num_hidden_layers, "vocab_size": spec.vocab_size},
        "layer_ids": list(layer_ids), "dtype": _dtype_name(dtype), "width": width,
        "max_seq_len": None, "min_supervised_tokens": None, "enable_thinking": None, "data": [],
        "token_ids": "auto", **settings,
        # How many answers were rendered from their generated token ids (and why others from text):
        # part of the key, since the same files render other tokens with the ids than without.
        "answers": dict(sorted(stats.answers.items())) if stats.answers_note() else {},
        "samples": len(samples), "tokens": sum(len(s.input_ids) for s in samples),
        "rows": {"read": stats.read, "skipped": dict(stats.skipped_by_reason), "first_example": dict(stats.first_example)},
        "complete": False,
    }
    out.mkdir(parents=True, exist_ok=True)
    header_path = out / HEADER
    check_cache_folder(out, header)
    element = torch.empty((), dtype=dtype).element_size()
    written = _written_shards(out, log, width, element)
    by_id = {s.sample_id: s for s in samples}
    kept: set[int] = set()
    for number, index in written.items():
        for entry in index["samples"]:
            sample = by_id.get(entry["id"])
            if sample is None or zlib.crc32(_token_bytes(sample.input_ids, sample.loss_mask)) != entry["crc_tokens"]:
                raise FeatureCacheError(
                    f"{out}/{_shard_name(number)}.bin holds sample {entry['id']} ({entry['source']}), which the data no "
                    "longer renders to the same tokens: the data or tokenizer changed; write to another --out"
                )
            kept.add(entry["id"])
    todo = [s for s in samples if s.sample_id not in kept]

    # The size estimate, before any work.
    per_token = width * element + 5
    total_tokens = header["tokens"]
    remaining_tokens = sum(len(s.input_ids) for s in todo)
    shard_bytes = max(1, int(shard_size_mb * _MiB))
    free = shutil.disk_usage(out).free
    print(
        f"size estimate: {len(samples)} samples, {total_tokens} tokens x {per_token} bytes/token "
        f"({len(layer_ids)} layers x {spec.hidden_size} hidden x {element} bytes {_dtype_name(dtype)} + 5 token bytes) "
        f"= {_human(total_tokens * per_token)}; to write now: {len(todo)} samples, {_human(remaining_tokens * per_token)} "
        f"in ~{max(1, -(-remaining_tokens * per_token // shard_bytes)) if todo else 0} shards of {shard_size_mb:g} MiB; "
        f"free disk {_human(free)}",
        file=log,
    )
    if remaining_tokens * per_token > free:
        raise FeatureCacheError(
            f"not enough disk space in {out}: the cache needs {_human(remaining_tokens * per_token)} more, "
            f"{_human(free)} is free (fewer --target-layer-ids, --dtype bfloat16 or a shorter --max-seq-len make it smaller)"
        )
    if kept:
        print(f"resuming {out}: {len(kept)} samples in {len(written)} shards already written", file=log)
    _write_json(header_path, header)

    report = CacheWriteReport(out, stats, samples_kept=len(kept))
    writer = _ShardWriter(out, max(written, default=-1) + 1, shard_bytes)
    progress = Progress(len(todo), "cache-features", stream=progress_stream or sys.stderr)
    progress.last_draw = progress.started  # the first line after `every_seconds`: short runs print one line
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    started = time.monotonic()
    pending: deque[Future] = deque()
    # Disk writes and checksums overlap the next batch's forward (one writer thread).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-writer") as pool:
        try:
            for batch in _length_sorted_batches(todo, batch_size):
                width_tokens = max(len(s.input_ids) for s in batch)
                input_ids = torch.full((len(batch), width_tokens), pad_id, dtype=torch.long)
                for i, sample in enumerate(batch):
                    input_ids[i, : len(sample.input_ids)] = sample.input_ids
                features = target.features(input_ids.to(target.device), layer_ids).to(dtype).cpu()
                rows = [(sample, features[i, : len(sample.input_ids)]) for i, sample in enumerate(batch)]
                while len(pending) >= 2:
                    pending.popleft().result()
                pending.append(pool.submit(_add_rows, writer, rows))
                report.samples_written += len(batch)
                report.tokens_written += sum(len(s.input_ids) for s in batch)
                elapsed = time.monotonic() - started
                progress.update(len(batch), note=f"{writer.bytes_written / _MiB / max(elapsed, 1e-9):.1f} MiB/s")
            while pending:
                pending.popleft().result()
            writer.close()
        finally:
            for future in pending:
                future.cancel()
    report.bytes_written = writer.bytes_written
    report.shards_written = writer.shards_written
    report.seconds = time.monotonic() - started
    progress.close()
    header["complete"] = True
    _write_json(header_path, header)
    return report


def _add_rows(writer: _ShardWriter, rows: list[tuple[TrainingSample, torch.Tensor]]) -> None:
    for sample, features in rows:
        writer.add(sample, features)


def _length_sorted_batches(samples: Sequence[TrainingSample], batch_size: int) -> list[list[TrainingSample]]:
    window = batch_size * _WINDOW_BATCHES
    batches = []
    for start in range(0, len(samples), window):
        chunk = sorted(samples[start : start + window], key=lambda s: len(s.input_ids))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    shard: int
    offset: int
    length: int
    crc_features: int
    source: str


def _read_json(path: Path, hint: str = "run the same cache-features command again to repair the cache") -> dict[str, Any]:
    """A cache's JSON file (header or shard index); FeatureCacheError naming it when damaged."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FeatureCacheError(f"{path}: damaged (not valid JSON: {error}); {hint}") from None
    if not isinstance(data, dict):
        raise FeatureCacheError(f"{path}: damaged (not a JSON object); {hint}")
    return data


class FeatureCache:
    """A complete feature cache, memory-mapped. Safe to read from several threads."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        header = read_header(self.directory)
        self.header = header
        self.target: str = header["target"]
        self.layer_ids: list[int] = list(header["layer_ids"])
        self.dtype: torch.dtype = DTYPES[header["dtype"]]
        self.width: int = header["width"]
        self.hidden_size: int = header["target_spec"]["hidden_size"]
        self.max_seq_len: int | None = header.get("max_seq_len")
        self._element = torch.empty((), dtype=self.dtype).element_size()
        self._maps: dict[int, mmap.mmap] = {}
        self._shard_paths: dict[int, Path] = {}
        self._entries: dict[int, _Entry] = {}
        self._verified: set[int] = set()
        self._lock = threading.Lock()
        self._samples: list[TrainingSample] = []
        for index_file in sorted(self.directory.glob("shard-*.json")):
            self._open_shard(index_file)
        if len(self._samples) != header["samples"]:
            raise FeatureCacheError(f"{self.directory}: the header promises {header['samples']} samples, "
                                    f"the shards hold {len(self._samples)}; a shard file is missing")
        self._samples.sort(key=lambda s: s.sample_id)
        self._by_id = {s.sample_id: s for s in self._samples}

    def _open_shard(self, index_file: Path) -> None:
        number = int(index_file.stem.split("-")[1])
        index = _read_json(index_file)
        if not {"shard", "bytes", "samples"} <= index.keys():
            raise FeatureCacheError(f"{index_file}: damaged (no shard, bytes and samples); delete it and its .bin "
                                    "and run cache-features again to rewrite that shard")
        path = self.directory / index["shard"]
        size = path.stat().st_size if path.is_file() else -1
        if size != index["bytes"]:
            raise FeatureCacheError(f"{path}: {size} bytes on disk, its index says {index['bytes']}: the shard is "
                                    f"truncated or replaced; delete {path.name} and {index_file.name} and run "
                                    "cache-features again to rewrite it")
        with open(path, "rb") as handle:
            # A private (copy-on-write) mapping is writable as far as torch.frombuffer is concerned,
            # and nothing is ever written to it, so the pages stay shared with the page cache.
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self._maps[number], self._shard_paths[number] = mapped, path
        for entry in index["samples"]:
            sample_id, length, offset = entry["id"], entry["length"], entry["offset"]
            feature_bytes, record = _record_bytes(length, self.width, self._element)
            where = f"{path.name}, sample {sample_id} ({entry['source']})"
            if sample_id in self._entries:
                raise FeatureCacheError(f"{self.directory}: sample {sample_id} is stored twice ({where})")
            if length < 1 or offset % ALIGN or offset + record > size:
                raise FeatureCacheError(f"{self.directory}: {where}: length {length} at offset {offset} does not fit "
                                        f"the shard of {size} bytes")
            tokens = memoryview(mapped)[offset + feature_bytes : offset + record]
            if zlib.crc32(tokens) != entry["crc_tokens"]:
                raise FeatureCacheError(f"{self.directory}: {where}: token checksum mismatch, the shard is corrupt; "
                                        "run the same dflash-train cache-features command again to rewrite it")
            input_ids = torch.frombuffer(mapped, dtype=torch.int32, count=length, offset=offset + feature_bytes).long()
            loss_mask = torch.frombuffer(mapped, dtype=torch.uint8, count=length, offset=offset + feature_bytes + 4 * length).bool()
            self._entries[sample_id] = _Entry(number, offset, length, entry["crc_features"], entry["source"])
            self._samples.append(TrainingSample(sample_id, input_ids, loss_mask, entry["source"]))

    def __len__(self) -> int:
        return len(self._samples)

    def samples(self) -> list[TrainingSample]:
        """Every cached sample, in sample_id order (input_ids, loss_mask as rendered when cached)."""
        return list(self._samples)

    def row_stats(self) -> RowStats:
        """The accounting of the rows the cache was made from."""
        rows = self.header["rows"]
        return RowStats(read=rows["read"], skipped_by_reason=Counter(rows["skipped"]), first_example=dict(rows["first_example"]),
                        answers=Counter(self.header.get("answers") or {}))

    def training_samples(self, max_length: int, min_supervised_tokens: int = 1) -> tuple[list[TrainingSample], RowStats]:
        """Samples truncated to `max_length` (features are causal: a prefix's features are a prefix
        of the features), filtered as load_training_samples filters; rows accounted from the data files."""
        stats = self.row_stats()
        too_few = f"fewer than {min_supervised_tokens} supervised tokens (after truncation to {max_length})"
        out = []
        for sample in self._samples:
            if len(sample.input_ids) > max_length:
                sample = TrainingSample(sample.sample_id, sample.input_ids[:max_length], sample.loss_mask[:max_length], sample.source)
            if not has_valid_anchor(sample.loss_mask.tolist()):
                stats.skip("no valid anchor", sample.source)
            elif int(sample.loss_mask.sum()) < min_supervised_tokens:
                stats.skip(too_few, sample.source)
            else:
                out.append(sample)
        return out, stats

    def features_of(self, sample_id: int) -> torch.Tensor:
        """The stored features of one sample, [length, width] in the cache dtype, a view of the
        mapped file (copy before writing to it); the checksum is checked on the first read."""
        entry = self._entries.get(sample_id)
        if entry is None:
            raise FeatureCacheError(f"{self.directory}: sample {sample_id} is not in the cache")
        mapped = self._maps[entry.shard]
        count = entry.length * self.width
        if sample_id not in self._verified:
            crc = zlib.crc32(memoryview(mapped)[entry.offset : entry.offset + count * self._element])
            if crc != entry.crc_features:
                path = self._shard_paths[entry.shard]
                raise FeatureCacheError(
                    f"{path}: sample {sample_id} ({entry.source}): feature checksum mismatch (stored {entry.crc_features:#010x}, "
                    f"read {crc:#010x}): the shard is corrupt; run the same dflash-train cache-features command again "
                    "to rewrite it (it verifies every shard)"
                )
            with self._lock:
                self._verified.add(sample_id)
        flat = torch.frombuffer(mapped, dtype=self.dtype, count=count, offset=entry.offset)
        return flat.view(entry.length, self.width)

    def input_ids_of(self, sample_id: int) -> torch.Tensor:
        return self._by_id[sample_id].input_ids

    def check_layers(self, layer_ids: Sequence[int]) -> None:
        missing = [k for k in layer_ids if k not in self.layer_ids]
        if missing:
            raise FeatureCacheError(
                f"the drafter needs target layers {list(layer_ids)} but the feature cache {self.directory} holds layers "
                f"{self.layer_ids} (missing {missing}); train with --target-layer-ids taken from the cache's layers, or "
                "rebuild the cache with dflash-train cache-features --target-layer-ids covering the drafter's"
            )

    def identity_note(self) -> str | None:
        """A line for a cache made before caches recorded their target's identity, whose target
        therefore cannot be compared with `train --target` (only its shape is)."""
        if isinstance(self.header.get("target_identity"), dict):
            return None
        return (f"features: the feature cache {self.directory} records no target identity (made by an older "
                "dflash-train, or from a target given in memory): only the target's shape is checked against it, not its weights")

    def check_target(self, target: Any) -> None:
        """The target used for embedding/head/tokenizer must be the one the features came from."""
        spec, cached = target.spec, self.header["target_spec"]
        mine = {"model_type": spec.model_type, "hidden_size": spec.hidden_size,
                "num_hidden_layers": spec.num_hidden_layers, "vocab_size": spec.vocab_size}
        if mine != cached:
            raise FeatureCacheError(f"the feature cache {self.directory} was made with target {self.target} {cached}, "
                                    f"the training target is {mine}: use the cache's target")

    def source(self, device: str | torch.device, layer_ids: Sequence[int], dtype: torch.dtype | None = None) -> "CachedFeatures":
        return CachedFeatures(self, torch.device(device), list(layer_ids), dtype)

    def close(self) -> None:
        for mapped in self._maps.values():
            if mapped is not None:
                try:
                    mapped.close()
                except BufferError:  # tensors still view it; the mapping goes with them
                    pass


class CachedFeatures:
    """FeatureSource reading a FeatureCache: `features(batch)` is [b, S, len(layer_ids) · hidden]
    on `device`, zero past each row's length, in `dtype` (default: what a live target there
    gives: bfloat16 on CUDA, float32 elsewhere)."""

    def __init__(self, cache: FeatureCache, device: torch.device, layer_ids: list[int], dtype: torch.dtype | None = None):
        cache.check_layers(layer_ids)
        self.cache = cache
        self.device = device
        self.layer_ids = layer_ids
        self.dtype = dtype or default_dtype(device)
        self.columns = None
        if layer_ids != cache.layer_ids:
            self.columns = torch.tensor([cache.layer_ids.index(k) for k in layer_ids])
        self.pin = device.type == "cuda" and torch.cuda.is_available()

    def features(self, batch: Any) -> torch.Tensor:
        rows, length = batch.input_ids.shape
        hidden = self.cache.hidden_size
        # A fresh pinned buffer per batch: the caching host allocator keeps it alive until the
        # asynchronous copy below has run, so reusing one buffer would race that copy.
        out = torch.zeros((rows, length, len(self.layer_ids) * hidden), dtype=self.cache.dtype, pin_memory=self.pin)
        for i, sample_id in enumerate(batch.sample_ids):
            size = int(batch.lengths[i])
            stored = self.cache.features_of(sample_id)
            cached_ids = self.cache.input_ids_of(sample_id)
            if size > stored.shape[0] or not torch.equal(cached_ids[:size], batch.input_ids[i, :size]):
                raise FeatureCacheError(
                    f"sample {sample_id}: its tokens differ from those in the feature cache {self.cache.directory} "
                    "(were the training samples made from other data than the cache?)"
                )
            stored = stored[:size]
            if self.columns is not None:
                stored = stored.view(size, -1, hidden).index_select(1, self.columns).flatten(1)
            out[i, :size] = stored
        if self.device.type == "cuda":
            return out.to(self.device, non_blocking=True).to(self.dtype)
        return out.to(self.dtype)
