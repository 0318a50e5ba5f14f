"""`dflash-train doctor` on this (CPU) machine: real checks, a real tiny target folder, exit codes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.core.attention import flash_kernels_missing
from tiny import tiny_hf_model

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target") / "tiny-qwen3"
    tiny_hf_model("qwen3").save_pretrained(folder)
    return folder


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _lines(text: str) -> dict[str, str]:
    """finding name -> 'status  detail' for each finding line."""
    found = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0] in ("ok", "FAIL", "info", "skip"):
            name, _, detail = parts[1].partition("  ")
            found[name.strip()] = f"{parts[0]} {detail.strip()}"
    return found


def test_doctor_in_process_reports_every_check_and_passes_here(target_dir, cache_dir, tmp_path, capsys):
    assert main(["doctor", "--target", str(target_dir), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    assert lines["python"] == "ok " + ".".join(map(str, sys.version_info[:3]))
    assert lines["torch"].startswith(f"ok {torch.__version__}")
    assert lines["transformers"].startswith("ok 5.")
    assert "triton" in lines
    assert lines["compile gate"].startswith("ok ") and "runs eagerly" in lines["compile gate"]
    if not torch.cuda.is_available():
        assert lines["GPU"].startswith("info no CUDA GPU")
        assert lines["flex attention"].startswith("skip ") and "backward is not implemented on CPU" in lines["flex attention"]
    if flash_kernels_missing():
        assert lines["flash kernels"] == "skip --attention flash needs FlashAttention-4: " + flash_kernels_missing()
    assert lines["disk: cache"].startswith("ok ") and "GiB free" in lines["disk: cache"] and str(cache_dir) in lines["disk: cache"]
    assert lines["disk: --out"].startswith("ok ") and "not there yet" in lines["disk: --out"]
    assert lines["target"] == "ok Qwen3Config: 6 layers, hidden 64, vocab 96"
    assert lines["static decoder"].startswith("ok passes its probe")
    assert out.rstrip().endswith("ready: nothing a run needs is missing")
    assert not (tmp_path / "run").exists()  # doctor writes nothing


def test_doctor_in_a_subprocess(target_dir, tmp_path):
    env = {**os.environ, "DFLASH_TRAIN_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "dflash_train.cli", "doctor", "--target", str(target_dir)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = _lines(result.stdout)
    assert {"python", "torch", "transformers", "triton", "compile gate", "GPU", "flex attention", "disk: cache",
            "target", "static decoder"} <= set(lines)
    assert len(result.stdout.splitlines()) <= 24  # one screen


def test_doctor_fails_with_the_reason_when_the_target_is_not_a_model(tmp_path, cache_dir, capsys):
    not_a_model = tmp_path / "weights"
    not_a_model.mkdir()
    (not_a_model / "model.safetensors").write_bytes(b"not a model")
    assert main(["doctor", "--target", str(not_a_model)]) == 1
    out = capsys.readouterr().out
    assert _lines(out)["target"].startswith("FAIL ")
    assert f"not ready: 1 problem: target: {not_a_model}: not a Hugging Face model folder (no config.json)" in out


def test_doctor_fails_when_out_is_a_file(tmp_path, cache_dir, capsys):
    (tmp_path / "run").write_text("a file where the run folder would go")
    assert main(["doctor", "--out", str(tmp_path / "run")]) == 1
    assert "is a file, not a folder" in _lines(capsys.readouterr().out)["disk: --out"]
    # Below a file: train refuses it (files.check_outside_inputs), so the doctor does too.
    assert main(["doctor", "--out", str(tmp_path / "run" / "x")]) == 1
    assert _lines(capsys.readouterr().out)["disk: --out"] == f"FAIL --out {tmp_path / 'run' / 'x'}: {tmp_path / 'run'} is a file, not a folder"


@pytest.mark.parametrize("broken", ["no weights", "gguf header"])
def test_doctor_fails_on_a_target_the_commands_refuse(broken, target_dir, tmp_path, cache_dir, capsys):
    """What train refuses before loading (target/model.py check_target_path), the doctor calls a
    problem in the same words, never 'ready' and never a bare struct.error."""
    if broken == "no weights":
        target = tmp_path / "config-only"
        target.mkdir()
        (target / "config.json").write_bytes((target_dir / "config.json").read_bytes())
        reason = f"{target}: no weights (none of model.safetensors"
    else:
        target = tmp_path / "fake.gguf"
        target.write_bytes(b"GGUFxxxx")
        reason = f"{target}: not a readable GGUF file (8 bytes): GGUF version"
    assert main(["doctor", "--target", str(target)]) == 1
    out = capsys.readouterr().out
    assert _lines(out)["target"].startswith(f"FAIL {reason}"), out
    assert f"not ready: 1 problem: target: {reason}" in out


def test_doctor_help_imports_no_torch():
    code = ("import sys\nfrom dflash_train.cli import main\ntry:\n    main(['doctor', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--target" in result.stdout and "--out" in result.stdout


@pytest.mark.gpu
def test_doctor_on_a_gpu_runs_the_products_peers_and_the_flex_compile(cache_dir, capsys):
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = _lines(out)
    for index in range(torch.cuda.device_count()):
        assert lines[f"cuda:{index}"].startswith("ok ") and "bf16 yes" in lines[f"cuda:{index}"]
        assert "FP8 " in lines[f"cuda:{index}"]
    if torch.cuda.device_count() > 1:
        assert "0->1" in lines["peer access"]
    assert lines["flex attention"].startswith("ok compiled forward+backward on cuda:0")
    if not flash_kernels_missing() and torch.cuda.get_device_capability(0)[0] >= 9:
        assert lines["flash kernels"].startswith("ok compiled forward+backward on cuda:0")
    assert lines["triton"].startswith("ok ")
