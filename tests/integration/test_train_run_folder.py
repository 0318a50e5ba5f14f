"""What `train --out` may hold (docs/FAULTS.md): nothing (a new or empty folder), or with
`--resume` the run it continues, in the same mode with the same variants; never the user's own
files, which a run would write beside and, where a name is one it writes (rows.cache), replace.
A resume that changes a setting says so, one line each, and run.json keeps every resume's
changes. Real tiny models, real files, the real command line."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from data_files import REGENERATED_64
from tiny import pattern_samples, tiny_hf_model, tiny_target, tiny_train_config

from dflash_train.cli import main
from dflash_train.config import ConfigError
from dflash_train.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second intra-op thread only spins

VARIANTS = dict(mode="variants", drafter_devices=["cpu", "cpu"],
                variants=[{"name": "a", "block_size": 4}, {"name": "b", "block_size": 6}])


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, head_scale=20)


def _config(out, **overrides):
    return tiny_train_config(out, **{**dict(steps=4, num_anchors=8, lr=5e-3, log_every=2, save_every=2,
                                            export_dtype="", tensorboard="off"), **overrides})


def _train(out, target, log=None, stop_at=None, **overrides):
    return train(_config(out, **overrides), samples=pattern_samples(16), target=target, stop_at=stop_at,
                 log=log if log is not None else open(os.devnull, "w"))


def _contents(folder: Path) -> dict[str, bytes | None]:
    """Every entry below `folder` with its bytes (None for a folder): what must stay as it was."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(tmp_path, target, resume):
    """The defect: --out of a folder holding the user's rows.cache trained, exit 0, and replaced it
    with the run's; one holding notes.txt got the run's files mixed in."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "rows.cache").write_text("mine\n")
    (mine / "notes.txt").write_text("keep\n")
    before = _contents(mine)
    with pytest.raises(ConfigError, match=r"--out .*mine is a folder that holds no training run \(notes.txt, rows.cache\)"):
        _train(mine, target, resume=resume)
    assert _contents(mine) == before


def test_a_finished_export_is_no_run_folder(tmp_path, target):
    _train(tmp_path / "run", target, steps=2, export_dtype="float32")
    export = tmp_path / "run" / "export"
    before = _contents(export)
    with pytest.raises(ConfigError, match="export is a folder that holds no training run"):
        _train(export, target)
    assert _contents(export) == before


def test_an_empty_folder_is_a_new_run_with_or_without_resume(tmp_path, target):
    for name, resume in (("fresh", False), ("resumed", True)):
        (tmp_path / name).mkdir()
        log = io.StringIO()
        summary = _train(tmp_path / name, target, log=log, resume=resume)
        assert summary["steps_done"]["drafter"] == 4
        assert (tmp_path / name / "run.json").is_file()
    assert "no complete checkpoint" in log.getvalue()


def test_the_command_refuses_a_folder_of_the_users_files_in_one_line_before_the_target_loads(tmp_path, capsys):
    """Exit 2, one line, nothing written, and before the target loads: its tokenizer is a stub,
    which loading it would stop at."""
    mine = tmp_path / "u3"
    mine.mkdir()
    (mine / "rows.cache").write_text("mine\n")
    stub = tmp_path / "tiny"
    tiny_hf_model("llama", layers=1).save_pretrained(stub)
    (stub / "tokenizer_config.json").write_text("{}")
    capsys.readouterr()
    code = main(["train", "--target", str(stub), "--data", str(REGENERATED_64), "--out", str(mine),
                 "--device", "cpu", "--steps", "4"])
    captured = capsys.readouterr()
    err = captured.err
    assert "loading target" not in captured.out
    assert code == 2
    assert err.strip().count("\n") == 0 and "holds no training run (rows.cache)" in err, err
    assert _contents(mine) == {"rows.cache": b"mine\n"}


@pytest.fixture(scope="module")
def variants_run(target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("variants")
    _train(out, target, **VARIANTS)
    return out


@pytest.fixture(scope="module")
def replicas_run(target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replicas")
    _train(out, target)
    return out


@pytest.mark.parametrize("asked,message", [
    ({}, r"it holds variants a, b \(--mode variants\), and this command trains one drafter \(--mode replicas\)"),
    ({**VARIANTS, "variants": [{"name": "a"}, {"name": "c"}]},
     r"it holds variants a, b \(--mode variants\), and this command trains variants a, c \(--mode variants\)"),
])
def test_a_variants_run_resumed_as_another_run_is_refused_and_untouched(variants_run, target, asked, message):
    """The defect: resumed without its config, a variants run said `no complete checkpoint`
    (they are under a/ and b/) and trained a second run into its folder."""
    before = _contents(variants_run)
    with pytest.raises(ConfigError, match=rf"cannot resume .*: {message}"):
        _train(variants_run, target, steps=6, resume=True, **asked)
    assert _contents(variants_run) == before


def test_a_one_drafter_run_resumed_with_variants_is_refused_and_untouched(replicas_run, target):
    before = _contents(replicas_run)
    with pytest.raises(ConfigError, match=r"it holds one drafter \(--mode replicas\), and this command trains "
                                          r"variants a, b \(--mode variants\)"):
        _train(replicas_run, target, steps=6, resume=True, **VARIANTS)
    assert _contents(replicas_run) == before


def test_a_resume_says_each_setting_it_changes_and_run_json_keeps_every_resume(tmp_path, target):
    """The defect: --loss, --warmup-ratio, ... changed at a resume were applied silently, and
    run.json, rewritten, no longer said what trained the steps before."""
    _train(tmp_path, target, steps=8, stop_at=4)
    log = io.StringIO()
    _train(tmp_path, target, log=log, steps=8, stop_at=6, resume=True, loss="dpace", warmup_ratio=0.25)
    said = log.getvalue()
    assert "--resume: --loss decay -> dpace (from step 5)\n" in said
    assert "--resume: --warmup-ratio 0.04 -> 0.25 (from step 5)\n" in said
    assert said.count("--resume: --") == 2  # nothing else changed (--resume itself is no change)
    log = io.StringIO()
    _train(tmp_path, target, log=log, steps=10, resume=True, loss="dpace", warmup_ratio=0.25, gamma=2.0)
    assert "--resume: --gamma unset -> 2.0 (from step 7)\n" in log.getvalue()
    assert "--resume: --steps 8 -> 10 (from step 7)\n" in log.getvalue()
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["train_config"]["loss"] == "dpace" and run["train_config"]["gamma"] == 2.0
    assert run["resumes"] == [
        {"step": 4, "checkpoint": "step-00000004", "changed": {"loss": {"from": "decay", "to": "dpace"},
                                                               "warmup_ratio": {"from": 0.04, "to": 0.25}}},
        {"step": 6, "checkpoint": "step-00000006", "changed": {"gamma": {"from": None, "to": 2.0},
                                                               "steps": {"from": 8, "to": 10}}},
    ]


def test_the_resumes_of_steps_trained_again_are_dropped(tmp_path, target):
    """A resume from an earlier checkpoint than the last resume's (the newer ones damaged or
    removed): the later entries were of steps now trained again, so run.json drops them."""
    import shutil

    kept = dict(steps=8, keep_checkpoints=4)
    _train(tmp_path, target, stop_at=2, **kept)
    _train(tmp_path, target, stop_at=4, resume=True, loss="dpace", **kept)
    _train(tmp_path, target, stop_at=6, resume=True, loss="dpace", clip_grad=0.5, **kept)
    assert [r["step"] for r in json.loads((tmp_path / "run.json").read_text())["resumes"]] == [2, 4]
    for step in (4, 6):
        shutil.rmtree(tmp_path / "checkpoints" / f"step-{step:08d}")
    (tmp_path / "checkpoints" / "latest").write_text("step-00000002\n")
    _train(tmp_path, target, resume=True, warmup_ratio=0.5, **kept)
    resumes = json.loads((tmp_path / "run.json").read_text())["resumes"]
    assert [(r["step"], sorted(r["changed"])) for r in resumes] == [(2, ["warmup_ratio"])]
