"""`dflash-train regenerate` and `dflash-train cache-features`: typed configs and runners.

Imported by the CLI, which is why the heavy imports (torch, transformers) stay inside the runners.
Both commands end with the `rows: read=N used=M skipped=K` accounting of their input.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from .. import cli
from ..config import ConfigError, option

_THINKING = {"auto": None, "on": True, "off": False}
_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _check_common(target: str, out: str, thinking: str, dtype: str, batch_size: int) -> None:
    if not target:
        raise ConfigError("no target: pass --target DIR (a Hugging Face folder or a .gguf file)")
    if not out:
        raise ConfigError("no output: pass --out")
    if thinking not in _THINKING:
        raise ConfigError(f"thinking {thinking!r}: use auto (the template's default), on or off")
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r}: use {', '.join(_DTYPES)}")
    if batch_size < 0:
        raise ConfigError(f"batch_size must be at least 1 (or 0 for automatic), got {batch_size}")


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
    batch_size: int = option(0, "prompts per batch; 0 = 64 on CUDA, 8 on CPU")
    max_prompt_tokens: int = option(0, "skip longer prompts; 0 = the target's context minus max_new_tokens")
    thinking: str = option("auto", "thinking templates (Qwen3): auto (template default), on or off")
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")
    dtype: str = option("auto", "target weights: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")

    def validate(self) -> None:
        _check_common(self.target, self.out, self.thinking, self.dtype, self.batch_size)
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
        if self.limit < 0 or self.max_prompt_tokens < 0:
            raise ConfigError("limit and max_prompt_tokens must be >= 0 (0 = no limit / automatic)")


@dataclasses.dataclass
class CacheFeaturesConfig:
    """Run the target once over conversations and store its hidden states for training."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file")
    data: list[str] = option([], "training conversations: JSONL/JSON/Parquet files (comma-separated)")
    out: str = option("", "cache folder (new or empty; an interrupted cache there is resumed)")
    max_seq_len: int = option(2048, "longer conversations are truncated (training may truncate further)")
    min_supervised_tokens: int = option(2, "skip rows with fewer assistant tokens than this")
    target_layer_ids: list[int] = option([], "target layers to store; empty = DESIGN rule with num_layers layers")
    num_layers: int = option(5, "how many layers the default rule picks (the drafter's depth, by default)")
    batch_size: int = option(0, "sequences per target forward; 0 = 32 on CUDA, 8 on CPU")
    shard_size_mb: float = option(1024.0, "shard file size in MiB (a shard is the unit of resume)")
    dtype: str = option("auto", "stored dtype: auto (the target's: bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")
    thinking: str = option("auto", "thinking templates (Qwen3): auto (template default), on or off")
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")

    def validate(self) -> None:
        _check_common(self.target, self.out, self.thinking, self.dtype, self.batch_size)
        if not self.data:
            raise ConfigError("no data: pass --data FILE.jsonl (conversations with assistant answers)")
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be at least 2, got {self.max_seq_len}")
        if self.num_layers < 1:
            raise ConfigError(f"num_layers must be at least 1, got {self.num_layers}")
        if self.shard_size_mb <= 0:
            raise ConfigError(f"shard_size_mb must be > 0, got {self.shard_size_mb}")


def _load(target_path: str, device, dtype: str):
    import torch

    from ..target import load_target

    weights = None if dtype == "auto" else getattr(torch, dtype)
    print(f"loading target {target_path} on {device}")
    return load_target(Path(target_path).resolve(), device, weights)


def run_regenerate(config: RegenerateConfig) -> int:
    from .prompts import default_training_prompts
    from .readers import RowStats, read_prompts
    from .regenerate import GenerationSettings, check_output, output_record, regenerate

    from ..target import resolve_device

    device = resolve_device(config.device)
    settings = GenerationSettings(
        max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
        seed=config.seed, enable_thinking=_THINKING[config.thinking],
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
    target = _load(config.target, device, config.dtype)
    batch_size = config.batch_size or (64 if target.device.type == "cuda" else 8)
    report = regenerate(
        target, prompts, config.out, stats=stats, settings=settings, batch_size=batch_size,
        max_prompt_tokens=config.max_prompt_tokens or None, target_name=target_name,
    )
    print(report.summary())
    return 0


def run_cache_features(config: CacheFeaturesConfig) -> int:
    import torch

    from ..target import default_target_layer_ids
    from .feature_cache import DTYPES, write_feature_cache
    from .samples import load_training_samples

    from ..target import resolve_device

    device = resolve_device(config.device)
    target = _load(config.target, device, config.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"{config.target}: no tokenizer next to the model; it is needed to render --data")
    data = [str(Path(p).resolve()) for p in config.data]
    thinking = _THINKING[config.thinking]
    samples, stats = load_training_samples(
        data, target.tokenizer, max_length=config.max_seq_len, min_supervised_tokens=config.min_supervised_tokens,
        enable_thinking=thinking,
    )
    if not samples:
        print(stats.summary())
        raise ConfigError(f"no usable rows in {', '.join(config.data)} (see the reasons above)")
    layer_ids = list(config.target_layer_ids) or default_target_layer_ids(target.spec.num_hidden_layers, config.num_layers)
    dtype = DTYPES[config.dtype] if config.dtype != "auto" else target.embed_weight.dtype
    batch_size = config.batch_size or (32 if target.device.type == "cuda" else 8)
    print(f"caching target layers {layer_ids} ({torch.finfo(dtype).bits}-bit {str(dtype).removeprefix('torch.')}) "
          f"of {len(samples)} samples")
    report = write_feature_cache(
        target, samples, stats, config.out, layer_ids=layer_ids, dtype=dtype, batch_size=batch_size,
        shard_size_mb=config.shard_size_mb,
        settings={"max_seq_len": config.max_seq_len, "min_supervised_tokens": config.min_supervised_tokens,
                  "enable_thinking": thinking, "data": data},
    )
    print(report.summary())
    return 0


cli.register("regenerate", RegenerateConfig, "dflash_train.data.commands:run_regenerate",
             "answer prompts with the target itself (resumable) to make training data")
cli.register("cache-features", CacheFeaturesConfig, "dflash_train.data.commands:run_cache_features",
             "store the target's hidden states for a data set (sharded, resumable) to train without running it")
