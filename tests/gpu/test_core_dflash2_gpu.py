"""DFlash2 on a GPU: the captured training step equals the eager one, the static decoder's
captured greedy steps (the selector's path inside the graph) give the eager tokens and
target-only decoding's, and a variants run trains DFlash and DFlash2 side by side with graphs.
Every test asserts that the graphs were really captured."""

import json
import os
import warnings

import pytest
import torch
from test_train_step_graphs_gpu import (
    DEVICE,
    LAYERS,
    _assert_all_captured,
    _compiled,
    _f32_lr,
    _frozen,
    _graphed,
    _pipeline_config,
    _relative,
    _steps,
    _target,
    _trainer,
)
from tiny import pattern_samples, tiny_target

from dflash_train.core.drafter import DFlashDrafter, DrafterConfig
from dflash_train.core.objective import ObjectiveConfig
from dflash_train.core.step import Step
from dflash_train.decode.loop import generate, make_decoder
from dflash_train.train.replicas import init_drafter
from dflash_train.train.trainer import train

pytestmark = pytest.mark.gpu

DFLASH2 = dict(arch="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)  # the shipped conv sizes


def _objective(miss):
    return ObjectiveConfig(block_size=4, num_anchors=32, loss_chunk_rows=64, compiled_head=True, selector_miss=miss,
                           selector_weight=0.7)


def _dflash2_drafter(target, seed=0):
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=4, mask_token_id=95, target_layer_ids=LAYERS,
                                       **DFLASH2)
    return _compiled(init_drafter(config, seed).to(DEVICE))


@pytest.mark.parametrize("miss", ["drop", "insert"])
def test_dflash2_graphed_step_equals_the_eager_step_in_float32(miss):
    """12 steps of 2 micro-batches over 2 length buckets, float32: the captured step's loss and
    gradient norm per step, and the weights at the end (convolutions, codebooks included), equal
    the eager Step's."""
    target, objective = _target(), _objective(miss)
    steps = _steps(target, objective, 12)
    eager = _dflash2_drafter(target)
    eager_opt, eager_sched = _trainer(eager)
    eager_step = Step(eager, eager_opt, eager_sched, _frozen(target, torch.float32), objective, attention_backend="flex",
                      clip_grad=0.5, autocast_dtype=None)
    expected = []
    for micro in steps:
        _f32_lr(eager_opt)
        expected.append(eager_step.run(micro))
    graphed_drafter = _dflash2_drafter(target)
    optimizer, scheduler = _trainer(graphed_drafter)
    graphed = _graphed(target, objective, graphed_drafter, optimizer, scheduler, None, torch.float32)
    graphed.prepare(lambda line: None)
    _assert_all_captured(graphed)
    got = [graphed.run(micro) for micro in steps]
    torch.cuda.synchronize()
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a.loss == pytest.approx(b.loss, rel=1e-5), step
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5), step
    assert got[-1].loss < got[0].loss
    for (name, a), b in zip(graphed_drafter.named_parameters(), eager.parameters()):
        assert _relative(a, b) <= 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash2_captured_greedy_steps_give_the_eager_tokens(dtype):
    target = tiny_target("qwen3", head_scale=8)
    target.model.to("cuda", dtype)
    torch.manual_seed(1)
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=4, mask_token_id=95,
                                       target_layer_ids=[1, 3, 4], **DFLASH2)
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, 0.2)
    drafter.to("cuda", dtype)
    prompt = [5, 17, 3, 60, 2, 9, 41, 8, 8, 1]
    runner = make_decoder(target, drafter, len(prompt) + 40)
    runner.prepare()
    assert all(step.graph is not None for step in runner.state.greedy_steps.values())
    static = generate(target, drafter, prompt, 40, decoder="static")
    steps = list(runner.state.greedy_steps.values())
    for step in steps:
        step.graph, step.eager = None, True
    eager = generate(target, drafter, prompt, 40, decoder="static")
    for step in steps:
        step.eager = False
    assert static.tokens == eager.tokens and static.acceptance_lengths == eager.acceptance_lengths
    if dtype == torch.float32:
        assert static.tokens == generate(target, None, prompt, 40, decoder="hf").tokens
        assert static.tokens == generate(target, drafter, prompt, 40, decoder="hf").tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_path_equals_the_position_by_position_walk_on_the_gpu(dtype):
    """cuBLAS may reduce the batched scores table's rows in another order than the walk's one
    row per call; at SmolLM2's sizes the paths must still agree (the CPU test's cases, here)."""
    from dflash_train.core.dflash2 import CandidateSelector

    generator = torch.Generator().manual_seed(0)
    for vocab, rank, top_k in ((1000, 16, 16), (49152, 64, 16), (49152, 16, 8)):
        for scale, batch in ((0.02, 1), (0.3, 1), (2.0, 3)):
            selector = CandidateSelector(576, vocab, rank, top_k)
            selector.reset_parameters(generator, std=scale)
            selector = selector.to(DEVICE, dtype)
            for _ in range(20):
                hidden = torch.randn(batch, 15, 576, generator=generator).to(DEVICE, dtype)
                logits = (torch.randn(batch, 15, vocab, generator=generator) * 4).to(DEVICE)
                anchor = torch.randint(0, vocab, (batch,), generator=generator).to(DEVICE)
                with torch.no_grad():
                    path, candidates, _ = selector.select(hidden, logits, anchor, 0.0)
                    unary, _ = torch.topk(logits, top_k, dim=-1, sorted=False)
                    walked, _ = selector.walk(selector.hidden_projection(hidden), unary, candidates, anchor, 0.0)
                assert torch.equal(path, walked), (vocab, rank, top_k, scale, batch)


def test_variants_train_dflash_and_dflash2_on_one_gpu_with_graphs(tmp_path):
    variants = [{"name": "dflash"}, {"name": "dflash2", **DFLASH2}]
    config = _pipeline_config(tmp_path, cuda_graphs="on", mode="variants", variants=variants, steps=12, save_every=12,
                              export_dtype="bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(config, samples=pattern_samples(64, min_len=30, max_len=250), target=_target(torch.bfloat16),
                        log=open(os.devnull, "w"))
    fallbacks = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    assert not fallbacks, fallbacks
    notes = {name: note for name, note in summary["startup"]["warmup_notes"].items() if name.startswith("drafter-")}
    assert len(notes) == 2 and all("graphs captured" in n and "eager" not in n for n in notes.values()), notes
    assert summary["workers"]["target-0"]["items"] == 12  # one target pass feeds both
    for variant in variants:
        folder = tmp_path / variant["name"]
        losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses))), (variant, losses)
    assert json.loads((tmp_path / "dflash2" / "export" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
