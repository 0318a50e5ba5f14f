"""bf16 parameters with float32 master weights (`--master-weights on`, core/master_weights.py):
the update against torch's AdamW, clip and skip inside it, its state dict, checkpoints and
exports of the masters, the replicas' gradient sum in float32, and the refusals."""

import io
import json
import os
import re
import threading

import pytest
import torch
from safetensors.torch import load_file
from tiny import pattern_samples, tiny_target, tiny_train_config

from dflash_train.config import ConfigError
from dflash_train.core.master_weights import MasterWeightAdamW, trained_weights, updated_tensors
from dflash_train.core.step import fused_clip_and_step, make_optimizer
from dflash_train.parallel.gradients import GradientReducer
from dflash_train.parallel.threads import StopSignal
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")

HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    return model


# (lr, gradient scale): a plain step, a clipped one (norm far over 1), lr 0, a non-finite gradient, another step
SCHEDULE = [(1e-2, 1e-2), (3e-3, 50.0), (0.0, 1e-2), (1e-2, float("inf")), (5e-3, 1e-2)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_master_update_is_torchs_adamw_with_clip_and_skip_inside(compiled):
    """The masters follow torch's fused AdamW on float32 parameters fed the same bf16 gradients
    (to float32 rounding), through fused_clip_and_step's clip and skip; the bf16 parameters are
    the masters rounded; a non-finite step changes no weight, moment or step count."""
    reference, ours = _model(), _model()
    adamw = torch.optim.AdamW(reference.parameters(), fused=True, **HYPER)
    master = make_optimizer(ours, master_weights=True, compiled=compiled, lr=HYPER["lr"],
                            weight_decay=HYPER["weight_decay"], betas=HYPER["betas"])
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    generator = torch.Generator().manual_seed(1)
    for index, (lr, scale) in enumerate(SCHEDULE):
        grads = [(torch.randn(p.shape, generator=generator) * scale).to(torch.bfloat16) for p in reference.parameters()]
        for group in (*adamw.param_groups, *master.param_groups):
            group["lr"] = lr
        for p, g in zip(reference.parameters(), grads):
            p.grad = g.float()
        for p, g in zip(ours.parameters(), grads):
            p.grad = g.clone()
        before = [t.clone() for t in (*updated_tensors(master), *_moments(master))] if index else []
        norm_ref, skipped_ref = fused_clip_and_step(adamw, [p.grad for p in reference.parameters()], 1.0)
        norm, skipped = fused_clip_and_step(master, [p.grad for p in ours.parameters()], 1.0)
        assert float(skipped) == float(skipped_ref) == (scale == float("inf"))
        if scale != float("inf"):
            torch.testing.assert_close(norm, norm_ref)
        for mine, theirs in zip(updated_tensors(master), reference.parameters()):
            torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7, msg=f"step {index}")
        for param, mine in zip(ours.parameters(), updated_tensors(master)):
            assert torch.equal(param.detach(), mine.to(torch.bfloat16))
        if skipped:
            assert all(torch.equal(a, b) for a, b in zip(before, (*updated_tensors(master), *_moments(master))))
    steps_taken = sum(scale != float("inf") for _, scale in SCHEDULE)
    assert {float(master.state[m]["step"]) for m in updated_tensors(master)} == {steps_taken}


def _moments(optimizer):
    return [optimizer.state[m][key] for m in updated_tensors(optimizer) for key in ("exp_avg", "exp_avg_sq")]


def test_the_state_dict_is_adamws_and_loads_either_way_with_float32_moments():
    """A master-weight optimizer's state dict loads into torch's AdamW and back: the moments stay
    float32 (torch casts loaded state to the parameters' dtype, which for the masters is float32),
    and a loaded optimizer continues with the same update as the one it was saved from."""
    model, copy_model = _model(), _model()
    master = MasterWeightAdamW.taking_over(model, compiled=False, **HYPER)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    master.step()
    state = master.state_dict()
    adamw = torch.optim.AdamW([p for p in _model().parameters()], **HYPER)
    adamw.load_state_dict(state)
    again = MasterWeightAdamW.taking_over(copy_model, compiled=False, **HYPER)
    again.load_state_dict(adamw.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        for saved, loaded in zip(updated_tensors(master), updated_tensors(again)):
            assert again.state[loaded][key].dtype == torch.float32
            assert torch.equal(again.state[loaded][key], master.state[saved][key])
    counts = {id(again.state[m]["step"]) for m in updated_tensors(again)}
    assert len(counts) == 1  # one shared count: the compiled update adds to one tensor
    # the same masters and gradients: one more step gives the same weights in both
    with torch.no_grad():
        for mine, theirs in zip(updated_tensors(again), updated_tensors(master)):
            mine.copy_(theirs)
    for p, q in zip(model.parameters(), copy_model.parameters()):
        q.grad = p.grad.clone()
    master.step()
    again.step()
    for a, b in zip(updated_tensors(master), updated_tensors(again)):
        assert torch.equal(a, b)


def test_trained_weights_are_the_float32_masters_under_the_parameter_names():
    model = _model()
    master = MasterWeightAdamW.taking_over(model, compiled=False, **HYPER)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    master.step()
    weights = trained_weights(model, master)
    assert weights.keys() == model.state_dict().keys()
    for name, param in model.named_parameters():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name].to(torch.bfloat16), param.detach())
    assert not all(torch.equal(weights[n], p.detach().float()) for n, p in model.named_parameters())  # more than bf16 holds


def test_replicas_sum_bf16_gradients_in_float32():
    """Three replicas' bf16 gradients summed as float32 and rounded once: adding in bf16 would
    round after each addition (1 + 2^-8 + 2^-8 in bf16 is 1, not 1 + 2^-7)."""
    replicas = [torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16) for _ in range(3)]
    values = [1.0, 2.0 ** -8, 2.0 ** -8]
    for model, value in zip(replicas, values):
        model.weight.grad = torch.full_like(model.weight, value)
    reducer = GradientReducer(replicas, StopSignal())
    assert [b.dtype for b in reducer.flats[0].buffers] == [torch.float32]
    threads = [threading.Thread(target=reducer.sync, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    expected = torch.tensor(sum(values)).to(torch.bfloat16)
    for model in replicas:
        assert model.weight.grad.dtype == torch.bfloat16
        assert torch.equal(model.weight.grad, torch.full_like(model.weight, float(expected)))
    assert float(expected) == 1.0 + 2.0 ** -7


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6, head_scale=20)


def _config(out, **overrides):
    return tiny_train_config(out, **{**dict(steps=30, num_anchors=16, lr=1e-2, log_every=10, save_every=10,
                                            precision="bf16", master_weights="on"), **overrides})


def test_training_with_master_weights_checkpoints_the_masters_and_resumes_exactly(tmp_path, target):
    """A run with master weights learns as the float32-parameter run does (the last five losses'
    mean within 3 %; measured 0.1 %); its checkpoints and export hold float32 masters; stopped at
    step 20 and resumed it ends on the same weights as the straight run (the masters come back from
    the checkpoint's weights, the moments from its optimizer state)."""
    samples = pattern_samples(24)
    summary = train(_config(tmp_path / "straight"), samples=samples, target=target, log=open(os.devnull, "w"))
    train(_config(tmp_path / "float32", master_weights="off"), samples=samples, target=target, log=open(os.devnull, "w"))
    losses = {name: [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
              for name in ("straight", "float32")}
    assert losses["straight"][-1] < losses["straight"][0] / 1.8, losses  # it learns (measured 9.2 -> 4.6)
    tail = {name: sum(values[-5:]) / 5 for name, values in losses.items()}
    assert abs(tail["straight"] - tail["float32"]) < 0.03 * tail["float32"], tail
    straight = load_file(str(latest_checkpoint(tmp_path / "straight") / "drafter.safetensors"))
    assert {t.dtype for t in straight.values()} == {torch.float32}
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in straight.values())  # not bf16 values
    export = summary["drafters"]["drafter"]["export"]
    assert os.path.isdir(export)

    train(_config(tmp_path / "split"), samples=samples, target=target, log=open(os.devnull, "w"), stop_at=20)
    train(_config(tmp_path / "split", resume=True), samples=samples, target=target, log=open(os.devnull, "w"))
    resumed = load_file(str(latest_checkpoint(tmp_path / "split") / "drafter.safetensors"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name


@pytest.mark.parametrize("overrides,match", [
    (dict(precision="fp32"), r"needs bf16, --precision bf16 \(or auto on CUDA\), not fp32"),
    (dict(grad_accum=2), "--grad-accum 2 would add"),
    (dict(precision="auto"), "--precision auto trains in float32 on cpu"),
])
def test_master_weights_refuse_what_would_train_otherwise(tmp_path, target, overrides, match):
    with pytest.raises(ConfigError, match=match):
        train(_config(tmp_path, **overrides), samples=pattern_samples(8), target=target, log=io.StringIO())


def test_the_compiled_master_update_compiles_in_the_warm_up_and_never_after(tmp_path, target):
    """With the drafter compiled (--compile on, here on the CPU) the master update is compiled too,
    and its compile happens in the warm-up (`Step.skip_update`): --fail-on-recompile would stop
    the first step otherwise."""
    log = io.StringIO()
    summary = train(_config(tmp_path, steps=4, save_every=4, compile="on", fail_on_recompile=True),
                    samples=pattern_samples(24), target=target, log=log)
    assert re.search(r"drafter-0 .* compiles [1-9][0-9]* \(after warm-up 0\)", log.getvalue()), log.getvalue()[-2000:]
    assert "on cpu, attention sdpa, master weights\n" in log.getvalue()  # the start line says it
    assert summary["drafters"]["drafter"]["export"]


def test_a_resume_switches_master_weights_either_way_and_keeps_its_own_optimizer_kind(tmp_path, target):
    """A master-weight checkpoint resumes with master weights off and the other way round; the
    resumed optimizer runs as its own kind would (torch's loading took every group key from the
    file, so a CPU AdamW resumed from master weights had become a fused one)."""
    samples = pattern_samples(24)
    seen = {}

    def optimizer_kind(worker, step):
        seen[step] = (type(worker.replica.optimizer).__name__, worker.replica.optimizer.param_groups[0].get("fused"))

    for first, then in (("on", "off"), ("off", "on")):
        out = tmp_path / f"{first}-{then}"
        train(_config(out, master_weights=first), samples=samples, target=target, log=io.StringIO(), stop_at=10)
        log = io.StringIO()
        train(_config(out, master_weights=then, resume=True), samples=samples, target=target, log=log,
              step_hook=optimizer_kind)
        assert f"--master-weights {first} -> {then}" in log.getvalue()
        assert seen[29] == (("AdamW", False) if then == "off" else ("MasterWeightAdamW", True)), seen  # 0-based
        weights = load_file(str(latest_checkpoint(out) / "drafter.safetensors"))
        assert {t.dtype for t in weights.values()} == {torch.float32}
        history = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(history) == 30 and history[-1] < history[0] / 1.8, history


def test_a_variant_may_train_with_master_weights_beside_one_without(tmp_path, target):
    """`master_weights` is a variant's own setting: one variant with it, one without, one target
    stream; each trains, and the master-weight variant's checkpoint holds float32 masters."""
    variants = [{"name": "masters", "master_weights": "on"}, {"name": "plain"}]
    train(_config(tmp_path, master_weights="off", mode="variants", variants=variants), samples=pattern_samples(24),
          target=target, log=io.StringIO())
    for name in ("masters", "plain"):
        weights = load_file(str(latest_checkpoint(tmp_path / name) / "drafter.safetensors"))
        assert {t.dtype for t in weights.values()} == {torch.float32}, name
        history = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert history[-1] < history[0] / 1.8, (name, history)
    with pytest.raises(ConfigError, match=r"variants\[0\] \(masters\): --master-weights on: --grad-accum 2"):
        _config(tmp_path / "refused", master_weights="off", mode="variants", variants=variants, grad_accum=2)
