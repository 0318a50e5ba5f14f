"""The build steps of a training run, in the order `train()` calls them.

    layout          which devices run target workers and drafter workers (per process; see
                    distributed.place_devices for several processes on one host)
    drafter plans   one plan per drafter to train (replicas: one; variants: one per entry)
    feature supply  the target(s) and where features come from (live target or feature cache)
    samples         the training rows
    drafter shapes  each plan's DrafterConfig and ObjectiveConfig, from the target
    resume point    the step to start from and the checkpoints to load
    pipeline        replicas (models, optimizers), checkpointers, the evaluator, queues, workers

Each step is a function of what the steps before it returned; none starts a thread.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch

from ..config import FIXED_BY_CHECKPOINT, THINKING, ConfigError, TrainConfig
from ..core.attention import resolve_backend
from ..core.dflash2 import GroupedDynamicCausalConv
from ..core.drafter import DFlashDrafter, DrafterConfig
from ..core.fp8 import check_fp8_dims, fp8_unsupported, use_fp8_linears
from ..core.objective import ObjectiveConfig, fused_head_unsupported
from ..core.step import FrozenTargetParts, make_optimizer, warmup_cosine
from ..files import check_outside_inputs, remove_leftover_staging, write_json_atomic
from ..parallel.nodes import Launch, NodeGroup, NodeStep, place_devices
from ..parallel.threads import StopSignal
from ..target.model import Target, load_target, resolve_device, resolve_mask_token_id, target_identity
from .batches import BatchPlanner, HostBatch, auto_buckets, stream_differences
from .checkpoint import (
    load_drafter,
    read_state,
    restore_trainer,
    resumable_checkpoint,
    set_aside_after,
    verified_checkpoints,
)
from .compile_cache import CompileCacheReport
from .compile_gate import CompileGate, recompile_limit_for
from .startup import GraphChoice, Warmup, attach_step, feature_dtype, graphed_sources
from .drafter_worker import DrafterSetup, DrafterWorker, StepHook
from .gradient_reducer import GradientReducer
from .rank_zero import Checkpointer, EvaluationSchedule
from .replicas import Replica
from .resume import StepRange
from .routing import BatchRouter, FeatureSource
from .target_worker import TargetSetup, TargetWorker

# --- layout ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Devices of the target worker threads and of the drafter worker threads (several threads
    may share a device; a one-device run is one target thread and one drafter thread on it)."""

    target_devices: list[torch.device]
    drafter_devices: list[torch.device]

    @property
    def uses_cuda(self) -> bool:
        return any(d.type == "cuda" for d in [*self.target_devices, *self.drafter_devices])


def resolve_layout(config: TrainConfig, launch: Launch | None = None) -> Layout:
    targets, drafters = place_devices([
        [resolve_device(d) for d in (config.target_devices or [config.device])],
        [resolve_device(d) for d in (config.drafter_devices or [config.device])],
    ], launch)
    layout = Layout(targets, drafters)
    on_cpu = [str(d) for d in layout.drafter_devices if d.type != "cuda"]
    if config.attention == "flex" and on_cpu:
        raise ConfigError(f"--attention flex: flex attention has no backward pass on {', '.join(on_cpu)} (it trains "
                          "on CUDA only); use --attention sdpa or auto")
    return layout


# --- drafter plans -----------------------------------------------------------------------------

@dataclass
class DrafterPlan:
    """One drafter to train: its settings, folder, and the devices of its replicas."""

    name: str
    config: TrainConfig
    run_dir: Path
    devices: list[torch.device]
    drafter_config: DrafterConfig | None = None  # set by `describe_drafters`
    objective: ObjectiveConfig | None = None


def plan_drafters(config: TrainConfig, layout: Layout) -> list[DrafterPlan]:
    out = Path(config.out)
    if config.mode == "replicas":
        return [DrafterPlan("drafter", config, out, list(layout.drafter_devices))]
    devices = layout.drafter_devices
    return [DrafterPlan(name, variant, out / name, [devices[i % len(devices)]])
            for i, (name, variant) in enumerate(config.variant_configs())]


# Everything a run writes at the top of its folder (and in each variant's folder).
RUN_FILES = ("run.json", "metrics.jsonl", "checkpoints", "export")
RUN_FOLDER_FILES = ("pipeline.jsonl", "summary.json")


def prepare_run_folder(config: TrainConfig, plans: list[DrafterPlan]) -> Path:
    """The run folder, created if new; call it holding the folder's lock (`files.hold_output`),
    so that no live process writes there meanwhile. It is never inside one of the run's inputs.
    Without --resume it must hold nothing a run writes (a second run would mix its metrics and
    checkpoints with the first's); with it, what an interrupted checkpoint write left behind is
    cleaned up."""
    out = Path(config.out)
    check_outside_inputs(out, "--out", [config.target, config.features, *config.data,
                                        *([config.eval_bench] if Path(config.eval_bench).is_file() else [])])
    if not config.resume:
        held = [out / name for name in RUN_FOLDER_FILES if (out / name).exists()]
        held += [plan.run_dir / name for plan in plans for name in RUN_FILES if (plan.run_dir / name).exists()]
        if held:
            raise ConfigError(f"--out {out} already holds a training run ({', '.join(str(p) for p in held[:3])}); "
                              "pass --resume to continue it, or choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    for plan in plans:
        remove_leftover_staging(plan.run_dir / "checkpoints")
    return out


def compiles_drafter(config: TrainConfig, device: torch.device) -> bool:
    return config.compile == "on" or (config.compile == "auto" and device.type == "cuda")


def compiles_target(config: TrainConfig, device: torch.device) -> bool:
    """Whether the target's feature forward on `device` is compiled before its capture (only
    under CUDA graphs: train/feature_graphs.py)."""
    return config.compile_target == "auto" and compiles_drafter(config, device)


# --- feature supply ----------------------------------------------------------------------------

class LiveTarget:
    """FeatureSource running the target model on its device."""

    def __init__(self, target: Target, layer_ids: list[int]):
        self.target = target
        self.layer_ids = layer_ids
        self.device = target.device

    def features(self, batch: HostBatch) -> torch.Tensor:
        return self.target.features(batch.input_ids.to(self.device, non_blocking=True), self.layer_ids)


@dataclass
class FeatureSupply:
    """The targets (one per target worker) and the feature cache, if features come from one."""

    targets: list[Target]
    cache: Any = None  # data.feature_cache.FeatureCache

    @property
    def first(self) -> Target:
        return self.targets[0]

    def sources(self, layout: Layout, layer_ids: list[int], log: TextIO) -> list[FeatureSource]:
        """One feature source per target worker: the live target, or the cache read on its device."""
        if self.cache is None:
            return [LiveTarget(target, layer_ids) for target in self.targets]
        devices = layout.target_devices
        sources = [self.cache.source(devices[t % len(devices)], layer_ids) for t in range(len(self.targets))]
        print(f"features: cache {self.cache.directory} ({len(self.cache)} samples, layers {self.cache.layer_ids}, "
              f"{self.cache.dtype}) read on {', '.join(str(s.device) for s in sources)}", file=log)
        return sources


def load_feature_supply(
    config: TrainConfig, layout: Layout, given: Target | Sequence[Target] | None, log: TextIO,
) -> FeatureSupply:
    targets: list[Target] = [] if given is None else [given] if isinstance(given, Target) else list(given)
    cache = None
    if config.features:
        from ..data.feature_cache import FeatureCache

        if config.data:
            raise ConfigError(f"pass --data or --features, not both: the feature cache {config.features} holds its own samples")
        cache = FeatureCache(config.features)
        cached_thinking(config, cache)
        if not targets:
            # No target forward runs for training; its embedding, head and tokenizer are still
            # needed (one copy serves every target worker), and the in-training evaluator runs it whole.
            path = config.target or cache.target
            device = feature_target_device(config, layout)
            use = "the in-training evaluator, embedding, head, tokenizer" if config.eval_every else "embedding, head, tokenizer"
            print(f"loading target {path} on {device} ({use}; features from {config.features})", file=log)
            drafters_on_cuda = any(d.type == "cuda" for d in layout.drafter_devices)
            targets.append(load_target(path, device, torch.bfloat16 if drafters_on_cuda else None))
        cache.check_target(targets[0])
        targets += targets[:1] * (len(layout.target_devices) - len(targets))
    for device in layout.target_devices[len(targets):]:
        print(f"loading target {config.target} on {device}", file=log)
        targets.append(load_target(config.target, device))
    return FeatureSupply(targets, cache)


def feature_target_device(config: TrainConfig, layout: Layout) -> torch.device:
    """Where the target goes when features come from a cache: the CPU (only its embedding and
    head are read, and copied to the drafters) unless --eval-every decodes with it, which on
    GPUs must not run on the CPU inside a drafter thread: then the first target device, or the
    first drafter device when the target devices are CPUs."""
    if not config.eval_every:
        return torch.device("cpu")
    for device in [*layout.target_devices, *layout.drafter_devices]:
        if device.type == "cuda":
            return device
    return torch.device("cpu")


def cached_thinking(config: TrainConfig, cache: Any) -> bool | None:
    """The thinking mode of a feature cache's rows, which the evaluator's prompts must share:
    --thinking auto takes it; another explicit value is refused."""
    cached = cache.header.get("enable_thinking")
    if config.thinking != "auto" and THINKING[config.thinking] != cached:
        made = {value: name for name, value in THINKING.items()}[cached]
        raise ConfigError(f"--thinking {config.thinking}: the feature cache {config.features} was rendered with "
                          f"thinking {made}; the evaluator must render prompts as the training rows were "
                          f"(pass --thinking {made} or auto)")
    return cached


def evaluation_thinking(config: TrainConfig, supply: FeatureSupply) -> bool | None:
    if supply.cache is not None:
        return cached_thinking(config, supply.cache)
    return THINKING[config.thinking]


# --- samples -----------------------------------------------------------------------------------

def load_samples(config: TrainConfig, supply: FeatureSupply, log: TextIO) -> list:
    """The training rows: from the feature cache, or rendered from --data with the target's tokenizer."""
    if supply.cache is not None:
        samples, stats = supply.cache.training_samples(config.max_seq_len, config.min_supervised_tokens)
        print(stats.summary(), file=log)
        from ..data.readers import FROM_TOKEN_IDS

        if config.token_ids == "ignore" and stats.answers.get(FROM_TOKEN_IDS):
            raise ConfigError(f"--token-ids ignore: the feature cache {config.features} rendered "
                              f"{stats.answers[FROM_TOKEN_IDS]} answers from their generated token ids; make one with "
                              "`dflash-train cache-features --token-ids ignore` to train on the re-tokenized text")
        if not samples:
            raise ConfigError(f"no usable training rows in the feature cache {config.features} (see the reasons above)")
        return samples
    from ..data.samples import load_training_samples

    tokenizer = supply.first.tokenizer
    if not config.data:
        raise ConfigError("no training data: pass --data FILE.jsonl (conversations with assistant answers)")
    if tokenizer is None:
        raise ConfigError(f"{config.target}: no tokenizer next to the model; it is needed to render --data")
    samples, stats = load_training_samples(
        config.data, tokenizer, max_length=config.max_seq_len, min_supervised_tokens=config.min_supervised_tokens,
        enable_thinking=THINKING[config.thinking], token_ids=config.token_ids,
    )
    print(stats.summary(), file=log)
    if not samples:
        raise ConfigError(f"no usable training rows in {', '.join(config.data)} (see the reasons above)")
    return samples


def check_batch_size(config: TrainConfig, samples: Sequence[Any]) -> None:
    if len(samples) < config.batch_size:
        source = f"the feature cache {config.features}" if config.features else ", ".join(config.data) or "the given samples"
        raise ConfigError(f"--batch-size {config.batch_size} is more than the {len(samples)} usable rows of {source}: "
                          f"pass --batch-size {len(samples)} or less, or more data")


# --- drafter shapes ----------------------------------------------------------------------------

def describe_drafters(plans: list[DrafterPlan], config: TrainConfig, target: Target, log: TextIO) -> None:
    """Each plan's drafter and objective, sized from the target; --fp8 checked against both."""
    mask_token_id = resolve_mask_token_id(config.mask_token_id, target.tokenizer, target.embed_weight.shape[0])
    for plan in plans:
        if plan.config.anchor_slots() < plan.config.num_anchors:
            print(f"{plan.name}: --num-anchors {plan.config.num_anchors} is more than --max-seq-len "
                  f"{plan.config.max_seq_len}: training {plan.config.anchor_slots()} anchor slots per sequence "
                  "(a sequence has no more anchor positions; the loss is the same)", file=log)
        plan.drafter_config = DrafterConfig.from_target(
            target.spec, num_layers=plan.config.num_layers, block_size=plan.config.block_size,
            mask_token_id=mask_token_id, target_layer_ids=plan.config.target_layer_ids or None,
            **dflash2_fields(plan.config),
        )
        compiled_head = all(compiles_drafter(config, device) for device in plan.devices)
        plan.objective = ObjectiveConfig(
            block_size=plan.config.block_size, num_anchors=plan.config.anchor_slots(), loss=plan.config.loss,
            gamma=plan.config.gamma, dpace_alpha=plan.config.dpace_alpha, loss_chunk_rows=plan.config.loss_chunk_rows,
            compiled_head=compiled_head,
            fused_head=compiled_head and uses_fused_head(plan, target.spec.final_logit_softcapping, log),
            fp8_head=plan.config.fp8 != "off",
            selector_weight=plan.config.selector_weight, selector_miss=plan.config.selector_miss,
        )
        if plan.config.fp8 != "off":
            check_fp8_support(plan, target)


def dflash2_fields(config: TrainConfig) -> dict:
    """The drafter's architecture and, for DFlash2, its sizes (a DFlash drafter keeps the defaults)."""
    if config.arch != "dflash2":
        return {"arch": config.arch}
    return {key: getattr(config, key) for key in ("arch", "conv_kernel_size", "conv_group_size", "selector_rank",
                                                   "selector_top_k")}


def uses_fused_head(plan: DrafterPlan, softcap: float | None, log: TextIO) -> bool:
    """Whether the frozen head's softmax runs as core/head_kernel.py's fused kernel: on every CUDA device
    of the drafter where it matched the reference (objective.fused_head_unsupported), else the
    compiled chunk, with the reason in the log."""
    for device in plan.devices:
        reason = fused_head_unsupported(device, softcap)
        if reason is not None:
            if device.type == "cuda":
                print(f"{plan.name}: frozen head: the compiled softmax, not the fused kernel ({reason})", file=log)
            return False
    print(f"{plan.name}: frozen head: the fused softmax kernel", file=log)
    return True


def check_fp8_support(plan: DrafterPlan, target: Target) -> None:
    """--fp8 needs FP8 products on every device of the drafter and 16-aligned model dims."""
    spec = target.spec
    dims = {"hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size}
    if plan.config.fp8 == "all":
        dims.update(intermediate_size=spec.intermediate_size, **{
            "num_attention_heads × head_dim": spec.num_attention_heads * spec.head_dim,
            "num_key_value_heads × head_dim": spec.num_key_value_heads * spec.head_dim,
        })
        if plan.config.arch == "dflash2":  # its kernel projections and selector projection are linears too
            dims.update({"2 × conv_kernel_size × hidden_size / conv_group_size":
                         2 * plan.config.conv_kernel_size * (spec.hidden_size // plan.config.conv_group_size),
                         "selector_rank": plan.config.selector_rank})
    try:
        check_fp8_dims(dims)
    except ValueError as error:
        raise ConfigError(f"{plan.name}: {error}") from None
    for device in plan.devices:
        reason = fp8_unsupported(device)
        if reason:
            raise ConfigError(f"{plan.name}: --fp8 {plan.config.fp8}: {reason}; use --fp8 off")


def layer_union(plans: list[DrafterPlan]) -> list[int]:
    """Every target layer some drafter reads: what the target workers capture."""
    return sorted({k for plan in plans for k in plan.drafter_config.target_layer_ids})


# --- resume point ------------------------------------------------------------------------------

@dataclass
class ResumePoint:
    start_step: int = 0
    checkpoints: dict[str, Path] = field(default_factory=dict)  # per plan name
    behind_newest: bool = False  # some drafter has checkpoints past start_step (see set_aside_later_checkpoints)


def run_target_identity(config: TrainConfig, supply: FeatureSupply | None = None) -> dict[str, str] | None:
    """The identity (`target.target_identity`) of the target this run trains against: --target,
    or the feature cache's target; None for a target given in memory (tests, benchmarks)."""
    path = config.target or (str(supply.cache.target) if supply is not None and supply.cache is not None else "")
    return target_identity(path) if path and Path(path).exists() else None


def find_resume_point(config: TrainConfig, plans: list[DrafterPlan], log: TextIO, stream: dict | None = None,
                      target: dict[str, str] | None = None) -> ResumePoint:
    """The step to continue from. A checkpoint fixes its drafter's shape, its optimizer's
    settings, its data stream (`stream_identity`: step s must train the same batches) and its
    target (`run_target_identity`): a resume that changes any of them is refused (never
    silently ignored)."""
    if not config.resume:
        return ResumePoint()
    # The newest checkpoint that loads and verifies; a damaged newer one is skipped with one line.
    found = {plan.name: resumable_checkpoint(plan.run_dir, log)[0] for plan in plans}
    states = {name: read_state(path) for name, path in found.items() if path is not None}
    if not states:
        print(f"--resume: no complete checkpoint in {config.out}, starting from step 0", file=log)
        return ResumePoint()
    if missing := [plan.name for plan in plans if plan.name not in states]:
        raise ConfigError(f"cannot resume: {', '.join(missing)} has no complete checkpoint in {config.out} while "
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
    saved_settings = state.get("train_config", {})
    for key in FIXED_BY_CHECKPOINT:
        if key in saved_settings and saved_settings[key] != getattr(plan.config, key):
            raise ConfigError(
                f"cannot resume {plan.run_dir}: --{key.replace('_', '-')} {getattr(plan.config, key)} differs from "
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
        raise ConfigError(f"cannot resume {plan.run_dir}: --target {plan.config.target or 'the feature cache target'} is not "
                          f"the target its checkpoint {checkpoint.name} was trained against ({what} differ); resume "
                          "with that target, or start a new run in another --out")


def step_range(config: TrainConfig, resume: ResumePoint, stop_at: int | None, log: TextIO) -> StepRange:
    end = min(config.steps, stop_at) if stop_at is not None else config.steps
    if resume.start_step >= end:
        print(f"nothing to do: already at step {resume.start_step} of {config.steps}", file=log)
    return StepRange(resume.start_step, end)


# --- compile gate ------------------------------------------------------------------------------

def shape_buckets(config: TrainConfig) -> list[int]:
    return sorted(config.seq_buckets) if config.seq_buckets else auto_buckets(config.max_seq_len)


def attention_backends(config: TrainConfig, layout: Layout) -> dict[torch.device, str]:
    return {d: resolve_backend(config.attention, d) for d in layout.drafter_devices}


def compile_gate(config: TrainConfig, layout: Layout, plans: list[DrafterPlan]) -> CompileGate | None:
    """The run's compile gate when anything compiles (train/compile_gate.py), else None. Under
    CUDA graphs the target's feature forward compiles too (in its thread's warm-up, which runs
    alone: startup.Warmup), once per bucket and target thread."""
    backends = attention_backends(config, layout)
    compiles = "flex" in backends.values() or any(compiles_drafter(config, d) for d in layout.drafter_devices) or any(
        compiles_target(config, d) for d in layout.target_devices)
    if not compiles:
        return None
    threads = max(sum(len(plan.devices) for plan in plans), len(layout.target_devices))
    return CompileGate(recompile_limit=recompile_limit_for(len(shape_buckets(config)), threads),
                       after_warmup="fail" if config.fail_on_recompile else "eager")


# --- pipeline: replicas, evaluator, queues, workers ----------------------------------------------

def init_drafter(config: DrafterConfig, seed: int) -> DFlashDrafter:
    """Weights drawn from N(0, 0.02) (norms at 1), as Hugging Face initialises Qwen3 layers."""
    generator = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        for module in drafter.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_to_identity()  # DFlash2 starts as the DFlash drafter with these weights
    return drafter


class FrozenPartsByDevice:
    """The target's embedding and head on each drafter device, copied once per device (once if
    tied), in the drafter's compute dtype there (`compute_dtype`): the head multiplies the
    drafter's hidden states, so a float32 run (`--precision fp32`) needs a float32 head even
    when the target is bf16."""

    def __init__(self, target: Target, config: TrainConfig):
        self.target = target
        self.config = config
        self._on: dict[torch.device, FrozenTargetParts] = {}

    def on(self, device: torch.device) -> FrozenTargetParts:
        if device not in self._on:
            dtype = compute_dtype(self.config, device)
            embed = self.target.embed_weight.detach()
            head = self.target.head_weight.detach()
            tied = embed.data_ptr() == head.data_ptr()
            embed = embed.to(device=device, dtype=dtype)
            head = embed if tied else head.to(device=device, dtype=dtype)
            spec = self.target.spec
            self._on[device] = FrozenTargetParts(embed, head, spec.input_embedding_scale, spec.final_logit_softcapping)
        return self._on[device]


def autocast_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    use_bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
    return torch.bfloat16 if use_bf16 else None


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype the drafter computes in on `device`: bf16 under autocast, else float32."""
    return autocast_dtype(config, device) or torch.float32


def write_run_record(plan: DrafterPlan, config: TrainConfig) -> None:
    """run.json: the settings this drafter trains with and its drafter config."""
    write_json_atomic(plan.run_dir / "run.json", {
        "train_config": dataclasses.asdict(plan.config), "drafter_config": plan.drafter_config.to_dict(),
        "target": str(config.target), "mode": config.mode, "name": plan.name,
    }, indent=2)


def build_replicas(
    plan: DrafterPlan, config: TrainConfig, resume: ResumePoint, frozen: FrozenPartsByDevice,
    backends: dict[torch.device, str], nodes: NodeGroup | None = None,
) -> list[Replica]:
    """The drafter's weights (fresh or from its checkpoint) on each of its devices, with an
    optimizer and LR schedule each (restored on resume)."""
    checkpoint = resume.checkpoints.get(plan.name)
    if checkpoint is not None:
        base = load_drafter(checkpoint)  # its config was checked against the plan by `check_resumable`
    else:
        base = init_drafter(plan.drafter_config, plan.config.seed)
    if nodes is not None:
        nodes.share_weights(base)
    replicas = []
    for rank, device in enumerate(plan.devices):
        model = copy.deepcopy(base).to(device)
        if compiles_drafter(config, device):
            # One graph per bucket for the whole drafter forward (flex inside it), so the
            # elementwise work around the matmuls fuses; the module itself stays
            # uncompiled, so checkpoints keep plain parameter names.
            model.forward = torch.compile(model.forward, dynamic=False)
        if plan.config.fp8 == "all":
            use_fp8_linears(model)
        optimizer = make_optimizer(model, plan.config.lr, plan.config.weight_decay,
                                   (plan.config.adam_beta1, plan.config.adam_beta2))
        scheduler = warmup_cosine(optimizer, config.steps, plan.config.warmup_ratio, plan.config.min_lr_ratio)
        if checkpoint is not None:
            restore_trainer(checkpoint, optimizer, scheduler)
        replicas.append(Replica(
            name=plan.name, rank=rank, device=device, drafter=model, optimizer=optimizer, scheduler=scheduler,
            frozen=frozen.on(device), objective=plan.objective, layer_ids=plan.drafter_config.target_layer_ids,
            attention_backend=backends[device], autocast_dtype=autocast_dtype(config, device),
            clip_grad=plan.config.clip_grad,
        ))
    return replicas


def build_evaluation(config: TrainConfig, supply: FeatureSupply, steps: StepRange, log: TextIO) -> EvaluationSchedule | None:
    """The in-training evaluator (real tau by speculative decoding every --eval-every steps),
    its prompts rendered in the thinking mode the training rows were."""
    if not config.eval_every:
        return None
    from ..eval.in_training import InTrainingEvaluator

    target = supply.first
    evaluator = InTrainingEvaluator.from_benchmark(
        target, config.eval_bench, limit=config.eval_limit, max_new_tokens=config.eval_max_new_tokens,
        enable_thinking=evaluation_thinking(config, supply))
    print(f"in-training eval: real tau every {config.eval_every} steps on {len(evaluator.prompts)} "
          f"{config.eval_bench} prompts, {config.eval_max_new_tokens} new tokens, on {target.device}", file=log)
    return EvaluationSchedule(evaluator, config.eval_every, steps.end)


@dataclass
class Pipeline:
    """The built run, ready to start: its workers and what the coordinator watches."""

    stop: StopSignal
    reports: queue.Queue
    router: BatchRouter
    planner: BatchPlanner
    target_workers: list[TargetWorker]
    drafter_workers: list[DrafterWorker]
    reducers: list[GradientReducer]
    targets: list[Target]
    warmup: Warmup | None = None
    gate: CompileGate | None = None  # when the run compiles

    @property
    def workers(self) -> list:
        return [*self.target_workers, *self.drafter_workers]

    def rank0(self, plan: DrafterPlan) -> DrafterWorker:
        return next(w for w in self.drafter_workers if w.replica.name == plan.name and w.replica.rank == 0)


def step_share(config: TrainConfig, plans: list[DrafterPlan], nodes: NodeGroup) -> tuple[int, range]:
    """Micro-batches per step over every node (nodes × replicas × grad_accum), and the
    contiguous range of them this node trains."""
    local = (len(plans[0].devices) if config.mode == "replicas" else 1) * config.grad_accum
    return local * nodes.world_size, range(nodes.rank * local, (nodes.rank + 1) * local)


def build_pipeline(
    config: TrainConfig, layout: Layout, plans: list[DrafterPlan], supply: FeatureSupply,
    sources: list[FeatureSource], samples: Sequence[Any], resume: ResumePoint, steps: StepRange, *, gate: CompileGate | None, evaluation: EvaluationSchedule | None,
    step_hook: StepHook | None, save_checkpoints: bool, graphs: GraphChoice, log: TextIO,
    compile_cache: CompileCacheReport | None = None, nodes: NodeGroup | None = None, stream: dict | None = None,
    target: dict[str, str] | None = None,
) -> Pipeline:
    nodes = nodes or NodeGroup()
    stop = StopSignal()
    reports: queue.Queue = queue.Queue()
    grad_accum = config.grad_accum
    global_batches, share = step_share(config, plans, nodes)
    batches_per_step = len(share)
    slots = [(plan, rank) for plan in plans for rank in range(len(plan.devices))]
    warmup = Warmup(len(sources) + len(slots), stop, log, run_dir=Path(config.out), compile_cache=compile_cache,
                    gate=gate)
    router = BatchRouter(len(supply.targets), len(slots), batches_per_step=batches_per_step, grad_accum=grad_accum,
                         every_drafter_trains_every_batch=config.mode == "variants", depth=config.prefetch)
    union = layer_union(plans)
    backends = attention_backends(config, layout)
    frozen = FrozenPartsByDevice(supply.first, config)

    drafter_workers, reducers = [], []
    for plan in plans:
        if nodes.writes:
            write_run_record(plan, config)
        replicas = build_replicas(plan, config, resume, frozen, backends, nodes)
        for replica in replicas:  # its step: graphed, or eager with its compiles before step 1
            attach_step(replica, config, graphs, shape_buckets(config), feature_dtype(sources),
                        compiled=compiles_drafter(config, replica.device) or backends[replica.device] == "flex")
        checkpointer = Checkpointer(
            plan.run_dir, config.save_every, config.keep_checkpoints,
            {"train_config": dataclasses.asdict(plan.config), "layer_union": union, "stream": stream, "target": target},
            saved_step=steps.start,
        ) if save_checkpoints and nodes.writes else None
        across = NodeStep(
            nodes, drafter=plan.name, start=steps.start, end=steps.end, local_replicas=len(replicas),
            block_size=plan.drafter_config.block_size, stop=stop, reports=reports,
            busy_after=rank0_busy_after(checkpointer, evaluation, steps.end),
        ) if nodes.distributed else None
        reducer = GradientReducer([r.drafter for r in replicas], stop, across) if len(replicas) > 1 or across else None
        if reducer is not None:
            reducers.append(reducer)
        for replica in replicas:
            slot = slots.index((plan, replica.rank))
            thread_name = f"drafter-{slot}" + (f"[{plan.name}]" if config.mode == "variants" else "")
            rank0 = replica.rank == 0
            indices = list(range(replica.rank * grad_accum, (replica.rank + 1) * grad_accum))
            drafter_workers.append(DrafterWorker(DrafterSetup(
                thread_name=thread_name, replica=replica, inbox=router.inbox(slot, indices, stop), steps=steps,
                stop=stop, reports=reports, reducer=reducer, checkpointer=checkpointer if rank0 else None,
                evaluation=evaluation if rank0 and nodes.writes else None,
                hook=step_hook, warmup=warmup,
            )))

    planner = BatchPlanner(
        samples, batch_size=config.batch_size, batches_per_step=global_batches, share=share, buckets=shape_buckets(config),
        seed=config.seed, objectives={plan.name: plan.objective for plan in plans},
        pad_id=(supply.first.tokenizer.pad_token_id or 0) if supply.first.tokenizer is not None else 0,
        pin_memory=layout.uses_cuda,
    )
    sources = graphed_sources(sources, graphs, shape_buckets(config), config.batch_size,
                              compiled=lambda device: compiles_target(config, device))
    target_workers = [
        TargetWorker(TargetSetup(f"target-{t}", t, source, planner, router, steps, stop, warmup=warmup))
        for t, source in enumerate(sources)
    ]
    return Pipeline(stop, reports, router, planner, target_workers, drafter_workers, reducers, supply.targets, warmup,
                    gate)


def rank0_busy_after(checkpointer: Checkpointer | None, evaluation: EvaluationSchedule | None, end: int):
    """Whether rank 0 has work of its own after a step (a periodic checkpoint, an in-training
    eval): it says so in that step's vote, and the other nodes wait for it without a time limit."""
    def busy(step: int) -> bool:
        return bool((checkpointer is not None and checkpointer.due(step + 1, end))
                    or (evaluation is not None and evaluation.due(step)))

    return busy


def cpu_threads_per_worker(pipeline: Pipeline) -> int | None:
    """On a CPU-only run every worker computes on the same cores: one intra-op pool each, not
    one per core each (oversubscribed OpenMP pools run several times slower, not just slower)."""
    if any(w.device.type != "cpu" for w in pipeline.drafter_workers) or any(t.device.type != "cpu" for t in pipeline.targets):
        return None
    return max(1, (os.cpu_count() or 1) // len(pipeline.workers))
