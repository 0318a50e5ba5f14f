"""`train --tensorboard`: real training runs write event files next to metrics.jsonl, and what
TensorBoard reads back from them is what metrics.jsonl / pipeline.jsonl hold."""

import json
import os
from pathlib import Path

import pytest
from tiny import pattern_samples, tiny_target, tiny_train_config

from dflash_train.config import ConfigError
from dflash_train.train.trainer import train

pytest.importorskip("tensorboard", reason="test extra: pip install tensorboard")


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_training_on_smollm2_writes_step_position_eval_and_pipeline_scalars(tmp_path, smollm2_dir):
    from dflash_train.cli import main

    data = Path(__file__).parent.parent / "data" / "smollm2_regenerated_64.jsonl.gz"
    assert main([
        "train", "--target", str(smollm2_dir), "--data", str(data), "--out", str(tmp_path), "--tensorboard", "on",
        "--steps", "4", "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8",
        "--block-size", "4", "--min-supervised-tokens", "8", "--device", "cpu", "--log-every", "2",
        "--eval-every", "2", "--eval-limit", "2", "--eval-max-new-tokens", "6",
    ]) == 0
    scalars = _scalars(tmp_path / "tensorboard")
    steps = _records(tmp_path / "metrics.jsonl")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [v for _, v in scalars["train/tau_sim"]] == pytest.approx([r["tau_sim"] for r in steps], rel=1e-6)
    for k in (1, 2, 3):  # block 4: positions 1..3 after the anchor
        assert [v for _, v in scalars[f"position_accuracy/k{k:02d}"]] == pytest.approx(
            [r["position_accuracy"][k - 1] for r in steps], abs=1e-6)
    measured = [(r["step"], r["tau_real"]) for r in steps if "tau_real" in r]
    assert [s for s, _ in measured] == [2, 4]
    assert [s for s, _ in scalars["eval/tau_real"]] == [2, 4]
    assert [v for _, v in scalars["eval/tau_real"]] == pytest.approx([t for _, t in measured], rel=1e-6)
    pipeline = _records(tmp_path / "pipeline.jsonl")
    for name in pipeline[-1]["workers"]:
        written = scalars[f"pipeline/busy/{name}"]
        assert [s for s, _ in written] == [r["step"] for r in pipeline]
        assert [v for _, v in written] == pytest.approx([r["workers"][name]["busy"] for r in pipeline], rel=1e-6)
    assert [s for s, _ in scalars["pipeline/mean_queue_depth"]] == [2, 4]


def test_variants_write_per_drafter_event_files_and_off_writes_none(tmp_path, one_thread):
    target = tiny_target("llama")
    config = tiny_train_config(tmp_path / "variants", steps=2, num_anchors=8, log_every=1, save_every=2,
                               mode="variants", variants=[{"name": "b4"}, {"name": "b3", "block_size": 3}],
                               tensorboard="on", export_dtype="")
    train(config, samples=pattern_samples(8), target=target, log=open(os.devnull, "w"))
    out = tmp_path / "variants"
    for name, positions in (("b4", 3), ("b3", 2)):
        scalars = _scalars(out / name / "tensorboard")
        assert [s for s, _ in scalars["train/loss"]] == [1, 2]
        assert sorted(t for t in scalars if t.startswith("position_accuracy/")) == [
            f"position_accuracy/k{k:02d}" for k in range(1, positions + 1)]
    assert any(t.startswith("pipeline/busy/") for t in _scalars(out / "tensorboard"))

    off = tiny_train_config(tmp_path / "off", steps=1, num_anchors=8, tensorboard="off", export_dtype="")
    train(off, samples=pattern_samples(8), target=target, log=open(os.devnull, "w"))
    assert (tmp_path / "off" / "metrics.jsonl").is_file()
    assert not (tmp_path / "off" / "tensorboard").exists()


def test_tensorboard_setting_is_validated():
    with pytest.raises(ConfigError, match="tensorboard 'yes': use auto, on or off"):
        tiny_train_config("unused", tensorboard="yes")
