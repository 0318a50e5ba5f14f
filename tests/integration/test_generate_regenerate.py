"""Regeneration with real models and the real SmolLM2 tokenizer: answers, stop tokens, sampling,
accounting, and resume after a torn write or a kill -9 in a real subprocess."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from data_files import DATA
from tiny import tiny_hf_model

from dflash_train.cli import main as cli_main
from dflash_train.data.readers import Prompt, RowStats, read_conversations, read_prompts
from dflash_train.data.render import render_prompt, stop_token_ids
from dflash_train.data.samples import load_training_samples
from dflash_train.generate.engine import EagerBatchEngine, Generated, StaticBatchEngine, generate_batch, local_engine
from dflash_train.generate.regenerate import GenerationSettings, RegenerateError, regenerate, row_seed, settings_path
from dflash_train.target.model import Target, load_target

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_smollm_dir(smollm2_dir: Path, out: Path, *, layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """A random-init Llama with SmolLM2's real tokenizer, chat template and eos, saved as an HF folder."""
    return save_with_smollm2_tokenizer(tiny_hf_model("llama", vocab=49152, hidden=hidden, layers=layers, seed=seed),
                                       smollm2_dir, out)


def save_with_smollm2_tokenizer(model, smollm2_dir: Path, out: Path) -> Path:
    """`model` (SmolLM2's vocabulary) saved as an HF folder with SmolLM2's tokenizer files, chat
    template and special token ids."""
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(smollm2_dir) / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir, tmp_path_factory):
    return tiny_smollm_dir(smollm2_dir, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_target(tiny_dir, "cpu")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_target(smollm2_dir, "cpu")


def run(target, prompts, out, *, stats=None, settings=GenerationSettings(), batch_size=8, max_prompt_tokens=None,
        engine=None, **kwargs):
    """`regenerate` as the command runs it for a local target (the engine `local_engine` picks)."""
    engine = engine or local_engine(target, settings, batch_size=batch_size, max_prompt_tokens=max_prompt_tokens, log=_quiet())
    kwargs = {"log": _quiet(), "progress_stream": _quiet(), **kwargs}
    return regenerate(prompts, out, engine=engine, stats=stats or _stats(prompts), settings=settings,
                      target_name=str(target.path), tokenizer=target.tokenizer, max_prompt_tokens=max_prompt_tokens, **kwargs)


def _prompts(texts, prefix="p"):
    return [Prompt(f"{prefix}{i}", [{"role": "user", "content": t}], f"test:{i + 1}") for i, t in enumerate(texts)]


def _stats(prompts):
    stats = RowStats()
    stats.count_read(len(prompts))
    return stats


def _rows(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _quiet():
    return open(os.devnull, "w")


TEXTS = [f"Tell me fact number {i} about {topic}." for i, topic in enumerate(
    ["rivers", "owls", "prime numbers", "the moon", "bread", "glaciers", "violins", "tea", "ants", "comets",
     "maps", "salt", "bees", "clocks", "sand", "wolves", "ink", "kites", "fog", "copper"])]


def test_smollm2_answers_match_hf_generate_and_stop_at_end_of_turn(smollm2, tmp_path):
    prompts = _prompts(["What is the capital of France?", "Explain recursion in simple words.", "Describe a cat."])
    out = tmp_path / "answers.jsonl"
    settings = GenerationSettings(max_new_tokens=12)
    engine = local_engine(smollm2, settings, batch_size=2, log=_quiet())
    assert isinstance(engine, StaticBatchEngine)  # 3 prompts through 2 slots: one is admitted when a row finishes
    log = io.StringIO()
    report = run(smollm2, prompts, out, settings=settings, engine=engine, log=log)
    assert log.getvalue().splitlines()[0] == "engine: static batched generator, 2 slots, continuous batching, no CUDA graphs, " \
                                            "finished rows read every 4 steps"
    rows = {row["id"]: row for row in _rows(out)}
    assert sorted(rows) == ["p0", "p1", "p2"] and report.new == 3 and report.stats.skipped == 0
    # The engine's account: 3 prompts admitted (2, then 1 when a slot freed) in 2 prefills.
    assert re.search(r"engine      2 slots, attention sdpa, \d+ step and 0 prefill shapes: [\d,]+ decode steps at occupancy 0\.\d\d, 2 prefills for 3 prompts",
                     report.summary()), report.summary()
    paris = rows["p0"]
    assert paris["messages"] == prompts[0].messages + [{"role": "assistant", "content": "The capital of France is Paris."}]
    assert paris["finish_reason"] == "stop" and paris["completion_tokens"] == 8  # 7 answer tokens + <|im_end|>
    assert rows["p1"]["finish_reason"] == "length" and rows["p1"]["completion_tokens"] == 12
    # Token for token what Hugging Face's own greedy generate writes, prompt by prompt.
    tokenizer = smollm2.tokenizer
    for prompt in prompts:
        ids = torch.tensor([render_prompt(tokenizer, prompt.messages)])
        expected = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                          eos_token_id=[2], pad_token_id=2)[0, ids.shape[1]:].tolist()
        answer = tokenizer(rows[prompt.id]["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        assert answer + ([2] if rows[prompt.id]["finish_reason"] == "stop" else []) == expected[: rows[prompt.id]["completion_tokens"]]
    # The rows are training data as they stand: the loss mask covers exactly the answer and its end of turn.
    samples, stats = load_training_samples(out, tokenizer, max_length=256)
    assert stats.used == 3
    by_source = {s.source: s for s in samples}
    paris_sample = by_source[f"{out}:{list(rows).index('p0') + 1}"]
    assert tokenizer.decode(paris_sample.input_ids[paris_sample.loss_mask]) == "The capital of France is Paris.<|im_end|>"


def test_stop_tokens_come_from_tokenizer_and_generation_config(smollm2):
    assert stop_token_ids(smollm2.model, smollm2.tokenizer) == [2]
    model = tiny_hf_model("llama", vocab=96)
    model.generation_config.eos_token_id = [7, 9]

    class NoEos:
        eos_token_id = 9

    assert stop_token_ids(model, NoEos()) == [7, 9]


def test_batched_greedy_equals_one_by_one_and_rows_leave_the_batch(tiny):
    tokenizer = tiny.tokenizer
    prompts = [render_prompt(tokenizer, p.messages) for p in _prompts(TEXTS[:5])]
    # Stop on a token the random model emits early for some rows only, so rows drop out mid-batch.
    probe = [g.tokens for g in generate_batch(tiny.model, prompts, max_new_tokens=10, stop_ids=[2], pad_id=2)]
    stop = next(t for row in probe for t in row[1:] if any(t not in other for other in probe))
    batched = generate_batch(tiny.model, prompts, max_new_tokens=10, stop_ids=[stop], pad_id=2)
    alone = [generate_batch(tiny.model, [p], max_new_tokens=10, stop_ids=[stop], pad_id=2)[0] for p in prompts]
    assert batched == alone
    for generated, row in zip(batched, probe):
        if stop in row:  # cut right after the stop token, which is kept in `tokens`
            assert generated == Generated(row[: row.index(stop) + 1], "stop") and generated.answer_tokens() == row[: row.index(stop)]
        else:
            assert generated == Generated(row, "length")
    assert {g.finish_reason for g in batched} == {"stop", "length"}


def test_sampling_is_seeded_per_row(tiny):
    tokenizer = tiny.tokenizer
    prompts = [render_prompt(tokenizer, p.messages) for p in _prompts(TEXTS[:4])]
    settings = GenerationSettings(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    seeds = [row_seed(3, f"p{i}") for i in range(4)]
    together = generate_batch(tiny.model, prompts, max_new_tokens=8, stop_ids=[2], pad_id=2, settings=settings, seeds=seeds)
    apart = [generate_batch(tiny.model, [p], max_new_tokens=8, stop_ids=[2], pad_id=2, settings=settings, seeds=[s])[0]
             for p, s in zip(prompts, seeds)]
    assert together == apart  # a row's answer does not depend on its batch neighbours
    greedy = generate_batch(tiny.model, prompts, max_new_tokens=8, stop_ids=[2], pad_id=2)
    other_seed = generate_batch(tiny.model, prompts, max_new_tokens=8, stop_ids=[2], pad_id=2, settings=settings,
                                seeds=[s + 1 for s in seeds])
    assert together != greedy and together != other_seed


def test_targets_the_static_generator_cannot_run_are_answered_by_hugging_face_eagerly(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    model = tiny_hf_model("gemma3_text", vocab=49152, hidden=32, layers=2)  # a 16-token sliding window
    target = Target(model, AutoTokenizer.from_pretrained(smollm2_dir), "tiny-gemma")
    settings = GenerationSettings(max_new_tokens=5)
    engine = local_engine(target, settings, batch_size=2, max_prompt_tokens=100, log=_quiet())
    assert isinstance(engine, EagerBatchEngine)
    assert engine.description == ("engine: Hugging Face eager batches of 2 (the static generator cannot run this target: "
                                  "its 16-token sliding window is shorter than the smallest static cache (512 positions))")
    prompts = _prompts(TEXTS[:3])
    log = io.StringIO()
    report = run(target, prompts, tmp_path / "out.jsonl", settings=settings, engine=engine, log=log)
    assert log.getvalue().splitlines()[0] == engine.description and report.new == 3
    for row in _rows(tmp_path / "out.jsonl"):
        ids = render_prompt(target.tokenizer, row["messages"][:-1])
        expected = generate_batch(model, [ids], max_new_tokens=5, stop_ids=[2], pad_id=2)[0]
        assert row["completion_tokens"] == len(expected.tokens)
        assert row["messages"][-1]["content"] == target.tokenizer.decode(expected.answer_tokens(), skip_special_tokens=False)


def test_accounting_of_bad_duplicate_long_and_failing_rows(smollm2_dir, tmp_path):
    # A real failure: a model whose embedding table is cut to 30,000 rows cannot take prompts with
    # higher token ids (IndexError per row); the others answer normally.
    model = tiny_hf_model("llama", vocab=49152, hidden=32, layers=2)
    model.resize_token_embeddings(30000)
    from transformers import AutoTokenizer

    target = Target(model, AutoTokenizer.from_pretrained(smollm2_dir), "cut-vocab")
    rows = [
        {"id": "ok1", "prompt": "Write a poem.", "system": "Be kind."},
        {"id": "ok1", "prompt": "Same id again.", "system": "Be kind."},  # duplicate id
        {"id": "fails", "prompt": "The Pythagorean theorem", "system": "Be kind."},  # ' Pythagorean' = 47997
        {"id": "long", "prompt": " ".join(["word"] * 80), "system": "Be kind."},
        {"id": "bad", "prompt": 42},
        {"id": "ok2", "prompt": "Name a color.", "system": "Be kind."},
    ]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = RowStats()
    prompts = list(read_prompts(source, stats))
    report = run(target, prompts, tmp_path / "out.jsonl", stats=stats, settings=GenerationSettings(max_new_tokens=4),
                 batch_size=4, max_prompt_tokens=60)
    assert sorted(r["id"] for r in _rows(tmp_path / "out.jsonl")) == ["ok1", "ok2"]
    assert report.failed == 1 and report.new == 2
    assert stats.read == 6 and stats.used == 2
    assert report.new + report.resumed + report.failed + (stats.skipped - report.failed) == stats.read
    assert dict(stats.skipped_by_reason) == {
        "duplicate id": 1, "generation failed: IndexError": 1, "prompt longer than 60 tokens": 1, "prompt: expected a string": 1,
    }
    text = report.summary()
    assert "accounting  input 6 = ok 2 + failed 1 + skipped 3" in text
    assert text.splitlines()[-5] == "rows: read=6 used=2 skipped=4"


class RecordingEngine:
    """A real engine that keeps the jobs it was given, to compare them between runs."""

    def __init__(self, engine):
        self.engine, self.jobs = engine, None
        self.description, self.setup_failures = engine.description, engine.setup_failures

    def answers(self, jobs):
        self.jobs = list(jobs)
        return self.engine.answers(self.jobs)


def test_prompts_rendered_in_worker_processes_make_the_same_jobs_skips_and_rows(tiny, tmp_path, monkeypatch):
    """Two worker processes (the threshold lowered to this short list) render the prompts: the
    same jobs in the same order, the same skips (duplicate, template error, too long) with the
    same examples, and the same rows as rendering here; and the same again when the workers
    cannot start."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.path)
    # Set after loading, so only a worker that receives the tokenizer as it is now fails this prompt.
    tokenizer.chat_template = ("{% if messages[-1]['content'].startswith('FAIL') %}"
                               "{{ raise_exception('this template refuses FAIL') }}{% endif %}" + tokenizer.chat_template)
    target = Target(tiny.model, tokenizer, tiny.path)
    prompts = _prompts(TEXTS[:9])
    prompts.insert(2, Prompt("p0", [{"role": "user", "content": "A second p0, answered never."}], "test:dup"))
    prompts.insert(5, Prompt("fail", [{"role": "user", "content": "FAIL on purpose"}], "test:fail"))
    prompts.insert(7, Prompt("long", [{"role": "user", "content": " ".join(["word"] * 80)}], "test:long"))
    settings = GenerationSettings(max_new_tokens=3)

    def regenerated(name, workers):
        stats = _stats(prompts)
        engine = RecordingEngine(local_engine(target, settings, batch_size=4, max_prompt_tokens=60, log=_quiet()))
        log = io.StringIO()
        report = run(target, prompts, tmp_path / name, stats=stats, settings=settings, max_prompt_tokens=60,
                     engine=engine, workers=workers, parallel_min_prompts=4, log=log)
        jobs = [(job.prompt.id, job.ids, job.seed) for job in engine.jobs]
        rows = sorted(json.dumps(row) for row in _rows(tmp_path / name))
        counts = (report.new, report.resumed, report.failed, report.tokens, report.finish, report.with_token_ids)
        return jobs, stats.summary(), dict(stats.first_example), counts, rows, log.getvalue()

    here, there = regenerated("here.jsonl", 1), regenerated("there.jsonl", 2)
    assert "rendering 11 prompts in 2 worker processes" in there[-1] and "worker processes" not in here[-1]
    assert there[:-1] == here[:-1]
    jobs, _, first_example, _, rows, _ = here
    assert [job_id for job_id, _, _ in jobs] == [f"p{i}" for i in range(9)]
    assert jobs[0][1] == render_prompt(tokenizer, prompts[0].messages) and len(rows) == 9
    assert first_example == {"duplicate id": "test:dup: id 'p0'",
                             "chat template error": "test:fail: chat template failed on 1 messages: "
                                                    "TemplateError: this template refuses FAIL",
                             "prompt longer than 60 tokens": "test:long: 110 tokens"}
    monkeypatch.setattr("sys.executable", "/nonexistent/python")  # the workers cannot start
    with pytest.warns(UserWarning, match="rendering the prompts in worker processes failed .*; doing it in this process"):
        fallback = regenerated("fallback.jsonl", 2)
    assert fallback[:-1] == here[:-1]


def test_every_row_failing_is_a_setup_error_not_bad_data(smollm2_dir, tmp_path):
    model = tiny_hf_model("llama", vocab=49152, hidden=32, layers=2)
    model.resize_token_embeddings(100)
    from transformers import AutoTokenizer

    target = Target(model, AutoTokenizer.from_pretrained(smollm2_dir), "tiny-vocab")
    prompts = _prompts(TEXTS[:3])
    with pytest.raises(IndexError):
        run(target, prompts, tmp_path / "out.jsonl", settings=GenerationSettings(max_new_tokens=2), batch_size=2)


def test_resume_after_torn_last_line_gives_the_uninterrupted_rows(tiny, tmp_path):
    prompts = _prompts(TEXTS)
    settings = GenerationSettings(max_new_tokens=6)
    straight = tmp_path / "straight.jsonl"
    run(tiny, prompts, straight, settings=settings, batch_size=3)
    full = straight.read_bytes()
    lines = full.splitlines(keepends=True)
    assert len(lines) == 20
    # A crash in the middle of a chunk's write: 7 whole rows and half a row.
    crashed = tmp_path / "crashed.jsonl"
    crashed.write_bytes(b"".join(lines[:7]) + lines[7][: len(lines[7]) // 2])
    shutil.copy(settings_path(straight), settings_path(crashed))
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        report = run(tiny, prompts, crashed, settings=settings, batch_size=3, log=handle)
    assert "dropped an incomplete last line" in log.read_text()
    assert report.resumed == 7 and report.new == 13
    # No duplicate, no gap, the same rows (written in the order they finished, so compared by id).
    resumed = crashed.read_bytes().splitlines(keepends=True)
    assert resumed[:7] == lines[:7] and sorted(resumed) == sorted(lines)
    # Resuming a finished file does nothing.
    again = run(tiny, prompts, crashed, settings=settings, batch_size=3)
    assert again.new == 0 and again.resumed == 20 and sorted(crashed.read_bytes().splitlines(keepends=True)) == sorted(lines)


def test_resume_refuses_other_settings_and_foreign_files(tiny, tmp_path):
    prompts = _prompts(TEXTS[:2])
    out = tmp_path / "out.jsonl"
    run(tiny, prompts, out, settings=GenerationSettings(max_new_tokens=3))
    with pytest.raises(RegenerateError, match=r"max_new_tokens: 3 before, 4 now"):
        run(tiny, prompts, out, settings=GenerationSettings(max_new_tokens=4))
    # A sampled file written before the counter-based sampler (its sidecar names none): other draws.
    sampled = tmp_path / "sampled.jsonl"
    settings = GenerationSettings(max_new_tokens=3, temperature=0.7)
    run(tiny, prompts, sampled, settings=settings)
    record = json.loads(settings_path(sampled).read_text())
    assert record["sampler"] == "counter-hash-v1"
    del record["sampler"]
    settings_path(sampled).write_text(json.dumps(record))
    with pytest.raises(RegenerateError, match=r"sampler: per-row torch generators before, counter-hash-v1 now"):
        run(tiny, prompts, sampled, settings=settings)
    foreign = tmp_path / "data.jsonl"
    shutil.copy(DATA / "chat_openai.jsonl", foreign)
    with pytest.raises(RegenerateError, match="was not written by `dflash-train regenerate`"):
        run(tiny, prompts, foreign, settings=GenerationSettings(max_new_tokens=3))
    assert foreign.read_bytes() == (DATA / "chat_openai.jsonl").read_bytes()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from dflash_train.cli import main; sys.exit(main(sys.argv[1:]))", *args]


def signal_after_rows(process: subprocess.Popen, out: Path, rows: int, signum: int, timeout: float = 120.0) -> None:
    """Send `signum` once `out` holds `rows` rows (the run is mid-way), unless the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= rows:
            process.send_signal(signum)
            return
        time.sleep(0.005)


def test_kill_9_mid_run_then_resume_matches_an_uninterrupted_run(tiny_dir, tmp_path, capsys):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("".join(f"{t} Then add a second fact about {t.split()[-1]}\n" for t in TEXTS * 2))
    args = ["regenerate", "--target", str(tiny_dir), "--prompts", str(prompt_file), "--max-new-tokens", "32",
            "--batch-size", "2", "--device", "cpu",
            "--flush-seconds", "0"]  # every row written as it finishes: the kill lands mid-run
    # One thread in the subprocesses too: the uninterrupted run below (in this process, under
    # `one_thread`) must compute with the same kernels.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed.jsonl"
    process = subprocess.Popen(_cli(*args, "--out", str(killed)), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    signal_after_rows(process, killed, 4, signal.SIGKILL)
    process.wait()
    stderr = process.stderr.read().decode()
    assert process.returncode == -signal.SIGKILL, f"the run ended by itself before it could be killed: {stderr[-2000:]}"
    partial = killed.read_bytes().count(b"\n")
    assert 4 <= partial < 40
    resumed = subprocess.run(_cli(*args, "--out", str(killed)), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{partial} rows were already in the output" in resumed.stdout
    assert resumed.stdout.rstrip().splitlines()[-1] == "rows: read=40 used=40 skipped=0"
    straight = tmp_path / "straight.jsonl"
    assert cli_main([*args, "--out", str(straight)]) == 0  # one thread, like the subprocesses (see `one_thread`)
    capsys.readouterr()
    killed_rows, straight_rows = _rows(killed), _rows(straight)
    assert len(killed_rows) == 40 and len({r["id"] for r in killed_rows}) == 40  # none lost, none twice
    assert sorted(killed_rows, key=lambda r: r["id"]) == sorted(straight_rows, key=lambda r: r["id"])
    assert [c.id for c in read_conversations(killed)] == [r["id"] for r in killed_rows]


def test_one_ctrl_c_stops_with_the_summary_and_every_prompt_accounted(tiny_dir, tmp_path):
    """A single SIGINT mid-run: exit 130 after the summary, which counts the prompts still in
    flight (before: the accounting did not add up to the input, and `aborted` followed the
    summary as if nothing had been handled)."""
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("".join(f"{t} Then add a second fact about {t.split()[-1]}\n" for t in TEXTS * 2))
    out = tmp_path / "answers.jsonl"
    process = subprocess.Popen(_cli("regenerate", "--target", str(tiny_dir), "--prompts", str(prompt_file),
                                    "--max-new-tokens", "32", "--batch-size", "2", "--device", "cpu",
                                    "--flush-seconds", "0", "--out", str(out)),
                               cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    signal_after_rows(process, out, 4, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "aborted" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert "regenerate summary (interrupted: run the same command again to resume)" in stdout
    line = next(line for line in stdout.splitlines() if line.strip().startswith("accounting"))
    numbers = [int(n) for n in re.findall(r"\d+", line)]
    assert numbers[0] == 40 and sum(numbers[1:]) == 40 and "not answered yet" in line, line


def test_cli_validates_its_flags(tmp_path, capsys):
    assert cli_main(["regenerate", "--target", "x", "--prompts", "p.txt", "--out", str(tmp_path / "o.json")]) == 2
    assert "use a .jsonl file" in capsys.readouterr().err
    assert cli_main(["regenerate", "--target", "x", "--prompts", "p.txt", "--out", str(tmp_path / "o.jsonl"), "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert cli_main(["regenerate", "--target", "x", "--prompts", "default", "--split", "test", "--out",
                     str(tmp_path / "o.jsonl")]) == 2
    assert "--split 'test': use auto, train, dev, all" in capsys.readouterr().err
