"""Several nodes: one process per node under torchrun, torch.distributed between them.

Inside a node the threaded pipeline runs as on one machine. Across nodes:

    Launch         what the launcher (torchrun, or anything that sets RANK, WORLD_SIZE,
                   MASTER_ADDR, MASTER_PORT) says about this process, read from the environment
    NodeGroup      the rendezvous store, the gradient process group (NCCL on GPUs, gloo on CPU), a
                   gloo control group, a heartbeat; who writes (rank 0); waits that last as long
                   as every awaited rank is alive
    NodeStep       the cross-node part of a step, run by the thread of each node's first replica:
                   one vote on the control group (does every node go on? with the node totals of
                   the previous step), then one all-reduce of the in-node gradient sum
    FlatGradients  the persistent flat buffers the gradient sums live in (no allocation per step)

Stopping is collective. Ctrl-C / SIGTERM only ask this node to stop; the next vote makes every
node stop after the same step. A failing thread stops its own node at once, and the node's first
replica votes "failed" on its way out, so every other node stops at the same step. A node that
dies is named by its missing heartbeat (or the reason it left, written to the store on its way
out) within `--dist-timeout` seconds.

A rank that announces, in a vote, work of its own before the next one (rank 0's checkpoint or
in-training eval) is waited for at the next vote through the store for as long as its heartbeat
ticks, so no collective times out behind it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..errors import ConfigError
from .threads import PipelineStopped, StopSignal

HEARTBEAT_SECONDS = 1.0  # how often each rank bumps its heartbeat counter in the store
POLL_SECONDS = 0.05  # store polling while waiting for a rank (only on slow paths)
NAMING_SECONDS = 3.0  # after a failed collective: how long a silent heartbeat takes to name its rank
SIGNAL_ECHO_SECONDS = 2.0  # a SIGINT this soon after the first is torchrun forwarding the same Ctrl-C
JOIN_SECONDS = 600.0  # how long a rank waits for the rendezvous store to accept it

CONTINUE, FINISHED, STOPPING, FAILED = 0, 1, 2, 3  # what a rank votes


# --- launch ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """This process's place in a multi-process launch (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); else rank 0 does
    attempt: int  # torchrun's restart count: store keys are per attempt


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch torchrun describes in the environment, or None for a plain one-process run."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ConfigError(f"RANK/WORLD_SIZE are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "not: start multi-node runs with torchrun (README, 'Several nodes (torchrun)')")

    def integer(name: str, default: int | None = None) -> int:
        text = env.get(name)
        if text is None and default is not None:
            return default
        try:
            return int(text)
        except (TypeError, ValueError):
            raise ConfigError(f"environment variable {name}={text!r} is not an integer") from None

    rank, world = integer("RANK"), integer("WORLD_SIZE")
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is outside WORLD_SIZE {world}")
    local_rank, local_world = integer("LOCAL_RANK", 0), integer("LOCAL_WORLD_SIZE", 1)
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ConfigError(f"LOCAL_RANK {local_rank} is outside LOCAL_WORLD_SIZE {local_world}")
    return Launch(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        master_addr=env["MASTER_ADDR"], master_port=integer("MASTER_PORT"),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        attempt=integer("TORCHELASTIC_RESTART_COUNT", 0),
    )


def check_launch(mode: str, launch: Launch | None) -> None:
    if launch is not None and launch.world_size > 1 and mode != "replicas":
        raise ConfigError(f"mode {mode!r} trains in one process; under torchrun with WORLD_SIZE "
                          f"{launch.world_size} use mode replicas (one drafter, data-parallel over every node)")


def place_devices(device_lists: Sequence[list[torch.device]], launch: Launch | None,
                  visible: int | None = None) -> list[list[torch.device]]:
    """Device indices are per process. Several processes on one host (--nproc-per-node > 1) that
    all see the host's GPUs use disjoint ones: process LOCAL_RANK r takes GPUs r·G ... r·G + G − 1,
    G being the GPUs one process's layout names. Where each process sees only G GPUs (a launcher
    set CUDA_VISIBLE_DEVICES per process) the indices are used as given. `visible`: the GPUs this
    process sees (default: torch.cuda.device_count())."""
    lists = [list(devices) for devices in device_lists]
    if launch is None or launch.local_world_size == 1:
        return lists
    used = {d.index or 0 for devices in lists for d in devices if d.type == "cuda"}
    if not used:
        return lists
    span = max(used) + 1
    visible = torch.cuda.device_count() if visible is None else visible
    if visible == span:
        return lists
    if visible < span * launch.local_world_size:
        raise ConfigError(
            f"{launch.local_world_size} processes on this host each use {span} GPU(s) (cuda:0..{span - 1} per "
            f"process), which needs {span * launch.local_world_size}; this process sees {visible}"
        )
    offset = launch.local_rank * span

    def shift(d: torch.device) -> torch.device:
        return torch.device("cuda", (d.index or 0) + offset) if d.type == "cuda" else d

    return [[shift(d) for d in devices] for devices in lists]


def gradient_backend(choice: str, drafter_devices: Sequence[torch.device]) -> str:
    """auto: NCCL when every drafter device is a GPU (and this torch has NCCL), else gloo."""
    import torch.distributed as dist

    if choice == "auto":
        on_gpus = all(d.type == "cuda" for d in drafter_devices)
        return "nccl" if on_gpus and dist.is_nccl_available() else "gloo"
    if choice == "nccl" and not dist.is_nccl_available():
        raise ConfigError("dist_backend nccl: this torch build has no NCCL; use gloo")
    return choice


# --- errors ------------------------------------------------------------------------------------

class NodeLost(RuntimeError):
    """Another node stopped answering: its process died, or its machine became unreachable."""

    def __init__(self, message: str, ranks: Sequence[int] = ()):
        super().__init__(message)
        self.ranks = list(ranks)

    @property
    def culprit(self) -> str:
        return ", ".join(f"rank {r}" for r in self.ranks) or "the node group"


class NodeFailure(RuntimeError):
    """Another node failed and every node stopped after the same step; its log has the traceback."""


# --- the node group ----------------------------------------------------------------------------

class Liveness:
    """Which awaited ranks have left: one that wrote why on its way out, or one whose heartbeat
    counter has not moved for `silence_limit` seconds of watching."""

    def __init__(self, store: Any, rank: int, silence_limit: float):
        self.store = store
        self.rank = rank
        self.silence_limit = silence_limit
        self.seen: dict[int, tuple[int, float]] = {}

    def lost(self, ranks: Iterable[int]) -> dict[int, str]:
        now = time.monotonic()
        found = {}
        for r in ranks:
            if r == self.rank:
                continue
            if self.store.check([f"gone/{r}"]):
                found[r] = self.store.get(f"gone/{r}").decode()
                continue
            beats = self.store.add(f"alive/{r}", 0)
            last = self.seen.get(r)
            if last is None or last[0] != beats:
                self.seen[r] = (beats, now)
            elif now - last[1] > self.silence_limit:
                found[r] = (f"no heartbeat for {self.silence_limit:g} s: its process died or its node is unreachable"
                            if beats else f"never joined within {self.silence_limit:g} s")
        return found


class NodeGroup:
    """This process among the nodes of a run, one process per node. `NodeGroup()` without a launch
    is the one-process case: rank 0 of 1, no process group, every collective a no-op."""

    def __init__(self, launch: Launch | None = None, *, backend: str = "gloo", timeout: float = 300.0):
        self.launch = launch
        self.rank = launch.rank if launch else 0
        self.world_size = launch.world_size if launch else 1
        self.backend = backend
        self.timeout = timeout
        self.store: Any = None
        self.gradients: Any = None  # the process group of the gradient all-reduce
        self.control: Any = None  # gloo: votes, agreement, weights at start
        self.stop_requested: str | None = None  # a signal's request, for the next vote
        self.broken = False  # a collective failed: no more collectives
        self.finished = False  # every rank reached `finish`
        self._closing = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def distributed(self) -> bool:
        return self.launch is not None

    @property
    def hosts_store(self) -> bool:
        """Whether the rendezvous store lives in this process (rank 0, where no launcher agent
        hosts it): it must outlive every other rank's last use of it."""
        return self.distributed and not self.launch.agent_store and self.rank == 0

    @property
    def writes(self) -> bool:
        """Rank 0 writes metrics, pipeline.jsonl, checkpoints, the summary and the export, and runs
        the in-training eval; the other ranks write nothing."""
        return self.rank == 0

    def describe(self) -> str:
        if not self.distributed:
            return "one process"
        launch = self.launch
        return (f"rank {self.rank} of {self.world_size} (local rank {launch.local_rank} of {launch.local_world_size}), "
                f"gradients over {self.backend}, votes over gloo, store {launch.master_addr}:{launch.master_port}, "
                f"timeout {self.timeout:g} s")

    # --- lifetime --------------------------------------------------------------------------------

    def __enter__(self) -> "NodeGroup":
        if self.distributed:
            try:
                self._join()
            except BaseException as error:
                self.close(error)
                raise
        return self

    def __exit__(self, _type, error, _traceback) -> None:
        self.close(error)

    def _join(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process")
        launch = self.launch
        prefix = f"dflash/{launch.attempt}"
        self.store = dist.PrefixStore(prefix, self._connect(is_host=self.hosts_store))
        self._start_heartbeat(dist.PrefixStore(prefix, self._connect(is_host=False)))
        # Everyone arrives before any process group forms, so gloo's connection setup (bounded by
        # the timeout) never waits for a rank that is still starting.
        self.wait_for("joined", range(self.world_size), "joining")
        timeout = timedelta(seconds=self.timeout)
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"{prefix}/pg", self._connect(is_host=False)),
                                rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.gradients = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=timeout)

    def _connect(self, is_host: bool) -> Any:
        import torch.distributed as dist

        launch = self.launch
        return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=is_host,
                             timeout=timedelta(seconds=max(JOIN_SECONDS, self.timeout)), wait_for_workers=False)

    def _start_heartbeat(self, store: Any) -> None:
        key = f"alive/{self.rank}"
        store.add(key, 1)

        def beat() -> None:
            while not self._closing.wait(HEARTBEAT_SECONDS):
                try:
                    store.add(key, 1)
                except Exception:  # noqa: BLE001 - the store is gone; the waits report it
                    return

        self._heartbeat = threading.Thread(target=beat, name="node-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self, error: BaseException | None = None) -> None:
        """Leave the group; with an error, say why in the store so waiting ranks name it at once."""
        if not self.distributed or self._closing.is_set():
            return
        import torch.distributed as dist

        if error is not None and self.store is not None:
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            with contextlib.suppress(Exception):
                self.store.set(f"gone/{self.rank}", f"it left with {type(error).__name__}: {first_line}")
        released = error is None and self.finished
        if released and self.hosts_store:
            self._wait_for_release()
        # After an error, worker threads may still be inside a collective; destroying the
        # groups under them aborts the process, so leaving them to process exit is safer.
        if dist.is_initialized() and not self.broken and error is None:
            dist.destroy_process_group()
        if released and not self.hosts_store:
            with contextlib.suppress(Exception):  # its last use of the store (heartbeat still ticking): the host may leave
                self.store.set(f"released/{self.rank}", "1")
        self._closing.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2 * HEARTBEAT_SECONDS)

    def _wait_for_release(self) -> None:
        """The store's host leaves last: a finished rank may still be reading the store (its own
        wait in `finish`, leaving its process groups), and a store gone under it would turn a
        finished run into a NodeLost on that rank. A rank that dies meanwhile is not waited for
        beyond the heartbeat timeout: the run is finished either way."""
        waiting = set(range(self.world_size)) - {self.rank}
        watch = Liveness(self.store, self.rank, self.timeout)
        with contextlib.suppress(Exception):
            while waiting:
                waiting = {r for r in waiting if not self.store.check([f"released/{r}"])}
                waiting -= set(watch.lost(sorted(waiting)))
                if waiting:
                    time.sleep(POLL_SECONDS)

    # --- waiting and collectives -------------------------------------------------------------------

    def wait_for(self, name: str, ranks: Iterable[int], what: str) -> None:
        """Arrive at `name`, then wait until every rank of `ranks` has; with no time limit as long
        as the awaited ranks are alive (heartbeat), else NodeLost naming them."""
        if not self.distributed:
            return
        try:
            self.store.set(f"{name}/{self.rank}", "1")
            waiting = {r for r in ranks if r != self.rank}
            watch = Liveness(self.store, self.rank, self.timeout)
            next_check = 0.0
            while waiting:
                waiting = {r for r in waiting if not self.store.check([f"{name}/{r}"])}
                if waiting and time.monotonic() >= next_check:
                    lost = watch.lost(sorted(waiting))
                    if lost:
                        self.broken = True
                        raise lost_error(lost, f"while {what}")
                    next_check = time.monotonic() + HEARTBEAT_SECONDS
                if waiting:
                    time.sleep(POLL_SECONDS)
        except NodeLost:
            raise
        except Exception as error:  # noqa: BLE001 - the store itself failed
            self.broken = True
            raise NodeLost(f"while {what}: the rendezvous store {self.launch.master_addr}:{self.launch.master_port} "
                           f"stopped answering ({error}); the node hosting it is down") from error

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Turns a failed collective into NodeLost naming the ranks that left."""
        try:
            yield
        except NodeLost:
            raise
        except Exception as error:
            self.broken = True
            raise lost_error(self._name_lost(), what, error) from error

    def _name_lost(self) -> dict[int, str]:
        try:
            watch = Liveness(self.store, self.rank, min(self.timeout, NAMING_SECONDS))
            deadline = time.monotonic() + 2 * min(self.timeout, NAMING_SECONDS)
            while time.monotonic() < deadline:
                lost = watch.lost(range(self.world_size))
                if lost:
                    return lost
                time.sleep(HEARTBEAT_SECONDS / 4)
        except Exception:  # noqa: BLE001 - the store is gone too: nothing to name from
            pass
        return {}

    def set_note(self, key: str, text: str) -> None:
        self.store.set(key, text)

    def note(self, key: str) -> str:
        return self.store.get(key).decode()

    def agree(self, values: Mapping[str, Any], what: str) -> None:
        """Every rank must hold the same `values` (same start step, data stream, ...): a
        ConfigError on every rank naming the ranks and keys that differ from rank 0."""
        if not self.distributed:
            return
        import torch.distributed as dist

        self.wait_for(f"agree/{what}", range(self.world_size), f"waiting to compare {what} (models and data loading)")
        gathered: list[Any] = [None] * self.world_size
        with self.collective(f"comparing {what} across nodes"):
            dist.all_gather_object(gathered, dict(values), group=self.control)
        reference = gathered[0]
        differences = [
            f"rank {r} has {key} = {_short(other.get(key))} where rank 0 has {_short(reference.get(key))}"
            for r, other in enumerate(gathered) for key in reference if other.get(key) != reference.get(key)
        ]
        if differences:
            raise ConfigError(f"the nodes disagree on {what}: " + "; ".join(differences))

    @torch.no_grad()
    def share_weights(self, module: torch.nn.Module) -> None:
        """Rank 0's weights on every rank (a fresh start draws the same ones everywhere; this makes
        it certain, whatever differs between the nodes' torch builds)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        self.wait_for("share weights", range(self.world_size), "waiting to share rank 0's initial weights")
        with self.collective("sharing rank 0's initial weights"):
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src=0, group=self.control)

    def finish(self) -> None:
        """Every rank waits here for the others before leaving: rank 0 writes the summary and the
        export meanwhile, and no launcher kills it because another rank exited first."""
        if self.distributed and not self.broken:
            self.wait_for("finished", range(self.world_size), "finishing")
            self.finished = True

    def interrupts(self, stop: StopSignal) -> Any:
        """What Ctrl-C / SIGTERM stop: on one process the pipeline at once; across nodes only a
        request that the next vote turns into every node stopping after the same step."""
        return StopRequest(self) if self.distributed else stop


def lost_error(lost: Mapping[int, str], what: str, error: BaseException | None = None) -> NodeLost:
    if lost:
        named = "; ".join(f"rank {r}: {why}" for r, why in sorted(lost.items()))
    else:
        named = f"no rank could be named ({type(error).__name__}: {error})"
    return NodeLost(f"{what}: {named}", sorted(lost))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


class StopRequest:
    """The interrupt target across nodes: a signal becomes a request for the next vote."""

    def __init__(self, nodes: NodeGroup):
        self.nodes = nodes
        self.first: float | None = None

    @property
    def stopped(self) -> bool:
        """Whether a further Ctrl-C should abort. torchrun forwards the terminal's Ctrl-C to its
        workers, which then see it twice within milliseconds: that copy does not abort."""
        return self.first is not None and time.monotonic() - self.first > SIGNAL_ECHO_SECONDS

    def stop(self, reason: str) -> None:
        if self.first is None:
            self.first = time.monotonic()
            self.nodes.stop_requested = reason


# --- gradients ---------------------------------------------------------------------------------

class FlatGradients:
    """A replica's gradients in persistent flat buffers, one per dtype: filled from the
    parameters' .grad after the backward, copied back after the reduction; no allocation per step."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        self.groups = [
            (group, torch.empty(sum(p.numel() for p in group), dtype=dtype, device=group[0].device))
            for dtype, group in by_dtype.items()
        ]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [buffer for _, buffer in self.groups]

    @torch.no_grad()
    def load(self) -> None:
        for params, buffer in self.groups:
            grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            torch.cat(grads, out=buffer)

    @torch.no_grad()
    def store(self) -> None:
        for params, buffer in self.groups:
            views = [v.view_as(p) for p, v in zip(params, buffer.split([p.numel() for p in params]))]
            for param, view in zip(params, views):
                if param.grad is None:
                    param.grad = view.clone()
            grads = [p.grad for p in params]
            if hasattr(torch, "_foreach_copy_"):  # one kernel launch per dtype and device, not one per tensor
                torch._foreach_copy_(grads, views)
            else:
                for grad, view in zip(grads, views):
                    grad.copy_(view)


class ReduceTimer:
    """Time in the cross-node all-reduce: host time on CPU; on CUDA, events read once they have
    completed, so timing never makes the host wait for the GPU."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self.count = 0
        self._pending: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def measure(self, tensor: torch.Tensor) -> Iterator[None]:
        self.count += 1
        if tensor.device.type != "cuda":
            started = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - started
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((start, end))
        self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        pending = []
        for start, end in self._pending:
            if wait:
                end.synchronize()
            if end.query():
                self._seconds += start.elapsed_time(end) / 1000
            else:
                pending.append((start, end))
        self._pending = pending

    @property
    def seconds(self) -> float:
        self._collect(wait=True)
        return self._seconds


# --- one step across nodes ---------------------------------------------------------------------

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


class NodeStep:
    """The cross-node part of a drafter's steps, called from the thread of the node's first replica.

    Vote k happens in step k, after every local replica's backward and before the gradient
    all-reduce; each node votes once per step it reaches, and once more when its first replica
    leaves (finished, stopped or failed) if the others will wait for that vote. A vote carries
    each rank's word (go on, finished, stopping, failed), whether it has work of its own before
    the next vote, and its node's totals of the previous step.
    """

    def __init__(self, nodes: NodeGroup, *, drafter: str, start: int, end: int, local_replicas: int,
                 block_size: int, stop: StopSignal, reports: queue.Queue,
                 busy_after: Callable[[int], bool] | None = None):
        self.nodes = nodes
        self.drafter = drafter
        self.start, self.end = start, end
        self.local_replicas = local_replicas
        self.layout = metric_layout(block_size)
        self.width = 3 + sum(shape.numel() for shape in self.layout.values())
        self.stop = stop
        self.reports = reports
        self.busy_after = busy_after or (lambda step: False)
        self.next_vote = start
        self.done = False  # a vote ended the run here, or the group broke: no more votes
        # Ranks that announced work of their own before the next vote; at the first vote, every
        # rank (its first step compiles, which takes the longest and the least predictably).
        self.awaited: list[int] = list(range(nodes.world_size))
        self.timer = ReduceTimer()
        self._totals: dict[int, list] = {}
        self._recorded = threading.Condition()

    # --- called by every local replica ---

    def record(self, step: int, loss: float, metric_sums: Mapping[str, torch.Tensor], samples: int,
               tokens: int) -> None:
        vector = torch.cat([torch.tensor([loss, samples, tokens], dtype=torch.float64),
                            *(metric_sums[k].reshape(-1).double() for k in self.layout)])
        with self._recorded:
            entry = self._totals.setdefault(step, [0, torch.zeros(self.width, dtype=torch.float64)])
            entry[0] += 1
            entry[1] += vector
            self._recorded.notify_all()

    # --- called by the first replica's thread ---

    def continue_or_stop(self) -> None:
        """Vote before this step's gradient all-reduce: every node goes on, or every node stops
        here (PipelineStopped; this step's gradients are dropped everywhere)."""
        request = self.nodes.stop_requested
        step = self.next_vote
        codes = self._vote(STOPPING if request else CONTINUE, request or "", wait_for_totals=0.0)
        if any(code in (STOPPING, FAILED) for code in codes):
            self._stop_everywhere(codes, step)
            raise PipelineStopped(self.stop.reason)

    def all_reduce(self, buffer: torch.Tensor) -> None:
        import torch.distributed as dist

        try:
            with self.nodes.collective(f"the gradient all-reduce of step {self.next_vote}"), self.timer.measure(buffer):
                dist.all_reduce(buffer, group=self.nodes.gradients)
        except NodeLost:
            self._lost()

    def leave(self, completed: int, failure: str | None = None) -> None:
        """The first replica is exiting (`failure`: why, if its own thread failed): cast the vote
        the other nodes wait for next (finished, stopping, or failed), unless a vote already
        ended the run."""
        if self.done or self.nodes.broken or self.next_vote > self.end:
            return
        if failure is not None or self.stop.failures:
            code, reason = FAILED, failure or self.stop.reason or "a worker failed"
        elif completed >= self.end:
            code, reason = FINISHED, ""
        else:
            code, reason = STOPPING, self.stop.reason or self.nodes.stop_requested or "stopped"
        step = self.next_vote
        try:
            codes = self._vote(code, reason, wait_for_totals=1.0)
        except PipelineStopped:
            return
        self.done = True
        if code == FINISHED and any(c in (STOPPING, FAILED) for c in codes):
            self._stop_everywhere(codes, step)

    @property
    def seconds(self) -> float:
        return self.timer.seconds

    # --- the vote ---

    def _vote(self, code: int, reason: str, wait_for_totals: float) -> list[int]:
        import torch.distributed as dist

        nodes, world, step = self.nodes, self.nodes.world_size, self.next_vote
        try:
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
        except NodeLost:
            self._lost()
        self.next_vote = step + 1
        self.awaited = [r for r in range(world) if payload[world + r] > 0]
        if step > self.start:
            self.reports.put(self._totals_message(step - 1, payload[2 * world:]))
        return [int(round(float(c))) for c in payload[:world]]

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

    def _stop_everywhere(self, codes: list[int], step: int) -> None:
        """Every node read the same codes: stop this node after the same step, with the reason."""
        self.done = True
        me = self.nodes.rank
        failed = [r for r, code in enumerate(codes) if code == FAILED and r != me]
        asked = [r for r, code in enumerate(codes) if code == STOPPING]
        if failed:
            why = "; ".join(f"rank {r} failed ({self.nodes.note(f'reason/{step}/{r}')})" for r in failed)
            try:
                raise NodeFailure(f"{why}; every node stopped after step {step} (see that rank's log for the traceback)")
            except NodeFailure as error:
                self.stop.fail(", ".join(f"rank {r}" for r in failed), error)
        elif asked:
            self.stop.stop(f"{self.nodes.note(f'reason/{step}/{asked[0]}')} on rank {asked[0]}")

    def _lost(self) -> None:
        """Called in an `except NodeLost` block: fail this node (naming the lost ranks) and stop."""
        import sys

        error = sys.exc_info()[1]
        self.done = True
        self.stop.fail(error.culprit, error)
        raise PipelineStopped(str(error)) from error
