#!/usr/bin/env python
"""Speculative-decoding benchmark: our decoder vs target-only decoding vs the reference.

    python bench/spec_decode.py --target DIR --drafter DIR --bench humaneval,mtbench \
        --limit 20 --max-new-tokens 256 --json out.json            # CUDA, bf16 by default

For every prompt it runs, on the same rendered prompt:
  1. our speculative decoder (`dflash_train.decode.loop.generate`) -> tokens, per-step acceptance;
  2. target-only decoding through the same KV-cache loop          -> the speed-up baseline;
  3. the reference `dflash.model.dflash_generate` with the same exported drafter loaded by
     `DFlashDraftModel.from_pretrained` and the same HF target   -> τ cross-check.
At T = 0 it reports whether our tokens equal the target-only tokens and the reference's tokens,
and whether our per-step acceptance lengths equal the reference's. In bf16 the target's logits
for a 16-token verify block and for a 1-token step can differ in the last bit, so a near-tie can
flip an argmax and make greedy outputs diverge from the target-only run: the count of identical
prompts is information, not a failure. The reference runs the very same verify shapes, so our
tokens and its tokens should agree (up to kernel nondeterminism).

Prints one progress line per prompt, then per benchmark τ (mean over prompts, median over
prompts, pooled over steps), the τ histogram, tokens/s and speed-up. Each prompt runs under
try/except (a failure is recorded and the run goes on) and under a faulthandler watchdog that
dumps every thread's stack and exits if one prompt takes longer than --watchdog-s.
Also runs on CPU with tiny models (`--device cpu`, float32) for a quick check.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from dflash_train.target.model import dtype_from_name  # noqa: E402

from dflash_train.config import DECODERS  # noqa: E402
from dflash_train.data.render import render_prompt, stop_token_ids  # noqa: E402
from dflash_train.decode.loop import generate  # noqa: E402
from dflash_train.eval.benchmarks import bench_label, load_benchmark  # noqa: E402
from dflash_train.eval.run import load_pair  # noqa: E402
from dflash_train.eval.stats import tau_statistics  # noqa: E402


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="target Hugging Face folder (or .gguf)")
    parser.add_argument("--drafter", required=True, help="exported DFlash drafter folder")
    parser.add_argument("--bench", default="humaneval,mtbench", help="comma-separated benchmarks or .jsonl files")
    parser.add_argument("--limit", type=int, default=10, help="first N prompts per benchmark (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--no-reference", action="store_true", help="skip the reference dflash_generate cross-check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decoder", default="auto", choices=DECODERS, help="how our decoder runs the forwards")
    parser.add_argument("--watchdog-s", type=float, default=600.0, help="dump stacks and exit if one prompt takes longer")
    parser.add_argument("--json", default="", help="write all numbers and per-prompt records here")
    return parser.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_reference(drafter_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """(dflash.model module, DFlashDraftModel) or (None, None) when the package is missing."""
    try:
        import dflash.model as reference_module
        from dflash import DFlashDraftModel
    except ImportError as error:
        log(f"reference package `dflash` not importable ({error}): skipping the cross-check")
        return None, None
    if device.type != "cuda":
        # The reference's stats timer calls torch.cuda.synchronize(); on CPU use a plain clock.
        reference_module._cuda_time = time.perf_counter
    model = DFlashDraftModel.from_pretrained(drafter_dir, dtype=dtype).to(device).eval()
    return reference_module, model


def summarize(records: list[dict[str, Any]], block_size: int) -> dict[str, Any]:
    ok = [r for r in records if r.get("error") is None]

    def rate(tokens_key: str, seconds_key: str) -> float | None:
        rows = [r for r in ok if r.get(seconds_key)]
        seconds = sum(r[seconds_key] for r in rows)
        return sum(r[tokens_key] for r in rows) / seconds if seconds > 0 else None

    summary: dict[str, Any] = {"prompts": len(records), "errors": len(records) - len(ok)}
    summary["ours"] = tau_statistics([r["acceptance_lengths"] for r in ok], block_size)
    summary["ours"]["tokens_per_s"] = rate("new_tokens", "seconds")
    summary["baseline_tokens_per_s"] = rate("baseline_new_tokens", "baseline_seconds")
    if summary["ours"]["tokens_per_s"] and summary["baseline_tokens_per_s"]:
        summary["speedup"] = summary["ours"]["tokens_per_s"] / summary["baseline_tokens_per_s"]
    with_reference = [r for r in ok if r.get("reference_acceptance_lengths") is not None]
    if with_reference:
        summary["reference"] = tau_statistics([r["reference_acceptance_lengths"] for r in with_reference], block_size)
        summary["reference"]["tokens_per_s"] = rate("reference_new_tokens", "reference_seconds")
    for key in ("same_as_baseline", "same_as_reference", "same_acceptance_as_reference"):
        compared = [r[key] for r in ok if r.get(key) is not None]
        if compared:
            summary[key] = f"{sum(compared)}/{len(compared)}"
    return summary


def print_summary(name: str, summary: dict[str, Any]) -> None:
    def f(x: Any, digits: int = 2) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    ours = summary["ours"]
    steps = ours["steps"] or 1
    log(f"== {name}: {summary['prompts']} prompts ({summary['errors']} failed)")
    log(f"   ours      tau mean {f(ours['tau_mean'])} median {f(ours['tau_median'])} pooled {f(ours['tau_pooled'])}  "
        f"{f(ours['tokens_per_s'], 1)} tok/s")
    log("   histogram " + " ".join(f"{k}:{100 * v / steps:.1f}%" for k, v in ours["histogram"].items()))
    log(f"   target-only {f(summary['baseline_tokens_per_s'], 1)} tok/s   speed-up {f(summary.get('speedup'))}x")
    if "reference" in summary:
        ref = summary["reference"]
        log(f"   reference tau mean {f(ref['tau_mean'])} median {f(ref['tau_median'])} pooled {f(ref['tau_pooled'])}  "
            f"{f(ref['tokens_per_s'], 1)} tok/s")
    for key in ("same_as_baseline", "same_as_reference", "same_acceptance_as_reference"):
        if key in summary:
            log(f"   {key}: {summary[key]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.enable()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("CUDA is not available: pass --device cpu")
        return 2
    dtype = dtype_from_name(args.dtype, device)
    log(f"torch {torch.__version__} | device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "") + f" | {dtype}")

    benches = {}
    for name in [b for b in args.bench.split(",") if b.strip()]:
        prompts = load_benchmark(name)
        benches[bench_label(name)] = prompts[: args.limit or None]
    target, drafter = load_pair(args.target, args.drafter, device, dtype)
    block_size = drafter.config.block_size
    reference_module, reference = (None, None) if args.no_reference else load_reference(args.drafter, device, dtype)
    stops = stop_token_ids(target.model, target.tokenizer)
    log(f"target {args.target} | drafter {args.drafter} (block {block_size}, layers {drafter.config.target_layer_ids}) | "
        f"stop ids {stops} | T={args.temperature} | max {args.max_new_tokens} new tokens")

    generator = torch.Generator(device).manual_seed(args.seed) if args.temperature > 0 else None

    def ours(ids: list[int], with_drafter: bool, max_new: int) -> Any:
        return generate(target, drafter if with_drafter else None, ids, max_new, stops,
                        temperature=args.temperature, generator=generator, decoder=args.decoder)

    def theirs(ids: list[int], max_new: int) -> tuple[list[int], list[int], float]:
        input_ids = torch.tensor([ids], device=device)
        sync(device)
        started = time.perf_counter()
        out = reference_module.dflash_generate(
            reference, target.model, input_ids, max_new, stops, temperature=args.temperature, return_stats=True
        )
        sync(device)
        return out.output_ids[0, len(ids):].tolist(), list(out.acceptance_lengths), time.perf_counter() - started

    first = render_prompt(target.tokenizer, next(iter(benches.values()))[0].messages)
    log("warm-up")
    for with_drafter in (True, False):
        ours(first, with_drafter, min(32, args.max_new_tokens))
    if reference is not None:
        theirs(first, min(32, args.max_new_tokens))

    results: dict[str, Any] = {}
    failures = 0
    for name, prompts in benches.items():
        records = []
        for index, prompt in enumerate(prompts):
            record: dict[str, Any] = {"id": prompt.id, "error": None}
            faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
            try:
                ids = render_prompt(target.tokenizer, prompt.messages)
                record["prompt_tokens"] = len(ids)
                spec = ours(ids, True, args.max_new_tokens)
                record.update(new_tokens=len(spec.tokens), acceptance_lengths=spec.acceptance_lengths,
                              tau=spec.tau, seconds=spec.seconds)
                base = ours(ids, False, args.max_new_tokens)
                record.update(baseline_new_tokens=len(base.tokens), baseline_seconds=base.seconds)
                if args.temperature == 0:
                    record["same_as_baseline"] = base.tokens == spec.tokens
                if reference is not None:
                    ref_tokens, ref_acceptance, ref_seconds = theirs(ids, args.max_new_tokens)
                    record.update(reference_new_tokens=len(ref_tokens), reference_acceptance_lengths=ref_acceptance,
                                  reference_seconds=ref_seconds)
                    if args.temperature == 0:
                        record["same_as_reference"] = ref_tokens == spec.tokens
                        record["same_acceptance_as_reference"] = ref_acceptance == spec.acceptance_lengths
            except Exception as error:  # noqa: BLE001 - one prompt must not end a long GPU run
                failures += 1
                record["error"] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
            finally:
                faulthandler.cancel_dump_traceback_later()
            records.append(record)
            if record["error"]:
                log(f"[{name} {index + 1}/{len(prompts)}] {prompt.id}: FAILED {record['error']}")
            else:
                speed = record["new_tokens"] / record["seconds"] if record["seconds"] else float("nan")
                base_speed = record["baseline_new_tokens"] / record["baseline_seconds"] if record["baseline_seconds"] else float("nan")
                tau = "n/a" if record["tau"] is None else f"{record['tau']:.2f}"
                ref = ""
                if record.get("reference_acceptance_lengths"):
                    ref_tau = statistics.fmean(record["reference_acceptance_lengths"])
                    ref = f" ref tau {ref_tau:.2f} same-tokens {record.get('same_as_reference')}"
                log(f"[{name} {index + 1}/{len(prompts)}] {prompt.id}: {record['prompt_tokens']} prompt tok, "
                    f"{record['new_tokens']} new, tau {tau}, {speed:.1f} tok/s vs {base_speed:.1f} target-only, "
                    f"same-as-baseline {record.get('same_as_baseline')}{ref}")
        results[name] = {"summary": summarize(records, block_size), "prompts": records}
        print_summary(name, results[name]["summary"])

    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": vars(args), "block_size": block_size, "dtype": str(dtype), "stop_token_ids": stops,
                   "device": str(device), "torch": torch.__version__, "benchmarks": results}
        out.write_text(json.dumps(payload, indent=1, default=lambda o: dataclasses.asdict(o)) + "\n")
        log(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
