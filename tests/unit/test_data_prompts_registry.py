"""Default training prompts, read from the installed OpenAI evals registry (real data, not a copy)."""

import collections
import gzip
import json
import random
import warnings

import pytest
from data_files import REGENERATED_4000, WITHOUT_REGENERATED_4000
from transformers import AutoTokenizer

from dflash_train.data.prompts.registry import (
    MAX_PROMPT_CHARS,
    MIN_PROMPT_CHARS,
    asks_for_short_answer,
    capped_registry_prompts,
    evals_registry_dir,
    looks_like_junk,
    prompt_rejection,
    ScanLimits,
    _scanned_file,
)
from dflash_train.data.decontaminate import normalized_key
from dflash_train.data.readers import RowStats

SUBSET_TASKS = ["chinese_ancient_masterpieces_dynasty", "knot-theory", "linear-regression", "ral_to_hex"]


def text_of(prompt) -> str:
    return "\n".join(m["content"] for m in prompt.messages)


def capped(registry_dir=None, seed=0, *, per_file=20, short_per_file=10, per_task=100, workers=None, seen=None):
    """`capped_registry_prompts` with small caps (the product's are 2,000 / 1,000 / 5,000): open
    prompts, short-answer prompts and the row counts."""
    stats = RowStats()
    selection = capped_registry_prompts(set() if seen is None else seen, stats, seed=seed, max_per_file=per_file,
                                        max_short_per_file=short_per_file, max_per_task=per_task,
                                        registry_dir=registry_dir, workers=workers)
    return selection.open, selection.short_answer, stats


@pytest.fixture(scope="module")
def registry_prompts():
    return capped()


@pytest.fixture
def small_registry(tmp_path):
    """A registry holding four real tasks (links into the installed package)."""
    for task in SUBSET_TASKS:
        (tmp_path / task).symlink_to(evals_registry_dir() / task, target_is_directory=True)
    return tmp_path


def test_default_prompts_are_many_diverse_and_clean(registry_prompts):
    prompts, short, stats = registry_prompts
    print(f"\n{len(prompts)} open prompts, {len(short)} short-answer\n{stats.summary()}")
    assert 2300 <= len(prompts) <= 2900 and 2500 <= len(short) <= 3200  # 2,605 and 2,880 with evals 3.0.1.post1
    assert stats.used == len(prompts) + len(short) and stats.used + stats.skipped == stats.read
    per_task = collections.Counter(p.id.split("/")[1] for p in prompts + short)
    assert len(per_task) >= 120 and max(per_task.values()) <= 100
    per_file = collections.Counter(p.id.rsplit(":", 1)[0] for p in prompts + short)
    assert max(per_file.values()) <= 20
    assert len({p.id for p in prompts + short}) == len(prompts) + len(short)
    assert len({" ".join(text_of(p).lower().split()) for p in prompts + short}) == len(prompts) + len(short)
    for prompt in prompts[::10] + short[::10]:  # every tenth: the filter is slow-ish in Python
        assert prompt.messages[-1]["role"] == "user" and {m["role"] for m in prompt.messages} <= {"system", "user"}
        assert MIN_PROMPT_CHARS <= len(text_of(prompt)) <= MAX_PROMPT_CHARS
        assert not looks_like_junk(text_of(prompt))
    assert not any(asks_for_short_answer(text_of(p)) for p in prompts[::10])
    assert all(prompt_rejection(p.messages) == "asks for a short answer" for p in short[::10])
    for reason in ("short-answer prompt over the per-file cap", "few-shot examples in the prompt",
                   "mostly non-text content", "duplicate prompt", "over the per-task cap"):
        assert stats.skipped_by_reason[reason] > 0


def test_prompt_ids_point_at_their_row_in_the_installed_registry(registry_prompts):
    prompts, short, _ = registry_prompts
    registry = evals_registry_dir()
    for prompt in prompts[:25] + short[:25]:
        relative, line = prompt.id.removeprefix("evals/").rsplit(":", 1)
        row = json.loads((registry / relative).read_text().splitlines()[int(line) - 1])
        assert [{"role": m["role"], "content": m["content"]} for m in row["input"]] == prompt.messages


def test_same_seed_same_prompts_other_seed_other_sample(small_registry):
    first, first_short, _ = capped(small_registry, per_task=10)
    again, again_short, _ = capped(small_registry, per_task=10)
    other, _, _ = capped(small_registry, seed=1, per_task=10)
    assert [p.id for p in first + first_short] == [p.id for p in again + again_short]
    assert [p.id for p in other] != [p.id for p in first]
    per_task = collections.Counter(p.id.split("/")[1] for p in first)
    assert "chinese_ancient_masterpieces_dynasty" not in per_task  # "你只需要回答朝代": answer only the dynasty
    assert set(per_task) == {"knot-theory", "linear-regression", "ral_to_hex"} and max(per_task.values()) == 10
    assert {p.id.split("/")[1] for p in first_short} == {"chinese_ancient_masterpieces_dynasty"}


def _write_task(registry, task: str, texts: list[str]) -> None:
    (registry / task).mkdir(parents=True)
    rows = [json.dumps({"input": [{"role": "user", "content": text}], "ideal": ""}) for text in texts]
    (registry / task / "samples.jsonl").write_text("\n".join(rows) + "\n")


def test_a_file_full_of_earlier_prompts_still_fills_its_quota_in_its_seeded_order(tmp_path):
    """Rows are judged ahead by workers that cannot know what earlier files took; where
    duplicates leave a file's quota short, the scan goes on past the workers' rows, exactly as a
    scan in one process would: the file's first 5 new prompts in its seeded order (the earlier
    task's 5 prompts were all taken, its quota being 5)."""
    earlier = [f"Write a detailed essay about topic number {k} and its long history." for k in range(5)]
    fresh = [f"Describe, with examples, how machine number {k} is built and maintained." for k in range(10)]
    _write_task(tmp_path, "a-earlier", earlier)
    _write_task(tmp_path, "b-mixed", earlier + fresh)
    prompts, _, stats = capped(tmp_path, per_file=5, per_task=50, workers=1)
    name = "evals/b-mixed/samples.jsonl"
    lines = (tmp_path / "b-mixed" / "samples.jsonl").read_text().split("\n")
    order = random.Random(f"0:{name}").sample(range(len(lines)), len(lines))
    expected = [f"{name}:{i + 1}" for i in order if lines[i].strip() and i >= len(earlier)][:5]
    assert [p.id for p in prompts if p.id.startswith(name)] == sorted(expected, key=lambda i: int(i.rsplit(":", 1)[1]))
    assert stats.skipped_by_reason["duplicate prompt"] > 0
    # The judged-ahead rows alone would not have done: some of them were duplicates.
    ahead = _scanned_file(ScanLimits(0, 5, 10), (tmp_path / "b-mixed" / "samples.jsonl", name)).rows
    assert len(ahead) == 5 and any(row.key in set(map(normalized_key, earlier)) for row in ahead)


def test_worker_processes_take_what_one_process_takes(small_registry):
    """The registry judged by two worker processes (a failure would warn, here an error) gives the
    prompts, short-answer prompts and counts of one process."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        there = capped(small_registry, per_task=10, workers=2)
    here = capped(small_registry, per_task=10, workers=1)
    assert [[p.id for p in there[0]], [p.id for p in there[1]], there[2].read, there[2].skipped_by_reason] == \
        [[p.id for p in here[0]], [p.id for p in here[1]], here[2].read, here[2].skipped_by_reason]
    assert [p.messages for p in there[0]] == [p.messages for p in here[0]]


@pytest.mark.parametrize(
    "text",
    [
        "You will be prompted with a single word. Does this word exist in the Norwegian language? "
        "Answer with exactly one letter: Y or N. Do not use punctionation. Do not explain your answer.\nKry",
        "Calculate the determinant of the matrix. Reply ONLY with the answer approximated to 2 decimals.\n[[4215,7802],[-1632,3512]]",
        "The following are multiple choice questions (with answers) about CISSP certification.\n"
        "What is a baseline in security documentation?\nA. A minimum level of security for every system\nB. A step-by-step how-to document",
        "Answer the following True/False question with the provided backgammon board state.",
        "下面这本中国古代名著是于哪个朝代编写的？你只需要回答朝代。例如：战国\n---\n《周书》",
        "東京近郊の鉄道路線と駅名を入力するので、対応する駅番号のみ回答してください。（例：DT01)\n東急大井町線 等々力",
    ],
)
def test_short_answer_requests_are_recognised(text):
    assert asks_for_short_answer(text)


@pytest.mark.parametrize(
    "text",
    [
        "Find the linear regression equation for the following observations.\nFirst explain your reasoning, "
        'then show the final equation in the form "y = ax + b".\nAt the end, repeat just the final equation again by itself on a new line.',
        "I will provide you with a CallStack code, and answer me whether it is reverse shell. Provide your reasoning step by step, "
        "and at the end, write your final answer as Yes or No.",
        "Summarize the variables that lead to initial attraction between people, and explain why physical attractiveness is so important in liking.",
    ],
)
def test_open_or_reasoned_prompts_are_kept(text):
    assert prompt_rejection([{"role": "user", "content": text}]) is None


def test_other_rejections():
    assert prompt_rejection([{"role": "user", "content": "Hi there"}]) == f"prompt shorter than {MIN_PROMPT_CHARS} characters"
    assert prompt_rejection([{"role": "user", "content": "Describe this. " * 200}]) == f"prompt longer than {MAX_PROMPT_CHARS} characters"
    svg = "Identify the object drawn by this SVG path: M1885 12789 c-82 -5 -186 -13 -230 -17 -44 -5 -90 -5 -102 -1 -15 5 -25 3 -33 -7"
    assert prompt_rejection([{"role": "user", "content": svg}]) == "mostly non-text content"
    few_shot = [
        {"role": "system", "content": "Translate the sentence into French, carefully and completely."},
        {"role": "system", "name": "example_user", "content": "Good morning, my friend."},
        {"role": "system", "name": "example_assistant", "content": "Bonjour, mon ami."},
        {"role": "user", "content": "The weather is lovely today, isn't it?"},
    ]
    assert prompt_rejection(few_shot) == "few-shot examples in the prompt"
    assert prompt_rejection(few_shot[:1]) == "prompt does not end with a user message"


@pytest.mark.skipif(not REGENERATED_4000.is_file(), reason=WITHOUT_REGENERATED_4000)
def test_kept_prompts_got_longer_answers_in_the_reference_data(smollm2_dir):
    """Calibration: SmolLM2 wrote long answers (>= 31 tokens) to the prompts the filter keeps more
    often than to those it drops for asking a short answer."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    chats = [json.loads(line)["messages"] for line in gzip.open(REGENERATED_4000, "rt")]
    answers = tokenizer([chat[-1]["content"] for chat in chats], add_special_tokens=False)["input_ids"]
    long_answers = collections.defaultdict(list)
    for chat, answer in zip(chats, answers):
        long_answers[prompt_rejection(chat[:-1])].append(len(answer) >= 31)
    kept, dropped = long_answers[None], long_answers["asks for a short answer"]
    assert len(kept) > 1500 and len(dropped) > 1500
    assert sum(kept) / len(kept) >= 0.72 and sum(dropped) / len(dropped) <= 0.6
