"""Default training prompts, read from the installed OpenAI evals registry (real data, not a copy)."""

import collections
import gzip
import json

import pytest
from data_files import REGENERATED_4000, WITHOUT_REGENERATED_4000
from transformers import AutoTokenizer

from dflash_train.data.prompts.registry import (
    MAX_PROMPT_CHARS,
    MIN_PROMPT_CHARS,
    asks_for_short_answer,
    default_training_prompts,
    evals_registry_dir,
    looks_like_junk,
    prompt_rejection,
)
from dflash_train.data.readers import RowStats

SUBSET_TASKS = ["chinese_ancient_masterpieces_dynasty", "knot-theory", "linear-regression", "ral_to_hex"]


def text_of(prompt) -> str:
    return "\n".join(m["content"] for m in prompt.messages)


@pytest.fixture(scope="module")
def registry_prompts():
    stats = RowStats()
    return default_training_prompts(stats=stats), stats


@pytest.fixture
def small_registry(tmp_path):
    """A registry holding four real tasks (links into the installed package)."""
    for task in SUBSET_TASKS:
        (tmp_path / task).symlink_to(evals_registry_dir() / task, target_is_directory=True)
    return tmp_path


def test_default_prompts_are_many_diverse_and_clean(registry_prompts):
    prompts, stats = registry_prompts
    print(f"\n{len(prompts)} default prompts\n{stats.summary()}")
    assert 6500 <= len(prompts) <= 8000  # 7,136 with evals 3.0.1.post1; the reference run used 4,000
    assert stats.used == len(prompts) and stats.used + stats.skipped == stats.read
    per_task = collections.Counter(p.id.split("/")[1] for p in prompts)
    assert len(per_task) >= 120 and max(per_task.values()) <= 100
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({" ".join(text_of(p).lower().split()) for p in prompts}) == len(prompts)
    for prompt in prompts[::10]:  # every tenth: the filter is slow-ish in Python
        assert prompt.messages[-1]["role"] == "user" and {m["role"] for m in prompt.messages} <= {"system", "user"}
        assert MIN_PROMPT_CHARS <= len(text_of(prompt)) <= MAX_PROMPT_CHARS
        assert not asks_for_short_answer(text_of(prompt)) and not looks_like_junk(text_of(prompt))
    for reason in ("asks for a short answer", "few-shot examples in the prompt", "mostly non-text content", "duplicate prompt"):
        assert stats.skipped_by_reason[reason] > 0


def test_prompt_ids_point_at_their_row_in_the_installed_registry(registry_prompts):
    prompts, _ = registry_prompts
    registry = evals_registry_dir()
    for prompt in prompts[:50]:
        relative, line = prompt.id.removeprefix("evals/").rsplit(":", 1)
        row = json.loads((registry / relative).read_text().splitlines()[int(line) - 1])
        assert [{"role": m["role"], "content": m["content"]} for m in row["input"]] == prompt.messages


def test_same_seed_same_prompts_other_seed_other_sample(small_registry):
    first = default_training_prompts(seed=0, max_per_task=10, registry_dir=small_registry)
    again = default_training_prompts(seed=0, max_per_task=10, registry_dir=small_registry)
    other = default_training_prompts(seed=1, max_per_task=10, registry_dir=small_registry)
    assert [p.id for p in first] == [p.id for p in again]
    assert [p.id for p in other] != [p.id for p in first]
    assert [p.id for p in default_training_prompts(limit=7, seed=0, max_per_task=10, registry_dir=small_registry)] == [p.id for p in first[:7]]
    per_task = collections.Counter(p.id.split("/")[1] for p in first)
    assert "chinese_ancient_masterpieces_dynasty" not in per_task  # "你只需要回答朝代": answer only the dynasty
    assert set(per_task) == {"knot-theory", "linear-regression", "ral_to_hex"} and max(per_task.values()) == 10


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
