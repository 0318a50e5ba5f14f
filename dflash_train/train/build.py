"""The build steps of a training run, in the order `train()` calls them, and the `Run` they make.

    layout          which devices run target workers and drafter workers (layout.py; see
                    parallel.launch.place_devices for several processes on one host)
    drafter plans   one plan per drafter to train (replicas: one; variants: one per entry)
    run folder      checked and created (`prepare_run_folder`)
    feature supply  the target(s) and where features come from (supply.py), the samples
    drafter shapes  each plan's DrafterConfig and ObjectiveConfig, from the target
    resume point    the step to start from and the checkpoints to load (resume.py)
    compile gate    when anything compiles (compile_gate.py)
    evaluator       the in-training evaluation, on the node that writes
    pipeline        from the `Run`: replicas (replicas.py), checkpointers, queues, workers

Each step is a function of what the steps before it returned; none starts a thread. Policy
lives in the rooms named for it: precision.py (compiles, attention backend, dtypes, FP8),
replicas.py (weight init), resume.py (the resume point and set-aside checkpoints).
"""

from __future__ import annotations

import functools
import os
import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

from ..config import TrainConfig
from ..core.attention import FLEX_BACKENDS
from ..core.drafter import DrafterConfig
from ..core.objective import ObjectiveConfig
from ..files import check_outside_inputs, remove_leftover_staging, write_json_atomic
from ..parallel.gradients import GradientReducer, NodeReduce
from ..parallel.nodes import NodeGroup
from ..parallel.threads import StopSignal
from ..parallel.vote import StepVote
from ..target.model import Target, resolve_mask_token_id
from .batches import BatchPlanner, shape_buckets
from .compile_cache import CompileCacheReport
from .compile_gate import CompileGate, recompile_limit_for
from .drafter_worker import DrafterSetup, DrafterWorker, StepHook
from .layout import DrafterPlan, Layout, layer_union, step_share
from .precision import attention_backends, check_fp8_support, compiles_drafter, compiles_target, uses_fused_head
from .rank_zero import Checkpointer, EvaluationSchedule, LoggedSteps, RankZeroWork
from .replicas import FrozenPartsByDevice, build_replicas
# RUN_FILES, RUN_FOLDER_FILES: what a run writes (resume.py reads a run folder by them), named here too.
from .resume import RUN_FILES, RUN_FOLDER_FILES, ResumePoint, StepRange, check_run_folder, resume_history  # noqa: F401
from .routing import BatchRouter, FeatureSource
from .startup import GraphChoice, Warmup, attach_step, feature_dtype, graphed_sources
from .supply import FeatureSupply, evaluation_thinking
from .target_worker import TargetSetup, TargetWorker

# --- run folder --------------------------------------------------------------------------------

def prepare_run_folder(config: TrainConfig, plans: list[DrafterPlan]) -> Path:
    """The run folder, created if new; call it holding the folder's lock (`files.hold_output`),
    so that no live process writes there meanwhile. It is never inside one of the run's inputs,
    and holds nothing but the run --resume continues (`resume.check_run_folder`); what an
    interrupted checkpoint write left behind is cleaned up."""
    out = Path(config.checkpoint.out)
    check_outside_inputs(out, "--out", [config.model.target, config.data.features, *config.data.data,
                                        *([config.eval.eval_bench] if Path(config.eval.eval_bench).is_file() else [])])
    check_run_folder(config)
    out.mkdir(parents=True, exist_ok=True)
    for plan in plans:
        remove_leftover_staging(plan.run_dir / "checkpoints")
    return out


def write_run_record(plan: DrafterPlan, config: TrainConfig, resume: ResumePoint) -> None:
    """run.json: the settings this drafter trains with, its drafter config, and each resume's
    step and changed settings (`resume.resume_history`: what trained the steps before)."""
    path = plan.run_dir / "run.json"
    write_json_atomic(path, {
        "train_config": plan.config.flat_values(), "drafter_config": plan.drafter_config.to_dict(),
        "target": str(config.model.target), "mode": config.parallel.mode, "name": plan.name,
        "resumes": resume_history(path, plan.name, resume),
    }, indent=2)


# --- drafter shapes ----------------------------------------------------------------------------

def describe_drafters(plans: list[DrafterPlan], config: TrainConfig, target: Target, log: TextIO) -> None:
    """Each plan's drafter and objective, sized from the target; --fp8 checked against both."""
    mask_token_id = resolve_mask_token_id(config.model.mask_token_id, target.tokenizer, target.embed_weight.shape[0])
    for plan in plans:
        if plan.config.anchor_slots() < plan.config.objective.num_anchors:
            print(f"{plan.name}: --num-anchors {plan.config.objective.num_anchors} is more than --max-seq-len "
                  f"{plan.config.data.max_seq_len}: training {plan.config.anchor_slots()} anchor slots per sequence "
                  "(a sequence has no more anchor positions; the loss is the same)", file=log)
        plan.drafter_config = DrafterConfig.from_target(
            target.spec, num_layers=plan.config.model.num_layers, block_size=plan.config.model.block_size,
            mask_token_id=mask_token_id, target_layer_ids=plan.config.model.target_layer_ids or None,
            **dflash2_fields(plan.config),
        )
        compiled_head = all(compiles_drafter(config, device) for device in plan.devices)
        plan.objective = ObjectiveConfig(
            block_size=plan.config.model.block_size, num_anchors=plan.config.anchor_slots(), loss=plan.config.objective.loss,
            gamma=plan.config.objective.gamma, dpace_alpha=plan.config.objective.dpace_alpha, loss_chunk_rows=plan.config.objective.loss_chunk_rows,
            compiled_head=compiled_head,
            fused_head=compiled_head and uses_fused_head(plan, target.spec.final_logit_softcapping, log),
            fp8_head=plan.config.parallel.fp8 != "off", pack_anchors=plan.config.parallel.pack_anchors == "on",
            selector_weight=plan.config.objective.selector_weight, selector_miss=plan.config.objective.selector_miss,
        )
        if plan.config.parallel.fp8 != "off":
            check_fp8_support(plan, target)


def dflash2_fields(config: TrainConfig) -> dict:
    """The drafter's architecture and, for DFlash2, its sizes (a DFlash drafter keeps the defaults)."""
    if config.model.arch != "dflash2":
        return {"arch": config.model.arch}
    return {key: getattr(config.model, key) for key in ("arch", "conv_kernel_size", "conv_group_size", "selector_rank",
                                                   "selector_top_k")}


# --- compile gate, evaluator -------------------------------------------------------------------

def compile_gate(config: TrainConfig, layout: Layout, plans: list[DrafterPlan], target: Target) -> CompileGate | None:
    """The run's compile gate when anything compiles (train/compile_gate.py), else None. Under
    CUDA graphs the target's feature forward compiles too (in its thread's warm-up, which runs
    alone: startup.Warmup), once per bucket and target thread."""
    backends = attention_backends(config, layout)
    compiles = (any(b in FLEX_BACKENDS for b in backends.values())
                or any(compiles_drafter(config, d) for d in layout.drafter_devices)
                or any(compiles_target(config, d, target) for d in layout.target_devices))
    if not compiles:
        return None
    threads = max(sum(len(plan.devices) for plan in plans), len(layout.target_devices))
    # Packed anchors: up to one drafter shape per whole rows' worth of anchor slots in each length bucket.
    shapes = len(shape_buckets(config)) * (config.optimizer.batch_size if config.parallel.pack_anchors == "on" else 1)
    return CompileGate(recompile_limit=recompile_limit_for(shapes, threads),
                       after_warmup="fail" if config.parallel.fail_on_recompile else "eager")


def build_evaluation(config: TrainConfig, supply: FeatureSupply, steps: StepRange, log: TextIO) -> EvaluationSchedule | None:
    """The in-training evaluator (real tau by speculative decoding every --eval-every steps),
    its prompts rendered in the thinking mode the training rows were."""
    if not config.eval.eval_every:
        return None
    from ..eval.in_training import InTrainingEvaluator

    target = supply.first
    evaluator = InTrainingEvaluator.from_benchmark(
        target, config.eval.eval_bench, limit=config.eval.eval_limit, max_new_tokens=config.eval.eval_max_new_tokens,
        enable_thinking=evaluation_thinking(config, supply))
    print(f"in-training eval: real tau every {config.eval.eval_every} steps on {len(evaluator.prompts)} "
          f"{config.eval.eval_bench} prompts, {config.eval.eval_max_new_tokens} new tokens, on {target.device}", file=log)
    return EvaluationSchedule(evaluator, config.eval.eval_every, steps.end)


# --- the run, and its pipeline: replicas, queues, workers --------------------------------------

@dataclass
class Run:
    """What the build steps decided, in their order; nothing of it runs yet. The pipeline is
    built from it (`build_pipeline`) and the coordinator runs both."""

    config: TrainConfig
    nodes: NodeGroup
    layout: Layout
    graphs: GraphChoice  # the CUDA-graph choice (startup.choose_cuda_graphs)
    plans: list[DrafterPlan]
    folder: Path  # --out
    supply: FeatureSupply
    sources: list[FeatureSource]  # one per target worker
    samples: Sequence[Any]
    stream: dict  # the data stream's identity (batches.stream_identity), recorded in each checkpoint
    target: dict[str, str] | None  # the target's identity (resume.run_target_identity), likewise
    resume: ResumePoint
    steps: StepRange
    gate: CompileGate | None  # when anything compiles
    compile_cache: CompileCacheReport | None
    evaluation: EvaluationSchedule | None  # --eval-every, on the node that writes
    log: TextIO

    @property
    def drafter_threads(self) -> list[tuple[DrafterPlan, int]]:
        """One (plan, replica rank) per drafter thread, in thread order."""
        return [(plan, rank) for plan in self.plans for rank in range(len(plan.devices))]


@dataclass
class Pipeline:
    """The run's threads, built and not started: its workers and what the coordinator watches."""

    stop: StopSignal
    reports: queue.Queue
    router: BatchRouter
    planner: BatchPlanner
    target_workers: list[TargetWorker]
    drafter_workers: list[DrafterWorker]
    reducers: list[GradientReducer]
    targets: list[Target]
    logged: LoggedSteps  # the coordinator marks each step's written line; checkpoints wait for it
    warmup: Warmup | None = None
    gate: CompileGate | None = None  # when the run compiles

    @property
    def workers(self) -> list:
        return [*self.target_workers, *self.drafter_workers]

    def rank0(self, plan: DrafterPlan) -> DrafterWorker:
        return next(w for w in self.drafter_workers if w.replica.name == plan.name and w.replica.rank == 0)


@dataclass
class Shared:
    """What every worker thread of the pipeline shares."""

    stop: StopSignal
    reports: queue.Queue  # StepReports for the coordinator
    router: BatchRouter
    warmup: Warmup
    logged: LoggedSteps  # the steps whose metrics lines are on disk


def build_pipeline(run: Run, *, step_hook: StepHook | None = None, save_checkpoints: bool = True) -> Pipeline:
    """The run's workers: per drafter its replicas and drafter threads, then the target threads.
    `step_hook` runs in each drafter thread after each step; `save_checkpoints=False` writes none."""
    shared = share_between_threads(run)
    frozen = FrozenPartsByDevice(run.supply.first, run.config)
    drafter_workers, reducers = [], []
    for plan in run.plans:
        workers, reducer = build_drafter_workers(run, plan, shared, frozen, step_hook, save_checkpoints)
        drafter_workers += workers
        reducers += [reducer] if reducer is not None else []
    planner = plan_batches(run)
    target_workers = build_target_workers(run, planner, shared)
    return Pipeline(shared.stop, shared.reports, shared.router, planner, target_workers, drafter_workers, reducers,
                    run.supply.targets, shared.logged, shared.warmup, run.gate)


def share_between_threads(run: Run) -> Shared:
    """The stop signal, the report queue, the batch router and the start-up gate every worker
    thread (targets' and drafters') waits at."""
    config = run.config
    stop = StopSignal()
    threads = len(run.sources) + len(run.drafter_threads)
    warmup = Warmup(threads, stop, run.log, run_dir=run.folder, compile_cache=run.compile_cache, gate=run.gate)
    _, share = step_share(config, run.plans, run.nodes)
    router = BatchRouter(len(run.supply.targets), len(run.drafter_threads), batches_per_step=len(share),
                         grad_accum=config.optimizer.grad_accum, every_drafter_trains_every_batch=config.parallel.mode == "variants",
                         depth=config.parallel.prefetch)
    return Shared(stop, queue.Queue(), router, warmup, LoggedSteps())


def build_drafter_workers(
    run: Run, plan: DrafterPlan, shared: Shared, frozen: FrozenPartsByDevice, step_hook: StepHook | None,
    save_checkpoints: bool,
) -> tuple[list[DrafterWorker], GradientReducer | None]:
    """One drafter's replicas, each with its step attached, its checkpointer (rank 0), the reducer
    of its gradients (several replicas or nodes), its vote (nodes) and one drafter thread per replica."""
    config, nodes, steps = run.config, run.nodes, run.steps
    if nodes.writes:
        write_run_record(plan, config, run.resume)
    backends = attention_backends(config, run.layout)
    replicas = build_replicas(plan, config, run.resume, frozen, backends, nodes)
    for replica in replicas:  # its step: graphed, or eager with its compiles before step 1
        attach_step(replica, config, run.graphs, shape_buckets(config), feature_dtype(run.sources),
                    compiled=compiles_drafter(config, replica.device) or backends[replica.device] in FLEX_BACKENDS)
    checkpointer = Checkpointer(
        plan.run_dir, config.checkpoint.save_every, config.checkpoint.keep_checkpoints,
        {"train_config": plan.config.flat_values(), "layer_union": layer_union(run.plans), "stream": run.stream,
         "target": run.target},
        saved_step=steps.start, logged=shared.logged, line_lag=1 if nodes.distributed else 0,
    ) if save_checkpoints and nodes.writes else None
    vote = StepVote(
        nodes, drafter=plan.name, start=steps.start, end=steps.end, local_replicas=len(replicas),
        block_size=plan.drafter_config.block_size, stop=shared.stop,
        busy_after=RankZeroWork(checkpointer, run.evaluation, steps.end).busy_after,
    ) if nodes.distributed else None
    across = NodeReduce(nodes) if nodes.distributed else None
    reducer = GradientReducer([r.drafter for r in replicas], shared.stop, across) if len(replicas) > 1 or across else None
    workers = []
    for replica in replicas:
        slot = run.drafter_threads.index((plan, replica.rank))
        thread_name = f"drafter-{slot}" + (f"[{plan.name}]" if config.parallel.mode == "variants" else "")
        rank0 = replica.rank == 0
        indices = list(range(replica.rank * config.optimizer.grad_accum, (replica.rank + 1) * config.optimizer.grad_accum))
        workers.append(DrafterWorker(DrafterSetup(
            thread_name=thread_name, replica=replica, inbox=shared.router.inbox(slot, indices, shared.stop),
            steps=steps, stop=shared.stop, reports=shared.reports, reducer=reducer, vote=vote,
            checkpointer=checkpointer if rank0 else None, evaluation=run.evaluation if rank0 and nodes.writes else None,
            hook=step_hook, warmup=shared.warmup,
        )))
    return workers, reducer


def plan_batches(run: Run) -> BatchPlanner:
    """The static-shaped host batches of every step, this node's share of them."""
    config = run.config
    global_batches, share = step_share(config, run.plans, run.nodes)
    tokenizer = run.supply.first.tokenizer
    return BatchPlanner(
        run.samples, batch_size=config.optimizer.batch_size, batches_per_step=global_batches, share=share,
        buckets=shape_buckets(config), seed=config.optimizer.seed, objectives={plan.name: plan.objective for plan in run.plans},
        pad_id=(tokenizer.pad_token_id or 0) if tokenizer is not None else 0, pin_memory=run.layout.uses_cuda,
    )


def build_target_workers(run: Run, planner: BatchPlanner, shared: Shared) -> list[TargetWorker]:
    """One target thread per feature source, its forward graphed under --cuda-graphs."""
    config = run.config
    sources = graphed_sources(run.sources, run.graphs, shape_buckets(config), config.optimizer.batch_size,
                              compiled=functools.partial(compiles_target, config))
    return [TargetWorker(TargetSetup(f"target-{t}", t, source, planner, shared.router, run.steps, shared.stop,
                                     warmup=shared.warmup))
            for t, source in enumerate(sources)]


def cpu_threads_per_worker(pipeline: Pipeline) -> int | None:
    """On a CPU-only run every worker computes on the same cores: one intra-op pool each, not
    one per core each (oversubscribed OpenMP pools run several times slower, not just slower)."""
    if any(w.device.type != "cpu" for w in pipeline.drafter_workers) or any(t.device.type != "cpu" for t in pipeline.targets):
        return None
    return max(1, (os.cpu_count() or 1) // len(pipeline.workers))
