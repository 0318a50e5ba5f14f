"""`--cuda-graphs` on a GPU: captured steps equal eager ones, threads warm up in turn, the
pipeline trains with graphs and names a deliberately slowed target. Every test asserts that the
graphs were really captured (a silent fallback to eager would otherwise pass as equal)."""

import io
import json
import os
import threading
import warnings

import pytest
import torch
from dflash_train.target.model import Target
from safetensors.torch import load_file
from threads import run_in_threads
from tiny import pattern_samples, tiny_hf_model, tiny_train_config

from dflash_train.core.drafter import DrafterConfig
from dflash_train.core.fp8 import use_fp8_linears
from dflash_train.core.objective import ObjectiveConfig
from dflash_train.core.step import DrafterBatch, FrozenTargetParts, Step, warmup_cosine
from dflash_train.parallel.gradients import GradientReducer
from dflash_train.parallel.threads import StopSignal
from dflash_train.train.batches import BatchPlanner
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.feature_graphs import GraphedFeatures
from dflash_train.train.replicas import init_drafter
from dflash_train.train.step_graphs import GraphedStep, step_shapes
from dflash_train.train.supply import LiveTarget
from dflash_train.train.trainer import train

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda:0")
LAYERS = [1, 3]
# Query rows (anchors x block) and key rows (bucket + query rows) in multiples of 128: on the
# H200 with torch 2.11, flex attention found no kernel for float32 queries of 96 rows
# (NoValidChoicesError), while the recipe's 4,096 x 4,864 compiled; the tests keep to such shapes.
BUCKETS = [128, 256]


def _room_for_recompiles():
    # Several drafters compile the same forward in one process: room for all of them. Dynamo's
    # config is per thread from torch 2.12, so each thread that compiles sets it.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)


@pytest.fixture(autouse=True)
def _compile_room():
    _room_for_recompiles()


def _target(dtype=torch.float32, seed=0):
    # head_dim 64, as SmolLM2: flex attention on torch 2.11 finds no kernel for float32 queries at head_dim 16.
    model = tiny_hf_model("llama", layers=6, hidden=256, seed=seed).to(DEVICE, dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    return Target(model)


def _objective(fused_head=False):
    return ObjectiveConfig(block_size=4, num_anchors=32, loss_chunk_rows=64, compiled_head=True, fused_head=fused_head)


def _drafter(target, seed=0, fp8=False):
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=4, mask_token_id=95, target_layer_ids=LAYERS)
    drafter = init_drafter(config, seed).to(DEVICE)
    if fp8:
        use_fp8_linears(drafter)
    return drafter


def _compiled(drafter):
    drafter.forward = torch.compile(drafter.forward, dynamic=False)
    return drafter


def _frozen(target, dtype):
    return FrozenTargetParts(target.embed_weight.detach().to(dtype), target.head_weight.detach().to(dtype))


def _trainer(drafter):
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    return optimizer, warmup_cosine(optimizer, 40, 0.1, 0.1)


def _steps(target, objective, steps, batches_per_step=2, poison=None):
    """Planned micro-batches (two length buckets) with the target's features on the GPU; `poison`
    = (step, micro-batch) gets an inf feature (a non-finite gradient: a skipped step)."""
    planner = BatchPlanner(pattern_samples(48, min_len=30, max_len=250), batch_size=4, batches_per_step=batches_per_step,
                           buckets=BUCKETS, seed=0, objectives={"d": objective})
    out = []
    for step in range(steps):
        micro = []
        for j, host in enumerate(planner.step_batches(step)):
            anchors, valid = host.anchors["d"]
            features = target.features(host.input_ids.to(DEVICE), LAYERS)
            if poison == (step, j):
                features = features.clone()
                features[0, 3, 0] = float("inf")
            micro.append(DrafterBatch(features, host.input_ids.to(DEVICE), host.loss_mask.to(DEVICE), anchors.to(DEVICE),
                                      valid.to(DEVICE), host.normalizers["d"], host.scored_rows["d"]))
        out.append(micro)
    return out


def _eager(drafter, optimizer, scheduler, frozen, objective, autocast):
    return Step(drafter, optimizer, scheduler, frozen, objective, attention_backend="flex", clip_grad=0.5,
                autocast_dtype=autocast)


def _graphed(target, objective, drafter, optimizer, scheduler, autocast, frozen_dtype):
    shapes = step_shapes(BUCKETS, 4, objective, len(LAYERS) * target.spec.hidden_size, target.embed_weight.dtype,
                         target.spec.vocab_size)
    step = _eager(drafter, optimizer, scheduler, _frozen(target, frozen_dtype), objective, autocast)
    return GraphedStep(name="gpu-test", step=step, shapes=shapes)


def _assert_all_captured(graphed):
    assert graphed.classic_reason is None, graphed.classic_reason
    assert not graphed.eager_reasons, graphed.eager_reasons
    assert len(graphed.graphs) == sum(len(r) for r in graphed.shapes.rows.values()) and graphed.update_graph is not None


def _f32_lr(optimizer):
    """The eager run at the float32 value of its lr: what a captured update reads from its lr tensor."""
    for group in optimizer.param_groups:
        group["lr"] = float(torch.tensor(group["lr"], dtype=torch.float32))


def _relative(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def _run_eager(target, objective, steps, autocast, frozen_dtype, round_lr, seed=0, fp8=False):
    drafter = _compiled(_drafter(target, seed, fp8))
    optimizer, scheduler = _trainer(drafter)
    step = _eager(drafter, optimizer, scheduler, _frozen(target, frozen_dtype), objective, autocast)
    results = []
    for micro in steps:
        if round_lr:
            _f32_lr(optimizer)
        results.append(step.run(micro))
    return drafter, optimizer, results


def _run_graphed(target, objective, steps, autocast, frozen_dtype, seed=0, fp8=False):
    drafter = _compiled(_drafter(target, seed, fp8))
    optimizer, scheduler = _trainer(drafter)
    graphed = _graphed(target, objective, drafter, optimizer, scheduler, autocast, frozen_dtype)
    graphed.prepare(lambda line: None)
    _assert_all_captured(graphed)
    results = [graphed.run(micro) for micro in steps]
    torch.cuda.synchronize()
    return drafter, optimizer, results, graphed


@pytest.mark.parametrize("fused_head", [False, True], ids=["compiled-head", "fused-head"])
def test_graphed_step_equals_the_eager_step_in_float32(fused_head):
    """24 steps of 2 micro-batches over 2 length buckets, one of them skipped for a non-finite
    gradient: per-step loss, gradient norm and skip flag, and the weights and Adam moments at the
    end, equal the eager Step's (run at the float32 value of its lr, what the captured
    update reads): weights to 1e-6 relative, Adam moments to 1e-5 (the compiled step sums a norm
    weight's gradient over rows in another order than eager; on an H200 a q_norm's first moment,
    values ~1e-5, differed by 1.27e-6 relative, the same with and without worker streams).
    With the head's softmax compiled or as core/head_kernel.py's fused kernel."""
    target, objective = _target(), _objective(fused_head)
    steps = _steps(target, objective, 24, poison=(9, 1))
    eager, eager_opt, expected = _run_eager(target, objective, steps, None, torch.float32, round_lr=True)
    graphed_drafter, graphed_opt, got, _ = _run_graphed(target, objective, steps, None, torch.float32)
    assert [r.skipped for r in got] == [r.skipped for r in expected] and got[9].skipped
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a.loss == pytest.approx(b.loss, rel=1e-6, nan_ok=True), step
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6, nan_ok=True), step
        assert a.lr == pytest.approx(b.lr, rel=1e-7)
    for (name, a), b in zip(graphed_drafter.named_parameters(), eager.parameters()):
        assert _relative(a, b) <= 1e-6, name
        assert _relative(graphed_opt.state[a]["exp_avg"], eager_opt.state[b]["exp_avg"]) <= 1e-5, name
        assert _relative(graphed_opt.state[a]["exp_avg_sq"], eager_opt.state[b]["exp_avg_sq"]) <= 1e-5, name


def test_graphed_step_in_bf16_stays_within_the_eager_spread():
    """bf16 autocast, 20 steps: the graphed weights are no further from the eager run (at the float32
    lr) than eager runs are from each other (at the two lr representations, and run twice)."""
    target, objective = _target(torch.bfloat16), _objective()
    steps = _steps(target, objective, 20)
    e1, _, _ = _run_eager(target, objective, steps, torch.bfloat16, torch.bfloat16, round_lr=False)
    e2, _, _ = _run_eager(target, objective, steps, torch.bfloat16, torch.bfloat16, round_lr=True)
    e2b, _, _ = _run_eager(target, objective, steps, torch.bfloat16, torch.bfloat16, round_lr=True)
    g, _, _, _ = _run_graphed(target, objective, steps, torch.bfloat16, torch.bfloat16)
    for (name, a), b, c, d in zip(g.named_parameters(), e2.parameters(), e1.parameters(), e2b.parameters()):
        spread = max(_relative(c, b), _relative(d, b))
        assert _relative(a, b) <= spread + 1e-6, (name, _relative(a, b), spread)


def test_graphed_fp8_step_follows_the_eager_fp8_step():
    """`--fp8 all` under `--cuda-graphs on` (FP8 drafter linears and frozen head, bf16 autocast),
    12 steps: captured, and its weights are closer to the eager FP8 run's than FP8 is to bf16 (a
    replay that froze a scale or an amax at capture would drift away). On 2026-12-02 the recipe-size
    bench (one H200) saw this combination train no step in the 21 s after its warm-up: this is the small case."""
    target = _target(torch.bfloat16)
    fp8_objective, bf16_objective = _objective(), _objective()
    fp8_objective.fp8_head = True
    steps = _steps(target, fp8_objective, 12)
    eager_fp8, _, expected = _run_eager(target, fp8_objective, steps, torch.bfloat16, torch.bfloat16, round_lr=True, fp8=True)
    eager_bf16, _, _ = _run_eager(target, bf16_objective, steps, torch.bfloat16, torch.bfloat16, round_lr=True)
    graphed, _, got, _ = _run_graphed(target, fp8_objective, steps, torch.bfloat16, torch.bfloat16, fp8=True)
    assert not any(r.skipped for r in got)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a.loss == pytest.approx(b.loss, rel=2e-2), step
    for (name, a), b, c in zip(graphed.named_parameters(), eager_fp8.parameters(), eager_bf16.parameters()):
        assert _relative(a, b) <= max(_relative(c, b), 1e-3), (name, _relative(a, b), _relative(c, b))


def test_graphed_step_does_not_wait_for_the_gpu():
    """Two graphed steps right after a synchronize issue no synchronising CUDA call (the third
    waits for the first: the run-ahead bound)."""
    target, objective = _target(), _objective()
    steps = _steps(target, objective, 4)
    _, _, _, graphed = _run_graphed(target, objective, steps[:2], None, torch.float32)
    torch.cuda.synchronize()
    graphed.ahead.clear()  # all done: the next MAX_AHEAD steps need not wait for any
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            results = [graphed.run(micro) for micro in steps[2:]]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # Only the warnings of an actual synchronising call; turning the debug mode on warns that it
    # is a prototype, which is not a sync.
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "called a synchronizing" in str(w.message)]
    assert not syncs, "\n".join(syncs)
    assert all(r.loss == r.loss for r in results)  # readable afterwards


def test_replicas_gradient_sum_between_graphed_steps_equals_one_eager_drafter():
    """Two replicas (two GPUs if present, else both on one), each a GraphedStep in its own thread,
    the GradientReducer summing their persistent gradients between the replayed micro-batches and
    the replayed update == one eager drafter taking both micro-batches (float32, 20 steps)."""
    devices = [DEVICE, torch.device("cuda:1") if torch.cuda.device_count() > 1 else DEVICE]
    target, objective = _target(), _objective()
    steps = _steps(target, objective, 20)
    eager, _, expected = _run_eager(target, objective, steps, None, torch.float32, round_lr=True)
    graphed, drafters = [], []
    for rank, device in enumerate(devices):
        drafter = _compiled(_drafter(target).to(device))
        frozen = FrozenTargetParts(target.embed_weight.detach().to(device), target.head_weight.detach().to(device))
        shapes = step_shapes(BUCKETS, 4, objective, len(LAYERS) * target.spec.hidden_size, torch.float32,
                             target.spec.vocab_size)
        optimizer, scheduler = _trainer(drafter)
        step = GraphedStep(name=f"replica-{rank}", step=_eager(drafter, optimizer, scheduler, frozen, objective, None),
                           shapes=shapes)
        with torch.cuda.device(device):
            step.prepare(lambda line: None)
        _assert_all_captured(step)
        graphed.append(step)
        drafters.append(drafter)
    reducer = GradientReducer(drafters, StopSignal())
    results: dict[int, list] = {0: [], 1: []}

    def run(rank):
        torch.cuda.set_device(devices[rank])
        for micro in steps:
            batch = micro[rank]
            moved = DrafterBatch(*(t.to(devices[rank]) for t in (batch.target_features, batch.input_ids,
                                                                  batch.loss_mask, batch.anchors, batch.anchor_valid)),
                                 batch.loss_normalizer, batch.scored_rows)
            graphed[rank].accumulate(moved)
            reducer.sync(rank)
            results[rank].append(graphed[rank].update())
        torch.cuda.synchronize(devices[rank])

    errors = run_in_threads(run, (0, 1), timeout=300, on_error=lambda _: reducer.abort())
    assert not errors, errors
    for step, exp in enumerate(expected):
        assert results[0][step].loss + results[1][step].loss == pytest.approx(exp.loss, rel=1e-5), step
        assert results[0][step].grad_norm == pytest.approx(exp.grad_norm, rel=1e-5), step
    for drafter in drafters:
        for a, b in zip(drafter.parameters(), eager.parameters()):
            assert _relative(a.to(DEVICE), b) <= 1e-5


def test_a_target_thread_and_two_drafter_threads_warm_up_in_turn():
    """Three real threads on one GPU warm up (compile and capture) one at a time, as the pipeline's
    start-up gate runs them (compiles in several threads at once are not supported: see
    train/compile_gate.py), each on its own thread's stream. Every graph is captured, and a
    replay then equals the eager computation of each, in the main thread."""
    target, objective = _target(), _objective()
    steps = _steps(target, objective, 3)
    features = GraphedFeatures(LiveTarget(target, LAYERS), target, BUCKETS, 4)
    drafters = [_compiled(_drafter(target, seed)) for seed in (0, 1)]
    twins = [_compiled(_drafter(target, seed)) for seed in (0, 1)]  # same seed: the same weights
    graphed = [_graphed(target, objective, d, *_trainer(d), None, torch.float32) for d in drafters]
    in_turn = threading.Lock()

    def warm(prepare):
        torch.cuda.set_device(DEVICE)
        with in_turn:
            _room_for_recompiles()
            prepare(lambda line: None)

    errors = run_in_threads(warm, (features.prepare, graphed[0].prepare, graphed[1].prepare), timeout=600)
    assert not errors, errors
    assert sorted(features.graphs) == BUCKETS and not features.eager_reasons, features.eager_reasons
    for g in graphed:
        _assert_all_captured(g)
    planner = BatchPlanner(pattern_samples(16), batch_size=4, batches_per_step=1, buckets=BUCKETS, seed=1,
                           objectives={"d": objective})
    host = planner.step_batches(0)[0]
    assert _relative(features.features(host), target.features(host.input_ids.to(DEVICE), LAYERS)) <= 1e-5
    for g, twin in zip(graphed, twins):
        eager = _eager(twin, *_trainer(twin), _frozen(target, torch.float32), objective, None)
        for micro in steps:
            _f32_lr(eager.optimizer)
            expected = eager.run(micro)
            assert g.run(micro).loss == pytest.approx(expected.loss, rel=1e-6)


class ReplicaWeights:
    """A `train` step hook: each replica's flat weights after each step, to compare replicas."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[int, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def __call__(self, worker, step) -> None:
        flat = torch.cat([p.detach().flatten() for p in worker.replica.drafter.parameters()]).cpu()
        with self.lock:
            self.by_step.setdefault(step, {})[worker.replica.rank] = flat

    def dtypes(self) -> set:
        return {flat.dtype for by_rank in self.by_step.values() for flat in by_rank.values()}

    def assert_identical(self) -> None:
        assert self.by_step
        for step, by_rank in self.by_step.items():
            assert torch.equal(by_rank[0], by_rank[1]), step


def _pipeline_config(out, **values):
    defaults = dict(device="cuda", steps=24, num_anchors=32, max_seq_len=256, log_every=4, save_every=24, export_dtype="",
                    seq_buckets=[128, 256])
    return tiny_train_config(out, **{**defaults, **values})


def test_the_pipeline_trains_with_graphs_and_reports_gpu_busy(tmp_path):
    """train() on one GPU with a target thread and two drafter replica threads, --cuda-graphs on:
    every worker's warm-up captured all its graphs (no fallback warning), the replicas stay
    identical, the loss follows the eager run's (bf16), and pipeline.jsonl / summary.json carry
    GPU busy fractions and the start-up times."""
    fingerprints = ReplicaWeights()
    target = _target(torch.bfloat16)
    samples = pattern_samples(64, min_len=30, max_len=250)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = train(_pipeline_config(tmp_path / "on", cuda_graphs="on", drafter_devices=["cuda:0", "cuda:0"]),
                        samples=samples, target=target, log=open(os.devnull, "w"), step_hook=fingerprints)
    fallbacks = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    assert not fallbacks, fallbacks
    notes = graphed["startup"]["warmup_notes"]
    assert "2/2 feature graphs" in notes["target-0"], notes
    assert all("graphs captured" in notes[name] and "eager" not in notes[name] for name in ("drafter-0", "drafter-1")), notes
    assert graphed["startup"]["warmup_s"] > 0 and graphed["startup"]["time_to_full_speed_s"] is not None
    fingerprints.assert_identical()
    eager = train(_pipeline_config(tmp_path / "off", cuda_graphs="off", drafter_devices=["cuda:0", "cuda:0"]),
                  samples=samples, target=target, log=open(os.devnull, "w"))
    on = [json.loads(line)["loss"] for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    off = [json.loads(line)["loss"] for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert len(on) == len(off) == 24
    assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(on, off)), list(zip(on, off))
    records = [json.loads(line) for line in (tmp_path / "on" / "pipeline.jsonl").read_text().splitlines()]
    workers = records[-1]["workers"]
    assert all(workers[name]["gpu_busy"] is not None and 0 < workers[name]["gpu_busy"] <= 1 for name in workers), workers
    assert records[-1]["bottleneck"] in ("target GPU", "drafter GPU", "target host", "drafter host", "queue")
    assert eager["startup"]["time_to_first_step_s"] is not None


def test_train_with_flashattention_kernels_captures_its_graphs_and_follows_flex(tmp_path):
    """`--attention flash` (needs the flash-attn-4 package and a Hopper GPU; skipped without them,
    where it proves nothing): train() captures every graph with FlashAttention-4's kernels inside,
    and its bf16 losses follow the Triton-kernel run's within the spread the graphed test allows."""
    pytest.importorskip("flash_attn.cute")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention-4 trains on Hopper or newer")
    target = _target(torch.bfloat16)
    samples = pattern_samples(64, min_len=30, max_len=250)
    losses = {}
    for attention in ("flash", "flex"):
        log = io.StringIO()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = train(_pipeline_config(tmp_path / attention, attention=attention, cuda_graphs="on"),
                            samples=samples, target=target, log=log)
        assert not [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
        assert f"on cuda:0, attention {attention}\n" in log.getvalue()
        notes = summary["startup"]["warmup_notes"]["drafter-0"]
        assert "graphs captured" in notes and "eager" not in notes, notes
        metrics = (tmp_path / attention / "metrics.jsonl").read_text().splitlines()
        losses[attention] = [json.loads(line)["loss"] for line in metrics]
    assert len(losses["flash"]) == len(losses["flex"]) == 24
    assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(losses["flash"], losses["flex"])), losses


def test_a_hybrid_target_is_captured_uncompiled_under_compile_target_auto_and_one_line_says_so(tmp_path):
    """--compile-target auto compiles dense targets only: a hybrid's feature forward is captured
    plain (0 compiled), and the start says so once."""
    model = tiny_hf_model("qwen3_5_text", layers=4, hidden=256).to(DEVICE, torch.bfloat16)
    log = io.StringIO()
    config = _pipeline_config(tmp_path, cuda_graphs="on", steps=4, save_every=4, max_seq_len=128, seq_buckets=[128],
                              attention="sdpa")
    summary = train(config, samples=pattern_samples(16, max_len=120), target=Target(model), log=log)
    said = [line for line in log.getvalue().splitlines() if line.startswith("target feature forward:")]
    assert said == ["target feature forward: captured uncompiled (--compile-target auto compiles dense targets only; "
                    "this target is hybrid; --compile-target on compiles it)"], log.getvalue()
    assert "feature graphs, 0 compiled" in summary["startup"]["warmup_notes"]["target-0"], summary["startup"]


def _slow_gpu_target(seconds: float) -> Target:
    """A live target whose GPU work takes `seconds` longer per batch without host work: a spin
    kernel before its first decoder layer (a forward pre-hook, so Target.features and the graphed
    feature forward both run it, and the capture records it). The cycle count is measured here,
    because the spin counts clock cycles and the clock differs between GPUs."""
    model = tiny_hf_model("llama", layers=6, hidden=256).to(DEVICE, torch.bfloat16)
    probe = 50_000_000
    torch.cuda._sleep(probe)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    cycles = int(probe * seconds * 1000 / start.elapsed_time(end))
    model.model.layers[0].register_forward_pre_hook(lambda module, args: torch.cuda._sleep(cycles))
    return Target(model)


def test_a_deliberately_slowed_target_gpu_is_named(tmp_path):
    """The target's GPU work made ~40 ms longer per batch (host untouched), graphs on: the step
    line's record in pipeline.jsonl names `target GPU`, with the target's GPU busy fraction high
    and above the drafter's. The feature forward is captured uncompiled: inductor drops the spin
    (a call with no tensor result) from a compiled forward, and the replays then ran without it
    (on an H100, 190 steps/s with a 40 ms spin "in" every batch), so the drafter was the limit."""
    spin = 0.04
    config = _pipeline_config(tmp_path, cuda_graphs="on", steps=30, log_every=10, compile_target="off")
    summary = train(config, samples=pattern_samples(64, min_len=30, max_len=250), target=_slow_gpu_target(spin),
                    log=open(os.devnull, "w"))
    assert "2/2 feature graphs, 0 compiled" in summary["startup"]["warmup_notes"]["target-0"]  # the spin is in the graph
    records = [json.loads(line) for line in (tmp_path / "pipeline.jsonl").read_text().splitlines()]
    last, first = records[-1], records[0]
    workers = last["workers"]
    # Everything a failure needs to be read without another GPU run: both workers' whole records and warm-up notes.
    seen = json.dumps({"record": last, "warmup_notes": summary["startup"]["warmup_notes"]}, indent=1)
    seconds_per_step = (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])
    assert seconds_per_step >= 0.9 * spin, seen  # every replay ran the spin
    assert last["bottleneck"] == "target GPU", seen
    assert workers["target-0"]["gpu_busy"] >= 0.6 and workers["target-0"]["gpu_busy"] > workers["drafter-0"]["gpu_busy"], seen


def test_variants_share_one_gpu_with_graphs(tmp_path):
    """mode=variants (the recipe search's run): three drafters of different shapes and losses on
    one GPU from one target stream, --cuda-graphs on. Every worker captures all its graphs (no
    fallback), one target pass feeds all three, and each variant trains every step with finite
    losses and a checkpoint."""
    variants = [{"name": "base"}, {"name": "b8-dpace", "block_size": 8, "loss": "dpace"},
                {"name": "one-layer", "num_layers": 1, "lr": 1e-3}]
    config = _pipeline_config(tmp_path, cuda_graphs="on", mode="variants", variants=variants, steps=12, save_every=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(config, samples=pattern_samples(64, min_len=30, max_len=250), target=_target(torch.bfloat16),
                        log=open(os.devnull, "w"))
    fallbacks = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    assert not fallbacks, fallbacks
    notes = summary["startup"]["warmup_notes"]
    drafter_notes = {name: note for name, note in notes.items() if name.startswith("drafter-")}
    assert len(drafter_notes) == 3, notes
    assert all("graphs captured" in note and "eager" not in note for note in drafter_notes.values()), notes
    assert summary["workers"]["target-0"]["items"] == 12  # one target pass feeds every variant
    for variant in variants:
        folder = tmp_path / variant["name"]
        losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses))), (variant, losses)
        assert (folder / "checkpoints" / "step-00000012" / "drafter.safetensors").is_file(), variant


def test_compiled_feature_graphs_equal_the_target_features():
    """The target's feature forward compiled by inductor, then captured, per length bucket (what
    `--cuda-graphs on` runs with --compile auto on CUDA): every bucket compiled and captured, and a
    replay on a real batch equals Target.features in float32."""
    target = _target()
    features = GraphedFeatures(LiveTarget(target, LAYERS), target, BUCKETS, 4, compiled=True)
    summary = features.prepare(lambda line: None)
    assert summary == f"{len(BUCKETS)}/{len(BUCKETS)} feature graphs, {len(BUCKETS)} compiled", (
        summary, features.eager_reasons, features.plain_reasons)
    planner = BatchPlanner(pattern_samples(16), batch_size=4, batches_per_step=1, buckets=BUCKETS, seed=1,
                           objectives={"d": _objective()})
    for step in range(3):
        host = planner.step_batches(step)[0]
        assert host.input_ids.shape[1] in features.graphs
        assert _relative(features.features(host), target.features(host.input_ids.to(DEVICE), LAYERS)) <= 1e-5


def test_a_compiled_feature_forward_that_replays_differently_is_captured_plain():
    """A compiled forward whose replay fails the check against Target.features (here a backend
    that scales every output by 1.1; on SmolLM2 in bf16, inductor's forward at 512 and 768 tokens
    differed by 3.1-3.6e-2) is not used: that length captures the plain forward, says why, and
    its replay equals Target.features."""
    target = _target()
    features = GraphedFeatures(LiveTarget(target, LAYERS), target, BUCKETS, 4, compiled=True)

    def off_by_a_tenth(graph_module, example_inputs):
        def run(*args):
            return [o * 1.1 if torch.is_tensor(o) and o.is_floating_point() else o for o in graph_module(*args)]
        return run

    features.compiled_forward = torch.compile(features.forward, backend=off_by_a_tenth, dynamic=False)
    assert features.prepare(lambda line: None) == f"{len(BUCKETS)}/{len(BUCKETS)} feature graphs, 0 compiled"
    assert all("a replay differs from Target.features" in features.plain_reasons[length] for length in BUCKETS)
    host = BatchPlanner(pattern_samples(16), batch_size=4, batches_per_step=1, buckets=BUCKETS, seed=1,
                        objectives={"d": _objective()}).step_batches(0)[0]
    assert _relative(features.features(host), target.features(host.input_ids.to(DEVICE), LAYERS)) <= 1e-5


def test_train_with_master_weights_captures_its_graphs_and_follows_float32_parameters(tmp_path):
    """`--master-weights on` on the GPU, two replicas on one device: the compiled master update
    compiles in the warm-up (nothing after it: --fail-on-recompile) and is captured with the rest;
    the replicas' bf16 weights stay identical step by step (gradients summed in float32); the
    graphed and the eager run's losses follow the float32-parameter run's within the spread the
    graphed test allows; the checkpoint holds float32 masters."""
    fingerprints = ReplicaWeights()
    target = _target(torch.bfloat16)
    samples = pattern_samples(64, min_len=30, max_len=250)
    losses = {}
    for name, values in {"graphed": dict(master_weights="on", cuda_graphs="on"),
                         "eager": dict(master_weights="on", cuda_graphs="off"),
                         "float32": dict(master_weights="off", cuda_graphs="on")}.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = train(_pipeline_config(tmp_path / name, drafter_devices=["cuda:0", "cuda:0"],
                                             fail_on_recompile=values["master_weights"] == "on", **values),
                            samples=samples, target=target, log=open(os.devnull, "w"),
                            step_hook=fingerprints if name == "graphed" else None)
        assert not [str(w.message) for w in caught if "CUDA graphs" in str(w.message)], name
        if name == "graphed":
            notes = summary["startup"]["warmup_notes"]
            assert all("graphs captured" in notes[d] and "eager" not in notes[d] for d in ("drafter-0", "drafter-1")), notes
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in metrics]
    assert fingerprints.dtypes() == {torch.bfloat16}
    fingerprints.assert_identical()
    assert len(losses["graphed"]) == len(losses["eager"]) == len(losses["float32"]) == 24
    for name in ("graphed", "eager"):
        assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(losses[name], losses["float32"])), (name, losses)
    weights = load_file(str(latest_checkpoint(tmp_path / "graphed") / "drafter.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_train_with_packed_anchors_captures_every_capacity_and_follows_the_padded_run(tmp_path):
    """`--pack-anchors on` on the GPU under CUDA graphs: the warm-up compiles and captures one
    shape per whole rows' worth of anchor slots in each length bucket (nothing compiles after it:
    --fail-on-recompile), no micro-batch falls outside them, and the losses follow the padded
    graphed run's within the spread bf16 allows."""
    target = _target(torch.bfloat16)
    samples = pattern_samples(64, min_len=30, max_len=250)
    losses = {}
    for pack in ("off", "on"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = train(_pipeline_config(tmp_path / pack, num_anchors=96, cuda_graphs="on", fail_on_recompile=True,
                                             pack_anchors=pack),
                            samples=samples, target=target, log=open(os.devnull, "w"))
        assert not [str(w.message) for w in caught if "CUDA graphs" in str(w.message)], pack
        notes = summary["startup"]["warmup_notes"]["drafter-0"]
        assert "graphs captured" in notes and "eager" not in notes, notes
        losses[pack] = [json.loads(line)["loss"] for line in (tmp_path / pack / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["on"]) == len(losses["off"]) == 24
    assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(losses["on"], losses["off"])), losses
