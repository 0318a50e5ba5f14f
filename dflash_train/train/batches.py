"""Host-side batch planning: deterministic, length-bucketed, static-shaped batches.

Step s of a run always gets the same batches, whatever the number of GPUs or nodes or a resume
in between: the order of epoch e is a function of (seed, e), a batch's position in the stream
is s × batches_per_step + j (batches_per_step counts every node's micro-batches), and anchors
come from (seed, sample id, epoch). Each batch is padded to the smallest bucket that holds its
longest row, so a compiled drafter sees one shape per bucket and compiles once per bucket.
`stream_identity` is what a checkpoint records of this, so a resume can refuse another stream.
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from ..config import TrainConfig
from ..core.objective import ObjectiveConfig, block_labels, draw_anchors
from ..errors import ConfigError


class Sample(Protocol):
    sample_id: int
    input_ids: torch.Tensor  # [S] long
    loss_mask: torch.Tensor  # [S] bool


def auto_buckets(max_seq_len: int, smallest: int = 128) -> list[int]:
    """Lengths 128, 192, 256, 384, 512, 768, ... (steps of ×1.5 / ×1.33) capped at max_seq_len:
    at most ~25% padding per row, and few enough shapes to compile each once."""
    buckets, size = [], smallest
    while size < max_seq_len:
        buckets.append(size)
        size = size * 3 // 2 if (size & (size - 1)) == 0 else size * 4 // 3
    buckets.append(max_seq_len)
    return buckets


def shape_buckets(config: TrainConfig) -> list[int]:
    """The sequence lengths a run pads its batches to: --seq-buckets, or the automatic ones."""
    return sorted(config.data.seq_buckets) if config.data.seq_buckets else auto_buckets(config.data.max_seq_len)


@dataclass
class HostBatch:
    """One micro-batch on the host, before the target runs."""

    step: int
    index: int  # position within this node's share of the step (replica × grad_accum + micro)
    epoch: int
    sample_ids: list[int]
    input_ids: torch.Tensor  # [b, S] padded to the bucket
    loss_mask: torch.Tensor  # [b, S] bool, False on padding
    lengths: torch.Tensor  # [b]
    anchors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # per objective
    normalizers: dict[str, float] = field(default_factory=dict)  # per objective, global over the step
    scored_rows: dict[str, int] = field(default_factory=dict)  # per objective: block slots with a label
    anchor_counts: dict[str, int] = field(default_factory=dict)  # per objective: valid anchor slots

    def pin(self) -> "HostBatch":
        # Pinned memory makes every host-to-device copy of the batch asynchronous: a copy from
        # pageable memory first waits for the stream's pending work.
        self.input_ids = self.input_ids.pin_memory()
        self.loss_mask = self.loss_mask.pin_memory()
        self.anchors = {key: (a.pin_memory(), v.pin_memory()) for key, (a, v) in self.anchors.items()}
        return self


class BatchPlanner:
    """Maps a step index to its micro-batches.

    `objectives` are keyed by drafter name (variants) or a single key (replicas); each gets
    its own anchors (its own N) and its own loss normaliser. The normaliser of a step sums
    over every micro-batch that trains the same drafter in that step, so planning one batch
    means planning the whole step: several target workers share each planned step (the last
    few are kept) instead of each drawing every anchor again. On several nodes each node plans
    every batch of the step (the normaliser is global) and keeps only its `share` of them.
    """

    keep_steps = 8

    def __init__(
        self,
        samples: Sequence[Sample],
        *,
        batch_size: int,
        batches_per_step: int,
        buckets: list[int],
        seed: int,
        objectives: dict[str, ObjectiveConfig],
        normalize_over_step: bool = True,
        pad_id: int = 0,
        group_factor: int = 32,
        pin_memory: bool = False,
        share: range | None = None,
    ):
        if len(samples) < batch_size:
            raise ConfigError(f"{len(samples)} usable samples is fewer than batch_size {batch_size}")
        self.samples = samples
        self.batch_size = batch_size
        self.batches_per_step = batches_per_step
        self.buckets = sorted(buckets)
        self.seed = seed
        self.objectives = objectives
        self.normalize_over_step = normalize_over_step
        self.pad_id = pad_id
        self.group_factor = group_factor
        self.pin_memory = pin_memory  # batches go to a GPU: pin them so their copies are asynchronous
        self.share = share if share is not None else range(batches_per_step)  # this node's batches of a step
        self.batches_per_epoch = len(samples) // batch_size  # the last partial batch is dropped
        self._epoch_cache: dict[int, list[list[int]]] = {}
        self._planned: OrderedDict[int, list[HostBatch]] = OrderedDict()
        self._lock = threading.Lock()
        longest = max(len(s.input_ids) for s in samples)
        if longest > self.buckets[-1]:
            raise ConfigError(f"a sample of {longest} tokens exceeds the largest bucket {self.buckets[-1]}: "
                              "add a bucket of at least that length to --seq-buckets (or lower --max-seq-len)")

    def epoch_order(self, epoch: int) -> list[list[int]]:
        """Batches of sample indices for one epoch: shuffle, group similar lengths, shuffle groups."""
        if epoch not in self._epoch_cache:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.samples), generator=generator).tolist()
            group = self.batch_size * self.group_factor
            batches = []
            for start in range(0, len(order) - len(order) % self.batch_size, group):
                chunk = order[start : start + group]
                chunk = chunk[: len(chunk) - len(chunk) % self.batch_size]
                chunk.sort(key=lambda i: len(self.samples[i].input_ids))
                batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
            shuffle = torch.randperm(len(batches), generator=generator).tolist()
            self._epoch_cache = {epoch: [batches[i] for i in shuffle]}  # keep one epoch in memory
        return self._epoch_cache[epoch]

    def bucket_for(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def step_batches(self, step: int) -> list[HostBatch]:
        """This node's micro-batches of the step; callers from several threads get the same
        objects (each target worker then uses only its own indices)."""
        with self._lock:
            if step not in self._planned:
                self._planned[step] = self._plan_step(step)
                while len(self._planned) > self.keep_steps:
                    self._planned.popitem(last=False)
            return self._planned[step]

    def _plan_step(self, step: int) -> list[HostBatch]:
        batches = [self._make_batch(step, j) for j in range(self.batches_per_step)]
        if self.normalize_over_step:
            for key in self.objectives:
                total = sum(b.normalizers[key] for b in batches)
                for b in batches:
                    b.normalizers[key] = total
        mine = batches[self.share.start : self.share.stop]
        for b in mine:
            b.index -= self.share.start
        return [b.pin() for b in mine] if self.pin_memory else mine

    def _make_batch(self, step: int, index: int) -> HostBatch:
        stream_position = step * self.batches_per_step + index
        epoch, position = divmod(stream_position, self.batches_per_epoch)
        rows = [self.samples[i] for i in self.epoch_order(epoch)[position]]
        length = self.bucket_for(max(len(r.input_ids) for r in rows))
        input_ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), length), dtype=torch.bool)
        for i, row in enumerate(rows):
            input_ids[i, : len(row.input_ids)] = row.input_ids
            loss_mask[i, : len(row.loss_mask)] = row.loss_mask
        batch = HostBatch(
            step=step, index=index, epoch=epoch, sample_ids=[r.sample_id for r in rows],
            input_ids=input_ids, loss_mask=loss_mask,
            lengths=torch.tensor([len(r.input_ids) for r in rows]),
        )
        for key, objective in self.objectives.items():
            drawn = [
                draw_anchors(row.loss_mask, objective.num_anchors, seed=self.seed, sample_id=row.sample_id, epoch=epoch)
                for row in rows
            ]
            anchors = torch.stack([a for a, _ in drawn])
            valid = torch.stack([v for _, v in drawn])
            batch.anchors[key] = (anchors, valid)
            _, label_valid = block_labels(input_ids, loss_mask, anchors, valid, objective.block_size)
            batch.normalizers[key] = objective.normalizer(label_valid)
            batch.scored_rows[key] = int(label_valid.sum())
            batch.anchor_counts[key] = int(valid.sum())
        return batch


def stream_identity(samples: Sequence[Sample], *, seed: int, batch_size: int, batches_per_step: int,
                    max_seq_len: int) -> dict:
    """What decides the batches of every step: checkpoints record it, and a resume on any number
    of nodes or GPUs continues the same run only if it is unchanged. `batches_per_step` counts
    every micro-batch of a step (nodes × replicas × grad_accum)."""
    digest = hashlib.sha256()
    for sample in samples:
        ids, mask = sample.input_ids, sample.loss_mask
        ids = (ids if ids.dtype == torch.int64 else ids.to(torch.int64)).contiguous().numpy()
        mask = (mask if mask.dtype == torch.bool else mask.to(torch.bool)).contiguous().numpy()
        digest.update(f"{sample.sample_id}:{len(ids)}:{zlib.crc32(ids)}:{zlib.crc32(mask)};".encode())
    return {
        "seed": seed, "batch_size": batch_size, "micro_batches_per_step": batches_per_step, "max_seq_len": max_seq_len,
        "samples": len(samples), "samples_sha256": digest.hexdigest()[:16],
    }


STREAM_FIELDS = {
    "seed": "--seed", "batch_size": "--batch-size",
    "micro_batches_per_step": "micro-batches per step (nodes × drafter replicas × --grad-accum)",
    "max_seq_len": "--max-seq-len", "samples": "training rows", "samples_sha256": "training data (digest of the rows)",
}


def stream_differences(saved: dict, current: dict) -> list[str]:
    """Human-readable differences between a checkpoint's stream and this run's."""
    return [f"{STREAM_FIELDS.get(key, key)}: {saved.get(key)} in the checkpoint, {current.get(key)} now"
            for key in STREAM_FIELDS if saved.get(key) != current.get(key)]
