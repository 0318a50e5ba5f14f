"""Where a run starts and ends: what `--out` already holds (`check_run_folder`: nothing, the run
being resumed, or a refusal), the resume point (the newest checkpoint every drafter has, checked
against the run's drafter, optimizer settings, data stream and target), the settings a resume
changes (said, and kept in run.json's `resumes`), the set-aside of checkpoints past it, and the
steps the run trains (`StepRange`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, TextIO

from ..config import FIXED_BY_CHECKPOINT, ConfigError, TrainConfig
from ..core.drafter import DrafterConfig
from ..target.model import identity_differences, target_identity
from .batches import stream_differences
from .checkpoint import CheckpointError, latest_checkpoint, read_state, resumable_checkpoint, set_aside_after, verified_checkpoints
from .layout import DrafterPlan
from .supply import FeatureSupply


# --- what --out holds ----------------------------------------------------------------------------

# Everything a run writes in a drafter's folder (--out itself, or OUT/<name> for each variant);
# the first three mark a folder as a drafter's (an `export` folder alone is not a run).
RUN_FILES = ("run.json", "metrics.jsonl", "checkpoints", "export")
DRAFTER_MARKS = RUN_FILES[:3]
# What a run of either mode writes at the top of --out.
RUN_FOLDER_FILES = ("pipeline.jsonl", "summary.json")


@dataclass(frozen=True)
class HeldRun:
    """The training run a folder holds, read from what runs write: a one-drafter (replicas) run
    keeps its drafter's files at the top, a variants run one folder per variant."""

    folder: Path
    top: list[Path]  # a drafter's files at the top of the folder: a replicas run
    variants: dict[str, list[Path]]  # variant name -> its drafter's files in OUT/<name>
    shared: list[Path]  # pipeline.jsonl, summary.json

    @property
    def evidence(self) -> list[Path]:
        return [*self.shared, *self.top, *(path for paths in self.variants.values() for path in paths)]

    def describe(self) -> str:
        parts = (["one drafter (--mode replicas)"] if self.top else []) + (
            [f"variants {', '.join(sorted(self.variants))} (--mode variants)"] if self.variants else [])
        return " and ".join(parts) or "a run that wrote no drafter's files yet"


def held_run(folder: Path) -> HeldRun | None:
    """The run `folder` holds, None when it holds none (missing, empty, or only others' files)."""
    if not folder.is_dir():
        return None
    top = [folder / name for name in DRAFTER_MARKS if (folder / name).exists()]
    variants = {}
    for sub in sorted(folder.iterdir()):
        marks = [sub / name for name in DRAFTER_MARKS if (sub / name).exists()] if sub.is_dir() else []
        if sub.name.startswith(".") or not marks:  # hidden: a writer's staging, never a variant
            continue
        # A one-drafter run trained into a sub-folder is that run's, not a variant of this one.
        if _recorded_mode(sub / "run.json") != "replicas":
            variants[sub.name] = marks
    shared = [folder / name for name in RUN_FOLDER_FILES if (folder / name).exists()]
    return HeldRun(folder, top, variants, shared) if top or variants or shared else None


def _recorded_mode(run_json: Path) -> str | None:
    try:
        record = json.loads(run_json.read_text())
    except (OSError, ValueError):
        return None
    return record.get("mode") if isinstance(record, dict) else None


def asked_run(config: TrainConfig) -> str:
    """The run `config` trains, in `HeldRun.describe`'s words."""
    if config.parallel.mode == "variants":
        return f"variants {', '.join(sorted(name for name, _ in config.variant_configs()))} (--mode variants)"
    return "one drafter (--mode replicas)"


def check_run_folder(config: TrainConfig) -> HeldRun | None:
    """What --out may hold before a run writes there, checked before anything loads: nothing (a
    new or empty folder); with --resume, the run it continues, of the same mode and variants;
    never a folder of the user's files (the run would write beside them, and replace any of
    them that has the name of a file it writes, e.g. rows.cache), nor, without --resume, a run
    (two runs' metrics and checkpoints would mix). The held run, if any."""
    out = Path(config.checkpoint.out)
    if not out.is_dir() or not (entries := sorted(entry.name for entry in out.iterdir())):
        return None
    held = held_run(out)
    if held is None:
        shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
        raise ConfigError(f"--out {out} is a folder that holds no training run ({shown}); train into a new or "
                          "empty folder (a run never writes among files it did not create)")
    if not config.checkpoint.resume:
        raise ConfigError(f"--out {out} already holds a training run ({', '.join(str(p) for p in held.evidence[:3])}); "
                          "pass --resume to continue it, or choose a new --out")
    asked = asked_run(config)
    if (held.top or held.variants) and held.describe() != asked:
        raise ConfigError(f"cannot resume {out}: it holds {held.describe()}, and this command trains {asked}; resume "
                          "with the run's own --mode / --config variants, or train into a new --out")
    return held


# --- where the run starts ----------------------------------------------------------------------

@dataclass(frozen=True)
class StepRange:
    """The steps this run trains: start (0, or the resumed step) up to end (exclusive)."""

    start: int
    end: int

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return max(0, self.end - self.start)


@dataclass
class ResumePoint:
    start_step: int = 0
    checkpoints: dict[str, Path] = field(default_factory=dict)  # per plan name
    behind_newest: bool = False  # some drafter has checkpoints past start_step (see set_aside_later_checkpoints)
    changed: dict[str, dict[str, dict]] = field(default_factory=dict)  # per plan name: `changed_settings`


def run_target_identity(config: TrainConfig, supply: FeatureSupply | None = None) -> dict[str, str] | None:
    """The identity (`target.target_identity`) of the target this run trains against: --target,
    or the feature cache's target; None for a target given in memory (tests, benchmarks)."""
    path = config.model.target or (str(supply.cache.target) if supply is not None and supply.cache is not None else "")
    return target_identity(path) if path and Path(path).exists() else None


def find_resume_point(config: TrainConfig, plans: list[DrafterPlan], log: TextIO, stream: dict | None = None,
                      target: dict[str, str] | None = None) -> ResumePoint:
    """The step to continue from. A checkpoint fixes its drafter's shape, its optimizer's
    settings, its data stream (`stream_identity`: step s must train the same batches) and its
    target (`run_target_identity`): a resume that changes any of them is refused (never
    silently ignored)."""
    if not config.checkpoint.resume:
        return ResumePoint()
    # The newest checkpoint that loads and verifies; a damaged newer one is skipped with one line.
    found = {plan.name: resumable_checkpoint(plan.run_dir, log)[0] for plan in plans}
    states = {name: read_state(path) for name, path in found.items() if path is not None}
    if not states:
        print(f"--resume: no complete checkpoint in {config.checkpoint.out}, starting from step 0", file=log)
        return ResumePoint()
    if missing := [plan.name for plan in plans if plan.name not in states]:
        raise ConfigError(f"cannot resume: {', '.join(missing)} has no complete checkpoint in {config.checkpoint.out} while "
                          f"{', '.join(states)} do; train into a new --out")
    unequal = len({state["step"] for state in states.values()}) != 1
    if unequal:
        found = common_checkpoints(plans, {name: state["step"] for name, state in states.items()}, log)
        states = {name: read_state(path) for name, path in found.items()}
    steps = {name: state["step"] for name, state in states.items()}
    for plan in plans:
        check_resumable(plan, found[plan.name], states[plan.name])
        check_same_target(plan, found[plan.name], states[plan.name], target, log)
    for name, state in states.items():
        if stream is None:
            continue
        if state.get("stream") is None:
            print(f"--resume: {found[name]} records no data stream (an older checkpoint): seed, batch and data "
                  "are not checked", file=log)
        else:
            refuse_other_stream(found[name], state["stream"], stream)
    start = next(iter(steps.values()))
    print(f"resuming from step {start} ({', '.join(str(p) for p in found.values())})", file=log)
    changed = {plan.name: changed_settings(states[plan.name].get("train_config", {}), plan.config.flat_values())
               for plan in plans}
    for plan in plans:
        who = f"{plan.name}: " if config.parallel.mode == "variants" else ""
        for key, change in changed[plan.name].items():
            print(f"--resume: {who}--{key.replace('_', '-')} {_shown(change['from'])} -> {_shown(change['to'])} "
                  f"(from step {start + 1})", file=log)
    return ResumePoint(start, found, behind_newest=unequal, changed=changed)


# --resume itself: on at every resume, off in the checkpoint of the run's first start.
NOT_A_CHANGE = ("resume",)


def changed_settings(saved: dict, settings: dict) -> dict[str, dict]:
    """The settings (by flat name) a resume changes from those its checkpoint was trained with,
    each {"from": before, "to": now}: applied from the next step on, so said and recorded
    (`resume_history`), never silent. A setting the checkpoint predates is not compared."""
    now = json.loads(json.dumps(settings))  # as the checkpoint holds them: tuples as lists
    return {key: {"from": saved[key], "to": value} for key, value in now.items()
            if key in saved and key not in NOT_A_CHANGE and saved[key] != value}


def _shown(value: object) -> str:
    if isinstance(value, list):
        return ",".join(map(_shown, value)) if value else "[]"
    return "''" if value == "" else "unset" if value is None else str(value)


def resume_history(run_json: Path, name: str, resume: ResumePoint) -> list[dict]:
    """run.json's `resumes`: one entry per start from a checkpoint (its step and the settings it
    changed), so that run.json, rewritten with each start's settings, still says what trained the
    earlier steps. The entries of the run.json already there are kept up to this resume's step
    (later ones were of steps trained again from here); a run started from step 0 has none."""
    if name not in resume.checkpoints:
        return []
    try:
        earlier = json.loads(run_json.read_text()).get("resumes", [])
    except (OSError, ValueError, AttributeError):
        earlier = []
    kept = [entry for entry in earlier if isinstance(entry, dict) and isinstance(entry.get("step"), int)
            and entry["step"] < resume.start_step] if isinstance(earlier, list) else []
    return [*kept, {"step": resume.start_step, "checkpoint": Path(resume.checkpoints[name]).name,
                    "changed": resume.changed.get(name, {})}]


def set_aside_later_checkpoints(plans: list[DrafterPlan], resume: ResumePoint, log: TextIO) -> None:
    """A resume from a step some drafters are past (`common_checkpoints`): their later checkpoints
    moved to checkpoints/superseded/, kept, so that until those steps are trained again no resume
    or export takes them for the newest. Called by the run folder's owner once the resume is
    agreed: a refused resume changes nothing."""
    if not resume.behind_newest:
        return
    for plan in plans:
        for before, after in set_aside_after(plan.run_dir, resume.start_step):
            print(f"--resume: {before} set aside as {after} (the steps after {resume.start_step} are trained again)",
                  file=log)


def common_checkpoints(plans: list[DrafterPlan], newest: dict[str, int], log: TextIO) -> dict[str, Path]:
    """Drafters trained from one stream whose newest checkpoints differ (a stop ends each after its
    own current step, and a slower one is a few steps behind): the newest step all of them have
    a verified checkpoint of."""
    verified = {plan.name: verified_checkpoints(plan.run_dir) for plan in plans}
    common = set.intersection(*(set(found) for found in verified.values()))
    if not common:
        held = {name: sorted(found) for name, found in verified.items()}
        raise ConfigError(f"cannot resume: the drafters have no checkpointed step in common (steps {held}); "
                          "train into a new --out")
    step = max(common)
    print(f"--resume: the drafters stopped at different steps {newest}; all resume from step {step}, "
          "the newest step each has a checkpoint of", file=log)
    return {name: found[step] for name, found in verified.items()}


def check_resumable(plan: DrafterPlan, checkpoint: Path, state: dict) -> None:
    # Fields a checkpoint predates (DFlash2's) hold their defaults: an older DFlash run still resumes.
    defaults = {f.name: f.default for f in dataclasses.fields(DrafterConfig) if f.default is not dataclasses.MISSING}
    saved = {**defaults, **state.get("drafter_config", {})}
    wanted = plan.drafter_config.to_dict()
    changed = [f"{key} {saved.get(key)!r} -> {wanted.get(key)!r}" for key in sorted(set(saved) | set(wanted))
               if saved.get(key) != wanted.get(key)]
    if changed:
        raise ConfigError(f"cannot resume {plan.run_dir}: its checkpoint {checkpoint.name} holds a different drafter "
                          f"({'; '.join(changed)}); resume with the run's settings, or start a new run in another --out")
    refuse_changed(plan, checkpoint, state, FIXED_BY_CHECKPOINT)


def refuse_other_stream(checkpoint: Path, saved: dict, stream: dict) -> None:
    """ConfigError where this run would train other batches at a step than the checkpoint's did."""
    if differences := stream_differences(saved, stream):
        raise ConfigError(f"cannot resume {checkpoint}: this run would train other batches at each step "
                          f"({'; '.join(differences)}); keep them as they were, or train into a new --out")


# What a checkpoint fixes that its record of the flat settings shows: the optimizer's settings and
# the drafter's shape. Compared, with the stream's settings, from the newest checkpoint's record
# before anything loads (`check_recorded_settings`); the full checks (`check_resumable`, the
# stream's identity, the target's) run once the target and rows are there.
RECORDED_AND_FIXED = {**dict.fromkeys(FIXED_BY_CHECKPOINT, "its optimizer state fixes it"),
                      **dict.fromkeys(("block_size", "num_layers", "arch"), "its drafter has that shape")}


def refuse_changed(plan: DrafterPlan, checkpoint: Path, state: dict, keys: Sequence[str]) -> None:
    """ConfigError naming the first of `keys` this run sets otherwise than the checkpoint's record."""
    saved, settings = state.get("train_config", {}), plan.config.flat_values()
    for key in keys:
        if key in saved and saved[key] != settings[key]:
            raise ConfigError(
                f"cannot resume {plan.run_dir}: --{key.replace('_', '-')} {settings[key]} differs from "
                f"{saved[key]} in its checkpoint {checkpoint.name}, and {RECORDED_AND_FIXED.get(key, 'it fixes it')}; "
                "resume without changing it, or start a new run in another --out")


def check_recorded_settings(config: TrainConfig, plans: list[DrafterPlan], batches_per_step: int) -> None:
    """A --resume that changes a setting the newest checkpoint fixes, refused from its record
    before the target loads and the rows render (minutes, for a big target): the stream's
    settings known before the rows are read are compared by `stream_identity`'s keys."""
    if not config.checkpoint.resume:
        return
    for plan in plans:
        checkpoint = latest_checkpoint(plan.run_dir)
        try:
            state = read_state(checkpoint) if checkpoint else None
        except CheckpointError:
            continue  # a damaged newest one: the resume skips it, saying so, and checks the one it takes
        if state is None:
            continue
        refuse_changed(plan, checkpoint, state, list(RECORDED_AND_FIXED))
        if isinstance(state.get("stream"), dict):
            now = {"seed": config.optimizer.seed, "batch_size": config.optimizer.batch_size,  # as `stream_identity` has them
                   "micro_batches_per_step": batches_per_step, "max_seq_len": config.data.max_seq_len}
            refuse_other_stream(checkpoint, {key: state["stream"].get(key) for key in now}, now)


def check_same_target(plan: DrafterPlan, checkpoint: Path, state: dict, target: dict[str, str] | None,
                      log: TextIO) -> None:
    """A checkpoint trained against one target is not continued against another of the same
    shape (a base model for its instruct tune, a fine-tune): the drafter would learn a mix."""
    saved = state.get("target")
    if target is None:
        return
    if saved is None:
        print(f"--resume: {checkpoint} records no target (an older checkpoint): the target is not checked", file=log)
        return
    differs = identity_differences(saved, target)
    if differs:
        what = " and ".join("its config.json" if name == "config_sha256" else "its sampled weights" for name in differs)
        raise ConfigError(f"cannot resume {plan.run_dir}: --target {plan.config.model.target or 'the feature cache target'} is not "
                          f"the target its checkpoint {checkpoint.name} was trained against ({what} differ); resume "
                          "with that target, or start a new run in another --out")


def step_range(config: TrainConfig, resume: ResumePoint, stop_at: int | None, log: TextIO) -> StepRange:
    end = min(config.optimizer.steps, stop_at) if stop_at is not None else config.optimizer.steps
    if resume.start_step >= end:
        print(f"nothing to do: already at step {resume.start_step} of {config.optimizer.steps}", file=log)
    return StepRange(resume.start_step, end)
