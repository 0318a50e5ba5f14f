"""Hybrid and MoE targets on a GPU: the feature forward captured where its replay equals
`Target.features` (else eager, said once), the static decoder's graphs on Qwen3-MoE and on
hybrids, the batched generator's graphs on hybrids, the rollback of the HF decoder on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
from dflash_train.target.model import Target
from tiny import NEW_FAMILIES, pattern_samples, slow_decay, tiny_hf_model

from dflash_train.core.drafter import DFlashDrafter, DrafterConfig
from dflash_train.core.objective import ObjectiveConfig
from dflash_train.decode.loop import generate, make_decoder
from dflash_train.train.batches import BatchPlanner
from dflash_train.train.supply import LiveTarget
from dflash_train.train.feature_graphs import GraphedFeatures

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda:0")
LAYERS = [0, 3]


def cuda_target(family: str, dtype: torch.dtype) -> Target:
    model = tiny_hf_model(family, layers=4).to(DEVICE, dtype)
    if dtype != torch.bfloat16 and getattr(model.config, "num_experts", None):
        # torch's grouped matrix product (Hugging Face's default experts path) is graph-safe in
        # bf16 only: its fallback reads the expert offsets on the host (docs/FAULTS.md).
        model.set_experts_implementation("batched_mm")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return Target(model)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_feature_forward_is_captured_where_it_replays_equal_else_eager_said_once(family):
    target = cuda_target(family, torch.bfloat16)
    live = LiveTarget(target, LAYERS)
    buckets = [64, 128]
    graphed = GraphedFeatures(live, target, buckets, 4)
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed.prepare(lines.append)
    eager_warnings = [w for w in caught if "runs eagerly" in str(w.message)]
    assert len(eager_warnings) <= 1  # said once, naming every length
    assert set(graphed.graphs) | set(graphed.eager_reasons) == set(buckets)
    if family == "gpt_oss":  # 16-token sliding windows: the model's own forward builds the masks
        assert set(graphed.eager_reasons) == set(buckets) and "sliding window" in graphed.eager_reasons[64]
    print(f"{family}: {lines[-1]}; eager: {graphed.eager_reasons}")
    planner = BatchPlanner(pattern_samples(8, max_len=100), batch_size=4, batches_per_step=1, buckets=buckets, seed=0,
                           objectives={"d": ObjectiveConfig(block_size=4, num_anchors=8)})
    for step in range(2):
        batch = planner.step_batches(step)[0]
        got, expected = graphed.features(batch), live.features(batch)
        scale = float(expected.abs().max())
        assert float((got - expected).abs().max()) / scale <= 2e-2


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_speculative_decoding_on_cuda_equals_target_only(family):
    target = cuda_target(family, torch.float32)
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95, target_layer_ids=LAYERS)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(DEVICE).eval()
    prompt = [5, 17, 3, 60, 2, 9, 41]
    expected = generate(target, None, prompt, 40, decoder="hf").tokens
    for decoder in ("auto", "hf"):
        spec = generate(target, drafter, prompt, 40, decoder=decoder)
        assert spec.decoder == ("static" if decoder == "auto" else "hf")
        assert spec.tokens == expected


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_static_decoder_graphs_on_a_hybrid_give_target_only_tokens(family):
    """Every greedy step captured (draft, verify, agreement and the commit of the kept tokens in
    one graph) and replayed: the tokens of target-only decoding, for blocks kept in part."""
    target = slow_decay(cuda_target(family, torch.float32))
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95, target_layer_ids=LAYERS)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(DEVICE).eval()
    prompts = [[5, 17, 3, 60, 2, 9, 41, 8], [1, 2, 3], list(range(10, 80))]
    runner = make_decoder(target, drafter, 80 + 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.prepare()
    messages = [str(w.message)[:200] for w in caught]
    assert all(step.graph is not None for step in runner.state.greedy_steps.values()), messages
    assert runner.state.next_greedy.graph is not None, messages
    for prompt in prompts:
        expected = generate(target, None, prompt, 40, decoder="hf").tokens
        assert generate(target, None, prompt, 40, decoder="static").tokens == expected
        static = generate(target, drafter, prompt, 40, decoder="static", cache_tokens=120)
        assert static.decoder == "static" and static.tokens == expected
        stopped = generate(target, drafter, prompt, 40, [expected[11]], decoder="static", cache_tokens=120)
        assert stopped.tokens == expected[: expected.index(expected[11]) + 1]


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_graphed_batched_generator_on_a_hybrid_equals_hugging_face_generate(family):
    """Captured steps and prefills with linear-attention states per slot: Hugging Face's own
    `generate` per prompt (float32), slots refilled, the tail's fewer-row steps captured while
    rows decode (their states put back before the checking replay); bf16 equals the eager engine."""
    from test_generate_engine import by_id, early_stop_token, hf_generate, make_jobs, varied_prompts

    from dflash_train.generate.engine import StaticBatchEngine
    from dflash_train.generate.regenerate import GenerationSettings

    for dtype in (torch.float32, torch.bfloat16):
        target = slow_decay(cuda_target(family, dtype))
        prompts = varied_prompts(40, seed=6, long=100)
        max_new = 40
        stop = early_stop_token(target, prompts[:10], max_new) if dtype == torch.float32 else 7
        settings = GenerationSettings(max_new_tokens=max_new)
        graphed = StaticBatchEngine(target, settings, [stop], slots=16)
        got = by_id(graphed.generated(make_jobs(prompts)))
        assert all(step.graph is not None for step in graphed.state.steps.values())
        assert all(p.step.graph is not None for p in graphed.state.prefills.values())
        if dtype == torch.float32:
            assert len(graphed.state.steps) >= 2  # the tail ran on fewer rows
            assert got == {f"row{i}": hf_generate(target, p, max_new, stop) for i, p in enumerate(prompts)}
        else:
            eager = StaticBatchEngine(target, settings, [stop], slots=16, graphs=False, bucket_prefills=True,
                                      attention=graphed.state.attention)
            assert by_id(eager.generated(make_jobs(prompts))) == got
