"""One bad byte must not kill a run (issue #14, item 3).

A row whose text is not valid UTF-8 (a damaged byte, or a lone surrogate escape in JSON) is
skipped and counted under its reason with its file:line, by the readers and by the three
commands that read user files (`train`, `cache-features`, `regenerate`), run through the real
CLI on a real tiny chat model. A file that is not what its name says (.gz, .parquet) is one
line naming the file, exit 2.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

from dflash_train import cli
from dflash_train.data.readers import DataError, RowStats, read_conversations, read_prompts
from test_decode_loop import char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

BAD_TEXT = "invalid UTF-8 or lone surrogate"


def _row(index: int) -> bytes:
    answer = "The answer is " + "abcdefgh"[index % 8] * 12 + "."
    return json.dumps({"messages": [{"role": "user", "content": f"Question {index}?"},
                                    {"role": "assistant", "content": answer}]}).encode()


def write_rows_with_bad_text(path: Path, count: int = 8) -> dict[int, str]:
    """`count` good rows, then line count+1 with a 0xff byte inside an answer and line count+2
    with a lone surrogate escape; returns {line: what is wrong}."""
    good = [_row(i) for i in range(count)]
    damaged = _row(100).replace(b"The answer", b"The \xff answer")
    surrogate = _row(101).replace(b"The answer", b"The \\ud800 answer")
    data = b"\n".join(good + [damaged, surrogate]) + b"\n"
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return {count + 1: "byte 0xff is not UTF-8", count + 2: "lone surrogate escape \\ud800"}


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz"])
def test_bad_text_rows_are_skipped_and_located(tmp_path, name):
    path = tmp_path / name
    bad = write_rows_with_bad_text(path)
    stats = RowStats()
    rows = list(read_conversations(path, stats))
    assert (stats.read, stats.used, len(rows)) == (10, 8, 8)
    assert stats.skipped_by_reason == {f"messages[*].content: {BAD_TEXT}": 2}
    example = stats.first_example[f"messages[*].content: {BAD_TEXT}"]
    assert example.startswith(f"{path}:9: messages[1].content: invalid text at character 4: {bad[9]}")
    with pytest.raises(DataError, match=rf"{name}:9: messages\[1\]\.content: invalid text"):
        list(read_conversations(path, strict=True))
    lone = tmp_path / "lone.jsonl"
    lone.write_bytes(path.read_bytes() if not name.endswith(".gz") else gzip.decompress(path.read_bytes()))
    lone.write_bytes(b"\n".join(lone.read_bytes().split(b"\n")[9:]))
    with pytest.raises(DataError, match=r"lone.jsonl:1: messages\[1\]\.content: invalid text at character 4: lone surrogate escape \\ud800"):
        list(read_conversations(lone, strict=True))
    # The summary that commands print must itself be printable as UTF-8.
    stats.summary().encode("utf-8")


def test_json_array_and_text_prompt_files_skip_bad_text(tmp_path):
    array = tmp_path / "rows.json"
    array.write_bytes(b"[" + b",".join([_row(0), _row(1).replace(b"Question", b"Qu\xc3estion")]) + b"]")
    stats = RowStats()
    assert len(list(read_prompts(array, stats))) == 1
    assert stats.first_example[f"messages[*].content: {BAD_TEXT}"].startswith(f"{array}:2: messages[0].content:")

    text = tmp_path / "prompts.txt"
    text.write_bytes(b"Describe a sunrise.\nDescribe a \xe9t\xe9.\nList three primes.\n")
    stats = RowStats()
    assert [p.messages[0]["content"] for p in read_prompts(text, stats)] == ["Describe a sunrise.", "List three primes."]
    assert stats.first_example[f"prompt: {BAD_TEXT}"].startswith(f"{text}:2: prompt: invalid text at character 11: byte 0xe9")


def test_a_bad_key_is_reported_printably(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"mess\xffages": []}\n' + _row(0) + b"\n")
    stats = RowStats()
    assert len(list(read_conversations(path, stats))) == 1
    example = stats.first_example["no 'messages' or 'conversations' field"]
    assert "mess\\udcffages" in example and example.encode("utf-8")


def test_parquet_cell_that_is_not_utf8_is_a_skipped_row(tmp_path):
    offsets = pa.array([0, 6, 13, 19], pa.int32()).buffers()[1]
    cells = pa.StringArray.from_buffers(3, offsets, pa.py_buffer(b"Hello!Bad \xff\xfe!Hello?"))
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": cells}), path)
    stats = RowStats()
    assert [p.messages[0]["content"] for p in read_prompts(path, stats)] == ["Hello!", "Hello?"]
    assert stats.skipped_by_reason == {f"prompt: {BAD_TEXT}": 1}
    assert stats.first_example[f"prompt: {BAD_TEXT}"].startswith(f"{path}:2: prompt: invalid text")


@pytest.mark.parametrize("name,kind", [("rows.jsonl.gz", "gzip"), ("rows.parquet", "Parquet"), ("prompts.txt.gz", "gzip")])
def test_a_file_that_is_not_its_format_is_one_error_naming_it(tmp_path, name, kind):
    path = tmp_path / name
    path.write_bytes(_row(0) + b"\n")
    reader = read_prompts if name.startswith("prompts") else read_conversations
    with pytest.raises(DataError, match=rf"^{path}: not a readable {kind} file \("):
        list(reader(path))


def test_a_truncated_gzip_is_one_error_naming_it(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join(_row(i) for i in range(50)))[:-12])
    with pytest.raises(DataError, match=rf"^{path}: not a readable gzip file"):
        list(read_conversations(path))


# --------------------------------------------------------------------------------------------
# The commands, through the real CLI entry point
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    """A tiny Llama with a character tokenizer and a ChatML template, saved as a HF folder."""
    root = tmp_path_factory.mktemp("bad-bytes") / "target"
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=104, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def _assert_counted(output: str, path: Path) -> None:
    assert "rows: read=10 used=8 skipped=2" in output, output
    assert f"skipped 2: messages[*].content: {BAD_TEXT}  (first: {path}:9: messages[1].content:" in output, output


def test_train_skips_and_counts_bad_text_rows(chat_target, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    write_rows_with_bad_text(data)
    code = cli.main([
        "train", "--target", str(chat_target), "--data", str(data), "--out", str(tmp_path / "run"),
        "--steps", "2", "--batch-size", "2", "--max-seq-len", "64", "--num-layers", "1", "--num-anchors", "8",
        "--block-size", "4", "--device", "cpu", "--log-every", "1", "--save-every", "2",
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    _assert_counted(captured.out + captured.err, data)


def test_cache_features_skips_and_counts_bad_text_rows(chat_target, tmp_path, capsys):
    data = tmp_path / "rows.jsonl.gz"
    write_rows_with_bad_text(data)
    code = cli.main(["cache-features", "--target", str(chat_target), "--data", str(data),
                     "--out", str(tmp_path / "cache"), "--num-layers", "1", "--device", "cpu", "--max-seq-len", "64"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    _assert_counted(captured.out + captured.err, data)


def test_regenerate_skips_and_counts_bad_text_prompts(chat_target, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    write_rows_with_bad_text(prompts)  # chats ending with an answer: the answer is replaced
    prompts.write_bytes(prompts.read_bytes().replace(b"Question 3?", b"Quest\xffion 3?"))
    out = tmp_path / "regenerated.jsonl"
    code = cli.main(["regenerate", "--target", str(chat_target), "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "3", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    output = captured.out + captured.err
    # A row is checked whole: damaged text in the answer that regenerate replaces skips it too.
    assert "rows: read=10 used=7 skipped=3" in output, output
    assert f"skipped 3: messages[*].content: {BAD_TEXT}  (first: {prompts}:4: messages[0].content:" in output
    assert len(out.read_text(encoding="utf-8").splitlines()) == 7


@pytest.mark.parametrize("command", ["train", "cache-features", "regenerate"])
def test_commands_name_a_file_that_is_not_gzip(chat_target, tmp_path, capsys, command):
    fake = tmp_path / "rows.jsonl.gz"
    fake.write_bytes(_row(0) + b"\n")
    flags = {
        "train": ["--data", str(fake), "--out", str(tmp_path / "run"), "--steps", "1", "--device", "cpu"],
        "cache-features": ["--data", str(fake), "--out", str(tmp_path / "cache"), "--device", "cpu"],
        "regenerate": ["--prompts", str(fake), "--out", str(tmp_path / "out.jsonl"), "--device", "cpu", "--max-new-tokens", "8"],
    }[command]
    code = cli.main([command, "--target", str(chat_target), *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"dflash-train {command}: {fake}: not a readable gzip file (Not a gzipped file (b'{{\"'))"
