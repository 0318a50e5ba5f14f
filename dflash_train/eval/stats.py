"""τ statistics, per-prompt eval records and their summaries."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence


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
