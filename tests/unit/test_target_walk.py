"""The layer walk's rotary call (target/walk.py): positions go in the shape the model's rotary
embedding takes, found once by calling it; a shape it does not know is refused by the probe with
one line, never guessed."""

import copy

import pytest
import torch
from tiny import tiny_hf_model
from torch import nn

from dflash_train.target.model import Target
from dflash_train.target.probe import feature_forward_unsupported, static_unsupported
from dflash_train.target.walk import FeatureForward, rotary_sections


class SectionedRotary(nn.Module):
    """A multimodal rotary that takes only [3, b, q] positions, one row per section (as Qwen3.5's
    mRoPE does in some transformers releases); text gives every section the same positions."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.mrope_section = inner, [4, 2, 2]

    def forward(self, x, position_ids):
        expanded = position_ids[:, :, None, :]  # IndexError on [b, q], as the real one raises
        assert expanded.shape[0] == 3
        return self.inner(x, expanded[0, :, 0])


class FourDimensionalRotary(SectionedRotary):
    def forward(self, x, position_ids):
        return self.inner(x, position_ids[:, :, :, 0][0, 0])


def test_plain_rotaries_take_positions_as_given():
    assert rotary_sections(tiny_hf_model("llama", layers=2).model.rotary_emb) == 0


def test_a_sectioned_rotary_gets_the_same_positions_in_each_section():
    model = tiny_hf_model("llama", layers=2).float()
    ids = (torch.arange(2 * 9) * 31 % 96).view(2, 9)
    expected = Target(model).features(ids, [0, 1])
    model.model.rotary_emb = SectionedRotary(model.model.rotary_emb)
    assert rotary_sections(model.model.rotary_emb) == 3
    torch.testing.assert_close(FeatureForward(Target(model), [0, 1])(ids), expected, rtol=0, atol=0)


@pytest.mark.usefixtures("one_thread")
def test_a_rotary_taking_neither_shape_is_refused_with_one_line():
    model = tiny_hf_model("llama", layers=2).float()
    model.model.rotary_emb = FourDimensionalRotary(model.model.rotary_emb)
    reason = rotary_sections(model.model.rotary_emb)
    assert isinstance(reason, str) and "FourDimensionalRotary does not run as rotary(x, positions)" in reason
    target = Target(model)
    assert static_unsupported(target, 64) == reason and feature_forward_unsupported(target, 9) == reason
    with pytest.raises(ValueError, match="does not run as rotary"):
        FeatureForward(target, [0])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float32_features_are_a_float32_targets_from_the_same_weights(family):
    """`FeatureForward.float32` (what a compiled forward's rounding is judged against) copies one
    layer at a time to float32: it must give what a float32 copy of the whole bf16 target gives,
    the last layer's final norm included, and leave the bf16 target as it was."""
    model = tiny_hf_model(family, layers=3).to(torch.bfloat16)
    ids = (torch.arange(2 * 11) * 37 % 96).view(2, 11)
    layer_ids = [0, 2]  # 2 is the last layer: its features are after the final norm
    before = {name: p.clone() for name, p in model.named_parameters()}
    got = FeatureForward(Target(model), layer_ids).float32(ids)
    whole = FeatureForward(Target(copy.deepcopy(model).float()), layer_ids)(ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[name]) for name, p in model.named_parameters())
    bf16 = FeatureForward(Target(model), layer_ids)(ids)
    assert 0 < float((bf16.float() - got).abs().max())  # a real rounding difference to judge against
