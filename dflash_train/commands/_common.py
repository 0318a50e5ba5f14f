"""What the data commands share: the checks of their common flags and loading the target."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import DTYPE_NAMES, THINKING, ConfigError


def check_target_flags(target: str, out: str, thinking: str, dtype: str) -> None:
    if not target:
        raise ConfigError("no target: pass --target DIR (a Hugging Face folder or a .gguf file)")
    if not out:
        raise ConfigError("no output: pass --out")
    if thinking not in THINKING:
        raise ConfigError(f"thinking {thinking!r}: use auto (the template's default), on or off")
    if dtype not in ("auto", *DTYPE_NAMES):
        raise ConfigError(f"dtype {dtype!r}: use auto, {', '.join(DTYPE_NAMES)}")


def load_target_for(target_path: str, device: Any, dtype: str) -> Any:
    """The target on `device`, its weights in `dtype` ("auto" keeps load_target's default)."""
    from ..target.model import dtype_from_name, load_target

    weights = dtype_from_name(dtype, device)
    print(f"loading target {target_path} on {device}")
    return load_target(Path(target_path).resolve(), device, weights)


def benchmark_prompt_texts() -> dict[str, list[str]]:
    """The text of every built-in benchmark prompt, by benchmark: what training prompts must not overlap."""
    from ..eval.benchmarks import BENCHMARKS

    return {name: ["\n".join(m["content"] for m in p.messages) for p in load()] for name, (_, load) in BENCHMARKS.items()}


@functools.lru_cache(maxsize=2)
def default_prompt_set(settings: Any) -> Any:
    """The default prompt set (data/prompts/sets.py) for `settings`, decontaminated, cached in the cache
    folder (and in this process: quickstart and tests ask more than once)."""
    from ..data.prompts.sets import build_prompt_set
    from ..target.gguf import default_cache_dir

    return build_prompt_set(benchmark_prompt_texts(), settings, cache_dir=default_cache_dir())


def prompt_file_bytes(prompts: Sequence[Any], source_of: Callable[[Any], str]) -> bytes:
    """`prompts` as a .jsonl of {id, source, messages} rows: what `regenerate --prompts FILE` reads."""
    lines = (json.dumps({"id": p.id, "source": source_of(p), "messages": p.messages}, ensure_ascii=False) for p in prompts)
    return "".join(line + "\n" for line in lines).encode("utf-8")


def write_new_prompt_file(out: str, prompts: Sequence[Any], source_of: Callable[[Any], str]) -> Path:
    """`prompts` written to the new file `out` by `files.write_new_file_atomic` (whole or not at
    all, never over a file that appeared meanwhile); the path written. For a file a stage of a
    command holds already; a command's own output goes through `files.NewFileOutput`."""
    from ..files import write_new_file_atomic

    return write_new_file_atomic(out, prompt_file_bytes(prompts, source_of))
