"""The default prompt set: 100k+ prompts from the installed packages, capped, deduplicated,
decontaminated against the real benchmarks, split train/dev, cached."""

import collections
import gzip
import io
import json
import re

import pytest
from dflash_train.data.prompts.registry import OVER_TASK_CAP, evals_registry_dir
from dflash_train.data.prompts.sets import (
    DEV_PER_MILLE,
    OVERLAP,
    SOURCES,
    PromptSetSettings,
    build_prompt_set,
    in_dev_split,
    prompt_text,
    select_split,
)

from dflash_train.commands._common import benchmark_prompt_texts
from dflash_train.commands.regenerate import RegenerateConfig, read_input_prompts
from dflash_train.data.decontaminate import NGRAM, Decontaminator, normalized_key, normalized_words
from dflash_train.data.readers import Prompt

# Real tasks: open prompts (linear-regression, knot-theory), short-answer ones throughout
# (chinese_ancient_masterpieces_dynasty), several files in one task (theory_of_mind).
SUBSET_TASKS = ["chinese_ancient_masterpieces_dynasty", "knot-theory", "linear-regression", "theory_of_mind"]


@pytest.fixture(scope="module")
def benchmarks():
    return benchmark_prompt_texts()


@pytest.fixture(scope="module")
def default_set(default_prompt_set):
    """The real default set (tests/conftest.py: built once per machine, read from the cache after)."""
    return default_prompt_set


def small_registry(root, planted_rows=()):
    root.mkdir()
    for task in SUBSET_TASKS:
        (root / task).symlink_to(evals_registry_dir() / task, target_is_directory=True)
    if planted_rows:
        (root / "planted").mkdir()
        lines = [json.dumps({"input": [{"role": "user", "content": text}], "ideal": ""}) for text in planted_rows]
        (root / "planted" / "samples.jsonl").write_text("\n".join(lines) + "\n")
    return root


def files_of(prompts):
    return collections.Counter(p.id.rsplit(":", 1)[0] for p in prompts)


def test_default_set_has_100k_unique_capped_clean_prompts(default_set, benchmarks):
    prompt_set = default_set
    print("\n" + prompt_set.summary())
    train = prompt_set.split("train")
    assert len(train) >= 100_000  # 113,035 with evals 3.0.1.post1, reasoning-gym 0.1.25, Python 3.11
    assert len({p.id for p in prompt_set.prompts}) == len(prompt_set.prompts)
    assert len({normalized_key(prompt_text(p)) for p in prompt_set.prompts}) == len(prompt_set.prompts)
    counts = prompt_set.counts()
    assert counts["evals"] >= 40_000 and counts["evals-short-answer"] >= 50_000
    assert counts["python-stdlib"] >= 2_000 and counts["reasoning-gym"] >= 3_000
    stats = prompt_set.stats
    assert stats.used == len(prompt_set.prompts) and stats.used + stats.skipped == stats.read
    evals = [p for p in prompt_set.prompts if prompt_set.source_of[p.id].startswith("evals")]
    short = [p for p in evals if prompt_set.source_of[p.id] == "evals-short-answer"]
    assert max(files_of(evals).values()) <= 2000 and max(files_of(short).values()) <= 1000
    assert max(collections.Counter(p.id.split("/")[1] for p in evals).values()) <= 5000
    assert len({p.id.split("/")[1] for p in evals}) >= 300  # tasks
    # Open-ended and code prompts first, the short-answer ones after them; any prefix is varied:
    # the first registry prompts are one of each task, and the first 10k hold the code prompts'
    # share of the open part.
    kinds = [prompt_set.source_of[p.id] == "evals-short-answer" for p in prompt_set.prompts]
    assert kinds == sorted(kinds)
    open_evals = [p.id.split("/")[1] for p in prompt_set.prompts if prompt_set.source_of[p.id] == "evals"]
    tasks = set(open_evals)
    assert len(tasks) >= 100 and len(set(open_evals[:len(tasks)])) == len(tasks)
    open_part = prompt_set.prompts[:kinds.index(True)]
    for source in ("python-stdlib", "python-packages", "reasoning-gym"):
        share = sum(prompt_set.source_of[p.id] == source for p in open_part) / len(open_part)
        assert abs(sum(prompt_set.source_of[p.id] == source for p in open_part[:10_000]) / 10_000 - share) < 0.002
    # Nothing left overlaps a benchmark (every 20th prompt: the filter is checked in full elsewhere).
    decontaminator = Decontaminator(benchmarks)
    assert not [p.id for p in prompt_set.prompts[::20] if decontaminator.match(prompt_text(p))]
    assert stats.skipped_by_reason[OVERLAP] == sum(prompt_set.overlaps.values()) > 0


def test_dev_split_is_a_stable_one_percent_never_in_train(default_set):
    prompts = default_set.prompts
    train, dev = default_set.split("train"), default_set.split("dev")
    assert len(train) + len(dev) == len(prompts)
    assert not {p.id for p in train} & {p.id for p in dev}
    assert abs(len(dev) / len(prompts) - DEV_PER_MILLE / 1000) < 0.002
    assert all(n > 0 for n in default_set.counts(dev).values()) and len(default_set.counts(dev)) == len(SOURCES)
    # The build's split (from the normalised texts it worked out once) is the rule's, prompt by prompt.
    assert all(in_dev_split(p) for p in dev) and not any(in_dev_split(p) for p in train[::40])
    # Membership follows the normalised text alone: another id, spacing or case does not move a prompt.
    for prompt in dev[:20] + train[:20]:
        text = prompt_text(prompt)
        twin = Prompt("elsewhere:1", [{"role": "user", "content": "  " + text.upper() + " "}], "elsewhere:1")
        assert in_dev_split(twin) == in_dev_split(prompt)
    # What regenerate reads: --split train (the default) never holds a dev prompt, --split dev only those.
    dev_ids = {p.id for p in dev}
    taken, stats = read_input_prompts(RegenerateConfig(prompts="default", out="x.jsonl"))
    assert len(taken) == len(train) and not {p.id for p in taken} & dev_ids and stats.read == len(taken)
    taken, _ = read_input_prompts(RegenerateConfig(prompts="default", out="x.jsonl", split="dev", limit=50))
    assert [p.id for p in taken] == [p.id for p in dev[:50]]


def test_split_of_a_prompt_file_is_accounted(tmp_path, default_set):
    rows = default_set.split("dev")[:3] + default_set.split("train")[:5]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in rows))
    taken, stats = read_input_prompts(RegenerateConfig(prompts=str(path), out="x.jsonl", split="dev"))
    assert [p.id for p in taken] == [p.id for p in rows[:3]]
    assert stats.read == 8 and stats.skipped_by_reason["not in the dev split"] == 5
    taken, _ = read_input_prompts(RegenerateConfig(prompts=str(path), out="x.jsonl"))  # auto: a file is used whole
    assert len(taken) == 8


def test_planted_benchmark_prompts_are_dropped_and_counted(tmp_path, benchmarks):
    humaneval = benchmarks["humaneval"][3]
    mtbench_words = normalized_words(benchmarks["mtbench"][10])
    shared = " ".join(mtbench_words[2:2 + NGRAM])
    near_miss = " ".join(mtbench_words[2:2 + NGRAM - 1])
    planted = [
        humaneval.replace("\n", "\n\n"),  # an exact copy, spaced out
        f"My teacher wrote this on the board today: {shared}. Could you explain it to me in simple terms?",
        f"My teacher wrote this on the board today: {near_miss}. Could you explain it to me in simple terms?",
        "Write a short story about a lighthouse keeper who befriends a seagull, in about two hundred words.",
    ]
    code = Prompt("python-stdlib/fake.py:f", [{"role": "user", "content": benchmarks["humaneval"][9]}], "fake.py:1")
    registry = small_registry(tmp_path / "registry", planted)
    prompt_set = build_prompt_set(benchmarks, PromptSetSettings(max_per_file=50, max_short_per_file=10, max_per_task=80),
                                  registry_dir=registry, code_sources=[("python-stdlib", lambda: [code])])
    assert prompt_set.overlaps == {("evals", "humaneval"): 1, ("evals", "mtbench"): 1, ("python-stdlib", "humaneval"): 1}
    kept = {p.id for p in prompt_set.prompts}
    assert {"evals/planted/samples.jsonl:3", "evals/planted/samples.jsonl:4"} <= kept  # the near miss stays
    assert not {"evals/planted/samples.jsonl:1", "evals/planted/samples.jsonl:2", code.id} & kept
    summary = prompt_set.summary()
    assert "dropped for benchmark overlap (exact or 13-gram): 3 (humaneval 2, mtbench 1)" in summary
    assert prompt_set.stats.skipped_by_reason[OVERLAP] == 3


def test_caps_per_file_and_task_open_prompts_first(tmp_path, benchmarks):
    registry = small_registry(tmp_path / "registry")
    settings = PromptSetSettings(seed=3, max_per_file=6, max_short_per_file=2, max_per_task=9)
    prompt_set = build_prompt_set(benchmarks, settings, registry_dir=registry, code_sources=[])
    per_file = files_of(prompt_set.prompts)
    short = [p for p in prompt_set.prompts if prompt_set.source_of[p.id] == "evals-short-answer"]
    assert max(per_file.values()) <= 6 and max(files_of(short).values()) <= 2
    per_task = collections.Counter(p.id.split("/")[1] for p in prompt_set.prompts)
    assert per_task["theory_of_mind"] == 9 and prompt_set.stats.skipped_by_reason[OVER_TASK_CAP] > 0
    assert per_task["chinese_ancient_masterpieces_dynasty"] == 2  # short-answer throughout: its short quota only
    assert per_task["linear-regression"] == 6 and not files_of(short)["evals/linear-regression/samples.jsonl"]
    stats = prompt_set.stats
    assert stats.used == len(prompt_set.prompts) and stats.used + stats.skipped == stats.read
    log = io.StringIO()
    again = build_prompt_set(benchmarks, settings, registry_dir=registry,
                             code_sources=[("reasoning-gym", lambda: [])], log=log)
    # Progress: the workers' judging as one line (they report only at the end), then the tasks, then each code source.
    lines = log.getvalue().splitlines()
    judged = next(i for i, line in enumerate(lines) if re.fullmatch(r"evals registry: rows judged in [\d.]+ s \(\d+ worker processes\)", line))
    tasks = next(i for i, line in enumerate(lines) if line.startswith("evals registry tasks [") and f"{len(list(registry.iterdir()))}/" in line)
    assert judged < tasks < lines.index("reasoning-gym: 0 prompts (0.0 s)"), lines
    other = build_prompt_set(benchmarks, PromptSetSettings(seed=4, max_per_file=6, max_short_per_file=2, max_per_task=9),
                             registry_dir=registry, code_sources=[])
    assert [p.id for p in again.prompts] == [p.id for p in prompt_set.prompts]
    assert {p.id for p in other.prompts} != {p.id for p in prompt_set.prompts}


def test_the_built_set_is_cached_atomically_and_keyed_by_settings(tmp_path, benchmarks):
    registry = small_registry(tmp_path / "registry")
    cache = tmp_path / "cache"
    settings = PromptSetSettings(max_per_file=4, max_short_per_file=1, max_per_task=6)
    built = build_prompt_set(benchmarks, settings, registry_dir=registry, code_sources=[], cache_dir=cache)
    files = list((cache / "prompts").iterdir())
    assert not built.from_cache and [f.name for f in files] == [built.cache_file.name]  # no temporary left behind
    read = build_prompt_set(benchmarks, settings, registry_dir=registry, code_sources=[], cache_dir=cache)
    assert read.from_cache and read.prompts == built.prompts and read.source_of == built.source_of
    assert read.stats.skipped_by_reason == built.stats.skipped_by_reason and read.stats.read == built.stats.read
    other = build_prompt_set(benchmarks, PromptSetSettings(max_per_file=5), registry_dir=registry, code_sources=[],
                             cache_dir=cache)
    assert other.cache_file != built.cache_file and not other.from_cache
    changed = dict(benchmarks, mtbench=benchmarks["mtbench"][:-1])  # another benchmark text: another key
    assert build_prompt_set(changed, settings, registry_dir=registry, code_sources=[], cache_dir=cache).cache_file != built.cache_file
    built.cache_file.write_bytes(gzip.compress(b"{not json"))
    log = io.StringIO()
    rebuilt = build_prompt_set(benchmarks, settings, registry_dir=registry, code_sources=[], cache_dir=cache, log=log)
    assert not rebuilt.from_cache and rebuilt.prompts == built.prompts and "unreadable prompt cache" in log.getvalue()


def test_select_split_refuses_unknown_names():
    with pytest.raises(ValueError, match="split 'test'"):
        select_split([], "test")


def test_prompts_command_writes_a_reusable_file_and_never_overwrites(tmp_path, default_set, capsys):
    from dflash_train.cli import main
    from dflash_train.data.readers import read_prompts

    out = tmp_path / "dev.jsonl"
    assert main(["prompts", "--split", "dev", "--limit", "25", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "taken (dev)" in printed and "dropped for benchmark overlap" in printed and "wrote 25 dev prompts" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == [p.id for p in default_set.split("dev")[:25]]
    assert {row["source"] for row in rows} <= set(SOURCES)
    assert [p.messages for p in read_prompts(out, strict=True)] == [row["messages"] for row in rows]
    before = out.read_bytes()
    assert main(["prompts", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["prompts", "--split", "test"]) == 2
    assert "dflash-train prompts: --split 'test': use train, dev, all" in capsys.readouterr().err
