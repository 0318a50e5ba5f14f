"""The pipeline's worker threads: target workers produce features, drafter workers train.

    BatchPlanner ─▶ TargetWorker t (its GPU) ─▶ queue[t][d] (bounded) ─▶ DrafterWorker d (its GPU)
                                                                          │ replicas: GradientReducer
Target worker t handles every batch whose stream position g satisfies g % T == t, so several
target GPUs can feed the drafters; each (target, drafter) pair has its own bounded queue, so a
drafter always knows where its next batch comes from and backpressure cannot deadlock.
Features move GPU to GPU as a peer copy on side streams ordered by CUDA events, never
through the host.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..checkpoint import save_checkpoint
from ..objective import ObjectiveConfig
from ..step import DrafterBatch, FrozenTargetParts, StepResult, training_step
from .batches import BatchPlanner, HostBatch
from .compile_safety import RecompileAfterWarmupError, configure_worker_thread, recompile_snapshot
from .runtime import POLL_SECONDS, PipelineStopped, StopSignal, Worker, get, put


class FeatureSource(Protocol):
    """Produces target features for a host batch (a live target, or a feature cache)."""

    device: torch.device
    layer_ids: list[int]

    def features(self, batch: HostBatch) -> torch.Tensor: ...


@dataclass
class FeatureBatch:
    host: HostBatch
    features: torch.Tensor  # [b, S, len(layer_ids) · hidden] on the producing device
    ready: Any  # torch.cuda.Event recorded after the features were written, or None on CPU
    layer_ids: list[int]


def record_ready(tensor: torch.Tensor):
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class TargetWorker(Worker):
    def __init__(
        self,
        name: str,
        stop: StopSignal,
        source: FeatureSource,
        planner: BatchPlanner,
        *,
        index: int,
        num_target_workers: int,
        start_step: int,
        total_steps: int,
        routes: Callable[[int, int], list[queue.Queue]],
        compile_safety: bool = False,
    ):
        super().__init__(name, stop)
        self.compile_safety = compile_safety
        self.source = source
        self.planner = planner
        self.index = index
        self.num_target_workers = num_target_workers
        self.start_step = start_step
        self.total_steps = total_steps
        self.routes = routes
        self.tokens = 0

    def work(self) -> None:
        if self.source.device.type == "cuda":
            torch.cuda.set_device(self.source.device)
        if self.compile_safety:
            configure_worker_thread()
        per_step = self.planner.batches_per_step
        for step in range(self.start_step, self.total_steps):
            mine = [j for j in range(per_step) if (step * per_step + j) % self.num_target_workers == self.index]
            if not mine:
                continue
            self.stop_signal.check()
            started = time.perf_counter()
            batches = self.planner.step_batches(step)
            for j in mine:
                batch = batches[j]
                features = self.source.features(batch)
                item = FeatureBatch(batch, features, record_ready(features), self.source.layer_ids)
                self.times.computing += time.perf_counter() - started
                self.times.items += 1
                self.tokens += int(batch.lengths.sum())
                for target_queue in self.routes(step, j):
                    self.times.waiting += put(target_queue, item, self.stop_signal)
                started = time.perf_counter()


def move_features(item: FeatureBatch, device: torch.device, streams: dict) -> torch.Tensor:
    """The features on `device`, ordered after the producer's event; GPU to GPU as a peer copy
    on side streams of both devices so it overlaps the drafter's compute."""
    source = item.features
    if source.device == device:
        if item.ready is not None:
            torch.cuda.current_stream(device).wait_event(item.ready)
        return source
    if source.device.type == "cuda" and device.type == "cuda":
        send = streams.setdefault(source.device, torch.cuda.Stream(source.device))
        receive = streams.setdefault(device, torch.cuda.Stream(device))
        with torch.cuda.stream(send), torch.cuda.stream(receive):
            send.wait_event(item.ready)
            moved = source.to(device, non_blocking=True)
        source.record_stream(send)  # the producer may free it; keep it until the copy ran
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(receive)
        moved.record_stream(compute)
        return moved
    if item.ready is not None:
        item.ready.synchronize()
    return source.to(device)


class GradientReducer:
    """Sums gradients across replicas in-process after every backward.

    All replicas meet at a barrier; replica 0 sums the flattened gradients (NCCL all-reduce
    when every replica has its own GPU, else copy-add-broadcast) and all meet again. Aborted
    when the pipeline stops, so no replica waits forever for a dead peer.
    """

    def __init__(self, replicas: list[torch.nn.Module], stop: StopSignal):
        self.params = [[p for p in model.parameters() if p.requires_grad] for model in replicas]
        self.barrier = threading.Barrier(len(replicas))
        devices = [ps[0].device for ps in self.params]
        self.use_nccl = (
            all(d.type == "cuda" for d in devices)
            and len(set(devices)) == len(devices)
            and hasattr(torch.cuda, "nccl")
            and torch.cuda.nccl.is_available([torch.empty(1, device=d) for d in devices])
        )
        stop.on_stop(self.barrier.abort)
        self.stop = stop
        self.seconds = 0.0

    def _wait(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise PipelineStopped(self.stop.reason or "a replica stopped") from None

    def sync(self, rank: int) -> None:
        self._wait()
        if rank == 0:
            started = time.perf_counter()
            self._reduce()
            self.seconds += time.perf_counter() - started
        self._wait()

    @torch.no_grad()
    def _reduce(self) -> None:
        grads = [[p.grad if p.grad is not None else torch.zeros_like(p) for p in ps] for ps in self.params]
        flats = [torch._utils._flatten_dense_tensors(g) for g in grads]
        if self.use_nccl:
            torch.cuda.nccl.all_reduce(flats)
        else:
            total = flats[0].clone()
            for flat in flats[1:]:
                total += flat.to(total.device)
            for flat in flats:
                flat.copy_(total)
        for params, grad_list, flat in zip(self.params, grads, flats):
            for param, grad, reduced in zip(params, grad_list, torch._utils._unflatten_dense_tensors(flat, grad_list)):
                if param.grad is None:
                    param.grad = grad
                param.grad.copy_(reduced)


@dataclass
class StepReport:
    drafter: str
    rank: int
    step: int
    result: StepResult
    samples: int
    tokens: int
    seconds: float
    waited: float
    evaluation: dict | None = None  # real tau measured after this step (rank 0, every K steps)


@dataclass
class DrafterSetup:
    """Everything one drafter worker owns."""

    name: str  # run name (variants) or "drafter"
    rank: int  # replica rank within its drafter (0 saves checkpoints)
    device: torch.device
    drafter: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    frozen: FrozenTargetParts
    objective: ObjectiveConfig
    run_dir: Path | None  # where rank 0 saves; None for other replicas
    layer_ids: list[int]  # this drafter's target layers, in its order


class DrafterWorker(Worker):
    def __init__(
        self,
        thread_name: str,
        stop: StopSignal,
        setup: DrafterSetup,
        *,
        inputs: list[queue.Queue],  # one per target worker
        batch_indices: list[int],  # which batches of each step this worker trains on
        batches_per_step: int,
        start_step: int,
        total_steps: int,
        reports: queue.Queue,
        reducer: GradientReducer | None,
        attention_backend: str,
        autocast_dtype: torch.dtype | None,
        clip_grad: float,
        save_every: int,
        keep_checkpoints: int,
        checkpoint_state: Callable[[int], dict],
        on_step_done: Callable[["DrafterWorker", int], None] | None = None,
        compile_safety: bool = False,
        fail_on_recompile: bool = False,
        evaluate: Callable[["DrafterWorker", int], dict | None] | None = None,
    ):
        super().__init__(thread_name, stop)
        self.evaluate = evaluate
        self.compile_safety = compile_safety
        self.fail_on_recompile = fail_on_recompile
        self.seen_shapes: set[tuple] = set()
        self.compiles = 0
        self.recompiles_after_warmup = 0
        self.setup = setup
        self.inputs = inputs
        self.batch_indices = batch_indices
        self.batches_per_step = batches_per_step
        self.start_step = start_step
        self.total_steps = total_steps
        self.reports = reports
        self.reducer = reducer
        self.attention_backend = attention_backend
        self.autocast_dtype = autocast_dtype
        self.clip_grad = clip_grad
        self.save_every = save_every
        self.keep_checkpoints = keep_checkpoints
        self.checkpoint_state = checkpoint_state
        self.on_step_done = on_step_done
        self.completed_step = start_step
        self.saved_step = start_step
        self.last_checkpoint: Path | None = None
        self._streams: dict = {}

    def _receive(self, step: int) -> tuple[list[DrafterBatch], float, int, int]:
        batches, waited, samples, tokens = [], 0.0, 0, 0
        for j in self.batch_indices:
            producer = (step * self.batches_per_step + j) % len(self.inputs)
            item, seconds = get(self.inputs[producer], self.stop_signal)
            waited += seconds
            if item.host.step != step or item.host.index != j:
                raise RuntimeError(f"expected batch ({step}, {j}), got ({item.host.step}, {item.host.index})")
            batches.append(self._to_drafter_batch(item))
            samples += len(item.host.sample_ids)
            tokens += int(item.host.lengths.sum())
        return batches, waited, samples, tokens

    def _to_drafter_batch(self, item: FeatureBatch) -> DrafterBatch:
        device, key = self.setup.device, self.setup.name
        features = move_features(item, device, self._streams)
        if item.layer_ids != self.setup.layer_ids:
            b, s, _ = features.shape
            per_layer = features.view(b, s, len(item.layer_ids), -1)
            columns = torch.tensor([item.layer_ids.index(k) for k in self.setup.layer_ids], device=device)
            features = per_layer.index_select(2, columns).flatten(2)
        anchors, anchor_valid = item.host.anchors[key]
        return DrafterBatch(
            target_features=features,
            input_ids=item.host.input_ids.to(device, non_blocking=True),
            loss_mask=item.host.loss_mask.to(device, non_blocking=True),
            anchors=anchors.to(device, non_blocking=True),
            anchor_valid=anchor_valid.to(device, non_blocking=True),
            loss_normalizer=item.host.normalizers[key],
            scored_rows=item.host.scored_rows.get(key),
        )

    @property
    def device(self) -> torch.device:
        return self.setup.device

    def _thread_compiles(self) -> int:
        return recompile_snapshot().get(self.name, {}).get("compiles", 0) if self.compile_safety else 0

    def _account_compiles(self, shape: tuple, before: int) -> None:
        """A shape's first step compiles (warm-up, per bucket); any compile on a shape seen
        before is a recompile: counted, and an error with --fail-on-recompile."""
        new = self._thread_compiles() - before
        self.compiles += new
        if shape in self.seen_shapes and new > 0:
            self.recompiles_after_warmup += new
            if self.fail_on_recompile:
                raise RecompileAfterWarmupError(
                    f"{self.name}: {new} compile(s) on an already-compiled shape {shape} "
                    f"(--fail-on-recompile); see TORCH_LOGS=recompiles for the failing guard"
                )
        self.seen_shapes.add(shape)

    def _save(self, step: int) -> None:
        if self.setup.run_dir is None or step <= self.saved_step:
            return
        self.last_checkpoint = save_checkpoint(
            self.setup.run_dir, step, self.setup.drafter, self.setup.optimizer, self.setup.scheduler,
            self.checkpoint_state(step), keep=self.keep_checkpoints,
        )
        self.saved_step = step

    def work(self) -> None:
        setup = self.setup
        if setup.device.type == "cuda":
            torch.cuda.set_device(setup.device)
        setup.drafter.train()
        if self.compile_safety:
            configure_worker_thread()
        sync = (lambda: self.reducer.sync(setup.rank)) if self.reducer is not None else None
        try:
            incoming = self._receive(self.start_step) if self.start_step < self.total_steps else None
            for step in range(self.start_step, self.total_steps):
                micro_batches, waited, samples, tokens = incoming
                # Take the next step's batches now: their GPU-to-GPU copies then overlap
                # this step's compute instead of following it.
                incoming = self._receive(step + 1) if step + 1 < self.total_steps else None
                started = time.perf_counter()
                shape = tuple(tuple(b.input_ids.shape) for b in micro_batches)
                compiles_before = self._thread_compiles()
                result = training_step(
                    setup.drafter, setup.optimizer, setup.scheduler, micro_batches, setup.frozen, setup.objective,
                    attention_backend=self.attention_backend, clip_grad=self.clip_grad,
                    autocast_dtype=self.autocast_dtype, sync_gradients=sync,
                )
                seconds = time.perf_counter() - started
                self._account_compiles(shape, compiles_before)
                self.times.computing += seconds
                self.times.waiting += waited
                self.times.items += 1
                self.completed_step = step + 1
                evaluation = self.evaluate(self, step) if self.evaluate is not None else None
                self.reports.put(StepReport(setup.name, setup.rank, step, result, samples, tokens, seconds, waited,
                                            evaluation))
                if self.on_step_done is not None:
                    self.on_step_done(self, step)
                if self.completed_step % self.save_every == 0 and self.completed_step < self.total_steps:
                    self._save(self.completed_step)
        except PipelineStopped:
            pass
        # Whether finished, interrupted or stopped by another worker's failure, this
        # drafter's weights are those of its last completed step: save them.
        self._save(self.completed_step)


def wait_for_workers(workers: list[Worker], stop: StopSignal, timeout: float) -> list[str]:
    """Join workers; returns the names of those still alive after `timeout` seconds of stop."""
    deadline = None
    while True:
        alive = [w for w in workers if w.is_alive()]
        if not alive:
            return []
        if stop.stopped and deadline is None:
            deadline = time.monotonic() + timeout
        if deadline is not None and time.monotonic() > deadline:
            return [w.name for w in alive]
        alive[0].join(POLL_SECONDS)
