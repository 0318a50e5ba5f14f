"""A run's start-up: whether CUDA graphs are used, each worker's warm-up before step 1, and its timing.

    choose      `--cuda-graphs auto|on|off` against the layout: on needs CUDA devices (a ConfigError
                otherwise); auto uses graphs on CUDA runs, where each worker's warm-up then proves
                them (train/step_graphs.py, feature_graphs.py) or falls back with one warning
    attach      each replica gets its step (a GraphedStep, or the eager step with its compiles
                done up front) and each live target its graphed feature forward
    warm up     every worker compiles and captures its buckets in its own thread before step 1,
                one worker at a time (`Warmup.lock`: no thread trains, compiles or captures while
                another captures), with a progress line per bucket; then all start together, and
                the compile gate closes (train/compile_gate.py: nothing compiles after it)
    clock       time to the first step and to full speed (the first step after the last compile),
                printed after step 1 and written to the first metrics record and summary.json
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from ..config import ConfigError, TrainConfig
from ..parallel.threads import PipelineStopped, StopSignal
from ..target.model import Target
from .compile_cache import CompileCacheReport, save_compile_cache
from .compile_gate import CompileGate
from .feature_graphs import GraphedFeatures
from .step_graphs import GraphedStep, step_shapes, warm_compile

Prepare = Callable[[Callable[[str], None]], str]


# --- choose ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphChoice:
    enabled: bool
    reason: str


def choose_cuda_graphs(config: TrainConfig, devices: list[torch.device]) -> GraphChoice:
    """What `--cuda-graphs` means for this layout (before any model loads)."""
    if config.parallel.cuda_graphs == "off":
        return GraphChoice(False, "off (--cuda-graphs off)")
    not_cuda = [d for d in devices if d.type != "cuda"]
    if not_cuda:
        if config.parallel.cuda_graphs == "on":
            raise ConfigError(f"--cuda-graphs on: CUDA graphs need CUDA devices, and {not_cuda[0]} is not one "
                              "(use --cuda-graphs auto or off)")
        return GraphChoice(False, f"off (auto: {not_cuda[0]} is not a CUDA device)")
    # FP8 included: --fp8 head and --fp8 all have both trained the SmolLM2 recipe graphed
    # (docs/PERF.md); each bucket's capture is still checked against its eager step.
    return GraphChoice(True, f"{config.parallel.cuda_graphs}: captured per bucket in the warm-up, eager where refused")


# --- attach ------------------------------------------------------------------------------------

def attach_step(replica: Any, config: TrainConfig, choice: GraphChoice, lengths: list[int],
                feature_dtype: torch.dtype, compiled: bool) -> None:
    """The replica's step (a replicas.Replica): graphed (choice enabled), or eager with its compiles up front."""
    shapes = step_shapes(lengths, config.optimizer.batch_size, replica.objective, len(replica.layer_ids) * replica.drafter.config.hidden_size,
                         feature_dtype, replica.frozen.head_weight.shape[0])
    thread = f"{replica.name}[{replica.rank}]"
    if choice.enabled:
        replica.graphed = GraphedStep(name=thread, step=replica.step, shapes=shapes)
        replica.prepare = replica.graphed.prepare
        return
    replica.step.hand_over_gradients()
    if compiled:
        replica.prepare = functools.partial(warm_compile, replica.step, shapes)


def graphed_sources(sources: list[Any], choice: GraphChoice, lengths: list[int], batch_size: int,
                    compiled: Callable[[torch.device, Target], bool]) -> list[Any]:
    """Live targets' feature sources with their forward graphed (feature caches stay as they are),
    compiled first where `compiled(device, target)` says so."""
    if not choice.enabled:
        return sources
    out = []
    for source in sources:
        target = getattr(source, "target", None)
        out.append(GraphedFeatures(source, target, lengths, batch_size, compiled=compiled(source.device, target))
                   if target is not None else source)
    return out


def feature_dtype(sources: list[Any]) -> torch.dtype:
    """The dtype features arrive in: a cache source says; a live target's is its weights'."""
    source = sources[0]
    dtype = getattr(source, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else source.target.embed_weight.dtype


# --- warm up -----------------------------------------------------------------------------------

class Warmup:
    """Every worker's warm-up, one worker at a time, then a start line all workers cross together."""

    def __init__(self, workers: int, stop: StopSignal, log: TextIO, *, run_dir: Path | None = None,
                 compile_cache: CompileCacheReport | None = None, gate: CompileGate | None = None):
        self.stop = stop
        self.gate = gate
        self.log = log
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(workers, action=self._all_ready)  # the action runs before any is released
        stop.on_stop(self.barrier.abort)
        self.run_dir, self.compile_cache = run_dir, compile_cache
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self.began: float | None = None
        self.ready: float | None = None

    def say(self, line: str) -> None:
        print(f"warm-up: {line}", file=self.log, flush=True)

    def run(self, worker: Any, prepare: Prepare | None) -> None:
        """In the worker's thread: its warm-up (if any), then wait until every worker is ready."""
        if self.began is None:
            self.began = time.monotonic()
        if prepare is not None:
            with self.lock:
                self.stop.check()
                started = time.monotonic()
                with self.gate.warming(worker.name) if self.gate is not None else contextlib.nullcontext():
                    note = prepare(lambda line: self.say(f"{worker.name}: {line}"))
                self.seconds[worker.name] = round(time.monotonic() - started, 2)
                self.notes[worker.name] = note
                self.say(f"{worker.name} ready in {self.seconds[worker.name]:.1f}s: {note}")
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise PipelineStopped(self.stop.reason or "the warm-up was stopped") from None
        worker.meter.start(worker.times.waiting)

    def _all_ready(self) -> None:
        if self.gate is not None:
            self.gate.close()
        self.ready = time.monotonic()
        if self.seconds:
            self.say(f"all workers ready after {self.ready - (self.began or self.ready):.1f}s; training starts")
        if self.compile_cache is not None and self.run_dir is not None:
            try:
                save_compile_cache(self.run_dir, self.compile_cache, self.log)
            except Exception as error:  # noqa: BLE001 - a cache that cannot be written never stops training
                warnings.warn(f"compile cache: not saved ({type(error).__name__}: {error})", stacklevel=2)

    @property
    def warmup_s(self) -> float | None:
        """Wall time from the first worker's start to all being ready (None when nobody had a warm-up)."""
        if self.began is None or self.ready is None or not self.seconds:
            return None
        return round(self.ready - self.began, 2)


# --- clock -------------------------------------------------------------------------------------

@dataclass
class StartupClock:
    """Time to the first step and to full speed, from the workers' start (`Coordinator.started`)."""

    warmup: Warmup | None
    first_step_s: float | None = None
    full_speed_s: float | None = None
    _compiles: int | None = None
    fields: dict = field(default_factory=dict)

    def observe(self, record: dict, compiles: int) -> str | None:
        """Called for each step record of the first drafter with the run's compile count so far;
        adds the start-up numbers to the first record and returns the line to print then."""
        elapsed = record["elapsed_s"]
        first = self.first_step_s is None
        if first:
            self.first_step_s = elapsed
            self._compiles = compiles
            self.full_speed_s = elapsed
        elif compiles > (self._compiles or 0):  # this step compiled: full speed only after it
            self._compiles = compiles
            self.full_speed_s = None
        elif self.full_speed_s is None:
            self.full_speed_s = elapsed
        if not first:
            return None
        warmup_s = self.warmup.warmup_s if self.warmup is not None else None
        self.fields = {"time_to_first_step_s": elapsed, "warmup_s": warmup_s}
        if warmup_s is not None:  # everything compiled and captured up front: full speed from step 1 on
            self.fields["time_to_full_speed_s"] = elapsed
        record.update(self.fields)
        per_worker = ", ".join(f"{name} {s:.1f}s" for name, s in (self.warmup.seconds if self.warmup else {}).items())
        return (f"startup: first step after {elapsed:.1f}s"
                + (f", warm-up (compile + capture, one worker at a time) {warmup_s:.1f}s" if warmup_s is not None else "")
                + (f" [{per_worker}]" if per_worker else ""))

    def summary(self) -> dict:
        warmup = self.warmup
        return {
            "time_to_first_step_s": self.first_step_s,
            "time_to_full_speed_s": self.full_speed_s,
            "warmup_s": warmup.warmup_s if warmup is not None else None,
            "warmup_per_worker_s": dict(warmup.seconds) if warmup is not None else {},
            "warmup_notes": dict(warmup.notes) if warmup is not None else {},
            "compile_cache": warmup.compile_cache.as_dict() if warmup is not None and warmup.compile_cache else None,
        }
