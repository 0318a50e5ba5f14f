"""The pipeline's worker threads: target workers produce features, drafter workers train.

    BatchPlanner ─▶ TargetWorker t (its GPU) ─▶ queue[t][d] (bounded) ─▶ DrafterWorker d (its GPU)
                                                                          │ replicas: GradientReducer
Target worker t handles every batch whose stream position g satisfies g % T == t, so several
target GPUs can feed the drafters; each (target, drafter) pair has its own bounded queue, so a
drafter always knows where its next batch comes from and backpressure cannot deadlock (the
`BatchRouter` owns that rule). Features move GPU to GPU as a peer copy on side streams ordered by
CUDA events, never through the host.

Each worker takes one setup object. A drafter worker talks to small named collaborators: its
`Inbox` (batches), the `GradientReducer` (replicas), its `Checkpointer` (rank 0 only: who
checkpoints) and the shared `EvaluationSchedule` (rank 0 only); what a step
computes is `step.training_step`; who logs it is the coordinator, from the `StepReport`s.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from ..core.objective import ObjectiveConfig
from ..core.step import DrafterBatch, FrozenTargetParts, StepResult, training_step
from ..parallel.nodes import FlatGradients, NodeStep
from ..parallel.streams import mark, receive, wait_for
from ..parallel.threads import POLL_SECONDS, PipelineStopped, StopBarrier, StopSignal, Worker, get, put
from .batches import BatchPlanner, HostBatch
from .checkpoint import save_checkpoint

if TYPE_CHECKING:
    from .startup import Warmup
    from .step_graphs import GraphedStep


class FeatureSource(Protocol):
    """Produces target features for a host batch (a live target, or a feature cache)."""

    device: torch.device
    layer_ids: list[int]

    def features(self, batch: HostBatch) -> torch.Tensor: ...


@dataclass
class FeatureBatch:
    host: HostBatch
    features: torch.Tensor  # [b, S, len(layer_ids) · hidden] on the producing device
    ready: Any  # an event on the target worker's stream after the features were written (None on CPU)
    layer_ids: list[int]


@dataclass(frozen=True)
class StepRange:
    """The steps this run trains: start (0, or the resumed step) up to end (exclusive)."""

    start: int
    end: int

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return max(0, self.end - self.start)


class BatchRouter:
    """Which target worker produces each batch of a step, and which queue it goes to.

    Batch j of step s sits at stream position s × batches_per_step + j; target worker
    position % num_targets produces it. In replicas mode it goes to the replica that trains it
    (batch j belongs to rank j // grad_accum); in variants mode every drafter trains every batch.
    """

    def __init__(self, num_targets: int, num_drafter_threads: int, *, batches_per_step: int, grad_accum: int,
                 every_drafter_trains_every_batch: bool, depth: int):
        self.num_targets = num_targets
        self.batches_per_step = batches_per_step
        self.grad_accum = grad_accum
        self.broadcast = every_drafter_trains_every_batch
        self.queues = [[queue.Queue(maxsize=depth) for _ in range(num_drafter_threads)] for _ in range(num_targets)]

    def producer_of(self, step: int, index: int) -> int:
        return (step * self.batches_per_step + index) % self.num_targets

    def produced_by(self, target_index: int, step: int) -> list[int]:
        return [j for j in range(self.batches_per_step) if self.producer_of(step, j) == target_index]

    def destinations(self, step: int, index: int) -> list[queue.Queue]:
        row = self.queues[self.producer_of(step, index)]
        return row if self.broadcast else [row[index // self.grad_accum]]

    def inbox(self, slot: int, batch_indices: list[int], stop: StopSignal) -> "Inbox":
        return Inbox(self, [row[slot] for row in self.queues], batch_indices, stop)

    def mean_depth(self) -> float:
        everything = [q for row in self.queues for q in row]
        return sum(q.qsize() for q in everything) / max(1, len(everything))


@dataclass
class Inbox:
    """Where one drafter thread's batches come from: one queue per target worker."""

    router: BatchRouter
    queues: list[queue.Queue]
    batch_indices: list[int]  # which batches of each step this thread trains on
    stop: StopSignal

    def receive(self, step: int) -> tuple[list[FeatureBatch], float]:
        """This thread's batches of `step` in order, and the seconds spent waiting for them."""
        items, waited = [], 0.0
        for j in self.batch_indices:
            item, seconds = get(self.queues[self.router.producer_of(step, j)], self.stop)
            waited += seconds
            if item.host.step != step or item.host.index != j:
                raise RuntimeError(f"expected batch ({step}, {j}), got ({item.host.step}, {item.host.index})")
            items.append(item)
        return items, waited


@dataclass
class TargetSetup:
    """Everything one target worker thread owns."""

    thread_name: str
    index: int  # which target worker (batch positions ≡ index mod the number of target workers)
    source: FeatureSource
    planner: BatchPlanner
    router: BatchRouter
    steps: StepRange
    stop: StopSignal
    warmup: "Warmup | None" = None  # the start-up gate: warm-ups one at a time, then all start


class TargetWorker(Worker):
    role = "target"

    def __init__(self, setup: TargetSetup):
        super().__init__(setup.thread_name, setup.stop, setup.source.device)
        self.setup = setup
        self.tokens = 0

    @property
    def device(self) -> torch.device:
        return self.setup.source.device

    def work(self) -> None:
        setup = self.setup
        if setup.source.device.type == "cuda":
            torch.cuda.set_device(setup.source.device)
        if setup.warmup is not None:
            setup.warmup.run(self, getattr(setup.source, "prepare", None))
        for step in setup.steps:
            mine = setup.router.produced_by(setup.index, step)
            if not mine:
                continue
            self.stop_signal.check()
            started = time.perf_counter()
            batches = setup.planner.step_batches(step)
            for j in mine:
                batch = batches[j]
                span = self.meter.begin(self.device)
                features = setup.source.features(batch)
                self.meter.end(span, self.device)
                item = FeatureBatch(batch, features, mark(features.device), setup.source.layer_ids)
                self.times.computing += time.perf_counter() - started
                self.times.items += 1
                self.tokens += int(batch.lengths.sum())
                for target_queue in setup.router.destinations(step, j):
                    self.times.waiting += put(target_queue, item, self.stop_signal)
                started = time.perf_counter()


@dataclass
class ReceivedStep:
    """One step's micro-batches as a drafter thread took them from its inbox."""

    batches: list[DrafterBatch]
    ready: list[Any]  # events this thread's stream waits for before the step reads the features
    waited: float  # seconds the thread waited for them
    samples: int
    tokens: int

    def wait_until_ready(self, device: torch.device) -> None:
        for event in self.ready:
            wait_for(event, device)


class GradientReducer:
    """Sums gradients across this node's replicas after every backward, and across nodes.

    Every replica copies its gradients into its own persistent flat buffers, on its own stream;
    all meet at a barrier; replica 0 sums the buffers into its own (NCCL when every replica has its
    own GPU, else copy-add); on several nodes it then votes and all-reduces that sum across nodes
    (`NodeStep`); it hands the total back into every buffer, and all meet again; each replica then
    copies the total back into its gradients, on its own stream. The first barrier is aborted when
    the pipeline stops, so no replica waits forever for a dead peer; the second only when replica 0
    fails: once it is passed, every replica finishes the step.

    On CUDA each replica's thread runs on its own stream (streams.py), and the barriers order only
    the hosts, so the GPU order is explicit: replica 0's streams wait for an event each replica
    recorded after loading its buffer (`loaded`), and each replica's stream waits for the event
    replica 0 recorded on its device after the sum (`summed`) before it reads its buffer back; its
    next step's gradients come after that read on its stream, so they cannot overwrite a gradient
    the sum has not read yet.
    """

    def __init__(self, replicas: list[torch.nn.Module], stop: StopSignal, across: NodeStep | None = None):
        self.params = [[p for p in model.parameters() if p.requires_grad] for model in replicas]
        self.flats = [FlatGradients(params) for params in self.params]
        # StopBarrier: a stop never reaches a replica its generation already released.
        self.gather = StopBarrier(len(replicas))
        self.release = StopBarrier(len(replicas))
        self.devices = devices = [ps[0].device for ps in self.params]
        self.use_nccl = (
            len(devices) > 1
            and all(d.type == "cuda" for d in devices)
            and len(set(devices)) == len(devices)
            and hasattr(torch.cuda, "nccl")
            and torch.cuda.nccl.is_available([torch.empty(1, device=d) for d in devices])
        )
        self.loaded: list[Any] = [None] * len(replicas)  # per replica: its buffer is written (an event, or None)
        self.summed: dict[torch.device, Any] = {}  # per device: every buffer there holds the total
        stop.on_stop(self.gather.abort)
        self.stop = stop
        self.across = across
        self.seconds = 0.0

    def sync(self, rank: int) -> None:
        device = self.devices[rank]
        self.flats[rank].load()
        self.loaded[rank] = mark(device)
        self.gather.wait()
        if rank == 0:
            try:
                if self.across is not None:
                    self.across.continue_or_stop()
                started = time.perf_counter()
                self._reduce()
                self.seconds += time.perf_counter() - started
            except BaseException:
                self.release.abort()
                raise
        self.release.wait()
        wait_for(self.summed.get(device), device)
        self.flats[rank].store()

    def abort(self) -> None:
        """A replica failed outside a pipeline (no StopSignal to stop): release every peer waiting
        in either barrier."""
        self.gather.abort()
        self.release.abort()

    def record(self, step: int, result: StepResult, samples: int, tokens: int) -> None:
        """A replica's step result, for the node totals the next vote carries."""
        if self.across is not None:
            self.across.record(step, result.loss, result.metric_sums, samples, tokens)

    def leave(self, rank: int, completed_step: int, failure: str | None = None) -> None:
        """Replica 0 is exiting (`failure`: why, if its own thread failed): the other nodes learn
        it in the vote they wait for next."""
        if rank == 0 and self.across is not None:
            self.across.leave(completed_step, failure)

    @torch.no_grad()
    def _reduce(self) -> None:
        """In replica 0's thread, on its current stream of each device, after every replica's load."""
        for event, device in zip(self.loaded, self.devices):
            wait_for(event, device)
        for group in range(len(self.flats[0].buffers)):
            buffers = [flat.buffers[group] for flat in self.flats]
            total = buffers[0]
            if self.use_nccl and self.across is None:
                torch.cuda.nccl.all_reduce(buffers)
                continue
            if self.use_nccl:
                torch.cuda.nccl.reduce(buffers, root=0)
            else:
                for buffer in buffers[1:]:
                    total += buffer.to(total.device)
            if self.across is not None:
                self.across.all_reduce(total)
            if self.use_nccl:
                torch.cuda.nccl.broadcast(buffers, root=0)
            else:
                for buffer in buffers[1:]:
                    buffer.copy_(total)
        self.summed = {device: mark(device) for device in set(self.devices)}


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
class Replica:
    """What one drafter thread trains, and how one step of it is taken."""

    name: str  # run name (variants) or "drafter"
    rank: int  # replica rank within its drafter (0 checkpoints and evaluates)
    device: torch.device
    drafter: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    frozen: FrozenTargetParts
    objective: ObjectiveConfig
    layer_ids: list[int]  # this drafter's target layers, in its order
    attention_backend: str
    autocast_dtype: torch.dtype | None
    clip_grad: float
    graphed: "GraphedStep | None" = None  # --cuda-graphs: the step as CUDA graphs (step_graphs.py)
    prepare: Callable[[Callable[[str], None]], str] | None = None  # its warm-up before step 1 (startup.py)

    def step(self, micro_batches: list[DrafterBatch], sync_gradients: Callable[[], None] | None) -> StepResult:
        if self.graphed is not None:
            return self.graphed.step(micro_batches, sync_gradients)
        return training_step(
            self.drafter, self.optimizer, self.scheduler, micro_batches, self.frozen, self.objective,
            attention_backend=self.attention_backend, clip_grad=self.clip_grad,
            autocast_dtype=self.autocast_dtype, sync_gradients=sync_gradients,
        )

    def take_gpu_wait(self) -> float:
        """Seconds the last steps waited for the GPU to catch up (graphed steps run ahead of it)."""
        return self.graphed.take_gpu_wait() if self.graphed is not None else 0.0


@dataclass
class Checkpointer:
    """Who checkpoints a drafter: its rank-0 thread, every `every` steps and when it stops."""

    run_dir: Path
    every: int
    keep: int
    state: dict  # written into each checkpoint's state.json (the run's config, the layer union)
    saved_step: int  # the newest step on disk (the resumed step at start)
    last: Path | None = None

    def due(self, completed_step: int, end_step: int) -> bool:
        """A periodic save; the final one is `save` from the worker's exit path."""
        return completed_step % self.every == 0 and completed_step < end_step

    def save(self, step: int, replica: Replica) -> None:
        if step <= self.saved_step:
            return
        self.last = save_checkpoint(self.run_dir, step, replica.drafter, replica.optimizer, replica.scheduler,
                                    self.state, keep=self.keep)
        self.saved_step = step


class Evaluator(Protocol):
    def measure(self, drafter: torch.nn.Module) -> dict: ...


class EvaluationSchedule:
    """Real tau every `every` steps and at the last step, one decode at a time (the
    evaluator's target is shared by every drafter of the run)."""

    def __init__(self, evaluator: Evaluator, every: int, end_step: int):
        self.evaluator = evaluator
        self.every = every
        self.end_step = end_step
        self._lock = threading.Lock()

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 or step + 1 == self.end_step

    def after_step(self, step: int, drafter: torch.nn.Module) -> dict | None:
        if not self.due(step):
            return None
        with self._lock:
            return self.evaluator.measure(drafter)


StepHook = Callable[["DrafterWorker", int], None]  # (worker, step) after each step: tests and benches


@dataclass
class DrafterSetup:
    """Everything one drafter worker thread owns and talks to."""

    thread_name: str
    replica: Replica
    inbox: Inbox
    steps: StepRange
    stop: StopSignal
    reports: queue.Queue  # StepReports for the coordinator
    reducer: GradientReducer | None = None  # replicas: gradients summed after every backward
    checkpointer: Checkpointer | None = None  # rank 0 of a drafter, unless checkpoints are off
    evaluation: EvaluationSchedule | None = None  # rank 0, with --eval-every
    hook: StepHook | None = None
    warmup: "Warmup | None" = None  # the start-up gate: warm-ups one at a time, then all start


class LayerColumns:
    """Where a drafter's target layers sit among the layers a feature batch holds (the union of
    every drafter's): one index tensor per set of layers held, on the drafter's device, made once.
    Made anew for each batch it was a blocking host-to-device copy, which makes the host wait for all this thread's
    stream has enqueued, the wait for the features' producer included: on the H200 the one variant
    reading fewer layers showed its thread 0.99 host-busy (0.09 for the others), and its prefetch
    of the next step waited for the target instead of overlapping this step."""

    def __init__(self, wanted: list[int], device: torch.device):
        self.wanted, self.device = list(wanted), device
        self._made: dict[tuple[int, ...], torch.Tensor] = {}

    def index(self, held: list[int]) -> torch.Tensor:
        key = tuple(held)
        if key not in self._made:
            missing = [k for k in self.wanted if k not in held]
            if missing:
                raise ValueError(f"a feature batch holds target layers {list(held)}, not {missing} this drafter reads")
            self._made[key] = torch.tensor([key.index(k) for k in self.wanted], device=self.device)
        return self._made[key]


def select_layers(features: torch.Tensor, layers_held: int, columns: torch.Tensor) -> torch.Tensor:
    """[b, S, layers_held · H] -> [b, S, len(columns) · H], the layers at `columns` in that order."""
    b, s, _ = features.shape
    return features.view(b, s, layers_held, -1).index_select(2, columns).flatten(2)


class DrafterWorker(Worker):
    role = "drafter"

    def __init__(self, setup: DrafterSetup):
        super().__init__(setup.thread_name, setup.stop, setup.replica.device)
        self.setup = setup
        self.replica = setup.replica
        self.completed_step = setup.steps.start
        self._streams: dict = {}
        self._columns = LayerColumns(setup.replica.layer_ids, setup.replica.device)

    @property
    def device(self) -> torch.device:
        return self.replica.device

    @property
    def last_checkpoint(self) -> Path | None:
        return self.setup.checkpointer.last if self.setup.checkpointer is not None else None

    def _to_drafter_batch(self, item: FeatureBatch) -> tuple[DrafterBatch, Any]:
        device, key = self.replica.device, self.replica.name
        features, ready = receive(item.features, item.ready, device, self._streams)  # and the event to wait for
        if item.layer_ids != self.replica.layer_ids:
            columns = self._columns.index(item.layer_ids)  # before the wait: making one may sync
            wait_for(ready, device)  # the column selection reads them now
            ready = None
            features = select_layers(features, len(item.layer_ids), columns)
        anchors, anchor_valid = item.host.anchors[key]
        batch = DrafterBatch(
            target_features=features,
            input_ids=item.host.input_ids.to(device, non_blocking=True),
            loss_mask=item.host.loss_mask.to(device, non_blocking=True),
            anchors=anchors.to(device, non_blocking=True),
            anchor_valid=anchor_valid.to(device, non_blocking=True),
            loss_normalizer=item.host.normalizers[key],
            scored_rows=item.host.scored_rows.get(key),
        )
        return batch, ready

    def _receive(self, step: int) -> ReceivedStep:
        items, waited = self.setup.inbox.receive(step)
        moved = [self._to_drafter_batch(item) for item in items]
        return ReceivedStep(
            batches=[batch for batch, _ in moved], ready=[ready for _, ready in moved if ready is not None],
            waited=waited, samples=sum(len(item.host.sample_ids) for item in items),
            tokens=sum(int(item.host.lengths.sum()) for item in items),
        )

    def work(self) -> None:
        setup, replica = self.setup, self.replica
        if replica.device.type == "cuda":
            torch.cuda.set_device(replica.device)
        replica.drafter.train()
        if setup.warmup is not None:
            setup.warmup.run(self, replica.prepare)
        sync = functools.partial(setup.reducer.sync, replica.rank) if setup.reducer is not None else None
        end = setup.steps.end
        try:
            incoming = self._receive(setup.steps.start) if len(setup.steps) else None
            for step in setup.steps:
                current = incoming
                micro_batches, waited, samples, tokens = current.batches, current.waited, current.samples, current.tokens
                # Take the next step's batches now: their GPU-to-GPU copies then overlap
                # this step's compute instead of following it (this stream waits for them
                # only when that step starts).
                incoming = self._receive(step + 1) if step + 1 < end else None
                started = time.perf_counter()
                current.wait_until_ready(replica.device)  # before the span: waiting for the target is not drafter time
                span = self.meter.begin(replica.device)
                result = replica.step(micro_batches, sync)
                self.meter.end(span, replica.device)
                self.meter.add_gpu_wait(replica.take_gpu_wait())
                seconds = time.perf_counter() - started
                self.times.computing += seconds
                self.times.waiting += waited
                self.times.items += 1
                self.completed_step = step + 1
                if setup.reducer is not None:
                    setup.reducer.record(step, result, samples, tokens)
                evaluation = setup.evaluation.after_step(step, replica.drafter) if setup.evaluation is not None else None
                setup.reports.put(StepReport(replica.name, replica.rank, step, result, samples, tokens, seconds, waited,
                                             evaluation))
                if setup.hook is not None:
                    setup.hook(self, step)
                if setup.checkpointer is not None and setup.checkpointer.due(self.completed_step, end):
                    setup.checkpointer.save(self.completed_step, replica)
        except PipelineStopped:
            pass
        except BaseException as error:
            if setup.reducer is not None:
                setup.reducer.leave(replica.rank, self.completed_step, f"{self.name} failed: {type(error).__name__}: {error}")
            raise
        if setup.reducer is not None:
            setup.reducer.leave(replica.rank, self.completed_step)
        # Whether finished, interrupted or stopped by another worker's failure, this
        # drafter's weights are those of its last completed step: save them.
        if setup.checkpointer is not None:
            setup.checkpointer.save(self.completed_step, replica)


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
