"""The stages of `dflash-train pipeline` (and quickstart): each calls one product command's
function on the work folder, and `StageBook` (WORK/stages.json) records per stage the settings
it started with, whether it is done, its rows and its seconds.

A stage is resumable: it continues what a stop left (regenerate keeps the rows written, the
feature cache its shards, training its checkpoints) or redoes a step whose output is written
whole or not at all (a prompt file, an eval result). A stage that started with some settings
refuses others, naming the setting: its output would mix two recipes.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, UserError
from ..errors import RunFailed
from ..files import write_json_atomic
from ..progress import format_seconds
from ..recipe import Recipe

# In order. `export-gguf` (the drafter file llama.cpp serves) needs the target's GGUF: it runs
# where the target is one. The exports come before eval: the drafter is in the user's hands
# while it is still being measured, and a stop during eval loses no drafter.
STAGES = ("prompts", "self-prompts", "regenerate", "features", "train", "export", "export-gguf", "eval")
EXPORTS = ("export", "export-gguf")
AFTER_TRAIN = (*EXPORTS, "eval")  # each reads the training's checkpoint only, none another's output
BOOK = "stages.json"
BOOK_EVERY_SECONDS = 30.0  # a running stage's seconds are written this often: a killed run keeps them
DATA_STAGES = ("prompts", "self-prompts", "regenerate")  # what answers given with --data replace

# What each stage's output depends on, as recipe tables (a whole table) or "table.key": a stage
# started with some values refuses others. Each stage also depends on the target and on every
# earlier stage's inputs, since it reads their outputs.
_TRAIN_SHAPE = tuple(f"train.{key}" for key in ("max_seq_len", "min_supervised_tokens", "target_layer_ids",
                                                 "num_layers", "thinking"))
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "prompts": ("prompts", "self_prompts.count"),
    "self-prompts": ("self_prompts", "regenerate.batch_size"),
    "regenerate": ("regenerate",),
    "features": ("features", *_TRAIN_SHAPE),
    "train": ("train",),
    "eval": ("eval", "speed"),
    "export": ("export",),
    "export-gguf": (),
}


def stage_settings(work: Work, stage: str) -> dict[str, Any]:
    """The settings `stage` depends on: the target, the answers given (if any), and the inputs of
    it and of every earlier stage the run has, flat as `table.key`."""
    recipe = work.recipe
    train = recipe.train_config("target", "data.jsonl", "run")  # [train] values with the defaults filled in
    settings: dict[str, Any] = {"target": work.target}
    if work.answers:
        settings["data"] = work.answers
    for name in STAGES[: STAGES.index(stage) + 1]:
        if not work.applies(name) or (name in AFTER_TRAIN and name != stage and stage in AFTER_TRAIN):
            continue  # a stage the run does not have; an export or eval reads none of the others
        for item in STAGE_INPUTS[name]:
            table, _, key = item.partition(".")
            values = train.flat_values() if table == "train" else recipe.section_values(table)
            keys = [key] if key else (recipe.train if table == "train" else values)
            settings.update({f"{table}.{k}": values[k] for k in keys})
    return json.loads(json.dumps(settings))  # as the book reads it back


def _setting(settings: dict[str, Any], key: str) -> str:
    """A recorded setting as a message shows it; one the recipe leaves out has train's default."""
    return repr(settings[key]) if key in settings else "unset (the default)"


class StageBook:
    """WORK/stages.json: per stage its settings, done, rows, seconds (over all runs), and notes."""

    def __init__(self, work: Path):
        self.path = work / BOOK
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self._lock = threading.Lock()  # the stage clock's thread saves too

    def check(self, work: Work, stages: list[str]) -> None:
        """Refuse, before anything runs, a stage that started with other settings."""
        for stage in stages:
            recorded = self.data.get(stage, {}).get("settings")
            if recorded is None:
                continue
            wanted = stage_settings(work, stage)
            changed = [f"{key} {_setting(recorded, key)} then, {_setting(wanted, key)} now"
                       for key in sorted(set(recorded) | set(wanted)) if recorded.get(key) != wanted.get(key)]
            if changed:
                raise ConfigError(f"{self.path}: stage {stage} was started with other settings ({'; '.join(changed)}); "
                                  "use the same recipe and target, or another --out")

    def start(self, stage: str, settings: dict[str, Any]) -> dict[str, Any]:
        entry = self.data.setdefault(stage, {"settings": settings, "done": False, "seconds": 0.0, "runs": 0})
        entry["runs"] += 1
        self.save()
        return entry

    def forget(self, stage: str) -> None:
        """Drop the stage's record: it failed on its settings before making anything."""
        self.data.pop(stage, None)
        self.save()

    def done(self, stage: str) -> bool:
        return bool(self.data.get(stage, {}).get("done"))

    def entry(self, stage: str) -> dict[str, Any]:
        return self.data.get(stage, {})

    def save(self) -> None:
        with self._lock:
            write_json_atomic(self.path, self.data)


class StageClock:
    """Adds a running stage's seconds to its book entry every `every` seconds and at its end, so
    a run killed outright (SIGKILL, a machine taken back, a second Ctrl-C) leaves its time
    recorded to within `every` seconds instead of losing the whole run's."""

    def __init__(self, book: StageBook, entry: dict[str, Any], every: float = BOOK_EVERY_SECONDS):
        self.book, self.entry, self.every = book, entry, every
        self._before = float(entry["seconds"])
        self._started = time.monotonic()
        self._ended: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="stage-clock", daemon=True)

    @property
    def seconds(self) -> float:
        """This run's seconds so far."""
        return (self._ended or time.monotonic()) - self._started

    def __enter__(self) -> "StageClock":
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._done.set()
        self._thread.join()
        self._ended = time.monotonic()
        self._record()

    def _tick(self) -> None:
        while not self._done.wait(self.every):
            self._record()

    def _record(self) -> None:
        self.entry["seconds"] = round(self._before + self.seconds, 1)
        self.book.save()


@dataclasses.dataclass
class Work:
    """A pipeline run: the recipe, the target, the work folder and where each stage writes."""

    recipe: Recipe
    target: str
    folder: Path
    device: str = "auto"
    answers: str = ""  # answers made before (a regenerate .jsonl): no prompts, self-prompts or regenerate stage

    @property
    def train_prompts(self) -> Path:
        return self.folder / "prompts" / "train.jsonl"

    @property
    def self_prompts(self) -> Path:
        return self.folder / "prompts" / "self-written.jsonl"

    @property
    def mixed_prompts(self) -> Path:
        return self.folder / "prompts" / "mixed.jsonl"

    @property
    def answered_prompts(self) -> Path:
        """What regenerate answers: the source's prompts, or those mixed with self-written ones."""
        return self.mixed_prompts if self.recipe.self_prompts.count else self.train_prompts

    @property
    def data(self) -> Path:
        return Path(self.answers) if self.answers else self.folder / "data.jsonl"

    @property
    def features(self) -> Path:
        return self.folder / "features"

    @property
    def run(self) -> Path:
        return self.folder / "run"

    @property
    def eval_json(self) -> Path:
        return self.folder / "eval.json"

    @property
    def speed_json(self) -> Path:
        return self.folder / "speed.json"

    @property
    def drafter(self) -> Path:
        return self.folder / "drafter"

    @property
    def drafter_gguf(self) -> Path:
        return self.folder / "drafter.gguf"

    def applies(self, stage: str) -> bool:
        """Whether this run has the stage at all."""
        return self.without(stage) is None

    def without(self, stage: str) -> str | None:
        """Why this run has no `stage`, or None where it has it."""
        if stage in DATA_STAGES and self.answers:
            return "--data gives the answers"
        if stage == "self-prompts" and not self.recipe.self_prompts.count:
            return "the recipe's [self_prompts] count is 0"
        if stage == "features" and not self.recipe.features.cache:
            return "the recipe's [features] cache is false"
        if stage == "export-gguf" and not self.target.endswith(".gguf"):
            return "the target is not a .gguf file"
        return None

    def outputs(self, stage: str) -> list[Path]:
        """What `stage` leaves in the work folder for the stages after it and for the user."""
        return {
            "prompts": [self.train_prompts], "self-prompts": [self.self_prompts, self.mixed_prompts],
            "regenerate": [self.data], "features": [self.features], "train": [self.run], "export": [self.drafter],
            "export-gguf": [self.drafter_gguf],
            "eval": [self.eval_json, *([self.speed_json] if self.recipe.speed.bench else [])],
        }[stage]

    def train_config(self):
        features = str(self.features) if self.recipe.features.cache else ""
        return self.recipe.train_config(self.target, str(self.data), str(self.run), features=features,
                                        device=self.device)


def count_rows(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def _prompt_file(path: Path, prompts: list, source_of: Callable[[Any], str]) -> None:
    """A prompts file written whole or not at all; one already there (an earlier run wrote it
    and stopped before its record) is that same file."""
    from ._common import write_new_prompt_file

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_new_prompt_file(str(path), prompts, source_of)


def checked(config: Any) -> Any:
    """A command's config, validated as its flags would be."""
    config.validate()
    return config


def source_prompts(work: Work, split: str, limit: int) -> list:
    from .regenerate import RegenerateConfig, read_input_prompts

    prompts = work.recipe.prompts
    return read_input_prompts(RegenerateConfig(prompts=prompts.source, split=split, limit=limit, seed=prompts.seed))[0]


# -------------------------------------------------------------------------------------------
# The stages: each returns (rows, a note for the progress line); RunFailed when it cannot go on.
# -------------------------------------------------------------------------------------------


def stage_prompts(work: Work) -> tuple[int, str]:
    own, prompts = work.recipe.self_prompts.count, work.recipe.prompts
    wanted = prompts.count - own if prompts.count else 0
    if not work.train_prompts.exists():
        taken = source_prompts(work, "train", wanted) if wanted or not prompts.count else []
        _prompt_file(work.train_prompts, taken, lambda p: p.source)
    rows = count_rows(work.train_prompts)
    short = f" (all it has: {wanted} were asked for)" if wanted and rows < wanted else ""
    return rows, f"{rows} prompts of {prompts.source}{short} in {work.train_prompts}"


def stage_self_prompts(work: Work) -> tuple[int, str]:
    from ..data.prompts.sets import spread
    from ..data.readers import RowStats, read_prompts
    from .self_prompts import SelfPromptsConfig, run_self_prompts

    own, regenerate = work.recipe.self_prompts, work.recipe.regenerate
    if not work.self_prompts.exists():  # written whole at its end, or not at all
        run_self_prompts(checked(SelfPromptsConfig(
            target=work.target, count=own.count, out=str(work.self_prompts), seed=own.seed,
            max_new_tokens=own.max_new_tokens, batch_size=regenerate.batch_size, device=work.device)))
    base = list(read_prompts(str(work.train_prompts), RowStats()))
    written = list(read_prompts(str(work.self_prompts), RowStats()))
    _prompt_file(work.mixed_prompts, spread([base, written]), lambda p: p.source)
    return len(written), (f"{len(written)} requests written by the target, spread through {len(base)} prompts "
                          f"into {work.mixed_prompts}")


def stage_regenerate(work: Work) -> tuple[int, str]:
    from .regenerate import RegenerateConfig, run_regenerate

    settings = work.recipe.regenerate
    run_regenerate(checked(RegenerateConfig(
        target=work.target, prompts=str(work.answered_prompts), out=str(work.data), limit=work.recipe.prompts.count,
        max_new_tokens=settings.max_new_tokens, max_prompt_tokens=settings.max_prompt_tokens,
        batch_size=settings.batch_size, temperature=settings.temperature, seed=work.recipe.prompts.seed,
        dtype=settings.dtype, device=work.device,
    )))
    rows = count_rows(work.data)
    if not rows:  # nothing to train on: the settings that skipped every prompt must be changeable
        raise ConfigError(f"regenerate wrote no answers to {work.data}: every prompt was skipped (the counts above "
                          "say why); change the recipe's [regenerate] or [prompts] settings")
    return rows, f"{rows} answers written by the target in {work.data}"


def stage_features(work: Work) -> tuple[int, str]:
    from .cache_features import CacheFeaturesConfig, run_cache_features

    train = work.train_config()
    cache_json = work.features / "cache.json"
    if not (cache_json.is_file() and json.loads(cache_json.read_text()).get("complete")):
        run_cache_features(checked(CacheFeaturesConfig(
            target=work.target, data=[str(work.data)], out=str(work.features), max_seq_len=train.data.max_seq_len,
            min_supervised_tokens=train.data.min_supervised_tokens, target_layer_ids=list(train.model.target_layer_ids),
            num_layers=train.model.num_layers, thinking=train.data.thinking, dtype=work.recipe.features.dtype, device=work.device,
        )))
    rows = int(json.loads(cache_json.read_text()).get("samples", 0))
    return rows, f"target layers {list(train.model.target_layer_ids) or '(default)'} of {rows} conversations cached in {work.features}"


class Interrupted(Exception):
    """Training stopped by a signal after saving: the stage resumes on the next run."""

    def __init__(self, exit_code: int, why: str):
        super().__init__(why)
        self.exit_code = exit_code


def stage_train(work: Work) -> tuple[int, str]:
    from ..train.trainer import train
    from .train import exit_code

    config = work.train_config()
    summary = train(config)
    if summary.get("interrupted_by"):
        raise Interrupted(exit_code(summary), f"training stopped by {summary['interrupted_by']} after its checkpoint")
    drafter = summary["drafters"]["drafter"]
    if not drafter.get("export") and not (work.run / "export").is_dir():
        raise RunFailed(f"training of {work.run} ended without an export ({summary.get('stop_reason')})")
    plot_training_curve(work.run / "metrics.jsonl", work.folder / "training_curve.png")
    keep = {k: drafter.get(k) for k in ("first_loss", "loss", "accuracy", "tau_sim")}
    write_json_atomic(work.folder / "train.json", {"steps_done": summary["steps_done"]["drafter"],
                                                     "samples": summary["data"]["samples"], **keep})
    rows = int(summary["data"]["samples"])
    numbers = {k: float("nan") if v is None else v for k, v in keep.items()}
    return rows, (f"{summary['steps_done']['drafter']} steps on {rows} rows: loss {numbers['first_loss']:.2f} "
                  f"-> {numbers['loss']:.2f}, accuracy {numbers['accuracy']:.3f}")


def eval_prompt_files(work: Work, folder: Path, benches: list[str], limit: int) -> list[str]:
    """Each benchmark's first `limit` prompts as a file named after it (what `eval` labels it
    by): a built-in benchmark, `dev` (the held-out split of the recipe's prompt source),
    `mtbench_odd` (first turns of every other MT-Bench question) or a prompts file."""
    from ..eval.benchmarks import bench_label, load_benchmark

    files = []
    for name in benches:
        path = folder / f"{bench_label(name)}.jsonl"
        if name == "dev":
            prompts = source_prompts(work, "dev", limit)
        elif name == "mtbench_odd":
            prompts = load_benchmark("mtbench")[::2]
        else:
            prompts = load_benchmark(name)
        _prompt_file(path, prompts[: limit or None], lambda _: name)
        files.append(str(path))
    return files


def check_benchmarks(recipe: Recipe) -> None:
    """Every benchmark the eval stage decodes can be read: a missing package or file fails now,
    not after training."""
    from ..eval.benchmarks import load_benchmark

    for name in {*recipe.eval.bench, *recipe.speed.bench} - {"dev", "mtbench_odd"}:
        try:
            load_benchmark(name)
        except ConfigError as error:
            raise ConfigError(f"recipe {recipe.name}: [eval] or [speed] bench: {error}") from None


def check_recipe_inputs(work: Work, stages: list[str]) -> None:
    """What the stages will read and write fits, checked without loading a model: the prompt
    source is a readable file (or the built-in set), and the recipe's requests and answers fit
    the target's context. A wrong value fails now, not after the stages before it have run and
    recorded their settings."""
    from ..data.readers import check_readable
    from ..generate.regenerate import prompt_token_limit
    from ..target.model import declared_context

    context = declared_context(work.target)
    source, own, regenerate = work.recipe.prompts.source, work.recipe.self_prompts, work.recipe.regenerate
    reads_source = "prompts" in stages or "eval" in stages and "dev" in work.recipe.eval.bench
    try:
        if reads_source and source != "default":
            check_readable(source, flag="[prompts] source")
        if "self-prompts" in stages:
            prompt_token_limit(context, own.max_new_tokens, names=("[self_prompts] max_new_tokens", ""))
        if "regenerate" in stages:
            prompt_token_limit(context, regenerate.max_new_tokens, regenerate.max_prompt_tokens,
                               names=("[regenerate] max_new_tokens", "[regenerate] max_prompt_tokens"))
    except UserError as error:
        raise ConfigError(f"recipe {work.recipe.name}: {error}") from None


def check_decontamination(work: Work, stages: list[str]) -> None:
    """The stages that keep benchmark prompts out of the training prompts read every built-in
    benchmark: self-prompts, and the built-in prompt set (its prompts, and the eval's `dev`
    prompts). A missing or broken benchmark package fails now, not after the stages before them."""
    from ..assets import MissingAsset
    from ._common import benchmark_prompt_texts

    default = work.recipe.prompts.source == "default"
    needs = [stage for stage in stages if stage == "self-prompts" or default and (
        stage == "prompts" or stage == "eval" and "dev" in work.recipe.eval.bench)]
    if not needs:
        return
    try:
        benchmark_prompt_texts()
    except MissingAsset as error:
        raise MissingAsset(f"stage {needs[0]} keeps benchmark prompts out of the training prompts, so it reads "
                           f"every built-in benchmark: {error}") from None


def stage_eval(work: Work) -> tuple[int, str]:
    from .eval import EvalConfig, run_eval

    drafter = work.run / "export"
    runs = [(work.eval_json, work.recipe.eval.bench, work.recipe.eval.limit, work.recipe.eval.decoder,
             work.recipe.eval.baseline, "tau")]
    if work.recipe.speed.bench:
        runs.append((work.speed_json, work.recipe.speed.bench, work.recipe.speed.limit, work.recipe.speed.decoder,
                     True, "speed"))
    prompts = 0
    for out, benches, limit, decoder, baseline, name in runs:
        if not out.exists():  # written whole at its end
            files = eval_prompt_files(work, work.folder / "eval" / name, benches, limit)
            # Each run loads its own models: target-only decoding timed with models that had
            # decoded the τ run's 160 prompts before ran 6 % slower than in a fresh load (one
            # H100, 2026-12-07: 405.7 against 433.4 tok/s), which flattered the speed-up.
            status = run_eval(checked(EvalConfig(
                target=work.target, drafter=str(drafter), bench=files, limit=0, device=work.device, decoder=decoder,
                max_new_tokens=work.recipe.eval.max_new_tokens, baseline=baseline, json=str(out))))
            if status != 0:
                raise RunFailed(f"eval: some prompts failed (see above); {out} holds the others")
        prompts += sum(b["summary"]["prompts"] for b in json.loads(out.read_text())["benchmarks"].values())
    return prompts, f"{prompts} prompts decoded: {', '.join(str(r[0]) for r in runs)}"


def stage_export(work: Work) -> tuple[int, str]:
    from .export import ExportConfig, run_export

    run_export(checked(ExportConfig(checkpoint=str(work.run), out=str(work.drafter), dtype=work.recipe.export.dtype)))
    return 0, f"the drafter engines load: {work.drafter}"


def stage_export_gguf(work: Work) -> tuple[int, str]:
    from .export import ExportConfig, run_export

    if not work.drafter_gguf.exists():  # written whole, or not at all
        run_export(checked(ExportConfig(checkpoint=str(work.run), out=str(work.drafter_gguf), format="gguf",
                                        target=work.target, dtype=work.recipe.export.dtype)))
    return 0, f"the drafter llama.cpp serves next to {Path(work.target).name}: {work.drafter_gguf}"


STAGE_FUNCTIONS: dict[str, Callable[[Work], tuple[int, str]]] = {
    "prompts": stage_prompts, "self-prompts": stage_self_prompts, "regenerate": stage_regenerate,
    "features": stage_features, "train": stage_train, "eval": stage_eval, "export": stage_export,
    "export-gguf": stage_export_gguf,
}


def plot_training_curve(metrics_path: Path, png_path: Path) -> Path:
    """Loss, accuracy and simulated tau per step; real tau points where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records]
    figure, (loss_axis, tau_axis) = plt.subplots(1, 2, figsize=(11, 4))
    loss_axis.plot(steps, [r["loss"] for r in records], lw=1)
    loss_axis.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    tau_axis.plot(steps, [r["tau_sim"] for r in records], lw=1, label="simulated tau (training batch)")
    tau_axis.plot(steps, [r["accuracy"] for r in records], lw=1, label="top-1 accuracy")
    real = [r for r in records if "tau_real" in r]
    if real:
        tau_axis.plot([r["step"] for r in real], [r["tau_real"] for r in real], "o-", label="real tau (spec. decoding)")
    tau_axis.set(xlabel="step", title="acceptance")
    tau_axis.legend(loc="best", fontsize=8)
    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return png_path


# -------------------------------------------------------------------------------------------
# Running stages
# -------------------------------------------------------------------------------------------


def _holds_something(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0 or path.is_dir() and any(path.iterdir())


def say(message: str) -> None:
    print(f"[pipeline] {message}", flush=True)


def check_work_folder(folder: Path) -> None:
    """WORK is new, empty, or a pipeline's earlier work folder: nothing else is written into."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--out {folder}: a file; the work folder must be a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / BOOK).is_file():
        raise ConfigError(f"--out {folder}: a folder that is not a pipeline's work folder (no {BOOK}); "
                          "choose a new or empty one")


def plan(work: Work, book: StageBook, requested: list[str]) -> list[str]:
    """The stages to run, in order (`requested` by name, or every stage the run has when empty),
    checked before anything runs: a named stage the run has, each one's earlier stages done or
    run now, and no started one with other settings."""
    for stage in requested:
        if not work.applies(stage):
            raise ConfigError(f"--stages {stage}: this run has no {stage} stage ({work.without(stage)})")
    stages = [s for s in STAGES if (s in requested or not requested) and work.applies(s)]
    for stage in stages:
        missing = [earlier for earlier in STAGES[: STAGES.index(stage)]
                   if not (stage in AFTER_TRAIN and earlier in AFTER_TRAIN)  # each reads the checkpoint, not another's output
                   and work.applies(earlier) and earlier not in stages and not book.done(earlier)]
        if missing:
            raise ConfigError(f"--stages: {stage} needs {', '.join(missing)}, not done in {work.folder}; add "
                              f"{'it' if len(missing) == 1 else 'them'} (--stages {','.join(s for s in STAGES if s in (*stages, *missing))})")
    book.check(work, stages)
    return stages


def run_stages(work: Work, book: StageBook, stages: list[str], warm_ahead: str = "off") -> dict[str, float]:
    """Run `stages` (from `plan`) in order; a done one is skipped. Seconds of each stage in this run.
    `warm_ahead` (auto, on, off): whether the train stage's compiles run beside the regenerate
    stage, in a process of their own (`_warm_ahead.py`)."""
    from ._warm_ahead import LOG_NAME, WarmAhead, skip_reason

    spent: dict[str, float] = {}
    pending = [stage for stage in stages if not book.done(stage) or any(not p.exists() for p in work.outputs(stage))]
    ahead_skipped = skip_reason(pending, warm_ahead, features_cached=work.recipe.features.cache, run_dir=work.run,
                                target=work.target, device=work.device)
    if ahead_skipped and warm_ahead == "on":
        say(f"warm-up ahead: not run ({ahead_skipped})")
    ahead: WarmAhead | None = None
    try:
        for number, stage in enumerate(stages, 1):
            where = f"{number}/{len(stages)} {stage}"
            if stage not in pending:
                entry = book.entry(stage)
                say(f"{where}: done in an earlier run ({entry.get('rows', 0)} rows, {format_seconds(entry['seconds'])}); skipped")
                continue
            if book.done(stage):
                gone = [path for path in work.outputs(stage) if not path.exists()]
                say(f"{where}: done in an earlier run, but {', '.join(map(str, gone))} is gone: running it again")
            settings = stage_settings(work, stage)
            entry = book.start(stage, settings)
            entry["done"] = False
            say(f"{where}: started" + (f" (resuming: {format_seconds(entry['seconds'])} spent before)" if entry["runs"] > 1 else ""))
            try:
                with StageClock(book, entry) as clock:  # records the seconds however the stage ends
                    if stage == "regenerate" and ahead_skipped is None:
                        ahead = WarmAhead.start(work.train_config(), work.folder / LOG_NAME)
                        say(f"warm-up ahead: compiling the train stage's step beside this stage (pid "
                            f"{ahead.process.pid}, log {ahead.log_path})")
                    if stage == "train" and ahead is not None:  # its wait is the train stage's time
                        say(ahead.finish())
                        ahead = None
                    rows, note = STAGE_FUNCTIONS[stage](work)
            except UserError:
                if not any(_holds_something(path) for path in work.outputs(stage)):
                    book.forget(stage)  # it made nothing that other settings would mix with: the fixed recipe may run
                raise
            spent[stage] = clock.seconds
            entry.update(done=True, rows=rows, note=note)
            book.save()
            say(f"{where}: done in {format_seconds(spent[stage])}: {note}")
    finally:
        if ahead is not None:
            ahead.abandon()
    return spent
