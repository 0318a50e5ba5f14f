"""`dflash-train cache-features`: store the target's hidden states for a data set (sharded,
resumable) so training can run without the target's forward.

Ends with the `rows: read=N used=M skipped=K` accounting of its input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import THINKING, TOKEN_IDS, ConfigError, Section, SectionedConfig, option
from ..files import check_outside_inputs, hold_output
from ._common import check_target_flags, load_target_for


@dataclasses.dataclass(frozen=True)
class InputSettings(Section):
    """What is read: the conversations, and the target that renders and runs them."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file")
    data: list[str] = option([], "training conversations: JSONL/JSON/Parquet files (comma-separated)")
    max_seq_len: int = option(2048, "longer conversations are truncated (training may truncate further)", at_least=2)
    min_supervised_tokens: int = option(2, "skip rows with fewer assistant tokens than this", at_least=0)
    thinking: str = option("auto", "thinking templates (Qwen3): auto (template default), on or off")
    token_ids: str = option("auto", "rows with their answer's generated token ids: auto = render those ids where their "
                                    "tokenizer is the target's, ignore = re-tokenize the text (as `train --token-ids`)")


@dataclasses.dataclass(frozen=True)
class LayerSettings(Section):
    """Which of the target's layers are stored (the ones the drafter will read)."""

    target_layer_ids: list[int] = option([], "target layers to store; empty = the rule of docs/SEMANTICS.md with num_layers layers", at_least=0)
    num_layers: int = option(5, "how many layers the default rule picks (the drafter's depth, by default)", at_least=1)


@dataclasses.dataclass(frozen=True)
class OutputSettings(Section):
    """The cache folder and how its shards are written."""

    out: str = option("", "cache folder (new or empty; an interrupted cache there is resumed, a complete one is "
                          "verified: every written shard is read whole and a damaged one is rewritten)")
    shard_size_mb: float = option(1024.0, "shard file size in MiB (a shard is the unit of resume)", above=0, at_most=1 << 20)
    dtype: str = option("auto", "stored dtype: auto (the target's: bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")


@dataclasses.dataclass(frozen=True)
class ComputeSettings(Section):
    """Where and how many at a time the target's forwards run."""

    batch_size: int = option(0, "sequences per target forward; 0 = 32 on CUDA, 8 on CPU", at_least=0)
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")


@dataclasses.dataclass(frozen=True, init=False)
class CacheFeaturesConfig(SectionedConfig):
    """Run the target once over conversations and store its hidden states for training.

    Flags and flat file keys (`num_layers = 5`) or `[section]` tables (`[layers]` /
    `num_layers = 5`); Python callers pass flat keywords. `validate()` (run by the CLI and by
    `checked`) checks the rules across the sections."""

    input: InputSettings
    layers: LayerSettings
    output: OutputSettings
    compute: ComputeSettings

    def validate(self) -> None:
        from ..data.readers import CONVERSATION_FORMATS, check_readable
        from ..target.model import check_layer_ids_fit, check_target_path, check_tokenizer_beside
        from ..train.supply import check_distinct_files

        check_target_flags(self.input.target, self.output.out, self.input.thinking, self.output.dtype)
        if not self.input.data:
            raise ConfigError("no data: pass --data FILE.jsonl (conversations with assistant answers)")
        for path in self.input.data:
            check_readable(path, CONVERSATION_FORMATS, "--data")  # before the target loads
        check_distinct_files(self.input.data, "--data")
        if Path(self.output.out).exists() and not Path(self.output.out).is_dir():
            raise ConfigError(f"--out {self.output.out} is a file; the cache is a folder (new, empty, or an "
                              "interrupted cache to resume)")
        check_target_path(self.input.target, "--target")
        check_tokenizer_beside(self.input.target, "--target", "render --data")
        check_layer_ids_fit(list(self.layers.target_layer_ids), self.input.target)  # a folder's depth, from config.json
        check_outside_inputs(self.output.out, "--out", [self.input.target, *self.input.data])
        if self.input.token_ids not in TOKEN_IDS:
            raise ConfigError(f"--token-ids {self.input.token_ids!r}: use {' or '.join(TOKEN_IDS)}")


def run_cache_features(config: CacheFeaturesConfig) -> int:
    with hold_output(config.output.out, "--out"):  # one writer of a cache folder at a time
        return _run_cache_features(config)


def _run_cache_features(config: CacheFeaturesConfig) -> int:
    import torch

    from ..data.feature_cache import DTYPES, check_cache_folder, recorded_target_identity, write_feature_cache
    from ..data.samples import load_training_samples
    from ..target.model import default_target_layer_ids, resolve_device

    device = resolve_device(config.compute.device)
    data = [str(Path(p).resolve()) for p in config.input.data]
    thinking = THINKING[config.input.thinking]
    rows = config.input
    # --out against the settings known before the target loads (minutes for a big one); all of
    # them are checked once it has loaded.
    known = {"target_identity": recorded_target_identity(config.input.target), "max_seq_len": rows.max_seq_len,
             "min_supervised_tokens": rows.min_supervised_tokens, "enable_thinking": thinking, "data": data,
             "token_ids": rows.token_ids}
    if config.layers.target_layer_ids:
        known["layer_ids"] = list(config.layers.target_layer_ids)
    if config.output.dtype != "auto":
        known["dtype"] = config.output.dtype
    check_cache_folder(config.output.out, known)
    target = load_target_for(config.input.target, device, config.output.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"{config.input.target}: no tokenizer next to the model; it is needed to render --data")
    samples, stats = load_training_samples(
        data, target.tokenizer, max_length=rows.max_seq_len, min_supervised_tokens=rows.min_supervised_tokens,
        enable_thinking=thinking, token_ids=rows.token_ids,
    )
    if not samples:
        print(stats.summary())
        raise ConfigError(f"no usable rows in {', '.join(config.input.data)} {stats.why_none_used()}")
    layers = config.layers
    layer_ids = list(layers.target_layer_ids) or default_target_layer_ids(target.spec.num_hidden_layers, layers.num_layers)
    dtype = DTYPES[config.output.dtype] if config.output.dtype != "auto" else target.embed_weight.dtype
    batch_size = config.compute.batch_size or (32 if target.device.type == "cuda" else 8)
    print(f"caching target layers {layer_ids} ({torch.finfo(dtype).bits}-bit {str(dtype).removeprefix('torch.')}) "
          f"of {len(samples)} samples")
    report = write_feature_cache(
        target, samples, stats, config.output.out, layer_ids=layer_ids, dtype=dtype, batch_size=batch_size,
        shard_size_mb=config.output.shard_size_mb,
        settings={k: v for k, v in known.items() if k not in ("layer_ids", "dtype")},  # those the writer derives
    )
    print(report.summary())
    return 0
