"""TEMPORARY driver: answers prompts with an AnswerEngine under the local path's rules.

The generator's branch gives data/regenerate.py a `regenerate(engine=...)` that drives any
AnswerEngine; until it lands, this module drives the endpoint engine with the same rules, reusing
what data/regenerate.py already has (settings sidecar and resume checks, torn-line repair, report,
row seeds, skip reasons): the same rows, the same accounting. Delete it when the two merge.

Rows are written as their answers arrive (any order; readers key rows by `id`), each line flushed
at once and the file fsync'ed at least every `FSYNC_SECONDS`, so an interrupted or failed run
keeps every row it had answered; rerunning the same command resumes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from ..config import ConfigError
from ..progress import Progress
from .endpoint import AnswerEngine, EndpointError, Job
from .readers import Prompt, RowStats
from .regenerate import DUPLICATE_ID, GENERATION_FAILED, GenerationSettings, RegenerationReport, prepare_output, row_seed
from .render import RenderError, render_prompt

FSYNC_SECONDS = 1.0


def _row(prompt: Prompt, text: str, finish_reason: str, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": prompt.id,
        "messages": [*prompt.messages, {"role": "assistant", "content": text}],
        "finish_reason": finish_reason,
        "completion_tokens": completion_tokens,
    }


def regenerate_with_engine(
    engine: AnswerEngine,
    prompts: Sequence[Prompt],
    out: str | Path,
    *,
    stats: RowStats,
    record: dict[str, Any],
    settings: GenerationSettings,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    log: TextIO | None = None,
    progress_stream: TextIO | None = None,
) -> RegenerationReport:
    """Answer `prompts` with `engine`, appending rows to `out` (resumed if it holds rows of the same `record`)."""
    log = log or sys.stdout
    out = Path(out)
    if not out.name.endswith(".jsonl"):
        raise ConfigError(f"--out {out}: must be a .jsonl file (appended to and resumed; not compressed)")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ConfigError("a prompt-length cap needs a tokenizer (pass --target)")
    done = prepare_output(out, record, log)
    report = RegenerationReport(out, stats)
    seen: set[str] = set()
    jobs: list[Job] = []
    too_long = f"prompt longer than {max_prompt_tokens} tokens"
    for prompt in prompts:
        if prompt.id in seen:
            stats.skip(DUPLICATE_ID, f"{prompt.source}: id {prompt.id!r}")
            continue
        seen.add(prompt.id)
        ids = None
        if tokenizer is not None:
            try:
                ids = render_prompt(tokenizer, prompt.messages, enable_thinking=settings.enable_thinking)
            except RenderError as error:
                stats.skip("chat template error", f"{prompt.source}: {error}")
                continue
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
    print(f"answering {len(jobs)} prompts with {engine.description}", file=log, flush=True)

    progress = Progress(len(jobs), "regenerate", stream=progress_stream or sys.stderr)
    started = time.monotonic()
    synced = started
    handle = open(out, "a", encoding="utf-8")
    try:
        for job, result in engine.answers(jobs):
            if isinstance(result, BaseException):
                stats.skip(f"{GENERATION_FAILED}: {type(result).__name__}", f"{job.prompt.source}: {result}")
            else:
                row = _row(job.prompt, result.text, result.finish_reason, result.completion_tokens)
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                handle.flush()
                report.new += 1
                report.tokens += result.completion_tokens
                report.finish[result.finish_reason] += 1
            now = time.monotonic()
            if now - synced >= FSYNC_SECONDS:
                os.fsync(handle.fileno())
                synced = now
            report.seconds = now - started
            progress.update(1, note=f"{report.tokens / max(report.seconds, 1e-9):.0f} tok/s")
    except EndpointError as error:
        raise EndpointError(f"{error}; the {report.new} rows answered in this run are kept in {out}: "
                            "run the same command again to resume") from None
    except KeyboardInterrupt:
        report.interrupted = True
        raise
    finally:
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        report.seconds = time.monotonic() - started
        progress.close()
        if report.interrupted:
            print(report.summary(), file=log)
    return report
