"""The batched generators behind `regenerate` (generate/engine.py) against Hugging Face `generate`.

On CPU the static generator runs its steps eagerly (no CUDA graphs), so these tests check the
whole of its logic: slots, refill, per-row positions, attention spans, stop flags, phases, the
out-of-memory retry and the sampler; the GPU tests check that the captured graphs give the same
tokens.
"""

from __future__ import annotations

import io

import pytest
import torch
from threads import run_in_threads
from tiny import tiny_target

from dflash_train.data.readers import Prompt
from dflash_train.generate.engine import ATTENTION_STEP, BatchState, EagerBatchEngine, Generated, StaticBatchEngine
from dflash_train.generate.regenerate import GenerationSettings, Job
from dflash_train.target.static_cache import StaticTarget, cache_attentions

pytestmark = pytest.mark.usefixtures("one_thread")


def make_jobs(prompts: list[list[int]], seed: int = 0) -> list[Job]:
    return [Job(Prompt(f"row{i}", [{"role": "user", "content": "-"}], f"test:{i + 1}"), ids, seed * 1000 + i)
            for i, ids in enumerate(prompts)]


def by_id(results) -> dict[str, Generated]:
    out = {}
    for job, result in results:
        assert not isinstance(result, BaseException), result
        assert job.prompt.id not in out, "a row came back twice"
        out[job.prompt.id] = result
    return out


def hf_generate(target, ids: list[int], max_new: int, stop: int) -> Generated:
    """Hugging Face's own greedy generate on the prompt alone (no padding)."""
    prompt = torch.tensor([ids], device=target.device)
    with torch.no_grad():
        out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new, do_sample=False,
                                    eos_token_id=[stop], pad_token_id=stop)[0, prompt.shape[1]:].tolist()
    if stop in out:
        return Generated(out[: out.index(stop) + 1], "stop")
    return Generated(out, "length")


def varied_prompts(count: int, seed: int = 0, long: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 90, (int(torch.randint(1, 20, (1,), generator=generator)),), generator=generator).tolist()
               for _ in range(count)]
    if long:
        prompts.insert(count // 2, torch.randint(0, 90, (long,), generator=generator).tolist())
    return prompts


def early_stop_token(target, prompts: list[list[int]], max_new: int) -> int:
    """A token some rows emit mid-answer and others never do, so rows stop at different steps."""
    free_runs = [hf_generate(target, p, max_new, stop=95).tokens for p in prompts]
    counts = {}
    for run in free_runs:
        for token in set(run[1:]):
            counts[token] = counts.get(token, 0) + 1
    return max((t for t, n in counts.items() if n < len(prompts)), key=lambda t: counts[t])


@pytest.mark.parametrize("family,read_every,overlap,attention,bucketed", [
    ("llama", 4, False, "sdpa", False), ("qwen2", 1, True, "sdpa", False), ("qwen3", 3, True, "sdpa", False),
    ("mistral", 4, False, "sdpa", False), ("llama", 3, True, "matmul", False), ("qwen3", 4, False, "matmul", False),
    ("llama", 4, True, "sdpa", True), ("qwen3", 2, False, "matmul", True),
])
def test_greedy_rows_equal_hugging_face_generate_row_by_row(family, read_every, overlap, attention, bucketed, monkeypatch):
    attended = []
    step = BatchState.step

    def checked_step(state, span, rows):  # every row still decoding must see its own position
        live = ~state.finished[:rows]
        attended.append(bool((state.positions[:rows][live] < span).all()))
        step(state, span, rows)

    monkeypatch.setattr(BatchState, "step", checked_step)
    target = tiny_target(family, head_scale=8)
    # 8 prompts of 1..19 tokens and one of 250 (its answer crosses an attention span boundary),
    # through 3 slots: rows are padded together in prefills, stop early or run to the cap, and
    # finished slots are refilled.
    prompts = varied_prompts(8, seed=1, long=ATTENTION_STEP - 6)
    max_new = 14
    stop = early_stop_token(target, prompts, max_new)
    settings = GenerationSettings(max_new_tokens=max_new)
    # overlap: the host acts on each round's finished flags one round late, as on CUDA.
    # bucketed: prefills padded to (power-of-two rows, multiple-of-64 width) buckets, the padding
    # rows written to a scratch cache row (what CUDA graphs replay), here run eagerly.
    engine = StaticBatchEngine(target, settings, [stop], slots=3, read_every=read_every, overlap=overlap, attention=attention,
                               bucket_prefills=bucketed)
    got = by_id(engine.generated(make_jobs(prompts)))
    expected = {f"row{i}": hf_generate(target, p, max_new, stop) for i, p in enumerate(prompts)}
    assert got == expected
    reasons = [g.finish_reason for g in got.values()]
    assert "stop" in reasons and "length" in reasons
    assert engine.state.slots == 3 and engine.state.capacity == 512
    assert sorted(span for _, span in engine.state.steps) == [ATTENTION_STEP, 2 * ATTENTION_STEP]  # the long row needed the second
    assert attended and all(attended)
    if bucketed:
        buckets = set(engine.state.prefills)
        assert buckets and all(rows & (rows - 1) == 0 and width % 64 == 0 for rows, width in buckets), buckets
        assert (4, 64) in buckets or (2, 64) in buckets  # 3 slots, short prompts: padded to a power of two
        assert engine.state.model.keys.shape[1] == 4  # the scratch row
    else:
        assert not engine.state.prefills and engine.state.model.keys.shape[1] == 3


def test_the_row_kernel_is_offered_only_where_it_runs(monkeypatch):
    """The Triton row kernel runs on CUDA only: on the CPU `auto` never times it and asking for it
    is refused when the engine is made, naming what the device has."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel tests' CPU mode offers it
    target = tiny_target("llama")
    assert cache_attentions(torch.device("cpu")) == ["sdpa", "matmul"]
    with pytest.raises(ValueError, match=r"attention 'rows' needs a CUDA device with Triton; cpu has sdpa, matmul"):
        StaticBatchEngine(target, GenerationSettings(max_new_tokens=4), [95], slots=2, attention="rows")
    with pytest.raises(ValueError, match=r"attention must be one of sdpa, matmul, rows, not 'flash'"):
        StaticBatchEngine(target, GenerationSettings(max_new_tokens=4), [95], slots=2, attention="flash")


def test_every_prefill_bucket_a_run_needs_is_made_before_rows_decode(monkeypatch):
    """With CUDA graphs a bucket first met mid-run was captured there (~0.1 s of host time each:
    at batch 64 the bench's timed run spent 1.8 of its 3.8 s in prefills, 15 shapes for 25 of
    them). Now each phase makes every bucket its prompts can reach before it starts; here, on the
    CPU, the buckets are made without capturing, and a run must not meet one it lacks."""
    target = tiny_target("llama", head_scale=8)
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 200, (40,), generator=generator).tolist()
    prompts = [torch.randint(0, 90, (n,), generator=generator).tolist() for n in lengths]
    settings = GenerationSettings(max_new_tokens=6)

    def run() -> tuple[StaticBatchEngine, dict]:
        engine = StaticBatchEngine(target, settings, [95], slots=8, prefill_tokens=300, admit_fraction=4,
                                   bucket_prefills=True)
        return engine, by_id(engine.generated(make_jobs(prompts)))

    prepared, answers = run()
    assert prepared.state.prefill_shapes_late == 0
    assert "(0 of them made mid-run)" in prepared.run_note()

    monkeypatch.setattr(StaticBatchEngine, "_capture_prefills", lambda self, state, longest: None)
    lazy, lazy_answers = run()  # the buckets this run really used, each made when first needed
    used = set(lazy.state.prefills)
    assert lazy.state.prefill_shapes_late == len(used) >= 5  # several widths and row counts
    assert used <= set(prepared.state.prefills)
    assert lazy_answers == answers


def test_the_last_rows_move_together_into_fewer_slots():
    target = tiny_target("qwen3", head_scale=8)
    prompts = varied_prompts(18, seed=8)  # 16 at once; those admitted late run on alone
    max_new = 16
    stop = early_stop_token(target, prompts[:8], max_new)
    engine = StaticBatchEngine(target, GenerationSettings(max_new_tokens=max_new), [stop], slots=16, overlap=True)
    got = by_id(engine.generated(make_jobs(prompts)))
    assert got == {f"row{i}": hf_generate(target, p, max_new, stop) for i, p in enumerate(prompts)}
    assert {rows for rows, _ in engine.state.steps} == {16, 8}  # the tail ran on a smaller batch


def test_refills_wait_for_enough_free_slots_and_answers_do_not_change():
    target = tiny_target("llama", head_scale=8)
    prompts = varied_prompts(40, seed=5)
    max_new = 12
    stop = early_stop_token(target, prompts[:8], max_new)
    expected = {f"row{i}": hf_generate(target, p, max_new, stop) for i, p in enumerate(prompts)}
    prefills = {}
    for fraction in (16, 4, 1):  # refill at 1, 4 or all 16 free slots (1 = whole batches)
        engine = StaticBatchEngine(target, GenerationSettings(max_new_tokens=max_new), [stop], slots=16,
                                   admit_fraction=fraction, read_every=2)
        assert by_id(engine.generated(make_jobs(prompts))) == expected
        stats = engine.stats.as_dict()
        assert stats["admitted"] == len(prompts) and stats["steps"] > 0 and 0 < stats["occupancy"] <= 1
        prefills[fraction] = stats["prefills"]
    assert prefills[16] > prefills[4] > prefills[1] >= 3  # 40 prompts through 16 slots: at least 3 refills


def test_a_stop_at_the_first_token_and_one_token_answers():
    target = tiny_target("llama", head_scale=8)
    prompts = varied_prompts(5, seed=2)
    first = [hf_generate(target, p, 1, stop=95).tokens[0] for p in prompts]
    engine = StaticBatchEngine(target, GenerationSettings(max_new_tokens=6), [first[1]], slots=2)
    got = by_id(engine.generated(make_jobs(prompts)))
    assert got == {f"row{i}": hf_generate(target, p, 6, first[1]) for i, p in enumerate(prompts)}
    assert got["row1"] == Generated([first[1]], "stop")
    one = by_id(StaticBatchEngine(target, GenerationSettings(max_new_tokens=1), [95], slots=2).generated(make_jobs(prompts)))
    assert one == {f"row{i}": hf_generate(target, p, 1, 95) for i, p in enumerate(prompts)}
    assert [one[f"row{i}"].tokens for i in range(5)] == [[t] for t in first]


def test_sampled_rows_depend_only_on_their_own_seed():
    target = tiny_target("qwen3", head_scale=2)
    prompts = varied_prompts(9, seed=3)
    jobs = make_jobs(prompts, seed=7)
    for top_p in (1.0, 0.8):
        settings = GenerationSettings(max_new_tokens=10, temperature=1.0, top_p=top_p)
        alone = {job.prompt.id: by_id(StaticBatchEngine(target, settings, [95], slots=1).generated([job]))[job.prompt.id]
                 for job in jobs}
        # Other slot counts, other neighbours, another order: every row keeps its answer.
        for slots, chosen in ((3, jobs), (8, jobs[::-1]), (2, jobs[1::2] + jobs[0::4])):
            got = by_id(StaticBatchEngine(target, settings, [95], slots=slots).generated(chosen))
            assert got == {job.prompt.id: alone[job.prompt.id] for job in chosen}, (top_p, slots)
        # The eager fallback draws from the same per-row stream.
        assert by_id(EagerBatchEngine(target, settings, [95], batch_size=4).generated(jobs)) == alone
        greedy = by_id(StaticBatchEngine(target, GenerationSettings(max_new_tokens=10), [95], slots=4).generated(jobs))
        reseeded = by_id(StaticBatchEngine(target, settings, [95], slots=4).generated(make_jobs(prompts, seed=8)))
        assert sum(alone[k] != greedy[k] for k in alone) >= 7 and sum(alone[k] != reseeded[k] for k in alone) >= 7


def test_sampler_draws_follow_the_tempered_top_p_distribution():
    from dflash_train.decode.sampling import choose_tokens, uniform_draws

    rows = 40_000
    probs = torch.tensor([0.04, 0.4, 0.06, 0.3, 0.2])
    logits = (probs.log() * 2).repeat(rows, 1)  # temperature 2 gives back `probs`
    seeds, counters = torch.arange(rows) * 7919, torch.arange(rows) % 5
    for top_p, kept in ((1.0, [0, 1, 2, 3, 4]), (0.75, [1, 3, 4]), (0.5, [1, 3]), (0.1, [1])):
        counts = torch.bincount(choose_tokens(logits, 2.0, top_p, seeds, counters), minlength=5).double() / rows
        expected = torch.zeros(5, dtype=torch.float64)
        expected[kept] = probs[kept].double() / probs[kept].sum()
        assert (counts - expected).abs().max() < 0.01, (top_p, counts, expected)
    # Each draw is a function of its own (seed, index) pair: the same pair, anywhere in a batch.
    u = uniform_draws(seeds, counters)
    assert torch.equal(uniform_draws(seeds.flip(0)[:100], counters.flip(0)[:100]), u.flip(0)[:100])
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(choose_tokens(logits[:3], 0.0, 0.5, None, None), torch.tensor([1, 1, 1]))


class OutOfMemoryAbove:
    """Wraps a real module's forward: a torch.OutOfMemoryError (what CUDA raises) when the batch
    has more than `rows` rows, as if the device's memory held only that many."""

    def __init__(self, module: torch.nn.Module, rows: int):
        self.module, self.rows, self.forward = module, rows, module.forward
        self.raised = 0

    def __enter__(self):
        def forward(x, *args, **kwargs):
            if x.shape[0] > self.rows:
                self.raised += 1
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows (test)")
            return self.forward(x, *args, **kwargs)

        self.module.forward = forward
        return self

    def __exit__(self, *exc):
        self.module.forward = self.forward


@pytest.mark.parametrize("engine_class", [StaticBatchEngine, EagerBatchEngine])
def test_out_of_memory_halves_the_batch_and_loses_no_row(engine_class):
    target = tiny_target("llama", head_scale=8)
    prompts = varied_prompts(11, seed=4)
    settings = GenerationSettings(max_new_tokens=9)
    size = "slots" if engine_class is StaticBatchEngine else "batch_size"
    expected = by_id(engine_class(target, settings, [95], **{size: 8}).generated(make_jobs(prompts)))
    log = io.StringIO()
    engine = engine_class(target, settings, [95], **{size: 8}, log=log)
    with OutOfMemoryAbove(target.layers[1].mlp, rows=2) as wrapped:
        got = by_id(engine.generated(make_jobs(prompts)))
    assert got == expected and wrapped.raised == 2
    assert engine.out_of_memory == 2 and getattr(engine, size) == 2
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "halving to 4" in lines[0] and "halving to 2" in lines[1], lines
    # Out of memory with a single row: that row fails (counted by the driver), the others are tried.
    with OutOfMemoryAbove(target.layers[1].mlp, rows=0):
        results = list(engine_class(target, settings, [95], **{size: 1}, log=log).generated(make_jobs(prompts[:3])))
    assert len(results) == 3 and all(isinstance(result, torch.OutOfMemoryError) for _, result in results)


def test_caches_that_do_not_fit_run_the_longest_prompts_later_with_fewer_slots():
    target = tiny_target("qwen2", head_scale=8)
    prompts = varied_prompts(6, seed=5, long=600)  # the long one needs 1024-position caches
    settings = GenerationSettings(max_new_tokens=8)
    per_slot = lambda capacity: capacity * StaticTarget.bytes_per_position(target) + 8 * 8 + 16 * 96  # noqa: E731
    log = io.StringIO()
    # Room for 4 slots of 512 positions, or 2 of 1024.
    engine = StaticBatchEngine(target, settings, [95], slots=4, memory_budget=4 * per_slot(512), log=log)
    got = by_id(engine.generated(make_jobs(prompts)))
    assert got == {f"row{i}": hf_generate(target, p, 8, 95) for i, p in enumerate(prompts)}
    assert "6 prompts run with 4 slots of 512 positions first" in log.getvalue()
    assert (engine.state.slots, engine.state.capacity) == (1, 1024)  # the last phase: the one long prompt
    # Not even one short prompt's 4 slots fit: fewer slots from the start.
    engine = StaticBatchEngine(target, settings, [95], slots=4, memory_budget=2 * per_slot(512), log=log)
    assert by_id(engine.generated(make_jobs(prompts[:3]))) == {k: got[k] for k in ("row0", "row1", "row2")}
    assert "3 prompts run with 2 slots of 512 positions first" in log.getvalue()
    # Captured prefills' scratch cache row counts against the budget: room for 3 rows is 2 slots.
    log = io.StringIO()
    engine = StaticBatchEngine(target, settings, [95], slots=4, memory_budget=3 * per_slot(512), bucket_prefills=True, log=log)
    assert by_id(engine.generated(make_jobs(prompts[:3]))) == {k: got[k] for k in ("row0", "row1", "row2")}
    assert "3 prompts run with 2 slots of 512 positions first" in log.getvalue(), log.getvalue()


def test_a_phase_state_is_freed_without_a_garbage_collector_pass():
    """A state's captured steps and prefills must not hold the state (a reference cycle): on a
    GPU it would keep the caches and the graphs' memory pools until a collector pass, so a new
    phase, an out-of-memory retry or the next engine in the process would find the memory taken
    (the 8B-shape bench's Hugging Face run failed so, with 69 GiB left in our graph pools)."""
    import gc
    import weakref

    target = tiny_target("qwen2", head_scale=8)
    prompts = varied_prompts(6, seed=5, long=600)  # two phases: 4 slots of 512 positions, then 1 of 1024
    per_slot = 512 * StaticTarget.bytes_per_position(target) + 8 * 8 + 16 * 96
    engine = StaticBatchEngine(target, GenerationSettings(max_new_tokens=8), [95], slots=4, memory_budget=5 * per_slot,
                               bucket_prefills=True, log=io.StringIO())
    states: list[list[weakref.ref]] = []  # per phase: the state, then what it made (not by id: a freed one's is reused)
    gc.collect()
    gc.disable()
    try:
        for _ in engine.generated(make_jobs(prompts)):
            state = engine.state
            if not states or states[-1][0]() is not state:
                assert state.steps and state.prefills
                states.append([weakref.ref(x) for x in (state, state.model, state.generated, *state.steps.values(),
                                                        *(p.step for p in state.prefills.values()))])
            del state
        assert len(states) == 2, engine.log.getvalue()
        first, last = states
        assert sum(ref() is not None for ref in first) == 0, "the first phase's state outlived its phase"
        assert all(ref() is not None for ref in last)
        del engine
        assert sum(ref() is not None for ref in last) == 0, "the last state outlived its engine"
    finally:
        gc.enable()


def test_rows_the_engine_cannot_start_fail_alone():
    target = tiny_target("llama", head_scale=8)
    jobs = make_jobs([[5, 6, 7], [], [4, 200], [8, 9]])
    jobs[3].ids = None
    for engine in (StaticBatchEngine(target, GenerationSettings(max_new_tokens=3), [95], slots=2),
                   EagerBatchEngine(target, GenerationSettings(max_new_tokens=3), [95], batch_size=2)):
        results = {job.prompt.id: result for job, result in engine.generated(jobs)}
        assert results["row0"] == hf_generate(target, [5, 6, 7], 3, 95)
        assert isinstance(results["row1"], ValueError) and "empty prompt" in str(results["row1"])
        assert isinstance(results["row2"], IndexError) and "token id 200" in str(results["row2"])
        assert isinstance(results["row3"], ValueError)


# --------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "matmul", "rows", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_generator_gives_the_eager_generators_tokens_on_the_gpu(dtype, attention):
    target = tiny_target("qwen3", head_scale=8)
    target.model.to("cuda", dtype)
    prompts = varied_prompts(40, seed=6, long=300)
    max_new = 40
    stop = early_stop_token(target, prompts[:10], max_new) if dtype == torch.float32 else 7
    jobs = make_jobs(prompts)
    for temperature in (0.0, 1.0):
        settings = GenerationSettings(max_new_tokens=max_new, temperature=temperature, top_p=0.9)
        graphed = StaticBatchEngine(target, settings, [stop], slots=16, attention=attention)
        got = by_id(graphed.generated(jobs))
        # float32 rows run long enough to be compacted into fewer slots: a third step shape.
        shapes = 3 if dtype == torch.float32 else 2
        assert all(step.graph is not None for step in graphed.state.steps.values()) and len(graphed.state.steps) >= shapes
        assert graphed.state.prefills and all(p.step.graph is not None for p in graphed.state.prefills.values())
        if attention == "auto":  # each timed once, the fastest kept
            assert set(graphed.state.attention_ms) == {"sdpa", "matmul", "rows"}
            assert graphed.state.attention == min(graphed.state.attention_ms, key=graphed.state.attention_ms.get)
        # The eager engine pads its prefills as the graphed one does (the same GEMM shapes).
        eager = by_id(StaticBatchEngine(target, settings, [stop], slots=16, graphs=False, attention=graphed.state.attention,
                                        bucket_prefills=True).generated(jobs))
        assert got == eager
        if dtype == torch.float32 and temperature == 0:
            assert got == {f"row{i}": hf_generate(target, p, max_new, stop) for i, p in enumerate(prompts)}
        # Again on the same engine: the captured graphs are replayed from a fresh set of slots.
        assert by_id(graphed.generated(jobs[::-1])) == got


@pytest.mark.gpu
def test_auto_leaves_out_a_row_kernel_that_fails_to_run(monkeypatch):
    """Should the Triton kernel not build on some card, `auto` times the other two and says why."""
    from dflash_train.target import static_cache

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this card\nsecond line")

    monkeypatch.setattr(static_cache, "attend_cache_rows", broken)
    target = tiny_target("llama", head_scale=8)
    target.model.to("cuda")
    settings = GenerationSettings(max_new_tokens=8)
    jobs = make_jobs(varied_prompts(6, seed=2))
    log = io.StringIO()
    engine = StaticBatchEngine(target, settings, [95], slots=4, log=log)
    got = by_id(engine.generated(jobs))
    assert set(engine.state.attention_ms) == {"sdpa", "matmul"} and engine.state.attention in ("sdpa", "matmul")
    assert engine.state.attention_failed == {"rows": "RuntimeError: no kernel for this card"}
    assert "rows failed (RuntimeError: no kernel for this card)" in log.getvalue()
    eager = StaticBatchEngine(target, settings, [95], slots=4, graphs=False, attention=engine.state.attention,
                              bucket_prefills=True)
    assert got == by_id(eager.generated(jobs))


@pytest.mark.gpu
def test_graphed_generators_in_worker_threads():
    target = tiny_target("llama", head_scale=8)
    target.model.to("cuda")
    settings = GenerationSettings(max_new_tokens=24)
    jobs = make_jobs(varied_prompts(30, seed=7))
    expected = by_id(StaticBatchEngine(target, settings, [95], slots=8, graphs=False).generated(jobs))
    results: dict[int, dict] = {}

    def worker(index: int) -> None:
        engine = StaticBatchEngine(target, settings, [95], slots=8)  # its own caches and graphs, captured in both threads
        for _ in range(2):
            results[index] = by_id(engine.generated(jobs))

    problems = run_in_threads(worker, range(2), timeout=300)
    assert not problems, problems
    assert results == {0: expected, 1: expected}
