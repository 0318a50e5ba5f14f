"""The compile gate: every compile of a run happens inside the warm-up, one worker at a time; after
it, nothing compiles.

torch.compile is not thread-safe (docs/ARCHITECTURE.md, "Compiling in threads"): a compile in one
thread can break a compiled call, or another compile, in another. The warm-up (`startup.Warmup`)
runs each worker's compiles and captures alone, under one lock, and holds every worker at a start
line until all are done. This module adds what makes that a rule rather than a habit:

    inside      `warming(worker)`: the dynamo recompile limits, set in the warming thread (dynamo's
                config is per thread from torch 2.12), sized for every bucket of every thread, a
                limit hit an error (past it dynamo would silently run flex unfused)
    close       once every warm-up is done (the start line's action): `torch.compiler.set_stance`
                (process-wide) makes a call that would compile run eagerly, or fail loudly with
                `--fail-on-recompile`; a compile that starts anyway (a lazily compiled backward is
                not governed by the stance) is counted, and is an error with `--fail-on-recompile`
    count       one counter of compile starts (torch's compile-start callback), credited to the
                warming worker inside the gate and to the compiling thread after it: the step
                line's "compiles N (recompiles M)"
    release     the stance back as it was when the run ends

Eager is the default after the gate because a call warm-up did not cover (a shape outside the
buckets, a guard warm-up did not see) then costs speed, never a race and never the run; the step
line's counter shows any compile that escaped, and `--fail-on-recompile` turns both into errors.
"""

from __future__ import annotations

import contextlib
import threading
import types
import warnings
from typing import Any, Iterator

import torch
import torch._dynamo.callback

from ..errors import ConfigError

STANCE_AFTER_WARMUP = {"eager": "eager_on_recompile", "fail": "fail_on_recompile"}


class CompileAfterWarmupError(RuntimeError):
    """Something compiled after every warm-up was done (`--fail-on-recompile`)."""


def recompile_limit_for(num_shape_buckets: int, num_threads: int, *, slack: int = 8) -> int:
    """Dynamo's per-function recompile limit for `num_threads` threads calling one compiled function
    (each replica's guards differ) at `num_shape_buckets` static shapes, plus `slack` for other
    guard variants (grad mode, dtype); never below dynamo's default of 8."""
    return max(8, num_shape_buckets * num_threads + slack)


class _CompileCounter:
    """Compile starts in this process (dynamo frames and lazily compiled backwards), by credit."""

    COUNTED = ("DYNAMO", "LAZY_BACKWARD")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gates: list[CompileGate] = []
        self.registered = False

    def attach(self, gate: "CompileGate") -> None:
        with self.lock:
            # torch._dynamo.reset() (tests, notebooks, libraries) clears every compile callback, so
            # "registered once" is not enough: register again whenever ours is no longer listed.
            listed = getattr(getattr(torch._dynamo.callback, "callback_handler", None), "start_callbacks", None)
            if not self.registered or (listed is not None and self.on_start not in listed):
                torch._dynamo.callback.on_compile_start(self.on_start)
                self.registered = True
            self.gates.append(gate)

    def detach(self, gate: "CompileGate") -> None:
        with self.lock:
            if gate in self.gates:
                self.gates.remove(gate)

    def on_start(self, args: Any = None) -> None:
        # A torch that passes no arguments (or other ones) still has every compile counted.
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if trigger not in self.COUNTED:
            return
        with self.lock:
            gates = list(self.gates)
        for gate in gates:
            gate._on_compile(trigger, str(getattr(args, "compile_id", "?")))


_COUNTER = _CompileCounter()


class CompileGate:
    """One run's gate (a context manager: entered before the workers start, left after they end)."""

    def __init__(self, *, recompile_limit: int, after_warmup: str = "eager"):
        if after_warmup not in STANCE_AFTER_WARMUP:
            raise ValueError(f"after_warmup: {after_warmup!r} is not one of {sorted(STANCE_AFTER_WARMUP)}")
        self.recompile_limit = recompile_limit
        self.after_warmup = after_warmup
        self.closed = False
        self.compiles = 0
        self.compiles_after_warmup = 0
        self.by_worker: dict[str, dict[str, int]] = {}
        self._warming: str | None = None
        self._stance: Any = None
        self._lock = threading.Lock()

    def __enter__(self) -> "CompileGate":
        problem = gate_problem()
        if problem is not None:
            raise ConfigError(f"torch {torch.__version__}: the compile gate cannot hold ({problem}); "
                              "train with --compile off --attention sdpa (nothing compiled), or another torch")
        _COUNTER.attach(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    @contextlib.contextmanager
    def warming(self, worker: str) -> Iterator[None]:
        """Around one worker's warm-up, in its thread, while it alone runs (`Warmup.lock`)."""
        if self.closed:
            raise RuntimeError(f"{worker}: warm-up after the compile gate closed")
        config = torch._dynamo.config  # per thread from torch 2.12: set here, not in the main thread
        config.recompile_limit = max(config.recompile_limit, self.recompile_limit)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * self.recompile_limit)
        config.fail_on_recompile_limit_hit = True
        self._warming = worker
        try:
            yield
        finally:
            self._warming = None

    def close(self) -> None:
        """Every warm-up is done: from now on a call that would compile runs eagerly or fails."""
        if not self.closed:
            self._stance = torch.compiler.set_stance(STANCE_AFTER_WARMUP[self.after_warmup])
            self.closed = True

    def release(self) -> None:
        """The run is over: the stance as it was before `close`, the counter detached."""
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None
        _COUNTER.detach(self)

    def _on_compile(self, trigger: str, compile_id: str) -> None:
        with self._lock:
            after = self.closed
            credit = self._warming or threading.current_thread().name
            self.compiles += 1
            counts = self.by_worker.setdefault(credit, {"warm_up": 0, "after_warmup": 0})
            counts["after_warmup" if after else "warm_up"] += 1
            if after:
                self.compiles_after_warmup += 1
        if not after:
            return
        message = (f"{credit}: a compile after every warm-up was done ({trigger}, compile id {compile_id}): "
                   "a shape outside the warmed buckets or a guard the warm-up did not see; "
                   "TORCH_LOGS=recompiles names it")
        if self.after_warmup == "fail":
            raise CompileAfterWarmupError(message + " (--fail-on-recompile)")
        warnings.warn(message, stacklevel=2)

    def describe(self) -> str:
        after = ("a call that would compile runs eagerly (--fail-on-recompile makes it an error)"
                 if self.after_warmup == "eager" else "a call that would compile is an error (--fail-on-recompile)")
        return (f"every compile in the warm-up, one worker at a time (recompile limit {self.recompile_limit}); "
                f"after it {after}")

    def worker_compiles(self, worker: str) -> dict[str, int]:
        return dict(self.by_worker.get(worker, {"warm_up": 0, "after_warmup": 0}))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"compiles": self.compiles, "after_warmup": self.compiles_after_warmup,
                    "stance_after_warmup": STANCE_AFTER_WARMUP[self.after_warmup],
                    "by_worker": {name: dict(counts) for name, counts in self.by_worker.items()}}


def _probe_body(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def gate_problem() -> str | None:
    """None when this torch behaves as the gate needs, else what it does not do: a compile is
    seen by the counter, and after `close` a new shape neither compiles (eager stance: it runs,
    uncompiled, with the right result) nor runs (fail stance: it raises). A behaviour probe on a
    fresh function (its own code object, so its own cache), not a version check: no compile runs
    in another thread meanwhile (it is called before the workers start)."""
    function = types.FunctionType(_probe_body.__code__.replace(), globals(), "compile_gate_probe")
    compiled = torch.compile(function, backend="eager", dynamic=False)
    probe = CompileGate(recompile_limit=8)
    _COUNTER.attach(probe)
    try:
        try:
            compiled(torch.ones(2))
        except Exception as error:  # noqa: BLE001 - a torch whose compiles fail with the counter on
            return f"a first compile failed ({type(error).__name__}: {error})"
        if probe.compiles != 1:
            return f"the compile-start callback counted {probe.compiles} compiles of one new function, not 1"
        probe.close()
        if not torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0)) or probe.compiles != 1:
            return "after set_stance('eager_on_recompile') a new shape compiled"
        with torch.compiler.set_stance("fail_on_recompile"):
            try:
                compiled(torch.ones(4))
            except Exception:  # noqa: BLE001 - dynamo's own error: what the fail stance should raise
                return None if probe.compiles == 1 else "set_stance('fail_on_recompile') raised after compiling"
        return "after set_stance('fail_on_recompile') a new shape ran without an error"
    finally:
        probe.release()
