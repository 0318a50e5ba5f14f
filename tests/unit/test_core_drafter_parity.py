"""Train exactly what inference runs: the training forward over many anchors equals, block by
block, an inference-style forward that only ever sees the context before its anchor.

The mutation tests at the bottom re-run the same checks against deliberately broken
variants (a `<=` anchor visibility, +1-shifted labels) and assert the checks catch them.
"""

import pytest
import torch
from tiny import tiny_target

import dflash_train.core.attention as attention
import dflash_train.core.objective as objective_module
import dflash_train.core.step as step_module
from dflash_train.core.drafter import DFlashDrafter, DrafterCache, DrafterConfig, embed_block_tokens
from dflash_train.core.objective import ObjectiveConfig, block_labels, block_token_ids
from dflash_train.core.step import DrafterBatch, FrozenTargetParts, drafter_loss

BLOCK = 4
ANCHORS = [3, 9, 10, 21]  # adjacent anchors (9, 10) and one near the end


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_target("qwen3")
    with torch.no_grad():  # sharper predictions, so a wrong label moves the loss clearly
        target.model.lm_head.weight.mul_(40)
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=BLOCK, mask_token_id=95)
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, 0.3)
    ids = torch.randint(0, 90, (1, 24))
    return target, drafter, ids


def _training_logits(target, drafter, ids, backend):
    anchors = torch.tensor([ANCHORS + [0]])  # plus one padded slot
    context = target.features(ids, drafter.config.target_layer_ids)
    block = block_token_ids(ids, anchors, BLOCK, drafter.config.mask_token_id).flatten(1)
    positions = (anchors[..., None] + torch.arange(BLOCK)).flatten(1)
    mask = attention.make_mask(backend, anchors, ids.shape[1], BLOCK)
    with torch.no_grad():
        hidden = drafter(context, embed_block_tokens(block, target.embed_weight), positions, mask)
    return (hidden @ target.head_weight.t()).view(len(ANCHORS) + 1, BLOCK, -1)


def _inference_logits(target, drafter, ids, anchor):
    """What the reference loop does at a verify step whose bonus token sits at `anchor`:
    only positions < anchor have target states (the target never saw anything later)."""
    context = target.features(ids[:, :anchor], drafter.config.target_layer_ids)
    block = torch.full((1, BLOCK), drafter.config.mask_token_id)
    block[0, 0] = ids[0, anchor]
    with torch.no_grad():
        hidden = drafter.draft(
            DrafterCache(drafter.config.num_hidden_layers), context, torch.arange(anchor)[None],
            embed_block_tokens(block, target.embed_weight), torch.arange(anchor, anchor + BLOCK)[None],
        )
    return (hidden @ target.head_weight.t())[0]


def _max_parity_error(target, drafter, ids, backend="sdpa"):
    training = _training_logits(target, drafter, ids, backend)
    assert torch.isfinite(training).all(), "padded anchor slots must not produce NaN"
    return max(
        float((training[i] - _inference_logits(target, drafter, ids, a)).abs().max())
        for i, a in enumerate(ANCHORS)
    )


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_training_blocks_equal_inference_blocks(setup, backend):
    assert _max_parity_error(*setup, backend=backend) < 1e-4


def _loss_from_inference(target, drafter, ids, loss_mask):
    """Σ w·CE / Σ w with labels taken by hand from inference logits: slot k -> token a + k."""
    weights = objective_module.decay_weights(BLOCK, 3.0)
    total, norm = 0.0, 0.0
    for a in ANCHORS:
        logits = _inference_logits(target, drafter, ids, a)
        for k in range(1, BLOCK):
            if a + k < ids.shape[1] and loss_mask[0, a + k]:
                ce = torch.nn.functional.cross_entropy(logits[k][None], ids[0, a + k][None])
                total += float(weights[k] * ce)
                norm += float(weights[k])
    return total / norm


def _training_loss(target, drafter, ids, loss_mask, host_count=False):
    anchors = torch.tensor([ANCHORS])
    anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
    objective = ObjectiveConfig(block_size=BLOCK, num_anchors=len(ANCHORS), gamma=3.0)
    _, label_valid = block_labels(ids, loss_mask, anchors, anchor_valid, BLOCK)
    batch = DrafterBatch(
        target.features(ids, drafter.config.target_layer_ids), ids, loss_mask, anchors, anchor_valid,
        objective.normalizer(label_valid), scored_rows=int(label_valid.sum()) if host_count else None,
    )
    frozen = FrozenTargetParts(target.embed_weight, target.head_weight)
    with torch.no_grad():
        loss, _ = drafter_loss(drafter, frozen, batch, objective, "sdpa")
    return float(loss)


@pytest.mark.parametrize("host_count", [False, True], ids=["device-count", "host-count"])
def test_training_loss_equals_loss_of_inference_predictions(setup, host_count):
    """Also with the scored-slot count given by the host (sync-free compaction)."""
    target, drafter, ids = setup
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[0, 12] = False
    training = _training_loss(target, drafter, ids, loss_mask, host_count)
    assert abs(training - _loss_from_inference(target, drafter, ids, loss_mask)) < 1e-4


# --- the checks above catch the classic off-by-one bugs -------------------------------------

def test_parity_check_catches_anchor_visible_to_its_own_block(setup, monkeypatch):
    def leaky_mask_mod(anchors, context_len, block_size, row_length=None):
        def mask_mod(b, h, q_idx, kv_idx):
            block = q_idx // block_size
            sees_context = kv_idx <= anchors[b, block]  # the bug: the anchor's own state
            in_own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
            return sees_context | in_own_block
        return mask_mod

    monkeypatch.setattr(attention, "dflash_mask_mod", leaky_mask_mod)
    assert _max_parity_error(*setup) > 1e-2


def test_loss_check_catches_labels_shifted_by_one(setup, monkeypatch):
    target, drafter, ids = setup
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    correct = _training_loss(target, drafter, ids, loss_mask)

    def shifted_labels(input_ids, mask, anchors, anchor_valid, block_size, row_length=None):
        labels, valid = block_labels(input_ids, mask, anchors, anchor_valid, block_size)
        shifted = torch.roll(input_ids, -1, dims=1)  # the bug: slot k scored against a + k + 1
        positions = (anchors[..., None] + torch.arange(block_size)).clamp(max=input_ids.shape[1] - 1)
        return torch.gather(shifted, 1, positions.flatten(1)).view_as(labels), valid

    monkeypatch.setattr(step_module, "block_labels", shifted_labels)
    broken = _training_loss(target, drafter, ids, loss_mask)
    reference = _loss_from_inference(target, drafter, ids, loss_mask)
    assert abs(correct - reference) < 1e-4
    assert abs(broken - reference) > 0.1, (broken, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_the_references_float32_then_cast_form_eager_and_traced(dtype):
    """The drafter's RMSNorm runs F.rms_norm eagerly (one kernel on CUDA) and the written-out
    form under the compiler; both must be the reference's: normalise in float32, round to the
    input's dtype, then the weight."""
    from dflash_train.core.drafter import RMSNorm

    torch.manual_seed(3)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    norm = norm.to(dtype)
    x = (torch.randn(3, 7, 64) * 3).to(dtype)
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), expected)
        torch._dynamo.reset()
        traced = torch.compile(norm, backend="eager", fullgraph=True)  # dynamo's trace, run eagerly: the written-out form
        assert torch.equal(traced(x), expected)
