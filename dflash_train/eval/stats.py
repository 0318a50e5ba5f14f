"""τ statistics, per-prompt eval records and their summaries, and merging eval shards."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..config import UserError


def tau_statistics(acceptance_per_prompt: Sequence[Sequence[int]], block_size: int) -> dict[str, Any]:
    """τ over prompts: mean and median of per-prompt means (prompts without a verify step are
    left out, as the reference does), pooled over all steps, and the histogram over 1..B."""
    per_prompt = [sum(a) / len(a) for a in acceptance_per_prompt if a]
    steps = [x for a in acceptance_per_prompt for x in a]
    histogram = {k: 0 for k in range(1, block_size + 1)}
    for x in steps:
        histogram[x] = histogram.get(x, 0) + 1
    return {
        "tau_mean": statistics.fmean(per_prompt) if per_prompt else None,
        "tau_median": statistics.median(per_prompt) if per_prompt else None,
        "tau_pooled": sum(steps) / len(steps) if steps else None,
        "steps": len(steps),
        "histogram": histogram,
    }



@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    new_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    tau: float | None = None
    seconds: float = 0.0
    decode_seconds: float = 0.0
    baseline_new_tokens: int | None = None
    baseline_seconds: float | None = None
    baseline_decode_seconds: float | None = None
    same_as_baseline: bool | None = None  # greedy only: token-for-token equality
    decoder: str | None = None  # "static" or "hf": which decoder ran this prompt (see make_decoder)
    error: str | None = None


def summarize(results: list[PromptResult], block_size: int) -> dict[str, Any]:
    """One benchmark's numbers. tokens/s = new tokens / (prefill + decode) seconds summed over
    prompts; decode tokens/s leaves out the prefill and its token (the reference's TPOT view).
    Speed-ups compare with target-only decoding of the same prompts."""
    done = [r for r in results if r.error is None]
    stats = tau_statistics([r.acceptance_lengths for r in done], block_size)

    def rate(tokens: float, seconds: float) -> float | None:
        return tokens / seconds if seconds > 0 else None

    summary: dict[str, Any] = {
        "prompts": len(results),
        "errors": len(results) - len(done),
        **stats,
        "new_tokens": sum(r.new_tokens for r in done),
        "tokens_per_s": rate(sum(r.new_tokens for r in done), sum(r.seconds for r in done)),
        "decode_tokens_per_s": rate(sum(r.new_tokens - 1 for r in done if r.new_tokens), sum(r.decode_seconds for r in done)),
    }
    base = [r for r in done if r.baseline_seconds is not None]
    if base:
        summary["baseline_tokens_per_s"] = rate(sum(r.baseline_new_tokens for r in base), sum(r.baseline_seconds for r in base))
        summary["baseline_decode_tokens_per_s"] = rate(
            sum(r.baseline_new_tokens - 1 for r in base if r.baseline_new_tokens), sum(r.baseline_decode_seconds for r in base)
        )
        for key, spec_key, base_key in (
            ("speedup", "tokens_per_s", "baseline_tokens_per_s"),
            ("decode_speedup", "decode_tokens_per_s", "baseline_decode_tokens_per_s"),
        ):
            summary[key] = summary[spec_key] / summary[base_key] if summary[spec_key] and summary[base_key] else None
        compared = [r for r in base if r.same_as_baseline is not None]
        if compared:
            summary["identical_to_baseline"] = sum(r.same_as_baseline for r in compared)
            summary["compared"] = len(compared)
    return summary


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def format_benchmark(name: str, summary: dict[str, Any]) -> list[str]:
    steps = summary["steps"] or 0
    histogram = " ".join(
        f"{k}:{100 * count / steps:.0f}%" for k, count in summary["histogram"].items() if steps and count
    )
    lines = [
        f"{name}: {summary['prompts']} prompts, {summary['new_tokens']} new tokens, {steps} verify steps"
        + (f", {summary['errors']} FAILED" if summary["errors"] else ""),
        f"  tau  mean {_fmt(summary['tau_mean'])}  median {_fmt(summary['tau_median'])}  pooled {_fmt(summary['tau_pooled'])}",
        f"  tau histogram  {histogram or 'n/a'}",
        f"  speculative {_fmt(summary['tokens_per_s'], 1)} tok/s (decode {_fmt(summary['decode_tokens_per_s'], 1)})",
    ]
    if "baseline_tokens_per_s" in summary:
        lines.append(
            f"  target-only {_fmt(summary['baseline_tokens_per_s'], 1)} tok/s (decode {_fmt(summary['baseline_decode_tokens_per_s'], 1)})"
            f"  speed-up {_fmt(summary['speedup'], 2, 'x')} (decode {_fmt(summary['decode_speedup'], 2, 'x')})"
        )
    if "identical_to_baseline" in summary:
        lines.append(f"  greedy output identical to target-only: {summary['identical_to_baseline']}/{summary['compared']} prompts")
    return lines


def format_summary(summaries: dict[str, dict[str, Any]]) -> list[str]:
    header = f"{'benchmark':<14}{'prompts':>8}{'tau mean':>10}{'median':>8}{'pooled':>8}{'tok/s':>9}{'base':>9}{'speed-up':>10}"
    lines = [header, "-" * len(header)]
    for name, s in summaries.items():
        lines.append(
            f"{name[:13]:<14}{s['prompts']:>8}{_fmt(s['tau_mean']):>10}{_fmt(s['tau_median']):>8}{_fmt(s['tau_pooled']):>8}"
            f"{_fmt(s['tokens_per_s'], 1):>9}{_fmt(s.get('baseline_tokens_per_s'), 1):>9}{_fmt(s.get('speedup'), 2, 'x'):>10}"
        )
    return lines



class MergeError(UserError, ValueError):
    """Shards that cannot be merged into one run (different settings, overlapping prompts)."""


# Settings that change τ or the speed-up: shards that differ in one of them measured different things.
_SHARD_SETTINGS = ("max_new_tokens", "temperature", "baseline")


def _check_same_pair(path: Path, payload: dict[str, Any], first_path: Path, first: dict[str, Any]) -> None:
    """Refuse shards that measured different drafters or targets (compared by content, recorded
    by `eval.run.pair_identity`; paths may differ between machines). Shards from an eval without
    that record are compared by the --target / --drafter they were given."""
    mine, theirs = payload.get("pair"), first.get("pair")
    if (mine is None) != (theirs is None):
        older = path if mine is None else first_path
        raise MergeError(f"{older} does not record which drafter and target it measured (an older `dflash-train eval`); "
                         "re-run that shard to merge it")
    for role in ("drafter", "target"):
        if mine is None:
            a, b = payload.get("config", {}).get(role), first.get("config", {}).get(role)
            if a != b:
                raise MergeError(f"--{role} is {a!r} in {path} but {b!r} in {first_path}: not one run")
            continue
        ours, other = mine.get(role, {}), theirs.get(role, {})
        differing = sorted(k for k in set(ours) | set(other) if k != "path" and ours.get(k) != other.get(k))
        if differing:
            raise MergeError(f"{path} measured {role} {ours.get('path')} but {first_path} measured {other.get('path')}, "
                             f"and they differ ({', '.join(differing)}): not one {role}")


def merge_eval_results(paths: Sequence[str | Path]) -> dict[str, Any]:
    """One payload, shaped like `run_eval`'s --json, from the --json files of shards of one run
    (`eval --offset O --limit N` over disjoint prompt ranges of the same benchmarks).

    Per benchmark the per-prompt records are concatenated in offset order (shards with equal
    offsets keep the order given) and the summary is recomputed from them, so τ statistics are
    those of one unsharded run. A benchmark missing from a shard contributes nothing there.
    Raises MergeError when the drafters or targets differ (see `_check_same_pair`), when block
    sizes or the settings in `_SHARD_SETTINGS` differ, when a prompt id appears twice in a
    benchmark (overlapping shards), or when prompts between two shards are in none (a gap)."""
    if not paths:
        raise MergeError("eval-merge needs at least one --json file of `dflash-train eval`")
    shards = []
    for order, path in enumerate(paths):
        try:
            payload = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise MergeError(f"{path}: no such file") from None
        except json.JSONDecodeError as error:
            raise MergeError(f"{path}: not JSON ({error})") from None
        if "benchmarks" not in payload or "block_size" not in payload:
            raise MergeError(f"{path}: not a --json file of `dflash-train eval` (no benchmarks / block_size)")
        shards.append((int(payload.get("config", {}).get("offset", 0)), order, Path(path), payload))
    shards.sort(key=lambda shard: shard[:2])

    first_path, first = shards[0][2], shards[0][3]
    for _, _, path, payload in shards[1:]:
        _check_same_pair(path, payload, first_path, first)
        if payload["block_size"] != first["block_size"]:
            raise MergeError(f"block size {payload['block_size']} in {path} but {first['block_size']} in {first_path}: not one drafter")
        for key in _SHARD_SETTINGS:
            mine, theirs = payload.get("config", {}).get(key), first.get("config", {}).get(key)
            if mine != theirs:
                raise MergeError(f"{key} is {mine!r} in {path} but {theirs!r} in {first_path}: not one run")

    known_fields = {f.name for f in dataclasses.fields(PromptResult)}
    merged: dict[str, list[PromptResult]] = {}
    seen: dict[str, dict[str, Path]] = {}
    covered: dict[str, tuple[int, Path]] = {}  # per benchmark: where the shards so far end, and the last one
    for offset, _, path, payload in shards:
        for name, bench in payload["benchmarks"].items():
            if name in covered and offset > covered[name][0]:
                end, before = covered[name]
                raise MergeError(f"{name}: {before} ends at prompt {end} but {path} starts at --offset {offset}: "
                                 f"prompts {end}..{offset - 1} are in no shard; evaluate them (--offset {end} "
                                 f"--limit {offset - end}) and merge that shard too")
            covered[name] = (max(offset + len(bench["prompts"]), covered.get(name, (0, path))[0]), path)
            results, owners = merged.setdefault(name, []), seen.setdefault(name, {})
            for record in bench["prompts"]:
                prompt_id = record["id"]
                if prompt_id in owners:
                    raise MergeError(f"{name}: prompt {prompt_id!r} is in both {owners[prompt_id]} and {path}: shards overlap")
                owners[prompt_id] = path
                results.append(PromptResult(**{k: v for k, v in record.items() if k in known_fields}))

    block_size = first["block_size"]
    return {
        "block_size": block_size,
        "shards": [str(path) for _, _, path, _ in shards],
        **{key: first[key] for key in ("device", "dtype", "stop_token_ids", "pair") if key in first},
        "benchmarks": {
            name: {"summary": summarize(results, block_size), "prompts": [dataclasses.asdict(r) for r in results]}
            for name, results in merged.items()
        },
    }


