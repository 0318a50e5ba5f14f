"""bench/quality_run.py, run as the lent machine runs it (a subprocess): the product's stages
through `dflash-train pipeline` in time boxes, the curve and recipe experiments, the plot."""

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from test_commands_pipeline import prompt_files
from test_generate_regenerate import tiny_smollm_dir

# Lab tooling, not the product: out of the default suite (its 10-minute aim); .ci/run runs them after it.
pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "quality_run.py"
NOT_FINISHED = 3  # the script's exit status when time ran out before every stage was done


@pytest.fixture(scope="module")
def files(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quality_run")
    target = tiny_smollm_dir(smollm2_dir, root / "target")
    prompts, dev = prompt_files(root, 40)
    return {"target": target, "prompts": prompts, "dev": dev}


def quality_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO)


def base_args(files, work, *extra):
    return ["run", "--target", str(files["target"]), "--prompts", str(files["prompts"]), "--dev-prompts",
            str(files["dev"]), "--work", str(work), "--device", "cpu", "--min-stage-seconds", "0", "--self-prompts", "0",
            "--max-prompt-tokens", "256", *extra]  # prompt + answer within the tiny target's 512-token context


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def restore_parts(folder: Path, name: str, into: Path) -> Path:
    """What `cat NAME.part* | tar -xz` gives."""
    parts = sorted(folder.glob(f"{name}.part*"))
    assert parts, f"no {name}.part* in {folder}"
    into.mkdir()
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:gz") as archive:
        archive.extractall(into, filter="data")
    return into


@pytest.mark.timeout(900)
def test_the_pipeline_stages_run_through_the_product_and_come_back_in_parts(files, tmp_path):
    """The product's stages with this script's overrides (the smoke recipe): WORK/pipeline is the
    product's work folder, its summary is printed, the answers and the drafter come back as parts
    that restore them, and a rerun runs nothing again."""
    work, back = tmp_path / "work", tmp_path / "json"
    args = base_args(files, work, "--samples", "6", "--smoke", "--steps", "4", "--eval-limit", "1", "--speed-limit", "1",
                     "--max-new-tokens", "8", "--json-dir", str(back))
    done = quality_run(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    book = json.loads((work / "pipeline" / "stages.json").read_text())
    assert [s for s in book if book[s]["done"]] == ["prompts", "regenerate", "train", "export", "eval"]
    assert book["train"]["settings"]["train.steps"] == 4 and book["train"]["settings"]["train.num_layers"] == 1
    assert book["train"]["settings"]["train.loss"] == "dpace" and book["regenerate"]["rows"] == 6
    recipe = json.loads((work / "recipe.json").read_text())
    assert recipe["prompts"]["count"] == 6 and recipe["eval"]["bench"] == [str(files["dev"]), "humaneval", "mtbench_odd",
                                                                         "math500"]
    out = done.stdout
    assert "[pipeline] 3/5 train: done in" in out and "dflash-train pipeline finished in" in out
    assert "speed-up    humaneval:" in out and "vllm serve" in out
    drafter = restore_parts(back, "export-drafter.tar.gz", tmp_path / "restored") / "drafter"
    assert (drafter / "model.safetensors").read_bytes() == (work / "pipeline" / "drafter" / "model.safetensors").read_bytes()
    answers = restore_parts(back, "regenerate-data.jsonl.tar.gz", tmp_path / "answers") / "data.jsonl"
    assert answers.read_bytes() == (work / "pipeline" / "data.jsonl").read_bytes()
    assert json.loads((back / "pipeline-stages.json").read_text()) == book and (back / "speed.json").is_file()

    again = quality_run(*args)
    assert again.returncode == 0 and again.stdout.count("done in an earlier run") == 5
    assert json.loads((work / "pipeline" / "stages.json").read_text())["train"]["runs"] == 1


@pytest.mark.timeout(900)
def test_a_box_stops_the_pipeline_and_the_next_call_resumes_without_losing_or_repeating_a_row(files, tmp_path):
    # Answers one at a time: 40 x 400 tokens take longer than a box after loading (40 x 160 did
    # not on a fast 2-core machine). Loading takes a few seconds on a shared CPU, so a box may end
    # before the first row: then the next call gets a longer deadline, until one stops regenerate
    # mid-run with rows written.
    args = base_args(files, tmp_path / "work", "--samples", "40", "--stages", "prompts,regenerate",
                     "--max-new-tokens", "400", "--max-prompt-tokens", "64", "--regen-batch-size", "1")
    answers = tmp_path / "work" / "pipeline" / "data.jsonl"
    partial: list[dict] = []
    for deadline in (12, 18, 24, 36, 48):
        stopped = quality_run(*args, "--deadline-seconds", str(deadline))
        assert stopped.returncode == NOT_FINISHED, "finished inside the box"
        assert "pipeline: box of" in stopped.stdout and "the next call resumes" in stopped.stdout
        written = rows(answers) if answers.exists() else []  # a box that ended while loading wrote no file yet
        assert written[: len(partial)] == partial  # rows of earlier calls stay as they were
        partial = written
        if partial:
            break
    # the file's prompts outside its dev split (the rule of `dflash-train prompts`): what regenerate answers
    train_split = [r["id"] for r in rows(tmp_path / "work" / "pipeline" / "prompts" / "train.jsonl")]
    assert 0 < len(partial) < len(train_split), f"no box stopped regenerate mid-run ({len(partial)} rows)"
    finished_call = quality_run(*args)  # the same command with the default deadline finishes
    assert finished_call.returncode == 0, finished_call.stdout[-3000:]
    finished = rows(answers)
    # none lost, none twice
    assert 36 <= len(train_split) <= 40 and sorted(r["id"] for r in finished) == sorted(train_split)
    assert finished[: len(partial)] == partial
    book = json.loads((tmp_path / "work" / "pipeline" / "stages.json").read_text())["regenerate"]
    assert book["done"] and book["rows"] == len(train_split) and book["runs"] >= 2


def test_bad_arguments_fail_in_one_line_before_anything_loads(files, tmp_path):
    work = tmp_path / "work"
    bad_dev = tmp_path / "bad_dev.jsonl"
    bad_dev.write_text('{"id": "d0", "prompt": "fine"}\nnot json\n')
    (tmp_path / "half.gguf").write_bytes(b"")
    answers = tmp_path / "answers.jsonl"
    answers.write_text("")
    cases = {
        "unfinished gguf": (["--target", str(tmp_path / "half.gguf")], "half.gguf: not a GGUF file (0 bytes"),
        "--stages": (["--stages", "regenerate,trian"], "--stages regenerate,trian: use some of"),
        "missing prompts": (["--prompts", str(tmp_path / "nope.jsonl")], "nope.jsonl: no such file"),
        "loss": (["--loss", "mse"], "--loss 'mse': use decay or dpace"),
        "curve sizes": (["--stages", "curve", "--samples", "10", "--curve-sizes", "5,20", "--curve-steps", "3"],
                        "20 rows is more than --samples 10"),
        "unknown flag": (["--sampels", "3"], "unknown argument '--sampels'"),
        "recipe value": (["--lr", "-1"], "[train] --lr must be > 0 (got -1.0)"),
        "bad dev row": (["--stages", "recipe", "--recipe-variants", "loss=decay", "--dev-prompts", str(bad_dev)],
                        "bad_dev.jsonl:2: invalid JSON"),
        "self prompts": (["--samples", "4", "--self-prompts", "5"], "--self-prompts must be in 0..--samples 4"),
        "answers and regenerate": (["--answers-from", str(answers), "--stages", "regenerate,train"],
                                   "--answers-from replaces the stages that make answers (regenerate)"),
        "variant key": (["--stages", "recipe", "--recipe-variants", "colour=red"], "'colour' is not a variant key"),
    }
    for name, (extra, message) in cases.items():
        failed = quality_run(*base_args(files, work), *extra)
        assert failed.returncode == 2, (name, failed.stdout[-2000:], failed.stderr[-2000:])
        assert message in failed.stderr and len(failed.stderr.strip().splitlines()) == 1, (name, failed.stderr)
    assert not work.exists()  # nothing was started
    failed = quality_run("plot", str(tmp_path / "none.json"), "--png", str(tmp_path / "x.png"))
    assert failed.returncode == 2 and "none.json: no such curve file" in failed.stderr


def test_plot_writes_a_png_and_a_table_with_where_tau_flattens(tmp_path):
    taus = {"equal steps": [1.20, 1.50, 1.53, 1.54], "equal epochs": [1.10, 1.20, 1.30, 1.32]}
    points = [{"series": series, "rows": size, "steps": steps,
               "tau": {"humaneval": {"prompts": 20, "errors": 0, "tau_mean": tau, "tau_median": tau,
                                     "tau_pooled": tau + 0.01, "steps": 100}}}
              for size, index in zip((10, 20, 40, 80), range(4))
              for series, steps in (("equal steps", 50), ("equal epochs", 1 + size // 4))
              for tau in [taus[series][index]]]
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"settings": {}, "sizes": [10, 20, 40, 80], "prompts": {"humaneval": 20}, "points": points}))
    png, table = tmp_path / "fig" / "tau.png", tmp_path / "tau.md"
    done = quality_run("plot", str(curve), "--png", str(png), "--table", str(table))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    text = table.read_text()
    assert "| equal steps | 20 | 50 | 1.50 / 1.51 |" in text
    assert "- equal steps, humaneval: τ flattens at 20 rows" in text  # 20 -> 40 adds 0.03
    assert "- equal epochs, humaneval: τ flattens at 40 rows" in text  # 10 -> 20 and 20 -> 40 add 0.10 each
    assert text in done.stdout + "\n"


def earlier_answers(path: Path, count: int) -> Path:
    """Answers an earlier run wrote (what --answers-from imports)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"e{i:02d}", "messages": [
        {"role": "user", "content": f"Tell me fact number {i} about ships."},
        {"role": "assistant", "content": f"Ship fact {i}: " + "the hull keeps the water out. " * 6}],
        "finish_reason": "stop", "completion_tokens": 60}) + "\n" for i in range(count)))
    return path


@pytest.mark.timeout(900)
def test_answers_from_an_earlier_run_are_imported_and_train_through_the_pipeline(files, tmp_path):
    """Answers an earlier run made (a .tar.xz of them, as packed for a carry limit) are imported
    byte for byte and given to `pipeline --data`: no prompts, self-prompts or regenerate stage
    runs. An archive cut short fails the call."""
    earlier = earlier_answers(tmp_path / "earlier" / "answers.jsonl", 8)
    packed = tmp_path / "earlier" / "answers.tar.xz"  # packed by hand with xz, to fit a carry limit
    with tarfile.open(packed, "w:xz") as archive:
        archive.add(earlier, arcname="answers.jsonl")
    work = tmp_path / "work"
    args = base_args(files, work, "--answers-from", str(packed), "--smoke", "--steps", "3", "--eval-limit", "1",
                     "--speed-limit", "1", "--max-new-tokens", "8")
    done = quality_run(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (work / "answers.jsonl").read_bytes() == earlier.read_bytes()
    book = json.loads((work / "pipeline" / "stages.json").read_text())
    assert list(book) == ["train", "export", "eval"] and all(entry["done"] for entry in book.values())
    assert book["train"]["settings"]["data"] == str((work / "answers.jsonl").resolve())
    cut = tmp_path / "cut.tar.xz"
    cut.write_bytes(packed.read_bytes()[:-100])  # an archive cut short
    failed = quality_run(*base_args(files, tmp_path / "work2", "--answers-from", str(cut), "--smoke"))
    assert failed.returncode == 1 and "not a readable archive of" in failed.stdout


@pytest.mark.slow
def test_curve_stage_trains_and_evaluates_each_point_then_plots(files, tmp_path):
    work = tmp_path / "work"
    earlier = earlier_answers(tmp_path / "earlier" / "answers.jsonl", 6)
    args = base_args(files, work, "--answers-from", str(earlier), "--smoke", "--stages", "curve", "--curve-sizes", "2,6",
                     "--curve-steps", "3", "--curve-epochs", "2", "--curve-limit", "1", "--eval-procs-per-device", "1",
                     "--max-new-tokens", "8")
    done = quality_run(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    curve = json.loads((work / "curve.json").read_text())
    assert [(p["series"], p["rows"], p["steps"]) for p in curve["points"]] == [
        ("equal steps", 2, 3), ("equal epochs", 2, 2), ("equal steps", 6, 3), ("equal epochs", 6, 6)]
    for point in curve["points"]:
        assert set(point["tau"]) == {"dev", "humaneval", "mtbench_odd"}
        assert all(s["prompts"] == 1 and s["tau_mean"] >= 1 for s in point["tau"].values())
        assert json.loads((Path(point["run"]) / "trained.json").read_text())["steps_done"] == point["steps"]
    two = rows(work / "curve" / "data-2.jsonl")
    assert len(two) == 2 and [r for r in rows(earlier) if r in two] == two  # drawn from the answers, in their order
    assert (work / "answers.jsonl").read_bytes() == earlier.read_bytes()
    assert "| equal epochs | 6 | 6 |" in done.stdout
    again = quality_run(*args)
    assert again.returncode == 0 and "curve: done in an earlier call" in again.stdout


def recipe_args(files, work: Path, earlier: Path, *extra: str) -> list[str]:
    return base_args(files, work, "--answers-from", str(earlier), "--smoke", "--stages", "recipe",
                     "--recipe-variants", "loss=decay", "--recipe-rows", "5", "--recipe-steps", "3",
                     "--recipe-limit", "1", "--eval-procs-per-device", "1", "--max-new-tokens", "8", *extra)


@pytest.mark.timeout(900)
def test_recipe_stage_trains_every_variant_in_one_run_and_ranks_them_on_dev(files, tmp_path):
    work = tmp_path / "work"
    earlier = earlier_answers(tmp_path / "earlier" / "answers.jsonl", 6)
    args = recipe_args(files, work, earlier)
    done = quality_run(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    recipe = json.loads((work / "recipe.json").read_text())
    assert [(v["name"], v["overrides"]) for v in recipe["variants"]] == [("base", {}), ("loss-decay", {"loss": "decay"})]
    run = work / "recipe" / "run"
    trained = {}
    for variant in recipe["variants"]:
        assert variant["tau"]["prompts"] == 1 and variant["tau"]["tau_mean"] >= 1
        assert variant["accuracy"] is not None
        trained[variant["name"]] = json.loads((run / variant["name"] / "run.json").read_text())["train_config"]
        assert (run / variant["name"] / "export" / "config.json").is_file()
    assert [trained[n]["loss"] for n in trained] == ["dpace", "decay"]  # base is the measured recipe, D-PACE
    assert {t["steps"] for t in trained.values()} == {3} and len({t["data"][0] for t in trained.values()}) == 1
    drawn = rows(Path(trained["base"]["data"][0]))  # one file for every variant: equal data by construction
    assert len(drawn) == 5 and all(r in rows(earlier) for r in drawn)
    assert "| loss-decay |" in out and "best on dev: " in out
    assert all(len(v["tau_by_prompt"]) == 1 for v in recipe["variants"])  # the pairing's input: one dev prompt each
    assert re.search(r"\| loss-decay \|[^|]*\|[^|]*\|[^|]*\| [+-]\d\.\d\d ± 0\.00 \([01] / [01] of 1\) \|", out), out
    again = quality_run(*args)
    assert again.returncode == 0 and "recipe: done in an earlier call" in again.stdout


@pytest.mark.timeout(900)
def test_recipe_stage_with_arch_dflash2_sweeps_the_selector_weight(files, tmp_path):
    """--arch dflash2 makes the base a DFlash2 drafter, so `selector_weight=K` variants sweep its weight."""
    work = tmp_path / "work"
    earlier = earlier_answers(tmp_path / "earlier" / "answers.jsonl", 6)
    done = quality_run(*recipe_args(files, work, earlier, "--arch", "dflash2", "--recipe-variants", "selector_weight=2.0"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recipe = json.loads((work / "recipe.json").read_text())
    assert [v["name"] for v in recipe["variants"]] == ["base", "selector_weight-2.0"]
    run = work / "recipe" / "run"
    trained = [json.loads((run / v["name"] / "run.json").read_text())["train_config"] for v in recipe["variants"]]
    assert [(c["arch"], c["selector_weight"]) for c in trained] == [("dflash2", 1.0), ("dflash2", 2.0)]
    for variant in recipe["variants"]:
        exported = json.loads((run / variant["name"] / "export" / "config.json").read_text())
        assert exported["architectures"] == ["DFlash2DraftModel"] and variant["tau"]["tau_mean"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recipe_stage_in_turn_gives_every_variant_the_weights_of_one_variants_run(files, tmp_path):
    """--recipe-mode sequential (the fallback where one variants run cannot be used): each variant
    is its own run on the same rows, and each drafter ends with the weights variants mode gave
    it (same rows, order, seed and steps; float32 on the CPU). Slow (two recipe stages); the
    product's half of it, a variants run equals each variant's own run, is
    test_train_workers.py::test_each_variant_ends_with_the_weights_of_its_own_run in the default suite."""
    from safetensors.torch import load_file

    earlier = earlier_answers(tmp_path / "earlier" / "answers.jsonl", 6)
    work, in_turn = tmp_path / "work", tmp_path / "in-turn"
    done = quality_run(*recipe_args(files, work, earlier))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = work / "recipe" / "run"
    done = quality_run(*recipe_args(files, in_turn, earlier, "--recipe-mode", "sequential"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "variant base (1 of 2)" in done.stdout and "variant loss-decay (2 of 2)" in done.stdout
    assert sorted(json.loads((in_turn / "recipe" / "in-turn.json").read_text())) == ["base", "loss-decay"]
    for name in ("base", "loss-decay"):
        alone = load_file(str(in_turn / "recipe" / "run" / name / "export" / "model.safetensors"))
        together = load_file(str(run / name / "export" / "model.safetensors"))
        assert alone.keys() == together.keys()
        for key in alone:
            torch.testing.assert_close(alone[key], together[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.gpu
def test_stages_on_a_gpu_with_the_static_speed_decoder(files, tmp_path):
    """The smoke run on CUDA: training with compile and CUDA graphs, tau and the speed eval with
    the static decoder (the device the lead runs the real thing on)."""
    work = tmp_path / "work"
    args = base_args(files, work, "--samples", "6", "--smoke", "--steps", "20", "--eval-limit", "2",
                     "--speed-limit", "2", "--max-new-tokens", "12")
    args[args.index("cpu")] = "cuda:0"
    done = quality_run(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    speed = json.loads((work / "pipeline" / "speed.json").read_text())["benchmarks"]["humaneval"]["summary"]
    assert speed["compared"] == 2 and speed["errors"] == 0 and speed["speedup"] is not None
