"""bench/quality_run.py on a CPU with a real (tiny, random) Llama behind SmolLM2's real tokenizer
and chat template: its stages really regenerate, train, export and decode, stop at their time
boxes and resume on the next call; bad arguments fail in one line before any model loads."""

import importlib
import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest
import torch

from test_regenerate import tiny_smollm_dir


@pytest.fixture(scope="module")
def script():
    return importlib.import_module("bench.quality_run")


@pytest.fixture(scope="module")
def files(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quality_run")
    target = tiny_smollm_dir(smollm2_dir, root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i:02d}", "prompt": f"Tell me fact number {i} about ships."}) + "\n"
                               for i in range(40)))
    dev = root / "dev.jsonl"
    dev.write_text("".join(json.dumps({"id": f"d{i}", "prompt": f"Explain item {i} of a list of rivers."}) + "\n"
                           for i in range(3)))
    return {"target": target, "prompts": prompts, "dev": dev}


def base_args(files, work, *extra):
    return ["run", "--target", str(files["target"]), "--prompts", str(files["prompts"]), "--dev-prompts",
            str(files["dev"]), "--work", str(work), "--device", "cpu", "--min-stage-seconds", "0", *extra]


def restore_parts(folder: Path, name: str, into: Path) -> Path:
    """What `cat NAME.part* | tar -xz` gives."""
    parts = sorted(folder.glob(f"{name}.part*"))
    assert parts, f"no {name}.part* in {folder}"
    into.mkdir()
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:gz") as archive:
        archive.extractall(into, filter="data")
    return into


def test_send_back_cuts_a_folder_into_parts_that_restore_it(script, tmp_path):
    source = tmp_path / "export"
    source.mkdir()
    (source / "model.safetensors").write_bytes(os.urandom(70_000))  # incompressible: several parts
    (source / "config.json").write_text('{"a": 1}')
    parts = script.send_back(source, tmp_path / "out", "train-export.tar.gz", limit=16_384)
    assert len(parts) >= 4 and all(p.stat().st_size <= 16_384 for p in parts)
    back = restore_parts(tmp_path / "out", "train-export.tar.gz", tmp_path / "back") / "export"
    assert {f.name: f.read_bytes() for f in back.iterdir()} == {f.name: f.read_bytes() for f in source.iterdir()}
    # Again into the same folder (a retried call): the old parts are replaced, not mixed in.
    (source / "model.safetensors").write_bytes(b"small")
    assert len(script.send_back(source, tmp_path / "out", "train-export.tar.gz", limit=16_384)) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train-export.tar.gz.part00"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_regenerate_stopped_at_its_box_resumes_without_losing_or_repeating_a_row(script, files, tmp_path, capsys):
    # Answers one at a time: 40 x 160 tokens take longer than a box after loading (a fresh CI
    # clone wrote all 40 x 96 inside a 12 s box once). Loading takes 2-7 s on a shared CPU, so a
    # box may end before the first row: then the next call gets a longer box (calls of a chain),
    # in small steps, until one stops mid-run with rows written.
    args = base_args(files, tmp_path / "work", "--samples", "40", "--stages", "regenerate", "--max-new-tokens", "160",
                     "--regen-batch-size", "1")
    answers = tmp_path / "work" / "answers.jsonl"
    partial: list[dict] = []
    for box in (6, 9, 12, 18, 24):
        assert script.main([*args, "--regen-seconds", str(box)]) == script.NOT_FINISHED, "finished inside the box"
        out = capsys.readouterr().out
        assert f"regenerate: box of {box}s reached, stopping it" in out and "the next call resumes" in out
        written = rows(answers) if answers.exists() else []  # a box that ended while loading wrote no file yet
        assert written[: len(partial)] == partial  # rows of earlier calls stay as they were
        partial = written
        if partial:
            break
    assert 0 < len(partial) < 40, f"no box stopped regenerate mid-run ({len(partial)} rows)"
    assert script.main(args) == 0  # the same command without a box finishes
    out = capsys.readouterr().out
    assert f"resumed     {len(partial)} rows were already in the output" in out
    finished = rows(answers)
    assert sorted(r["id"] for r in finished) == [f"p{i:02d}" for i in range(40)]  # none lost, none twice
    assert finished[: len(partial)] == partial
    book = json.loads((tmp_path / "work" / "stages.json").read_text())["regenerate"]
    assert book["done"] and book["rows"] == 40 and book["seconds"] > 6
    assert "accounting  input 40 = ok 40 + failed 0 + skipped 0" in book["summary"]


def test_answers_from_an_earlier_run_are_imported_from_its_sent_back_parts(script, files, tmp_path, capsys):
    """The parts an earlier call sent back (several, by a small part size) are the regenerate
    stage: WORK/answers.jsonl is their file byte for byte, --prompts is not needed, nothing is
    generated or sent back again, and a rerun skips the stage. A broken archive fails the stage."""
    earlier = tmp_path / "earlier" / "answers.jsonl"
    earlier.parent.mkdir()
    earlier.write_text("".join(json.dumps({"id": f"p{i:02d}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": os.urandom(900).hex()}],
        "finish_reason": "stop", "completion_tokens": 300 + i}) + "\n" for i in range(12)))
    parts = script.send_back(earlier, tmp_path / "back", "regenerate-answers.jsonl.tar.gz", limit=8_192)
    assert len(parts) >= 2
    work = tmp_path / "work"
    args = ["run", "--target", str(files["target"]), "--work", str(work), "--device", "cpu", "--min-stage-seconds", "0",
            "--samples", "12", "--stages", "regenerate", "--answers-from", str(parts[0]), "--json-dir", str(tmp_path / "json")]
    assert script.main(args) == 0
    out = capsys.readouterr().out
    assert "regenerate: done: imported 12 rows (3666 generated tokens)" in out
    assert (work / "answers.jsonl").read_bytes() == earlier.read_bytes()
    book = json.loads((work / "stages.json").read_text())["regenerate"]
    assert book["done"] and book["rows"] == 12 and book["imported"] == str(parts[0].resolve())
    assert not list((tmp_path / "json").glob("regenerate-answers*"))  # not sent back a second time
    assert script.main(args) == 0 and "regenerate: done in an earlier call" in capsys.readouterr().out

    parts[-1].write_bytes(parts[-1].read_bytes()[:-100])  # a part cut short
    args[args.index(str(work))] = str(tmp_path / "work2")
    assert script.main(args) == 1
    assert "not a readable archive of" in capsys.readouterr().out
    (tmp_path / "earlier" / "notes.txt").write_text("not answers")
    assert script.main([*args[:-4], "--answers-from", str(tmp_path / "earlier" / "notes.txt")]) == 2
    assert "a .jsonl, a .tar.gz, a .tar.xz or a .partNN file of one" in capsys.readouterr().err

    packed = tmp_path / "earlier" / "answers.tar.xz"  # packed by hand with xz, to fit a carry limit
    with tarfile.open(packed, "w:xz") as archive:
        archive.add(earlier, arcname="answers.jsonl")
    args[args.index(str(tmp_path / "work2"))] = str(tmp_path / "work3")
    assert script.main([*args[:-4], "--answers-from", str(packed)]) == 0
    assert (tmp_path / "work3" / "answers.jsonl").read_bytes() == earlier.read_bytes()


def test_stages_train_resume_export_and_evaluate_then_a_rerun_skips_them(script, files, tmp_path, capsys):
    work = tmp_path / "work"
    args = base_args(files, work, "--samples", "6", "--smoke", "--steps", "80", "--dev-limit", "2", "--eval-limit", "2",
                     "--speed-limit", "1", "--eval-procs-per-device", "1", "--max-new-tokens", "12",
                     "--speed-decoder", "auto", "--json-dir", str(tmp_path / "json"))
    # First call: training stops at its 3 s box (loading included), so eval has nothing to evaluate.
    assert script.main([*args, "--train-seconds", "3"]) == script.NOT_FINISHED
    out = capsys.readouterr().out
    assert "regenerate: done: 6 rows" in out and "of 80 after" in out and "eval: waiting: train is not done yet" in out
    stopped_at = json.loads((work / "stages.json").read_text())["train"]["steps_done"]
    assert 0 < stopped_at < 80 and not (work / "run" / "export").exists()
    answers = (work / "answers.jsonl").read_bytes()
    # The call that finished regenerate sent the answers back with its other files.
    restored = restore_parts(tmp_path / "json", "regenerate-answers.jsonl.tar.gz", tmp_path / "back1")
    assert (restored / "answers.jsonl").read_bytes() == answers

    assert script.main(args) == 0
    out = capsys.readouterr().out
    export = restore_parts(tmp_path / "json", "train-export.tar.gz", tmp_path / "back2") / "export"
    assert sorted(f.name for f in export.iterdir()) == sorted(f.name for f in (work / "run" / "export").iterdir())
    assert all(f.read_bytes() == (work / "run" / "export" / f.name).read_bytes() for f in export.iterdir())
    assert "regenerate: done in an earlier call" in out
    assert f"resuming from step {stopped_at}" in out and "train: done: 80 steps" in out
    results = json.loads((work / "results.json").read_text())
    line = "quality SmolLM2 0.006k: tau humaneval {:.2f}, mtbench {:.2f}, speed-up humaneval {:.2f}x".format(
        results["tau"]["humaneval"]["tau_mean"], results["tau"]["mtbench_odd"]["tau_mean"],
        results["speed"]["humaneval"]["speedup"])
    assert results["line"] == line and line in out.splitlines()
    # N counts the rows the drafter learned from (the trainer's own count), not the answers written.
    trained_on = json.loads((work / "stages.json").read_text())["train"]["training_rows"]
    assert results["rows"] == trained_on and 0 < trained_on <= results["answers"] == 6
    assert set(results["tau"]) == {"dev", "humaneval", "mtbench_odd", "math500"}
    assert all(s["prompts"] == 2 and s["errors"] == 0 and s["tau_mean"] >= 1 for s in results["tau"].values())
    speed = results["speed"]["humaneval"]
    assert speed["compared"] == 1 and speed["identical_to_baseline"] == 1 and speed["baseline_tokens_per_s"] > 0
    assert results["stage_seconds"]["train"] > 3 and "regenerate + train" in out
    assert f"training rows {trained_on} (of 6 answers to 6 prompts)" in out

    imported = {**results, "samples": None, "answers": 140, "answers_imported_from": "earlier.tar.xz",
                "answers_imported_rows": 100}  # the screen of a run on imported answers: no prompt count
    assert f"training rows {trained_on} (of 140 answers, 100 of them imported)" in script.results_screen(imported)[1]
    assert json.loads((tmp_path / "json" / "results.json").read_text()) == results

    assert script.main(args) == 0  # a third call finds everything done and redoes nothing
    out = capsys.readouterr().out
    assert all(f"{stage}: done in an earlier call" in out for stage in ("regenerate", "train", "eval"))
    assert "loading target" not in out and (work / "answers.jsonl").read_bytes() == answers


def test_self_prompts_stage_spreads_the_targets_own_requests_through_the_prompts_regenerate_answers(
        script, files, smollm2_dir, tmp_path, capsys, monkeypatch):
    """The real SmolLM2 target (a random one writes no request that ends): 2 of the 6 prompts are
    its own, in place of the last 2 of --prompts, spread evenly; a rerun redoes nothing."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the stages' subprocesses: see conftest's one_thread
    work = tmp_path / "work"
    args = ["run", "--target", str(smollm2_dir), "--prompts", str(files["prompts"]), "--work", str(work),
            "--device", "cpu", "--min-stage-seconds", "0", "--samples", "6", "--smoke", "--stages", "regenerate",
            "--self-prompts", "2", "--self-prompt-tokens", "40", "--json-dir", str(tmp_path / "json")]
    assert script.main(args) == 0
    out = capsys.readouterr().out
    assert "self-prompts: done: 2 self-written requests" in out and "regenerate: done: 6 rows" in out
    own = rows(work / "self-prompts.jsonl")
    assert [r["source"] for r in own] == ["self-prompts"] * 2
    mixed = [r["id"] for r in rows(work / "prompts-mixed.jsonl")]
    # spread: the 4 prompts at (k + 0.5) / 4, the 2 own ones at (k + 0.5) / 2
    assert mixed == ["p00", own[0]["id"], "p01", "p02", own[1]["id"], "p03"]
    assert sorted(r["id"] for r in rows(work / "answers.jsonl")) == sorted(mixed)
    book = json.loads((work / "stages.json").read_text())
    assert book["self-prompts"]["done"] and book["self-prompts"]["rows"] == 2
    assert book["self-prompts"]["mixed"] == {"file": str(work / "prompts-mixed.jsonl"), "rows": 6, "from_prompts": 4,
                                             "self_written": 2}
    assert "accounting  generated" in book["self-prompts"]["summary"]
    assert book["regenerate"]["settings"]["self_prompts"] == 2
    restored = restore_parts(tmp_path / "json", "self-prompts-self-prompts.jsonl.tar.gz", tmp_path / "back")
    assert (restored / "self-prompts.jsonl").read_bytes() == (work / "self-prompts.jsonl").read_bytes()

    assert script.main(args) == 0
    out = capsys.readouterr().out
    assert "self-prompts: done in an earlier call" in out and "regenerate: done in an earlier call" in out
    # Another number of self-written prompts would change what was answered: refused.
    assert script.main([*args[:-4], "--self-prompts", "3"]) == 2
    assert "stage self-prompts was started with other settings" in capsys.readouterr().err


def earlier_answers(path: Path, ids: list[str]) -> Path:
    """Rows as an earlier run's regenerate wrote them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": row_id, "messages": [
        {"role": "user", "content": f"question {row_id}"}, {"role": "assistant", "content": os.urandom(900).hex()}],
        "finish_reason": "stop", "completion_tokens": 300}) + "\n" for row_id in ids))
    return path


def test_answers_from_with_self_prompts_answers_only_the_self_written_ones_and_trains_on_both(
        script, files, smollm2_dir, tmp_path, capsys, monkeypatch):
    """self-prompts writes 2 requests (the real SmolLM2 target); regenerate imports the 12 earlier
    answers from their sent-back parts, answers only the 2 self-written prompts (no mixed prompts
    file, --prompts not needed), and WORK/answers.jsonl is the imported rows + those 2, ids
    distinct. A call that ends between the answers and that file resumes the answers (none
    regenerated) and writes the same file; a later call redoes nothing."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the stages' subprocesses: see conftest's one_thread
    earlier = earlier_answers(tmp_path / "earlier" / "answers.jsonl", [f"p{i:02d}" for i in range(12)])
    parts = script.send_back(earlier, tmp_path / "back", "regenerate-answers.jsonl.tar.gz", limit=8_192)
    work, json_dir = tmp_path / "work", tmp_path / "json"
    args = ["run", "--target", str(smollm2_dir), "--work", str(work), "--device", "cpu", "--min-stage-seconds", "0",
            "--smoke", "--stages", "regenerate", "--answers-from", str(parts[0]), "--self-prompts", "2",
            "--self-prompt-tokens", "40", "--json-dir", str(json_dir)]
    assert script.main(args) == 0
    out = capsys.readouterr().out
    assert "self-prompts: done: 2 self-written requests" in out
    assert "regenerate: done: 12 imported + 2 self-answered rows" in out
    own = [r["id"] for r in rows(work / "self-prompts.jsonl")]
    assert sorted(r["id"] for r in rows(work / "self-answers.jsonl")) == sorted(own)
    assert (work / "answers-imported.jsonl").read_bytes() == earlier.read_bytes()
    combined = (work / "answers.jsonl").read_bytes()
    assert combined == earlier.read_bytes() + (work / "self-answers.jsonl").read_bytes()
    ids = [r["id"] for r in rows(work / "answers.jsonl")]
    assert len(ids) == 14 == len(set(ids)) and set(own) < set(ids)
    assert not (work / "prompts-mixed.jsonl").exists()
    book = json.loads((work / "stages.json").read_text())
    entry = book["regenerate"]
    assert entry["done"] and (entry["imported_rows"], entry["self_rows"], entry["rows"]) == (12, 2, 14)
    assert entry["imported"] == str(parts[0].resolve()) and "import_seconds" in entry
    assert "imported 12 rows (3600 generated tokens)" in entry["summary"]
    assert "their seconds are in that run's stages.json" in entry["summary"]
    assert "accounting  input 2 = ok 2 + failed 0 + skipped 0" in entry["summary"]
    assert entry["settings"]["self_prompts"] == 2 and entry["settings"]["answers_from"] == str(parts[0].resolve())
    assert "mixed" not in book["self-prompts"]
    # The new answers go back with the call (the imported ones came from there already).
    restored = restore_parts(json_dir, "regenerate-self-answers.jsonl.tar.gz", tmp_path / "restored")
    assert (restored / "self-answers.jsonl").read_bytes() == (work / "self-answers.jsonl").read_bytes()
    assert not list(json_dir.glob("regenerate-answers*"))

    # As if the call had ended after regenerate finished but before the training file was written.
    entry["done"] = False
    (work / "stages.json").write_text(json.dumps(book))
    (work / "answers.jsonl").unlink()
    assert script.main(args) == 0
    out = capsys.readouterr().out
    assert "self-prompts: done in an earlier call" in out and "resumed     2 rows were already in the output" in out
    assert "rows (+0 in" in out and (work / "answers.jsonl").read_bytes() == combined
    assert script.main(args) == 0 and "regenerate: done in an earlier call" in capsys.readouterr().out


def test_an_imported_row_with_the_id_of_a_self_written_prompt_fails_before_regenerate(script, files, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "self-prompts.jsonl").write_text("".join(json.dumps({"id": f"self/0/{n}", "source": "self-prompts", "messages": [
        {"role": "user", "content": f"Write a poem about lake {n}."}]}) + "\n" for n in range(2)))
    earlier = earlier_answers(tmp_path / "earlier.jsonl", ["p00", "self/0/1", "p01"])
    args = ["run", "--target", str(files["target"]), "--work", str(work), "--device", "cpu", "--min-stage-seconds", "0",
            "--stages", "regenerate", "--answers-from", str(earlier), "--self-prompts", "2"]
    assert script.main(args) == 1
    out = capsys.readouterr().out
    assert "row id 'self/0/1' is also the id of a self-written prompt" in out
    assert not (work / "self-answers.jsonl").exists() and not (work / "answers.jsonl").exists()


def test_without_self_prompts_the_stages_record_what_they_did_before(script, files, tmp_path):
    config = script.parse_run([*base_args(files, tmp_path / "work")[1:], "--samples", "6"])
    assert config.stages == ["regenerate", "train", "eval"] and config.training_prompts == str(files["prompts"])
    assert "self_prompts" not in script.stage_settings(config, "regenerate")  # old work folders stay resumable
    command = script.regenerate_command(script.Call(config, script.StageBook(tmp_path / "s.json"), 0.0),
                                        config.training_prompts, config.samples, config.answers)
    assert command[command.index("--prompts") + 1] == str(files["prompts"])
    # A book an older version wrote (no optional settings recorded) is resumed with the same flags.
    work = tmp_path / "work"
    work.mkdir()
    (work / "stages.json").write_text(json.dumps({stage: {"settings": script.stage_settings(config, stage), "done": False,
                                                          "calls": 1, "seconds": 3.0} for stage in config.stages}))
    assert script.main([*base_args(files, work), "--samples", "6", "--stages", "train,eval"]) == script.NOT_FINISHED


def test_a_work_folder_of_imported_plus_self_written_answers_refuses_other_flags(script, files, tmp_path):
    """Both flags are recorded with the stages they shape; giving either one alone later (or a
    new --self-prompts alone on an old imported folder) is refused, as any other changed flag."""
    answers = tmp_path / "earlier.jsonl"
    answers.write_text('{"id": "a0", "messages": []}\n')
    work = tmp_path / "work"
    both = [*base_args(files, work)[1:], "--answers-from", str(answers), "--self-prompts", "2", "--stages", "regenerate"]
    book = script.StageBook(work / "stages.json")
    for stage in ("self-prompts", "regenerate"):
        book.entry(stage, script.parse_run(both))
    work.mkdir()
    book.save()
    script.StageBook(work / "stages.json").check(script.parse_run(both))  # the same flags resume
    import_only = [a for a in both if a not in ("--self-prompts", "2")]
    with pytest.raises(script.ConfigError, match=r"stage regenerate was started with other settings \(--self-prompts 2 "
                                                  r"then, 0 now\)"):
        script.StageBook(work / "stages.json").check(script.parse_run(import_only))
    self_only = both[:both.index("--answers-from")] + both[both.index("--self-prompts"):]
    with pytest.raises(script.ConfigError, match=r"--answers-from '.*earlier.jsonl' then, '' now"):
        script.StageBook(work / "stages.json").check(script.parse_run(self_only))


def test_bad_arguments_fail_in_one_line_before_anything_loads(script, files, tmp_path, capsys):
    work = tmp_path / "work"
    bad_dev = tmp_path / "bad_dev.jsonl"
    bad_dev.write_text('{"id": "d0", "prompt": "fine"}\nnot json\n')
    (tmp_path / "half.gguf").write_bytes(b"")
    cases = {
        "unfinished gguf": (["--target", str(tmp_path / "half.gguf")], "half.gguf: not a GGUF file (0 bytes"),
        "--stages": (["--stages", "regenerate,trian"], "--stages regenerate,trian: use some of"),
        "missing prompts": (["--prompts", str(tmp_path / "nope.jsonl")], "nope.jsonl: no such file"),
        "samples": (["--samples", "0"], "--samples must be at least 1"),
        "loss": (["--loss", "mse"], "--loss 'mse': use decay or dpace"),
        "curve sizes": (["--stages", "curve", "--samples", "10", "--curve-sizes", "5,20", "--curve-steps", "3"],
                        "20 rows is more than --samples 10"),
        "unknown flag": (["--sampels", "3"], "unknown argument '--sampels'"),
        "recipe": (["--lr", "-1"], "--lr must be > 0 (got -1.0)"),
        "bad dev row": (["--dev-prompts", str(bad_dev)], "bad_dev.jsonl:2: invalid JSON"),
        "self prompts": (["--samples", "4", "--self-prompts", "5"], "--self-prompts must be in 0..--samples 4"),
        "self-prompts stage": (["--stages", "self-prompts"], "the self-prompts stage needs --self-prompts N > 0"),
    }
    for name, (extra, message) in cases.items():
        assert script.main([*base_args(files, work), *extra]) == 2, name
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (name, err)
    assert not work.exists()  # nothing was started
    no_dev = [a for a in base_args(files, work) if a not in ("--dev-prompts", str(files["dev"]))]
    assert script.main(no_dev) == 2 and "--dev-prompts is required" in capsys.readouterr().err
    # --answers-from with --self-prompts: N is not bounded by --samples, but not negative; and the
    # imported file may not be one this run writes in the work folder.
    earlier = earlier_answers(tmp_path / "other" / "answers.jsonl", ["a0"])
    for extra, message in ((["--self-prompts", "-1"], "--self-prompts must be >= 0, got -1"),
                           (["--self-prompts", "2", "--work", str(earlier.parent)], "a file this run writes in --work")):
        assert script.main([*base_args(files, work), "--answers-from", str(earlier), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (extra, err)
    config = script.parse_run([*base_args(files, work)[1:], "--answers-from", str(earlier), "--samples", "3",
                               "--self-prompts", "5"])
    assert config.stages == ["self-prompts", "regenerate", "train", "eval"] and config.imported_plus_self
    assert not work.exists()
    # A stage started with some settings refuses others (its results would mix the two).
    work.mkdir()
    started = script.parse_run([*base_args(files, work)[1:], "--samples", "6", "--stages", "regenerate"])
    book = script.StageBook(work / "stages.json")
    book.entry("regenerate", started)
    book.save()
    assert script.main([*base_args(files, work), "--samples", "7", "--stages", "regenerate"]) == 2
    err = capsys.readouterr().err
    assert "stage regenerate was started with other settings (--samples 6 then, 7 now);" in err
    assert script.main(["plot", str(tmp_path / "none.json"), "--png", str(tmp_path / "x.png")]) == 2
    assert "none.json: no such curve file" in capsys.readouterr().err


def test_plot_writes_a_png_and_a_table_with_where_tau_flattens(script, files, tmp_path, capsys):
    config = script.parse_run(base_args(files, tmp_path / "work", "--stages", "curve", "--samples", "100",
                                        "--curve-sizes", "10,20,40,80", "--curve-steps", "50", "--curve-epochs", "2")[1:])
    points = script.curve_points(config, batch_size=8)
    assert [(p["series"], p["rows"], p["steps"]) for p in points[:4]] == [
        ("equal steps", 10, 50), ("equal epochs", 10, 3), ("equal steps", 20, 50), ("equal epochs", 20, 5)]
    taus = {"equal steps": [1.20, 1.50, 1.53, 1.54], "equal epochs": [1.10, 1.20, 1.30, 1.32]}
    for point in points:
        tau = taus[point["series"]][config.curve_sizes.index(point["rows"])]
        point["tau"] = {"humaneval": {"prompts": 20, "errors": 0, "tau_mean": tau, "tau_median": tau,
                                      "tau_pooled": tau + 0.01, "steps": 100}}
    curve = tmp_path / "curve.json"
    script.write_curve(curve, config, points, {"humaneval": 20})
    png, table = tmp_path / "fig" / "tau.png", tmp_path / "tau.md"
    assert script.main(["plot", str(curve), "--png", str(png), "--table", str(table)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    text = table.read_text()
    assert "| equal steps | 20 | 50 | 1.50 / 1.51 |" in text
    assert "- equal steps, humaneval: τ flattens at 20 rows" in text  # 20 -> 40 adds 0.03
    assert "- equal epochs, humaneval: τ flattens at 40 rows" in text  # 10 -> 20 and 20 -> 40 add 0.10 each
    assert text in capsys.readouterr().out + "\n"


@pytest.mark.slow
def test_curve_stage_trains_and_evaluates_each_point_then_plots(script, files, tmp_path, capsys):
    work = tmp_path / "work"
    args = base_args(files, work, "--samples", "6", "--smoke", "--stages", "regenerate,curve", "--curve-sizes", "2,6",
                     "--curve-steps", "3", "--curve-epochs", "2", "--curve-limit", "1", "--eval-procs-per-device", "1",
                     "--max-new-tokens", "8")
    assert script.main(args) == 0
    out = capsys.readouterr().out
    curve = json.loads((work / "curve.json").read_text())
    assert [(p["series"], p["rows"], p["steps"]) for p in curve["points"]] == [
        ("equal steps", 2, 3), ("equal epochs", 2, 2), ("equal steps", 6, 3), ("equal epochs", 6, 6)]
    for point in curve["points"]:
        assert set(point["tau"]) == {"dev", "humaneval", "mtbench_odd"}
        assert all(s["prompts"] == 1 and s["tau_mean"] >= 1 for s in point["tau"].values())
        trained = json.loads((Path(point["run"]) / "trained.json").read_text())
        assert trained["steps_done"] == point["steps"]
    answers = rows(work / "answers.jsonl")
    two = rows(work / "curve" / "data-2.jsonl")
    assert len(two) == 2 and [r for r in answers if r in two] == two  # drawn from the answers, in their order
    assert "| equal epochs | 6 | 6 |" in out
    assert script.main(args) == 0 and "curve: done in an earlier call" in capsys.readouterr().out
    png = tmp_path / "curve.png"
    assert script.main(["plot", str(work / "curve.json"), "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_sampled_rows_are_a_seeded_nested_draw_in_file_order(script, tmp_path):
    """The answers come grouped by prompt source, so a curve point's rows are drawn, not cut from the front."""
    source = tmp_path / "answers.jsonl"
    source.write_text("".join(json.dumps({"row": i}) + "\n" for i in range(100)))
    small = rows(script.sampled_rows(source, 10, tmp_path / "data-10.jsonl"))
    large = rows(script.sampled_rows(source, 40, tmp_path / "data-40.jsonl"))
    indices = [r["row"] for r in small]
    assert len(small) == 10 and len(large) == 40 and all(r in large for r in small)  # nested
    assert indices == sorted(indices) and indices != list(range(10))  # file order, not the front
    assert len({r["row"] for r in large}) == 40
    assert rows(script.sampled_rows(source, 10, tmp_path / "again-10.jsonl")) == small  # seeded
    assert rows(script.sampled_rows(source, 100, tmp_path / "all.jsonl")) == rows(source)


def test_recipe_stage_trains_every_variant_in_one_run_or_in_turn_and_ranks_them_on_dev(script, files, tmp_path, capsys):
    work = tmp_path / "work"
    args = base_args(files, work, "--samples", "6", "--smoke", "--stages", "regenerate,recipe",
                     "--recipe-variants", "loss=decay", "--recipe-rows", "5", "--recipe-steps", "3",
                     "--recipe-limit", "1", "--eval-procs-per-device", "1", "--max-new-tokens", "8")
    assert script.main(args) == 0
    out = capsys.readouterr().out
    recipe = json.loads((work / "recipe.json").read_text())
    assert [(v["name"], v["overrides"]) for v in recipe["variants"]] == [("base", {}), ("loss-decay", {"loss": "decay"})]
    run = work / "recipe" / "run"
    trained = {}
    for variant in recipe["variants"]:
        assert variant["tau"]["prompts"] == 1 and variant["tau"]["tau_mean"] >= 1
        assert variant["accuracy"] is not None
        trained[variant["name"]] = json.loads((run / variant["name"] / "run.json").read_text())["train_config"]
        assert (run / variant["name"] / "export" / "config.json").is_file()
    assert [trained[n]["loss"] for n in trained] == ["dpace", "decay"]  # base is the chosen recipe, D-PACE
    assert {t["steps"] for t in trained.values()} == {3} and len({t["data"][0] for t in trained.values()}) == 1
    drawn = rows(Path(trained["base"]["data"][0]))  # one file for every variant: equal data by construction
    assert len(drawn) == 5 and all(r in rows(work / "answers.jsonl") for r in drawn)
    assert "| loss-decay |" in out and "best on dev: " in out
    assert all(len(v["tau_by_prompt"]) == 1 for v in recipe["variants"])  # the pairing's input: one dev prompt each
    assert re.search(r"\| loss-decay \|[^|]*\|[^|]*\|[^|]*\| [+-]\d\.\d\d ± 0\.00 \([01] / [01] of 1\) \|", out), out
    assert script.main(args) == 0 and "recipe: done in an earlier call" in capsys.readouterr().out
    for bad, message in ((["--recipe-variants", "colour=red"], "'colour' is not a variant key; use one of block_size"),
                         (["--recipe-variants", "loss"], "--recipe-variants 'loss': write KEY=VALUE"),
                         (["--recipe-variants", "lr=1e-3,lr=1e-3"], "'lr=1e-3': named twice")):
        assert script.main([*args[:args.index("--recipe-variants")], *bad, *args[args.index("--recipe-rows"):]]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert script.main([*args[:args.index("--recipe-variants")], *args[args.index("--recipe-rows"):]]) == 2
    assert "the recipe stage needs --recipe-variants" in capsys.readouterr().err
    # values keep their type (a variant's lr is a float, its depth an int), names say what changed
    variants = script.recipe_variants(["lr=3e-4", "num-layers=3", "gamma=7"])
    assert variants == [{"name": "base"}, {"name": "lr-3e-4", "lr": 3e-4}, {"name": "num_layers-3", "num_layers": 3},
                        {"name": "gamma-7", "gamma": 7.0}]
    assert [type(v[k]) for v, k in zip(variants[1:], ("lr", "num_layers", "gamma"))] == [float, int, float]
    with pytest.raises(script.ConfigError, match="num_layers"):
        script.recipe_variants(["num_layers=deep"])

    # --recipe-mode sequential (the fallback where one variants run cannot be used): each variant
    # is its own run on the same rows, and each drafter ends with the weights variants mode gave
    # it (same rows, order, seed and steps; float32 on the CPU). A rerun loads nothing again.
    from safetensors.torch import load_file

    in_turn = tmp_path / "in-turn"
    sequential = [*base_args(files, in_turn), *args[args.index("--samples"):], "--recipe-mode", "sequential"]
    assert script.main(sequential) == 0
    out = capsys.readouterr().out
    assert "variant base (1 of 2)" in out and "variant loss-decay (2 of 2)" in out and "one run per variant" in out
    recipe = json.loads((in_turn / "recipe.json").read_text())
    assert recipe["mode"] == "sequential" and all(v["tau"]["prompts"] == 1 for v in recipe["variants"])
    assert sorted(json.loads((in_turn / "recipe" / "in-turn.json").read_text())) == ["base", "loss-decay"]
    for name in ("base", "loss-decay"):
        alone = load_file(str(in_turn / "recipe" / "run" / name / "export" / "model.safetensors"))
        together = load_file(str(run / name / "export" / "model.safetensors"))
        assert alone.keys() == together.keys()
        for key in alone:
            torch.testing.assert_close(alone[key], together[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    assert script.main(sequential) == 0 and "recipe: done in an earlier call" in capsys.readouterr().out
    assert script.main([*sequential[:-1], "apart"]) == 2
    err = capsys.readouterr().err
    assert "--recipe-mode 'apart': use variants or sequential" in err and len(err.strip().splitlines()) == 1, err


def test_recipe_variants_are_compared_with_base_prompt_by_prompt(script):
    base = {"a": 2.0, "b": 5.0, "c": 1.0, "d": 3.0}
    other = {"a": 2.5, "b": 5.5, "c": 1.5, "d": 2.5, "only-here": 9.0}
    paired = script.paired_difference(base, other)
    assert paired["prompts"] == 4 and (paired["better"], paired["worse"]) == (3, 1)
    assert paired["mean_difference"] == pytest.approx(0.25)
    assert paired["standard_error"] == pytest.approx(0.25)  # differences +.5 +.5 +.5 −.5: sd 0.5, over √4
    assert script.paired_difference(base, {"x": 1.0}) is None
    recipe = {"rows": 10, "steps": 3, "dev_prompts": 4, "variants": [
        {"name": "base", "tau": {"tau_mean": 2.75, "tau_median": 2.5, "tau_pooled": 2.6}, "tau_by_prompt": base},
        {"name": "lr-1e-3", "tau": {"tau_mean": 3.0, "tau_median": 2.0, "tau_pooled": 2.9}, "tau_by_prompt": other},
        {"name": "loss-dpace"}]}  # not measured yet
    table = script.recipe_table(recipe)
    assert "| lr-1e-3 | 3.00 | 2.00 | 2.90 | +0.25 ± 0.25 (3 / 1 of 4) |" in table[4]
    assert table[3].startswith("| base | 2.75 | 2.50 | 2.60 | – |")  # base against itself: no pairing
    assert table[5].startswith("| loss-dpace | – | – | – | – |")
    assert table[-1] == "best on dev: lr-1e-3 (tau mean 3.00; +0.25 ± 0.25 (3 / 1 of 4) against base on the same prompts)"


@pytest.mark.slow
def test_final_exports_the_last_checkpoint_of_a_stopped_run(script, files, tmp_path, capsys):
    work = tmp_path / "work"
    args = base_args(files, work, "--samples", "6", "--smoke", "--steps", "200", "--stages", "regenerate,train")
    assert script.main([*args, "--train-seconds", "3"]) == script.NOT_FINISHED
    stopped_at = json.loads((work / "stages.json").read_text())["train"]["steps_done"]
    assert script.main([*args, "--final"]) == 0
    assert "train: done (--final): step" in capsys.readouterr().out
    book = json.loads((work / "stages.json").read_text())["train"]
    assert book["done"] and book["steps_done"] == stopped_at < 200
    assert json.loads((work / "run" / "export" / "config.json").read_text())["num_hidden_layers"] == 1  # --smoke


@pytest.mark.gpu
def test_stages_on_a_gpu_with_the_static_speed_decoder(script, files, tmp_path, capsys):
    """The smoke run on CUDA: training with compile and CUDA graphs, tau shards and the speed
    eval with the static decoder (the device the lead runs the real thing on)."""
    work = tmp_path / "work"
    args = base_args(files, work, "--samples", "6", "--smoke", "--steps", "20", "--dev-limit", "2", "--eval-limit", "2",
                     "--speed-limit", "2", "--eval-procs-per-device", "2", "--max-new-tokens", "12")
    args[args.index("cpu")] = "cuda:0"
    assert script.main(args) == 0
    results = json.loads((work / "results.json").read_text())
    assert results["line"] in capsys.readouterr().out
    speed = results["speed"]["humaneval"]
    assert speed["compared"] == 2 and speed["errors"] == 0 and speed["speedup"] is not None
