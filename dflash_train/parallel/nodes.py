"""Several nodes: one process per node under torchrun, torch.distributed between them.

Inside a node the threaded pipeline runs as on one machine. Across nodes, `NodeGroup` holds the
rendezvous store, the gradient process group (NCCL on GPUs, gloo on CPU), a gloo control group
and a heartbeat; says who writes (rank 0); and waits as long as every awaited rank is alive. A
node that dies is named by its missing heartbeat (or the reason it left, written to the store on
its way out) within `--dist-timeout` seconds (`Liveness`, `NodeLost`).

What runs across nodes every step, called by each drafter's step loop: the vote (vote.py: does
every node go on?) and the gradient all-reduce (gradients.py). The launch itself: launch.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from ..errors import ConfigError, RunFailed
from .launch import Launch

HEARTBEAT_SECONDS = 1.0  # how often each rank bumps its heartbeat counter in the store
POLL_SECONDS = 0.05  # store polling while waiting for a rank (only on slow paths)
NAMING_SECONDS = 3.0  # after a failed collective: how long a silent heartbeat takes to name its rank
LINGER_SECONDS = 3 * HEARTBEAT_SECONDS  # after an error, how long the store's host waits for the others to read why
JOIN_SECONDS = 600.0  # how long a rank waits for the rendezvous store to accept it


class NodeLost(RunFailed):
    """Another node stopped answering: its process died, or its machine became unreachable. A
    run failure the message explains (one line and exit 1 at the command line), not a bug."""

    def __init__(self, message: str, ranks: Sequence[int] = ()):
        super().__init__(message)
        self.ranks = list(ranks)

    @property
    def culprit(self) -> str:
        return ", ".join(f"rank {r}" for r in self.ranks) or "the node group"


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
        self._in_flight = 0  # collectives under way in any thread of this process
        self._in_flight_lock = threading.Lock()
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
        try:
            return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=is_host,
                                 timeout=timedelta(seconds=max(JOIN_SECONDS, self.timeout)), wait_for_workers=False)
        except RuntimeError as error:  # torch's DistNetworkError: the port another process holds is bad input
            if is_host and ("EADDRINUSE" in str(error) or "address already in use" in str(error).lower()):
                raise ConfigError(f"MASTER_PORT {launch.master_port}: another process already listens on it at "
                                  f"{launch.master_addr}; choose a free port") from None
            raise

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
        if dist.is_initialized():
            self._destroy_groups(clean=error is None and not self.broken)
        if error is not None and self.hosts_store:
            self._linger_for_readers()
        if released and not self.hosts_store:
            with contextlib.suppress(Exception):  # its last use of the store (heartbeat still ticking): the host may leave
                self.store.set(f"released/{self.rank}", "1")
        self._closing.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2 * HEARTBEAT_SECONDS)

    def _destroy_groups(self, clean: bool) -> None:
        """Destroy the process groups while the interpreter is whole: a gloo group left to process
        exit aborts it now and then ("terminate called without an active exception", exit -6 where
        2 was due). Not under a collective another thread is still inside (that aborts at once);
        an NCCL group only after a clean run, since a failed step may leave its work on the GPU."""
        import torch.distributed as dist

        with self._in_flight_lock:
            if self._in_flight:
                return
        # Our own references go too: they would keep a destroyed group's C++ object (its worker
        # threads, holding the last collective's work and tensors) alive into interpreter
        # shutdown, whose teardown of it is the abort above.
        if clean or self.backend == "gloo":
            dist.destroy_process_group()
            self.gradients = self.control = None
        elif self.control is not None:
            dist.destroy_process_group(self.control)
            self.control = None

    def _linger_for_readers(self) -> None:
        """After an error, the store's host stays until every other rank has left too (each writes
        why), at most LINGER_SECONDS: a rank waiting on it then reads the reason it wrote, where
        the store gone with it would only say that its node is down."""
        deadline = time.monotonic() + LINGER_SECONDS
        waiting = set(range(self.world_size)) - {self.rank}
        with contextlib.suppress(Exception):
            while waiting and time.monotonic() < deadline:
                waiting = {r for r in waiting if not self.store.check([f"gone/{r}"])}
                if waiting:
                    time.sleep(POLL_SECONDS)

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
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            yield
        except NodeLost:
            raise
        except Exception as error:
            self.broken = True
            raise lost_error(self._name_lost(), what, error) from error
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1

    def _name_lost(self) -> dict[int, str]:
        try:
            watch = Liveness(self.store, self.rank, min(self.timeout, NAMING_SECONDS))
            deadline = time.monotonic() + 2 * min(self.timeout, NAMING_SECONDS)
            while time.monotonic() < deadline:
                lost = watch.lost(range(self.world_size))
                if lost:
                    return lost
                time.sleep(HEARTBEAT_SECONDS / 4)
        except Exception:  # noqa: BLE001 - the store is gone too: only its host can be named
            if self.distributed and not self.launch.agent_store and not self.hosts_store:
                return {0: "the rendezvous store it hosts stopped answering: its process died or its node is unreachable"}
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


def lost_error(lost: Mapping[int, str], what: str, error: BaseException | None = None) -> NodeLost:
    if lost:
        named = "; ".join(f"rank {r}: {why}" for r, why in sorted(lost.items()))
    else:
        named = f"no rank could be named ({type(error).__name__}: {error})"
    return NodeLost(f"{what}: {named}", sorted(lost))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."
