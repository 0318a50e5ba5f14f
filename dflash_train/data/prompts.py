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
The patterns are English; short-answer instructions in other languages get through.

To keep the mix diverse, at most `max_per_task` prompts are taken per task (a task is a top-level
folder of the registry), sampled by seed; a task whose first `20 × max_per_task` sampled rows do
not yield that many is mostly short-answer and gives what it has. Calibration on the 4,000-row
SmolLM2 regeneration (shared/data): of the prompts this filter keeps, 79 % got answers of ≥ 31
tokens from SmolLM2, against 50 % of those it drops for asking a short answer.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any

from .readers import DataError, Prompt, RowStats, parse_messages

EVALS_INSTALL = "pip install --no-deps evals==3.0.1.post1"
MIN_PROMPT_CHARS = 32
MAX_PROMPT_CHARS = 2000
DEFAULT_MAX_PER_TASK = 100
_SCAN_FACTOR = 20


def _any_of(*patterns: str) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE | re.MULTILINE)


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
    r"\b(?:only|just)\s+(?:the|a|an|one|your)\s+(?:final\s+)?"
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
# Lettered options "A. ...", "(b) ...", "C) ..." on their own or inline: a multiple-choice question.
_OPTION = re.compile(r"(?:^|\s)\(?([A-Ea-e])[).:]\s", re.MULTILINE)
_REASONING = _any_of(
    r"\bstep[- ]by[- ]step\b",
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
_NEGATED = re.compile(r"(?:\bnot|n't|n’t|\bno|\bwithout|\bnever)\W+(?:\w+\W+){0,2}$", re.IGNORECASE)


def asks_for_reasoning(text: str) -> bool:
    return any(not _NEGATED.search(text[max(0, m.start() - 30) : m.start()]) for m in _REASONING.finditer(text))


def is_multiple_choice(text: str) -> bool:
    letters = {m.group(1).lower() for m in _OPTION.finditer(text)}
    return {"a", "b"} <= letters or {"b", "c"} <= letters


def asks_for_short_answer(text: str) -> bool:
    """The prompt wants a word, a letter, a number, a yes/no or an option, and no reasoning."""
    return (bool(_SHORT_ANSWER.search(text)) or is_multiple_choice(text)) and not asks_for_reasoning(text)


def looks_like_junk(text: str) -> bool:
    """Mostly symbols or digits, or an unbroken 80+ character run (base64, SVG paths, grids)."""
    visible = [c for c in text if not c.isspace()]
    if not visible or sum(c.isalpha() for c in visible) < len(visible) / 2:
        return True
    return max(len(word) for word in text.split()) > 80


def prompt_rejection(raw_messages: list[Any]) -> str | None:
    """Why an evals `input` is not a usable training prompt, or None if it is (messages already validated)."""
    if any("name" in m for m in raw_messages) or any(m.get("role") == "assistant" for m in raw_messages):
        return "few-shot examples in the prompt"
    if raw_messages[-1].get("role") != "user":
        return "prompt does not end with a user message"
    text = "\n".join(m["content"] for m in raw_messages)
    if len(text) < MIN_PROMPT_CHARS:
        return f"prompt shorter than {MIN_PROMPT_CHARS} characters"
    if len(text) > MAX_PROMPT_CHARS:
        return f"prompt longer than {MAX_PROMPT_CHARS} characters"
    if looks_like_junk(text):
        return "mostly non-text content"
    if asks_for_short_answer(text):
        return "asks for a short answer"
    return None


def evals_registry_dir() -> Path:
    """`evals/registry/data` of the installed package (found without importing it: installed --no-deps)."""
    spec = importlib.util.find_spec("evals")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "registry" / "data"
        if candidate.is_dir():
            return candidate
    raise DataError("evals", "", f"the OpenAI evals registry data is not installed; install it with: {EVALS_INSTALL}")


def _is_chat_file(path: Path) -> bool:
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False
                messages = row.get("input") if isinstance(row, dict) else None
                return isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict) and "role" in messages[0]
    return False


def _task_lines(task_dir: Path, registry: Path) -> list[tuple[str, bytes]]:
    """(location, raw line) of every row of the task's chat-format files, in path order."""
    lines = []
    for path in sorted(task_dir.rglob("*.jsonl")):
        if not _is_chat_file(path):
            continue
        name = f"evals/{path.relative_to(registry).as_posix()}"
        with open(path, "rb") as handle:
            lines.extend((f"{name}:{number}", line) for number, line in enumerate(handle, start=1) if line.strip())
    return lines


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
    for task_dir in sorted(p for p in registry.iterdir() if p.is_dir()):
        lines = _task_lines(task_dir, registry)
        # A string seed is hashed with sha512 by `random`: the same order on every run and machine.
        random.Random(f"{seed}:{task_dir.name}").shuffle(lines)
        if max_per_task is not None:
            lines = lines[: max_per_task * _SCAN_FACTOR]
        taken = 0
        for where, line in lines:
            if max_per_task is not None and taken >= max_per_task:
                break
            stats.count_read()
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise DataError(where, "row", "expected an object")
                raw = row.get("input")
                messages = parse_messages({"messages": raw}, where)
            except json.JSONDecodeError as error:
                stats.skip("invalid JSON", f"{where}: {error.msg}")
                continue
            except DataError as error:
                stats.skip(error.reason, str(error))
                continue
            reason = prompt_rejection(raw)
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
