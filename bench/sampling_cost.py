"""What a batched generator's sampling costs a step: `decode.sampling.choose_tokens` on [rows, vocab]
logits, greedy against tempered top-p (the self-prompts stage's temperature 0.8, top-p 0.99), and
the parts of the top-p path one at a time (CUDA events, mean of --repeats calls after a warm-up).

    python3 bench/sampling_cost.py --rows 1024 --vocab 49152 --device cuda:0

Prints one line per case and the summary line
`sampling SmolLM2 1024 rows: top-p <ms> ms, greedy <ms> ms (sort <ms> ms)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.decode.sampling import choose_tokens  # noqa: E402


def timed(function, repeats: int, device: torch.device) -> float:
    """Mean milliseconds of `function()` over `repeats` calls, after two warm-up calls."""
    for _ in range(2):
        function()
    if device.type != "cuda":
        import time

        started = time.perf_counter()
        for _ in range(repeats):
            function()
        return (time.perf_counter() - started) * 1e3 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.99)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    # Logits of a language model's spread: a few strong candidates over a long tail.
    logits = (torch.randn(args.rows, args.vocab, generator=generator) * 3.0).to(device, torch.bfloat16)
    seeds = torch.arange(args.rows, dtype=torch.int64, device=device)
    counters = torch.zeros(args.rows, dtype=torch.int64, device=device)
    probs = torch.softmax(logits.float() / args.temperature, dim=-1)
    cases = {
        "top-p": lambda: choose_tokens(logits, args.temperature, args.top_p, seeds, counters),
        "temperature only": lambda: choose_tokens(logits, args.temperature, 1.0, seeds, counters),
        "greedy": lambda: choose_tokens(logits, 0.0, 1.0, None, None),
        "softmax": lambda: torch.softmax(logits.float() / args.temperature, dim=-1),
        "sort": lambda: probs.sort(dim=-1, descending=True),
        "float64 cumsum": lambda: probs.double().cumsum(dim=-1),
    }
    results = {}
    for name, function in cases.items():
        results[name] = round(timed(function, args.repeats, device), 3)
        print(f"{name:<18} {results[name]:8.3f} ms", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"sampling SmolLM2 {args.rows} rows: top-p {results['top-p']:.2f} ms, greedy {results['greedy']:.2f} ms "
          f"(sort {results['sort']:.2f} ms) on {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": args.rows, "vocab": args.vocab,
                                               "temperature": args.temperature, "top_p": args.top_p, "ms": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
