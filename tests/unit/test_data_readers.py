"""Readers: every row of real files is used or skipped with a reason naming file, line and field."""

import gzip
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_train.data.readers import DataError, RowStats, read_conversations, read_prompts

DATA = Path(__file__).parent.parent / "data"
OPENAI = DATA / "chat_openai.jsonl"
SHAREGPT = DATA / "chat_sharegpt.jsonl"


def read_all(path, reader=read_conversations):
    stats = RowStats()
    rows = list(reader(path, stats))
    assert stats.used + stats.skipped == stats.read
    assert stats.used == len(rows), "a row was neither returned nor counted as skipped"
    return rows, stats


def test_openai_jsonl_rows_are_used_or_skipped_with_located_reasons():
    conversations, stats = read_all(OPENAI)
    assert (stats.read, stats.used, stats.skipped) == (10, 3, 7)  # the blank line is not a row
    assert [c.id for c in conversations] == ["greeting", "chat_openai.jsonl:2", "7"]
    assert [c.source for c in conversations] == [f"{OPENAI}:1", f"{OPENAI}:2", f"{OPENAI}:9"]
    assert conversations[0].messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert conversations[2].messages[1]["reasoning_content"] == "Short question, short answer."

    examples = stats.first_example
    assert examples["messages[*].content: expected a string"] == f"{OPENAI}:4: messages[2].content: expected a string, got null"
    assert examples["invalid JSON"].startswith(f"{OPENAI}:5: invalid JSON")
    assert examples["messages[*].role: unknown role"].startswith(f"{OPENAI}:6: messages[1].role: unknown role 'tool'")
    assert examples["no assistant message"].startswith(f"{OPENAI}:7: ")
    assert examples["row: expected an object"] == f"{OPENAI}:8: row: expected an object, got an array"
    assert examples["messages: expected an array of messages"] == f"{OPENAI}:10: messages: expected an array of messages, got a string"
    assert examples["no 'messages' or 'conversations' field"].startswith(f"{OPENAI}:11: row: expected a 'messages'")
    assert sum(stats.skipped_by_reason.values()) == 7 and all(n == 1 for n in stats.skipped_by_reason.values())


def test_summary_lists_totals_then_one_line_per_reason():
    _, stats = read_all(OPENAI)
    lines = stats.summary().splitlines()
    assert lines[0] == "rows: read=10 used=3 skipped=7"
    assert len(lines) == 1 + 7
    assert lines[1].startswith("  skipped 1: ")
    assert any(f"{OPENAI}:4: messages[2].content: expected a string, got null" in line for line in lines)


def test_sharegpt_roles_are_mapped_and_stats_merge_across_files():
    conversations, sharegpt = read_all(SHAREGPT)
    assert [m["role"] for m in conversations[0].messages] == ["system", "user", "assistant"]
    assert sharegpt.first_example["conversations[*].from: unknown role"].startswith(f"{SHAREGPT}:2: conversations[1].from: unknown role 'bot'")
    assert sharegpt.first_example["conversations[*].value: expected a string"] == (
        f"{SHAREGPT}:3: conversations[1].value: expected a string, got a number"
    )
    merged = RowStats()  # one RowStats across files, as load_training_samples keeps it
    for path in (OPENAI, SHAREGPT):
        list(read_conversations(path, merged))
    assert (merged.read, merged.used, merged.skipped) == (13, 4, 9)
    assert merged.summary().splitlines()[0] == "rows: read=13 used=4 skipped=9"


def test_gzip_jsonl_reads_the_same_rows(tmp_path):
    compressed = tmp_path / "chat.jsonl.gz"
    with open(OPENAI, "rb") as source, gzip.open(compressed, "wb") as target:
        shutil.copyfileobj(source, target)
    plain, plain_stats = read_all(OPENAI)
    packed, packed_stats = read_all(compressed)
    assert [c.messages for c in packed] == [c.messages for c in plain]
    assert packed_stats.skipped_by_reason == plain_stats.skipped_by_reason
    assert packed[1].source == f"{compressed}:2"


def test_parquet_rows_including_nulls(tmp_path):
    rows = [
        {"id": "p1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"id": None, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
        {"id": None, "messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]},
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    conversations, stats = read_all(path)
    assert [c.id for c in conversations] == ["p1", "chat.parquet:3"]
    assert conversations[1].messages[1] == {"role": "assistant", "content": "Goodbye"}
    assert stats.first_example == {"messages[*].content: expected a string": f"{path}:2: messages[1].content: expected a string, got null"}


def test_json_array_file(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([json.loads(line) for line in SHAREGPT.read_text().splitlines()]))
    conversations, stats = read_all(path)
    assert (stats.read, stats.used) == (3, 1)
    assert conversations[0].source == f"{path}:1"


def test_prompt_files():
    prompts, stats = read_all(DATA / "prompts.jsonl", read_prompts)
    assert (stats.read, stats.used, stats.skipped) == (7, 4, 3)
    assert [p.messages for p in prompts] == [
        [{"role": "user", "content": "Write a haiku about autumn."}],
        [{"role": "system", "content": "You are an editor."}, {"role": "user", "content": "Summarise this."}],
        [{"role": "user", "content": "Explain recursion."}],  # the old answer is dropped, to be regenerated
        [{"role": "user", "content": "Why is the sky blue?"}],
    ]
    assert set(stats.skipped_by_reason) == {"prompt: empty", "prompt does not end with a user message", "prompt: expected a string"}

    lines, text_stats = read_all(DATA / "prompts.txt", read_prompts)
    assert [p.messages[0]["content"] for p in lines] == ["Describe a sunrise.", "List three prime numbers and explain why they are prime."]
    assert [p.id for p in lines] == ["prompts.txt:1", "prompts.txt:3"]


def test_strict_mode_raises_the_located_error():
    with pytest.raises(DataError, match=r"chat_openai\.jsonl:4: messages\[2\]\.content: expected a string, got null"):
        list(read_conversations(OPENAI, strict=True))


def test_unsupported_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="unsupported file type"):
        list(read_conversations(DATA / "prompts.txt"))  # text files hold prompts, not conversations
    with pytest.raises(DataError, match="no such file"):
        list(read_conversations(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("ids,bad", [
    ([5, True, 7], "True"), ([5, -1], "-1"), ([2**31], str(2**31)), ([3, 1.0], "1.0"), ([3, "4"], "'4'"),
    ([[1]], "[1]"), ("1 2", "'1 2'"),
])
def test_answer_token_ids_that_are_not_token_ids_are_refused_naming_one(ids, bad, tmp_path):
    """Only integers in [0, 2**31) stand for tokens: a bool (JSON's true), a negative, one too large,
    a float, a string or a nested array makes the row bad, its example naming the culprit; an
    empty array and valid ids pass."""
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
             "answer_token_ids": value, "tokenizer_fingerprint": "sha256:x"} for value in (ids, [], [0, 2**31 - 1])]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    conversations, stats = read_all(path)
    assert [list(c.answer_ids) for c in conversations] == [[], [0, 2**31 - 1]]
    assert stats.skipped_by_reason == {"answer_token_ids: not an array of token ids": 1}
    example = stats.first_example["answer_token_ids: not an array of token ids"]
    assert example.startswith(f"{path}:1: answer_token_ids: expected an array of token ids (integers >= 0), got {bad}")
