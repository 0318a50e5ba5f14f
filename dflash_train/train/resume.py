"""Where a run starts and ends: the resume point (the newest checkpoint every drafter has, checked
against the run's drafter, optimizer settings, data stream and target), the set-aside of
checkpoints past it, and the steps the run trains (`StepRange`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..config import FIXED_BY_CHECKPOINT, ConfigError, TrainConfig
from ..core.drafter import DrafterConfig
from ..target.model import target_identity
from .batches import stream_differences
from .checkpoint import read_state, resumable_checkpoint, set_aside_after, verified_checkpoints
from .layout import DrafterPlan
from .supply import FeatureSupply


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
        elif differences := stream_differences(state["stream"], stream):
            raise ConfigError(f"cannot resume {found[name]}: this run would train other batches at each step "
                              f"({'; '.join(differences)}); keep them as they were, or train into a new --out")
    start = next(iter(steps.values()))
    print(f"resuming from step {start} ({', '.join(str(p) for p in found.values())})", file=log)
    return ResumePoint(start, found, behind_newest=unequal)


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
    saved_settings, settings = state.get("train_config", {}), plan.config.flat_values()
    for key in FIXED_BY_CHECKPOINT:
        if key in saved_settings and saved_settings[key] != settings[key]:
            raise ConfigError(
                f"cannot resume {plan.run_dir}: --{key.replace('_', '-')} {settings[key]} differs from "
                f"{saved_settings[key]} in its checkpoint {checkpoint.name}, whose optimizer state fixes it; resume "
                f"without changing it, or start a new run in another --out")


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
    differs = [name for name in ("config_sha256", "weights_fingerprint") if saved.get(name) != target.get(name)]
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
