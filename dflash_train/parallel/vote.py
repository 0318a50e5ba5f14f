"""Stopping across nodes: one vote per step, so every node stops after the same step.

    StopRequest   Ctrl-C / SIGTERM on one node only ask it to stop: a request for the next vote
    StepVote      the vote of step k, cast by the node's first replica in the step loop after
                  every local replica's backward and before the gradient all-reduce: does every
                  node go on? It carries the node totals of step k − 1 (what rank 0 logs)
    Verdict       what a vote decided, which the step loop acts on

A failing thread stops its own node at once, and the node's first replica votes "failed" on its
way out, so every other node stops at the same step. A rank that announces, in a vote, work of
its own before the next one (rank 0's checkpoint or in-training eval) is waited for at the next
vote through the store for as long as its heartbeat ticks, so no collective times out behind it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .nodes import NodeGroup
from .threads import StopSignal

CONTINUE, FINISHED, STOPPING, FAILED = 0, 1, 2, 3  # what a rank votes


class NodeFailure(RuntimeError):
    """Another node failed and every node stopped after the same step; its log has the traceback."""


class StopRequest:
    """The interrupt target across nodes: a signal becomes a request for the next vote."""

    def __init__(self, nodes: NodeGroup):
        self.nodes = nodes
        self.requested = False

    @property
    def stopped(self) -> bool:
        return self.requested

    def stop(self, reason: str) -> None:
        if not self.requested:
            self.requested = True
            self.nodes.stop_requested = reason


def interrupt_target(nodes: NodeGroup, stop: StopSignal) -> Any:
    """What Ctrl-C / SIGTERM stop: on one process the pipeline at once; across nodes only a
    request that the next vote turns into every node stopping after the same step."""
    return StopRequest(nodes) if nodes.distributed else stop


@dataclass
class NodeTotals:
    """One step of one drafter summed over every replica of every node: what rank 0 logs.
    The coordinator collects it like one more replica report of the step."""

    drafter: str
    step: int
    loss: float
    metric_sums: dict[str, torch.Tensor]
    samples: int
    tokens: int


def metric_layout(block_size: int) -> dict[str, torch.Size]:
    """The names and shapes of a step's metric sums (objective.block_metrics)."""
    from ..core.objective import block_metrics

    empty = torch.zeros(1, 1, block_size, dtype=torch.bool)
    return {k: v.shape for k, v in block_metrics(empty, empty, torch.zeros(1, 1, dtype=torch.bool)).items()}


@dataclass
class Verdict:
    """What one vote decided, and the node totals of the step before it (None at the first vote)."""

    totals: NodeTotals | None = None
    reason: str | None = None  # every node stops after the step before the vote, and why
    failed: str = ""  # the ranks that failed, when that is why ("rank 1")

    @property
    def stops(self) -> bool:
        return self.reason is not None

    def stop_node(self, stop: StopSignal) -> None:
        """Stop this node with the reason every node read."""
        if not self.failed:
            stop.stop(self.reason)
            return
        try:
            raise NodeFailure(self.reason)
        except NodeFailure as error:  # raised for its traceback in the failure report
            stop.fail(self.failed, error)


class StepVote:
    """The per-step vote of one drafter. Every local replica `record`s its step; the node's first
    replica casts the vote of each step it reaches (`cast`), and once more when it leaves
    (finished, stopped or failed) if the others will wait for that vote (`leave`). A vote carries
    each rank's word (go on, finished, stopping, failed), whether it has work of its own before
    the next vote, and its node's totals of the previous step.
    """

    def __init__(self, nodes: NodeGroup, *, drafter: str, start: int, end: int, local_replicas: int,
                 block_size: int, stop: StopSignal, busy_after: Callable[[int], bool] | None = None):
        self.nodes = nodes
        self.drafter = drafter
        self.start, self.end = start, end
        self.local_replicas = local_replicas
        self.layout = metric_layout(block_size)
        self.width = 3 + sum(shape.numel() for shape in self.layout.values())
        self.stop = stop  # read for why this node leaves; never stopped from here
        self.busy_after = busy_after or (lambda step: False)
        self.next_vote = start
        self.done = False  # a vote ended the run here: no more votes
        # Ranks that announced work of their own before the next vote; at the first vote, every
        # rank (its first step compiles, which takes the longest and the least predictably).
        self.awaited: list[int] = list(range(nodes.world_size))
        self._totals: dict[int, list] = {}
        self._recorded = threading.Condition()

    def record(self, step: int, loss: float, metric_sums: Mapping[str, torch.Tensor], samples: int,
               tokens: int) -> None:
        """A local replica's step (any replica's thread), for the node totals the next vote carries."""
        vector = torch.cat([torch.tensor([loss, samples, tokens], dtype=torch.float64),
                            *(metric_sums[k].reshape(-1).double() for k in self.layout)])
        with self._recorded:
            entry = self._totals.setdefault(step, [0, torch.zeros(self.width, dtype=torch.float64)])
            entry[0] += 1
            entry[1] += vector
            self._recorded.notify_all()

    def cast(self) -> Verdict:
        """The vote of this step, before its gradient all-reduce: every node goes on, or every node
        stops here (this step's gradients are dropped everywhere)."""
        request = self.nodes.stop_requested
        step = self.next_vote
        codes, totals = self._vote(STOPPING if request else CONTINUE, request or "", wait_for_totals=0.0)
        if any(code in (STOPPING, FAILED) for code in codes):
            return self._stop_everywhere(codes, step, totals)
        return Verdict(totals)

    def leave(self, completed: int, failure: str | None = None) -> Verdict | None:
        """The first replica is exiting (`failure`: why, if its own thread failed): cast the vote
        the other nodes wait for next (finished, stopping, or failed), unless a vote already ended
        the run or the group broke. The verdict stops this node only where it had finished."""
        if self.done or self.nodes.broken or self.next_vote > self.end:
            return None
        if failure is not None or self.stop.failures:
            code, reason = FAILED, failure or self.stop.reason or "a worker failed"
        elif completed >= self.end:
            code, reason = FINISHED, ""
        else:
            code, reason = STOPPING, self.stop.reason or self.nodes.stop_requested or "stopped"
        step = self.next_vote
        codes, totals = self._vote(code, reason, wait_for_totals=1.0)
        self.done = True
        if code == FINISHED and any(c in (STOPPING, FAILED) for c in codes):
            return self._stop_everywhere(codes, step, totals)
        return Verdict(totals)

    def _vote(self, code: int, reason: str, wait_for_totals: float) -> tuple[list[int], NodeTotals | None]:
        import torch.distributed as dist

        nodes, world, step = self.nodes, self.nodes.world_size, self.next_vote
        if code in (STOPPING, FAILED):
            nodes.set_note(f"reason/{step}/{nodes.rank}", reason)
        if self.awaited:
            nodes.wait_for(f"vote/{step}", self.awaited,
                           f"waiting before step {step + 1} for {', '.join(f'rank {r}' for r in self.awaited)} "
                           "(its checkpoint or in-training eval)")
        payload = torch.zeros(2 * world + self.width, dtype=torch.float64)
        payload[nodes.rank] = code
        payload[world + nodes.rank] = float(step < self.end and self.busy_after(step))
        if step > self.start:
            payload[2 * world:] = self._local_totals(step - 1, wait_for_totals)
        with nodes.collective(f"the vote of step {step + 1}"):
            dist.all_reduce(payload, group=nodes.control)
        self.next_vote = step + 1
        self.awaited = [r for r in range(world) if payload[world + r] > 0]
        totals = self._totals_message(step - 1, payload[2 * world:]) if step > self.start else None
        return [int(round(float(c))) for c in payload[:world]], totals

    def _local_totals(self, step: int, wait: float) -> torch.Tensor:
        with self._recorded:
            if wait:
                self._recorded.wait_for(lambda: self._totals.get(step, [0])[0] >= self.local_replicas, timeout=wait)
            entry = self._totals.pop(step, None)
            for old in [s for s in self._totals if s < step]:
                del self._totals[old]
        return entry[1] if entry else torch.zeros(self.width, dtype=torch.float64)

    def _totals_message(self, step: int, vector: torch.Tensor) -> NodeTotals:
        sums, offset = {}, 3
        for key, shape in self.layout.items():
            sums[key] = vector[offset: offset + shape.numel()].float().view(shape)
            offset += shape.numel()
        return NodeTotals(self.drafter, step, float(vector[0]), sums, int(vector[1]), int(vector[2]))

    def _stop_everywhere(self, codes: list[int], step: int, totals: NodeTotals | None) -> Verdict:
        """Every node read the same codes: the verdict stops this node after the same step, with the reason."""
        self.done = True
        me = self.nodes.rank
        failed = [r for r, code in enumerate(codes) if code == FAILED and r != me]
        asked = [r for r, code in enumerate(codes) if code == STOPPING]
        if failed:
            why = "; ".join(f"rank {r} failed ({self.nodes.note(f'reason/{step}/{r}')})" for r in failed)
            return Verdict(totals, f"{why}; every node stopped after step {step} (see that rank's log for the traceback)",
                           ", ".join(f"rank {r}" for r in failed))
        if asked:
            return Verdict(totals, f"{self.nodes.note(f'reason/{step}/{asked[0]}')} on rank {asked[0]}")
        return Verdict(totals)
