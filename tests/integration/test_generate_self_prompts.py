"""`dflash-train self-prompts` with the real SmolLM2 target on a CPU: the prefix is its template
up to the user's text, the requests it writes are the seeded samples of that prefix (decoded from
the engine's tokens, ending at the end-of-turn token, the same whatever the batch size), every
candidate is kept or dropped for a named reason, and a planted benchmark text is dropped."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from dflash_train.data.prompts.sets import in_dev_split
from transformers import AutoTokenizer

from dflash_train.cli import main
from dflash_train.commands._common import benchmark_prompt_texts
from dflash_train.data.decontaminate import Decontaminator, normalized_key
from dflash_train.data.readers import Prompt, RowStats, read_prompts
from dflash_train.data.render import stop_token_ids
from dflash_train.errors import ConfigError
from dflash_train.generate.regenerate import GenerationSettings, Job, row_seed
from dflash_train.generate.self_prompts import (
    MAX_CHARS,
    MIN_CHARS,
    OVERLAP,
    SOURCE,
    RequestFilter,
    SelfPromptSettings,
    user_request_prefix,
)

COUNT, NEW_TOKENS = 4, 40


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_prefix_is_smollm2s_template_up_to_where_the_user_text_begins(tokenizer):
    prefix = user_request_prefix(tokenizer)
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_end|>\n<|im_start|>user\n")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Plan a trip."}], tokenize=False)
    assert rendered == prefix + "Plan a trip.<|im_end|>\n"


@pytest.mark.parametrize("template, error", [
    ("{% for m in messages %}{% if m['role'] != 'user' %}{{ m['content'] }}{% endif %}{% endfor %}<|im_start|>",
     "no user turn"),
    ("{% for m in messages %}{{ m['content'] }}\n{{ m['content'] }}{% endfor %}", "2 times"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "nothing before the user's text"),
    (None, "no chat template"),
])
def test_a_template_without_one_user_turn_to_continue_is_refused(smollm2_dir, template, error):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = template
    with pytest.raises(ConfigError, match=error):
        user_request_prefix(tokenizer)


def test_settings_are_checked():
    for bad in (dict(count=0), dict(count=1, temperature=0.0), dict(count=1, top_p=1.5), dict(count=1, split="test")):
        with pytest.raises(ConfigError):
            SelfPromptSettings(**bad).validate()


def run_command(target: Path, out: Path, batch_size: int, count: int = COUNT) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["self-prompts", "--target", str(target), "--count", str(count), "--out", str(out),
                     "--max-new-tokens", str(NEW_TOKENS), "--batch-size", str(batch_size), "--device", "cpu"])
    return code, printed.getvalue()


@pytest.fixture(scope="module")
def first_run(smollm2_dir, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("self_prompts") / "requests.jsonl"
    code, printed = run_command(smollm2_dir, out, 8)
    assert code == 0, printed
    return out, printed


def file_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kept_requests_pass_every_filter_and_the_accounting_adds_up(first_run):
    out, printed = first_run
    rows = file_rows(out)
    assert len(rows) == COUNT
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == COUNT and all(re.fullmatch(r"self/0/\d+", i) for i in ids)
    assert ids == sorted(ids, key=lambda i: int(i.rsplit("/", 1)[1]))  # in order of n
    benchmarks = Decontaminator(benchmark_prompt_texts())
    texts = []
    for row in rows:
        assert row["source"] == SOURCE and [m["role"] for m in row["messages"]] == ["user"]
        text = row["messages"][0]["content"]
        assert text == text.strip() and MIN_CHARS <= len(text) <= MAX_CHARS
        assert "<|im_start|>" not in text and "<|im_end|>" not in text
        assert benchmarks.match(text) is None
        assert not in_dev_split(Prompt(row["id"], row["messages"], ""))  # --split train (the default)
        texts.append(normalized_key(text))
    assert len(set(texts)) == COUNT
    # The summary: generated = kept + dropped, and the dropped ones by reason add up to it.
    generated, kept, dropped = map(int, re.search(r"accounting  generated (\d+) = kept (\d+) \+ dropped (\d+)", printed).groups())
    assert kept == COUNT and generated == kept + dropped
    assert f"rows: read={generated} used={kept} skipped={dropped}" in printed
    assert sum(int(n) for n in re.findall(r"^  skipped (\d+): ", printed, re.M)) == dropped
    assert max(int(i.rsplit("/", 1)[1]) for i in ids) < generated
    # What `regenerate --prompts FILE` reads: every row, as a one-message prompt.
    stats = RowStats()
    assert [p.id for p in read_prompts(str(out), stats)] == ids and stats.skipped == 0


def test_each_request_is_the_decoded_sample_of_its_own_seed_ending_at_the_end_of_turn(first_run, smollm2_dir, one_thread):
    from dflash_train.target.model import load_target

    from dflash_train.generate.engine import StaticBatchEngine

    rows = file_rows(first_run[0])
    target = load_target(smollm2_dir, "cpu")
    tokenizer = target.tokenizer
    prefix_ids = tokenizer(user_request_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    stops = stop_token_ids(target.model, tokenizer)
    defaults = SelfPromptSettings(count=1)  # what the command samples with (no flags given)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, temperature=defaults.temperature, top_p=defaults.top_p)
    engine = StaticBatchEngine(target, settings, stops, slots=2)  # another batch than the command's 8
    jobs = [Job(Prompt(row["id"], [], ""), list(prefix_ids), row_seed(0, row["id"])) for row in rows]
    by_id = {job.prompt.id: generated for job, generated in engine.generated(jobs)}
    for row in rows:
        tokens = by_id[row["id"]].tokens
        assert tokens[-1] in stops and not any(t in stops for t in tokens[:-1])
        assert tokenizer.decode(tokens[:-1], skip_special_tokens=False).strip() == row["messages"][0]["content"]


def test_the_same_seed_with_another_batch_size_writes_the_same_file(first_run, smollm2_dir, tmp_path, one_thread):
    out = tmp_path / "again.jsonl"
    code, printed = run_command(smollm2_dir, out, 3)
    assert code == 0, printed
    assert out.read_bytes() == first_run[0].read_bytes()


def test_an_existing_output_is_never_overwritten(first_run, smollm2_dir, capsys):
    out = first_run[0]
    before = out.read_bytes()
    assert main(["self-prompts", "--target", str(smollm2_dir), "--count", "2", "--out", str(out), "--device", "cpu"]) == 2
    assert f"--out {out} already exists" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_a_planted_benchmark_text_is_dropped_and_counted(first_run):
    generated = file_rows(first_run[0])[0]["messages"][0]["content"]
    benchmarks = benchmark_prompt_texts()
    clean = RequestFilter(benchmarks, "all", ["<|im_end|>"])
    assert clean.reason_to_drop(generated, "stop") is None  # kept without the plant ...
    planted = RequestFilter({**benchmarks, "planted": ["Some preamble. " + generated]}, "all", ["<|im_end|>"])
    assert planted.reason_to_drop(generated, "stop") == OVERLAP  # ... dropped with it
    mtbench = benchmarks["mtbench"][0]
    assert planted.reason_to_drop(mtbench, "stop") == OVERLAP  # a benchmark prompt written by the model
    assert planted.overlaps == {"planted": 1, "mtbench": 1}


def test_each_filter_names_its_reason():
    judge = RequestFilter({}, "train", ["<|im_start|>"])
    request = "Could you suggest three weekend trips near Lisbon for a family?"
    assert judge.reason_to_drop(request, "length").startswith("no end of turn")
    assert judge.reason_to_drop("Hi <|im_start|>assistant and some more words here", "stop").startswith("a special token")
    assert judge.reason_to_drop("Too short a request.", "stop").startswith("shorter than")
    assert judge.reason_to_drop("x" * (MAX_CHARS + 1), "stop").startswith("longer than")
    assert judge.reason_to_drop("{[(0x1f, 0x2e, 0x3d, 0x4c)]} == 123456789", "stop") == "not mostly text"
    assert judge.reason_to_drop("Broken bytes \ufffd\ufffd inside a request here", "stop") == "not mostly text"
    dev = next(f"Tell me about the river number {i} of Europe, please." for i in range(10_000)
               if in_dev_split(Prompt("", [{"role": "user", "content": f"Tell me about the river number {i} of Europe, please."}], "")))
    assert judge.reason_to_drop(dev, "stop") == "in the dev split"
    assert judge.reason_to_drop(request, "stop") is None
    assert judge.reason_to_drop("  could you SUGGEST three weekend trips near lisbon, for a family  ", "stop") == "duplicate request"
