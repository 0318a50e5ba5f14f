"""`eval-merge` joins only shards of one run: shards measured with other settings or other
prompts are refused, a damaged shard is one line naming it, and a merged file merges again.
Shards come from the real `eval` command on a real tiny target (CPU); where a test needs a
shard that differs in one setting, it edits one field of a copy of a real shard's JSON.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from dflash_train.export.hf import export_model
from dflash_train.target.model import Target
from test_decode_loop import char_tokenizer, random_drafter
from test_eval_mismatch import PROMPTS, _one_error_line, _save_target

from dflash_train import cli
from dflash_train.eval.merge import MergeError, merge_eval_results

pytestmark = pytest.mark.usefixtures("one_thread")

# Five prompts: longer than PROMPTS (three), so a shard past PROMPTS' end still holds some.
LONGER = [f"Count to {n} in words." for n in range(1, 6)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("merge-pair")
    target = _save_target(root / "target")
    drafter = random_drafter(Target(target), layer_ids=(0, 2), mask_token_id=char_tokenizer().mask_token_id)
    export_model(drafter, root / "drafter", dtype=torch.float32)
    return root


def _write_prompts(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": text}) + "\n" for i, text in enumerate(texts)))
    return path


def _eval_shard(pair: Path, out: Path, offset: int, limit: int, *benches: Path) -> Path:
    code = cli.main(["eval", "--target", str(pair / "target"), "--drafter", str(pair / "drafter"),
                     "--bench", ",".join(map(str, benches)), "--offset", str(offset), "--limit", str(limit),
                     "--max-new-tokens", "4", "--no-baseline", "--device", "cpu", "--json", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def shards(pair, tmp_path_factory) -> dict[str, Path]:
    """One run over PROMPTS (3 prompts) and `longer` (5) in three shards of two prompts: s4 holds
    no prompt of PROMPTS, which ended before its offset."""
    root = tmp_path_factory.mktemp("merge-shards")
    longer = _write_prompts(root / "prompts" / "longer.jsonl", LONGER)
    return {f"s{offset}": _eval_shard(pair, root / f"s{offset}.json", offset, 2, PROMPTS, longer)
            for offset in (0, 2, 4)}


def _edited(shard: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    payload = json.loads(shard.read_text())
    edit(payload)
    out.write_text(json.dumps(payload))
    return out


def _setting(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda payload: payload["config"].__setitem__(key, value)


def _recorded(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A setting eval records as it resolved it (top level) and as it was given (config)."""
    def edit(payload: dict[str, Any]) -> None:
        payload[key] = payload["config"][key] = value
    return edit


def _both(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(payload: dict[str, Any]) -> None:
        for one in edits:
            one(payload)
    return edit


def _without_prompt_lists(payload: dict[str, Any]) -> None:
    """As an eval from before the prompt lists were recorded wrote it."""
    for bench in payload["benchmarks"].values():
        del bench["prompt_list"]


def _without_config(payload: dict[str, Any]) -> None:
    """As an eval-merge from before merged files kept their settings wrote it."""
    del payload["config"]


def _unchanged(payload: dict[str, Any]) -> None:
    pass


# name: (edit of s0, edit of s2, the refusal's "KEY is X in s2 but Y in s0" values,
#        and a pair of edits that differ in the same setting without changing what is measured)
SETTINGS = {
    "dtype": ((_unchanged, _recorded("dtype", "bfloat16"), ("dtype", "'bfloat16'", "'float32'")),
              # --dtype auto is float32 on the CPU: the same as --dtype float32
              (_unchanged, _setting("dtype", "float32"))),
    "stop tokens": ((_unchanged, _recorded("stop_token_ids", [7]), ("stop_token_ids", "[7]", "[2]")),
                    (_recorded("stop_token_ids", [2, 7]), _recorded("stop_token_ids", [7, 2]))),
    "seed when sampling": ((_setting("temperature", 0.7), _both(_setting("temperature", 0.7), _setting("seed", 1)),
                            ("seed", "1", "0")),
                           # greedy decoding draws no random number
                           (_unchanged, _setting("seed", 1))),
    "thinking": ((_unchanged, _setting("thinking", "on"), ("thinking", "'on'", "'auto'")), None),
    "decoder": ((_unchanged, _setting("decoder", "hf"), ("decoder", "'hf'", "'auto'")), None),
    "compile-draft": ((_unchanged, _setting("compile_draft", "on"), ("compile_draft", "'on'", "'off'")),
                      # auto is off on the CPU
                      (_unchanged, _setting("compile_draft", "off"))),
    "device": ((_unchanged, _recorded("device", "cuda:0"), ("device", "'cuda'", "'cpu'")),
               # two GPUs of one kind: how a run is sharded
               (_recorded("device", "cuda:0"), _recorded("device", "cuda:1"))),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_shards_measured_with_another_setting_are_refused(shards, name, tmp_path, capsys):
    (edit_first, edit_other, (key, other_value, first_value)), same = SETTINGS[name]
    first = _edited(shards["s0"], tmp_path / "a.json", edit_first)
    other = _edited(shards["s2"], tmp_path / "b.json", edit_other)
    assert json.loads(shards["s0"].read_text())["stop_token_ids"] == [2]  # what the expected messages assume
    assert cli.main(["eval-merge", f"{first},{other}"]) == 2
    assert _one_error_line(capsys) == (f"dflash-train eval-merge: {key} is {other_value} in {other} but {first_value} "
                                       f"in {first}: not one run")
    if same is not None:
        first = _edited(shards["s0"], tmp_path / "c.json", same[0])
        other = _edited(shards["s2"], tmp_path / "d.json", same[1])
        merged = merge_eval_results([first, other])
        assert [len(bench["prompts"]) for bench in merged["benchmarks"].values()] == [3, 4]


def test_shards_of_an_edited_prompts_file_are_refused(pair, shards, tmp_path, capsys):
    """The prompts file changed between two shards' runs, at a prompt in neither shard: each shard
    recorded the whole benchmark's prompts, so the merge sees it (end to end, two real evals)."""
    edited = _write_prompts(tmp_path / "prompts" / "longer.jsonl", [*LONGER[:4], "Count to 5 in French."])
    other = _eval_shard(pair, tmp_path / "edited.json", 2, 2, PROMPTS, edited)
    capsys.readouterr()
    assert cli.main(["eval-merge", f"{shards['s0']},{other}"]) == 2
    assert _one_error_line(capsys) == (f"dflash-train eval-merge: the prompts of longer differ between {other} and "
                                       f"{shards['s0']} (the prompts file changed between the shards?)")
    # The shard's own prompts are the same: only the recorded fingerprint tells them apart.
    records = [json.loads(p.read_text())["benchmarks"]["longer"]["prompts"] for p in (other, shards["s2"])]
    assert [r["id"] for r in records[0]] == [r["id"] for r in records[1]] == ["q2", "q3"]

    # A shard of an older eval records no fingerprint: merged as before (nothing to compare with).
    older = _edited(other, tmp_path / "older.json", _without_prompt_lists)
    assert [len(b["prompts"]) for b in merge_eval_results([shards["s0"], older])["benchmarks"].values()] == [3, 4]


def test_a_shard_past_the_end_of_a_shorter_benchmark_is_no_gap(shards):
    merged = merge_eval_results([shards["s4"], shards["s2"], shards["s0"]])
    assert {name: len(bench["prompts"]) for name, bench in merged["benchmarks"].items()} == {"eval_prompts": 3,
                                                                                            "longer": 5}
    # Prompts 2.. of both benchmarks in no shard: a gap, even in the one that ends before s4's offset.
    with pytest.raises(MergeError, match=r"eval_prompts: .*s0.json ends at prompt 2 but .*s4.json starts at --offset 4: "
                                         r"prompts 2\.\.2 are in no shard; evaluate them \(--offset 2 --limit 1\)"):
        merge_eval_results([shards["s0"], shards["s4"]])


def test_a_merged_file_merges_again_as_its_shards_would(shards, tmp_path, capsys):
    merged_path = tmp_path / "m.json"
    assert cli.main(["eval-merge", f"{shards['s2']},{shards['s0']}", "--json", str(merged_path)]) == 0
    merged = json.loads(merged_path.read_text())
    shard = json.loads(shards["s0"].read_text())
    assert merged["config"] == {**{k: v for k, v in shard["config"].items() if k != "json"}, "offset": 0, "limit": 4}
    assert {name: bench["prompt_list"] for name, bench in merged["benchmarks"].items()} == {
        name: bench["prompt_list"] for name, bench in shard["benchmarks"].items()}

    again, whole = merge_eval_results([shards["s4"], merged_path]), merge_eval_results(list(shards.values()))
    assert again["benchmarks"] == whole["benchmarks"] and again["config"] == whole["config"]
    assert whole["config"]["offset"] == 0 and whole["config"]["limit"] == 6
    assert [len(bench["prompts"]) for bench in again["benchmarks"].values()] == [3, 5]
    # What a merge checks, it checks against a merged file too.
    with pytest.raises(MergeError, match="shards overlap"):
        merge_eval_results([merged_path, shards["s2"]])
    hotter = _edited(shards["s4"], tmp_path / "hot.json", _setting("max_new_tokens", 8))
    with pytest.raises(MergeError, match=rf"max_new_tokens is 8 in {hotter} but 4 in {merged_path}: not one run"):
        merge_eval_results([merged_path, hotter])
    # A merge written before merged files kept their settings cannot be checked: refused, saying so.
    older = _edited(merged_path, tmp_path / "older.json", _without_config)
    assert cli.main(["eval-merge", f"{older},{shards['s4']}"]) == 2
    assert _one_error_line(capsys) == (f"dflash-train eval-merge: {older} records no settings (a file of an older "
                                       "eval-merge?): merge the shards it was made of instead")


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


MALFORMED = {
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8 text"),
    "not JSON": (b"{benchmarks", "not JSON"),
    "a number": (b"5", "not an object"),
    "a string naming the keys": (b'"benchmarks, block_size"', "not an object"),
    "nested too deeply": (_nested(100_000), "nested too deeply"),
    "benchmarks a list": (b'{"benchmarks": [], "block_size": 4}', "benchmarks is not an object"),
    "a record without id": (b'{"benchmarks": {"p": {"prompts": [{}]}}, "block_size": 4}',
                            "benchmark p: prompt record 0 has no id"),
    "a record without its token count": (b'{"benchmarks": {"p": {"prompts": [{"id": "a"}]}}, "block_size": 4}',
                                         "benchmark p: prompt record 0 has no prompt_tokens"),
    "acceptance lengths a string": (
        b'{"benchmarks": {"p": {"prompts": [{"id": "a", "prompt_tokens": 3, "acceptance_lengths": "xy"}]}},'
        b' "block_size": 4}', "benchmark p: prompt record 0: acceptance_lengths is 'xy'"),
    "block size a string": (b'{"benchmarks": {}, "block_size": "4"}', "block_size is '4', not a positive whole number"),
    "block size beyond any drafter's": (b'{"benchmarks": {}, "block_size": 1000000000000}',
                                        "block_size is 1000000000000, not a positive whole number up to 65536"),
    "offset a word": (b'{"benchmarks": {}, "block_size": 4, "config": {"offset": "x"}}',
                      "config.offset is 'x', not a whole number"),
    "pair a string": (b'{"benchmarks": {}, "block_size": 4, "config": {}, "pair": "x"}', "pair is not an object"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_shard_is_one_line_naming_it(name, tmp_path, capsys):
    content, why = MALFORMED[name]
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert cli.main(["eval-merge", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dflash-train eval-merge: {bad}: not a --json file of `dflash-train eval` ({why}"), err
    assert len(err.strip().splitlines()) == 1, err


def test_a_real_shard_beside_a_malformed_one_names_the_malformed_one(shards, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    shutil.copy(shards["s0"], bad)
    bad.write_bytes(bad.read_bytes()[:-40])  # cut short, as by a full disk
    assert cli.main(["eval-merge", f"{shards['s2']},{bad}"]) == 2
    assert _one_error_line(capsys).startswith(f"dflash-train eval-merge: {bad}: not a --json file of "
                                              "`dflash-train eval` (not JSON: ")
