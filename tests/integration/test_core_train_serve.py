"""Train exactly what serves: for every verify step of a real speculative decode, the number
of draft tokens the target accepted equals the number of leading correct slots the training
forward (`step.drafter_loss`, the code that computes the loss and simulated tau) reports for a
block anchored at the same position of the same sequence."""

import os

import pytest
import torch
from dflash_train.export.hf import load_exported_drafter
from tiny import Sample, tiny_target

from dflash_train.config import TrainConfig
from dflash_train.core.objective import ObjectiveConfig, block_labels
from dflash_train.core.step import DrafterBatch, FrozenTargetParts, drafter_loss
from dflash_train.decode.loop import generate, generate_target_only
from dflash_train.train.trainer import train

# The module fixture trains a drafter first: with both intra-op threads it took 62 s of a 2-core
# machine shared with other jobs, on one 8 s (tiny models gain nothing from a second thread).
pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_thread")]

BLOCK = 6


def _greedy_samples(target, count, prompt_len, new_tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = torch.randint(0, 90, (prompt_len,), generator=generator).tolist()
        tokens = generate_target_only(target, prompt, new_tokens).tokens
        ids = torch.tensor(prompt + tokens)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[prompt_len:] = True
        samples.append(Sample(i, ids, mask))
    return samples


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    target = tiny_target("llama", layers=6, head_scale=20)
    samples = _greedy_samples(target, 32, prompt_len=6, new_tokens=30, seed=0)
    out = tmp_path_factory.mktemp("run")
    config = TrainConfig(
        out=str(out), steps=100, batch_size=8, max_seq_len=64, block_size=BLOCK, num_layers=1, num_anchors=16,
        mask_token_id=95, lr=1e-2, warmup_ratio=0.05, device="cpu", save_every=1000, log_every=1000,
        export_dtype="float32",
    )
    train(config, samples=samples, target=target, log=open(os.devnull, "w"))
    return target, load_exported_drafter(out / "export").eval()


def _leading_correct(target, drafter, sequence, prompt_len, anchor):
    ids = torch.tensor([sequence])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, prompt_len:] = True
    anchors = torch.tensor([[anchor]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    objective = ObjectiveConfig(block_size=BLOCK, num_anchors=1)
    _, label_valid = block_labels(ids, mask, anchors, valid, BLOCK)
    batch = DrafterBatch(target.features(ids, drafter.config.target_layer_ids), ids, mask, anchors, valid,
                         objective.normalizer(label_valid))
    frozen = FrozenTargetParts(target.embed_weight, target.head_weight)
    with torch.no_grad():
        _, metrics = drafter_loss(drafter, frozen, batch, objective, "sdpa")
    return int(metrics["accepted_sum"])


def test_decoder_acceptance_equals_training_forward_per_block(trained):
    target, drafter = trained
    prompts = _greedy_samples(target, 4, prompt_len=6, new_tokens=0, seed=123)  # unseen prompts
    checked, accepted_total, longest = 0, 0, 0
    for sample in prompts:
        prompt = sample.input_ids.tolist()
        result = generate(target, drafter, prompt, 30)
        assert result.tokens == generate_target_only(target, prompt, 30).tokens  # lossless
        sequence = prompt + result.tokens
        anchor = len(prompt)
        for produced in result.acceptance_lengths[:-1]:  # the last step may be clipped by the limit
            assert _leading_correct(target, drafter, sequence, len(prompt), anchor) == produced - 1, anchor
            accepted_total += produced - 1
            longest = max(longest, produced - 1)
            anchor += produced
            checked += 1
    assert checked >= 12
    # the drafter must really accept, several tokens at once, or the check is vacuous
    assert accepted_total >= 10 and longest >= 2, (accepted_total, longest)
