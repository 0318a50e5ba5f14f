"""Self-written prompts: the target writes user requests itself (the Magpie technique, Xu et al. 2024).

Why. A drafter learns the target's answers to the prompts it is trained on; the offline prompt
set (data/prompts/sets.py) is mostly templated registry tasks and code, while chat benchmarks
(MT-Bench) and real users send open requests: travel posts, role-play, advice, explanations. An
aligned chat model that is given only its template's opening of a user turn continues with a
plausible user request, so sampling there yields open chat prompts in the target's own domain
without any chat data set.

The prefix. The template is rendered (data/render.py, the one rendering rule) for a conversation
whose only user message is a sentinel string, and cut where the sentinel begins: whatever the
template puts first (a default system prompt, BOS, the user header) is kept. A template that does
not show the user's text, or shows it more than once, is refused (ConfigError).

Sampling. Every candidate is one `Job` of the answer engines (generate/engine.py, or any
`AnswerEngine`) with its own seed `row_seed(seed, id)`, id `self/<seed>/<n>`, so a candidate's
text depends on the seed and n alone, not on batching. It stops at the template's end-of-turn
token (the engines stop at `render.stop_token_ids`).

Filters, in this order (each drop counted by reason in a RowStats; kept + dropped = generated):
    no end of turn       the length cap came first (a request cut short)
    special token        a template token inside the text (<|im_start|> ...: not a request)
    too short / too long fewer than MIN_CHARS or more than MAX_CHARS characters after strip
    not mostly text      under half of its visible characters are letters, or control characters
    duplicate            the same normalised text (decontaminate.normalized_key) as an earlier one
    benchmark overlap    exact or 13-gram overlap with a benchmark prompt (decontaminate.Decontaminator)
    other split          the text falls in the other side of the train/dev rule (data.prompts.sets.in_dev_split)
    beyond the count     kept by the filters after --count was reached (the last round's surplus)
Candidates are judged in order of n, so which ones are kept does not depend on round sizes either.

Rounds. The first round samples ROUND_MARGIN x count candidates; each next one what is still
missing divided by the share kept so far. A round that keeps nothing, or MAX_ROUNDS rounds,
ends the run short (the model keeps writing duplicates): `SelfPromptReport.short` says so.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TextIO

from ..data.decontaminate import Decontaminator, normalized_key
from ..data.prompts.sets import SPLITS, in_dev_split
from ..data.readers import Prompt, RowStats
from ..data.render import RenderError, render_text
from ..errors import ConfigError
from ..progress import Progress, format_seconds
from .regenerate import Answer, AnswerEngine, Job, row_seed

SENTINEL = "dflash-train:user-request-sentinel:5b1e"
SOURCE = "self-prompts"
MIN_CHARS = 24
MAX_CHARS = 2000
MIN_LETTER_SHARE = 0.5
ROUND_MARGIN = 1.25  # the first round samples this many candidates per request wanted
MAX_ROUNDS = 8

NO_END_OF_TURN = "no end of turn (the length cap came first)"
SPECIAL_TOKEN = "a special token inside the text"
TOO_SHORT = f"shorter than {MIN_CHARS} characters"
TOO_LONG = f"longer than {MAX_CHARS} characters"
NOT_TEXT = "not mostly text"
DUPLICATE = "duplicate request"
OVERLAP = "overlaps a benchmark prompt"
BEYOND_COUNT = "beyond --count (the last round's surplus)"
GENERATION_FAILED = "generation failed"


def other_split(split: str) -> str:
    return f"in the {'train' if split == 'dev' else 'dev'} split"


@dataclass(frozen=True)
class SelfPromptSettings:
    count: int  # requests to keep
    seed: int = 0
    # 0.8, not Magpie's 1.0: on SmolLM2-135M 1.0 wrote more garbled requests and more that ran past
    # the length cap (16 requests each, CPU, 2026-12-01).
    temperature: float = 0.8
    top_p: float = 0.99
    max_new_tokens: int = 128
    split: str = "train"  # which side of the dev rule the kept requests must fall on (or "all")

    def validate(self) -> None:
        if self.count < 1:
            raise ConfigError(f"count must be at least 1, got {self.count}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0 (greedy would write one request), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.split not in SPLITS:
            raise ConfigError(f"split {self.split!r}: use {', '.join(SPLITS)}")


def user_request_prefix(tokenizer: Any, enable_thinking: bool | None = None) -> str:
    """The template's text before a first user message's own text (see the module doc)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"{type(tokenizer).__name__} has no chat template: self-written prompts need a chat "
                          "model's template (its opening of a user turn)")
    try:
        text = render_text(tokenizer, [{"role": "user", "content": SENTINEL}], False, enable_thinking)
    except RenderError as error:
        raise ConfigError(f"the chat template cannot render one user message: {error}") from None
    found = text.count(SENTINEL)
    if found == 0:
        raise ConfigError(f"the chat template has no user turn: a user message's text does not appear in its render "
                          f"({text[:80]!r})")
    if found > 1:
        raise ConfigError(f"the chat template shows a user message's text {found} times: no single place where the "
                          "user's request begins")
    prefix = text[: text.index(SENTINEL)]
    if not prefix:
        raise ConfigError("the chat template puts nothing before the user's text: the target has no opening to continue")
    return prefix


def _mostly_text(text: str) -> bool:
    if any(ch in "\ufffd" or (ord(ch) < 32 and ch not in "\n\t\r") for ch in text):
        return False  # a broken UTF-8 sequence or a control character: bytes, not a request
    visible = [ch for ch in text if not ch.isspace()]
    return bool(visible) and sum(ch.isalpha() for ch in visible) >= MIN_LETTER_SHARE * len(visible)


class RequestFilter:
    """Decides, in order, which candidates are kept (the module doc's filters); remembers the
    normalised texts kept so far (duplicates)."""

    def __init__(self, benchmarks: Mapping[str, Sequence[str]], split: str, special_texts: Sequence[str]):
        self.decontaminator = Decontaminator(benchmarks)
        self.split = split
        self.special_texts = [t for t in special_texts if t]
        self.seen: set[str] = set()
        self.overlaps: Counter = Counter()  # benchmark -> requests dropped

    def reason_to_drop(self, text: str, finish_reason: str) -> str | None:
        """None to keep `text` (already stripped), else the reason it is dropped."""
        if finish_reason != "stop":
            return NO_END_OF_TURN
        if any(special in text for special in self.special_texts):
            return SPECIAL_TOKEN
        if len(text) < MIN_CHARS:
            return TOO_SHORT
        if len(text) > MAX_CHARS:
            return TOO_LONG
        if not _mostly_text(text):
            return NOT_TEXT
        key = normalized_key(text)
        if key in self.seen:
            return DUPLICATE
        self.seen.add(key)  # same key, same verdict below: a later copy is a duplicate either way
        hit = self.decontaminator.match(text)
        if hit is not None:
            self.overlaps[hit.benchmark] += 1
            return OVERLAP
        if self.split != "all" and in_dev_split(request_prompt("", text)) != (self.split == "dev"):
            return other_split(self.split)
        return None


def request_prompt(row_id: str, text: str) -> Prompt:
    return Prompt(row_id, [{"role": "user", "content": text}], SOURCE)


@dataclass
class SelfPromptReport:
    settings: SelfPromptSettings
    prefix: str
    prefix_tokens: int
    kept: list[Prompt] = field(default_factory=list)
    stats: RowStats = field(default_factory=RowStats)  # read = generated; used = kept
    overlaps: Counter = field(default_factory=Counter)
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    short: str = ""  # why fewer than `count` were kept ("" when the count was reached)

    def summary(self, out: str = "") -> str:
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        overlaps = ", ".join(f"{name} {n}" for name, n in sorted(self.overlaps.items())) or "none"
        lines = [
            "=" * 72,
            "self-prompts summary" + (" (SHORT: " + self.short + ")" if self.short else ""),
            *([f"  output      {out}"] if out else []),
            f"  kept        {len(self.kept)} of {self.settings.count} requests wanted (split {self.settings.split})",
            f"  generated   {self.stats.read} candidates in {self.rounds} round(s), {self.tokens} tokens in "
            f"{format_seconds(self.seconds)} ({self.seconds:.1f} s, {tps:.0f} tokens/s)",
            f"  sampling    temperature {self.settings.temperature}, top_p {self.settings.top_p}, "
            f"<= {self.settings.max_new_tokens} new tokens, seed {self.settings.seed}",
            f"  prefix      {self.prefix!r} ({self.prefix_tokens} tokens)",
            f"  overlaps    {overlaps}",
            f"  accounting  generated {self.stats.read} = kept {len(self.kept)} + dropped {self.stats.skipped}",
            "=" * 72,
            self.stats.summary(),
        ]
        return "\n".join(lines)


def _round_size(wanted: int, kept: int, generated: int) -> int:
    missing = wanted - kept
    if generated == 0:
        return math.ceil(ROUND_MARGIN * wanted)
    share = kept / generated
    return min(math.ceil(missing / share * 1.1) + 1, 4 * math.ceil(ROUND_MARGIN * wanted))


def sample_requests(
    engine: AnswerEngine,
    tokenizer: Any,
    settings: SelfPromptSettings,
    benchmarks: Mapping[str, Sequence[str]],
    *,
    enable_thinking: bool | None = None,
    log: TextIO | None = None,
    progress_stream: TextIO | None = None,
) -> SelfPromptReport:
    """`settings.count` user requests written by the target behind `engine` (module doc), in id order."""
    settings.validate()
    log = log or sys.stdout
    prefix = user_request_prefix(tokenizer, enable_thinking)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    special_texts = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    judge = RequestFilter(benchmarks, settings.split, special_texts)
    report = SelfPromptReport(settings, prefix, len(prefix_ids), overlaps=judge.overlaps)
    print(engine.description, file=log)
    progress = Progress(settings.count, "self-prompts", stream=progress_stream or sys.stderr)
    started = time.monotonic()
    first_failure: BaseException | None = None
    try:  # the rounds (module doc)
        while len(report.kept) < settings.count:
            if report.rounds == MAX_ROUNDS:
                report.short = f"{MAX_ROUNDS} rounds were not enough"
                break
            size = _round_size(settings.count, len(report.kept), report.stats.read)
            start = report.stats.read
            jobs = []
            for n in range(start, start + size):
                row_id = f"self/{settings.seed}/{n}"
                jobs.append(Job(request_prompt(row_id, ""), list(prefix_ids), row_seed(settings.seed, row_id)))
            report.rounds += 1
            finished: dict[int, Answer | BaseException] = {}
            for job, result in engine.answers(jobs):
                finished[int(job.prompt.id.rsplit("/", 1)[1])] = result
                if not isinstance(result, BaseException):
                    report.tokens += result.completion_tokens
                report.seconds = time.monotonic() - started
                progress.update(0, note=f"round {report.rounds}: {len(finished)}/{size} sampled, "
                                        f"{report.tokens / max(report.seconds, 1e-9):.0f} tok/s")
            report.stats.count_read(size)
            kept_before, failed = len(report.kept), 0
            for n in range(start, start + size):
                result = finished.get(n, RuntimeError("the engine returned no answer for this row"))
                row_id = f"self/{settings.seed}/{n}"
                if isinstance(result, BaseException):
                    first_failure, failed = first_failure or result, failed + 1
                    report.stats.skip(f"{GENERATION_FAILED}: {type(result).__name__}", f"{row_id}: {result}")
                    continue
                text = result.text.strip()
                reason = judge.reason_to_drop(text, result.finish_reason)
                if reason is None and len(report.kept) >= settings.count:
                    reason = BEYOND_COUNT
                if reason is not None:
                    report.stats.skip(reason, f"{row_id}: {text[:100]!r}")
                    continue
                report.kept.append(request_prompt(row_id, text))
                progress.update(1)
            if len(report.kept) == kept_before:
                if first_failure is not None and kept_before == 0 and failed == size:
                    raise first_failure  # every row failed and nothing ever worked: a setup problem, not bad rows
                report.short = f"round {report.rounds} kept no new request"
                break
    finally:
        report.seconds = time.monotonic() - started
        progress.close()
    return report
