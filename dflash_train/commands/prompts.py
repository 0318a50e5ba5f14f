"""`dflash-train prompts`: build (or read from the cache) the default prompt set, print what it
holds per source and what decontamination dropped, and optionally write one split as a prompt
file that `regenerate --prompts FILE` (or anything else) can use."""

from __future__ import annotations

import contextlib
import dataclasses

from ..config import ConfigError, option
from ..data.prompts.sets import SPLITS
from ..files import NewFileOutput, check_new_output


@dataclasses.dataclass
class PromptsConfig:
    """Build the default training prompts (decontaminated against the benchmarks) and inspect or export them."""

    out: str = option("", "write the prompts as a .jsonl file ({id, source, messages} rows); never overwrites a file")
    split: str = option("train", "train, dev (1 in 100 prompts, held out for choosing recipes) or all")
    limit: int = option(0, "write only the first N prompts of the split (0 = all)", at_least=0)
    seed: int = option(0, "picks the registry rows and orders the set (regenerate --seed uses the same)", at_least=0)
    max_per_file: int = option(2000, "at most this many prompts from one registry file", at_least=1)
    max_short_per_file: int = option(1000, "of which at most this many asking for a short answer", at_least=1)
    max_per_task: int = option(5000, "at most this many prompts from one registry task (folder)", at_least=1)

    def validate(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"--split {self.split!r}: use {', '.join(SPLITS)}")
        if self.out and not self.out.endswith(".jsonl"):
            raise ConfigError(f"--out {self.out}: use a .jsonl file")
        if self.out:
            check_new_output(self.out, "--out")


def run_prompts(config: PromptsConfig) -> int:
    with NewFileOutput(config.out, "--out") if config.out else contextlib.nullcontext() as output:
        return _run_prompts(config, output)


def _run_prompts(config: PromptsConfig, output: NewFileOutput | None) -> int:
    from ..data.prompts.sets import PromptSetSettings
    from ._common import default_prompt_set, prompt_file_bytes

    prompt_set = default_prompt_set(PromptSetSettings(
        seed=config.seed, max_per_file=config.max_per_file, max_short_per_file=config.max_short_per_file,
        max_per_task=config.max_per_task,
    ))
    taken = prompt_set.split(config.split)[: config.limit or None]
    print(prompt_set.summary(taken, config.split))
    print(prompt_set.stats.summary())
    if output is not None:
        written = output.write(prompt_file_bytes(taken, lambda p: prompt_set.source_of[p.id]))
        print(f"wrote {len(taken)} {config.split} prompts to {written}")
    return 0
