#!/usr/bin/env python
"""Rendering speed of training rows: one process vs worker processes (dflash_train/processes.py).

    python bench/render_speed.py --target SMOLLM2_DIR_OR_GGUF --data answers.jsonl --workers 1,4,16

Each case renders the same file with `load_training_samples` (the training's own path: chat
template, tokenizer, loss mask, row filters) and prints rows/s; all cases must give the same
samples. Prints one line per case:

    render <rows> rows, <W> worker(s): <s> s (<rows/s> rows/s)

and, last, what a restarted run pays instead (`data/rows_cache.py`: the data hashed, the run
folder's rows.cache read back; it must give the same samples):

    render <rows> rows read back from rows.cache: <s> s (<MB> MB on disk)

With `--prompts FILE` it times instead what regenerate does before its first token: render the
prompts (`generate/regenerate.py`, worker processes from `--parallel-min` prompts up), each
worker count giving the same jobs:

    render <n> prompts for regenerate, <W> worker(s): <s> s (<prompts/s> prompts/s)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash_train.target.model import model_folder  # noqa: E402

from dflash_train.data.rows_cache import read_rows, rows_key, write_rows  # noqa: E402
from dflash_train.data.samples import load_training_samples  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a Hugging Face folder or .gguf (only its tokenizer is used)")
    parser.add_argument("--data", default="", help="a conversation file (.jsonl or .jsonl.gz)")
    parser.add_argument("--prompts", default="", help="a prompt file: time regenerate's prompt rendering instead")
    parser.add_argument("--limit", type=int, default=0, help="--prompts: the first N prompts (0 = all)")
    parser.add_argument("--parallel-min", type=int, default=8192, help="--prompts: regenerate's parallel_min_prompts")
    parser.add_argument("--workers", default="1,4,16", help="comma-separated worker counts (1 = this process)")
    parser.add_argument("--max-length", type=int, default=768)
    parser.add_argument("--min-supervised-tokens", type=int, default=32)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if bool(args.data) == bool(args.prompts):
        parser.error("give one of --data (training rows) or --prompts (regenerate's prompts)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.target))
    if args.prompts:
        return time_prompt_rendering(args, tokenizer)
    latest: dict = {}  # the last case's samples and stats: what the read-back below writes

    def render(workers: int) -> tuple[list, dict, str]:
        started = time.perf_counter()
        samples, stats = load_training_samples(args.data, tokenizer, max_length=args.max_length,
                                               min_supervised_tokens=args.min_supervised_tokens,
                                               workers=workers, parallel_min_rows=1)
        seconds = time.perf_counter() - started
        latest.update(samples=samples, stats=stats)
        read = stats.read
        return ([(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples],
                {"rows": read, "samples": len(samples), "seconds": round(seconds, 2), "rows_per_s": round(read / seconds, 1)},
                f"render {read} rows, {workers} worker(s): {seconds:.1f} s ({read / seconds:,.0f} rows/s)")

    compared = each_worker_count(args.workers, render, "samples")
    if compared is None:
        return 1
    results, reference = compared
    samples, stats = latest["samples"], latest["stats"]
    settings = dict(max_length=args.max_length, min_supervised_tokens=args.min_supervised_tokens)
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "rows.cache"
        write_rows(cache, rows_key([args.data], tokenizer, settings), samples, stats)
        started = time.perf_counter()
        kept = read_rows(cache, rows_key([args.data], tokenizer, settings))
        seconds = time.perf_counter() - started
        if kept is None or [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in kept[0]] != reference:
            print("render: the rows read back from rows.cache differ from the rendered ones", file=sys.stderr)
            return 1
        megabytes = cache.stat().st_size / 1e6
    results.append({"read_back_seconds": round(seconds, 2), "cache_mb": round(megabytes, 1)})
    print(f"render {stats.read} rows read back from rows.cache: {seconds:.1f} s ({megabytes:.0f} MB on disk)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def each_worker_count(counts: str, render, what: str) -> tuple[list[dict], list] | None:
    """`render(workers)` -> (what it made, its numbers, its line) for each comma-separated count:
    the numbers of each, and what the first made; None (said on stderr) when a count made
    anything else than the first."""
    results, reference = [], None
    for workers in [int(w) for w in counts.split(",")]:
        made, numbers, line = render(workers)
        if reference is not None and made != reference:
            print(f"render: {workers} worker(s) gave other {what} than the first case", file=sys.stderr)
            return None
        reference = made
        results.append({"workers": workers, **numbers})
        print(line, flush=True)
    return results, reference


class _CollectingEngine:
    """An engine that keeps the jobs regenerate hands it and answers none: regenerate up to its first token."""

    description = "engine: none (the jobs are kept, nothing is generated)"
    setup_failures = None

    def answers(self, jobs):
        self.jobs = list(jobs)
        return iter(())


def time_prompt_rendering(args: argparse.Namespace, tokenizer) -> int:
    import io
    import itertools

    from dflash_train.data.readers import RowStats, read_prompts
    from dflash_train.generate.regenerate import regenerate

    prompts = list(itertools.islice(read_prompts(args.prompts), args.limit or None))

    def render(workers: int) -> tuple[list, dict, str]:
        engine, stats = _CollectingEngine(), RowStats()
        stats.count_read(len(prompts))
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            regenerate(prompts, Path(folder) / "answers.jsonl", engine=engine, stats=stats, target_name="bench",
                       tokenizer=tokenizer, log=io.StringIO(), progress_stream=io.StringIO(), workers=workers,
                       parallel_min_prompts=args.parallel_min)
            seconds = time.perf_counter() - started
        jobs = [(job.prompt.id, job.ids) for job in engine.jobs]
        return (jobs, {"prompts": len(prompts), "jobs": len(jobs), "seconds": round(seconds, 2)},
                f"render {len(prompts)} prompts for regenerate, {workers} worker(s): {seconds:.1f} s "
                f"({len(prompts) / seconds:,.0f} prompts/s)")

    compared = each_worker_count(args.workers, render, "jobs")
    if compared is None:
        return 1
    results, _ = compared
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
