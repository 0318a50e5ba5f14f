"""A target that cannot load is one line naming --target and what is wrong, exit 2, before any model
loads: a folder without weights, a config.json that is not JSON, not an object, or names an
architecture transformers does not know, a weights file or shard index cut short, a .gguf whose
header does not read. What only the load can find (weights whose shapes the config contradicts)
is one line too. Real files, the real CLI, in process."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import pytest
from safetensors.torch import save_file

from dflash_train.cli import main
from tiny import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good") / "target"
    tiny_hf_model("llama", layers=2).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("{}")  # checked for before loading; never loaded here
    return folder


def _folder(tmp: Path, config: str | None, **weights: bytes) -> Path:
    folder = tmp / "target"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    for name, data in weights.items():
        (folder / name.replace("__", ".")).write_bytes(data)
    return folder


def _copy_without(good: Path, tmp: Path, *left_out: str) -> Path:
    folder = tmp / "target"
    folder.mkdir()
    for item in good.iterdir():
        if item.name not in left_out:
            (folder / item.name).write_bytes(item.read_bytes())
    return folder


def _sharded_missing_one(good: Path, tmp: Path) -> Path:
    folder = _copy_without(good, tmp, "model.safetensors")
    save_file({}, str(folder / "model-00001-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _gguf(tmp: Path, data: bytes) -> Path:
    path = tmp / "model.gguf"
    path.write_bytes(data)
    return path


_V3_ONE_KEY = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)  # a version 3 header announcing one key, then cut short

# name -> (builds the broken target in a folder, what the one line says is wrong)
CASES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "config.json only (no weights)": (lambda good, tmp: _copy_without(good, tmp, "model.safetensors"),
                                      "no weights (none of model.safetensors, model.safetensors.index.json, "
                                      "pytorch_model.bin, pytorch_model.bin.index.json); an unfinished download or copy?"),
    "config.json not JSON": (lambda good, tmp: _folder(tmp, "{x"),
                             "config.json is not valid JSON (Expecting property name enclosed in double quotes at "
                             "line 1 column 2)"),
    "config.json not an object": (lambda good, tmp: _folder(tmp, "[1, 2]"), "config.json is not a JSON object (it is a list)"),
    "config.json without model_type": (lambda good, tmp: _folder(tmp, "{}"), "config.json names no model_type"),
    "unknown model_type": (lambda good, tmp: _folder(tmp, '{"model_type": "nosuch"}'),
                           "config.json has model_type 'nosuch', which transformers"),
    "weights not safetensors": (lambda good, tmp: _folder(tmp, '{"model_type": "llama"}', model__safetensors=b"not a model"),
                                "model.safetensors is not a readable safetensors file (11 bytes)"),
    "a shard missing": (_sharded_missing_one, "model.safetensors.index.json lists 1 weight file the folder lacks: "
                                              "model-00002-of-00002.safetensors"),
    "gguf: 8 bytes": (lambda good, tmp: _gguf(tmp, b"GGUFxxxx"), "not a readable GGUF file (8 bytes): GGUF version"),
    "gguf: cut inside its header": (lambda good, tmp: _gguf(tmp, _V3_ONE_KEY),
                                    "not a readable GGUF file (24 bytes): the file ends inside its header"),
}


def _command(name: str, target: Path, tmp: Path) -> list[str]:
    data = tmp / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "hi"}) + "\n")
    out = tmp / "out"
    return {
        "train": ["train", "--device", "cpu", "--target", str(target), "--data", str(data), "--block-size", "4",
                  "--num-layers", "1", "--steps", "2", "--out", str(out)],
        "regenerate": ["regenerate", "--device", "cpu", "--target", str(target), "--prompts", str(prompts),
                       "--out", f"{out}.jsonl", "--max-new-tokens", "8"],
        "cache-features": ["cache-features", "--device", "cpu", "--target", str(target), "--data", str(data),
                           "--out", str(out), "--num-layers", "1"],
    }[name]


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "loading target" not in captured.out, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("command", ["train", "regenerate", "cache-features"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_target_is_one_line_naming_the_flag_before_anything_loads(case, command, good, tmp_path, capsys):
    build, reason = CASES[case]
    target = build(good, tmp_path)
    assert main(_command(command, target, tmp_path)) == 2
    line = _one_line(capsys)
    assert line.startswith(f"dflash-train {command}: --target {target}: {reason}"), line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.jsonl").exists()


def test_weights_the_config_contradicts_are_one_line_once_loaded(good, tmp_path, capsys):
    """Only the load can find this one (the shapes are in the weights, the checks read headers)."""
    target = _copy_without(good, tmp_path)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    assert main(_command("train", target, tmp_path)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"dflash-train train: {target}: weights whose shapes differ from what config.json describes: "), line
    assert "(file [" in line and "config [" in line and line.endswith("the config.json does not belong to these weights")
    assert not (tmp_path / "out").exists()


def test_the_same_targets_load_when_whole(good, tmp_path, capsys):
    """The checks refuse only what is broken: the good folder, and one sharded with its index, pass."""
    from dflash_train.target.model import check_target_path

    check_target_path(good, "--target")
    sharded = tmp_path / "sharded"
    tiny_hf_model("llama", layers=2).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    check_target_path(sharded, "--target")
