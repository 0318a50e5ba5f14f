"""Regeneration: the target writes the answers its drafter will learn from.

A drafter is only as good as the match between its training answers and what the target itself
would write, so prompts are answered by the target (greedy by default), and each answer is
written as a training row the conversation reader takes as is:

    {"id": ..., "messages": [...prompt messages..., {"role": "assistant", "content": answer}],
     "finish_reason": "stop" | "length", "completion_tokens": n}

"stop" means the target emitted an end-of-turn token (tokenizer eos or generation_config eos ids;
the token itself is not part of `content`, the chat template adds it back when the row is
rendered); "length" means `max_new_tokens` ran out first.

Decoding is a plain KV-cache loop over a left-padded batch. Rows that finish leave the batch
(their cache rows are dropped), so a batch costs as many steps as its longest answer, at the
width of the answers still running. Sampling (`temperature > 0`) draws each row from its own
generator seeded by (seed, row id), so a row's answer does not depend on its batch neighbours.

Resuming. The output is append-only: each batch's rows are written in one piece, flushed and
fsync'ed. A restart truncates a torn last line (kill -9 during a write), reads the ids already
present and generates only the others. Batches are a fixed function of the input (windows of
`16 × batch_size` prompts in file order, sorted by prompt length, cut into batches), whatever was
done before, and a batch with some rows already written is generated again in full and only its
missing rows are written: an interrupted and resumed run writes the same rows as one that was
never interrupted. (Rows are therefore written in batch order, not in input order; readers
key them by `id`.) A sidecar `OUT.regenerate.json` records the settings that shape the answers;
resuming with other settings is refused rather than mixing two kinds of answers in one file.

Accounting: every input row is exactly one of ok (written now, or already in the output), failed
(generation raised for that row alone) or skipped (unreadable row, duplicate id, chat template
error, prompt too long); failed and skipped rows are counted by reason in a RowStats.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch

from ..config import ConfigError
from ..files import write_json_atomic
from ..progress import Progress, format_seconds
from .readers import DataError, Prompt, RowStats
from .render import RenderError, render_prompt, stop_token_ids

# Prompts are sorted by length inside windows of this many batches: less padding, and the
# batches stay a function of the input alone (see the module doc).
WINDOW_BATCHES = 16
DUPLICATE_ID = "duplicate id"
GENERATION_FAILED = "generation failed"


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


@dataclass(frozen=True)
class Generated:
    tokens: list[int]  # the answer's tokens, the stop token included when there is one
    finish_reason: str  # "stop" or "length"

    def answer_tokens(self) -> list[int]:
        return self.tokens[:-1] if self.finish_reason == "stop" else self.tokens


def row_seed(seed: int, row_id: str) -> int:
    """A stable 63-bit seed per (run seed, row id): Python's hash() differs between processes."""
    digest = hashlib.sha256(f"{seed}\0{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _cache_keyword(model: Any) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` on the forward; accept either.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _choose(logits: torch.Tensor, settings: GenerationSettings, generators: list[torch.Generator] | None) -> torch.Tensor:
    if settings.greedy or generators is None:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= settings.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])


@torch.inference_mode()
def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    settings: GenerationSettings = GenerationSettings(),
    seeds: Sequence[int] | None = None,
) -> list[Generated]:
    """Answer a batch of tokenized prompts (left-padded here) with a KV cache.

    `seeds` (one per prompt) are required for sampling; greedy ignores them.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    count = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    attention = torch.zeros((count, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - len(prompt):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    # Left padding shifts every row; positions count real tokens only, as for an unpadded prompt.
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    generators = None
    if not settings.greedy:
        if seeds is None or len(seeds) != count:
            raise ValueError("sampling needs one seed per prompt")
        generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    stops = set(int(s) for s in stop_ids)
    cache = DynamicCache(config=model.config)
    cache_kw = {_cache_keyword(model): cache}
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                   logits_to_keep=1, **cache_kw).logits[:, -1]
    next_position = positions[:, -1:] + 1
    live = list(range(count))  # original index of each row still in the batch
    tokens: list[list[int]] = [[] for _ in range(count)]
    finish = ["length"] * count
    for step in range(max_new_tokens):
        chosen = _choose(logits, settings, generators)
        keep = []
        for slot, (row, token) in enumerate(zip(live, chosen.tolist())):
            tokens[row].append(token)
            if token in stops:
                finish[row] = "stop"
            else:
                keep.append(slot)
        if not keep or step + 1 == max_new_tokens:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            chosen, attention, next_position = chosen[index], attention[index], next_position[index]
            live = [live[k] for k in keep]
            if generators is not None:
                generators = [generators[k] for k in keep]
        attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=-1)
        logits = model(input_ids=chosen[:, None], attention_mask=attention, position_ids=next_position,
                       use_cache=True, **cache_kw).logits[:, -1]
        next_position = next_position + 1
    return [Generated(tokens[i], finish[i]) for i in range(count)]


def settings_path(out: Path) -> Path:
    return out.with_name(out.name + ".regenerate.json")


def output_record(target_name: str, settings: GenerationSettings) -> dict[str, Any]:
    return {"target": target_name, "settings": asdict(settings)}


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
    before = json.loads(sidecar.read_text())
    changed = [f"{k}: {before['settings'].get(k)!r} before, {v!r} now" for k, v in record["settings"].items()
               if before["settings"].get(k) != v]
    if before.get("target") != record["target"]:
        changed.insert(0, f"target: {before.get('target')} before, {record['target']} now")
    if changed:
        raise RegenerateError(
            f"{out} was written with other settings ({'; '.join(changed)}); resume with the same settings, "
            "or write to another --out"
        )
    return True


def prepare_output(out: Path, record: dict[str, Any], log: TextIO) -> set[str]:
    """Ids already in `out`, after dropping a torn last line; checks or writes the settings sidecar."""
    if not check_output(out, record):
        out.parent.mkdir(parents=True, exist_ok=True)
        sidecar = settings_path(out)
        write_json_atomic(sidecar, record)
        out.touch()
        return set()
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
    for number, line in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row_id = json.loads(line)["id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{out}:{number}", "", "not a row written by regenerate; the file was edited, "
                            "fix or delete that line to resume") from None
        ids.add(str(row_id))
    return ids


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

    @property
    def failed(self) -> int:
        return sum(n for reason, n in self.stats.skipped_by_reason.items() if reason.startswith(GENERATION_FAILED))

    def summary(self) -> str:
        rate = self.new / self.seconds if self.seconds > 0 else 0.0
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        finish = ", ".join(f"{k} {v}" for k, v in sorted(self.finish.items())) or "none"
        skipped = self.stats.skipped - self.failed
        lines = [
            "=" * 72,
            "regenerate summary" + (" (interrupted: run the same command again to resume)" if self.interrupted else ""),
            f"  output      {self.out} ({self.new + self.resumed} rows from this input)",
            f"  this run    {self.new} rows (finish: {finish}), {self.tokens} tokens generated in "
            f"{format_seconds(self.seconds)} ({self.seconds:.1f} s): {rate:.2f} rows/s, {tps:.1f} tokens/s",
            f"  resumed     {self.resumed} rows were already in the output",
            f"  accounting  input {self.stats.read} = ok {self.new + self.resumed} + failed {self.failed} + skipped {skipped}",
            "=" * 72,
            self.stats.summary(),
        ]
        return "\n".join(lines)


def _batches(items: list[tuple[Prompt, list[int]]], batch_size: int) -> list[list[tuple[Prompt, list[int]]]]:
    window = batch_size * WINDOW_BATCHES
    out = []
    for start in range(0, len(items), window):
        chunk = sorted(items[start:start + window], key=lambda item: len(item[1]))
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return out


def _row(prompt: Prompt, answer: str, generated: Generated) -> dict[str, Any]:
    return {
        "id": prompt.id,
        "messages": [*prompt.messages, {"role": "assistant", "content": answer}],
        "finish_reason": generated.finish_reason,
        "completion_tokens": len(generated.tokens),
    }


def regenerate(
    target: Any,
    prompts: Sequence[Prompt],
    out: str | Path,
    *,
    stats: RowStats,
    settings: GenerationSettings = GenerationSettings(),
    batch_size: int = 8,
    max_prompt_tokens: int | None = None,
    target_name: str | None = None,
    log: TextIO | None = None,
    progress_stream: TextIO | None = None,
) -> RegenerationReport:
    """Answer `prompts` with `target` (a dflash_train Target) and append the rows to `out`.

    `stats` must already count the input rows as read (the reader does, for a file); this adds
    the skipped and failed ones. Resumes an existing `out` (see the module doc). `target_name`
    (default: the target's folder) is what the settings sidecar records for the target.
    """
    log = log or sys.stdout
    out = Path(out)
    if not out.name.endswith(".jsonl"):
        raise ConfigError(f"--out {out}: must be a .jsonl file (appended to and resumed; not compressed)")
    model, tokenizer = target.model, target.tokenizer
    if tokenizer is None:
        raise ConfigError(f"{target.path}: no tokenizer next to the model; it is needed to render the prompts")
    stop_ids = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if max_prompt_tokens is None:
        max_prompt_tokens = context - settings.max_new_tokens if context else None
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ConfigError(f"--max-new-tokens {settings.max_new_tokens} leaves no room for a prompt in the "
                              f"target's {context}-token context")
    record = output_record(target_name or str(target.path), settings)
    record["stop_token_ids"] = stop_ids
    done = prepare_output(out, record, log)
    report = RegenerationReport(out, stats)

    # Every input row is accounted for here: duplicates, template errors and over-long prompts
    # are skipped; the others are rendered once and wait for their batch.
    seen: set[str] = set()
    items: list[tuple[Prompt, list[int]]] = []
    too_long = f"prompt longer than {max_prompt_tokens} tokens"
    for prompt in prompts:
        if prompt.id in seen:
            stats.skip(DUPLICATE_ID, f"{prompt.source}: id {prompt.id!r}")
            continue
        seen.add(prompt.id)
        try:
            ids = render_prompt(tokenizer, prompt.messages, enable_thinking=settings.enable_thinking)
        except RenderError as error:
            stats.skip("chat template error", f"{prompt.source}: {error}")
            continue
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            stats.skip(too_long, f"{prompt.source}: {len(ids)} tokens")
            continue
        items.append((prompt, ids))
    report.resumed = sum(1 for prompt, _ in items if prompt.id in done)
    foreign = len(done - seen)
    if foreign:
        print(f"note: {out} also holds {foreign} rows whose ids are not in this input (kept)", file=log)
    if report.resumed:
        print(f"resuming {out}: {report.resumed} of {len(items)} rows already written", file=log)

    progress = Progress(len(items) - report.resumed, "regenerate", stream=progress_stream or sys.stderr)
    progress.last_draw = progress.started  # the first line after `every_seconds`: short runs print one line
    started = time.monotonic()
    handle = open(out, "a", encoding="utf-8")
    try:
        for batch in _batches(items, batch_size):
            todo = [item for item in batch if item[0].id not in done]
            if not todo:
                continue
            generated = _generate_rows(model, batch, stop_ids, pad_id, settings, stats, report)
            lines = []
            for (prompt, _ids), result in zip(batch, generated):
                if prompt.id in done or result is None:
                    continue
                answer = tokenizer.decode(result.answer_tokens(), skip_special_tokens=False)
                lines.append(json.dumps(_row(prompt, answer, result), ensure_ascii=False) + "\n")
                report.tokens += len(result.tokens)
                report.finish[result.finish_reason] += 1
            if lines:
                handle.write("".join(lines))
                handle.flush()
                os.fsync(handle.fileno())
            report.new += len(lines)
            report.seconds = time.monotonic() - started
            progress.update(len(todo), note=f"{report.tokens / max(report.seconds, 1e-9):.0f} tok/s")
    except KeyboardInterrupt:
        report.interrupted = True
        raise
    finally:
        handle.close()
        report.seconds = time.monotonic() - started
        progress.close()
        if report.interrupted:
            print(report.summary(), file=log)
    return report


def _generate_rows(model, batch, stop_ids, pad_id, settings, stats, report) -> list[Generated | None]:
    """The batch's answers. If the batch fails (out of memory, a row the model cannot take), each
    row is retried alone, and a row that still fails is counted as failed (None)."""
    prompts = [ids for _, ids in batch]
    seeds = [row_seed(settings.seed, prompt.id) for prompt, _ in batch]
    kwargs = dict(max_new_tokens=settings.max_new_tokens, stop_ids=stop_ids, pad_id=pad_id, settings=settings)
    try:
        return generate_batch(model, prompts, seeds=seeds, **kwargs)
    except Exception as error:  # noqa: BLE001 - isolated row by row below
        batch_error = error
    _release_memory(model)
    results: list[Generated | None] = [None] * len(batch)
    errors: list[BaseException | None] = [batch_error] * len(batch)
    for i, (ids, seed) in enumerate(zip(prompts, seeds)):
        if len(batch) == 1:
            break  # that row just failed alone
        try:
            results[i], errors[i] = generate_batch(model, [ids], seeds=[seed], **kwargs)[0], None
        except Exception as error:  # noqa: BLE001 - counted per row below
            errors[i] = error
            _release_memory(model)
    if report.new == 0 and all(result is None for result in results):
        # Nothing has worked yet and every row of this batch fails: a setup problem, not bad rows.
        raise batch_error
    for (prompt, _), error in zip(batch, errors):
        if error is not None:
            stats.skip(f"{GENERATION_FAILED}: {type(error).__name__}", f"{prompt.source}: {error}")
    return results


def _release_memory(model: Any) -> None:
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()
