"""The pipeline's warm-up ahead (`--warm-ahead`): a real second process compiles the train stage's
step on stand-in rows while the target regenerates, and the train stage's own warm-up then finds
its compiles in inductor's caches. Tiny target on the CPU (`[train] compile = "on"` makes the
CPU run compile; `auto` runs the warm-up ahead on CUDA devices only)."""

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from test_commands_pipeline import pipeline_files

from dflash_train.cli import main
from dflash_train.commands._stages import Work
from dflash_train.commands._warm_ahead import WarmAhead, skip_reason
from dflash_train.recipe import load_recipe
from dflash_train.train.warm_ahead import stand_in_samples, warm_up_settings


@pytest.fixture(scope="module")
def files(smollm2_dir, tmp_path_factory):
    # Hidden 64 over 4 heads: flex attention compiles on CUDA only from head size 16 up.
    return pipeline_files(smollm2_dir, tmp_path_factory.mktemp("warm-ahead"), hidden=64, train_lines='compile = "on"\n')


def work_of(files, folder: Path, device: str = "cpu") -> Work:
    return Work(load_recipe(str(files["recipe"])), str(files["target"]), folder, device)


def inductor_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {key: counters["inductor"][key] for key in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device, choice", [("cpu", "on"), pytest.param("cuda:0", "auto", marks=pytest.mark.gpu)])
def test_the_train_stage_finds_the_compiles_the_warm_up_ahead_made(files, tmp_path, capsys, one_thread, monkeypatch,
                                                                    device, choice):
    """With fresh inductor caches, every graph the train stage's warm-up compiles is a cache hit:
    the second process compiled them all (the same graphs: same shapes, same settings), and the
    train stage's seconds include waiting for it. On CUDA (`auto`) that includes the target's
    compiled feature forward and the captured step."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the child inherits it
    work = tmp_path / "work"
    before, scratches = inductor_counts(), set(Path(tempfile.gettempdir()).glob("dflash-warm-ahead-*"))
    assert main(["pipeline", "--target", str(files["target"]), "--recipe", str(files["recipe"]), "--out", str(work),
                 "--device", device, "--stages", "prompts,regenerate,train", "--warm-ahead", choice]) == 0
    out = capsys.readouterr().out
    after = inductor_counts()
    assert "warm-up ahead: compiling the train stage's step beside this stage" in out
    train_part = out[out.index("[pipeline] 3/3 train: started"):]
    assert "warm-up ahead: done after" in train_part.split("[pipeline] 3/3 train: done in")[0]
    log = (work / "warm-ahead.log").read_text()
    assert "warm-up ahead: done in" in log and "compiled in" in log
    hits = after["fxgraph_cache_hit"] - before["fxgraph_cache_hit"]
    assert hits > 0 and after["fxgraph_cache_miss"] == before["fxgraph_cache_miss"], (before, after)
    assert set(Path(tempfile.gettempdir()).glob("dflash-warm-ahead-*")) <= scratches  # its scratch folder is gone
    assert json.loads((work / "stages.json").read_text())["train"]["done"]


def test_a_warm_up_ahead_that_fails_is_one_line_and_leaves_no_scratch(files, tmp_path):
    """A real child that fails (its target is gone) ends with a line naming its exit and last
    log line; its scratch folder is removed."""
    work = dataclasses.replace(work_of(files, tmp_path), target=str(tmp_path / "no-such-target"))
    ahead = WarmAhead.start(work.train_config(), tmp_path / "warm-ahead.log")
    line = ahead.finish()
    assert line.startswith("warm-up ahead: failed after") and "(exit 1: " in line, line
    assert "no-such-target" in line and str(tmp_path / "warm-ahead.log") in line
    assert not ahead.scratch.exists()


def test_an_abandoned_warm_up_ahead_is_stopped_and_cleaned(files, tmp_path):
    ahead = WarmAhead.start(work_of(files, tmp_path).train_config(), tmp_path / "warm-ahead.log")
    ahead.abandon()
    assert ahead.process.returncode is not None and not ahead.scratch.exists()


def test_when_the_warm_up_ahead_runs(files, tmp_path, monkeypatch):
    run = tmp_path / "w" / "run"
    every = ["prompts", "regenerate", "train", "export", "eval"]

    def reason(stages=every, choice="on", features_cached=False):
        return skip_reason(stages, choice, features_cached=features_cached, run_dir=run, target=str(files["target"]),
                           device="cpu")

    assert reason() is None
    assert reason(choice="off") == "--warm-ahead off"
    assert reason(["train", "export"]) == "the train stage does not follow a regenerate stage in this run"
    assert reason(["prompts", "regenerate"]) == "the train stage does not follow a regenerate stage in this run"
    assert reason(choice="auto") == "auto: cpu is not a CUDA device"
    assert reason(features_cached=True) == "the recipe trains from cached features"
    run.mkdir(parents=True)
    (run / "compile_cache.bin").write_bytes(b"x")
    assert "the run's own compile cache is there" in reason()
    (run / "compile_cache.bin").unlink()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert reason() == "a torchrun launch: each node warms up its own run"


def test_the_stand_in_rows_have_the_runs_shapes(files, tmp_path):
    config = work_of(files, tmp_path).train_config()
    settings = warm_up_settings(config, tmp_path / "scratch")
    assert (settings.data.data, settings.data.features, settings.checkpoint.resume, settings.eval.eval_every,
            settings.checkpoint.export_dtype, settings.checkpoint.out) == ([], "", False, 0, "", str(tmp_path / "scratch"))
    # Everything that shapes a compiled graph is the run's.
    for key in ("max_seq_len", "seq_buckets", "batch_size", "block_size", "num_layers", "num_anchors", "compile",
                "cuda_graphs", "compile_target", "fp8", "precision", "arch", "loss", "device"):
        assert settings.flat_values()[key] == config.flat_values()[key], key
    samples = stand_in_samples(settings, vocab_size=49152)
    assert len(samples) >= config.optimizer.batch_size
    for sample in samples:
        assert sample.input_ids.shape == (config.data.max_seq_len,) and int(sample.input_ids.max()) < 49152
        assert int(sample.loss_mask.sum()) >= config.data.min_supervised_tokens and not sample.loss_mask[0]
    assert torch.equal(samples[0].input_ids, stand_in_samples(settings, vocab_size=49152)[0].input_ids)
