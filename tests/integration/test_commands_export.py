"""`export --out DIR` never destroys what DIR holds (issue: export deleted its --out folder).

A real checkpoint of a real tiny drafter, exported through the real CLI entry point."""

import json
import os
from pathlib import Path

import pytest
from tiny import tiny_target

from dflash_train.cli import main
from dflash_train.core.drafter import DFlashDrafter, DrafterConfig
from dflash_train.files import write_dir_atomically
from dflash_train.train.checkpoint import save_checkpoint


@pytest.fixture()
def run_dir(tmp_path):
    target = tiny_target("llama")
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=4, mask_token_id=95)
    run = tmp_path / "run"
    save_checkpoint(run, 3, DFlashDrafter(config), None, None, {})
    return run


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_refuses_a_foreign_non_empty_folder_and_leaves_it_as_it_was(run_dir, tmp_path, capsys):
    model = tmp_path / "target-model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights of the user's target")
    (model / "tokenizer.json").write_text("{}")
    before = _tree(model)
    assert main(["export", str(run_dir), "--out", str(model)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert _tree(model) == before


@pytest.mark.parametrize("where", ["run", "checkpoints", "cwd"])
def test_export_never_replaces_the_folder_holding_its_checkpoint_even_with_force(run_dir, where, monkeypatch, capsys):
    out = {"run": run_dir, "checkpoints": run_dir / "checkpoints", "cwd": Path(".")}[where]
    monkeypatch.chdir(run_dir.parent)
    before = _tree(run_dir)
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 2
    expected = "is the current folder" if where == "cwd" else "holds the checkpoint"  # `.` is refused as a path
    assert expected in capsys.readouterr().err
    assert _tree(run_dir) == before


def test_export_replaces_its_own_earlier_export_and_force_replaces_a_foreign_one(run_dir, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert json.loads((out / "export.json").read_text())["run"] == str(run_dir.resolve())
    first = (out / "model.safetensors").read_bytes()
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "float32"]) == 0  # same run: replaced
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["export", str(run_dir), "--out", str(foreign)]) == 2
    assert main(["export", str(run_dir), "--out", str(foreign), "--force"]) == 0
    assert not (foreign / "notes.txt").exists() and (foreign / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left aside


def test_export_to_a_file_is_refused(run_dir, tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    assert main(["export", str(run_dir), "--out", str(target), "--force"]) == 2
    assert "is a file" in capsys.readouterr().err and target.read_text() == "keep me"


def test_a_failed_folder_write_keeps_the_old_folder(tmp_path):
    final = tmp_path / "folder"
    final.mkdir()
    (final / "a").write_text("old")

    def broken(staging: Path) -> None:
        (staging / "a").write_text("new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_dir_atomically(final, broken)
    assert (final / "a").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["folder"]

    write_dir_atomically(final, lambda staging: (staging / "b").write_text("new"))
    assert sorted(os.listdir(final)) == ["b"] and sorted(os.listdir(tmp_path)) == ["folder"]


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_an_export_into_a_run_that_a_live_train_holds_is_refused(run_dir, tmp_path, capsys, form):
    """The trainer holds its run folder (`hold_output`) and writes run/export at its end: an export
    written there meanwhile was replaced without a word. Held here as a live train holds it."""
    from dflash_train.files import hold_output

    out = run_dir / ("export" if form == "hf" else "drafter.gguf")
    extra = ["--format", "gguf", "--target", str(tmp_path / "t.gguf")] if form == "gguf" else []
    with hold_output(run_dir, "--out"):
        assert main(["export", str(run_dir), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert f"--out {run_dir.resolve()} is in use by another live process (pid {os.getpid()}" in err, err
    assert not out.exists()
    if form == "hf":  # with no live train on it, the run takes its export
        assert main(["export", str(run_dir), "--out", str(out)]) == 0 and (out / "model.safetensors").is_file()


def test_an_export_into_a_variant_of_a_run_that_a_live_train_holds_is_refused(tmp_path, capsys):
    """A variants `train` holds its --out (OUT), not each variant's folder OUT/<name>: an export into
    OUT/a/export looked for the run by its checkpoints/, found OUT/a, took OUT/a's lock (free) and
    was written, to be replaced by the trainer's own export of `a` at its end. Held here as a live
    variants train holds it."""
    from tiny import pattern_samples, tiny_train_config

    from dflash_train.files import hold_output
    from dflash_train.train.trainer import train

    out = tmp_path / "variants"
    config = tiny_train_config(out, steps=2, num_anchors=8, save_every=2, export_dtype="", tensorboard="off",
                               mode="variants", drafter_devices=["cpu", "cpu"],
                               variants=[{"name": "a", "block_size": 4}, {"name": "b", "block_size": 6}])
    train(config, samples=pattern_samples(16), target=tiny_target("llama", layers=4), log=open(os.devnull, "w"))
    export = out / "a" / "export"
    with hold_output(out, "--out"):
        assert main(["export", str(out / "a"), "--out", str(export)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out.resolve()} is in use by another live process (pid {os.getpid()}" in err, err
    assert len(err.strip().splitlines()) == 1 and not export.exists()
    # With no live train on it, the variant takes its export.
    assert main(["export", str(out / "a"), "--out", str(export)]) == 0 and (export / "model.safetensors").is_file()
