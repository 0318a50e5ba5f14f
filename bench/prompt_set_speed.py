"""Time the default prompt set: decontamination of every registry prompt, the build, the cached read.

    python bench/prompt_set_speed.py            # all three (the build takes ~70 s of one core)
    python bench/prompt_set_speed.py --only build --cores 1,all   # the build on one core, then on all

Prints wall and CPU seconds (CPU includes the build's worker processes; it is the figure to
compare on a shared machine) and summary lines:
    decontaminate <N> prompts: <s> s wall, <s> s CPU (<n> overlaps)
    prompt set build on <c> cores: <s> s wall, <s> s CPU (<N> prompts); cached read: <s> s wall
With several core counts it also says whether every build gave the same prompts (it must).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
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


def cpu_seconds() -> float:
    """This process's CPU time and that of its finished children (the build's workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(fn):
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = fn()
    return result, time.perf_counter() - wall, cpu_seconds() - cpu


def bench_decontaminate(benchmarks) -> None:
    texts = registry_texts()
    decontaminator, build_wall, _ = timed(lambda: Decontaminator(benchmarks))
    print(f"benchmark 13-grams: {len(decontaminator.grams)} from {decontaminator.prompts} prompts ({build_wall:.2f} s)")
    hits, wall, cpu = timed(lambda: [hit for hit in map(decontaminator.match, texts) if hit is not None])
    by = collections.Counter((hit.benchmark, hit.kind) for hit in hits)
    print(f"overlaps by benchmark: {dict(by)}")
    print(f"decontaminate {len(texts)} prompts: {wall:.1f} s wall, {cpu:.1f} s CPU ({len(hits)} overlaps)")


def bench_build(benchmarks, cores: list[str]) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    built = []
    for count in cores:
        # The build spreads its work over the cores this process may use (dflash_train/processes.py).
        os.sched_setaffinity(0, allowed if count == "all" else allowed[:int(count)])
        try:
            with tempfile.TemporaryDirectory() as cache:
                prompt_set, wall, cpu = timed(lambda: build_prompt_set(benchmarks, cache_dir=cache))
                _, read_wall, read_cpu = timed(lambda: build_prompt_set(benchmarks, cache_dir=cache))
        finally:
            os.sched_setaffinity(0, allowed)
        print(prompt_set.summary())
        print(f"prompt set build on {len(os.sched_getaffinity(0)) if count == 'all' else count} cores: {wall:.1f} s wall, "
              f"{cpu:.1f} s CPU ({len(prompt_set.prompts)} prompts); cached read: {read_wall:.1f} s wall, {read_cpu:.1f} s CPU")
        built.append([(p.id, p.messages) for p in prompt_set.prompts])
    if len(built) > 1:
        print(f"same prompts on every core count: {'yes' if all(b == built[0] for b in built) else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("decontaminate", "build"))
    parser.add_argument("--cores", default="all", help="comma-separated core counts for the build (a number or all)")
    args = parser.parse_args()
    cores = args.cores.split(",")
    if not all(c == "all" or c.isdigit() and 1 <= int(c) <= len(os.sched_getaffinity(0)) for c in cores):
        parser.error(f"--cores {args.cores}: each is `all` or a number from 1 to {len(os.sched_getaffinity(0))}")
    benchmarks = benchmark_prompt_texts()
    if args.only in (None, "decontaminate"):
        bench_decontaminate(benchmarks)
    if args.only in (None, "build"):
        bench_build(benchmarks, cores)


if __name__ == "__main__":
    main()
