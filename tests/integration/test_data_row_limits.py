"""Rows the readers must take without a trap: a row far longer than --max-seq-len is cut before it
is tokenized (bounded memory) and counted as truncated in the rows line; a UTF-8 byte-order mark
on line 1 is not part of row 1. SmolLM2's real tokenizer, real files, a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_train.data.readers import MAX_CHARS_PER_TOKEN, read_conversations
from dflash_train.data.render import render_conversation
from dflash_train.data.samples import load_training_samples

REPO = Path(__file__).resolve().parents[2]


def _chat(user: str, answer: str = "The answer is four.") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_a_long_row_keeps_the_same_first_tokens_and_is_counted(tokenizer, tmp_path):
    long_text = "Tell me about rivers and the sea. " * 2000  # 68k characters: past 128 x MAX_CHARS_PER_TOKEN
    assert len(long_text) > 128 * MAX_CHARS_PER_TOKEN
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(_chat("What is 2 + 2?")) + "\n" + json.dumps(_chat("Rivers?", long_text)) + "\n")
    samples, stats = load_training_samples(data, tokenizer, max_length=128, workers=1)
    whole = render_conversation(tokenizer, _chat("Rivers?", long_text)["messages"])  # every token, then cut
    assert samples[1].input_ids.tolist() == whole.input_ids[:128]
    assert samples[1].loss_mask.tolist() == [bool(m) for m in whole.loss_mask[:128]]
    assert stats.truncated == 1 and "rows: read=2 used=2 skipped=0 (of the used, 1 truncated" in stats.summary()


HUGE_ROW = """
import json, resource, sys
from transformers import AutoTokenizer
from dflash_train.data.samples import load_training_samples
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
samples, stats = load_training_samples(sys.argv[2], tokenizer, max_length=128, workers=1)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_mib": grown / 1024, "truncated": getattr(stats, "truncated", None), "lengths": [len(s.input_ids) for s in samples]}))
"""


def test_a_huge_row_costs_no_more_memory_than_its_kept_tokens(smollm2_dir, tmp_path):
    """8 MB in one row, 128 tokens kept: tokenizing all of it took ~1.5 GB (9.4 GB for 50 MB, D14)."""
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps(_chat("Say words.", "word " * 1_600_000)) + "\n")
    done = subprocess.run([sys.executable, "-c", HUGE_ROW, str(smollm2_dir), str(data)], capture_output=True,
                          text=True, cwd=REPO, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["lengths"] == [128] and result["truncated"] == 1
    assert result["grown_mib"] < 200, result


def test_a_byte_order_mark_on_line_1_is_not_part_of_row_1(tmp_path):
    for name, write in (("bom.jsonl", lambda p, text: p.write_bytes(b"\xef\xbb\xbf" + text.encode())),
                        ("bom.jsonl.gz", lambda p, text: p.write_bytes(__import__("gzip").compress(b"\xef\xbb\xbf" + text.encode())))):
        path = tmp_path / name
        write(path, json.dumps(_chat("first")) + "\n" + json.dumps(_chat("second")) + "\n")
        rows = list(read_conversations(path))
        assert [r.messages[0]["content"] for r in rows] == ["first", "second"], name
