#!/usr/bin/env python
"""Decode-step latency: the static decoder (preallocated caches, CUDA graphs) vs Hugging Face eager.

    python bench/static_decode_speed.py --dims smollm2 --json out.json      # GPU, bf16
    python bench/static_decode_speed.py --dims smollm2 --arch dflash2 --decoders static   # a DFlash2 drafter

Random-init target and drafter of real shapes (no download): `smollm2` = SmolLM2-135M (30 layers,
hidden 576, 9/3 heads, vocab 49,152) with the bar recipe's drafter (5 layers, B = 16, target
layers 1, 8, 14, 20, 27); `qwen3-8b` = Qwen3-8B's shape (the target of `bench/pipeline.py`)
with a 5-layer drafter. For each decoder it times, at a context of --context tokens:

    target-only step   one token through the target                 (the baseline's cost per token)
    draft step         one drafter block (B new context rows)
    verify step        B tokens through the target, with the drafter's layers
    greedy step        draft + verify + acceptance as the decode loop runs it (static: one graph)
    end to end         generate() target-only and speculative, --new-tokens tokens

and prints the break-even acceptance length: τ* = greedy step / target-only step, the τ a
drafter needs for speculative decoding to beat target-only decoding with that decoder. The
random drafter accepts nothing (τ = 1), so the end-to-end speculative rate is its floor.

    --lengths 57,101,...   prompts of those lengths one after another, as an eval runs them:
                           prefill and decode ms per request (and, static, the eager prefill
                           at a length not seen before: what every request paid before the
                           prefills were captured)
    --profile PREFIX       one decode of each kind under torch.profiler: the GPU's idle time
                           per step (waiting for the host) and the kernel and host tables
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from dflash_train.target.model import Target  # noqa: E402

from bench.flex_tuning import time_ms  # noqa: E402
from bench.pipeline import QWEN3_8B, TINY, random_target  # noqa: E402
from bench.profiling import gpu_busy, write_tables  # noqa: E402
from dflash_train.config import ModelSettings  # noqa: E402
from dflash_train.core.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_train.decode.loop import generate, make_decoder  # noqa: E402

COMPILE_DRAFT = False  # --compile-draft: every decoder this bench makes compiles its drafter's block forward

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)
DIMS = {"smollm2": ("llama", SMOLLM2), "qwen3-8b": ("qwen3", QWEN3_8B), "tiny": ("qwen3", TINY)}
LAYER_IDS = {"smollm2": [1, 8, 14, 20, 27], "qwen3-8b": [1, 9, 17, 25, 33], "tiny": [1, 3, 4]}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def dflash2_defaults() -> dict:
    """`train --arch dflash2`'s default sizes (the released drafters' convolutions)."""
    return {field.name: field.default for field in dataclasses.fields(ModelSettings)
            if field.name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}


def build(dims: str, device: torch.device, dtype: torch.dtype, block_size: int,
          arch: str = "dflash") -> tuple[Target, DFlashDrafter]:
    family, values = DIMS[dims]
    target = random_target(values, device, dtype, family)
    sizes = dict(arch="dflash2", **dflash2_defaults()) if arch == "dflash2" else {}
    config = DrafterConfig.from_target(target.spec, num_layers=5 if dims != "tiny" else 1, block_size=block_size,
                                       mask_token_id=16, target_layer_ids=LAYER_IDS[dims], **sizes)
    drafter = DFlashDrafter(config).to(device).eval()
    for param in drafter.parameters():
        param.data = param.data.to(dtype)
    return target, drafter


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` calls after 3 warm-up calls, each call
    synchronised (decoding is a chain of dependent steps: latency is what counts)."""
    for _ in range(3):
        fn()
    return time_ms(fn, repeats, device)


@torch.no_grad()
def step_latencies(target, drafter, kind: str, context: int, repeats: int) -> dict[str, float]:
    device = target.device
    block = drafter.config.block_size
    prompt = torch.randint(0, target.spec.vocab_size, (1, context), device=device)
    bonus = torch.tensor([5], device=device)
    results = {}
    # Target-only: a decoder without drafter; each timed call re-verifies the same position.
    runner = make_decoder(target, None, context + 64, kind)
    runner.prefill(prompt)

    def one_token():
        runner.verify(bonus[None], context, features=False)
        runner.keep(context)

    results["target_only_step_ms"] = timed(one_token, device, repeats)

    runner = make_decoder(target, drafter, context + 64, kind, compile_draft=COMPILE_DRAFT)
    _, features = runner.prefill(prompt)  # static: the prompt's context goes into the drafter's cache here
    runner.draft(features, context, bonus, block)  # hf: here
    new_rows = runner.state.new_features if kind == "static" else features[:, -block:]  # B new context rows
    ids = torch.randint(0, target.spec.vocab_size, (1, block), device=device)

    def draft():
        if kind == "hf":  # its context cache only grows: keep it at `context` positions
            runner.drafter_cache.crop(context - block)
        runner.draft(new_rows, context, bonus, block)

    def verify():
        runner.verify(ids, context, features=True)
        runner.keep(context)

    # A whole greedy step as the decode loop runs it (static: one captured graph), one new row of context.
    one_row = runner.state.new_features[:, :1] if kind == "static" else features[:, -1:]

    def greedy():
        if kind == "hf":
            runner.drafter_cache.crop(context - 1)
        runner.greedy(one_row, context, bonus, block)
        runner.keep(context)

    results["draft_step_ms"] = timed(draft, device, repeats)
    results["verify_step_ms"] = timed(verify, device, repeats)
    results["greedy_step_ms"] = timed(greedy, device, repeats)
    results["break_even_tau"] = results["greedy_step_ms"] / results["target_only_step_ms"]
    return results


@torch.no_grad()
def end_to_end(target, drafter, kind: str, context: int, new_tokens: int) -> dict[str, float]:
    prompt = torch.randint(0, target.spec.vocab_size, (context,)).tolist()
    out = {}
    for name, model in (("target_only", None), ("speculative_tau1", drafter)):
        generate(target, model, prompt, new_tokens, decoder=kind, compile_draft=COMPILE_DRAFT)  # warm-up: the same cache size, so captures happen here
        result = generate(target, model, prompt, new_tokens, decoder=kind, compile_draft=COMPILE_DRAFT)
        out[f"{name}_tokens_per_s"] = len(result.tokens) / result.decode_seconds if result.decode_seconds else None
        out[f"{name}_decoder"] = result.decoder
    return out


def decode_steps(result) -> int:
    """Decode steps of a Generation: its verify steps, or one per token after the prefill's."""
    return len(result.acceptance_lengths) or len(result.tokens) - 1


@torch.no_grad()
def varied_prompts(target, drafter, kind: str, lengths: list[int], new_tokens: int) -> dict[str, float]:
    """Prompts of other lengths one after another, as an eval runs them: median prefill and
    decode milliseconds per prompt (every length new to the process), target-only and
    speculative, after `prepare()` captured every shape of the run's cache size. For the static
    decoder also the eager prefill of the same prompts (what it ran before its prefills were
    captured per padded width), each at a length it has not seen before."""
    device = target.device
    cache_tokens = max(lengths) + new_tokens
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.spec.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    out: dict[str, float] = {}
    for name, model in (("target_only", None), ("speculative", drafter)):
        if kind == "static":
            make_decoder(target, model, 0, kind, cache_tokens, COMPILE_DRAFT).prepare()
        runs = [generate(target, model, p, new_tokens, decoder=kind, cache_tokens=cache_tokens, compile_draft=COMPILE_DRAFT) for p in prompts]
        out[f"{name}_prefill_ms"] = 1000 * statistics.median(r.prefill_seconds for r in runs)
        out[f"{name}_decode_ms_per_step"] = 1000 * statistics.median(
            r.decode_seconds / max(decode_steps(r), 1) for r in runs)
    if kind == "static":
        state = make_decoder(target, drafter, 0, kind, cache_tokens, COMPILE_DRAFT).state
        eager = []
        for n in [length + 1 for length in lengths]:  # lengths this process has not run eagerly yet
            ids = torch.randint(0, target.spec.vocab_size, (1, n), device=device)
            started = time.perf_counter()
            state.target.single(ids, state.start.new_zeros(()), last_only=True, features=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            eager.append(time.perf_counter() - started)
        out["eager_prefill_new_length_ms"] = 1000 * statistics.median(eager)
    return out


@torch.no_grad()
def profile_decoding(target, drafter, kind: str, context: int, new_tokens: int, prefix: str) -> dict[str, float]:
    """One target-only and one speculative generate() under torch.profiler (after an unprofiled
    warm-up of the same shapes): how much of each decode the GPU sat idle, waiting for the host,
    and the kernel and host tables (to PREFIX.<kind>.<name>.txt)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    prompt = torch.randint(0, target.spec.vocab_size, (context,)).tolist()
    found: dict[str, float] = {}
    for name, model in (("target_only", None), ("speculative", drafter)):
        generate(target, model, prompt, new_tokens, decoder=kind, compile_draft=COMPILE_DRAFT)
        with profile(activities=activities) as prof:
            result = generate(target, model, prompt, new_tokens, decoder=kind, compile_draft=COMPILE_DRAFT)
        busy, span = gpu_busy(prof)
        steps = decode_steps(result)
        found[f"{name}_steps"] = steps
        found[f"{name}_decode_ms_per_step"] = 1000 * result.decode_seconds / max(steps, 1)
        found[f"{name}_gpu_busy_fraction"] = busy / span if span else float("nan")
        found[f"{name}_gpu_idle_ms_per_step"] = 1000 * (span - busy) / max(steps, 1)
        write_tables(prof, Path(f"{prefix}.{kind}.{name}.txt"),
                     f"{kind} decoder, {name}: {steps} steps, {found[f'{name}_decode_ms_per_step']:.2f} ms per step, "
                     f"GPU busy {found[f'{name}_gpu_busy_fraction']:.2f} of its span\n\n")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", choices=sorted(DIMS), default="smollm2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--arch", default="dflash", choices=("dflash", "dflash2"),
                        help="the drafter's architecture (dflash2: train's default sizes)")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens before the timed steps")
    parser.add_argument("--new-tokens", type=int, default=256, help="end-to-end: tokens per generate()")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--decoders", default="static,hf")
    parser.add_argument("--lengths", default="", help="comma-separated prompt lengths: time prefill and decode over "
                        "prompts of these lengths, one after another (e.g. 57,101,150,211,263,300,347,390,433,480)")
    parser.add_argument("--length-new-tokens", type=int, default=48, help="new tokens per prompt of --lengths")
    parser.add_argument("--profile", default="", help="also profile one decode of each kind (torch.profiler): "
                        "GPU idle time per step, and kernel and host tables in PROFILE.<decoder>.<kind>.txt")
    parser.add_argument("--compile-draft", action="store_true",
                        help="the static decoder's drafter block forward compiled before its graphs are captured "
                             "(`eval --compile-draft`, on by default on CUDA)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    global COMPILE_DRAFT
    COMPILE_DRAFT = args.compile_draft
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    target, drafter = build(args.dims, device, dtype, args.block_size, args.arch)
    log(f"torch {torch.__version__} | {device} | {args.dtype} | {args.dims}: {target.spec.num_hidden_layers} target "
        f"layers, {args.arch} drafter {drafter.config.num_hidden_layers} layers{' (compiled)' if args.compile_draft else ''}, "
        f"B = {args.block_size}, context {args.context}")
    results = {"dims": args.dims, "arch": args.arch, "compile_draft": args.compile_draft, "dtype": args.dtype, "context": args.context, "torch": torch.__version__,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for kind in [k.strip() for k in args.decoders.split(",") if k.strip()]:
        started = time.perf_counter()
        row = step_latencies(target, drafter, kind, args.context, args.repeats)
        row.update(end_to_end(target, drafter, kind, args.context, args.new_tokens))
        if args.lengths:
            row["varied_prompts"] = varied_prompts(target, drafter, kind, [int(n) for n in args.lengths.split(",")],
                                                   args.length_new_tokens)
            log(f"{kind:>6}: prompts of {len(args.lengths.split(','))} lengths: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["varied_prompts"].items()))
        if args.profile:
            row["profile"] = profile_decoding(target, drafter, kind, args.context, args.length_new_tokens, args.profile)
            log(f"{kind:>6}: profiled: " + ", ".join(f"{k} {v:.2f}" for k, v in row["profile"].items()))
        row["seconds"] = time.perf_counter() - started
        results[kind] = row
        log(f"{kind:>6}: target-only step {row['target_only_step_ms']:.2f} ms | draft {row['draft_step_ms']:.2f} ms | "
            f"verify {row['verify_step_ms']:.2f} ms | greedy step {row['greedy_step_ms']:.2f} ms | break-even tau {row['break_even_tau']:.2f} | end to end "
            f"{row['target_only_tokens_per_s']:.1f} tok/s target-only, {row['speculative_tau1_tokens_per_s']:.1f} tok/s "
            f"speculative at tau 1 ({row['seconds']:.0f}s)")
    if "static" in results and "hf" in results:
        s, h = results["static"], results["hf"]
        log(f"static vs hf: target-only step {h['target_only_step_ms'] / s['target_only_step_ms']:.1f}x faster, "
            f"verify {h['verify_step_ms'] / s['verify_step_ms']:.1f}x, draft {h['draft_step_ms'] / s['draft_step_ms']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
