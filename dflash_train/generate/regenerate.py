"""Regeneration: the target writes the answers its drafter will learn from.

A drafter is only as good as the match between its training answers and what the target itself
would write, so prompts are answered by the target (greedy by default), and each answer is
written as a training row the conversation reader takes as is:

    {"id": ..., "messages": [...prompt messages..., {"role": "assistant", "content": answer}],
     "finish_reason": "stop" | "length", "completion_tokens": n,
     "answer_token_ids": [...], "tokenizer_fingerprint": "sha256:..."}

"stop" means the target emitted an end-of-turn token (tokenizer eos or generation_config eos ids;
the token itself is not part of `content`, the chat template adds it back when the row is
rendered); "length" means `max_new_tokens` ran out first. `answer_token_ids` are the answer's
tokens exactly as the target generated them (the stop token excluded, like the text), and
`tokenizer_fingerprint` names the tokenizer they belong to (`render.tokenizer_fingerprint`):
training renders the answer from them where the target's tokenizer has that fingerprint, since
a target does not always write the canonical tokenization of its own text. A row has them when
the engine returned ids (the local engines always; a server where it returns them, see
endpoint.py) and they decode to the row's text with the tokenizer given here; otherwise the row
is text only, as rows written before ids were kept (training reads both kinds).

This module is the driver: it reads and deduplicates the prompts, renders them, skips what
cannot be answered, resumes, writes and accounts. The answers come from an `AnswerEngine`, which
takes `Job`s and yields `(job, Answer)` (or `(job, exception)` for a row that failed) as rows
finish, in any order: the local engines in `generate/engine.py` (the static continuous-batching
generator, or Hugging Face eagerly for targets it cannot run), or a server (`--endpoint`).
Sampling (`temperature > 0`) gives each row its own seed, `row_seed(seed, row id)`; the local
engines draw from it alone, so a row's answer does not depend on its batch neighbours.

Resuming. The output is append-only: finished rows are written in chunks (every `flush_seconds`,
and at the end), each chunk flushed and fsync'ed. A restart truncates a torn last line (kill -9
during a write), reads the ids already present and gives the engine only the others: no row is
lost (a row is either in the file whole, or answered again) and none is written twice. What a
resumed run does not reproduce: the order of rows in the file (rows are written as they finish;
readers key them by `id`), and bit-for-bit answers where the device's arithmetic depends on the
batch a row shares. Each row's answer is a function of its prompt, its seed and the settings;
on CPU in float32 the resumed rows equal an uninterrupted run's (tested), while on a GPU in
bfloat16 the kernels chosen for a prefill of another batch shape can round differently and flip
a near-tie (as any two runs with different batch sizes can). A sidecar `OUT.regenerate.json`
records the settings that shape the answers; resuming with other settings is refused rather
than mixing two kinds of answers in one file.

Accounting: every input row is exactly one of ok (written now, or already in the output), failed
(the engine failed that row alone) or skipped (unreadable row, duplicate id, chat template
error, prompt too long); failed and skipped rows are counted by reason in a RowStats. When the
first rows of a run all fail, that is a setup problem, not bad data: the first error is raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, Sequence, TextIO

from ..config import ConfigError, UserError
from ..data.readers import DataError, Prompt, RowStats
from ..data.render import RenderError, decode_text, render_prompt, tokenizer_fingerprint
from ..errors import StoppedAndKept
from ..files import write_json_atomic
from ..processes import default_workers, map_anywhere
from ..progress import Progress, format_seconds

DUPLICATE_ID = "duplicate id"
GENERATION_FAILED = "generation failed"
SETUP_FAILURES = 8  # a run whose first this many rows (or all, if fewer) fail stops with the first error
SAMPLER = "counter-hash-v1"  # how the local engines draw (decode/sampling.py); recorded for sampled runs
# Fewer prompts render about as fast in this process as in workers: a prompt takes ~0.3 ms of a
# core, a worker ~0.7 s to start (Python, transformers, the tokenizer unpickled), and the parent
# ~15 µs a prompt to unpickle its ids; two workers on two cores break even near 8,000 prompts.
PARALLEL_MIN_PROMPTS = 8192


class RegenerateError(ConfigError):
    """The output file cannot be resumed with these settings (or was not written by regenerate)."""


@dataclass(frozen=True)
class GenerationSettings:
    """What shapes the answers; recorded next to the output and checked on resume."""

    max_new_tokens: int = 1024
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    enable_thinking: bool | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Job:
    """One prompt to answer: `ids` are its rendered tokens (None when no tokenizer is used, e.g.
    a server renders it), `seed` its own sampling seed."""

    prompt: Prompt
    ids: list[int] | None
    seed: int


@dataclass
class Answer:
    text: str
    finish_reason: str  # "stop" | "length"
    completion_tokens: int  # generated tokens, the stop token included
    # The generated tokens where the engine has them (a server's may include the stop token).
    token_ids: list[int] | None = None


class AnswerEngine(Protocol):
    """Anything that answers jobs: yields each job once with its Answer, or with the exception
    that failed that row alone (counted; the run goes on), in any order, as rows finish. An
    exception raised instead ends the run (rows already written are kept)."""

    description: str  # one line for the run's header
    # The driver stops with the first error when this many leading rows (or all, if fewer) failed
    # and none succeeded: a setup problem, not bad rows. None: the engine applies its own rule.
    setup_failures: int | None

    def answers(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Answer | BaseException]]: ...


def row_seed(seed: int, row_id: str) -> int:
    """A stable 63-bit seed per (run seed, row id): Python's hash() differs between processes."""
    digest = hashlib.sha256(f"{seed}\0{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def prompt_token_limit(context: int | None, max_new_tokens: int, max_prompt_tokens: int = 0,
                       names: tuple[str, str] = ("--max-new-tokens", "--max-prompt-tokens")) -> int | None:
    """The longest prompt to admit: `max_prompt_tokens`, else what the target's `context` leaves
    after the answer (None when neither bounds it). Refused when an answer could run past the
    context: positions the target was never trained on make garbage training rows. `names` are
    what the user calls the two settings (flags, or a recipe's keys)."""
    new_name, prompt_name = names
    if not context:
        return max_prompt_tokens or None
    if context - max_new_tokens < 1:
        raise ConfigError(f"{new_name} {max_new_tokens} leaves no room for a prompt in the target's {context}-token context")
    if max_prompt_tokens and max_prompt_tokens + max_new_tokens > context:
        raise ConfigError(f"{prompt_name} {max_prompt_tokens} + {new_name} {max_new_tokens} exceed the target's "
                          f"{context}-token context: an answer could run past it; lower one of them")
    return max_prompt_tokens or context - max_new_tokens


def settings_path(out: Path) -> Path:
    return out.with_name(out.name + ".regenerate.json")


def output_record(target_name: str, settings: GenerationSettings, sampler: str = SAMPLER) -> dict[str, Any]:
    """What the sidecar records; `sampler` names how sampled runs draw (another engine, e.g. a
    server, passes its own name here and as `record_extra["sampler"]`)."""
    record: dict[str, Any] = {"target": target_name, "settings": asdict(settings)}
    if not settings.greedy:
        record["sampler"] = sampler
    return record


def check_output(out: Path, record: dict[str, Any]) -> bool:
    """Whether `out` holds rows to resume; refuses a file regenerate did not write, or one written
    with other settings. Cheap (no model needed): the CLI calls it before loading the target."""
    sidecar = settings_path(out)
    if not (out.exists() and out.stat().st_size > 0):
        return False
    if not sidecar.is_file():
        raise RegenerateError(
            f"{out} already exists and was not written by `dflash-train regenerate` (no {sidecar.name} next to it); "
            "choose another --out, or delete the file"
        )
    try:
        before = json.loads(sidecar.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        before = error
    if not isinstance(before, dict) or not isinstance(before.get("settings"), dict):
        why = f"not valid JSON: {before}" if isinstance(before, Exception) else "no settings recorded"
        raise RegenerateError(f"{sidecar}: damaged ({why}), so {out} cannot be resumed safely; restore it, or "
                              "write to another --out")
    changed = [f"{k}: {before['settings'].get(k)!r} before, {v!r} now" for k, v in record["settings"].items()
               if before["settings"].get(k) != v]
    if before.get("target") != record["target"]:
        changed.insert(0, f"target: {before.get('target')} before, {record['target']} now")
    if record["settings"].get("temperature", 0) > 0 and before.get("sampler") != record.get("sampler"):
        changed.append(f"sampler: {before.get('sampler') or 'per-row torch generators'} before, {record.get('sampler')} now")
    if changed:
        raise RegenerateError(
            f"{out} was written with other settings ({'; '.join(changed)}); resume with the same settings, "
            "or write to another --out"
        )
    return True


def prepare_output(out: Path, record: dict[str, Any], log: TextIO) -> tuple[set[str], int]:
    """Ids already in `out`, after dropping a torn last line, and how many of those rows carry no
    answer token ids; checks or writes the settings sidecar."""
    if not check_output(out, record):
        out.parent.mkdir(parents=True, exist_ok=True)
        sidecar = settings_path(out)
        write_json_atomic(sidecar, record)
        out.touch()
        return set(), 0
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        # Written rows end with a newline; anything after the last one is a write cut short.
        with open(out, "r+b") as handle:
            handle.truncate(end)
            handle.flush()
            os.fsync(handle.fileno())
        print(f"{out}: dropped an incomplete last line ({len(data) - end} bytes) left by an interrupted run", file=log)
    ids: set[str] = set()
    without_token_ids = 0
    for number, raw in enumerate(data[:end].split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            row_id = row["id"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{out}:{number}", "", "not a row written by regenerate; the file was edited, "
                            "fix or delete that line to resume") from None
        ids.add(str(row_id))
        without_token_ids += "answer_token_ids" not in row
    return ids, without_token_ids


@dataclass
class RegenerationReport:
    out: Path
    stats: RowStats  # input rows: used = ok (new + resumed); skipped includes failed rows
    new: int = 0
    resumed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    finish: Counter = field(default_factory=Counter)
    interrupted: bool = False
    engine_note: str = ""  # the engine's own account of the run (where it has one)
    fingerprint: str | None = None  # of the tokenizer the answer token ids belong to
    with_token_ids: int = 0  # rows written now with their answer's token ids
    text_only: Counter = field(default_factory=Counter)  # rows written now without them, by reason

    @property
    def failed(self) -> int:
        return sum(n for reason, n in self.stats.skipped_by_reason.items() if reason.startswith(GENERATION_FAILED))

    def summary(self) -> str:
        rate = self.new / self.seconds if self.seconds > 0 else 0.0
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        finish = ", ".join(f"{k} {v}" for k, v in sorted(self.finish.items())) or "none"
        skipped = self.stats.skipped - self.failed
        unanswered = self.stats.read - (self.new + self.resumed) - self.failed - skipped  # in flight at a stop
        lines = [
            "=" * 72,
            "regenerate summary" + (" (interrupted: run the same command again to resume)" if self.interrupted else ""),
            f"  output      {self.out} ({self.new + self.resumed} rows from this input)",
            f"  this run    {self.new} rows (finish: {finish}), {self.tokens} tokens generated in "
            f"{format_seconds(self.seconds)} ({self.seconds:.1f} s): {rate:.2f} rows/s, {tps:.1f} tokens/s",
            f"  resumed     {self.resumed} rows were already in the output",
            *([f"  engine      {self.engine_note}"] if self.engine_note else []),
            f"  token ids   {self.with_token_ids} of {self.new} rows carry their answer's generated token ids"
            + (f" (tokenizer {self.fingerprint})" if self.fingerprint and self.with_token_ids else "")
            + "".join(f"; {n} without: {why}" for why, n in sorted(self.text_only.items())),
            f"  accounting  input {self.stats.read} = ok {self.new + self.resumed} + failed {self.failed} + skipped {skipped}"
            + (f" + not answered yet {unanswered} (the next run answers them)" if unanswered else ""),
            "=" * 72,
            self.stats.summary(),
        ]
        return "\n".join(lines)


NO_IDS_FROM_ENGINE = "the engine returned no token ids"
NO_TOKENIZER = "no tokenizer to name the ids' (pass --target, the served model)"
IDS_NOT_THE_TEXT = "the ids do not decode to the answer text with the target's tokenizer"


def answer_token_ids(answer: Answer, tokenizer: Any | None) -> tuple[list[int] | None, str | None]:
    """The answer's generated token ids without the stop token, checked against its text with
    `tokenizer`, or (None, why not). A server may return the stop token with the ids: a last id
    whose removal makes the ids decode to the text is that token."""
    ids = answer.token_ids
    if ids is None:
        return None, NO_IDS_FROM_ENGINE
    if tokenizer is None:
        return None, NO_TOKENIZER
    if decode_text(tokenizer, ids) == answer.text:
        return list(ids), None
    if answer.finish_reason == "stop" and ids and decode_text(tokenizer, ids[:-1]) == answer.text:
        return list(ids[:-1]), None
    return None, IDS_NOT_THE_TEXT


def _row(prompt: Prompt, answer: Answer, token_ids: list[int] | None, fingerprint: str | None) -> dict[str, Any]:
    row = {
        "id": prompt.id,
        "messages": [*prompt.messages, {"role": "assistant", "content": answer.text}],
        "finish_reason": answer.finish_reason,
        "completion_tokens": answer.completion_tokens,
    }
    if token_ids is not None:
        row["answer_token_ids"] = token_ids
        row["tokenizer_fingerprint"] = fingerprint
    return row


class ChunkWriter:
    """Appends lines to the output in fsync'ed chunks: at most every `flush_seconds`, and on
    `flush()`. A kill loses at most the last unflushed chunk, which a resume answers again."""

    def __init__(self, out: Path, flush_seconds: float):
        self.handle = open(out, "a", encoding="utf-8")
        self.flush_seconds = flush_seconds
        self.pending: list[str] = []
        self.last_flush = time.monotonic()

    def add(self, line: str) -> None:
        self.pending.append(line)
        if time.monotonic() - self.last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            try:
                self.handle.write("".join(self.pending))
                self.handle.flush()
                os.fsync(self.handle.fileno())
            except OSError as error:  # a full disk: the rows flushed before are whole; a rerun resumes
                error.filename = error.filename or self.handle.name
                raise
            self.pending = []
        self.last_flush = time.monotonic()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            try:
                self.handle.close()  # writes what a failed flush left in the file object's buffer
            except OSError as error:
                error.filename = error.filename or self.handle.name
                raise


def regenerate(
    prompts: Sequence[Prompt],
    out: str | Path,
    *,
    engine: AnswerEngine,
    stats: RowStats,
    settings: GenerationSettings = GenerationSettings(),
    target_name: str,
    tokenizer: Any | None = None,
    max_prompt_tokens: int | None = None,
    record_extra: dict[str, Any] | None = None,
    flush_seconds: float = 1.0,
    log: TextIO | None = None,
    progress_stream: TextIO | None = None,
    workers: int | None = None,
    parallel_min_prompts: int = PARALLEL_MIN_PROMPTS,
) -> RegenerationReport:
    """Answer `prompts` with `engine` and append the rows to `out` (resumed if it exists).

    `stats` must already count the input rows as read (the reader does, for a file); this adds
    the skipped and failed ones. With a `tokenizer` the prompts are rendered here (`Job.ids`) and
    those longer than `max_prompt_tokens` skipped; without one, `Job.ids` is None. The settings
    sidecar records `target_name`, `settings` and `record_extra` (e.g. the stop token ids).
    With `parallel_min_prompts` distinct prompts or more, `workers` processes render them (None:
    one per core, at most processes.MAX_WORKERS), or this process if they fail (with a warning):
    the same jobs, skips and stats either way.
    """
    log = log or sys.stdout
    out = Path(out)
    if not out.name.endswith(".jsonl"):
        raise ConfigError(f"--out {out}: must be a .jsonl file (appended to and resumed; not compressed)")
    record = {**output_record(target_name, settings), **(record_extra or {})}
    done, without_token_ids = prepare_output(out, record, log)
    report = RegenerationReport(out, stats, fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None)
    print(engine.description, file=log)

    # Every input row is accounted for here: duplicates, template errors and over-long prompts
    # are skipped; the others become jobs, rendered once. The first prompt of each id is rendered
    # up front (possibly in other processes), then the rows are accounted for in input order.
    # Prompts already in the output are rendered too: one now too long for `max_prompt_tokens` is
    # counted as skipped, not resumed.
    rendered: Iterator[list[int] | str] | None = None
    if tokenizer is not None:
        firsts: dict[str, Prompt] = {}
        for prompt in prompts:
            firsts.setdefault(prompt.id, prompt)
        workers = default_workers() if workers is None else workers
        rendered = iter(_render_prompts(tokenizer, [prompt.messages for prompt in firsts.values()],
                                        settings.enable_thinking, workers, parallel_min_prompts, log))
    seen: set[str] = set()
    jobs: list[Job] = []
    too_long = f"prompt longer than {max_prompt_tokens} tokens"
    for prompt in prompts:
        if prompt.id in seen:
            stats.skip(DUPLICATE_ID, f"{prompt.source}: id {prompt.id!r}")
            continue
        seen.add(prompt.id)
        ids = None
        if rendered is not None:
            outcome = next(rendered)
            if isinstance(outcome, str):
                stats.skip("chat template error", f"{prompt.source}: {outcome}")
                continue
            ids = outcome
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                stats.skip(too_long, f"{prompt.source}: {len(ids)} tokens")
                continue
        if prompt.id in done:
            report.resumed += 1
        else:
            jobs.append(Job(prompt, ids, row_seed(settings.seed, prompt.id)))
    foreign = len(done - seen)
    if foreign:
        print(f"note: {out} also holds {foreign} rows whose ids are not in this input (kept)", file=log)
    if report.resumed:
        print(f"resuming {out}: {report.resumed} of {report.resumed + len(jobs)} rows already written", file=log)
    if without_token_ids:
        print(f"note: {without_token_ids} rows already in {out} carry no answer token ids (written by an engine that "
              "returned none, or before regenerate kept them); training renders those from their text", file=log)

    progress = Progress(len(jobs), "regenerate", stream=progress_stream or sys.stderr)
    progress.last_draw = progress.started  # the first line after `every_seconds`: short runs print one line
    started = time.monotonic()
    writer = ChunkWriter(out, flush_seconds)
    first_failure: BaseException | None = None
    failed = 0
    limit = getattr(engine, "setup_failures", SETUP_FAILURES)
    try:
        for job, result in engine.answers(jobs):
            if isinstance(result, BaseException):
                first_failure, failed = first_failure or result, failed + 1
                stats.skip(f"{GENERATION_FAILED}: {type(result).__name__}", f"{job.prompt.source}: {result}")
                if limit is not None and report.new == 0 and failed >= min(limit, len(jobs)):
                    # Nothing has worked yet and every row so far failed: a setup problem, not bad rows.
                    raise first_failure
            else:
                token_ids, why_not = answer_token_ids(result, tokenizer)
                if token_ids is None:
                    report.text_only[why_not] += 1
                else:
                    report.with_token_ids += 1
                writer.add(json.dumps(_row(job.prompt, result, token_ids, report.fingerprint), ensure_ascii=False) + "\n")
                report.new += 1
                report.tokens += result.completion_tokens
                report.finish[result.finish_reason] += 1
            report.seconds = time.monotonic() - started
            progress.update(1, note=f"{report.tokens / max(report.seconds, 1e-9):.0f} tok/s")
    except UserError as error:
        if report.new == 0:
            raise
        # The engine gave up (a server that went away): every row answered so far stays.
        raise UserError(f"{error}; the {report.new} rows answered in this run are kept in {out}: "
                        "run the same command again to resume") from None
    except KeyboardInterrupt:
        report.interrupted = True
        raise StoppedAndKept() from None  # the summary below says what was kept and how to resume
    finally:
        writer.close()  # finished rows are whole: keep them, whatever ended the run
        report.seconds = time.monotonic() - started
        report.engine_note = engine.run_note() if hasattr(engine, "run_note") else ""
        progress.close()
        if report.interrupted:
            print(report.summary(), file=log)
    return report


def _render_prompts(tokenizer: Any, messages: list[list[dict[str, str]]], enable_thinking: bool | None, workers: int,
                    parallel_min_prompts: int, log: TextIO) -> list[list[int] | str]:
    """`_rendered_prompt` of each prompt's messages, in order: in worker processes when there are
    enough to pay for starting them."""
    if workers > 1 and len(messages) >= parallel_min_prompts:
        print(f"rendering {len(messages)} prompts in {workers} worker processes", file=log, flush=True)
    else:
        workers = 1
    return map_anywhere(_rendered_prompt, messages, workers, fixed=(tokenizer, enable_thinking),
                        what="rendering the prompts")


def _rendered_prompt(tokenizer: Any, enable_thinking: bool | None, messages: list[dict[str, str]]) -> list[int] | str:
    """The prompt's ids, or why the chat template cannot render it: returned, not raised, so that
    one bad prompt does not fail a worker's whole share."""
    try:
        return render_prompt(tokenizer, messages, enable_thinking=enable_thinking)
    except RenderError as error:
        return str(error)
