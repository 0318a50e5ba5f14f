"""`dflash-train self-prompts`: the target writes user requests itself (generate/self_prompts.py), kept
when they end properly, look like text, are new and overlap no benchmark; written as a prompts
.jsonl ({id, source, messages}) that `regenerate --prompts FILE` answers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ConfigError, option
from ..data.prompts.sets import SPLITS
from ..files import NewFileOutput, check_new_output
from ..generate.self_prompts import SelfPromptSettings
from ._common import check_target_flags, load_target_for

DEFAULTS = SelfPromptSettings(count=1)  # the flags' defaults are the settings' own (light imports: no torch)


@dataclasses.dataclass
class SelfPromptsConfig:
    """Sample open chat prompts from the target's own chat template (the Magpie technique)."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file (a chat model: its template's "
                             "user turn is what it continues)")
    count: int | None = option(None, "requests to keep (sampled in rounds until reached); required", at_least=1)
    out: str = option("", "the prompts .jsonl to write ({id, source, messages} rows); never overwrites a file")
    split: str = option("train", "keep requests of the train split, the dev split (1 in 100 texts, the rule of "
                                 "`dflash-train prompts`) or all")
    seed: int = option(0, "sampling seed: request n is drawn from its own seed (seed, n), whatever the batch", at_least=0)
    temperature: float = option(DEFAULTS.temperature, "sampling temperature (> 0)", above=0)
    top_p: float = option(DEFAULTS.top_p, "nucleus sampling mass", above=0, at_most=1)
    max_new_tokens: int = option(DEFAULTS.max_new_tokens, "length cap of a request; a request cut by it is dropped", at_least=1)
    batch_size: int = option(0, "requests decoded at once (as `regenerate --batch-size`; 0 = the device's default)", at_least=0)
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")
    dtype: str = option("auto", "target weights: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")

    def settings(self) -> SelfPromptSettings:
        return SelfPromptSettings(count=self.count, seed=self.seed, temperature=self.temperature, top_p=self.top_p,
                                  max_new_tokens=self.max_new_tokens, split=self.split)

    def validate(self) -> None:
        if self.count is None:
            raise ConfigError("--count is required: how many requests to keep")
        check_target_flags(self.target, self.out, "auto", self.dtype)
        if not Path(self.target).exists():
            raise ConfigError(f"--target {self.target}: no such file or folder")
        if not self.out.endswith(".jsonl"):
            raise ConfigError(f"--out {self.out}: use a .jsonl file")
        check_new_output(self.out, "--out", [self.target])
        if self.split not in SPLITS:
            raise ConfigError(f"--split {self.split!r}: use {', '.join(SPLITS)}")
        self.settings().validate()


def run_self_prompts(config: SelfPromptsConfig) -> int:
    with NewFileOutput(config.out, "--out") as output:
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
    target = load_target_for(config.target, resolve_device(config.device), config.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"{target.path}: no tokenizer next to the model; its chat template is what it continues")
    prefix_tokens = len(target.tokenizer(user_request_prefix(target.tokenizer), add_special_tokens=False)["input_ids"])
    generation = GenerationSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                    top_p=settings.top_p, seed=settings.seed)
    engine = local_engine(target, generation, batch_size=config.batch_size, max_prompt_tokens=prefix_tokens)
    report = sample_requests(engine, target.tokenizer, settings, benchmarks)
    written = output.write(prompt_file_bytes(report.kept, lambda _: SOURCE)) if report.kept else None
    print(report.summary(str(written or "")))
    if report.short:
        kept = f"the {len(report.kept)} kept are in {written}" if written else "nothing was written"
        raise RunFailed(f"only {len(report.kept)} of {config.count} requests kept ({report.short}); {kept}")
    print(f"wrote {len(report.kept)} self-written {config.split} prompts to {written}")
    return 0
