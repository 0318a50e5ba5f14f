"""Target contract: layer k = HF hidden_states[k + 1], early stop, layer rule, clear errors."""

import json

import pytest
import torch
from dflash_train.target.model import (
    TargetError,
    check_target_layer_ids,
    default_target_layer_ids,
    load_target,
    resolve_mask_token_id,
)
from tiny import FAMILIES, tiny_hf_model, tiny_target


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second intra-op thread only spins


@pytest.mark.parametrize("family", FAMILIES)
def test_features_are_hf_hidden_states_plus_one(family):
    target = tiny_target(family)
    ids = torch.randint(0, 96, (2, 23))
    hidden_states = target.model(ids, output_hidden_states=True).hidden_states
    last = target.spec.num_hidden_layers - 1
    for layer_ids in ([0, 2, 4], [1, last], [3, 1]):
        features = target.features(ids, layer_ids)
        expected = torch.cat([hidden_states[k + 1] for k in layer_ids], dim=-1)
        torch.testing.assert_close(features, expected, rtol=0, atol=0)
        # the +1 contract is not vacuous: hidden_states[k] (no +1) differs
        wrong = torch.cat([hidden_states[k] for k in layer_ids], dim=-1)
        assert not torch.allclose(features, wrong)


def test_forward_stops_after_deepest_layer():
    target = tiny_target("llama", layers=6)
    ran = []
    handles = [layer.register_forward_hook(lambda m, i, o, k=k: ran.append(k)) for k, layer in enumerate(target.layers)]
    target.features(torch.randint(0, 96, (1, 9)), [1, 3])
    for handle in handles:
        handle.remove()
    assert ran == [0, 1, 2, 3]


def test_default_layer_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M (the bar recipe, docs/RESULTS.md)
    assert default_target_layer_ids(36, 1) == [18]


def test_layer_ids_out_of_range_names_the_fix():
    with pytest.raises(TargetError, match=r"out of range.*0\.\.5"):
        check_target_layer_ids([1, 6], 6)
    with pytest.raises(TargetError, match="empty"):
        check_target_layer_ids([], 6)


def test_unknown_architecture_is_refused_with_supported_list(tmp_path):
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetError, match="unknown architecture 'gpt2'.*llama"):
        load_target(tmp_path)


def test_load_target_from_folder(tmp_path):
    model = tiny_hf_model("qwen3")
    model.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    assert target.spec.model_type == "qwen3" and target.spec.head_dim == 24
    assert target.features(torch.randint(0, 96, (1, 5)), [0]).shape == (1, 5, 64)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(TargetError, match="no config.json"):
        load_target(tmp_path)


def test_what_only_the_load_finds_is_a_target_error_naming_the_path(tmp_path):
    """The files pass the checks before loading (their headers read) but transformers refuses them:
    one TargetError naming the path and the cause, never the raw KeyError or torch's advice to
    unpickle with weights_only=False."""
    tiny_hf_model("llama", layers=2).save_pretrained(tmp_path / "rope")
    config = json.loads((tmp_path / "rope" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "nosuch", "rope_theta": 10000.0}
    (tmp_path / "rope" / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetError, match=f"^target {tmp_path / 'rope'}: cannot be loaded: KeyError 'nosuch'$"):
        load_target(tmp_path / "rope")
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text(json.dumps({**config, "rope_parameters": None}))
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(TargetError, match=f"^target {tmp_path / 'pickle'}: cannot be loaded: a pickled weights file "
                                          r"\(.bin\) does not load as plain tensors"):
        load_target(tmp_path / "pickle")


class _Tokenizer:
    """Just the attributes the mask rule reads, with a real-looking special-token table."""

    def __init__(self, size, specials, mask_token_id=None):
        self.size, self.added_tokens_decoder, self.mask_token_id = size, specials, mask_token_id
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 1, 2, None

    def __len__(self):
        return self.size


def test_mask_token_rule_order():
    specials = {0: "<|endoftext|>", 2: "<|im_end|>", 16: "<empty_output>", 20: "<|reserved_special_token_3|>"}
    assert resolve_mask_token_id(5, _Tokenizer(100, specials), 100) == 5
    assert resolve_mask_token_id(None, _Tokenizer(100, specials, mask_token_id=7), 100) == 7
    assert resolve_mask_token_id(None, _Tokenizer(90, specials), 100) == 90  # spare embedding row
    assert resolve_mask_token_id(None, _Tokenizer(100, specials), 100) == 16  # unused special token
    with pytest.raises(TargetError, match="outside the target's embedding table"):
        resolve_mask_token_id(100, _Tokenizer(100, specials), 100)
    with pytest.raises(TargetError, match="pass --mask-token-id"):
        resolve_mask_token_id(None, _Tokenizer(100, {0: "<s>"}), 100)
