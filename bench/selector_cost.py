"""The DFlash2 candidate selector's greedy (T = 0) path, one call as a decoder makes it: the
batched scores table and its walk (`CandidateSelector.select`) against the position-by-position
walk it replaced (`CandidateSelector.walk`), at SmolLM2-135M's sizes by default (vocabulary
49,152, hidden 576, k 16, rank 64, 15 draft positions, batch 1).

    python3 bench/selector_cost.py --json selector_cost.json          # CUDA: graph replays, CUDA events
    python3 bench/selector_cost.py --device cpu --iters 50            # CPU: wall clock

Counts the kernels each launches (aten ops that are not views, run eagerly), checks the two pick the same path on --check random draws (bf16 on CUDA, float32 on the
CPU), and prints the summary line
`selector greedy path SmolLM2: <n> ops, <t> ms (sequential <m> ops, <u> ms)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profiling import mean_ms  # noqa: E402
from dflash_train.core.dflash2 import CandidateSelector  # noqa: E402


class OpCounter(TorchDispatchMode):
    """The aten ops a call runs, views left out (they launch no kernel; `_unsafe_view`, a
    reshape's result, is one though not marked so)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten._unsafe_view:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def batched(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    return selector.select(hidden, logits, anchor, 0.0)[0]


def sequential(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1, sorted=False)
    return selector.walk(selector.hidden_projection(hidden), unary, candidates, anchor, 0.0)[0]


PATHS: dict[str, Callable] = {"batched": batched, "sequential": sequential}


def count_ops(path: Callable, selector: CandidateSelector, *inputs: torch.Tensor) -> tuple[int, dict[str, int]]:
    """Kernels one call launches: non-view aten ops, counted eagerly (a graph replays the same ones)."""
    with torch.no_grad(), OpCounter() as counter:
        path(selector, *inputs)
    return sum(counter.ops.values()), dict(counter.ops.most_common())


def time_path(path: Callable, selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor,
              anchor: torch.Tensor, warmup: int, iters: int) -> float:
    """Mean milliseconds per call: CUDA-graph replays timed by CUDA events, or the CPU's wall clock."""
    with torch.no_grad():
        if hidden.device.type != "cuda":
            return mean_ms(lambda: path(selector, hidden, logits, anchor), hidden.device, warmup, iters)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                path(selector, hidden, logits, anchor)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            path(selector, hidden, logits, anchor)
        return mean_ms(graph.replay, hidden.device, warmup, iters)


def random_inputs(args: argparse.Namespace, generator: torch.Generator, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden rows in the drafter's dtype, float32 logits (as the static decoder's head gives them)."""
    hidden = torch.randn(args.batch, args.positions, args.hidden, generator=generator).to(device, dtype)
    logits = (torch.randn(args.batch, args.positions, args.vocab, generator=generator) * 4).to(device)
    anchor = torch.randint(0, args.vocab, (args.batch,), generator=generator).to(device)
    return hidden, logits, anchor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--positions", type=int, default=15)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--std", type=float, default=0.3, help="the codebooks' scale (fresh selectors start at 0.02)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--check", type=int, default=100, help="random draws on which the two paths must agree")
    parser.add_argument("--name", default="SmolLM2", help="the sizes' name in the summary line")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    for flag in ("vocab", "hidden", "top_k", "rank", "positions", "batch", "iters"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1")
    if args.top_k > args.vocab:
        parser.error(f"--top-k {args.top_k}: must be at most --vocab {args.vocab}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    selector = CandidateSelector(args.hidden, args.vocab, args.rank, args.top_k)
    selector.reset_parameters(generator, std=args.std)
    selector = selector.to(device, dtype).eval()

    agree = 0
    with torch.no_grad():
        for _ in range(args.check):
            inputs = random_inputs(args, generator, device, dtype)
            agree += bool(torch.equal(batched(selector, *inputs), sequential(selector, *inputs)))
    print(f"paths equal on {agree}/{args.check} random draws ({device.type}, {str(dtype).removeprefix('torch.')})",
          flush=True)

    inputs = random_inputs(args, generator, device, dtype)
    results = {}
    for name, path in PATHS.items():
        ops, by_name = count_ops(path, selector, *inputs)
        ms = time_path(path, selector, *inputs, args.warmup, args.iters)
        results[name] = {"ops": ops, "ms": ms, "ops_by_name": by_name}
        print(f"{name}: {ops} ops, {ms:.3f} ms per call  ({', '.join(f'{k} {v}' for k, v in by_name.items())})",
              flush=True)
    new, old = results["batched"], results["sequential"]
    line = (f"selector greedy path {args.name}: {new['ops']} ops, {new['ms']:.3f} ms "
            f"(sequential {old['ops']} ops, {old['ms']:.3f} ms)")
    print(line)
    if args.json:
        sizes = {k: getattr(args, k) for k in ("vocab", "hidden", "top_k", "rank", "positions", "batch", "std")}
        Path(args.json).write_text(json.dumps({**sizes, "device": str(device), "dtype": str(dtype), "timing":
                                               "cuda graph replays" if device.type == "cuda" else "cpu wall clock",
                                               "paths_equal": [agree, args.check], "paths": results, "summary": line},
                                              indent=1))
    return 0 if agree == args.check else 1


if __name__ == "__main__":
    sys.exit(main())
