"""Exported folders load in the reference (`dflash` on PyPI) and give our logits."""

import json

import pytest
import torch
from dflash_train.export.hf import ExportError, expected_weight_names, export_model
from tiny import tiny_target

from dflash_train.core.drafter import DFlashDrafter, DrafterCache, DrafterConfig, embed_block_tokens

dflash = pytest.importorskip("dflash", reason="reference package: pip install --no-deps dflash==0.1.0")


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5_text", "gpt_oss"])  # a hybrid; YaRN
def test_reference_loads_export_and_matches_logits(tmp_path, family):
    from dflash import DFlashDraftModel

    torch.manual_seed(0)
    target = tiny_target(family)
    config = DrafterConfig.from_target(target.spec, num_layers=2, block_size=5, mask_token_id=95,
                                       target_layer_ids=[1, 3, 4])
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, 0.2)
    export_model(drafter, tmp_path / "export", dtype=torch.float32)
    reference = DFlashDraftModel.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert reference.block_size == 5 and reference.mask_token_id == 95
    assert list(reference.target_layer_ids) == [1, 3, 4]

    ids = torch.randint(0, 90, (1, 30))
    features = target.features(ids, config.target_layer_ids)
    cache = DrafterCache(2)
    for start, end in ((0, 11), (11, 17)):  # two verify steps: the cache must carry the context
        block = torch.full((1, 5), 95)
        block[0, 0] = ids[0, end]
        noise = embed_block_tokens(block, target.embed_weight)
        with torch.no_grad():
            ours = drafter.draft(cache, features[:, start:end], torch.arange(start, end)[None], noise,
                                 torch.arange(end, end + 5)[None])
            theirs = reference(position_ids=torch.arange(0, end + 5)[None], noise_embedding=noise,
                               target_hidden=features[:, :end])
        ours_logits = ours @ target.head_weight.t()
        theirs_logits = reference.compute_logits(theirs, target.model.lm_head)
        torch.testing.assert_close(ours_logits, theirs_logits, rtol=1e-4, atol=1e-4)

    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"]
    assert exported["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 3, 4], "block_size": 5,
                                         "num_target_layers": target.spec.num_hidden_layers}
    assert exported["num_target_layers"] == target.spec.num_hidden_layers


def test_export_refuses_a_wrong_weight_layout(tmp_path):
    target = tiny_target("llama")
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95)
    drafter = DFlashDrafter(config)
    drafter.extra = torch.nn.Linear(2, 2)  # a name serving engines would silently skip
    with pytest.raises(ExportError, match="unknown"):
        export_model(drafter, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    assert "layers.0.self_attn.q_norm.weight" in expected_weight_names(1)
