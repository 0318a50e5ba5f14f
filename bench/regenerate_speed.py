#!/usr/bin/env python
"""Regeneration speed: the static batched generator of `regenerate` vs Hugging Face `generate`.

    python bench/regenerate_speed.py --target smol.gguf --json out.json              # GPU: real SmolLM2
    python bench/regenerate_speed.py --target smol.gguf --dims qwen3-8b --batches 64,256
    python bench/regenerate_speed.py --target SMOLLM2_DIR --dims tiny --device cpu \\
        --batches 2,4 --rows 8 --max-new-tokens 6 --prompts prompts.txt              # smoke test (seconds)

The same real prompts (rendered with the target's chat template, variable lengths, answers that
stop early) go to every engine, at each batch size of --batches:

    ours        regenerate's engine (generate/engine.py): continuous batching over static
                caches, one CUDA graph per (slots, attention span)
    hf-static   model.generate(cache_implementation="static"), which transformers compiles
                (torch.compile, CUDA graphs) on CUDA; batches of the length-sorted prompts
    hf          plain model.generate (DynamicCache), the same batches

Tokens/s = generated tokens (each row's stop token included, nothing after it) / wall time.
Each engine gets one untimed warm-up first (graph captures, compiles), then runs until its
rows are done or --budget-s passes. Also reported: peak CUDA memory per case, and how many of
the rows both ours and hf-static finished came out token-identical (greedy; bf16 rounding
differs between the two, so near-ties may flip). --dims builds random weights of a real shape
on the device (the target still gives the tokenizer): `qwen3-8b`, `smollm2`, or `tiny` (a small
Llama with SmolLM2's vocabulary, for CPU). Prints, per batch size,

    regenerate SmolLM2 batch <B>: <N> tok/s (HF generate <M> tok/s)

with M the hf-static rate (the issue's baseline; plain generate on the next line), and writes
everything to --json.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from dflash_train.target.model import Target, load_target, model_folder  # noqa: E402

from bench.pipeline import QWEN3_8B, random_target  # noqa: E402
from bench.profiling import write_tables  # noqa: E402
from bench.static_decode_speed import SMOLLM2  # noqa: E402
from dflash_train.data.readers import RowStats, read_prompts  # noqa: E402
from dflash_train.data.render import RenderError, render_prompt, stop_token_ids  # noqa: E402
from dflash_train.generate.engine import StaticBatchEngine  # noqa: E402
from dflash_train.generate.regenerate import GenerationSettings, Job, row_seed  # noqa: E402

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)
DIMS = {"smollm2": ("llama", SMOLLM2), "qwen3-8b": ("qwen3", QWEN3_8B), "tiny": ("llama", TINY)}
LABELS = {"smollm2": "SmolLM2-shape", "qwen3-8b": "Qwen3-8B-shape", "tiny": "tiny"}
ENGINES = ("ours", "hf-static", "hf")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load(args) -> tuple[Target, str]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else None
    if not args.dims:
        target = load_target(args.target, device, dtype)
        return target, args.label or ("SmolLM2" if "smol" in Path(args.target).name.lower() else Path(args.target).stem)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.target))
    family, dims = DIMS[args.dims]
    torch.manual_seed(0)
    target = random_target(dims, device, dtype, family)
    if target.model.generation_config.eos_token_id is None:
        target.model.generation_config.eos_token_id = tokenizer.eos_token_id
    return Target(target.model, tokenizer, f"random {args.dims}"), LABELS[args.dims]


def bench_jobs(args, tokenizer, needed: int) -> tuple[list[Job], dict]:
    """The first `needed` prompts of at most --max-prompt-tokens tokens, rendered, in input order
    (rendering all of the default set's 119k prompts took 85 s of a device call)."""
    stats = RowStats()
    if args.prompts == "default":  # what `regenerate --prompts default` answers
        from dflash_train.data.prompts.sets import PromptSetSettings

        from dflash_train.commands._common import default_prompt_set

        prompts = default_prompt_set(PromptSetSettings(seed=args.seed)).split("train")
    else:
        prompts = list(read_prompts(args.prompts, stats))
    jobs, seen, too_long = [], set(), 0
    for prompt in prompts:
        if prompt.id in seen:
            continue
        seen.add(prompt.id)
        try:
            ids = render_prompt(tokenizer, prompt.messages)
        except RenderError:
            continue
        if len(ids) > args.max_prompt_tokens:
            too_long += 1
            continue
        jobs.append(Job(prompt, ids, row_seed(args.seed, prompt.id)))
        if len(jobs) == needed:
            break
    lengths = sorted(len(job.ids) for job in jobs) or [0]
    info = {"prompts": len(jobs), "longer_than_cap": too_long,
            "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]}}
    return jobs, info


def spread(jobs: list[Job], count: int) -> list[Job]:
    """`count` jobs spanning the length range (the longest included): a warm-up that needs
    the same caches as the timed run."""
    ordered = sorted(jobs, key=lambda job: len(job.ids))
    if count >= len(ordered):
        return ordered
    step = (len(ordered) - 1) / max(1, count - 1)
    return [ordered[round(i * step)] for i in range(count)]


def _peak_reset(device: torch.device) -> None:
    gc.collect()  # the last case's engine, ours or Hugging Face's, must not hold memory the next one needs
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def replay_ms(engine: StaticBatchEngine, device: torch.device, repeats: int = 20) -> dict[str, float]:
    """GPU milliseconds per replay of each all-slots decode step (rows finished: the same
    kernels, no state change), timed with CUDA events."""
    state = engine.state
    if state is None or device.type != "cuda":
        return {}
    out = {}
    for (rows, span), step in sorted(state.steps.items()):
        if rows != state.slots or step.graph is None:
            continue
        step()
        out[f"{rows}x{span}"] = round(step.milliseconds_per_call(repeats), 3)
    return out


def profile_ours(engine: StaticBatchEngine, jobs: list[Job], seconds: float, path: Path) -> None:
    """torch.profiler over `seconds` of the warmed engine: the kernel table (by GPU time) and
    the host table (by self CPU time) to `path`."""
    from torch.profiler import ProfilerActivity, profile

    results = engine.generated(jobs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in results:
            if time.perf_counter() - started > seconds:
                break
        torch.cuda.synchronize()
    results.close()
    write_tables(prof, path)
    log(f"  profile written to {path}")


def run_ours(target: Target, jobs: list[Job], batch: int, settings: GenerationSettings, stop_ids: list[int], args,
             attention: str = "sdpa") -> dict:
    engine = StaticBatchEngine(target, settings, stop_ids, slots=batch, read_every=args.read_every, log=sys.stdout,
                               attention=attention, admit_fraction=args.admit_fraction)
    started = time.perf_counter()
    for _ in engine.generated(spread(jobs, batch)):
        pass
    warmup = time.perf_counter() - started
    log(f"  ours: warm-up {warmup:.1f}s ({engine.description})")
    tokens, rows, finish, answers = 0, 0, {"stop": 0, "length": 0}, {}
    engine.stats = type(engine.stats)()  # the timed run's own counters
    started = time.perf_counter()
    last_print = started
    in_flight_at_cut = 0
    results = engine.generated(jobs)
    for job, result in results:
        if isinstance(result, BaseException):
            raise result
        tokens += len(result.tokens)
        rows += 1
        finish[result.finish_reason] += 1
        answers[job.prompt.id] = result.tokens
        now = time.perf_counter()
        if now - last_print > 10:
            log(f"  ours: {rows} rows, {tokens / (now - started):,.0f} tok/s")
            last_print = now
        if now - started > args.budget_s:
            # HF's batches always finish; rows of ours still decoding here are not counted.
            in_flight_at_cut = max(0, engine.stats.admitted - rows)
            results.close()
            break
    seconds = time.perf_counter() - started
    if in_flight_at_cut:
        log(f"  ours: cut by --budget-s with {in_flight_at_cut} rows in flight, their tokens not counted "
            f"(HF's batches are never cut): the rate is understated; a larger --budget-s compares whole rows")
    out = {"rows": rows, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "finish": finish,
           "warmup_s": warmup, "slots": engine.slots, "rows_in_flight_at_cut": in_flight_at_cut,
           "out_of_memory_halvings": engine.out_of_memory,
           "attention": attention, "admit_fraction": args.admit_fraction, "host": engine.stats.as_dict(),
           "attention_used": engine.state.attention if engine.state else None,
           "attention_ms": engine.state.attention_ms if engine.state else {},
           "step_shapes": sorted(engine.state.steps) if engine.state else [],  # (rows, attention span)
           "graphs": sum(step.graph is not None for step in engine.state.steps.values()) if engine.state else 0,
           "prefill_shapes": sorted(engine.state.prefills) if engine.state else [],  # (rows, width) buckets
           "prefill_graphs": sum(p.step.graph is not None for p in engine.state.prefills.values()) if engine.state else 0}
    out["replay_ms"] = replay_ms(engine, target.device)
    log(f"  ours[{attention}]: {engine.run_note()}; replay ms/step {out['replay_ms']}")
    if args.profile_s and target.device.type == "cuda":
        profile_ours(engine, jobs, args.profile_s, Path(args.json or "regenerate_speed.json").with_suffix(f".{batch}.{attention}.prof.txt"))
    del engine
    return out, answers


def _hf_batches(jobs: list[Job], batch: int) -> list[list[Job]]:
    """Full batches of the length-sorted jobs (less padding; one shape per batch size)."""
    ordered = sorted(jobs, key=lambda job: len(job.ids))
    batches = [ordered[i:i + batch] for i in range(0, len(ordered) - batch + 1, batch)]
    return batches or [ordered]


def _hf_generate(target: Target, batch: list[Job], settings: GenerationSettings, stop_ids: list[int], pad_id: int,
                 static: bool) -> list[list[int]]:
    device = target.device
    width = max(len(job.ids) for job in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, job in enumerate(batch):  # left padding, as generate expects
        ids[i, width - len(job.ids):] = torch.tensor(job.ids)
        mask[i, width - len(job.ids):] = 1
    extra = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        out = target.model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=settings.max_new_tokens,
                                    do_sample=False, eos_token_id=stop_ids, pad_token_id=pad_id, **extra)
    rows = []
    stops = set(stop_ids)
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        rows.append(row[:end])
    return rows


def run_hf(target: Target, jobs: list[Job], batch: int, settings: GenerationSettings, stop_ids: list[int], static: bool,
           args) -> tuple[dict, dict]:
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    batches = _hf_batches(jobs, batch)
    name = "hf-static" if static else "hf"
    started = time.perf_counter()
    _hf_generate(target, batches[-1], settings, stop_ids, pad_id, static)  # the longest prompts: the largest cache
    warmup = time.perf_counter() - started
    log(f"  {name}: warm-up {warmup:.1f}s")
    tokens, rows, per_batch, answers = 0, 0, [], {}
    started = time.perf_counter()
    for batch_jobs in batches:
        t = time.perf_counter()
        outs = _hf_generate(target, batch_jobs, settings, stop_ids, pad_id, static)
        per_batch.append(round(time.perf_counter() - t, 3))
        for job, out in zip(batch_jobs, outs):
            answers[job.prompt.id] = out
            tokens += len(out)
        rows += len(batch_jobs)
        log(f"  {name}: {rows} rows, {tokens / (time.perf_counter() - started):,.0f} tok/s")
        if time.perf_counter() - started > args.budget_s:
            break
    seconds = time.perf_counter() - started
    return {"rows": rows, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "warmup_s": warmup,
            "batch_seconds": per_batch}, answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a Hugging Face folder or .gguf (weights, or with --dims only the tokenizer)")
    parser.add_argument("--dims", choices=sorted(DIMS), default="", help="random weights of this shape instead of the target's")
    parser.add_argument("--prompts", default="default", help="prompt file, or 'default' (the train split of `regenerate --prompts default`'s set)")
    parser.add_argument("--batches", default="64,256,1024")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"some of {', '.join(ENGINES)}")
    parser.add_argument("--rows", type=int, default=0, help="rows per case (0 = 3 x batch)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out (counted)")
    parser.add_argument("--budget-s", type=float, default=30.0, help="timed seconds per case (after its warm-up)")
    parser.add_argument("--read-every", type=int, default=4, help="ours: decode steps between reads of the finished flags")
    parser.add_argument("--attention", default="auto", help="ours: comma-separated cache attentions to time (auto, sdpa, matmul, rows)")
    parser.add_argument("--admit-fraction", type=int, default=16, help="ours: refill once 1/N of the slots are free")
    parser.add_argument("--profile-s", type=float, default=0.0, help="ours: also profile this many seconds (CUDA), table next to --json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="the target's name in the summary (default: SmolLM2 for a smol* file)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    # A hang prints every thread's stack instead of silently eating the caller's time limit.
    faulthandler.dump_traceback_later(float(os.environ.get("BENCH_WATCHDOG_S", 1200)), exit=True, file=sys.__stderr__)
    try:
        return run(args, parser)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run(args, parser) -> int:
    device = torch.device(args.device)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    target, label = load(args)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    stop_ids = stop_token_ids(target.model, target.tokenizer)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    jobs, prompt_info = bench_jobs(args, target.tokenizer, args.rows or 3 * max(batches, default=1))
    log(f"torch {torch.__version__} | {device} | {target.embed_weight.dtype} | {label} ({target.spec.num_hidden_layers} layers) | "
        f"the first {prompt_info['prompts']} prompts, of {prompt_info['prompt_tokens']} tokens ({prompt_info['longer_than_cap']} over "
        f"{args.max_prompt_tokens} left out) | <= {args.max_new_tokens} new tokens, stop ids {stop_ids}")
    results = {"label": label, "dims": args.dims or None, "torch": torch.__version__, "dtype": str(target.embed_weight.dtype),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "max_new_tokens": args.max_new_tokens, "prompts": prompt_info, "cases": {}}
    summary = []
    for batch in batches:
        rows = jobs[: args.rows or 3 * batch]
        case = results["cases"].setdefault(str(batch), {})
        answers = {}
        attentions = [a.strip() for a in args.attention.split(",") if a.strip()]
        cases = [(e, a) for e in engines for a in (attentions if e == "ours" else [""])]
        for engine, attention in cases:
            name = engine if not attention or attention == attentions[0] else f"{engine}-{attention}"
            log(f"batch {batch}: {name}, {len(rows)} rows")
            _peak_reset(device)
            try:
                if engine == "ours":
                    row, answers[name] = run_ours(target, rows, batch, settings, stop_ids, args, attention)
                else:
                    row, answers[name] = run_hf(target, rows, batch, settings, stop_ids, engine == "hf-static", args)
                row["peak_memory_gib"] = _peak(device)
                log(f"  {name}: {row['tokens_per_s']:,.0f} tok/s ({row['rows']} rows, {row['tokens']} tokens in "
                    f"{row['seconds']:.1f}s, peak {row['peak_memory_gib'] or 0:.1f} GiB)")
            except Exception as error:  # noqa: BLE001 - one failed case must not lose the others
                row = {"error": f"{type(error).__name__}: {error}"}
                log(f"  {name}: FAILED {row['error'][:300]}")
            case[name] = row
        if "ours" in answers and "hf-static" in answers:
            both = set(answers["ours"]) & set(answers["hf-static"])
            same = sum(answers["ours"][k] == answers["hf-static"][k] for k in both)
            case["identical_to_hf_static"] = {"rows": len(both), "identical": same}
        rate = {e: case.get(e, {}).get("tokens_per_s") for e in ENGINES}
        fmt = lambda v: f"{v:,.0f}" if v else "n/a"  # noqa: E731
        line = f"regenerate {label} batch {batch}: {fmt(rate['ours'])} tok/s (HF generate {fmt(rate['hf-static'])} tok/s)"
        variants = "".join(f", {name} {fmt(row.get('tokens_per_s'))}" for name, row in case.items()
                           if name.startswith("ours-") and isinstance(row, dict))
        summary.append(line + f"   [plain HF generate {fmt(rate['hf'])} tok/s{variants}]")
        print(line, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")  # after every batch: a cut run keeps its cases
    log("summary:\n" + "\n".join(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
