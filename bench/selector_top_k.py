"""The DFlash2 selector's candidates in training: the top-k of each scored row's head logits,
torch.topk over the whole row against `row_top_k`'s slice maxima (core/objective.py), at the
smollm2-quality recipe's shapes (~23,000 scored rows a step, SmolLM2's 49,152 logits, k = 8).

    python3 bench/selector_top_k.py --json top_k.json
    python3 bench/selector_top_k.py --device cpu --rows 500 --vocab 4000   # smoke test

Checks that both give the same values, then prints one line per segment width and the summary
line `selector top-k <rows> rows × <vocab>: slice maxima <ms> ms, torch.topk <ms> ms`
(bf16 logits on CUDA, float32 on the CPU; mean of --iters calls after --warmup). On CUDA it also
times what training runs there: the fused CE kernel (core/head_kernel.py) with and without the
slice maxima it writes for the candidates, and the top-k from those maxima.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profiling import mean_ms  # noqa: E402
from dflash_train.core.head_kernel import fused_softmax_cross_entropy  # noqa: E402
from dflash_train.core.objective import TOP_K_SEGMENT, candidate_segment, row_top_k  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=23000)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--segments", default=f"64,128,{TOP_K_SEGMENT},512", help="slice widths to time")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    segments = [int(s) for s in args.segments.split(",") if s]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    # Logits as a head gives them: rounded to the dtype, so ties are common.
    logits = (torch.randn(args.rows, args.vocab, generator=generator) * 4).to(device, dtype)
    want = torch.topk(logits, args.k, dim=-1).values
    result = {"rows": args.rows, "vocab": args.vocab, "k": args.k, "dtype": str(dtype).removeprefix("torch."),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "segments": {}}
    result["torch_topk_ms"] = mean_ms(lambda: torch.topk(logits, args.k, dim=-1), device, args.warmup, args.iters)
    print(f"torch.topk: {result['torch_topk_ms']:.2f} ms", flush=True)
    for segment in segments:
        values, ids = row_top_k(logits, args.k, segment)
        if not (torch.equal(values, want) and torch.equal(logits.gather(1, ids), values)):
            print(f"segment {segment}: the values differ from torch.topk's", file=sys.stderr)
            return 1
        result["segments"][segment] = mean_ms(lambda: row_top_k(logits, args.k, segment), device, args.warmup, args.iters)
        print(f"slice maxima, segment {segment}: {result['segments'][segment]:.2f} ms (same values)", flush=True)
    # The first pass alone (each slice's maximum), three ways: it reads every logit once.
    result["slice_max_ms"] = {}
    for segment in segments:
        whole = logits[:, :args.vocab // segment * segment].view(args.rows, -1, segment)
        flat = logits[:, :args.vocab // segment * segment][:, None]
        ways = {"amax": lambda: whole.amax(dim=-1), "max_pool1d": lambda: torch.nn.functional.max_pool1d(flat, segment)}
        if device.type == "cuda":
            ways["compiled amax"] = torch.compile(lambda: whole.amax(dim=-1))
        times = {name: mean_ms(way, device, args.warmup, args.iters) for name, way in ways.items()}
        result["slice_max_ms"][segment] = times
        print(f"slice maxima alone, segment {segment}: " + ", ".join(f"{n} {t:.2f} ms" for n, t in times.items()), flush=True)
    if device.type == "cuda":
        result["fused_kernel_ms"] = time_kernel_maxima(logits, args.k, want, device, args.warmup, args.iters)
    best = result["segments"].get(TOP_K_SEGMENT, min(result["segments"].values()))
    print(f"selector top-k {args.rows} rows × {args.vocab}: slice maxima {best:.2f} ms, torch.topk {result['torch_topk_ms']:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def time_kernel_maxima(logits: torch.Tensor, k: int, want: torch.Tensor, device: torch.device, warmup: int,
                       iters: int) -> dict[str, float]:
    """What training does on CUDA: the fused CE kernel writes the slice maxima while it reads the
    logits, and row_top_k ranks slices by them. Times the kernel without and with them, and the
    candidates from them; checks the values first."""
    rows, vocab = logits.shape
    segment = candidate_segment(vocab)
    labels = torch.zeros(rows, dtype=torch.long, device=device)
    ce = torch.empty(rows, device=device)
    correct = torch.empty(rows, dtype=torch.bool, device=device)
    maxima = torch.empty(rows, vocab // segment, device=device)

    def kernel(with_maxima: bool):
        return fused_softmax_cross_entropy(logits, labels, ce, correct, 0, 0.0, True, logits.dtype,
                                           maxima if with_maxima else None, segment if with_maxima else 0)

    kernel(True)
    values, ids = row_top_k(logits, k, segment, maxima)
    if not (torch.equal(values, want) and torch.equal(logits.gather(1, ids), values)):
        raise SystemExit(f"candidates from the kernel's {segment}-wide slice maxima differ from torch.topk's")
    times = {"ce": mean_ms(lambda: kernel(False), device, warmup, iters),
             "ce_and_maxima": mean_ms(lambda: kernel(True), device, warmup, iters),
             "top_k_from_maxima": mean_ms(lambda: row_top_k(logits, k, segment, maxima), device, warmup, iters)}
    print(f"fused CE kernel: {times['ce']:.2f} ms, writing {segment}-wide slice maxima too: {times['ce_and_maxima']:.2f} ms; "
          f"top-k from them: {times['top_k_from_maxima']:.2f} ms (same values)", flush=True)
    return times


if __name__ == "__main__":
    raise SystemExit(main())
