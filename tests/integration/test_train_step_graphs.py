"""`--cuda-graphs` on the CPU: the static-shape step (the functions CUDA graphs capture) run
eagerly against the classic step, its rows-bucket padding, its buffers, the replicas' gradient sum
through it, the capturable feature forward against Target.features, the fallbacks and the
configuration errors. Capture and replay themselves need a GPU: tests/gpu/test_train_step_graphs_gpu.py."""

import copy
import functools
import json
import math
import os
import time
import warnings

import pytest
import torch
from dflash_train.target.model import Target
from dflash_train.target.probe import feature_forward_unsupported
from dflash_train.target.walk import FeatureForward
from threads import run_in_threads
from tiny import pattern_samples, tiny_target, tiny_train_config

from dflash_train.config import ConfigError, TrainConfig
from dflash_train.core.drafter import DrafterConfig
from dflash_train.core.objective import ObjectiveConfig
from dflash_train.core.step import (
    DrafterBatch,
    FrozenTargetParts,
    InputShape,
    StaticInputs,
    Step,
    drafter_loss,
    padded_slot_index,
    rows_bucket,
    rows_buckets,
    warmup_cosine,
)
from dflash_train.parallel.gradients import GradientReducer
from dflash_train.parallel.threads import StopSignal
from dflash_train.parallel.utilisation import WorkerLoad, bottleneck
from dflash_train.train.batches import BatchPlanner
from dflash_train.train.replicas import init_drafter
from dflash_train.train.startup import choose_cuda_graphs
from dflash_train.train.step_graphs import GraphedStep, step_shapes
from dflash_train.train.trainer import train

LAYERS = [1, 3]
BUCKETS = [64, 112]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models: spinning OpenMP threads on shared cores cost seconds per test."""


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6, head_scale=20)


def _objective(loss="decay", anchors=24, chunk_rows=16):
    return ObjectiveConfig(block_size=4, num_anchors=anchors, loss=loss, loss_chunk_rows=chunk_rows)


def _drafter(target, seed=0):
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95, target_layer_ids=LAYERS)
    return init_drafter(config, seed)


def _frozen(target):
    return FrozenTargetParts(target.embed_weight.detach(), target.head_weight.detach())


def _steps(target, objective, *, steps, batches_per_step, batch_size=4, seed=0):
    """Real planned micro-batches (BatchPlanner: buckets, anchors, the step's normaliser and the
    host's scored-slot count) with the target's features, as a drafter worker receives them."""
    planner = BatchPlanner(pattern_samples(48, min_len=30, max_len=110, seed=seed), batch_size=batch_size,
                           batches_per_step=batches_per_step, buckets=BUCKETS, seed=seed, objectives={"d": objective})
    out = []
    for step in range(steps):
        micro = []
        for host in planner.step_batches(step):
            anchors, valid = host.anchors["d"]
            micro.append(DrafterBatch(target.features(host.input_ids, LAYERS), host.input_ids, host.loss_mask, anchors,
                                      valid, host.normalizers["d"], host.scored_rows["d"],
                                      anchor_count=host.anchor_counts["d"]))
        out.append(micro)
    return out


def _trainer(target, objective, drafter, lr=3e-3, fused=True):
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    return optimizer, warmup_cosine(optimizer, 40, 0.1, 0.1)


def _eager(target, objective, drafter, optimizer, scheduler, clip=0.5):
    return Step(drafter, optimizer, scheduler, _frozen(target), objective, attention_backend="sdpa", clip_grad=clip,
                autocast_dtype=None)


def _graphed(target, objective, drafter, optimizer, scheduler, batch_size=4, clip=0.5):
    shapes = step_shapes(BUCKETS, batch_size, objective, len(LAYERS) * target.spec.hidden_size, torch.float32,
                         target.spec.vocab_size)
    return GraphedStep(name="test", step=_eager(target, objective, drafter, optimizer, scheduler, clip), shapes=shapes)


def _relative(a, b):
    """Largest difference relative to the largest magnitude (elementwise ratios of near-zeros say nothing)."""
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


# --- rows buckets and the padded index ----------------------------------------------------------

def test_rows_buckets_hold_every_count_of_every_planned_batch(target):
    """Bucket keys: every count maps to the smallest granule multiple holding it, the buckets of a
    length hold every count a planned batch of that length has, and their number is capped."""
    assert [rows_bucket(c, 16) for c in (0, 1, 16, 17, 32)] == [16, 16, 16, 32, 32]
    assert rows_buckets(40, 16) == [16, 32, 48]
    objective = _objective(anchors=24)
    shapes = step_shapes(BUCKETS, 4, objective, 128, torch.float32, target.spec.vocab_size)
    for micro in _steps(target, objective, steps=12, batches_per_step=2):
        for batch in micro:
            shape = InputShape.of(batch)
            rows = shapes.rows_for(shape, batch.scored_rows)
            assert batch.scored_rows <= rows and rows in shapes.rows[shape]
    wide = step_shapes([4096], 64, ObjectiveConfig(block_size=16, num_anchors=512, loss_chunk_rows=64), 8, torch.float32, 100)
    [shape] = wide.inputs
    assert len(wide.rows[shape]) <= 48 and wide.rows[shape][-1] >= 64 * 512 * 15


def test_padded_slot_index_is_nonzero_static_with_a_dump_slot():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        scored = torch.rand(200, generator=generator) < torch.rand((), generator=generator)
        count = int(scored.sum())
        for rows in (max(1, count), count + 1, count + 37):
            expected = torch.nonzero_static(scored, size=rows, fill_value=200).squeeze(1)
            assert torch.equal(padded_slot_index(scored, rows), expected)


@pytest.mark.parametrize("loss", ["decay", "dpace"])
def test_rows_padding_changes_no_loss_gradient_or_metric(target, loss):
    """The static step function at the exact scored-slot count and padded to its rows bucket and
    three chunks beyond (CPU, float32, eager head in chunks of 16 rows): padding rows change
    nothing. Loss and metric sums are bitwise equal throughout; gradients are bitwise equal
    between any two paddings, and within 1e-6 of the exact count's, whose last chunk is a shorter
    matrix product that BLAS rounds differently (the compiled GPU head pads every chunk to full
    size, eagerly and in graphs alike). Equal to the classic drafter_loss too."""
    objective = _objective(loss=loss, anchors=40)
    drafter, frozen = _drafter(target), _frozen(target)
    batch = _steps(target, objective, steps=1, batches_per_step=1)[0][0]
    count = batch.scored_rows
    assert 0 < count < batch.anchors.numel() * 3  # some slots unscored (padded anchors, row ends)
    inputs = StaticInputs(InputShape(*batch.input_ids.shape[:1], batch.input_ids.shape[1], 40,
                                     batch.target_features.shape[-1], torch.float32), torch.device("cpu"))
    inputs.fill(batch)

    def run(fn):
        drafter.zero_grad(set_to_none=True)
        value, metrics = fn()
        value.backward()
        return value.detach(), metrics, [p.grad.clone() for p in drafter.parameters()]

    exact = run(lambda: drafter_loss(drafter, frozen, inputs, objective, "sdpa", count))
    bucket = rows_bucket(count, 16)
    assert bucket > count  # the bucket really pads
    padded = [run(lambda rows=rows: drafter_loss(drafter, frozen, inputs, objective, "sdpa", rows))
              for rows in (bucket, bucket + 48)]
    for each in padded:
        assert torch.equal(each[0], exact[0])
        assert all(torch.equal(each[1][k], exact[1][k]) for k in exact[1])
        assert all(_relative(a, b) <= 1e-6 for a, b in zip(each[2], exact[2]))
    assert all(torch.equal(a, b) for a, b in zip(padded[0][2], padded[1][2]))
    classic = run(lambda: drafter_loss(drafter, frozen, batch, objective, "sdpa"))
    torch.testing.assert_close(exact[0], classic[0], rtol=1e-6, atol=0)
    assert all(_relative(a, b) <= 1e-6 for a, b in zip(exact[2], classic[2]))


# --- the whole step -----------------------------------------------------------------------------

def _compare(results_a, results_b, drafter_a, drafter_b, opt_a, opt_b):
    for step, (a, b) in enumerate(zip(results_a, results_b)):
        assert a.skipped == b.skipped, step
        assert a.loss == pytest.approx(b.loss, rel=1e-5, nan_ok=True), step
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5, nan_ok=True), step
        for name in a.metric_sums:
            torch.testing.assert_close(a.metric_sums[name].float(), b.metric_sums[name].float(), rtol=1e-6, atol=0,
                                       equal_nan=True)
    for (name, pa), pb in zip(drafter_a.named_parameters(), drafter_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(opt_a.state[pa]["exp_avg_sq"], opt_b.state[pb]["exp_avg_sq"], rtol=1e-5, atol=1e-12)


def test_static_step_equals_the_classic_step_over_24_steps(target):
    """GraphedStep on the CPU runs the captured functions eagerly: 24 steps of 2 micro-batches in
    different length buckets, clipping, weight decay, warm-up + cosine lr, and one step made
    non-finite (skipped by both, weights and moments untouched) equal the eager Step's."""
    objective = _objective(anchors=24)
    steps = _steps(target, objective, steps=24, batches_per_step=2)
    assert any(len({b.input_ids.shape[1] for b in micro}) == 2 for micro in steps)  # mixed buckets in a step
    poisoned = steps[9][1].target_features.clone()
    poisoned[0, 3, 0] = float("inf")
    steps[9][1] = copy.copy(steps[9][1])
    steps[9][1].target_features = poisoned
    classic_drafter = _drafter(target)
    static_drafter = copy.deepcopy(classic_drafter)
    classic_opt, classic_sched = _trainer(target, objective, classic_drafter)
    static_opt, static_sched = _trainer(target, objective, static_drafter)
    graphed = _graphed(target, objective, static_drafter, static_opt, static_sched)
    classic_step = _eager(target, objective, classic_drafter, classic_opt, classic_sched)
    classic, static = [], []
    grads = [p.grad for p in static_drafter.parameters()]
    inputs = {length: buffers.target_features.data_ptr() for length, buffers in graphed.inputs.items()}
    for micro in steps:
        classic.append(classic_step.run(micro))
        static.append(graphed.run(micro))
    assert [r.skipped for r in static].count(True) == 1 and static[9].skipped
    _compare(classic, static, classic_drafter, static_drafter, classic_opt, static_opt)
    # buffer reuse: the same gradient tensors and input buffers every step, nothing left to add
    assert all(p.grad is g for p, g in zip(static_drafter.parameters(), grads))
    assert {length: b.target_features.data_ptr() for length, b in graphed.inputs.items()} == inputs
    assert all(float(g.abs().max()) == 0.0 for g in grads) and float(graphed.step.loss_sum) == 0.0
    assert static_opt.param_groups[0]["lr"] == classic_opt.param_groups[0]["lr"]  # a float again, on schedule
    assert isinstance(static_opt.param_groups[0]["lr"], float)


def _handed_over(target, objective, drafter, optimizer, scheduler):
    step = _eager(target, objective, drafter, optimizer, scheduler)
    step.hand_over_gradients()
    return step


@pytest.mark.parametrize("fused", [True, False], ids=["fused AdamW", "clip_grad_norm_ and AdamW"])
def test_handed_over_gradients_give_the_buffered_steps_numbers_bit_for_bit(target, fused):
    """The eager step that drops its gradients and keeps the backward's own tensors (what train
    runs without CUDA graphs) against the persistent buffers: 12 steps of 2 micro-batches (so the
    second backward adds into the first's tensors), weight decay, clipping and one non-finite step
    give identical losses, norms, weights and moments; no gradient outlives an update; a graphed
    step refuses such a Step."""
    objective = _objective(anchors=24)
    steps = _steps(target, objective, steps=12, batches_per_step=2)
    poisoned = steps[5][0].target_features.clone()
    poisoned[0, 2, 0] = float("nan")
    steps[5][0] = copy.copy(steps[5][0])
    steps[5][0].target_features = poisoned
    buffered_drafter = _drafter(target)
    # no backward reaches it: a buffer gives it zero gradients, so AdamW still decays it
    buffered_drafter.register_parameter("unreached", torch.nn.Parameter(torch.ones(3)))
    handed_drafter = copy.deepcopy(buffered_drafter)
    buffered_opt, buffered_sched = _trainer(target, objective, buffered_drafter, fused=fused)
    handed_opt, handed_sched = _trainer(target, objective, handed_drafter, fused=fused)
    buffered = _eager(target, objective, buffered_drafter, buffered_opt, buffered_sched)
    handed = _handed_over(target, objective, handed_drafter, handed_opt, handed_sched)
    assert all(p.grad is None for p in handed_drafter.parameters())
    for step, micro in enumerate(steps):
        a, b = buffered.run(micro), handed.run(micro)
        assert a.skipped == b.skipped and a.skipped == (step == 5), step
        for x, y in ((a.loss, b.loss), (a.grad_norm, b.grad_norm)):
            assert x == y or (math.isnan(x) and math.isnan(y)), step
        assert all(p.grad is None for p in handed_drafter.parameters()), step
    for (name, pa), pb in zip(buffered_drafter.named_parameters(), handed_drafter.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(buffered_opt.state[pa]["exp_avg_sq"], handed_opt.state[pb]["exp_avg_sq"]), name
    assert float(handed_drafter.unreached.detach().max()) < 1.0
    with pytest.raises(ValueError, match="persistent gradient buffers" if fused else "fused AdamW"):
        GraphedStep(name="test", step=handed, shapes=step_shapes(BUCKETS, 4, objective, len(LAYERS) * target.spec.hidden_size,
                                                                  torch.float32, target.spec.vocab_size))


@pytest.mark.parametrize("kind", ["graphed", "eager, gradients handed over"])
def test_replicas_gradient_sum_through_the_static_step(target, kind):
    """Two replicas in two real threads, each a GraphedStep (or the eager step that drops its
    gradients), the GradientReducer summing their gradients between the micro-batches and the
    update == one drafter taking both micro-batches of each step (classic step, gradient
    accumulation)."""
    objective = _objective(anchors=24)
    steps = _steps(target, objective, steps=10, batches_per_step=2)
    reference = _drafter(target)
    replicas = [copy.deepcopy(reference), copy.deepcopy(reference)]
    ref_opt, ref_sched = _trainer(target, objective, reference)
    make = _graphed if kind == "graphed" else _handed_over
    stepped = [make(target, objective, d, *_trainer(target, objective, d)) for d in replicas]
    reducer = GradientReducer(replicas, StopSignal())
    results: dict[int, list] = {0: [], 1: []}

    def run(rank):
        for micro in steps:
            stepped[rank].accumulate(micro[rank])
            reducer.sync(rank)
            step = stepped[rank]
            results[rank].append(step.update() if kind == "graphed" else step.result(step.update()))

    errors = run_in_threads(run, (0, 1), timeout=60, on_error=lambda _: reducer.abort())
    assert not errors, errors
    ref_step = _eager(target, objective, reference, ref_opt, ref_sched)
    expected = [ref_step.run(micro) for micro in steps]
    for step, exp in enumerate(expected):
        assert results[0][step].loss + results[1][step].loss == pytest.approx(exp.loss, rel=1e-5)
        assert results[0][step].grad_norm == pytest.approx(exp.grad_norm, rel=1e-5)
    for replica in replicas:
        for a, b in zip(reference.parameters(), replica.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_shape_no_bucket_was_prepared_for_runs_eagerly_with_one_warning(target):
    objective = _objective(anchors=24)
    steps = _steps(target, objective, steps=3, batches_per_step=1, batch_size=2)
    drafter = _drafter(target)
    graphed = _graphed(target, objective, drafter, *_trainer(target, objective, drafter), batch_size=4)
    reference = copy.deepcopy(drafter)
    ref_opt, ref_sched = _trainer(target, objective, reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [graphed.run(micro) for micro in steps]
    notes = [str(w.message) for w in caught if "no bucket was prepared" in str(w.message)]
    assert 1 <= len(notes) <= 2  # once per unprepared shape (two lengths at most here)
    ref_step = _eager(target, objective, reference, ref_opt, ref_sched)
    expected = [ref_step.run(micro) for micro in steps]
    assert [r.loss for r in results] == pytest.approx([e.loss for e in expected], rel=1e-5)


# --- the capturable feature forward -------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_feature_forward_equals_target_features(family):
    """The hook-free forward over the model's own modules (what the target's graphs capture)
    equals Target.features in float32, stopping early and with the last layer's final norm."""
    target = tiny_target(family, layers=6, seed=1)
    ids = torch.randint(0, 96, (3, 37), generator=torch.Generator().manual_seed(0))
    assert feature_forward_unsupported(target, 37) is None
    for layer_ids in ([1, 3], [5, 0, 2], [4]):
        assert torch.equal(FeatureForward(target, layer_ids)(ids), target.features(ids, layer_ids))


def test_feature_forward_refuses_models_it_would_get_wrong():
    gemma = tiny_target("gemma3_text", layers=4)  # its rotary embedding takes a layer type; a 16-token window
    assert "sliding window" in feature_forward_unsupported(gemma, 40)
    assert "Gemma3RotaryEmbedding does not run as rotary(x, positions)" in feature_forward_unsupported(gemma, 12)
    eager = tiny_target("llama", layers=4, seed=3)
    eager.model.config._attn_implementation = "eager"  # its layers need the model's causal mask
    assert "differ from Target.features" in feature_forward_unsupported(eager, 12)


def test_graphed_features_on_cpu_fall_back_to_the_live_target(target):
    from dflash_train.train.supply import LiveTarget
    from dflash_train.train.feature_graphs import GraphedFeatures

    live = LiveTarget(target, LAYERS)
    graphed = GraphedFeatures(live, target, BUCKETS, 4)
    assert "not a CUDA device" in graphed.prepare(lambda line: None)
    host = BatchPlanner(pattern_samples(8), batch_size=4, batches_per_step=1, buckets=BUCKETS, seed=0,
                        objectives={"d": _objective()}).step_batches(0)[0]
    assert torch.equal(graphed.features(host), live.features(host))


# --- choices, configuration errors --------------------------------------------------------------

def test_cuda_graphs_choices_and_configuration_errors(tmp_path):
    with pytest.raises(ConfigError, match="--cuda-graphs 'yes'"):
        TrainConfig(cuda_graphs="yes")
    with pytest.raises(ConfigError, match="need CUDA devices"):
        TrainConfig(cuda_graphs="on", device="cpu")
    with pytest.raises(ConfigError, match="need CUDA devices"):
        TrainConfig(cuda_graphs="on", device="cuda:0", drafter_devices=["cpu"])
    TrainConfig(cuda_graphs="on", device="cpu", target_devices=["cuda:0"], drafter_devices=["cuda:1"])
    cpu = [torch.device("cpu")]
    with pytest.raises(ConfigError, match="cpu is not one"):  # `auto` resolved to the cpu
        choose_cuda_graphs(TrainConfig(cuda_graphs="on", device="auto"), cpu)
    assert not choose_cuda_graphs(TrainConfig(cuda_graphs="auto"), cpu).enabled
    assert not choose_cuda_graphs(TrainConfig(cuda_graphs="off"), [torch.device("cuda:0")]).enabled
    assert choose_cuda_graphs(TrainConfig(cuda_graphs="auto"), [torch.device("cuda:0")]).enabled
    # Both FP8 modes have trained the recipe graphed on a GPU (docs/PERF.md): auto captures them,
    # each bucket still checked against its eager step at capture.
    cuda = [torch.device("cuda:0")]
    for mode in ("auto", "on"):
        for fp8 in ("head", "all"):
            choice = choose_cuda_graphs(TrainConfig(cuda_graphs=mode, fp8=fp8), cuda)
            assert choice.enabled and "eager where refused" in choice.reason
    variants = [{"name": "plain"}, {"name": "fp8", "fp8": "all"}]
    assert choose_cuda_graphs(TrainConfig(cuda_graphs="auto", mode="variants", variants=variants), cuda).enabled


def test_compile_target_decides_which_graphed_sources_compile_the_feature_forward(target):
    """--compile-target auto compiles a dense target's feature forward wherever --compile compiles
    the drafter (auto: on CUDA), a hybrid's or MoE's never, and says so in one start line; on
    compiles every family's; off, or --compile off, captures the plain forward; anything else is
    a one-line configuration error. No CUDA call is made: the decision reads the device's type."""
    from dflash_train.train.precision import compiles_target, uncompiled_target_note
    from dflash_train.train.supply import LiveTarget
    from dflash_train.train.startup import GraphChoice, graphed_sources

    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    hybrid, moe = tiny_target("qwen3_5_text", layers=4), tiny_target("qwen3_moe", layers=2)
    assert compiles_target(TrainConfig(), cuda, target) and not compiles_target(TrainConfig(), cpu, target)
    assert compiles_target(TrainConfig(compile="on"), cpu, target)
    for other in (hybrid, moe):
        assert not compiles_target(TrainConfig(), cuda, other) and not compiles_target(TrainConfig(compile="on"), cpu, other)
    for each in (target, hybrid, moe):
        assert compiles_target(TrainConfig(compile_target="on"), cuda, each)
        assert compiles_target(TrainConfig(compile_target="on", compile="on"), cpu, each)
        assert not compiles_target(TrainConfig(compile_target="on"), cpu, each)  # --compile auto: CUDA only
        assert not compiles_target(TrainConfig(compile_target="on", compile="off"), cuda, each)
        assert not compiles_target(TrainConfig(compile_target="off"), cuda, each)
    with pytest.raises(ConfigError, match="--compile-target 'yes'"):
        TrainConfig(compile_target="yes")

    assert uncompiled_target_note(TrainConfig(), [cuda], hybrid) == (
        "target feature forward: captured uncompiled (--compile-target auto compiles dense targets only; "
        "this target is hybrid; --compile-target on compiles it)")
    assert "this target is moe;" in uncompiled_target_note(TrainConfig(), [cpu, cuda], moe)
    assert uncompiled_target_note(TrainConfig(), [cuda], target) is None
    for config in (TrainConfig(compile_target="on"), TrainConfig(compile_target="off"), TrainConfig(compile="off")):
        assert uncompiled_target_note(config, [cuda], hybrid) is None
    assert uncompiled_target_note(TrainConfig(), [cpu], hybrid) is None

    live = LiveTarget(target, LAYERS)
    for compiled in (True, False):
        [source] = graphed_sources([live], GraphChoice(True, "on"), BUCKETS, 4, compiled=lambda device, _: compiled)
        assert source.fallback is live and (source.compiled_forward is not None) == compiled
    assert graphed_sources([live], GraphChoice(False, "off"), BUCKETS, 4, compiled=lambda device, _: True) == [live]
    # build_target_workers' decision, per source's own target (constructing torch.compile compiles nothing yet)
    sources = graphed_sources([live, LiveTarget(hybrid, [1, 3])], GraphChoice(True, "on"), BUCKETS, 4,
                              compiled=functools.partial(compiles_target, TrainConfig(compile="on")))
    assert [source.compiled_forward is not None for source in sources] == [True, False]


def test_cli_refuses_cuda_graphs_on_the_cpu_in_one_line(tmp_path, capsys):
    from dflash_train.cli import main

    code = main(["train", "--target", "x", "--data", "y", "--out", str(tmp_path), "--device", "cpu", "--cuda-graphs", "on"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cuda-graphs on" in err[0]


# --- utilisation and the bottleneck ---------------------------------------------------------------

def _load(name, role, host, gpu, device="cuda:0"):
    return WorkerLoad(name, role, device, host, gpu)


def test_bottleneck_names_the_saturated_resource():
    # a drafter GPU full of kernels, hosts idle
    assert bottleneck([_load("target-0", "target", 0.2, 0.1), _load("drafter-0", "drafter", 0.3, 0.9, "cuda:1")],
                      1.9, 2).label == "drafter GPU"
    # one shared GPU, mostly the target's work: the target's GPU limits
    assert bottleneck([_load("target-0", "target", 0.1, 0.6), _load("drafter-0", "drafter", 0.2, 0.3)],
                      0.1, 2).label == "target GPU"
    # GPUs idle, the drafter thread busy all the time: its host (launches, Python)
    assert bottleneck([_load("target-0", "target", 0.4, 0.2), _load("drafter-0", "drafter", 0.97, 0.31)],
                      1.5, 2).label == "drafter host"
    # nobody saturated: drafters starve on an empty queue -> the target side, its larger resource
    found = bottleneck([_load("target-0", "target", 0.7, 0.4), _load("drafter-0", "drafter", 0.3, 0.2)], 0.1, 2)
    assert found.label == "target host" and "queue depth" in found.detail
    assert bottleneck([_load("target-0", "target", 0.3, 0.2), _load("drafter-0", "drafter", 0.5, 0.6)],
                      1.8, 2).label == "drafter GPU"
    assert bottleneck([_load("target-0", "target", 0.5, None, "cpu"), _load("drafter-0", "drafter", 0.5, None, "cpu")],
                      1.0, 2).label == "queue"


class _SlowTarget(Target):
    """A live target whose features take 60 ms longer (host time: the thread sleeps)."""

    def features(self, *args, **kwargs):
        time.sleep(0.06)
        return super().features(*args, **kwargs)


def _pipeline_records(out):
    return [json.loads(line) for line in (out / "pipeline.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("slow", ["target", "drafter"])
def test_pipeline_names_a_deliberately_slowed_side(tmp_path, target, slow):
    """Real threads on the CPU: a target thread sleeping 60 ms per batch is named `target host`,
    a drafter thread sleeping 60 ms after each step `drafter host` (in the step line's record in
    pipeline.jsonl and the summary), with the host busy fractions that say so."""
    source = _SlowTarget(target.model) if slow == "target" else target
    hook = (lambda worker, step: time.sleep(0.06)) if slow == "drafter" else None
    config = tiny_train_config(tmp_path, steps=12, num_anchors=8, log_every=4, save_every=100, export_dtype="")
    summary = train(config, samples=pattern_samples(32), target=source, log=open(os.devnull, "w"), step_hook=hook)
    last = _pipeline_records(tmp_path)[-1]
    assert last["bottleneck"] == f"{slow} host", last
    assert summary["bottleneck"].startswith(f"{slow} host")
    workers = last["workers"]
    fast = "drafter-0" if slow == "target" else "target-0"
    slow_name = "target-0" if slow == "target" else "drafter-0"
    assert workers[slow_name]["host_busy"] > 0.85 > workers[fast]["host_busy"], workers
    assert workers[slow_name]["gpu_busy"] is None  # no CUDA events on the CPU


def test_startup_numbers_reach_the_first_record_and_the_summary(tmp_path, target):
    config = tiny_train_config(tmp_path, steps=3, num_anchors=8, log_every=1, save_every=100, export_dtype="")
    summary = train(config, samples=pattern_samples(16), target=target, log=open(os.devnull, "w"))
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < first["time_to_first_step_s"] <= first["elapsed_s"] + 1e-9
    startup = summary["startup"]
    assert startup["time_to_first_step_s"] == first["time_to_first_step_s"]
    assert startup["time_to_full_speed_s"] is not None and startup["warmup_s"] is None  # nothing to warm up on the CPU


def test_a_damaged_compile_cache_is_reported_and_ignored(tmp_path):
    import io

    from dflash_train.train.compile_cache import CACHE_FILE, artifacts_supported, load_compile_cache

    if not artifacts_supported():
        pytest.skip("this torch has no save/load_cache_artifacts")
    (tmp_path / CACHE_FILE).write_bytes(b"not a cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = load_compile_cache(tmp_path, io.StringIO())
    assert report.supported and not report.loaded and "did not load" in report.note
    assert any("compile cache" in str(w.message) for w in caught)
    assert load_compile_cache(tmp_path / "empty", io.StringIO()).note == "no saved artifacts yet"


# --- the warm-up's logic, with a stand-in for the capture -----------------------------------------

class _EagerGraph:
    """Stands in for a captured CUDA graph on the CPU (no capture runs here): `replay` runs the
    function eagerly. With `baked`, it first puts back the input buffers as they were at
    "capture", like a graph that read host copies instead of the buffers would behave."""

    def __init__(self, fn, buffers=None):
        self.fn = fn
        self.baked = [(b, b.clone()) for b in buffers] if buffers else []

    def replay(self):
        for buffer, value in self.baked:
            buffer.copy_(value)
        self.fn()


class _Stream:
    def synchronize(self):
        pass


def _warm_up_on_cpu(graphed, monkeypatch, capture):
    """GraphedStep's warm-up sequence (prepare without its CUDA streams) with `capture` standing in."""
    from dflash_train import capture as graph_capture

    monkeypatch.setattr(graph_capture, "capture", capture)
    graphed.stream = _Stream()
    graphed.step.skip_update()
    for shape in graphed.shapes.inputs:
        graphed._prepare_shape(shape, lambda line: None)
    graphed._prepare_update()
    graphed.step.reset()


def test_the_warm_up_changes_no_weight_and_its_replay_check_catches_a_baked_graph(target, monkeypatch):
    """The warm-up (compile run, captures, replay checks, skipped update) leaves weights, Adam
    moments and step counts as they were, and the steps after it equal the classic step's. A
    'graph' that replays stale inputs fails the replay check: its length then runs eagerly, named
    in one warning, and the result is still the classic step's."""
    objective = _objective(anchors=24)
    steps = _steps(target, objective, steps=6, batches_per_step=2)
    for baked_length in (None, BUCKETS[1]):
        reference = _drafter(target)
        drafter = copy.deepcopy(reference)
        optimizer, scheduler = _trainer(target, objective, drafter)
        graphed = _graphed(target, objective, drafter, optimizer, scheduler)
        before = [p.detach().clone() for p in drafter.parameters()]

        baked_shape = next((shape for shape in graphed.inputs if shape.length == baked_length), None)

        def capture(fn, device, stream, pool=None):
            baked = _captures_shape(graphed, fn, baked_shape)
            return _EagerGraph(fn, [graphed.inputs[baked_shape].target_features] if baked else None), None

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _warm_up_on_cpu(graphed, monkeypatch, capture)
            graphed._warn_eager_buckets()
        assert all(torch.equal(a, b) for a, b in zip(drafter.parameters(), before))
        assert all(float(optimizer.state[p]["step"]) == 0 and float(optimizer.state[p]["exp_avg"].abs().max()) == 0
                   for p in drafter.parameters())
        assert all(float(g.abs().max()) == 0 for g in graphed.step.grads)
        if baked_length is None:
            assert not graphed.eager_reasons and graphed.update_graph is not None
            assert len(graphed.graphs) == sum(len(r) for r in graphed.shapes.rows.values())
            assert not [w for w in caught if "CUDA graphs" in str(w.message)]
        else:
            assert list(graphed.eager_reasons) == [f"length {baked_length}"], graphed.eager_reasons
            assert "replay differs" in graphed.eager_reasons[f"length {baked_length}"]
            assert not any(key[0] == baked_shape for key in graphed.graphs)
            assert len([w for w in caught if "CUDA graphs" in str(w.message)]) == 1
        ref_step = _eager(target, objective, reference, *_trainer(target, objective, reference))
        for micro in steps:
            expected = ref_step.run(micro)
            assert graphed.run(micro).loss == pytest.approx(expected.loss, rel=1e-5)
        for a, b in zip(drafter.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _captures_shape(graphed, fn, shape):
    """Whether `fn` (a lambda around Step.accumulate) reads `shape`'s buffers."""
    if shape is None:
        return False
    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    return any(cell is graphed.inputs[shape] for cell in cells)


def test_static_step_with_fp8_products_follows_the_classic_fp8_step(target):
    """--fp8 all through the functions CUDA graphs capture (run eagerly here): 3 steps of 2
    micro-batches stay closer to the classic FP8 step than FP8 is to exact products (by a margin
    a static step that lost the FP8 head would not keep: measured 1.5 of FP8's distance then).
    Not always equal: a rows bucket's padding rows (copies of a real row) can change the last
    head chunk's FP8 scale. Small on purpose: CPU FP8 products are slow on some hosts."""
    from dflash_train.core.fp8 import use_fp8_linears

    fp8_objective, exact_objective = _objective(anchors=12), _objective(anchors=12)
    fp8_objective.fp8_head = True
    steps = _steps(target, fp8_objective, steps=3, batches_per_step=2)
    classic_fp8 = _drafter(target)
    exact = copy.deepcopy(classic_fp8)
    assert use_fp8_linears(classic_fp8) > 0
    static_fp8 = copy.deepcopy(classic_fp8)
    classic_opt, classic_sched = _trainer(target, fp8_objective, classic_fp8)
    exact_opt, exact_sched = _trainer(target, exact_objective, exact)
    static_opt, static_sched = _trainer(target, fp8_objective, static_fp8)
    graphed = _graphed(target, fp8_objective, static_fp8, static_opt, static_sched)
    classic_step = _eager(target, fp8_objective, classic_fp8, classic_opt, classic_sched)
    exact_step = _eager(target, exact_objective, exact, exact_opt, exact_sched)
    for micro in steps:
        expected = classic_step.run(micro)
        exact_step.run(micro)
        got = graphed.run(micro)
        assert not got.skipped and got.loss == pytest.approx(expected.loss, rel=1e-2)
    with torch.no_grad():
        for (name, s), c, e in zip(static_fp8.named_parameters(), classic_fp8.parameters(), exact.parameters()):
            # measured: ~3e-5 of FP8's distance from exact (0.61 at 6 steps of 24 anchors); ~1.5 without the FP8 head
            assert _relative(s, c) <= 0.8 * _relative(e, c), (name, _relative(s, c), _relative(e, c))


def test_graphed_features_capture_the_compiled_forward_or_say_why_not(target):
    """`GraphedFeatures(compiled=True)` runs the torch.compile'd FeatureForward before its capture
    (dynamo's eager backend here: the same trace inductor gets on the GPU), and it equals
    Target.features; a compile that fails leaves that length on the plain forward, with the reason."""
    from dflash_train.train.supply import LiveTarget
    from dflash_train.train.feature_graphs import GraphedFeatures

    ids = torch.randint(0, 96, (4, BUCKETS[0]), generator=torch.Generator().manual_seed(2))
    expected = target.features(ids, LAYERS)
    graphed = GraphedFeatures(LiveTarget(target, LAYERS), target, BUCKETS, 4, compiled=True)
    graphed.compiled_forward = torch.compile(graphed.forward, backend="eager", dynamic=False)
    forward = graphed._warm_forward(ids, BUCKETS[0])
    assert forward is graphed.compiled_forward and not graphed.plain_reasons
    torch.testing.assert_close(forward(ids), expected, rtol=1e-5, atol=1e-6)

    def refuse(graph_module, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    graphed.compiled_forward = torch.compile(graphed.forward, backend=refuse, dynamic=False)
    forward = graphed._warm_forward(ids, BUCKETS[0])
    assert forward is graphed.forward and "this backend compiles nothing" in graphed.plain_reasons[BUCKETS[0]]
    assert torch.equal(forward(ids), expected)
    assert GraphedFeatures(LiveTarget(target, LAYERS), target, BUCKETS, 4).compiled_forward is None  # --compile off
