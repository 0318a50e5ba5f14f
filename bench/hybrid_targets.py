#!/usr/bin/env python
"""Hybrid and MoE targets at real shapes (random weights): the training pipeline's samples/s with
its limiting worker, and regeneration tokens/s against Hugging Face `generate` in the same run.

    python bench/hybrid_targets.py --family qwen3_5,qwen3_moe --device cuda:0           # GPU, real shapes
    python bench/hybrid_targets.py --family all --tiny --device cpu --steps 4 --rows 4 --batch 2 \\
        --max-new-tokens 8 --max-seq-len 128                                            # smoke test (CPU)

Shapes (random weights, bfloat16 on CUDA; --layers N keeps the first N decoder layers of one):

    qwen3_5     Qwen3.5-9B-like hybrid: 32 layers, 3 Gated DeltaNet (linear attention) : 1 full
    qwen3_moe   Qwen3-30B-A3B-like MoE: 48 layers, 128 experts, 8 per token
    qwen3_next  Qwen3-Next-80B-A3B-like hybrid MoE (160 GB in bf16: pass --layers 16 on one H200)
    gpt_oss     gpt-oss-20b-like MoE: 24 layers, 32 experts, 4 per token, sinks, 128-token windows, YaRN

Per family it prints the target line the trainer prints at start (what runs and why not), then

    train <family>-shape: <S> samples/s (limit <worker>)
    regenerate <family>-shape batch <B>: <N> tok/s (HF generate <M> tok/s)

samples/s is the steady state (the last two thirds of the steps); regeneration answers --rows
random prompts of 64..--max-prompt tokens with --max-new-tokens each, through regenerate's local
engine (the static generator where its probe passes, else Hugging Face batches, as `regenerate`
picks) and through plain `model.generate` on the same rows in batches of --batch (left-padded).
Tokens/s counts generated tokens up to and including a stop token.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from dflash_train.target.model import Target, default_dtype, default_target_layer_ids  # noqa: E402

from bench.pipeline import variable_length_samples  # noqa: E402
from dflash_train.config import TrainConfig  # noqa: E402
from dflash_train.data.readers import Prompt  # noqa: E402
from dflash_train.decode.families import describe_target  # noqa: E402
from dflash_train.decode.static import cache_capacity  # noqa: E402
from dflash_train.generate.engine import EagerBatchEngine, StaticBatchEngine  # noqa: E402
from dflash_train.generate.regenerate import GenerationSettings, Job  # noqa: E402
from dflash_train.target.probe import static_unsupported  # noqa: E402
from dflash_train.train.trainer import train  # noqa: E402

LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4)
SHAPES = {
    "qwen3_5": ("Qwen3.5-9B", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, vocab_size=248320, max_position_embeddings=262144, **LINEAR)),
    "qwen3_moe": ("Qwen3-30B-A3B", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960)),
    "qwen3_next": ("Qwen3-Next-80B-A3B", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=512, num_experts_per_tok=10, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, vocab_size=151936, max_position_embeddings=262144, **{**LINEAR, "linear_num_key_heads": 16})),
    "gpt_oss": ("gpt-oss-20b", "GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128,
        max_position_embeddings=131072)),
}
TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, sliding_window=16)


def build_target(family: str, device: torch.device, tiny: bool, layers: int) -> tuple[str, Target]:
    import transformers

    name, config_name, model_name, dims = SHAPES[family]
    dims = dict(dims)
    if tiny:
        dims.update({k: v for k, v in TINY.items() if k in dims or k in ("head_dim",)})
        name = f"tiny {name}"
    if layers:
        dims["num_hidden_layers"] = layers
    config = getattr(transformers, config_name)(**dims)
    if getattr(config, "layer_types", None) and len(config.layer_types) != config.num_hidden_layers:
        config.layer_types = list(config.layer_types[: config.num_hidden_layers])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype(device))
    try:
        with torch.device(device):
            model = getattr(transformers, model_name)(config)
    finally:
        torch.set_default_dtype(previous)
    return name, Target(model)


def train_rate(target: Target, args, out: str) -> tuple[float | None, str]:
    spec = target.spec
    layers = spec.num_hidden_layers  # a few-layer target (--tiny, --layers) is too short for the 5-layer rule
    layer_ids = default_target_layer_ids(layers, 5) if layers >= 12 else sorted({0, layers // 2, layers - 1})
    config = TrainConfig(
        out=out, steps=args.steps, batch_size=args.train_batch, max_seq_len=args.max_seq_len, block_size=16,
        num_layers=1 if args.tiny else 5, num_anchors=min(512, args.max_seq_len // 4),
        target_layer_ids=layer_ids, mask_token_id=spec.vocab_size - 1,
        device=str(target.device), save_every=10**9, log_every=10, export_dtype="",
        **({"seq_buckets": [int(b) for b in args.buckets.split(",")]} if args.buckets else {}),
    )
    samples = variable_length_samples(max(32, args.train_batch * 8), spec.vocab_size, args.max_seq_len // 2,
                                      args.max_seq_len)
    summary = train(config, samples=samples, target=target, log=sys.stdout, save_checkpoints=False)
    records = [record for record in map(json.loads, open(Path(out) / "metrics.jsonl")) if record.get("step_s")]
    # Each step record times its own step; elapsed_s is rounded to 10 ms, too coarse for a tiny target's steps.
    steady = records[len(records) // 3:]
    rate = statistics.median(r["samples"] / r["step_s"] for r in steady) if steady else None
    return rate, str(summary.get("bottleneck") or "?")


def prompts_for(target: Target, args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    vocab = target.spec.vocab_size - 2
    low = min(64, args.max_prompt)
    return [torch.randint(0, vocab, (int(torch.randint(low, args.max_prompt + 1, (1,), generator=generator)),),
                          generator=generator).tolist() for _ in range(args.rows)]


def ours_rate(target: Target, prompts: list[list[int]], args, stop: int) -> tuple[float, str]:
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    reason = static_unsupported(target, cache_capacity(max(map(len, prompts)) + args.max_new_tokens))
    if reason is None:
        engine = StaticBatchEngine(target, settings, [stop], slots=args.batch, log=sys.stdout)
        kind = "static batched generator"
    else:
        engine = EagerBatchEngine(target, settings, [stop], batch_size=args.batch, reason=reason, log=sys.stdout)
        kind = engine.description
    jobs = [Job(Prompt(f"row{i}", [], f"bench:{i}"), ids, i) for i, ids in enumerate(prompts)]
    list(engine.generated(jobs[: min(len(jobs), args.batch)]))  # warm-up: captures, first allocations
    sync(target)
    started = time.perf_counter()
    tokens = sum(len(result.tokens) for _, result in engine.generated(jobs) if not isinstance(result, BaseException))
    sync(target)
    return tokens / (time.perf_counter() - started), kind


def hf_rate(target: Target, prompts: list[list[int]], args, stop: int) -> float:
    model, device = target.model, target.device
    ordered = sorted(prompts, key=len)
    batches = [ordered[i:i + args.batch] for i in range(0, len(ordered), args.batch)]

    def run(batch: list[list[int]]) -> int:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), stop, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, eos_token_id=[stop], pad_token_id=stop)[:, width:].tolist()
        return sum(row.index(stop) + 1 if stop in row else len(row) for row in out)

    run(batches[0])  # warm-up
    sync(target)
    started = time.perf_counter()
    tokens = sum(run(batch) for batch in batches)
    sync(target)
    return tokens / (time.perf_counter() - started)


def sync(target: Target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5,qwen3_moe", help=f"comma-separated: {', '.join(SHAPES)}, or all")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="tiny dims of each family (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=0, help="keep only this many decoder layers (0: the real count)")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--train-batch", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--buckets", default="", help="training length buckets, comma-separated (default: the "
                                                        "trainer's; each one compiles the drafter once)")
    parser.add_argument("--batch", type=int, default=64, help="regeneration batch (slots)")
    parser.add_argument("--rows", type=int, default=256, help="regenerated prompts")
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--skip", default="", help="train or regenerate: leave that part out")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    families = list(SHAPES) if args.family == "all" else args.family.split(",")
    device = torch.device(args.device)
    lines, results = [], []
    for family in families:
        started = time.perf_counter()
        name, target = build_target(family, device, args.tiny, args.layers)
        print(f"built {name}-like ({sum(p.numel() for p in target.model.parameters()) / 1e9:.2f} B parameters, "
              f"{time.perf_counter() - started:.0f} s)", flush=True)
        if "train" in args.skip:  # the trainer prints it otherwise
            print(describe_target(target, args.max_seq_len), flush=True)
        result = {"family": family, "shape": name, "layers": target.spec.num_hidden_layers}
        if "train" not in args.skip:
            rate, limit = train_rate(target, args, tempfile.mkdtemp(prefix="dflash-hybrid-bench-"))
            result.update(train_samples_per_s=rate, limit=limit)
            lines.append(f"train {family}-shape: {'n/a' if rate is None else f'{rate:.2f}'} samples/s (limit {limit})")
        if "regenerate" not in args.skip:
            prompts = prompts_for(target, args)
            stop = target.spec.vocab_size - 1
            ours, kind = ours_rate(target, prompts, args, stop)
            theirs = hf_rate(target, prompts, args, stop)
            result.update(regenerate_tok_s=ours, hf_generate_tok_s=theirs, engine=kind)
            lines.append(f"regenerate {family}-shape batch {args.batch}: {ours:,.0f} tok/s (HF generate {theirs:,.0f} tok/s)")
        results.append(result)
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    faulthandler.dump_traceback_later(3000, exit=True)  # a hung GPU run says where it hung
    sys.exit(main())
