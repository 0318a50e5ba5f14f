"""The training loop on one device: learning, checkpoints, resume, clear errors."""

import io
import json
import os
from pathlib import Path

import pytest
import torch
from dflash_train.target.model import TargetError
from safetensors.torch import load_file
from tiny import pattern_samples, tiny_target, tiny_train_config

from dflash_train.config import ConfigError
from dflash_train.train.checkpoint import latest_checkpoint, load_drafter
from dflash_train.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second intra-op thread only spins


def _config(out, **overrides):
    return tiny_train_config(out, **{**dict(steps=40, num_anchors=16, lr=3e-3, log_every=10, save_every=20), **overrides})


def _run(out, samples, target, **overrides):
    return train(_config(out, **overrides), samples=samples, target=target, log=open(os.devnull, "w"))


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6, head_scale=20)


def test_tiny_overfit_loss_falls(tmp_path, target):
    samples = pattern_samples(16, max_len=60)
    summary = _run(tmp_path, samples, target, steps=120, batch_size=8, num_layers=2, lr=1e-2, warmup_ratio=0.05)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in history[:5]) / 5
    last = sum(r["loss"] for r in history[-5:]) / 5
    assert last < first / 20, (first, last)  # stated factor: 20x (measured ~700x)
    assert history[-1]["accuracy"] > 0.95 and history[-1]["tau_sim"] > 3.5  # B = 4: tau at most 4
    assert summary["drafters"]["drafter"]["export"]


def test_the_start_line_names_each_drafters_attention_backend(tmp_path, target):
    """--attention auto resolves per device (sdpa on the CPU) and the start says which one runs."""
    log = io.StringIO()
    train(_config(tmp_path, steps=1, num_layers=1), samples=pattern_samples(8), target=target, log=log)
    line = next(line for line in log.getvalue().splitlines() if line.startswith("pipeline: "))
    assert line.endswith("on cpu, attention sdpa"), line


def test_a_bf16_target_trains_a_float32_drafter(tmp_path):
    """--precision fp32 with a bf16 target: the frozen embedding and head are copied in the
    drafter's compute dtype (float32), not the target's; a bf16 head met float32 hidden states
    in the loss's matmul and failed the first step (found on the GPU, where the head was always
    made bf16)."""
    target = tiny_target("llama", layers=6, head_scale=20)
    target.model.to(torch.bfloat16)
    summary = _run(tmp_path, pattern_samples(8, max_len=60), target, steps=3, precision="fp32", log_every=1)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert summary["drafters"]["drafter"]["export"]


def test_resume_continues_exactly(tmp_path, target):
    samples = pattern_samples(24)
    _run(tmp_path / "straight", samples, target, steps=30, save_every=10)
    # a 30-step run stopped at step 20 (same LR schedule), then resumed to the end
    first = _config(tmp_path / "split", steps=30, save_every=10)
    train(first, samples=samples, target=target, log=open(os.devnull, "w"), stop_at=20)
    assert latest_checkpoint(tmp_path / "split").name == "step-00000020"
    train(_config(tmp_path / "split", steps=30, save_every=10, resume=True), samples=samples, target=target,
          log=open(os.devnull, "w"))
    straight = load_file(str(latest_checkpoint(tmp_path / "straight") / "drafter.safetensors"))
    resumed = load_file(str(latest_checkpoint(tmp_path / "split") / "drafter.safetensors"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6)
    metrics = [json.loads(l) for l in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 31))


def test_interrupted_checkpoint_write_is_ignored(tmp_path, target):
    samples = pattern_samples(8)
    _run(tmp_path, samples, target, steps=4, save_every=2)
    checkpoints = tmp_path / "checkpoints"
    good = latest_checkpoint(tmp_path)
    # a crash mid-write leaves a hidden staging folder and no pointer update
    (checkpoints / ".step-00000006.abc").mkdir()
    (checkpoints / ".step-00000006.abc" / "drafter.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == good
    # a pointer to a folder without state.json (impossible with rename, but be safe) is skipped
    (checkpoints / "step-00000008").mkdir()
    (checkpoints / "latest").write_text("step-00000008\n")
    assert latest_checkpoint(tmp_path) == good
    assert load_drafter(tmp_path).config.block_size == 4


def test_checkpoints_are_pruned_to_keep(tmp_path, target):
    _run(tmp_path, pattern_samples(8), target, steps=8, save_every=2, keep_checkpoints=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-00000006", "step-00000008"]


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(block_size=1), ConfigError, r"--block-size must be in \[2, 1024\]"),
        (dict(target_layer_ids=[1, 9]), TargetError, "out of range"),
        (dict(mask_token_id=96), TargetError, "outside the target's embedding table"),
        (dict(mode="ensemble"), ConfigError, "replicas or variants"),
    ],
)
def test_clear_errors(tmp_path, target, overrides, error, match):
    with pytest.raises(error, match=match):
        _run(tmp_path, pattern_samples(8), target, **overrides)


def test_cli_trains_on_real_smollm2_data_with_in_training_eval(tmp_path, smollm2_dir):
    """The whole command on the real target and real regenerated rows: rendering, training,
    real tau every 2 steps by speculative decoding, checkpoint, export."""
    from dflash_train.cli import main

    data = Path(__file__).parent.parent / "data" / "smollm2_regenerated_64.jsonl.gz"
    code = main([
        "train", "--target", str(smollm2_dir), "--data", str(data), "--out", str(tmp_path),
        "--steps", "4", "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8",
        "--block-size", "4", "--min-supervised-tokens", "8", "--device", "cpu", "--log-every", "2",
        "--eval-every", "2", "--eval-limit", "2", "--eval-max-new-tokens", "6",
    ])
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [("tau_real" in r) for r in records] == [False, True, False, True]
    assert all(1.0 <= r["tau_real"] <= 4.0 for r in records if "tau_real" in r)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["drafter_config"]["mask_token_id"] == 16  # SmolLM2's <empty_output>, by the documented rule
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "again"), "--dtype", "float32"]) == 0
    assert (tmp_path / "again" / "config.json").is_file()


@pytest.mark.gpu
def test_gpu_training_measures_real_tau_with_captured_graphs(tmp_path):
    """In-training evaluation on the GPU: the drafter thread captures the static decoder's CUDA
    graphs while the target thread computes features on the same device, and measures real tau."""
    from dflash_train.target.model import Target
    from test_decode_loop import char_tokenizer
    from tiny import tiny_hf_model

    target = Target(tiny_hf_model("llama", vocab=104).to("cuda", torch.bfloat16), char_tokenizer())
    prompts = Path(__file__).parent.parent / "data" / "eval_prompts.jsonl"
    config = _config(tmp_path, device="cuda", steps=6, log_every=3, save_every=6, eval_every=3,
                     eval_bench=str(prompts), eval_limit=2, eval_max_new_tokens=24)
    train(config, samples=pattern_samples(16), target=target, log=open(os.devnull, "w"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if "tau_real" in r]
    assert [r["step"] for r in measured] == [3, 6]
    assert all(r["tau_real_decoder"] == "static" and 1.0 <= r["tau_real"] <= 4.0 for r in measured)


@pytest.mark.parametrize("scale", [1e-3, 1e3])  # unclipped / clipped
def test_clip_inside_fused_adamw_equals_clip_then_step(scale):
    """`fused_clip_and_step` folds the clip into the fused kernel's grad_scale: the same update
    as clip_grad_norm_ then AdamW, for a norm under and over the limit; a non-finite
    gradient leaves weights and optimizer moments untouched."""
    from dflash_train.core.step import fused_clip_and_step

    def clipped_fused_step(optimizer, model, clip):
        return float(fused_clip_and_step(optimizer, [p.grad for p in model.parameters()], clip)[0])

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True) for m in models]
    for step in range(3):
        inputs = torch.randn(5, 8) * scale
        for model in models:
            model.zero_grad()
            model(inputs).square().sum().backward()
        reference_norm = float(torch.nn.utils.clip_grad_norm_(models[0].parameters(), 1.0))
        optimizers[0].step()
        fused_norm = clipped_fused_step(optimizers[1], models[1], 1.0)
        assert fused_norm == pytest.approx(reference_norm, rel=1e-5)
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    before = [p.detach().clone() for p in models[1].parameters()]
    moments = [optimizers[1].state[p]["exp_avg"].clone() for p in models[1].parameters()]
    models[1].zero_grad()
    models[1](torch.full((5, 8), float("inf"))).sum().backward()
    assert clipped_fused_step(optimizers[1], models[1], 1.0) != pytest.approx(0.0)
    for p, old, moment in zip(models[1].parameters(), before, moments):
        assert torch.equal(p, old) and torch.equal(optimizers[1].state[p]["exp_avg"], moment)
    assert not hasattr(optimizers[1], "grad_scale")


@pytest.mark.gpu
def test_drafter_loss_and_backward_never_wait_for_the_gpu():
    """With the scored-slot count from the host, a warmed-up forward + loss + backward issues
    no synchronising CUDA call, so the host can run ahead of the GPU for the whole step."""
    import warnings

    from dflash_train.core.drafter import DFlashDrafter
    from dflash_train.core.step import FrozenTargetParts, drafter_loss
    from dflash_train.train.synthetic import TINY, drafter_config, make_batch

    device = torch.device("cuda")
    config = drafter_config(TINY, 16)
    drafter = DFlashDrafter(config).to(device)
    drafter.forward = torch.compile(drafter.forward, dynamic=False)
    batch, objective, _ = make_batch(config, 2, 192, 32, device, torch.bfloat16)
    objective.compiled_head = True
    frozen = FrozenTargetParts(torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16),
                               torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, metrics = drafter_loss(drafter, frozen, batch, objective, "flex")
        loss.backward()
        return loss, metrics

    step()  # compiles
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "called a synchronizing" in str(w.message)]
    assert not syncs, "\n".join(syncs)


def test_thinking_switch_reaches_the_training_rows_and_the_eval_prompts():
    """--thinking renders --data and the in-training evaluator's prompts the way regenerate does,
    with the real Qwen3 template: off makes the empty think block part of the prompt (masked,
    and the end of every eval prompt); on and auto leave it to the target (supervised)."""
    from dflash_train.target.model import Target
    from test_data_render import NPM_SETUP, npm_tokenizer_dir
    from tiny import tiny_hf_model
    from transformers import AutoTokenizer

    from dflash_train.train.build import build_evaluation
    from dflash_train.train.supply import FeatureSupply, load_samples
    from dflash_train.train.resume import StepRange

    path = npm_tokenizer_dir("qwen3")
    if path is None:
        pytest.skip("real Qwen3 tokenizer absent: " + NPM_SETUP.format(name="qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    supply = FeatureSupply([Target(tiny_hf_model("qwen3", vocab=len(tokenizer), hidden=32, layers=2), tokenizer)])
    data = Path(__file__).parent.parent / "data" / "chat_openai.jsonl"
    prompts = Path(__file__).parent.parent / "data" / "eval_prompts.jsonl"
    supervised, endings = {}, {}
    for thinking in ("off", "on", "auto"):
        config = tiny_train_config("unused", data=[str(data)], thinking=thinking, eval_every=1, eval_bench=str(prompts),
                                   eval_limit=2, min_supervised_tokens=1)
        samples, _ = load_samples(config, supply, open(os.devnull, "w"))
        supervised[thinking] = sum(int(s.loss_mask.sum()) for s in samples)
        evaluation = build_evaluation(config, supply, StepRange(0, 1), open(os.devnull, "w"))
        endings[thinking] = {tokenizer.decode(p[-6:]) for p in evaluation.evaluator.prompts}
    empty_think = "<think>\n\n</think>\n\n"
    assert all(text.endswith(empty_think) for text in endings["off"])
    assert not any(text.endswith(empty_think) for text in endings["on"] | endings["auto"])
    rows = len(samples)
    assert supervised["on"] == supervised["auto"] >= supervised["off"] + 4 * rows  # the think block's tokens
