"""`dflash-train regenerate`: the target answers prompts (resumable) to make training data.

The answers come from the target loaded here or, with --endpoint, from an OpenAI-compatible
server (vLLM, SGLang, llama.cpp, `transformers serve`) running the target; no model is loaded
then, and --target only supplies the tokenizer for the prompt-length cap and the answers' token ids.
Ends with the `rows: read=N used=M skipped=K` accounting of its input."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import MAX_SECONDS, THINKING, ConfigError, Section, SectionedConfig, option
from ..files import check_outside_inputs, hold_output
from ._common import check_target_flags, load_target_for

if TYPE_CHECKING:
    from ..data.readers import Prompt, RowStats

SPLIT_CHOICES = ("auto", "train", "dev", "all")


@dataclasses.dataclass(frozen=True)
class InputSettings(Section):
    """What is answered: the prompts, and the target whose templates render them."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file (with --endpoint: only its tokenizer, "
                             "for --max-prompt-tokens and to keep the server's answer token ids; optional)")
    prompts: str = option("", "prompt file (.jsonl/.json/.parquet/.txt, optionally .gz; chats ending with an answer "
                              "have it replaced) or 'default' (~114k built-in prompts: OpenAI evals registry, coding "
                              "prompts; decontaminated against the benchmarks; see `dflash-train prompts`)")
    split: str = option("auto", "which prompts: train, dev (1 in 100, held out), all; auto = train for --prompts default, "
                                "all for a file")
    limit: int = option(0, "use only the first N prompts (0 = all)", at_least=0)
    thinking: str = option("auto", "thinking templates (Qwen3): auto (template default), on or off")
    max_prompt_tokens: int = option(0, "skip longer prompts; 0 = the target's context minus max_new_tokens "
                                       "(with --endpoint: no cap unless set, and it needs --target)", at_least=0)


@dataclasses.dataclass(frozen=True)
class OutputSettings(Section):
    """Where the answers go, and how often they are made durable."""

    out: str = option("", "output .jsonl of training rows; an existing one is resumed (rows already there are kept)")
    flush_seconds: float = option(1.0, "write finished rows (fsync'ed) at most this often; a kill loses at most the "
                                       "rows of the last interval, which a rerun answers again", at_least=0, at_most=MAX_SECONDS)


@dataclasses.dataclass(frozen=True)
class AnswerSettings(Section):
    """How each answer is decoded (the same for a target loaded here and for a server)."""

    max_new_tokens: int = option(1024, "answer length cap; a capped answer gets finish_reason 'length'", at_least=1)
    temperature: float = option(0.0, "0 = greedy; > 0 samples (each row from its own seed)", at_least=0)
    top_p: float = option(1.0, "nucleus sampling mass (with temperature > 0)", above=0, at_most=1)
    seed: int = option(0, "sampling seed (also picks and orders the default prompts)", at_least=0)


@dataclasses.dataclass(frozen=True)
class LocalSettings(Section):
    """The target loaded here (without --endpoint)."""

    batch_size: int = option(0, "prompts decoded at once (the static generator's slots); 0 = 1024 on CUDA (fewer "
                                "where the caches do not fit; 64 for targets on the eager fallback), 8 on CPU", at_least=0)
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")
    dtype: str = option("auto", "target weights: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")


@dataclasses.dataclass(frozen=True)
class ServerSettings(Section):
    """An OpenAI-compatible server that answers in the target's place (--endpoint)."""

    endpoint: str = option("", "answer with an OpenAI-compatible server at this URL (e.g. http://localhost:8000/v1) "
                               "instead of loading the target")
    model: str = option("", "with --endpoint: the served model's name (default: the server's first /v1/models entry)")
    concurrency: int = option(16, "with --endpoint: requests in flight at once", at_least=1)
    request_timeout: float = option(600.0, "with --endpoint: seconds one request may take before it is retried", above=0, at_most=MAX_SECONDS)
    retries: int = option(5, "with --endpoint: retries of a request after a connection error, timeout, 429 or 5xx "
                             "(exponential backoff from 1 s)", at_least=0)


@dataclasses.dataclass(frozen=True, init=False)
class RegenerateConfig(SectionedConfig):
    """Let the target write the answers to a set of prompts (training data in its own words).

    Flags and flat file keys (`seed = 1`) or `[section]` tables (`[generation]` / `seed = 1`);
    Python callers pass flat keywords (`RegenerateConfig(prompts=..., out=...)`). Its sections
    check their numbers where they are made; `validate()` (run by the CLI and by `checked`)
    checks the rules across them."""

    input: InputSettings
    output: OutputSettings
    generation: AnswerSettings
    local: LocalSettings
    server: ServerSettings

    def validate(self) -> None:
        if self.server.endpoint:
            from ..generate.endpoint import api_base

            api_base(self.server.endpoint)
            if not self.output.out:
                raise ConfigError("no output: pass --out")
            if self.input.thinking not in THINKING:
                raise ConfigError(f"thinking {self.input.thinking!r}: use auto (the template's default), on or off")
            if self.local.batch_size:
                raise ConfigError("--batch-size is for a target loaded here; with --endpoint the server batches "
                                  "(set --concurrency)")
            if self.input.max_prompt_tokens and not self.input.target:
                raise ConfigError("--max-prompt-tokens with --endpoint needs --target (its tokenizer counts the prompt)")
        else:
            check_target_flags(self.input.target, self.output.out, self.input.thinking, self.local.dtype)
            if self.server.model:
                raise ConfigError("--model names a served model: use it with --endpoint")
        if not self.input.prompts:
            raise ConfigError("no prompts: pass --prompts FILE or --prompts default")
        if not self.output.out.endswith(".jsonl"):
            raise ConfigError(f"--out {self.output.out}: use a .jsonl file (it is appended to, and resumed)")
        if self.input.split not in SPLIT_CHOICES:
            raise ConfigError(f"--split {self.input.split!r}: use {', '.join(SPLIT_CHOICES)}")
        if not self.server.endpoint:  # with --endpoint, --target may be a folder holding only the tokenizer
            from ..generate.regenerate import prompt_token_limit
            from ..target.model import check_target_path, check_tokenizer_beside, declared_context

            check_target_path(self.input.target, "--target")
            check_tokenizer_beside(self.input.target, "--target", "render the prompts")
            prompt_token_limit(declared_context(self.input.target), self.generation.max_new_tokens,
                               self.input.max_prompt_tokens)  # before the target loads
        inputs = [self.input.target, *([self.input.prompts] if self.input.prompts != "default" else [])]
        check_outside_inputs(self.output.out, "--out", inputs)


def read_input_prompts(config: RegenerateConfig) -> tuple[list[Prompt], RowStats]:
    """The prompts to answer (split, then limit) and the RowStats that counts them as read."""
    from ..data.prompts.sets import PromptSetSettings
    from ..data.readers import RowStats, read_prompts
    from ._common import default_prompt_set

    stats = RowStats()
    if config.input.prompts == "default":
        split = "train" if config.input.split == "auto" else config.input.split
        prompt_set = default_prompt_set(PromptSetSettings(seed=config.generation.seed))
        prompts = prompt_set.split(split)[: config.input.limit or None]
        print(prompt_set.summary(prompts, split))
        stats.count_read(len(prompts))
        return prompts, stats
    rows = read_prompts(config.input.prompts, stats)
    if config.input.split not in ("auto", "all"):
        rows = _in_split(rows, config.input.split, stats)
    prompts = list(itertools.islice(rows, config.input.limit) if config.input.limit else rows)
    if not prompts:  # an empty answers file and exit 0 would hide the mistake; the target is not loaded yet
        print(stats.summary())
        raise ConfigError(f"--prompts {config.input.prompts}: no prompt to answer in it {stats.why_none_used()}")
    return prompts, stats


def _in_split(rows, split: str, stats):
    from ..data.prompts.sets import select_split

    for prompt in rows:
        if select_split([prompt], split):
            yield prompt
        else:
            stats.skip(f"not in the {split} split", prompt.source)


def run_regenerate(config: RegenerateConfig) -> int:
    with hold_output(config.output.out, "--out"):  # two runs appending to one file would answer every prompt twice
        return _run_regenerate(config)


def _run_regenerate(config: RegenerateConfig) -> int:
    from ..generate.regenerate import GenerationSettings, check_output, output_record, regenerate
    from ..target.model import resolve_device

    answers = config.generation
    settings = GenerationSettings(
        max_new_tokens=answers.max_new_tokens, temperature=answers.temperature, top_p=answers.top_p,
        seed=answers.seed, enable_thinking=THINKING[config.input.thinking],
    )
    if config.server.endpoint:
        return run_regenerate_endpoint(config, settings)
    device = resolve_device(config.local.device)
    target_name = str(Path(config.input.target).resolve())
    check_output(Path(config.output.out), output_record(target_name, settings))  # refuse early, before loading anything
    prompts, stats = read_input_prompts(config)
    engine, tokenizer, max_prompt_tokens, record_extra = _local_engine(config, device, settings)
    report = regenerate(
        prompts, config.output.out, engine=engine, stats=stats, settings=settings, target_name=target_name,
        tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens, record_extra=record_extra,
        flush_seconds=config.output.flush_seconds,
    )
    print(report.summary())
    return 0


def run_regenerate_endpoint(config: RegenerateConfig, settings) -> int:
    """The same driver with a server as the engine: the server and model take the target's
    place in the settings sidecar, so resuming against another server or model is refused like
    resuming with another target."""
    from ..generate.endpoint import SAMPLER, EndpointClient, EndpointEngine, RetryPolicy, resolve_model
    from ..generate.regenerate import check_output, output_record, regenerate

    client = EndpointClient(config.server.endpoint, timeout=config.server.request_timeout,
                            retry=RetryPolicy(retries=config.server.retries))
    model, server = resolve_model(client, config.server.model)
    target_name = f"{model} @ {client.base}"
    record_extra = {"endpoint": {"url": client.base, "model": model}}
    if not settings.greedy:
        record_extra["sampler"] = SAMPLER
    check_output(Path(config.output.out), {**output_record(target_name, settings), **record_extra})  # before building prompts
    tokenizer = load_tokenizer(config.input.target) if config.input.target else None
    prompts, stats = read_input_prompts(config)
    engine = EndpointEngine(
        client, model, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
        enable_thinking=settings.enable_thinking, concurrency=config.server.concurrency, server=server,
    )
    report = regenerate(
        prompts, config.output.out, engine=engine, stats=stats, settings=settings, target_name=target_name,
        tokenizer=tokenizer, max_prompt_tokens=config.input.max_prompt_tokens or None, record_extra=record_extra,
        flush_seconds=config.output.flush_seconds,
    )
    print(report.summary())
    return 0


def load_tokenizer(target: str):
    """The target's tokenizer alone: from a Hugging Face folder, or read from a .gguf file's metadata."""
    from transformers import AutoTokenizer

    path = Path(target).resolve()
    if not path.exists():
        raise ConfigError(f"--target {target}: no such file or folder")
    print(f"loading the tokenizer of {path}")
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--target {path}: cannot read its tokenizer ({error})") from None


def _local_engine(config: RegenerateConfig, device: Any, settings: Any) -> tuple[Any, Any, int | None, dict[str, Any]]:
    """The target loaded here and its engine (generate/engine.py): (engine, tokenizer for
    rendering, prompt token cap, what the settings sidecar records besides the settings)."""
    from ..data.render import stop_token_ids
    from ..generate.engine import local_engine
    from ..generate.regenerate import prompt_token_limit

    target = load_target_for(config.input.target, device, config.local.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"{target.path}: no tokenizer next to the model; it is needed to render the prompts")
    context = int(getattr(target.model.config, "max_position_embeddings", 0) or 0)
    max_prompt_tokens = prompt_token_limit(context, settings.max_new_tokens, config.input.max_prompt_tokens)
    engine = local_engine(target, settings, batch_size=config.local.batch_size, max_prompt_tokens=max_prompt_tokens)
    return engine, target.tokenizer, max_prompt_tokens, {"stop_token_ids": stop_token_ids(target.model, target.tokenizer)}
