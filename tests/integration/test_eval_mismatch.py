"""Mismatches refused (issue #14, items 6 and 7): a drafter of another vocabulary, a target whose
LM head is missing from its files, a target folder given as `--drafter`, and eval shards of
different drafters or targets given to `eval-merge`, and one live `eval-merge` per --json. Real
tiny models saved as real folders, run through the real CLI (in real processes where two meet).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from dflash_train.export.hf import export_model
from dflash_train.target.model import Target, TargetError, load_target
from safetensors.torch import load_file, save_file
from processes import hidden_copies, paused_cli
from test_decode_loop import char_tokenizer, random_drafter

from dflash_train import cli
from dflash_train.eval.merge import MergeError, merge_eval_results

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "tests" / "data" / "eval_prompts.jsonl"
pytestmark = pytest.mark.usefixtures("one_thread")


def _save_target(folder: Path, *, vocab: int = 104, seed: int = 0, tie: bool = False) -> transformers.PreTrainedModel:
    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """target/ and a fine-tune of it (same config, other weights), a drafter for it, another
    drafter for it, and a drafter for a 128-token-vocabulary target of the same shape."""
    root = tmp_path_factory.mktemp("mismatch")
    mask = char_tokenizer().mask_token_id
    target = _save_target(root / "target")
    _save_target(root / "finetune", seed=1)
    wide = _save_target(root / "wide-target", vocab=128)
    export_model(random_drafter(Target(target), layer_ids=(0, 2), mask_token_id=mask), root / "drafter", dtype=torch.float32)
    export_model(random_drafter(Target(target), layer_ids=(0, 2), mask_token_id=mask, seed=2), root / "drafter2",
                 dtype=torch.float32)
    export_model(random_drafter(Target(wide), layer_ids=(0, 2), mask_token_id=mask), root / "wide-drafter",
                 dtype=torch.float32)
    return root


def _eval(target: Path, drafter: Path, *extra: str) -> list[str]:
    return ["eval", "--target", str(target), "--drafter", str(drafter), "--bench", str(PROMPTS),
            "--max-new-tokens", "4", "--device", "cpu", *extra]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_eval_refuses_a_drafter_of_another_vocabulary(models, capsys):
    assert cli.main(_eval(models / "target", models / "wide-drafter", "--limit", "1")) == 2
    line = _one_error_line(capsys)
    assert line == ("dflash-train eval: the drafter does not fit this target: vocabulary of 128 tokens vs the "
                    "target's 104"), line
    assert cli.main(_eval(models / "target", models / "drafter", "--limit", "1")) == 0  # the matching pair runs
    capsys.readouterr()


def test_eval_with_a_target_folder_as_drafter_is_one_line(models, capsys):
    assert cli.main(_eval(models / "target", models / "finetune")) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"dflash-train eval: --drafter {models / 'finetune'}: not a DFlash drafter (its config.json has "
                           "architectures ['LlamaForCausalLM'] and no dflash_config"), line


def test_eval_names_missing_drafter_weights(models, tmp_path, capsys):
    broken = tmp_path / "drafter"
    broken.mkdir()
    (broken / "config.json").write_bytes((models / "drafter" / "config.json").read_bytes())
    weights = load_file(str(models / "drafter" / "model.safetensors"))
    del weights["fc.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    assert cli.main(_eval(models / "target", broken)) == 2
    assert _one_error_line(capsys) == f"dflash-train eval: {broken}: weights missing from the export: ['fc.weight']"


def _without_head(source: Path, folder: Path) -> Path:
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(folder / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_target_saved_without_its_lm_head_is_refused(models, tmp_path, capsys):
    headless = _without_head(models / "target", tmp_path / "headless")
    assert json.loads((headless / "config.json").read_text())["tie_word_embeddings"] is False
    with pytest.raises(TargetError, match=r"weights missing from the model files: lm_head\.weight; .*random values\. "
                                          r"The LM head is not stored and tie_word_embeddings is false"):
        load_target(headless)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi?"},
                                             {"role": "assistant", "content": "Hello there, friend."}]}) + "\n")
    code = cli.main(["train", "--target", str(headless), "--data", str(data), "--out", str(tmp_path / "run"),
                     "--steps", "1", "--batch-size", "1", "--device", "cpu"])
    assert code == 2
    assert "lm_head.weight" in _one_error_line(capsys)
    assert not (tmp_path / "run" / "checkpoints").exists()

    # A head that is the embedding (tied) is not stored, and such a model is complete.
    _save_target(tmp_path / "tied", tie=True)
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    tied = load_target(tmp_path / "tied")
    assert tied.head_weight.data_ptr() == tied.embed_weight.data_ptr()


# --------------------------------------------------------------------------------------------
# eval-merge: shards must have measured one drafter on one target
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(models, tmp_path_factory) -> dict[str, Path]:
    """The second prompt of the file measured four ways, and its first prompt once: only
    'first' + 'second' belong to one run."""
    root = tmp_path_factory.mktemp("shards")
    runs = {
        "first": (models / "target", models / "drafter", 0),
        "second": (models / "target", models / "drafter", 1),
        "other-drafter": (models / "target", models / "drafter2", 1),
        "other-target": (models / "finetune", models / "drafter", 1),
    }
    for name, (target, drafter, offset) in runs.items():
        out = root / f"{name}.json"
        assert cli.main(_eval(target, drafter, "--offset", str(offset), "--limit", "1", "--no-baseline",
                              "--json", str(out))) == 0
    return {name: root / f"{name}.json" for name in runs}


def test_eval_records_the_drafter_and_target_it_measured(shards, models):
    pair = json.loads(shards["first"].read_text())["pair"]
    assert pair["drafter"]["path"] == str((models / "drafter").resolve())
    assert pair["target"]["path"] == str((models / "target").resolve())
    assert len(pair["drafter"]["weights_sha256"]) == len(pair["target"]["weights_fingerprint"]) == 64
    merged = merge_eval_results([shards["second"], shards["first"]])
    assert merged["pair"] == pair and merged["shards"] == [str(shards["first"]), str(shards["second"])]


@pytest.mark.parametrize("other,role", [("other-drafter", "drafter"), ("other-target", "target")])
def test_eval_merge_refuses_shards_of_another_drafter_or_target(shards, other, role, capsys):
    with pytest.raises(MergeError, match=rf"measured {role} .* and they differ \(.*\): not one {role}"):
        merge_eval_results([shards["first"], shards[other]])
    assert cli.main(["eval-merge", f"{shards['first']},{shards[other]}"]) == 2
    assert f"not one {role}" in _one_error_line(capsys)


def test_eval_merge_refuses_a_shard_without_the_record(shards, tmp_path):
    old = json.loads(shards["second"].read_text())
    del old["pair"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(MergeError, match=r"old.json does not record which drafter and target it measured"):
        merge_eval_results([shards["first"], tmp_path / "old.json"])


def test_eval_merge_refuses_a_gap_between_shards(shards, models, tmp_path, capsys):
    """Prompt 0 and prompt 2 measured, prompt 1 in no shard: not one run's numbers (D13)."""
    third = tmp_path / "third.json"
    assert cli.main(_eval(models / "target", models / "drafter", "--offset", "2", "--limit", "1", "--no-baseline",
                          "--json", str(third))) == 0
    capsys.readouterr()
    assert cli.main(["eval-merge", f"{third},{shards['first']}"]) == 2
    line = _one_error_line(capsys)
    assert f"ends at prompt 1 but {third} starts at --offset 2: prompts 1..1 are in no shard" in line, line
    merged = merge_eval_results([shards["first"], shards["second"], third])  # the gap filled: one run
    assert [p["id"] for p in next(iter(merged["benchmarks"].values()))["prompts"]] == [
        p["id"] for s in (shards["first"], shards["second"], third)
        for p in next(iter(json.loads(s.read_text())["benchmarks"].values()))["prompts"]]


def test_eval_merge_given_a_folder_is_one_line(tmp_path, capsys):
    assert cli.main(["eval-merge", str(tmp_path)]) == 2
    assert f"{tmp_path}: a folder" in _one_error_line(capsys)


def test_two_eval_merge_processes_never_share_a_json(shards, tmp_path, capsys):
    """A second `eval-merge --json F` while another live one writes F is refused, naming its pid,
    before it reads a shard, and writes nothing. The first, killed (-9) just before its file took
    its name, leaves only a hidden copy; the next merge frees the lock, removes that copy and writes F."""
    out = tmp_path / "merged.json"
    args = ["eval-merge", f"{shards['first']},{shards['second']}", "--json", str(out)]
    environment = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with paused_cli(args, "before_final_link") as first:
        second = subprocess.run([sys.executable, "-m", "dflash_train.cli", *args], capture_output=True, text=True,
                                env=environment, timeout=120, check=False)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().startswith(f"dflash-train eval-merge: --json {out} is in use by another live "
                                                f"process (pid {first.pid}: "), second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        first.kill()
    left = sorted(p.name for p in tmp_path.iterdir())
    hidden_copy = hidden_copies(tmp_path, "merged.json")
    assert len(hidden_copy) == 1 and set(left) <= {".merged.json.lock", *hidden_copy}, left  # no merged*.json
    assert cli.main(args) == 0
    assert f"removed {tmp_path / hidden_copy[0]}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.json"]
    assert json.loads(out.read_text())["shards"] == [str(shards["first"]), str(shards["second"])]


def test_an_eval_killed_while_writing_its_json_is_cleaned_by_the_next(models, tmp_path, capsys):
    """`eval --json F` killed (-9) as its file was about to take its name leaves a hidden copy
    `.F.XXXXXXXX.tmp`; the next eval of F removes it, says so, and writes F (nothing else is left)."""
    out = tmp_path / "eval.json"
    args = _eval(models / "target", models / "drafter", "--limit", "1", "--no-baseline", "--json", str(out))
    with paused_cli(args, "before_final_link") as killed:
        killed.kill()
    hidden_copy = hidden_copies(tmp_path, "eval.json")
    assert len(hidden_copy) == 1 and not out.exists(), sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert cli.main(args) == 0
    assert f"removed {tmp_path / hidden_copy[0]}: the unfinished copy a killed write left" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]
    assert json.loads(out.read_text())["pair"]["drafter"]["path"] == str((models / "drafter").resolve())


def test_a_json_whose_name_and_every_numbered_name_appeared_is_one_line(shards, tmp_path):
    """If F and F.1 ... F.999 all appear while `eval-merge --json F` runs (it never overwrites, and
    writes beside a file that took its name), it says so in one line naming --json F, exit 2,
    and leaves nothing of its own: no hidden copy, no lock."""
    out = tmp_path / "merged.json"
    with paused_cli(["eval-merge", f"{shards['first']},{shards['second']}", "--json", str(out)],
                    "before_final_link") as merge:
        for n in range(1000):
            (tmp_path / ("merged.json" if n == 0 else f"merged.{n}.json")).write_text("theirs")
        merge.send_signal(signal.SIGUSR1)  # go on
        _, err = merge.communicate(timeout=120)
    assert merge.returncode == 2, err
    assert err.strip().splitlines()[-1] == (
        f"dflash-train eval-merge: --json {out}: cannot write it: it and every numbered name beside it "
        "(merged.1.json to merged.999.json) exist; nothing was written (move some away, or choose another --json)"), err
    assert "Traceback" not in err, err
    assert len(list(tmp_path.iterdir())) == 1000 and {p.read_text() for p in tmp_path.iterdir()} == {"theirs"}


def test_a_failed_eval_leaves_no_folder_it_made_for_its_json(models, tmp_path, capsys):
    """`eval --json new/dir/F` that fails before writing F (here: a benchmark that does not exist)
    removes the folders it made for F; a folder that was there before stays."""
    (tmp_path / "mine").mkdir()
    for out in (tmp_path / "new" / "dir" / "eval.json", tmp_path / "mine" / "new" / "eval.json"):
        args = _eval(models / "target", models / "drafter", "--json", str(out))
        args[args.index("--bench") + 1] = str(tmp_path / "no-such-prompts.jsonl")
        assert cli.main(args) == 2
        assert "no-such-prompts.jsonl" in _one_error_line(capsys)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["mine"]
