"""The compile gate (train/compile_gate.py) with real threads and real torch.compile.

The invariant that keeps torch.compile's races out of the threaded trainer: warm-ups run one at
a time, and once every warm-up is done nothing compiles. A call that would compile runs eagerly
(the default) or fails loudly (`--fail-on-recompile`), in every thread at once."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
import types
import warnings

import pytest
import torch
from dflash_train.target.model import Target
from tiny import pattern_samples, tiny_hf_model, tiny_target, tiny_train_config

from dflash_train.errors import ConfigError
from dflash_train.parallel.threads import StopSignal, Worker
from dflash_train.train.compile_gate import CompileGate, gate_problem
from dflash_train.train.startup import Warmup
from dflash_train.train.trainer import train

WORKERS = 3
LIMIT = 40


def _body(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


def _fresh_compiled():
    """A compiled function with its own code object, so its compile cache is this test's alone."""
    function = types.FunctionType(_body.__code__.replace(), globals(), "gate_test_function")
    return torch.compile(function, backend="eager", dynamic=False)


class CompilingWorker(Worker):
    """A pipeline worker thread whose warm-up compiles `compiled` at its own length (each holds the
    gate a while, so warm-ups without the lock would overlap), then, past the start line, calls it
    at a length nobody warmed, all workers at once."""

    def __init__(self, index: int, warmup: Warmup, compiled, after_gate: threading.Barrier, log: dict):
        super().__init__(f"worker-{index}", warmup.stop, torch.device("cpu"))
        self.index, self.warmup, self.compiled, self.after_gate, self.log = index, warmup, compiled, after_gate, log

    def prepare(self, say) -> str:
        with self.log["lock"]:
            self.log["inside"] += 1
            self.log["most_inside"] = max(self.log["most_inside"], self.log["inside"])
            self.log["limits"][self.name] = torch._dynamo.config.recompile_limit  # this thread's config
        try:
            self.compiled(torch.ones(self.index + 2))
            time.sleep(0.2)
        finally:
            with self.log["lock"]:
                self.log["inside"] -= 1
                self.log["warm_ends"].append(time.monotonic())
        return "warmed"

    def work(self) -> None:
        self.warmup.run(self, self.prepare)
        self.log["released"][self.name] = time.monotonic()
        self.after_gate.wait(timeout=60)
        try:
            self.log["new_shape"][self.name] = self.compiled(torch.ones(17))
        except Exception as error:  # noqa: BLE001 - the fail stance's error, kept for the test
            self.log["new_shape"][self.name] = error


def _run_gated_workers(after_warmup: str) -> tuple[CompileGate, dict]:
    compiled = _fresh_compiled()
    log = {"lock": threading.Lock(), "inside": 0, "most_inside": 0, "limits": {}, "warm_ends": [], "released": {},
           "new_shape": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile after the gate warns in eager mode: make it fail here
        with CompileGate(recompile_limit=LIMIT, after_warmup=after_warmup) as gate:
            warmup = Warmup(WORKERS, StopSignal(), io.StringIO(), gate=gate)
            after_gate = threading.Barrier(WORKERS)
            workers = [CompilingWorker(i, warmup, compiled, after_gate, log) for i in range(WORKERS)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(120)
            assert not any(w.is_alive() for w in workers)
            assert not warmup.stop.failures, [f.traceback for f in warmup.stop.failures]
            assert gate.closed
    return gate, log


@pytest.mark.parametrize("after_warmup", ["eager", "fail"])
def test_warm_ups_run_one_at_a_time_and_nothing_compiles_after_the_gate(after_warmup):
    gate, log = _run_gated_workers(after_warmup)
    # Warm-ups one at a time, each with the gate's recompile limit set in its own thread, and no
    # worker past the start line before the last warm-up ended.
    assert log["most_inside"] == 1
    assert log["limits"] == {f"worker-{i}": LIMIT for i in range(WORKERS)}
    assert min(log["released"].values()) >= max(log["warm_ends"])
    # Every compile happened inside the gate, credited to the worker warming then.
    assert gate.compiles == WORKERS and gate.compiles_after_warmup == 0
    assert gate.by_worker == {f"worker-{i}": {"warm_up": 1, "after_warmup": 0} for i in range(WORKERS)}
    # A length nobody warmed, called by every worker at once after the gate: nothing compiled.
    results = log["new_shape"]
    assert len(results) == WORKERS
    if after_warmup == "eager":
        expected = torch.sin(torch.ones(17)) * 2 + 1
        assert all(torch.equal(result, expected) for result in results.values()), results
    else:
        assert all(isinstance(r, RuntimeError) and "fail_on_recompile" in str(r) for r in results.values()), results
    assert gate.snapshot()["stance_after_warmup"] == f"{after_warmup}_on_recompile"


def test_the_gate_gives_the_stance_back_when_the_run_ends():
    """After a run's gate is left, the next run (here a plain call) compiles new shapes again."""
    _run_gated_workers("fail")
    compiled = _fresh_compiled()
    with CompileGate(recompile_limit=8) as gate:
        compiled(torch.ones(5))
        compiled(torch.ones(6))
    assert gate.compiles == 2 and gate.compiles_after_warmup == 0


def test_this_torch_holds_the_gate():
    assert gate_problem() is None


def test_the_gate_still_counts_after_torch_dynamo_reset():
    """torch._dynamo.reset() (a test's, a notebook's, a library's) clears every compile callback:
    the next run's gate registers its counter again rather than finding it gone and refusing the run."""
    with CompileGate(recompile_limit=8):  # the counter registered in this process
        pass
    torch._dynamo.reset()
    compiled = _fresh_compiled()
    with CompileGate(recompile_limit=8) as gate:
        compiled(torch.ones(5))
    assert gate.compiles == 1 and gate.by_worker == {"MainThread": {"warm_up": 1, "after_warmup": 0}}


@pytest.mark.filterwarnings("ignore:.*a compile after every warm-up")  # the probe's compiles, stance left on
def test_a_torch_whose_stance_does_not_hold_is_refused(monkeypatch):
    """Fail closed on behaviour, not on a version: a torch where set_stance leaves compiling on
    (here a set_stance that does nothing) is refused before any worker starts, naming the way out."""
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *args, **kwargs: contextlib.nullcontext())
    assert "a new shape compiled" in gate_problem()
    with pytest.raises(ConfigError, match="compile gate cannot hold.*--compile off --attention sdpa"):
        with CompileGate(recompile_limit=8):
            pass


def test_a_step_that_compiles_after_the_gate_is_an_error_with_fail_on_recompile():
    """--fail-on-recompile: a compile that starts after the gate anyway (here under an explicit
    default stance, as a lazily compiled backward would) stops with an error naming the thread."""
    compiled = _fresh_compiled()
    with CompileGate(recompile_limit=8, after_warmup="fail") as gate:
        gate.close()
        with torch.compiler.set_stance("default"), pytest.raises(Exception, match="MainThread: a compile after every warm-up"):
            compiled(torch.ones(7))
    assert gate.compiles_after_warmup == 1


@pytest.mark.slow
def test_a_compiled_cpu_run_with_two_drafter_threads_compiles_only_in_the_warm_up(tmp_path):
    """train() on the CPU with the drafter compiled (inductor) and two replica threads, under
    --fail-on-recompile: every compile in the warm-up, none after it over every step (a step that
    would compile stops the run), and the step line shows the count (1-2 min on 2 cores)."""
    log = io.StringIO()
    config = tiny_train_config(tmp_path, steps=4, compile="on", attention="sdpa", log_every=1, save_every=4,
                               export_dtype="", mode="replicas", drafter_devices=["cpu", "cpu"], fail_on_recompile=True)
    summary = train(config, samples=pattern_samples(32), target=tiny_target("llama", layers=6), log=log)
    compiles = summary["compiles"]
    assert summary["steps_done"]["drafter"] == 4
    assert compiles["compiles"] > 0 and compiles["after_warmup"] == 0, compiles
    assert compiles["stance_after_warmup"] == "fail_on_recompile"
    step_lines = [line for line in log.getvalue().splitlines() if line.startswith("step ")]
    assert len(step_lines) == 4 and all(f"compiles {compiles['compiles']} (recompiles 0)" in line for line in step_lines)


@pytest.mark.slow
def test_compiled_cpu_runs_with_three_drafter_variants_credit_each_compile_to_its_warm_up(tmp_path):
    """The GPU test's layout on the CPU (inductor, sdpa, no target compile): each drafter's compiles
    are credited to its own warm-up, a drafter with another's shapes finds torch's cache, and a run
    after torch._dynamo.reset() is counted as a fresh process's would be (about a minute on 2 cores)."""
    variants = [{"name": "base"}, {"name": "b8", "block_size": 8}, {"name": "one-layer", "num_layers": 1}]
    target = tiny_target("llama", layers=6)
    for run in ("first", "after-reset"):
        torch._dynamo.reset()
        config = tiny_train_config(tmp_path / run, steps=2, compile="on", attention="sdpa", log_every=1, save_every=2,
                                   export_dtype="", mode="variants", variants=variants, fail_on_recompile=True)
        summary = train(config, samples=pattern_samples(32), target=target, log=io.StringIO())
        compiles = summary["compiles"]
        drafters = {name.split("[")[-1].rstrip("]"): name for name in summary["workers"] if name.startswith("drafter-")}
        warm = {variant: compiles["by_worker"].get(name, {}).get("warm_up", 0) for variant, name in drafters.items()}
        assert set(compiles["by_worker"]) <= set(drafters.values()), (run, compiles)  # the target compiles nothing
        assert warm["b8"] > 0 and warm["base"] + warm["one-layer"] > 0, (run, compiles)
        assert compiles["compiles"] == sum(warm.values()) and compiles["after_warmup"] == 0, (run, compiles)


@pytest.mark.gpu
def test_a_threaded_run_with_several_drafters_compiles_only_inside_the_gate(tmp_path):
    """train() on one GPU, three drafter variants and a target thread, flex attention compiled
    (eager step, no CUDA graphs, and graphs on), each run cold as in a fresh process: every compile
    falls inside the warm-up, credited to the worker warming then, and 0 compiles after it over
    every step."""
    target = Target(tiny_hf_model("llama", layers=6, hidden=256).to("cuda:0", torch.bfloat16))
    # tiny_train_config's drafter has one layer: "one-layer" has the base's shapes, "b8" its own.
    variants = [{"name": "base"}, {"name": "b8", "block_size": 8}, {"name": "one-layer", "num_layers": 1}]
    for graphs in ("off", "on"):
        # Without this the second run finds every drafter graph in the first run's compile cache
        # (same process, same shapes) and compiles nothing of its own.
        torch._dynamo.reset()
        out = tmp_path / graphs
        config = tiny_train_config(out, device="cuda", steps=16, num_anchors=32, max_seq_len=256, log_every=4,
                                   save_every=16, export_dtype="", seq_buckets=[128, 256], mode="variants",
                                   variants=variants, cuda_graphs=graphs, fail_on_recompile=True)
        summary = train(config, samples=pattern_samples(64, min_len=30, max_len=250), target=target,
                        log=open(os.devnull, "w"))
        compiles = summary["compiles"]
        assert compiles["compiles"] > 0 and compiles["after_warmup"] == 0, (graphs, compiles)
        workers = list(summary["workers"])
        drafters = {name.split("[")[-1].rstrip("]"): name for name in workers if name.startswith("drafter-")}
        assert sorted(drafters) == sorted(v["name"] for v in variants), workers
        assert set(compiles["by_worker"]) <= set(workers), (graphs, compiles)  # no stray thread credited
        warm = {name: compiles["by_worker"].get(name, {}).get("warm_up", 0) for name in workers}
        assert warm[drafters["b8"]] > 0, (graphs, compiles)
        # Whichever of the two same-shaped drafters warmed first compiled; the other found torch's cache.
        assert warm[drafters["base"]] + warm[drafters["one-layer"]] > 0, (graphs, compiles)
        # The target compiles its feature forward only to capture it (graphs on, --compile-target auto).
        target_worker = next(name for name in workers if name.startswith("target-"))
        assert (warm[target_worker] > 0) == (graphs == "on"), (graphs, compiles)
        assert all(counts["after_warmup"] == 0 for counts in compiles["by_worker"].values()), (graphs, compiles)
        assert all(summary["steps_done"][v["name"]] == 16 for v in variants), summary["steps_done"]
