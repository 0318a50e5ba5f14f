"""Hybrid and MoE targets on a GPU: the feature forward captured where its replay equals
`Target.features` (else eager, said once), the static decoder's graphs on Qwen3-MoE, the
rollback of the HF decoder on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
from dflash_train.target.model import Target
from tiny import NEW_FAMILIES, pattern_samples, tiny_hf_model

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
    spec = generate(target, drafter, prompt, 40, decoder="auto")
    assert spec.decoder == "hf"
    assert spec.tokens == generate(target, None, prompt, 40, decoder="hf").tokens


def test_static_decoder_graphs_on_qwen3_moe_give_the_eager_tokens():
    target = cuda_target("qwen3_moe", torch.float32)
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95, target_layer_ids=LAYERS)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(DEVICE).eval()
    prompt = [5, 17, 3, 60, 2, 9, 41, 8]
    runner = make_decoder(target, drafter, len(prompt) + 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.prepare()
    captured = [name for name, step in runner.state.greedy_steps.items() if step.graph is not None]
    print(f"qwen3_moe static greedy steps captured: {captured}; warnings: {[str(w.message)[:160] for w in caught]}")
    static = generate(target, drafter, prompt, 40, decoder="static")
    assert static.decoder == "static"
    assert static.tokens == generate(target, None, prompt, 40, decoder="hf").tokens
