"""The start-up check of a compiled feature forward (train/feature_graphs.py): a compiled forward
rounds elsewhere than the eager one, so it may differ from it by more than the tolerance and
still be as right; it passes when it is no further from the float32 features of the same weights.
Real features of a tiny bf16 target; the GPU capture around the check is tested on a GPU."""

import pytest
import torch
from tiny import tiny_hf_model

from dflash_train.target.model import Target
from dflash_train.target.walk import FeatureForward
from dflash_train.train.feature_graphs import judge_features, relative_difference


@pytest.fixture(scope="module")
def features():
    model = tiny_hf_model("llama", layers=4).to(torch.bfloat16)
    forward = FeatureForward(Target(model), [1, 3])
    ids = (torch.arange(2 * 24) * 41 % 96).view(2, 24)
    return forward(ids), forward.float32(ids)


def never() -> torch.Tensor:
    raise AssertionError("the float32 features are computed only when the eager ones disagree")


def test_a_forward_within_the_tolerance_passes_without_the_float32_features(features):
    eager, _ = features
    assert judge_features(eager.clone(), eager, never) is None


def test_one_rounded_elsewhere_passes_though_it_differs_from_the_eager_one(features):
    eager, reference = features
    rounded = reference.to(torch.bfloat16)  # float32's features in bf16: rounded once, not per layer
    assert relative_difference(rounded, eager)[0] > 0
    assert judge_features(rounded, eager, lambda: reference, tolerance=0.0) is None


def test_a_wrong_one_is_refused_with_both_errors(features):
    eager, reference = features
    half = eager.shape[-1] // 2
    swapped = torch.cat([eager[..., half:], eager[..., :half]], dim=-1)  # the layers' features in the wrong order
    reason = judge_features(swapped, eager, lambda: reference)
    assert reason is not None and reason.startswith("a replay differs from Target.features (relative error")
    assert "from the float32 features by" in reason and "where the eager forward differs by" in reason


def test_without_float32_features_it_is_refused_naming_why(features):
    eager, reference = features

    def fails() -> torch.Tensor:
        raise RuntimeError("no float32 kernel for this layer")

    reason = judge_features(reference.to(torch.bfloat16), eager, fails, tolerance=0.0)
    assert reason is not None and "no float32 features to judge it by (RuntimeError: no float32 kernel" in reason


def test_the_plain_forward_gets_no_float32_allowance(features):
    """The uncompiled forward runs the eager forward's own modules: beyond the tolerance it is wrong."""
    eager, reference = features
    reason = judge_features(reference.to(torch.bfloat16), eager, tolerance=0.0)
    assert reason is not None and reason.startswith("a replay differs from Target.features (relative error")
    assert "float32" not in reason
