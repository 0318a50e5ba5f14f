"""The static decoder's state cache lets go (issue #14, item 8): a dropped drafter or target frees
its caches, a finished thread's states are released (thread ids are reused; its states must not
be found by another thread), copies of a module start without states; and a captured graph is
judged by what its replay computes, not by the warnings capture prints.
"""

from __future__ import annotations

import copy
import gc
import io
import threading
import weakref

import pytest
import torch

from dflash_train.capture import CapturedStep
from dflash_train.decode.loop import generate
from dflash_train.decode.static import static_state
from test_decode_loop import random_drafter
from tiny import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [3, 1, 4, 1, 5, 9, 2]


def _refs(state) -> list[weakref.ref]:
    """Weak references to a state and the cache tensors it allocated."""
    refs = [weakref.ref(state), weakref.ref(state.target.keys), weakref.ref(state.target.values)]
    if state.drafter is not None:
        refs += [weakref.ref(state.drafter.keys), weakref.ref(state.new_features)]
    return refs


def _alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_a_dropped_drafter_frees_its_caches_while_the_target_lives():
    target = tiny_target("llama", head_scale=8)
    drafter = random_drafter(target, block_size=4)
    assert generate(target, drafter, PROMPT, 8, decoder="static").decoder == "static"
    refs = _refs(static_state(target, drafter, 512)) + [weakref.ref(drafter)]
    assert _alive(refs) == len(refs)
    del drafter
    assert _alive(refs) == 0
    assert generate(target, None, PROMPT, 8, decoder="static").decoder == "static"  # the target still decodes


def test_a_dropped_target_frees_its_caches():
    target = tiny_target("llama", head_scale=8)
    generate(target, None, PROMPT, 8, decoder="static")
    refs = _refs(static_state(target, None, 512)) + [weakref.ref(target.model)]
    del target
    assert _alive(refs) == 0


def test_a_finished_thread_releases_its_states():
    target = tiny_target("llama", head_scale=8)
    drafter = random_drafter(target, block_size=4)
    mine = static_state(target, drafter, 512)
    refs: list[weakref.ref] = []

    def worker() -> None:
        generate(target, drafter, PROMPT, 8, decoder="static")
        state = static_state(target, drafter, 512)
        assert state is not mine
        refs.extend(_refs(state))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert len(refs) == 5 and _alive(refs) == 0  # target, drafter and the Thread object all still exist
    assert thread.is_alive() is False and static_state(target, drafter, 512) is mine


@pytest.mark.parametrize("compile_draft", [False, True], ids=["eager", "compiled-draft"])
def test_a_replaced_state_is_freed_at_once_without_a_collector_pass(compile_draft):
    """A module and its shelf of states form a cycle the collector reclaims (by design), but a
    state dropped from the shelf (weights replaced, the oldest of too many, its thread gone)
    must go at once: its captured steps must not hold it, or on a GPU its caches and graph
    pools stay until a collector pass that GPU memory pressure never triggers. A compiled draft
    forward (`compile_draft`) must not hold it either."""
    target = tiny_target("llama", head_scale=8)
    drafter = random_drafter(target, block_size=4)
    gc.collect()
    gc.disable()
    try:
        generate(target, drafter, PROMPT, 8, decoder="static", compile_draft=compile_draft)
        old = static_state(target, drafter, 512, compile_draft)
        assert old.drafter.compile_done is compile_draft
        steps = [old.next_token, old.next_greedy, old.draft, old.verify, *old.greedy_steps.values(), *old.prefill_steps.values()]
        refs = _refs(old) + [weakref.ref(x) for x in (old.target, old.drafter, *steps)]
        del old, steps
        weight = next(drafter.parameters())
        weight.data = weight.data.clone()  # a replaced tensor: the graphs' addresses are stale, the state is rebuilt
        assert generate(target, drafter, PROMPT, 8, decoder="static", compile_draft=compile_draft).decoder == "static"
        assert sum(ref() is not None for ref in refs) == 0, "the replaced state outlived its eviction"
    finally:
        gc.enable()


def test_copies_of_a_module_start_without_states():
    target = tiny_target("llama", head_scale=8)
    drafter = random_drafter(target, block_size=4)
    generate(target, drafter, PROMPT, 8, decoder="static")
    state = static_state(target, drafter, 512)
    twin = copy.deepcopy(drafter)  # the trainer copies a drafter per replica
    assert static_state(target, twin, 512) is not state
    buffer = io.BytesIO()
    torch.save(drafter, buffer)  # a module with cached states still pickles
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert generate(target, loaded, PROMPT, 8, decoder="static").tokens == generate(target, drafter, PROMPT, 8, decoder="hf").tokens


@pytest.mark.gpu
def test_a_graph_that_does_not_compute_its_outputs_runs_eagerly():
    """A graph that records some of a step's kernels but not the ones that produce its outputs
    (here: the output is computed on the host; in the field: on another GPU) is not empty, so
    capture warns about nothing, yet every replay would return the capture run's stale values."""
    device = torch.device("cuda")
    scratch = torch.zeros(4, device=device)
    calls: list[int] = []

    def step() -> torch.Tensor:
        scratch.add_(1)  # captured: the graph is not empty
        calls.append(1)
        return torch.full((4,), float(len(calls)))  # computed outside the graph

    captured = CapturedStep(step, device, "test")
    with pytest.warns(UserWarning, match="running it eagerly: its first replay did not reproduce the eager result"):
        first = captured()
    assert captured.eager and captured.graph is None
    assert torch.equal(first, torch.full((4,), float(len(calls))))
    assert torch.equal(captured(), torch.full((4,), float(len(calls))))  # fresh every call, never a stale replay
