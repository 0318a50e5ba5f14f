"""How far the target's feature forward moves when torch.compile'd, against the error bf16 has
anyway: the eager and the compiled bf16 forward (`FeatureForward`, the training's) each compared
with the same weights in float32 arithmetic (`FeatureForward.float32`) and with each other, and
what the training's start-up check (`judge_features`) makes of them: a compiled forward
within `FEATURE_TOLERANCE` of the eager one passes, and so does one that differs more but is no
further from float32 than the eager one (rounded elsewhere, not wrong).

    python3 bench/feature_compile_error.py --device cuda:0 --json feature_compile_error.json
    python3 bench/feature_compile_error.py --device cpu --batch 2 --length 256

Prints the summary line
`feature compile error SmolLM2: compiled <x> (eager <y>) of float32, compiled vs eager <z>`
(each the largest difference as a fraction of the largest feature), then the norm-relative ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.target.model import load_target, resolve_device  # noqa: E402
from dflash_train.target.walk import FeatureForward  # noqa: E402
from dflash_train.train.feature_graphs import FEATURE_TOLERANCE, judge_features, relative_difference  # noqa: E402


def relative(got: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    return dict(zip(("max", "norm"), relative_difference(got, expected)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="", help="a Hugging Face folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=768)
    parser.add_argument("--layers", default="1,8,14,20,27", help="target layer ids, comma-separated")
    parser.add_argument("--name", default="", help="the target's name in the summary line (default: SmolLM2, or the path's stem)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if not args.target:
        from dflash_train.target.gguf import smollm2_target_dir

        args.target, args.name = str(smollm2_target_dir()), args.name or "SmolLM2"
    layers = [int(x) for x in args.layers.split(",")]
    half = load_target(args.target, device=device, dtype=torch.bfloat16, load_tokenizer=False)
    vocab = half.embed_weight.shape[0]
    ids = ((torch.arange(args.batch * args.length) * 7919 + 31) % vocab).view(args.batch, args.length).to(device)
    eager_forward = FeatureForward(half, layers)
    compiled_forward = torch.compile(eager_forward, dynamic=False)
    with torch.no_grad():
        reference = eager_forward.float32(ids)  # the same weights in float32 arithmetic, a layer at a time
        eager = eager_forward(ids)
        started = time.perf_counter()
        compiled_forward(ids)
        compiled = compiled_forward(ids)
        compile_seconds = time.perf_counter() - started
    result = {
        "device": str(device), "torch": torch.__version__, "target": args.target, "layers": layers,
        "batch": args.batch, "length": args.length, "tolerance": FEATURE_TOLERANCE,
        "compile_seconds": round(compile_seconds, 1),
        "eager_vs_float32": relative(eager, reference), "compiled_vs_float32": relative(compiled, reference),
        "compiled_vs_eager": relative(compiled, eager),
        "check": judge_features(compiled, eager, lambda: reference) or "passes",
    }
    name = args.name or Path(args.target).stem
    result["summary"] = (f"feature compile error {name}: compiled {result['compiled_vs_float32']['max']:.2e} "
                         f"(eager {result['eager_vs_float32']['max']:.2e}) of float32, compiled vs eager "
                         f"{result['compiled_vs_eager']['max']:.2e}")
    print(result["summary"])
    print(f"  in norm: compiled {result['compiled_vs_float32']['norm']:.2e} (eager {result['eager_vs_float32']['norm']:.2e}) "
          f"of float32, compiled vs eager {result['compiled_vs_eager']['norm']:.2e}; the start-up check allows "
          f"{FEATURE_TOLERANCE:.0e} (largest difference, compiled vs eager); compile {compile_seconds:.1f} s")
    print(f"  the start-up check on these features: {result['check']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
