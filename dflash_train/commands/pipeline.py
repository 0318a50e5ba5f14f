"""`dflash-train pipeline`: from a target to a served drafter in one command, by a recipe.

prompts -> self-prompts (if the recipe has them) -> regenerate -> features (if the recipe caches
them) -> train -> export -> export-gguf (if the target is a GGUF file) -> eval, each stage one
product command on the work folder (`_stages.py`), each resumable: run the same command again
after a stop and it continues. The stages' settings, rows and seconds are kept in
WORK/stages.json; another recipe or target for a started stage is refused, naming the setting.
Ends with one screen: when the drafter was ready, tau, speed-up, and the commands that serve the
drafter with llama.cpp, vLLM and SGLang.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

from ..config import ARCHS, ConfigError, check_choices, option
from ..export.rules import ARCHITECTURE
from ..files import check_outside_inputs
from ..progress import format_seconds
from ..recipe import Recipe, builtin_recipes, load_recipe
from ._stages import (EXPORTS, STAGES, Interrupted, StageBook, Work, check_recipe_inputs, check_benchmarks,
                      check_decontamination, check_work_folder, plan, run_stages, say)
from ._warm_ahead import CHOICES as WARM_AHEAD_CHOICES


@dataclasses.dataclass
class PipelineConfig:
    """Train, measure and export a drafter for a target, stage by stage, by a recipe."""

    target: str = option("", "target model: a Hugging Face folder or a .gguf file")
    recipe: str = option("", f"a built-in recipe ({', '.join(builtin_recipes())}) or a recipe .toml file")
    out: str = option("", "work folder: prompts, answers, run, results, drafter, stages.json (new, or an earlier "
                          "pipeline's to continue it)")
    stages: list[str] = option([], f"run only these stages (comma-separated, run in pipeline order): "
                                   f"{', '.join(STAGES)}; default: every stage the recipe has")
    device: str = option("auto", "auto (cuda:0 if present, else cpu), cpu or cuda:N")
    data: str = option("", "train on these answers (a `regenerate` .jsonl made before, e.g. with --endpoint) instead "
                           "of the prompts, self-prompts and regenerate stages; never written to")
    arch: str = option("", "the drafter, in place of the recipe's [train] arch: dflash or dflash2 (default: the "
                           "recipe's)", choices=("", *ARCHS))
    warm_ahead: str = option("auto", "compile and capture the train stage's step in a second process while the "
                                     "target regenerates, so training starts sooner: auto (on a CUDA device, for a "
                                     "target whose weights take at most 1/16 of its memory), on, off",
                             choices=WARM_AHEAD_CHOICES)

    def overrides(self) -> dict[str, dict[str, str]]:
        """What the flags change in the recipe."""
        return {"train": {"arch": self.arch}} if self.arch else {}

    def validate(self) -> None:
        if not self.target:
            raise ConfigError("no target: pass --target DIR (a Hugging Face folder or a .gguf file)")
        from ..target.model import check_target_path

        check_target_path(self.target, "--target")
        if not self.recipe:
            raise ConfigError(f"no recipe: pass --recipe NAME ({', '.join(builtin_recipes())}) or --recipe FILE.toml")
        if not self.out:
            raise ConfigError("no output: pass --out WORK_DIR")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"--stages {unknown[0]!r}: use some of {', '.join(STAGES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError(f"--stages {','.join(self.stages)}: a stage is named twice")
        if self.data and not Path(self.data).is_file():
            raise ConfigError(f"--data {self.data}: no such file")
        if self.data and not self.data.endswith(".jsonl"):
            raise ConfigError(f"--data {self.data}: not a .jsonl file (the answers `regenerate` writes)")
        if self.data:
            Path(self.data).open("rb").close()  # unreadable: the OS error names it now, not after the target loads
        check_work_folder(Path(self.out))
        check_outside_inputs(self.out, "--out", [self.target, self.data])
        check_choices(self)
        load_recipe(self.recipe, self.overrides())  # every key checked now, before any model loads


def run_pipeline(config: PipelineConfig) -> int:
    recipe = load_recipe(config.recipe, config.overrides())
    if config.arch:  # the start line and the summary say what the flag changed
        recipe = dataclasses.replace(recipe, name=f"{recipe.name} with --arch {config.arch}")
    return run_recipe(recipe, config.target, Path(config.out), config.stages, config.device,
                      "dflash-train pipeline", answers=config.data, warm_ahead=config.warm_ahead)


def run_recipe(recipe: Recipe, target: str | Callable[[], Path], folder: Path, requested: list[str], device: str,
               command: str, footer: list[str] = (), answers: str = "", warm_ahead: str = "auto") -> int:
    """Plan and check everything (no model loaded), run the stages (`requested` by name, or every
    stage the run has when empty), print the summary screen; one live process per work folder
    (its stages resume what they find). `target` may be a function that finds it (quickstart's
    conversion), called once the folder is held."""
    from ..files import hold_output
    from ..target.model import resolve_device

    resolve_device(device)  # a GPU that is not here is refused now, not after the prompts stage
    with hold_output(folder, "--out"):
        if callable(target):
            target = str(target())
        return _run_recipe(recipe, target, folder, requested, device, command, footer, answers, warm_ahead)


def _run_recipe(recipe: Recipe, target: str, folder: Path, requested: list[str], device: str, command: str,
                footer: list[str], answers: str, warm_ahead: str) -> int:
    from ..target.model import check_layer_ids_fit
    from ..train.layout import resolve_layout

    check_work_folder(folder)
    work = Work(recipe, str(Path(target).resolve()), folder, device, str(Path(answers).resolve()) if answers else "")
    book = StageBook(folder)
    stages = plan(work, book, requested)
    train_config = work.train_config()
    check_layer_ids_fit(train_config.model.target_layer_ids, work.target)  # not after minutes of regenerating
    if "train" in stages:
        try:  # its devices and attention backend (e.g. flash's package), the same way
            resolve_layout(train_config)
        except ConfigError as error:
            raise ConfigError(f"recipe {recipe.name}: [train] {error}") from None
    if "eval" in stages:
        check_benchmarks(recipe)
    check_decontamination(work, stages)
    check_recipe_inputs(work, stages)
    folder.mkdir(parents=True, exist_ok=True)
    say(f"recipe {recipe.titled}; stages {', '.join(stages)}; work folder {folder}")
    started = time.monotonic()
    try:
        run_stages(work, book, stages, warm_ahead)
    except Interrupted as stop:
        say(f"{stop}; run the same command again to continue")
        return stop.exit_code
    except KeyboardInterrupt:  # regenerate has flushed its rows, the feature cache its shards
        say("stopped by Ctrl-C; run the same command again to continue")
        return 130
    print(summary_screen(work, book, command, time.monotonic() - started, footer))
    return 0


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _number(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def summary_screen(work: Work, book: StageBook, command: str, elapsed: float, footer: list[str] = ()) -> str:
    """One screen: what each stage made and took, tau, speed-up, the serve commands."""
    times = ", ".join(f"{stage} {format_seconds(book.entry(stage)['seconds'])}" for stage in STAGES
                      if book.entry(stage).get("done"))
    lines = ["=" * 96, f"{command} finished in {format_seconds(elapsed)}" + (f" (stages over all runs: {times})" if times else "")]
    exports = [stage for stage in EXPORTS if book.done(stage)]
    if exports:
        before_eval = sum(book.entry(stage)["seconds"] for stage in STAGES[: STAGES.index("eval")] if book.done(stage))
        lines.append(f"  ready       the drafter after {format_seconds(before_eval)} (stages up to {exports[-1]}, over all runs)"
                     + (f"; eval {format_seconds(book.entry('eval')['seconds'])} more" if book.done("eval") else ""))
    lines += [f"  recipe      {work.recipe.titled}",
              f"  target      {work.target}"]
    if work.answers:
        lines.append(f"  data        the answers given: {work.data}")
    elif book.done("regenerate"):
        lines.append(f"  data        {book.entry('regenerate')['rows']} answers written by the target itself -> {work.data}")
    trained = _read(work.folder / "train.json")
    if trained:
        lines.append(f"  training    {trained['steps_done']} steps on {trained['samples']} rows: loss "
                     f"{_number(trained['first_loss'])} -> {_number(trained['loss'])}, accuracy "
                     f"{_number(trained['accuracy'], 3)}, simulated tau {_number(trained['tau_sim'])}")
    tau, speed = _read(work.eval_json), _read(work.speed_json) or _read(work.eval_json)
    if tau:
        for name, bench in tau["benchmarks"].items():
            s = bench["summary"]
            speedup = s.get("speedup") if speed is tau else None
            lines.append(f"  {name:<11} tau {_number(s['tau_mean'])} (median {_number(s['tau_median'])}, pooled "
                         f"{_number(s['tau_pooled'])}) on {s['prompts']} prompts"
                         + (f", speed-up {speedup:.2f}x" if speedup else ""))
    if speed and speed is not tau:
        for name, bench in speed["benchmarks"].items():
            s = bench["summary"]
            lines.append(f"  speed-up    {name}: {_number(s.get('speedup'), suffix='x')} on {s['prompts']} prompts "
                         f"({_number(s.get('tokens_per_s'), 1)} vs {_number(s.get('baseline_tokens_per_s'), 1)} tok/s, "
                         f"{speed['config']['decoder']} decoder, batch 1; greedy identical "
                         f"{s.get('identical_to_baseline')}/{s.get('compared')})")
    if (work.folder / "training_curve.png").is_file():
        lines.append(f"  curve       {work.folder / 'training_curve.png'}")
    drafter = work.drafter if book.done("export") else work.run / "export"
    exported = _read(drafter / "config.json")
    if exported:
        architecture = (exported.get("architectures") or [ARCHITECTURE])[0]
        lines.append(f"  drafter     {drafter}  (Hugging Face folder; dflash.{architecture}.from_pretrained loads it)")
        lines += serve_commands(work.target, work.run, drafter, work.drafter_gguf if book.done("export-gguf") else None)
    return "\n".join([*lines, *footer, "=" * 96])


def serve_commands(target: str, run: Path, drafter: Path, drafter_gguf: Path | None) -> list[str]:
    """How llama.cpp, vLLM and SGLang serve `drafter` with `target` (block size B from its config);
    llama.cpp loads `drafter_gguf` (the export-gguf stage's, when the target is a GGUF file)."""
    block = int(json.loads((drafter / "config.json").read_text()).get("block_size", 16))
    target_path = Path(target)
    hf_target = target
    if target_path.suffix == ".gguf":
        from ..target.gguf import hf_folder_from_gguf

        hf_target = str(hf_folder_from_gguf(target_path))
    gguf_target = target if target_path.suffix == ".gguf" else "TARGET.gguf"
    lines = [f"serve it (B = {block}: the engines draft B - 1 = {block - 1} tokens after the anchor):"]
    if drafter_gguf is None:
        drafter_gguf = Path("drafter.gguf")
        lines.append(f"  llama.cpp  dflash-train export {run} --format gguf --target {gguf_target} "
                     f"--out {drafter_gguf}   (TARGET.gguf: the target's GGUF file)")
        prefix = "             "
    else:
        prefix = "  llama.cpp  "
    lines += [f"{prefix}llama-server -m {gguf_target} -md {drafter_gguf} --spec-type draft-dflash "
              f"--spec-draft-n-max {block - 1}",
              f"  vLLM       vllm serve {hf_target} --speculative-config "
              f"'{{\"method\": \"dflash\", \"model\": \"{drafter}\", \"num_speculative_tokens\": {block - 1}}}'",
              f"  SGLang     python3 -m sglang.launch_server --model-path {hf_target} --speculative-algorithm DFLASH "
              f"--speculative-draft-model-path {drafter} --speculative-num-draft-tokens {block}"]
    return lines
