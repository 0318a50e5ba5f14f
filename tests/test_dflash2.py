"""DFlash2: our drafter against the reference (`dflash` 0.1.0 on PyPI, `DFlash2DraftModel`) loaded
from our export, the selector's training objective, and the export rules."""

import json

import pytest
import torch

from dflash_train.dflash2 import grouped_causal_conv
from dflash_train.drafter import DFlashDrafter, DrafterCache, DrafterConfig, embed_block_tokens
from dflash_train.export import export_model, load_exported_drafter
from dflash_train.export_rules import check_folder, failures
from tiny import tiny_target

dflash = pytest.importorskip("dflash", reason="reference package: pip install --no-deps dflash==0.1.0")

DFLASH2 = dict(arch="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)


def random_dflash2(target, *, block_size=5, layers=2, std=0.2, seed=0, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(target.spec, num_layers=layers, block_size=block_size, mask_token_id=95,
                                       target_layer_ids=[1, 3, 4], **{**DFLASH2, **overrides})
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, std)
    return drafter


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_reference_loads_dflash2_export_and_matches_logits_and_proposals(tmp_path, family):
    from dflash import DFlash2DraftModel

    target = tiny_target(family, head_scale=20.0)
    drafter = random_dflash2(target)
    export_model(drafter, tmp_path / "export", dtype=torch.float32)
    reference, info = DFlash2DraftModel.from_pretrained(tmp_path / "export", dtype=torch.float32,
                                                        output_loading_info=True)
    reference.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(reference.candidate_selector.predecessor_codebook.weight,
                       drafter.candidate_selector.predecessor_codebook)

    ids = torch.randint(0, 90, (1, 30))
    features = target.features(ids, drafter.config.target_layer_ids)
    cache = DrafterCache(2)
    selector = drafter.candidate_selector
    for start, end in ((0, 11), (11, 17)):  # two verify steps: the cache must carry the context
        block = torch.full((1, 5), 95)
        block[0, 0] = ids[0, end]
        noise = embed_block_tokens(block, target.embed_weight)
        with torch.no_grad():
            ours = drafter.draft(cache, features[:, start:end], torch.arange(start, end)[None], noise,
                                 torch.arange(end, end + 5)[None])[:, 1:]
            theirs = reference(position_ids=torch.arange(0, end + 5)[None], noise_embedding=noise,
                               target_hidden=features[:, :end])[:, 1:]
            ours_logits = ours @ target.head_weight.t()
            torch.testing.assert_close(ours_logits, reference.compute_logits(theirs, target.model.lm_head),
                                       rtol=1e-4, atol=1e-4)
            our_path, our_candidates, _ = selector.select(ours, ours_logits, block[:, 0], 0.0)
            their_path, their_candidates, _ = reference.propose(theirs, block[:, 0], target.model.lm_head, 0.0)
            assert torch.equal(our_path, their_path)
            assert torch.equal(our_candidates, their_candidates)
            # T > 0: the same seed draws the same path, and q (over the k candidates) agrees.
            torch.manual_seed(7)
            our_path, _, our_q = selector.select(ours, ours_logits, block[:, 0], 0.8)
            torch.manual_seed(7)
            their_path, _, their_q = reference.propose(theirs, block[:, 0], target.model.lm_head, 0.8)
            assert torch.equal(our_path, their_path)
            torch.testing.assert_close(our_q, their_q, rtol=1e-5, atol=1e-6)

    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"]
    assert {k: exported["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k")} == {k: DFLASH2[k] for k in DFLASH2 if k != "arch"}
    assert not failures(check_folder(tmp_path / "export"))
    again = load_exported_drafter(tmp_path / "export")
    assert again.config.arch == "dflash2" and again.config.selector_top_k == 6
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), drafter.state_dict().values()))


def test_reference_speculative_decoding_on_our_dflash2_export_is_lossless(tmp_path):
    from dflash import DFlash2DraftModel

    target = tiny_target("qwen3", head_scale=20.0)
    drafter = random_dflash2(target, block_size=4, std=0.1)
    export_model(drafter, tmp_path / "export", dtype=torch.float32)
    reference = DFlash2DraftModel.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    prompt = torch.randint(0, 90, (1, 9))
    with torch.no_grad():
        speculative = reference.spec_generate(target.model, prompt, max_new_tokens=24, stop_token_ids=None)
        plain = target.model.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert torch.equal(speculative[0, :plain.shape[1]], plain[0])


def test_conv_stays_inside_blocks_and_starts_as_identity():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 32)
    dynamic = torch.randn(2, 12, 3, 2)
    base = torch.randn(3, 32)
    whole = grouped_causal_conv(x, dynamic, base, 16, segment=4)
    # Block by block: each 4-token block convolved alone gives the same rows.
    parts = torch.cat([grouped_causal_conv(x[:, i:i + 4], dynamic[:, i:i + 4], base, 16, segment=4)
                       for i in range(0, 12, 4)], dim=1)
    torch.testing.assert_close(whole, parts)
    # A tap longer than the block adds nothing (the reference fails on blocks shorter than the kernel).
    short = grouped_causal_conv(x[:, :2], dynamic[:, :2], base, 16, segment=2)
    torch.testing.assert_close(short, grouped_causal_conv(x[:, :2], dynamic[:, :2, :2], base[:2], 16, segment=2))

    target = tiny_target("llama")
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95, **DFLASH2)
    fresh = DFlashDrafter(config)
    h = torch.randn(1, 8, config.hidden_size)
    conv = fresh.layers[0].attention_conv
    out, finish_kernel = conv.prepare(h, 4)
    assert torch.equal(out, h) and torch.equal(conv.finish(h, finish_kernel, 4), h)
