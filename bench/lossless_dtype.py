"""Is greedy speculative decoding token-identical to target-only decoding on the GPU, per dtype?

Exact arithmetic makes greedy speculative decoding lossless; finite precision does not quite:
the verify forward scores B positions at once while target-only decoding scores one, so the
matmuls reduce in another order and a near-tie between the two best tokens can flip. This
decodes the same prompts with SmolLM2 and an untrained drafter (acceptance ~1, so every
verify step is a full B-token forward) in float32 and in bfloat16, target-only and
speculative, and counts the prompts whose outputs are identical. Sharded like the bar recipe's run (bench/quality_smollm2.py).

    python3 bench/lossless_dtype.py --gguf smol.gguf --prompts 16 --devices cuda:0,cuda:1 --json-dir $OUT
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.export.hf import export_model  # noqa: E402
from dflash_train.target.gguf import hf_folder_from_gguf  # noqa: E402
from dflash_train.target.model import load_target  # noqa: E402

from bench.quality_smollm2 import ShardRunner, merge_group, shard_jobs  # noqa: E402
from dflash_train.core.drafter import DrafterConfig  # noqa: E402
from dflash_train.train.replicas import init_drafter  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--bench", default="humaneval")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--devices", default="cuda:0,cuda:1")
    parser.add_argument("--procs-per-device", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default="/tmp/lossless")
    parser.add_argument("--json-dir", default="")
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--deadline-seconds", type=float, default=240)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.deadline_seconds + 60, exit=True)
    started = time.monotonic()
    out = Path(args.out)
    target_dir = hf_folder_from_gguf(args.gguf, cache_dir=args.cache_dir or None)
    target = load_target(str(target_dir), "cpu", None, load_tokenizer=False)  # only its spec is needed
    config = DrafterConfig.from_target(target.spec, num_layers=1, block_size=16, mask_token_id=16,
                                       target_layer_ids=[1, 8, 14, 20, 27])
    drafter_dir = export_model(init_drafter(config, seed=0), out / "random-drafter")
    del target
    print(f"[lossless] target {target_dir}, untrained drafter {drafter_dir} ({time.monotonic() - started:.0f}s)", flush=True)

    dtypes = args.dtypes.split(",")
    devices = args.devices.split(",")
    slots = [d for d in devices for _ in range(args.procs_per_device)]
    per_dtype = max(1, len(slots) // len(dtypes))
    deadline = started + args.deadline_seconds
    runners = {}
    for i, dtype in enumerate(dtypes):
        common = ["--target", str(target_dir), "--bench", args.bench, "--max-new-tokens", str(args.max_new_tokens),
                  "--dtype", dtype]
        runner = ShardRunner(slots[i * per_dtype:(i + 1) * per_dtype] or slots[:1], common, deadline)
        per_shard = max(1, -(-args.prompts // len(runner.slots)))
        for job in shard_jobs(dtype, str(drafter_dir), args.prompts, per_shard, baseline=True, priority=0,
                              shard_dir=out / "shards"):
            runner.submit(job)
        runners[dtype] = runner
    while not all(r.idle for r in runners.values()):
        for runner in runners.values():
            runner.poll()
        time.sleep(0.5)

    results = {}
    for dtype, runner in runners.items():
        merged = merge_group(runner, dtype)
        if merged is None:
            results[dtype] = {"error": "no shard finished"}
            continue
        (bench_name, bench), = merged["benchmarks"].items()
        records = bench["prompts"]
        results[dtype] = {
            "bench": bench_name, "prompts": len(records),
            "identical": sum(bool(r["same_as_baseline"]) for r in records),
            "different_ids": [r["id"] for r in records if r["same_as_baseline"] is False],
            "tau_mean": bench["summary"]["tau_mean"],
            "tokens_per_s": bench["summary"]["tokens_per_s"],
            "baseline_tokens_per_s": bench["summary"].get("baseline_tokens_per_s"),
            "processes_per_device": args.procs_per_device,
        }
    print("\n" + "=" * 72)
    print(f"greedy speculative vs target-only, {args.bench}, untrained drafter (B = 16), "
          f"<= {args.max_new_tokens} new tokens")
    for dtype, result in results.items():
        if "error" in result:
            print(f"  {dtype:<9} {result['error']}")
        else:
            print(f"  {dtype:<9} identical {result['identical']}/{result['prompts']} prompts "
                  f"(tau {result['tau_mean']:.2f}); different: {', '.join(result['different_ids']) or '-'}")
            print(f"  {'':<9} speculative {result['tokens_per_s']:.1f} tok/s, target-only "
                  f"{result['baseline_tokens_per_s']:.1f} tok/s ({args.procs_per_device} process(es) per device)")
    print("=" * 72)
    if args.json_dir:
        Path(args.json_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.json_dir) / "lossless_dtype.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
