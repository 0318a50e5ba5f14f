"""Time the default prompt set: decontamination of every registry prompt, the build, the cached read.

    python bench/prompt_set_speed.py            # all three (the build takes ~40 s of CPU)
    python bench/prompt_set_speed.py --only decontaminate

Prints wall and CPU seconds (the CPU figure is the one to compare on a shared machine) and
summary lines:
    decontaminate <N> prompts: <s> s wall, <s> s CPU (<n> overlaps)
    prompt set build: <s> s wall, <s> s CPU (<N> prompts); cached read: <s> s wall
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

from dflash_train.data.prompts.registry import evals_registry_dir
from dflash_train.data.prompts.sets import build_prompt_set

from dflash_train.commands._common import benchmark_prompt_texts
from dflash_train.data.decontaminate import Decontaminator


def registry_texts() -> list[str]:
    """Every distinct chat prompt text of the installed evals registry (~780k)."""
    texts: dict[str, None] = {}
    for path in sorted(evals_registry_dir().rglob("*.jsonl")):
        for line in path.read_bytes().split(b"\n"):
            try:
                messages = json.loads(line)["input"]
                texts.setdefault("\n".join(m["content"] for m in messages), None)
            except (ValueError, KeyError, TypeError):
                continue
    return list(texts)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def bench_decontaminate(benchmarks) -> None:
    texts = registry_texts()
    decontaminator, build_wall, _ = timed(lambda: Decontaminator(benchmarks))
    print(f"benchmark 13-grams: {len(decontaminator.grams)} from {decontaminator.prompts} prompts ({build_wall:.2f} s)")
    hits, wall, cpu = timed(lambda: [hit for hit in map(decontaminator.match, texts) if hit is not None])
    by = collections.Counter((hit.benchmark, hit.kind) for hit in hits)
    print(f"overlaps by benchmark: {dict(by)}")
    print(f"decontaminate {len(texts)} prompts: {wall:.1f} s wall, {cpu:.1f} s CPU ({len(hits)} overlaps)")


def bench_build(benchmarks) -> None:
    with tempfile.TemporaryDirectory() as cache:
        prompt_set, wall, cpu = timed(lambda: build_prompt_set(benchmarks, cache_dir=cache))
        _, read_wall, read_cpu = timed(lambda: build_prompt_set(benchmarks, cache_dir=cache))
    print(prompt_set.summary())
    print(f"prompt set build: {wall:.1f} s wall, {cpu:.1f} s CPU ({len(prompt_set.prompts)} prompts); "
          f"cached read: {read_wall:.1f} s wall, {read_cpu:.1f} s CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("decontaminate", "build"))
    args = parser.parse_args()
    benchmarks = benchmark_prompt_texts()
    if args.only in (None, "decontaminate"):
        bench_decontaminate(benchmarks)
    if args.only in (None, "build"):
        bench_build(benchmarks)


if __name__ == "__main__":
    main()
