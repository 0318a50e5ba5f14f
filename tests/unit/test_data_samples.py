"""Training samples from real conversation files, rendered with the real SmolLM2 tokenizer."""

import gzip
import io
import json
import time
from pathlib import Path

import pytest
import torch
from data_files import DATA, REGENERATED_64, REGENERATED_4000, WITHOUT_REGENERATED_4000
from transformers import AutoTokenizer

from dflash_train.data.render import render_conversation, render_prompt
from dflash_train.data.samples import (
    NO_VALID_ANCHOR,
    has_valid_anchor,
    load_training_samples,
)

TEMPLATES = DATA / "chat_templates"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_regenerated_rows_become_samples_that_match_their_render(tokenizer):
    samples, stats = load_training_samples(REGENERATED_64, tokenizer, max_length=768, min_supervised_tokens=32)
    assert stats.summary().splitlines() == [
        "rows: read=64 used=38 skipped=26",
        f"  skipped 26: fewer than 32 supervised tokens (after truncation to 768)  (first: {REGENERATED_64}:2)",
    ]
    assert len(samples) == stats.used
    rows = [json.loads(line) for line in gzip.open(REGENERATED_64, "rt")]
    for sample in samples:
        assert sample.input_ids.dtype == torch.long and sample.loss_mask.dtype == torch.bool
        assert sample.input_ids.shape == sample.loss_mask.shape and sample.input_ids.ndim == 1
        assert sample.source == f"{REGENERATED_64}:{sample.sample_id + 1}"  # no blank lines: row i is line i + 1
        rendered = render_conversation(tokenizer, rows[sample.sample_id]["messages"], max_length=768)
        assert sample.input_ids.tolist() == rendered.input_ids and sample.loss_mask.tolist() == [bool(m) for m in rendered.loss_mask]
        assert int(sample.loss_mask.sum()) >= 32
        answer = rows[sample.sample_id]["messages"][-1]["content"]
        assert tokenizer.decode(sample.input_ids[sample.loss_mask]) == answer + "<|im_end|>"


def test_sample_ids_are_row_positions_and_survive_other_filters(tokenizer):
    strict, _ = load_training_samples(REGENERATED_64, tokenizer, max_length=768, min_supervised_tokens=32)
    loose, _ = load_training_samples(REGENERATED_64, tokenizer, max_length=768)
    by_id = {s.sample_id: s for s in loose}
    assert len(loose) == 64 and sorted(by_id) == list(range(64))
    for sample in strict:
        assert torch.equal(by_id[sample.sample_id].input_ids, sample.input_ids)


def test_anchor_rule_at_the_truncation_edge(tokenizer, tmp_path):
    """An anchor p needs loss_mask[p] and loss_mask[p + 1]: one supervised token left is not enough, two are."""
    messages = [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": "Hello there, friend."}]
    path = write_jsonl(tmp_path / "one.jsonl", [{"messages": messages}])
    prompt_length = len(render_prompt(tokenizer, messages[:1]))
    samples, stats = load_training_samples(path, tokenizer, max_length=prompt_length + 1)
    assert samples == [] and dict(stats.skipped_by_reason) == {NO_VALID_ANCHOR: 1}
    samples, stats = load_training_samples(path, tokenizer, max_length=prompt_length + 2)
    assert len(samples) == 1 and samples[0].loss_mask.tolist()[-2:] == [True, True]
    assert not has_valid_anchor([1, 0, 1, 0]) and has_valid_anchor([0, 1, 1])


def test_every_row_is_accounted_for_across_files(tokenizer, tmp_path):
    first = write_jsonl(
        tmp_path / "first.jsonl",
        [
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help you today?"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},  # only <|im_end|>: no anchor
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]},  # 3 tokens < 5
            {"messages": [{"role": "user", "content": "Hi"}]},  # not a conversation
        ],
    )
    second = write_jsonl(
        tmp_path / "second.jsonl",
        [{"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two, three, four, five."}]}],
    )
    samples, stats = load_training_samples([first, second], tokenizer, max_length=64, min_supervised_tokens=5)
    assert [(s.sample_id, s.source) for s in samples] == [(0, f"{first}:1"), (4, f"{second}:1")]
    assert (stats.read, stats.used, stats.skipped) == (5, 2, 3)
    assert dict(stats.skipped_by_reason) == {
        NO_VALID_ANCHOR: 1,
        "fewer than 5 supervised tokens (after truncation to 64)": 1,
        "no assistant message": 1,
    }
    assert stats.first_example[NO_VALID_ANCHOR] == f"{first}:2"


def test_template_errors_are_counted_not_raised(smollm2_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    path = write_jsonl(
        tmp_path / "thinking.jsonl",
        [
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\nIt is 4."}]},
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4, of course."}]},
        ],
    )
    samples, stats = load_training_samples(path, tokenizer, max_length=64, enable_thinking=False)
    assert [s.sample_id for s in samples] == [1]
    assert list(stats.skipped_by_reason) == ["chat template error"]
    assert stats.first_example["chat template error"].startswith(f"{path}:1: assistant message 1 does not begin with the generation prompt")


def test_progress_stays_quiet_on_short_reads(tokenizer):
    stream = io.StringIO()
    load_training_samples(REGENERATED_64, tokenizer, max_length=256, progress_stream=stream)
    assert stream.getvalue() == ""


@pytest.mark.skipif(not REGENERATED_4000.is_file(), reason=WITHOUT_REGENERATED_4000)
def test_shared_4000_row_file(tokenizer):
    """The reference run's data: 2,634 rows keep >= 32 supervised tokens at length 768 (the answer and
    <|im_end|>; the reference's 2,646 also counted the newline after <|im_end|>: 2,646 rows have >= 31 here)."""
    samples, stats = load_training_samples(REGENERATED_4000, tokenizer, max_length=768, min_supervised_tokens=32)
    assert (stats.read, stats.used) == (4000, 2634) and len(samples) == 2634
    assert sum(1 for s in samples if int(s.loss_mask.sum()) >= 32) == 2634


def _samples_and_stats(samples, stats):
    return ([(s.sample_id, s.source, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples],
            stats.summary(), dict(stats.first_example))


def test_worker_processes_render_what_one_process_renders(tokenizer, tmp_path):
    """Every kind of row (samples, no anchor, too few tokens, not a conversation, bad JSON) in one
    file parsed and rendered by 3 worker processes: the same samples, order, ids and stats as here
    (the workers are handed every line read, the bad ones included)."""
    rows = [json.loads(line) for line in gzip.open(REGENERATED_64, "rt")]
    extra = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "Hi"}]},
    ]
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(row) for row in rows[:20] + extra + rows[20:]]
    lines.insert(30, "{not json")
    path.write_text("\n".join(lines) + "\n")
    here = load_training_samples(path, tokenizer, max_length=768, min_supervised_tokens=32, workers=1)
    stream = io.StringIO()
    there = load_training_samples(path, tokenizer, max_length=768, min_supervised_tokens=32, workers=3,
                                  parallel_min_rows=8, progress_stream=stream)
    assert "rendering 67 rows in 3 worker processes" in stream.getvalue()
    assert _samples_and_stats(*there) == _samples_and_stats(*here)
    assert len(here[0]) == 38 and here[1].skipped == 29  # 26 short + no anchor + no assistant + bad JSON


def test_worker_processes_use_the_tokenizer_as_it_was_changed(smollm2_dir, tmp_path):
    """The tokenizer reaches the workers with its state (here a chat template set after loading),
    and a template error in a worker is counted like one here."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    thinking = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\nIt is 4."}]}
    plain = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4, of course."}]}
    path = write_jsonl(tmp_path / "thinking.jsonl", [thinking, plain] * 4)
    here = load_training_samples(path, tokenizer, max_length=64, enable_thinking=False, workers=1)
    there = load_training_samples(path, tokenizer, max_length=64, enable_thinking=False, workers=2, parallel_min_rows=2)
    assert _samples_and_stats(*there) == _samples_and_stats(*here)
    assert [s.sample_id for s in there[0]] == [1, 3, 5, 7] and list(there[1].skipped_by_reason) == ["chat template error"]


def _render_defined_in_a_test(tokenizer, row):  # not importable by a worker: tests/ is not on its path
    return row


def test_a_failing_worker_is_reported_and_rendering_falls_back(tokenizer, monkeypatch):
    from dflash_train.processes import WorkerError, map_in_processes

    with pytest.raises(WorkerError, match=r"worker \d exited with 1: ModuleNotFoundError: No module named 'test_data_samples'"):
        map_in_processes(_render_defined_in_a_test, list(range(4)), 2, fixed=(None,))
    here = load_training_samples(REGENERATED_64, tokenizer, max_length=768, min_supervised_tokens=32, workers=1)
    monkeypatch.setattr("sys.executable", "/nonexistent/python")  # the workers cannot start
    with pytest.warns(UserWarning, match="rendering in worker processes failed .*; rendering in this process"):
        there = load_training_samples(REGENERATED_64, tokenizer, max_length=768, min_supervised_tokens=32, workers=2,
                                      parallel_min_rows=8)
    assert _samples_and_stats(*there) == _samples_and_stats(*here)


def test_a_log_gets_one_last_line_per_state():
    """In a log (not a terminal) `close` writes the last state once: not again when the last
    update already wrote that line (the render pool's one update of all rows did), and still
    when the state moved on after the last line."""
    from dflash_train.progress import Progress

    stream = io.StringIO()
    progress = Progress(10, "rendering x", stream=stream, every_seconds=0.0)
    progress.update(10)
    progress.close()
    assert stream.getvalue().count("10/10") == 1, stream.getvalue()
    stream = io.StringIO()
    progress = Progress(10, "rendering y", stream=stream, every_seconds=3600.0)
    progress.last_draw = time.monotonic()
    progress.update(4)
    progress.close()
    assert stream.getvalue().splitlines() and "4/10" in stream.getvalue().splitlines()[-1], stream.getvalue()


def test_the_modules_render_workers_import_load_no_torch():
    """A render worker unpickles _RenderRule.render (data/samples.py) and regenerate's
    _rendered_prompt: importing either must not import torch, which would be most of the
    start-up of 16 workers at once."""
    import subprocess
    import sys

    code = ("import sys; import dflash_train.data.samples, dflash_train.generate.regenerate; "
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr or "torch was imported"
