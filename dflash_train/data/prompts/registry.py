"""Default training prompts: user prompts from the OpenAI `evals` registry, filtered for long answers.

The registry (installed with `pip install --no-deps evals`, read in place, never copied here) holds
~470 tasks of chat-format JSONL rows `{"input": [{"role", "content"}, ...], "ideal": ...}`. Most
are graded by exact match and ask for a letter, a number or a yes/no, which gives a drafter almost
nothing to learn from, so a prompt is dropped when it
  - asks for a short answer (one word/letter/number, yes/no, true/false, "answer only", "no
    explanation", multiple-choice options) unless it also asks for reasoning ("step by step",
    "explain your reasoning", ...), which makes the answer long again;
  - is shorter than 32 or longer than 2,000 characters (system + user text);
  - is mostly not text (letters < half of the non-space characters, or a 80+ character "word":
    grids, SVG paths, base64, SMILES);
  - contains few-shot examples (messages with a `name` or assistant turns) or does not end with a
    user message;
  - repeats an earlier prompt (same text after lower-casing and collapsing whitespace).
The patterns are English, plus the common Chinese and Japanese phrasings; short-answer
instructions in other languages (Ukrainian, Polish, ...) get through.

To keep the mix diverse, at most `max_per_task` prompts are taken per task (a task is a top-level
folder of the registry), sampled by seed. Scanning a task stops after `20 × max_per_task` sampled
rows, or after 100 rows if none of them was usable (a short-answer task throughout): about 36k
of the registry's 940k rows are parsed (a few seconds), and < 1 % of the prompts are lost.

Calibration on the 4,000-row SmolLM2 regeneration (the bar recipe's data, docs/RESULTS.md): of the prompts this filter
keeps, 77 % got answers of ≥ 31 tokens from SmolLM2, against 55 % of those it drops for asking a
short answer (SmolLM2 often ignores "answer only ..."; a stronger target would not, which is why
such prompts go).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import operator
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ...assets import package_path
from ..decontaminate import normalized_key
from ..readers import DataError, Prompt, RowStats, parse_messages

EVALS_INSTALL = "pip install --no-deps evals==3.0.1.post1"
MIN_PROMPT_CHARS = 32
MAX_PROMPT_CHARS = 2000
DEFAULT_MAX_PER_TASK = 100
_SCAN_FACTOR = 20
_GIVE_UP_AFTER = 100


def _any_of(*patterns: str) -> re.Pattern:
    """One regex for patterns that all start a word with [a-z1], matched against lower-cased text.

    The shared `\\b(?=[a-z1])` prefix lets re reject most positions before trying 20 alternatives
    (4x faster), and IGNORECASE would make it twice as slow again."""
    return re.compile(r"\b(?=[a-z1])(?:" + "|".join(f"(?:{p})" for p in patterns) + ")", re.MULTILINE)


_VERB = r"(?:answer|respond|reply|output|return|print|write|type|give|provide|state|say)"
_SHORT_ANSWER = _any_of(
    r"\b(?:one|single|1|a)[- ](?:word|letter|number|digit|character|integer|token|phrase|name|emoji|sentence|line)\b",
    r"\b(?:yes|y|true)\W{0,3}(?:or|/)\W{0,3}(?:no|n|false)\b",
    r"\b(?:don't|dont|don’t|do not|without|no|never)\s+(?:any\s+)?"
    r"(?:explain|explanation|elaborat|comment|additional|extra|justif|reasoning|other|further|punctuation|quot|preamble)",
    r"\bnothing else\b",
    r"\bno other (?:text|words?|output|characters?|content)\b",
    _VERB + r"\b[^.\n]{0,40}\bonly\b",
    r"\bonly\s+" + _VERB + r"\b",
    r"\b(?:don't|dont|don’t|do not|never)\s+(?:output|write|include|add|print|return|give|say)\s+(?:any(?:thing)?\s+)?"
    r"(?:other|else|more|additional|extra|explanation)",
    r"\b(?:only|just)\s+(?:the|a|an|one|your)\s+(?:\w+\s+)?"
    r"(?:answer|number|letter|word|name|result|value|option|choice|integer|label|category|digit|code|string|translation)\b",
    r"\bexactly one of\b",
    r"\bone of the following\b",
    r"\bwhich of the following\b",
    r"\b(?:number|numbers|digits?|integer|letter|word|words|answer|name)\s+only\b",
    r"\bas (?:concise(?:ly)?|short|brief(?:ly)?) as possible\b|\bbe concise\b|\bconcisely\b|\bshort answer\b",
    r"\bmultiple[- ]choice\b",
    r"\b(?:select|choose|pick)\s+(?:the\s+)?(?:only\s+)?(?:correct|right|best|one|most)\b",
    _VERB + r"\s+(?:with\s+)?(?:a|an|the|either)\s+(?:number|letter|word|name|integer|digit|single|short)\b",
    r"\bin (?:one|a single|1) (?:word|sentence|line)\b",
    _VERB + r"\b[^.\n]{0,30}\b(?:yes|no)\b[.\"']",
)
# The same requests in Chinese and Japanese ("only answer ...", "no explanation", "concisely", "yes or no"),
# which make up a good part of the registry.
_SHORT_ANSWER_CJK = re.compile(
    r"只需要?(?:回答|输出|回复|给出|写)|[仅只](?:回答|输出|回复|返回|给出)|请仅|直接(?:回答|输出)|"
    r"(?:不要|无需|不需要|不用)(?:解释|说明|任何)|[是对]`?\s*(?:或者?|还是)\s*`?[否错]|"
    r"のみ(?:を|で)?(?:回答|答え|出力|返答|記述)|だけ(?:を|で)?(?:回答|答え|述べ|出力)|簡潔に|端的に|"
    r"(?:説明|補足|解説)は(?:不要|いりません|要りません)"
)
# Lettered options "a. ...", "(b) ...", "c) ..." on their own or inline: a multiple-choice question.
_OPTION = re.compile(r"(?:^|\s)\(?([a-e])[).:]\s", re.MULTILINE)
_KANA_OPTION = re.compile(r"^\s*([アイウエ])\s*[:：.．)）]", re.MULTILINE)  # Japanese exams letter options ア イ ウ エ
_KANA_TO_LETTER = {"ア": "a", "イ": "b", "ウ": "c", "エ": "d"}
_REASONING = _any_of(
    # An instruction, not a noun ("A step-by-step how-to document" is an answer option).
    r"\b(?:think|reason|solve|explain|work|show|go|walk|proceed|answer|respond|provide|give|write)\w*\b[^.\n]{0,30}\bstep[- ]by[- ]step\b",
    r"\bchain[- ]of[- ]thought\b",
    r"\bexplain(?:ing)? (?:your|the|how|why)\b",
    r"\bshow (?:your|the) (?:work|reasoning|steps)\b",
    r"\breason (?:about|through|before|first)\b",
    r"\bthink (?:carefully|step|first)\b",
    r"\bfirst,? (?:explain|reason|think|provide|describe)\b",
    r"\bexplanations? (?:for|of) your\b",
    r"\bjustify your\b",
)
# "Do not explain your answer" must not count as a request for reasoning.
_NEGATED = re.compile(r"(?:\bnot|n't|n’t|\bno|\bwithout|\bnever)\W+(?:\w+\W+){0,2}$")
_LONG_RUN = re.compile(r"\S{81,}")
# What str.isalpha / str.isspace accept among ASCII characters (isspace includes \x1c-\x1f).
_ASCII_LETTERS = bytes(c for c in range(128) if chr(c).isalpha())
_ASCII_SPACES = bytes(c for c in range(128) if chr(c).isspace())


@dataclass(frozen=True)
class TextSignals:
    """What the filter needs from one message; messages combine by `|`, so a system prompt
    repeated over thousands of rows is analysed once."""

    short_answer: bool
    reasoning: bool
    option_letters: frozenset[str]
    letters: int
    visible: int
    long_run: bool

    @classmethod
    def of(cls, text: str) -> "TextSignals":
        lower = text.lower()
        reasoning = any(not _NEGATED.search(lower[max(0, m.start() - 30) : m.start()]) for m in _REASONING.finditer(lower))
        ascii_text = text.isascii()  # 85 % of the registry: the CJK patterns cannot match, counting is bytes work
        option_letters = frozenset(m.group(1) for m in _OPTION.finditer(lower))
        if ascii_text:
            raw = text.encode("ascii")
            letters, spaces = len(raw) - len(raw.translate(None, _ASCII_LETTERS)), len(raw) - len(raw.translate(None, _ASCII_SPACES))
        else:
            letters, spaces = sum(map(str.isalpha, text)), sum(map(str.isspace, text))
            option_letters |= frozenset(_KANA_TO_LETTER[m.group(1)] for m in _KANA_OPTION.finditer(text))
        return cls(
            short_answer=_SHORT_ANSWER.search(lower) is not None or (not ascii_text and _SHORT_ANSWER_CJK.search(text) is not None),
            reasoning=reasoning,
            option_letters=option_letters,
            letters=letters,
            visible=len(text) - spaces,
            long_run=_LONG_RUN.search(text) is not None,
        )

    def __or__(self, other: "TextSignals") -> "TextSignals":
        return TextSignals(
            self.short_answer or other.short_answer,
            self.reasoning or other.reasoning,
            self.option_letters | other.option_letters,
            self.letters + other.letters,
            self.visible + other.visible,
            self.long_run or other.long_run,
        )

    @property
    def multiple_choice(self) -> bool:
        return {"a", "b"} <= self.option_letters or {"b", "c"} <= self.option_letters

    @property
    def asks_for_short_answer(self) -> bool:
        """A word, a letter, a number, a yes/no or an option is wanted, and no reasoning."""
        return (self.short_answer or self.multiple_choice) and not self.reasoning

    @property
    def looks_like_junk(self) -> bool:
        """Mostly symbols or digits, or an unbroken 80+ character run (base64, SVG paths, grids)."""
        return self.visible == 0 or self.letters < self.visible / 2 or self.long_run


def asks_for_short_answer(text: str) -> bool:
    return TextSignals.of(text).asks_for_short_answer


def looks_like_junk(text: str) -> bool:
    return TextSignals.of(text).looks_like_junk


def prompt_rejection(raw_messages: list[Any], signals_of: Callable[[str], TextSignals] = TextSignals.of) -> str | None:
    """Why an evals `input` (already validated) is not a usable training prompt, or None if it is."""
    if any("name" in m for m in raw_messages) or any(m.get("role") == "assistant" for m in raw_messages):
        return "few-shot examples in the prompt"
    if raw_messages[-1].get("role") != "user":
        return "prompt does not end with a user message"
    length = sum(len(m["content"]) for m in raw_messages) + len(raw_messages) - 1
    if length < MIN_PROMPT_CHARS:
        return f"prompt shorter than {MIN_PROMPT_CHARS} characters"
    if length > MAX_PROMPT_CHARS:
        return f"prompt longer than {MAX_PROMPT_CHARS} characters"
    signals = functools.reduce(operator.or_, (signals_of(m["content"]) for m in raw_messages))
    if signals.looks_like_junk:
        return "mostly non-text content"
    if signals.asks_for_short_answer:
        return "asks for a short answer"
    return None


def evals_registry_dir() -> Path:
    """`evals/registry/data` of the installed package (found without importing it: installed --no-deps)."""
    return package_path("evals", "registry/data", EVALS_INSTALL, directory=True)


def _is_chat_row(line: bytes) -> bool:
    try:
        row = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return False
    messages = row.get("input") if isinstance(row, dict) else None
    return isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict) and "role" in messages[0]


def _task_files(task_dir: Path, registry: Path) -> list[tuple[str, list[bytes]]]:
    """(name, raw lines) of the task's chat-format JSONL files (judged by their first row), in path order."""
    files = []
    for path in sorted(task_dir.rglob("*.jsonl")):
        lines = path.read_bytes().split(b"\n")
        first = next((line for line in lines if line.strip()), b"")
        if _is_chat_row(first):
            files.append((f"evals/{path.relative_to(registry).as_posix()}", lines))
    return files


def _sampled_rows(files: list[tuple[str, list[bytes]]], rng: random.Random, count: int | None) -> Iterator[tuple[str, bytes]]:
    """`count` (all if None) non-blank rows of `files` in random order, as (file:line, raw line).

    Indices are sampled, not the rows shuffled: a 287k-row task needs 2,000 of them, not a permutation."""
    starts = list(itertools.accumulate((len(lines) for _, lines in files), initial=0))
    total = starts[-1]
    for index in rng.sample(range(total), total if count is None else min(count, total)):
        file_index = bisect.bisect_right(starts, index) - 1
        name, lines = files[file_index]
        line = lines[index - starts[file_index]]
        if line.strip():
            yield f"{name}:{index - starts[file_index] + 1}", line


def _parse_registry_row(where: str, line: bytes, stats: RowStats) -> tuple[dict, list[dict[str, str]]] | None:
    """The row and its validated messages, or None after counting why the row is unusable."""
    try:
        row = json.loads(line)
        if not isinstance(row, dict):
            raise DataError(where, "row", "expected an object")
        return row, parse_messages(row, where, openai_key="input")
    except json.JSONDecodeError as error:
        stats.skip("invalid JSON", f"{where}: {error.msg}")
    except UnicodeDecodeError as error:
        stats.skip("invalid UTF-8", f"{where}: {error.reason} at byte {error.start}")
    except DataError as error:
        stats.skip(error.reason, str(error))
    return None


def default_training_prompts(
    limit: int | None = None,
    seed: int = 0,
    *,
    max_per_task: int | None = DEFAULT_MAX_PER_TASK,
    registry_dir: str | Path | None = None,
    stats: RowStats | None = None,
) -> list[Prompt]:
    """Filtered, deduplicated prompts from the installed evals registry, shuffled by `seed`.

    The same (seed, max_per_task, registry) always gives the same list; `limit` takes its first
    prompts. Rows scanned and the reasons for dropping them go to `stats` if given.
    """
    registry = Path(registry_dir) if registry_dir is not None else evals_registry_dir()
    stats = stats if stats is not None else RowStats()
    seen: set[str] = set()
    prompts: list[Prompt] = []
    # System prompts repeat across a task's rows: analyse each distinct one once.
    signals_of = functools.lru_cache(maxsize=4096)(TextSignals.of)
    for task_dir in sorted(p for p in registry.iterdir() if p.is_dir()):
        # A string seed is hashed with sha512 by `random`: the same order on every run and machine.
        rng = random.Random(f"{seed}:{task_dir.name}")
        rows = _sampled_rows(_task_files(task_dir, registry), rng, None if max_per_task is None else max_per_task * _SCAN_FACTOR)
        taken = 0
        for scanned, (where, line) in enumerate(rows):
            if max_per_task is not None and taken >= max_per_task:
                break
            if taken == 0 and scanned >= _GIVE_UP_AFTER:
                break  # a short-answer task throughout: don't parse its thousands of rows
            stats.count_read()
            parsed = _parse_registry_row(where, line, stats)
            if parsed is None:
                continue
            row, messages = parsed
            reason = prompt_rejection(row["input"], signals_of)
            if reason is None:
                key = " ".join("\n".join(m["content"] for m in messages).lower().split())
                reason = "duplicate prompt" if key in seen else None
                seen.add(key)
            if reason is not None:
                stats.skip(reason, where)
                continue
            prompts.append(Prompt(id=where, messages=messages, source=where))
            taken += 1
    random.Random(seed).shuffle(prompts)
    return prompts if limit is None else prompts[:limit]


@dataclass
class RegistrySelection:
    """Registry prompts taken by `capped_registry_prompts`, by kind, in registry order."""

    open: list[Prompt] = field(default_factory=list)  # pass every filter
    short_answer: list[Prompt] = field(default_factory=list)  # pass all but "asks for a short answer"


OVER_FILE_CAP = "short-answer prompt over the per-file cap"
OVER_TASK_CAP = "over the per-task cap"


def capped_registry_prompts(
    seen: set[str],
    stats: RowStats,
    *,
    seed: int,
    max_per_file: int,
    max_short_per_file: int,
    max_per_task: int,
    registry_dir: str | Path | None = None,
    on_task: Callable[[int, int], None] | None = None,
) -> RegistrySelection:
    """Many registry prompts, at most `max_per_file` from one file and `max_per_task` from one task.

    A file's quota goes to its open prompts first; prompts that pass every filter but ask for a
    short answer fill what is left of it, up to `max_short_per_file`. Rows are visited in a
    seeded random order and scanning a file stops once its quota of open prompts is full, after
    `_SCAN_FACTOR / 2 × max_per_file` rows, or once it has its short-answer prompts and `_GIVE_UP_AFTER`
    rows without an open one. A task over `max_per_task` keeps a seeded sample, open prompts first.
    `seen` holds the normalised texts taken so far (by any source) and gets the new ones; every row
    read is counted in `stats` (used: taken, or skipped with its reason). `on_task(done, total)` is called
    after each task (progress).
    """
    registry = Path(registry_dir) if registry_dir is not None else evals_registry_dir()
    signals_of = functools.lru_cache(maxsize=1 << 14)(TextSignals.of)
    scan_limit = _SCAN_FACTOR * max_per_file // 2
    selection = RegistrySelection()
    task_dirs = sorted(p for p in registry.iterdir() if p.is_dir())
    for done, task_dir in enumerate(task_dirs, start=1):
        task_open: list[Prompt] = []
        task_short: list[Prompt] = []
        for name, lines in _task_files(task_dir, registry):
            rng = random.Random(f"{seed}:{name}")
            file_open: list[Prompt] = []
            file_short: list[Prompt] = []
            for scanned, (where, line) in enumerate(_sampled_rows([(name, lines)], rng, None)):
                if len(file_open) >= max_per_file or scanned >= scan_limit:
                    break
                if not file_open and scanned >= _GIVE_UP_AFTER and len(file_short) >= max_short_per_file:
                    break  # a short-answer file throughout
                stats.count_read()
                parsed = _parse_registry_row(where, line, stats)
                if parsed is None:
                    continue
                row, messages = parsed
                reason = prompt_rejection(row["input"], signals_of)
                short = reason == "asks for a short answer"
                if short and len(file_short) >= max_short_per_file:
                    reason = OVER_FILE_CAP
                elif reason is None or short:
                    key = normalized_key("\n".join(m["content"] for m in messages))
                    reason = "duplicate prompt" if key in seen else None
                    seen.add(key)
                if reason is not None:
                    stats.skip(reason, where)
                    continue
                (file_short if short else file_open).append(Prompt(id=where, messages=messages, source=where))
            room = max_per_file - len(file_open)
            for prompt in file_short[room:]:
                stats.skip(OVER_FILE_CAP, prompt.id)
            task_open += file_open
            task_short += file_short[:room]
        rng = random.Random(f"{seed}:{task_dir.name}")
        rng.shuffle(task_open)
        rng.shuffle(task_short)
        kept_open = task_open[:max_per_task]
        kept_short = task_short[:max_per_task - len(kept_open)]
        for prompt in task_open[len(kept_open):] + task_short[len(kept_short):]:
            stats.skip(OVER_TASK_CAP, prompt.id)
        # Registry order inside a task: the same rows whatever the shuffle above picked first.
        selection.open += sorted(kept_open, key=_registry_order)
        selection.short_answer += sorted(kept_short, key=_registry_order)
        if on_task is not None:
            on_task(done, len(task_dirs))
    return selection


def _registry_order(prompt: Prompt) -> tuple[str, int]:
    name, line = prompt.id.rsplit(":", 1)
    return name, int(line)
