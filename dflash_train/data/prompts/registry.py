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

To keep the mix diverse, `capped_registry_prompts` takes at most `max_per_file` prompts from a
file and `max_per_task` from a task (a top-level folder of the registry), sampled by seed, and
stops scanning a file once its quota is full, after `10 × max_per_file` rows, or after 100 rows
without an open prompt once it has its short-answer ones. Rows are judged (parsed, filtered,
normalised) in worker processes, a file per job (dflash_train/processes.py); what is taken from them
(deduplication, caps, order) is decided here, in order, so the set is the same on any machine.

Calibration on the 4,000-row SmolLM2 regeneration (the bar recipe's data, docs/RESULTS.md): of the prompts this filter
keeps, 77 % got answers of ≥ 31 tokens from SmolLM2, against 55 % of those it drops for asking a
short answer (SmolLM2 often ignores "answer only ..."; a stronger target would not, which is why
such prompts go).
"""

from __future__ import annotations

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
from ...processes import map_anywhere
from ..decontaminate import normalized_key
from ..readers import DataError, Prompt, RowStats, parse_messages

MIN_PROMPT_CHARS = 32
MAX_PROMPT_CHARS = 2000
ASKS_FOR_SHORT_ANSWER = "asks for a short answer"  # the one rejection a prompt can still be taken with
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
        return ASKS_FOR_SHORT_ANSWER
    return None


def evals_registry_dir() -> Path:
    """`evals/registry/data` of the installed package (found without importing it: installed --no-deps)."""
    return package_path("evals", "registry/data", "evals", directory=True)


def _is_chat_row(line: bytes) -> bool:
    try:
        row = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return False
    messages = row.get("input") if isinstance(row, dict) else None
    return isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict) and "role" in messages[0]


def _chat_lines(path: Path) -> list[bytes] | None:
    """The raw lines of a chat-format JSONL file (judged by its first row), else None."""
    lines = path.read_bytes().split(b"\n")
    first = next((line for line in lines if line.strip()), b"")
    return lines if _is_chat_row(first) else None


def _sampled_rows(name: str, lines: list[bytes], rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """The non-blank rows of a file in its seeded order (a permutation of the line indices: the
    rows themselves are not copied), as (file:line, raw line)."""
    for index in rng.sample(range(len(lines)), len(lines)):
        if lines[index].strip():
            yield f"{name}:{index + 1}", lines[index]


@dataclass(frozen=True)
class RegistryRow:
    """What the filter makes of one registry row, by itself: unusable (`error`: reason and
    example), or its messages, why it is not a prompt (`rejection`, None if it is) and its
    normalised text (`key`, for deduplication against everything taken before it)."""

    where: str
    error: tuple[str, str] | None = None
    messages: list[dict[str, str]] | None = None
    rejection: str | None = None
    key: str = ""


# System prompts repeat across a file's rows: each distinct one is analysed once per process.
_signals_of = functools.lru_cache(maxsize=1 << 14)(TextSignals.of)


def _registry_row(where: str, line: bytes) -> RegistryRow:
    try:
        row = json.loads(line)
        if not isinstance(row, dict):
            raise DataError(where, "row", "expected an object")
        messages = parse_messages(row, where, openai_key="input")
    except json.JSONDecodeError as error:
        return RegistryRow(where, error=("invalid JSON", f"{where}: {error.msg}"))
    except UnicodeDecodeError as error:
        return RegistryRow(where, error=("invalid UTF-8", f"{where}: {error.reason} at byte {error.start}"))
    except DataError as error:
        return RegistryRow(where, error=(error.reason, str(error)))
    rejection = prompt_rejection(row["input"], _signals_of)
    if rejection is not None and rejection != ASKS_FOR_SHORT_ANSWER:
        return RegistryRow(where, rejection=rejection)
    return RegistryRow(where, messages=messages, rejection=rejection,
                       key=normalized_key("\n".join(m["content"] for m in messages)))


@dataclass(frozen=True)
class FileScan:
    """A registry file for `capped_registry_prompts`: its name, and its first rows in the seeded
    order as judged by a worker, which stops where the file's caps would stop the scan if no row
    were a duplicate (the caller judges any further rows itself), or at the file's end (`whole`)."""

    path: Path
    name: str
    rows: list[RegistryRow]
    whole: bool


@dataclass(frozen=True)
class ScanLimits:
    seed: int
    max_per_file: int
    max_short_per_file: int

    @property
    def rows(self) -> int:
        return _SCAN_FACTOR * self.max_per_file // 2


def _scanned_file(limits: ScanLimits, job: tuple[Path, str]) -> FileScan | None:
    """A worker's job (dflash_train/processes.py): one file's rows judged in order, up to where
    its caps stop the scan when no row is a duplicate; None if the file is not chat-format."""
    path, name = job
    lines = _chat_lines(path)
    if lines is None:
        return None
    rows: list[RegistryRow] = []
    usable = short = 0
    judged = _file_rows(name, lines, limits.seed)
    while not _scan_ends(len(rows), usable, short, limits):
        row = next(judged, None)
        if row is None:
            return FileScan(path, name, rows, whole=True)
        rows.append(row)
        if row.error is None and row.rejection is None:
            usable += 1
        elif row.rejection == ASKS_FOR_SHORT_ANSWER:
            short += 1
    return FileScan(path, name, rows, whole=False)


def _file_rows(name: str, lines: list[bytes], seed: int, skip: int = 0) -> Iterator[RegistryRow]:
    """A file's rows in its seeded order, judged; the first `skip` are passed over unjudged."""
    for position, (where, line) in enumerate(_sampled_rows(name, lines, random.Random(f"{seed}:{name}"))):
        if position >= skip:
            yield _registry_row(where, line)


def _rows_of(scan: FileScan, seed: int) -> Iterator[RegistryRow]:
    """The worker's judged rows, then (read again only if asked for) the file's next ones."""
    yield from scan.rows
    if not scan.whole:
        yield from _file_rows(scan.name, _chat_lines(scan.path) or [], seed, skip=len(scan.rows))


def _scan_ends(scanned: int, open_taken: int, short_taken: int, limits: ScanLimits) -> bool:
    """Whether a file's scan stops before its row `scanned`: its quota of open prompts is full,
    `limits.rows` rows were read, or it has its short-answer prompts and `_GIVE_UP_AFTER` rows
    without an open one (a short-answer file throughout)."""
    return (open_taken >= limits.max_per_file or scanned >= limits.rows
            or not open_taken and scanned >= _GIVE_UP_AFTER and short_taken >= limits.max_short_per_file)


@dataclass
class RegistrySelection:
    """Registry prompts taken by `capped_registry_prompts`, by kind, in registry order."""

    open: list[Prompt] = field(default_factory=list)  # pass every filter
    short_answer: list[Prompt] = field(default_factory=list)  # pass all but "asks for a short answer"
    keys: dict[str, str] = field(default_factory=dict)  # prompt id -> its normalised text (decontaminate.normalized_key)


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
    workers: int | None = None,
) -> RegistrySelection:
    """Many registry prompts, at most `max_per_file` from one file and `max_per_task` from one task.

    A file's quota goes to its open prompts first; prompts that pass every filter but ask for a
    short answer fill what is left of it, up to `max_short_per_file`. Rows are visited in a
    seeded random order and scanning a file stops once its quota of open prompts is full, after
    `_SCAN_FACTOR / 2 × max_per_file` rows, or once it has its short-answer prompts and `_GIVE_UP_AFTER`
    rows without an open one. A task over `max_per_task` keeps a seeded sample, open prompts first.
    `seen` holds the normalised texts taken so far (by any source) and gets the new ones; every row
    read is counted in `stats` (used: taken, or skipped with its reason). `on_task(done, total)` is called
    once every row is judged (done = 0) and after each task (progress). Rows are judged on `workers` processes (default: one per core;
    dflash_train/processes.py); what is taken is the same for any number.
    """
    registry = Path(registry_dir) if registry_dir is not None else evals_registry_dir()
    limits = ScanLimits(seed, max_per_file, max_short_per_file)
    selection = RegistrySelection()
    task_dirs = sorted(p for p in registry.iterdir() if p.is_dir())
    task_files = [sorted(task_dir.rglob("*.jsonl")) for task_dir in task_dirs]
    jobs = [(path, f"evals/{path.relative_to(registry).as_posix()}") for files in task_files for path in files]
    scans = iter(map_anywhere(_scanned_file, jobs, workers, fixed=(limits,), what="judging the evals registry's rows"))
    if on_task is not None:
        on_task(0, len(task_dirs))
    for done, (task_dir, files) in enumerate(zip(task_dirs, task_files), start=1):
        task_open: list[Prompt] = []
        task_short: list[Prompt] = []
        for scan in itertools.islice(scans, len(files)):
            if scan is None:
                continue
            file_open, file_short = _take_from_file(scan, seen, stats, limits, selection.keys)
            task_open += file_open
            task_short += file_short
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


def _take_from_file(scan: FileScan, seen: set[str], stats: RowStats, limits: ScanLimits,
                    keys: dict[str, str]) -> tuple[list[Prompt], list[Prompt]]:
    """A file's open and short-answer prompts within its quota: the worker's judged rows first,
    then (where duplicates left the quota unfilled) rows judged here, in the same seeded order.
    Each prompt's normalised text goes into `keys`."""
    file_open: list[Prompt] = []
    file_short: list[Prompt] = []
    rows = _rows_of(scan, limits.seed)
    scanned = 0
    while not _scan_ends(scanned, len(file_open), len(file_short), limits) and (row := next(rows, None)) is not None:
        scanned += 1
        stats.count_read()
        if row.error is not None:
            stats.skip(*row.error)
            continue
        short = row.rejection == ASKS_FOR_SHORT_ANSWER
        reason = row.rejection
        if short and len(file_short) >= limits.max_short_per_file:
            reason = OVER_FILE_CAP
        elif reason is None or short:
            reason = "duplicate prompt" if row.key in seen else None
            seen.add(row.key)
        if reason is not None:
            stats.skip(reason, row.where)
            continue
        (file_short if short else file_open).append(Prompt(id=row.where, messages=row.messages, source=row.where))
        keys[row.where] = row.key
    room = limits.max_per_file - len(file_open)
    for prompt in file_short[room:]:
        stats.skip(OVER_FILE_CAP, prompt.id)
    return file_open, file_short[:room]


def _registry_order(prompt: Prompt) -> tuple[str, int]:
    name, line = prompt.id.rsplit(":", 1)
    return name, int(line)
