"""`dflash-train self-prompts`: the target writes user requests itself (generate/self_prompts.py), kept
when they end properly, look like text, are new and overlap no benchmark; written as a prompts
.jsonl ({id, source, messages}) that `regenerate --prompts FILE` answers."""

from __future__ import annotations

import dataclasses

from ..config import ConfigError, Section, SectionedConfig, option
from ..data.prompts.sets import SPLITS
from ..files import NewFileOutput, check_new_output
from ..generate.self_prompts import SelfPromptSettings
from ._common import check_target_flags, load_target_for

DEFAULTS = SelfPromptSettings(count=1)  # the flags' defaults are the settings' own (light imports: no torch)


@dataclasses.dataclass(frozen=True)
class InputSettings(Section):
    """The target whose chat template is continued."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file (a chat model: its template's "
                             "user turn is what it continues)")


@dataclasses.dataclass(frozen=True)
class OutputSettings(Section):
    """Which requests are kept, and where they are written."""

    count: int | None = option(None, "requests to keep (sampled in rounds until reached; each round holds its "
                                     "candidates in memory, so at most 1,000,000: run again with another --seed "
                                     "for more); required", at_least=1, at_most=1_000_000)
    out: str = option("", "the prompts .jsonl to write ({id, source, messages} rows); never overwrites a file")
    split: str = option("train", "keep requests of the train split, the dev split (1 in 100 texts, the rule of "
                                 "`dflash-train prompts`) or all")


@dataclasses.dataclass(frozen=True)
class RequestSettings(Section):
    """How each request is sampled."""

    seed: int = option(0, "sampling seed: request n is drawn from its own seed (seed, n), whatever the batch", at_least=0)
    temperature: float = option(DEFAULTS.temperature, "sampling temperature (> 0)", above=0)
    top_p: float = option(DEFAULTS.top_p, "nucleus sampling mass", above=0, at_most=1)
    max_new_tokens: int = option(DEFAULTS.max_new_tokens, "length cap of a request; a request cut by it is dropped", at_least=1)


@dataclasses.dataclass(frozen=True)
class LocalSettings(Section):
    """The target loaded here: where, in which dtype, how many requests at once."""

    batch_size: int = option(0, "requests decoded at once (as `regenerate --batch-size`; 0 = the device's default)", at_least=0)
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")
    dtype: str = option("auto", "target weights: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")


@dataclasses.dataclass(frozen=True, init=False)
class SelfPromptsConfig(SectionedConfig):
    """Sample open chat prompts from the target's own chat template (the Magpie technique).

    Flags and flat file keys (`seed = 1`) or `[section]` tables (`[generation]` / `seed = 1`);
    Python callers pass flat keywords. `validate()` (run by the CLI and by `checked`) checks the
    rules across the sections."""

    input: InputSettings
    output: OutputSettings
    generation: RequestSettings
    local: LocalSettings

    def settings(self) -> SelfPromptSettings:
        sampling = self.generation
        return SelfPromptSettings(count=self.output.count, split=self.output.split, seed=sampling.seed,
                                  temperature=sampling.temperature, top_p=sampling.top_p,
                                  max_new_tokens=sampling.max_new_tokens)

    def validate(self) -> None:
        if self.output.count is None:
            raise ConfigError("--count is required: how many requests to keep")
        check_target_flags(self.input.target, self.output.out, "auto", self.local.dtype)
        if not self.output.out.endswith(".jsonl"):
            raise ConfigError(f"--out {self.output.out}: use a .jsonl file")
        from ..generate.regenerate import prompt_token_limit
        from ..target.model import check_target_path, check_tokenizer_beside, declared_context

        check_target_path(self.input.target, "--target")
        check_tokenizer_beside(self.input.target, "--target", "open a user turn with its chat template")
        prompt_token_limit(declared_context(self.input.target), self.generation.max_new_tokens)  # before the target loads
        check_new_output(self.output.out, "--out", [self.input.target])
        if self.output.split not in SPLITS:
            raise ConfigError(f"--split {self.output.split!r}: use {', '.join(SPLITS)}")
        self.settings().validate()


def run_self_prompts(config: SelfPromptsConfig) -> int:
    with NewFileOutput(config.output.out, "--out") as output:
        return _run_self_prompts(config, output)


def _run_self_prompts(config: SelfPromptsConfig, output: NewFileOutput) -> int:
    from ..errors import RunFailed
    from ..generate.engine import local_engine
    from ..generate.regenerate import GenerationSettings
    from ..generate.self_prompts import SOURCE, sample_requests, user_request_prefix
    from ..target.model import resolve_device
    from ._common import benchmark_prompt_texts, prompt_file_bytes

    settings = config.settings()
    benchmarks = benchmark_prompt_texts()
    target = load_target_for(config.input.target, resolve_device(config.local.device), config.local.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"{target.path}: no tokenizer next to the model; its chat template is what it continues")
    prefix_tokens = len(target.tokenizer(user_request_prefix(target.tokenizer), add_special_tokens=False)["input_ids"])
    generation = GenerationSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                    top_p=settings.top_p, seed=settings.seed)
    engine = local_engine(target, generation, batch_size=config.local.batch_size, max_prompt_tokens=prefix_tokens)
    report = sample_requests(engine, target.tokenizer, settings, benchmarks)
    written = output.write(prompt_file_bytes(report.kept, lambda _: SOURCE)) if report.kept else None
    print(report.summary(str(written or "")))
    if report.short:
        kept = f"the {len(report.kept)} kept are in {written}" if written else "nothing was written"
        raise RunFailed(f"only {len(report.kept)} of {config.output.count} requests kept ({report.short}); {kept}")
    print(f"wrote {len(report.kept)} self-written {config.output.split} prompts to {written}")
    return 0
