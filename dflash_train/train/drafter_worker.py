"""The drafter worker thread: trains one replica of one drafter, a step at a time.

It takes one setup object (`DrafterSetup`) and talks to small named collaborators: its `Inbox`
(batches, routing.py), the `GradientReducer` (replicas, nodes) and the `StepVote` (nodes; both
in parallel/), its `Checkpointer` (rank 0 only: who checkpoints) and the shared
`EvaluationSchedule` (rank 0 only; both in rank_zero.py). What a step computes is its replica's
`core.step.Step` (replicas.py); who logs it is the coordinator, from the `StepReport`s. The loop
owns the order of a step:

    accumulate      forward, loss and backward of each micro-batch (the Step, or its graphs)
    arrive          replicas: this replica's gradients are in; every local replica is here
    vote            nodes, the first replica: every node goes on, or every node stops here
    reduce          replicas, nodes: the summed gradients are back in every replica
    update          clip, AdamW, LR schedule

The vote comes before the cross-node all-reduce so that a node which leaves is met at the vote,
never waited for inside an all-reduce; nothing deeper than this loop stops the run.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core.step import DrafterBatch, StepResult
from ..parallel.gradients import GradientReducer
from ..parallel.nodes import NodeLost
from ..parallel.streams import receive, wait_for
from ..parallel.threads import PipelineStopped, StopSignal, Worker
from ..parallel.vote import StepVote, Verdict
from .rank_zero import Checkpointer, EvaluationSchedule
from .replicas import Replica
from .resume import StepRange
from .routing import FeatureBatch, Inbox

if TYPE_CHECKING:
    from .startup import Warmup


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
    reducer: GradientReducer | None = None  # replicas or nodes: gradients summed after every backward
    vote: StepVote | None = None  # nodes: every replica records its steps, the first one votes
    checkpointer: Checkpointer | None = None  # rank 0 of a drafter, unless checkpoints are off
    evaluation: EvaluationSchedule | None = None  # rank 0, with --eval-every
    hook: StepHook | None = None
    warmup: "Warmup | None" = None  # the start-up gate: warm-ups one at a time, then all start


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
            anchor_count=item.host.anchor_counts.get(key),
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
        try:
            self._train()
        except PipelineStopped:
            pass
        except NodeLost as lost:  # another node left: this node fails, naming it
            self.stop_signal.fail(lost.culprit, lost)
        except BaseException as error:
            self._leave(f"{self.name} failed: {type(error).__name__}: {error}")
            raise
        self._leave()
        # Whether finished, interrupted or stopped by another worker's failure, this
        # drafter's weights are those of its last completed step: save them.
        if setup.checkpointer is not None:
            setup.checkpointer.save(self.completed_step, replica)

    def _train(self) -> None:
        """The step loop: accumulate, (replicas, nodes) arrive, vote, reduce, update; then report,
        evaluate, checkpoint. It returns when a vote stops every node."""
        setup, replica, end = self.setup, self.replica, self.setup.steps.end
        reducer, votes = setup.reducer, setup.vote is not None and replica.rank == 0
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
            replica.accumulate(micro_batches)
            if reducer is not None:
                reducer.arrive(replica.rank)
                if votes and not self._every_node_goes_on(reducer):
                    return  # every node stops after the step before this one
                reducer.reduce(replica.rank, step)
            result = replica.update()
            self.meter.end(span, replica.device)
            self.meter.add_gpu_wait(replica.take_gpu_wait())
            seconds = time.perf_counter() - started
            self.times.computing += seconds
            self.times.waiting += waited
            self.times.items += 1
            self.completed_step = step + 1
            if setup.vote is not None:
                setup.vote.record(step, result.loss, result.metric_sums, samples, tokens)
            evaluation = setup.evaluation.after_step(step, replica.drafter) if setup.evaluation is not None else None
            setup.reports.put(StepReport(replica.name, replica.rank, step, result, samples, tokens, seconds, waited,
                                         evaluation))
            if setup.hook is not None:
                setup.hook(self, step)
            if setup.checkpointer is not None:
                setup.checkpointer.raise_if_failed()  # a periodic checkpoint's write, in its own thread
                if setup.checkpointer.due(self.completed_step, end):
                    setup.checkpointer.save_periodic(self.completed_step, replica, self.stop_signal)

    def _every_node_goes_on(self, reducer: GradientReducer) -> bool:
        """This step's vote (the node's first replica, after every local backward, before the
        gradient all-reduce); a stop verdict stops this node after the step before. Unless every
        node goes on, the other local replicas leave the step too, without its update."""
        go_on = False
        try:
            go_on = not self._act_on(self.setup.vote.cast())
        finally:
            if not go_on:
                reducer.cancel()
        return go_on

    def _leave(self, failure: str | None = None) -> None:
        """The node's first replica is exiting (`failure`: why, if its own thread failed): the other
        nodes learn it in the vote they wait for next."""
        if self.setup.vote is None or self.replica.rank != 0:
            return
        try:
            verdict = self.setup.vote.leave(self.completed_step, failure)
        except NodeLost as lost:
            self.stop_signal.fail(lost.culprit, lost)
            return
        if verdict is not None:
            self._act_on(verdict)

    def _act_on(self, verdict: Verdict) -> bool:
        """The node totals of the step before the vote go to the coordinator; a stop stops this
        node. Returns whether it stops."""
        if verdict.totals is not None:
            self.setup.reports.put(verdict.totals)
        if verdict.stops:
            verdict.stop_node(self.stop_signal)
        return verdict.stops
