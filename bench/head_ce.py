"""The frozen-head cross-entropy alone (forward and backward, bf16): eager chunks, compiled chunks
and core/head_kernel.py's fused kernel, at the bar recipe's shapes (SmolLM2 head 49,152 × 576).

    python3 bench/head_ce.py --json head_ce.json
    python3 bench/head_ce.py --device cpu --rows 300 --vocab 4000 --kernels eager   # smoke test

Prints one line per kernel and the summary line
`head CE <rows> rows × <vocab>: fused <ms> ms, compiled <ms> ms, eager <ms> ms`
(mean of --iters calls after --warmup, CUDA events; the recipe's steps score ~23,000 rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profiling import mean_ms  # noqa: E402
from dflash_train.core.objective import frozen_head_cross_entropy, fused_head_unsupported  # noqa: E402

KERNELS = ("fused", "compiled", "eager")


def time_kernel(kernel: str, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                warmup: int, iters: int) -> float:
    """Mean milliseconds of one forward and backward."""
    x = hidden.clone().requires_grad_(True)

    def once() -> None:
        ce, _ = frozen_head_cross_entropy(x, head, labels, compiled=kernel == "compiled", fused=kernel == "fused")
        (ce * weights).sum().backward()
        x.grad = None

    return mean_ms(once, hidden.device, warmup, iters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=23000)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        parser.error(f"--kernels: unknown {', '.join(unknown)} (choose from {', '.join(KERNELS)})")
    device = torch.device(args.device)
    refused = fused_head_unsupported(device) if "fused" in kernels else None
    if refused:
        parser.error(f"--kernels fused: {refused}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=generator).to(device, dtype)
    head = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.05).to(device, dtype)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=generator).to(device)
    weights = torch.rand(args.rows, generator=generator).to(device)
    results = {}
    for kernel in kernels:
        results[kernel] = time_kernel(kernel, hidden, head, labels, weights, args.warmup, args.iters)
        print(f"{kernel}: {results[kernel]:.2f} ms", flush=True)
    line = f"head CE {args.rows} rows × {args.vocab}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in results.items())
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden,
                                               "device": str(device), "ms": results, "summary": line}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
