"""`dflash-train eval-merge`: one run's numbers from the --json files of `eval` shards."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

from ..config import ConfigError, option
from ..files import NewFileOutput, check_new_output
from ..eval.merge import merge_eval_results
from ..eval.stats import format_benchmark, format_summary


@dataclasses.dataclass
class EvalMergeConfig:
    inputs: list[str] = option([], "the --json files of `dflash-train eval` shards, comma-separated")
    json: str = option("", "write the merged numbers and per-prompt records to this JSON file")

    def validate(self) -> None:
        if not self.inputs:
            raise ConfigError("eval-merge needs SHARD.json,SHARD.json,... (or --inputs)")
        for shard in self.inputs:
            if not Path(shard).is_file():
                kind = "a folder" if Path(shard).is_dir() else "no such file"
                raise ConfigError(f"{shard}: {kind}; eval-merge reads the --json files of `eval --offset --limit` shards")
        if self.json:
            check_new_output(self.json, "--json", self.inputs)


def run_eval_merge(config: EvalMergeConfig) -> int:
    # Two merges writing one --json: the second's file would land beside the first's, as NAME.1.json.
    with NewFileOutput(config.json, "--json") if config.json else contextlib.nullcontext() as output:
        return _run_eval_merge(config, output)


def _run_eval_merge(config: EvalMergeConfig, output: NewFileOutput | None) -> int:
    payload = merge_eval_results(config.inputs)
    summaries = {name: bench["summary"] for name, bench in payload["benchmarks"].items()}
    for name, summary in summaries.items():
        print("\n".join(format_benchmark(name, summary)))
    print()
    print("\n".join(format_summary(summaries)))
    if output is not None:
        out = output.write((json.dumps(payload, indent=1) + "\n").encode())
        print(f"wrote {out} (merged {len(payload['shards'])} shards)")
    return 1 if any(s["errors"] for s in summaries.values()) else 0
