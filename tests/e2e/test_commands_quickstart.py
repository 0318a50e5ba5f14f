"""The README's first command, shrunk: every stage on the real SmolLM2 target."""

import json

import pytest

from dflash_train.cli import main


# Every stage twice on a 135M-parameter target: 3 min on one core of a busy machine, over 5 on
# both cores of it (measured): more than the 300 s default.
@pytest.mark.timeout(1200)
def test_quickstart_runs_every_stage_and_resumes(tmp_path, smollm2_dir, capsys):
    # One step: quickstart evaluates in training every steps // 2 steps, and each of those evaluations
    # decodes 8 prompts with SmolLM2 (13 s on a CPU): 4 steps cost two of them, 1 step one.
    args = ["quickstart", "--out", str(tmp_path), "--prompts", "12", "--max-new-tokens", "12", "--steps", "1",
            "--num-layers", "1", "--block-size", "4", "--eval-prompts", "1", "--eval-max-new-tokens", "8",
            "--device", "cpu"]
    assert main(args) == 0
    output = capsys.readouterr().out
    assert "dflash-train quickstart finished" in output and "rows: read=12" in output
    assert (tmp_path / "training_curve.png").stat().st_size > 10_000
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()
    evaluation = json.loads((tmp_path / "eval.json").read_text())
    for bench in evaluation["benchmarks"].values():
        assert bench["summary"]["identical_to_baseline"] == bench["summary"]["compared"]  # lossless
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and "tau_real" in records[-1]

    assert "--spec-draft-n-max 3" in output and "vllm serve" in output and "sglang.launch_server" in output

    # a second run reuses everything: every stage (prompts, regenerate, features, train, eval,
    # export) is recorded done in stages.json, and no model is loaded again
    assert main(args) == 0
    again = capsys.readouterr().out
    assert again.count("done in an earlier run") == 6 and "loading target" not in again
    assert "dflash-train quickstart finished" in again


def test_quickstart_refuses_layer_ids_beyond_the_target_at_start(tmp_path, smollm2_dir, capsys):
    """SmolLM2 has 30 layers: id 99 is refused once the target is known, before minutes of
    regenerating data (D14)."""
    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--target-layer-ids", "2,99", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "target_layer_ids [99] out of range" in captured.err and "valid ids are 0..29" in captured.err
    assert not list(out.rglob("*.jsonl")), list(out.rglob("*"))
