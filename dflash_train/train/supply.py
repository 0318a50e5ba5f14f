"""Where a run's features and rows come from: the target(s) run live, or a feature cache read
on the target devices (`FeatureSupply`), and the training samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TextIO

import torch

from ..config import THINKING, ConfigError, TrainConfig, UserError
from ..target.model import Target, load_target
from .batches import HostBatch
from .layout import Layout
from .routing import FeatureSource

if TYPE_CHECKING:
    from ..data.rows_cache import Rendering


class LiveTarget:
    """FeatureSource running the target model on its device."""

    def __init__(self, target: Target, layer_ids: list[int]):
        self.target = target
        self.layer_ids = layer_ids
        self.device = target.device

    def features(self, batch: HostBatch) -> torch.Tensor:
        return self.target.features(batch.input_ids.to(self.device, non_blocking=True), self.layer_ids)


@dataclass
class FeatureSupply:
    """The targets (one per target worker) and the feature cache, if features come from one."""

    targets: list[Target]
    cache: Any = None  # data.feature_cache.FeatureCache

    @property
    def first(self) -> Target:
        return self.targets[0]

    def sources(self, layout: Layout, layer_ids: list[int], log: TextIO) -> list[FeatureSource]:
        """One feature source per target worker: the live target, or the cache read on its device."""
        if self.cache is None:
            return [LiveTarget(target, layer_ids) for target in self.targets]
        devices = layout.target_devices
        sources = [self.cache.source(devices[t % len(devices)], layer_ids) for t in range(len(self.targets))]
        print(f"features: cache {self.cache.directory} ({len(self.cache)} samples, layers {self.cache.layer_ids}, "
              f"{self.cache.dtype}) read on {', '.join(str(s.device) for s in sources)}", file=log)
        return sources


def load_feature_supply(
    config: TrainConfig, layout: Layout, given: Target | Sequence[Target] | None, log: TextIO,
) -> FeatureSupply:
    targets: list[Target] = [] if given is None else [given] if isinstance(given, Target) else list(given)
    cache = None
    if config.data.features:
        from ..data.feature_cache import FeatureCache

        if config.data.data:
            raise ConfigError(f"pass --data or --features, not both: the feature cache {config.data.features} holds its own samples")
        cache = FeatureCache(config.data.features)
        cached_thinking(config, cache)
        if config.model.target and (note := cache.identity_note()):
            # Accepted, not refused: a cache is hours of target forwards, and a cache from before
            # the identity was recorded still has its shape checked (check_target, below).
            print(note, file=log)
        if not targets:
            # No target forward runs for training; its embedding, head and tokenizer are still
            # needed (one copy serves every target worker), and the in-training evaluator runs it whole.
            path = config.model.target or cache.target
            device = feature_target_device(config, layout)
            use = "the in-training evaluator, embedding, head, tokenizer" if config.eval.eval_every else "embedding, head, tokenizer"
            print(f"loading target {path} on {device} ({use}; features from {config.data.features})", file=log)
            drafters_on_cuda = any(d.type == "cuda" for d in layout.drafter_devices)
            targets.append(load_target(path, device, torch.bfloat16 if drafters_on_cuda else None))
        cache.check_target(targets[0])
        targets += targets[:1] * (len(layout.target_devices) - len(targets))
    for device in layout.target_devices[len(targets):]:
        print(f"loading target {config.model.target} on {device}", file=log)
        targets.append(load_target(config.model.target, device))
    return FeatureSupply(targets, cache)


def feature_target_device(config: TrainConfig, layout: Layout) -> torch.device:
    """Where the target goes when features come from a cache: the CPU (only its embedding and
    head are read, and copied to the drafters) unless --eval-every decodes with it, which on
    GPUs must not run on the CPU inside a drafter thread: then the first target device, or the
    first drafter device when the target devices are CPUs."""
    if not config.eval.eval_every:
        return torch.device("cpu")
    for device in [*layout.target_devices, *layout.drafter_devices]:
        if device.type == "cuda":
            return device
    return torch.device("cpu")


def cached_thinking(config: TrainConfig, cache: Any) -> bool | None:
    """The thinking mode of a feature cache's rows, which the evaluator's prompts must share:
    --thinking auto takes it; another explicit value is refused."""
    cached = cache.header.get("enable_thinking")
    if config.data.thinking != "auto" and THINKING[config.data.thinking] != cached:
        made = {value: name for name, value in THINKING.items()}[cached]
        raise ConfigError(f"--thinking {config.data.thinking}: the feature cache {config.data.features} was rendered with "
                          f"thinking {made}; the evaluator must render prompts as the training rows were "
                          f"(pass --thinking {made} or auto)")
    return cached


def evaluation_thinking(config: TrainConfig, supply: FeatureSupply) -> bool | None:
    if supply.cache is not None:
        return cached_thinking(config, supply.cache)
    return THINKING[config.data.thinking]


def check_inputs(config: TrainConfig, *, samples_given: bool, target_given: bool) -> None:
    """The target and the data files a run reads, checked before anything loads or is written
    (a target that takes minutes to load is not loaded for a --data path with a typo)."""
    from ..data.readers import CONVERSATION_FORMATS, check_readable
    from ..target.model import check_target_path

    if not target_given:
        if config.model.target:
            check_target_path(config.model.target, "--target")
            check_drafter_fits(config, config.model.target)
        elif not config.data.features:
            raise ConfigError("no target: pass --target DIR (a Hugging Face folder or a .gguf file), or --features CACHE")
        if config.model.target and config.data.features:
            from ..data.feature_cache import check_made_from, read_header

            # A sampled fingerprint (a few MiB read), so a cache of another target is refused before this one loads.
            check_made_from(read_header(config.data.features), config.data.features, config.model.target)
    if config.eval.eval_every:  # the in-training eval's prompts: a typo fails now, not once the target has loaded
        from ..eval.benchmarks import load_benchmark

        try:
            found = load_benchmark(config.eval.eval_bench)
        except UserError as error:
            raise ConfigError(f"--eval-bench: {error}") from None
        if not found:
            raise ConfigError(f"--eval-bench {config.eval.eval_bench}: no prompts in it")
    if samples_given or config.data.features:
        return
    if not config.data.data:
        raise ConfigError("no training data: pass --data FILE.jsonl (conversations with assistant answers)")
    for path in config.data.data:
        check_readable(path, CONVERSATION_FORMATS, "--data")
    check_distinct_files(config.data.data, "--data")
    if config.model.target and not target_given:
        from ..target.model import check_tokenizer_beside

        check_tokenizer_beside(config.model.target, "--target", "render --data")


def check_drafter_fits(config: TrainConfig, target: str) -> None:
    """Each drafter's target layer ids, mask token id and DFlash2 sizes against the depth,
    vocabulary and hidden size the target declares (config.json or the GGUF header), before it
    loads: the drafter's own checks would find them only once it is built on the loaded target."""
    from ..core.dflash2 import check_dflash2_dims
    from ..target.model import check_target_layer_ids, declared_config, positive_size

    declared = declared_config(target)  # read once: a .gguf's header is parsed whole
    vocab, hidden = positive_size(declared, "vocab_size"), positive_size(declared, "hidden_size")
    layers = positive_size(declared, "num_hidden_layers")
    for layer_ids in [config.model.target_layer_ids, *(d.model.target_layer_ids for _, d in config.variant_configs())]:
        if layers and layer_ids:
            check_target_layer_ids(list(layer_ids), layers)
    for name, drafter in config.variant_configs() or [("", config)]:
        where, model = f"{name}: " if name else "", drafter.model
        if vocab and model.mask_token_id is not None and model.mask_token_id >= vocab:
            raise ConfigError(f"{where}--mask-token-id {model.mask_token_id} is outside the target's embedding table "
                              f"(rows 0..{vocab - 1})")
        if vocab and hidden and model.arch == "dflash2":
            problem = check_dflash2_dims(hidden, vocab, model.conv_kernel_size, model.conv_group_size,
                                         model.selector_rank, model.selector_top_k)
            if problem:
                raise ConfigError(f"{where}--arch dflash2: {problem}")


def check_distinct_files(paths: Sequence[str], flag: str) -> None:
    """A file named twice (`a.jsonl,./a.jsonl`, or through a link) is refused: its rows would be
    read twice, silently doubling what is trained on. Resolved paths are compared."""
    seen: dict[Path, str] = {}
    for path in paths:
        resolved = Path(path).resolve()
        if resolved in seen:
            same = f" (the same file as {seen[resolved]})" if seen[resolved] != path else ""
            raise ConfigError(f"{flag} {path} is given twice{same}: each file's rows would be read twice; name it once")
        seen[resolved] = path


def load_samples(config: TrainConfig, supply: FeatureSupply, log: TextIO) -> tuple[list, Rendering | None]:
    """The training rows: from the feature cache, or rendered from --data with the target's
    tokenizer, with that rendering (read back from the run folder's rows.cache when an earlier
    start rendered the same files the same way; `Rendering.keep` stores a new one there)."""
    if supply.cache is not None:
        samples, stats = supply.cache.training_samples(config.data.max_seq_len, config.data.min_supervised_tokens)
        print(stats.summary(), file=log)
        from ..data.readers import FROM_TOKEN_IDS

        if config.data.token_ids == "ignore" and stats.answers.get(FROM_TOKEN_IDS):
            raise ConfigError(f"--token-ids ignore: the feature cache {config.data.features} rendered "
                              f"{stats.answers[FROM_TOKEN_IDS]} answers from their generated token ids; make one with "
                              "`dflash-train cache-features --token-ids ignore` to train on the re-tokenized text")
        if not samples:
            raise ConfigError(f"no usable training rows in the feature cache {config.data.features} {stats.why_none_used()}")
        return samples, None
    from ..data.rows_cache import CACHE_NAME, cached_training_samples

    tokenizer = supply.first.tokenizer
    if tokenizer is None:
        raise ConfigError(f"{config.model.target}: no tokenizer next to the model; it is needed to render --data")
    rendering = cached_training_samples(
        Path(config.checkpoint.out), config.data.data, tokenizer, max_length=config.data.max_seq_len,
        min_supervised_tokens=config.data.min_supervised_tokens, enable_thinking=THINKING[config.data.thinking],
        token_ids=config.data.token_ids,
    )
    samples, stats = rendering.rows, rendering.stats
    if rendering.read_back:
        print(f"rows: read back from {Path(config.checkpoint.out) / CACHE_NAME} (rendered by an earlier start)", file=log)
    print(stats.summary(), file=log)
    if not samples:
        raise ConfigError(f"no usable training rows in {', '.join(config.data.data)} {stats.why_none_used()}")
    return samples, rendering


def check_batch_size(config: TrainConfig, samples: Sequence[Any]) -> None:
    if len(samples) < config.optimizer.batch_size:
        source = f"the feature cache {config.data.features}" if config.data.features else ", ".join(config.data.data) or "the given samples"
        raise ConfigError(f"--batch-size {config.optimizer.batch_size} is more than the {len(samples)} usable rows of {source}: "
                          f"pass --batch-size {len(samples)} or less, or more data")
