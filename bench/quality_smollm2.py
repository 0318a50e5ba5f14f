"""The QUALITY.md run: train a drafter for SmolLM2-135M-Instruct on the regenerated data, then
measure tau by speculative decoding on HumanEval and MT-Bench.

Recipe of the bar (QUALITY.md): 5 layers, block 16, target layers [1, 8, 14, 20, 27], mask
token 16, batch 8, max length 768, 256 anchors, gamma 7, AdamW lr 6e-4, 4% warm-up, cosine,
clip 1.0, rows with >= 32 supervised tokens. A wall-clock guard stops training gracefully
(checkpoint, then export) if the step budget would overrun the machine's time.

    python3 bench/quality_smollm2.py --gguf smol.gguf --data smollm2-regenerated-4000.jsonl.gz \
        --out /tmp/q --steps 1500 --train-seconds 300 --eval-limit 20 --json-dir $OUT
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.cli import main as cli_main  # noqa: E402
from dflash_train.config import TrainConfig  # noqa: E402
from dflash_train.gguf import hf_folder_from_gguf  # noqa: E402
from dflash_train.pipeline.trainer import train  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--train-seconds", type=float, default=300.0, help="stop training (gracefully) after this")
    parser.add_argument("--eval-limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--bench", default="humaneval,mtbench")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--buckets", default="768")
    parser.add_argument("--json-dir", default="")
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--smoke", action="store_true", help="tiny settings, to check the script on a CPU")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(590, exit=True)
    started = time.monotonic()
    json_dir = Path(args.json_dir or args.out)
    json_dir.mkdir(parents=True, exist_ok=True)

    target_dir = hf_folder_from_gguf(args.gguf, cache_dir=args.cache_dir or None)
    print(f"[quality] target folder {target_dir} ({time.monotonic() - started:.0f}s)", flush=True)

    config = TrainConfig(
        target=str(target_dir), data=[args.data], out=args.out, steps=args.steps, batch_size=8, max_seq_len=768,
        seq_buckets=[int(b) for b in args.buckets.split(",")], min_supervised_tokens=32, block_size=16,
        num_layers=5, num_anchors=256, mask_token_id=16, gamma=7.0, lr=6e-4, warmup_ratio=0.04, clip_grad=1.0,
        device=args.device, save_every=500, log_every=100,
    )
    if args.smoke:
        config.batch_size, config.num_anchors, config.num_layers = 2, 8, 1
        config.max_seq_len, config.seq_buckets, config.min_supervised_tokens = 256, [256], 8
    train_started = time.monotonic()

    def time_guard(worker, step):
        if time.monotonic() - train_started > args.train_seconds:
            worker.stop_signal.stop(f"time budget of {args.train_seconds:.0f}s reached at step {step + 1}")

    summary = train(config, step_hook=time_guard)
    train_seconds = time.monotonic() - train_started
    entry = summary["drafters"]["drafter"]
    export = entry.get("export")
    if not export:
        export = str(Path(args.out) / "export")
        cli_main(["export", args.out, "--out", export])
    print(f"[quality] trained {summary['steps_done']} steps in {train_seconds:.0f}s; export {export}", flush=True)

    results = {"train_summary": summary, "train_seconds": round(train_seconds, 1)}
    (json_dir / "train_summary.json").write_text(json.dumps(results, indent=2))
    eval_json = json_dir / "eval.json"
    cli_main([
        "eval", "--target", str(target_dir), "--drafter", export, "--bench", args.bench,
        "--limit", str(args.eval_limit), "--max-new-tokens", str(args.max_new_tokens), "--device", args.device,
        "--no-baseline", "--json", str(eval_json),
    ])
    print(f"[quality] done in {time.monotonic() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
