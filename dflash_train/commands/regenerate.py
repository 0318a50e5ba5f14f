"""`dflash-train regenerate`: the target answers prompts (resumable) to make training data.

Ends with the `rows: read=N used=M skipped=K` accounting of its input."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

from ..config import THINKING, ConfigError, option
from ._common import check_target_flags, load_target_for


@dataclasses.dataclass
class RegenerateConfig:
    """Let the target write the answers to a set of prompts (training data in its own words)."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file")
    prompts: str = option("", "prompt file (.jsonl/.json/.parquet/.txt, optionally .gz; chats ending with an answer "
                              "have it replaced) or 'default' (built-in prompts from the OpenAI evals registry)")
    out: str = option("", "output .jsonl of training rows; an existing one is resumed (rows already there are kept)")
    limit: int = option(0, "use only the first N prompts (0 = all)")
    max_new_tokens: int = option(1024, "answer length cap; a capped answer gets finish_reason 'length'")
    temperature: float = option(0.0, "0 = greedy; > 0 samples (each row from its own seed)")
    top_p: float = option(1.0, "nucleus sampling mass (with temperature > 0)")
    seed: int = option(0, "sampling seed (also picks and orders the default prompts)")
    batch_size: int = option(0, "prompts decoded at once (the static generator's slots); 0 = 1024 on CUDA (fewer "
                                "where the caches do not fit; 64 for targets on the eager fallback), 8 on CPU")
    flush_seconds: float = option(1.0, "write finished rows (fsync'ed) at most this often; a kill loses at most the "
                                       "rows of the last interval, which a rerun answers again")
    max_prompt_tokens: int = option(0, "skip longer prompts; 0 = the target's context minus max_new_tokens")
    thinking: str = option("auto", "thinking templates (Qwen3): auto (template default), on or off")
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")
    dtype: str = option("auto", "target weights: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")

    def validate(self) -> None:
        check_target_flags(self.target, self.out, self.thinking, self.dtype, self.batch_size)
        if not self.prompts:
            raise ConfigError("no prompts: pass --prompts FILE or --prompts default")
        if not self.out.endswith(".jsonl"):
            raise ConfigError(f"--out {self.out}: use a .jsonl file (it is appended to, and resumed)")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.flush_seconds < 0:
            raise ConfigError(f"flush_seconds must be >= 0 (0 = after every row), got {self.flush_seconds}")
        if self.limit < 0 or self.max_prompt_tokens < 0:
            raise ConfigError("limit and max_prompt_tokens must be >= 0 (0 = no limit / automatic)")


def run_regenerate(config: RegenerateConfig) -> int:
    from ..data.prompts import default_training_prompts
    from ..data.readers import RowStats, read_prompts
    from ..data.regenerate import GenerationSettings, check_output, output_record, regenerate
    from ..target import resolve_device

    device = resolve_device(config.device)
    settings = GenerationSettings(
        max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
        seed=config.seed, enable_thinking=THINKING[config.thinking],
    )
    target_name = str(Path(config.target).resolve())
    check_output(Path(config.out), output_record(target_name, settings))  # refuse early, before loading anything
    stats = RowStats()
    if config.prompts == "default":
        scanned = RowStats()
        prompts = default_training_prompts(config.limit or None, config.seed, stats=scanned)
        print(f"default prompts: {len(prompts)} taken from the OpenAI evals registry "
              f"({scanned.read} registry rows scanned, {scanned.used} usable)")
        stats.count_read(len(prompts))
    else:
        rows = read_prompts(config.prompts, stats)
        prompts = list(itertools.islice(rows, config.limit) if config.limit else rows)
    # The engine step: where an --endpoint engine (data/endpoint.py) gives the same four values.
    engine, tokenizer, max_prompt_tokens, record_extra = _local_engine(config, device, settings)
    report = regenerate(
        prompts, config.out, engine=engine, stats=stats, settings=settings, target_name=target_name,
        tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens, record_extra=record_extra,
        flush_seconds=config.flush_seconds,
    )
    print(report.summary())
    return 0


def _local_engine(config: RegenerateConfig, device: Any, settings: Any) -> tuple[Any, Any, int | None, dict[str, Any]]:
    """The target loaded here and its engine (decode/batched.py): (engine, tokenizer for
    rendering, prompt token cap, what the settings sidecar records besides the settings)."""
    from ..data.regenerate import prompt_token_limit
    from ..data.render import stop_token_ids
    from ..decode.batched import local_engine

    target = load_target_for(config.target, device, config.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"{target.path}: no tokenizer next to the model; it is needed to render the prompts")
    max_prompt_tokens = config.max_prompt_tokens or prompt_token_limit(target.model.config, settings)
    engine = local_engine(target, settings, batch_size=config.batch_size, max_prompt_tokens=max_prompt_tokens)
    return engine, target.tokenizer, max_prompt_tokens, {"stop_token_ids": stop_token_ids(target.model, target.tokenizer)}
