"""`train()`: a training run as a sequence of named build steps and a coordinator.

Layout comes from device lists: `target_devices` run TargetWorkers, `drafter_devices` run
DrafterWorkers (several threads may share a device). A one-device run is the degenerate
case of the same pipeline (one target thread and one drafter thread on that device), so
there is exactly one training loop.

Modes:
  replicas  one drafter, data-parallel over the drafter devices; gradients summed in-process
            after every backward, so every replica holds identical weights after every step.
  variants  several independent drafters (each with its own block size, depth, loss, ...)
            trained from one target stream, each in its own run folder.

Under torchrun (one process per node) the same pipeline runs in every node's process and the
nodes are joined by a `NodeGroup` (parallel/nodes.py): a step's batches are split over
the nodes, gradients are all-reduced across them, every stop is agreed, and rank 0 writes.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from ..config import PER_NODE_SETTINGS, ConfigError, TrainConfig
from ..decode.families import describe_target
from ..files import hold_output, remove_if_empty
from ..parallel.launch import check_launch, detect_launch, gradient_backend
from ..parallel.nodes import NodeGroup
from ..target.model import Target
from .batches import stream_identity
from .build import Pipeline, Run, build_evaluation, build_pipeline, compile_gate, describe_drafters, prepare_run_folder
from .compile_cache import load_compile_cache
from .compile_gate import CompileGate
from .coordinator import Coordinator
from .drafter_worker import StepHook
from .layout import DrafterPlan, Layout, layer_union, plan_drafters, resolve_layout, step_share
from .precision import attention_backends, uncompiled_target_note
from .reporting import Sink, open_sinks
from .resume import (ResumePoint, check_recorded_settings, find_resume_point, run_target_identity,
                     set_aside_later_checkpoints, step_range)
from .startup import choose_cuda_graphs
from .supply import check_batch_size, check_inputs, load_feature_supply, load_samples
from .tensorboard import tensorboard_enabled


def train(
    config: TrainConfig,
    *,
    samples: Sequence[Any] | None = None,
    target: Target | Sequence[Target] | None = None,
    log: TextIO | None = None,
    step_hook: StepHook | None = None,
    stop_at: int | None = None,
    save_checkpoints: bool = True,
    sinks: Sequence[Sink] = (),
) -> dict:
    """Run training; returns the summary dict (also written to OUT/summary.json).

    `samples`/`target` (one Target, or one per target device) may be given directly (tests,
    quickstart); otherwise they are read from config.data.data / config.model.target. `step_hook(worker,
    step)` runs in each drafter thread after each step (tests use it to inspect replicas or
    inject faults). `stop_at` ends the run after that step as an interruption would (the LR
    schedule still spans config.optimizer.steps). `save_checkpoints=False` (benchmarks) writes no
    checkpoint at all. `sinks` receive every step record besides the run's own files.
    """
    log = log or sys.stdout
    if not config.checkpoint.out:
        raise ConfigError("no run folder: pass --out RUN_DIR")
    out = Path(config.checkpoint.out)
    check_inputs(config, samples_given=samples is not None, target_given=target is not None)
    launch = detect_launch()
    check_launch(config.parallel.mode, launch)
    layout = resolve_layout(config, launch)
    graphs = choose_cuda_graphs(config, [*layout.target_devices, *layout.drafter_devices])
    tensorboard_enabled(config.logging.tensorboard)  # --tensorboard on without the package fails before any model loads
    with NodeGroup(launch, backend=gradient_backend(config.parallel.dist_backend, layout.drafter_devices),
                   timeout=config.parallel.dist_timeout) as nodes, contextlib.ExitStack() as owned:
        if nodes.distributed:
            print(f"nodes: {nodes.describe()}", file=log)
            nodes.agree(settings_every_node_shares(config), "the settings")  # before anything loads or is written
        plans = plan_drafters(config, layout)
        # A resume that changes what its checkpoint fixes: refused before the target loads.
        check_recorded_settings(config, plans, step_share(config, plans, nodes)[0])
        if nodes.writes:  # rank 0 owns the run folder (the others write nothing), one live process at a time
            owned.enter_context(hold_output(out, "--out"))
            if not out.exists():  # a run that fails before writing anything leaves no empty folder behind
                owned.callback(remove_if_empty, out)
            prepare_run_folder(config, plans)
        # The others load nothing until rank 0 has checked the run folder: a refusal there (another
        # run's folder, your files) reaches every node at once, not after minutes of loading.
        nodes.wait_for("the run folder", [0], "waiting for rank 0 to check the run folder")
        supply = load_feature_supply(config, layout, target, log)
        rendering = None
        if samples is None:
            samples, rendering = load_samples(config, supply, log)
        check_batch_size(config, samples)
        print(describe_target(supply.first, config.data.max_seq_len), file=log)
        describe_drafters(plans, config, supply.first, log)
        sources = supply.sources(layout, layer_union(plans), log)
        stream = stream_identity(samples, seed=config.optimizer.seed, batch_size=config.optimizer.batch_size,
                                 batches_per_step=step_share(config, plans, nodes)[0], max_seq_len=config.data.max_seq_len)
        identity = run_target_identity(config, supply)
        resume = agreed_resume_point(config, plans, nodes, stream, identity, log)
        steps = step_range(config, resume, stop_at, log)
        gate = entered_compile_gate(config, layout, plans, supply.first, owned, log)
        compile_cache = load_compile_cache(out, log) if gate is not None else None
        evaluation = build_evaluation(config, supply, steps, log) if nodes.writes else None
        run = Run(config=config, nodes=nodes, layout=layout, graphs=graphs, plans=plans, folder=out, supply=supply,
                  sources=sources, samples=samples, stream=stream, target=identity, resume=resume, steps=steps,
                  gate=gate, compile_cache=compile_cache, evaluation=evaluation, log=log)
        pipeline = build_pipeline(run, step_hook=step_hook, save_checkpoints=save_checkpoints)
        print(layout_line(run, pipeline) + f"\ncuda graphs: {graphs.reason}", file=log)
        note = uncompiled_target_note(config, layout.target_devices, supply.first) if graphs.enabled and supply.cache is None else None
        if note:
            print(note, file=log)
        run_sinks = open_run_sinks(run, sinks)
        if rendering is not None and nodes.writes:  # the run is under way: its next start reads the rows back
            rendering.keep(out)
        nodes.wait_for("built", range(nodes.world_size), "waiting for every node to load its models and data")
        summary = Coordinator(run, pipeline, run_sinks).run()
        # The rows the drafters learned from (after the supervised-token filter), for whoever reports the run.
        summary["data"] = {"samples": len(pipeline.planner.samples), "batches_per_epoch": pipeline.planner.batches_per_epoch}
        return summary


def agreed_resume_point(config: TrainConfig, plans: list[DrafterPlan], nodes: NodeGroup, stream: dict,
                        target: dict[str, str] | None, log: TextIO) -> ResumePoint:
    """The resume point every node agrees on; only then are the checkpoints past it set aside
    (by the run folder's owner), so a refused resume changes nothing."""
    resume = find_resume_point(config, plans, log, stream, target)
    nodes.agree({"the data stream": stream, "the resumed step": resume.start_step,
                 "the checkpoint": {name: Path(path).name for name, path in resume.checkpoints.items()}},
                "what to train")
    if nodes.writes:
        set_aside_later_checkpoints(plans, resume, log)
    return resume


def entered_compile_gate(config: TrainConfig, layout: Layout, plans: list[DrafterPlan], target: Target,
                         owned: contextlib.ExitStack, log: TextIO) -> CompileGate | None:
    """The run's compile gate, entered before any worker starts and left (by `owned`) after all
    have ended; None when nothing compiles."""
    gate = compile_gate(config, layout, plans, target)
    if gate is not None:
        owned.enter_context(gate)
        print(f"compile gate: {gate.describe()}", file=log)
    return gate


def open_run_sinks(run: Run, extra: Sequence[Sink]) -> list[Sink]:
    """Where step records go: metrics.jsonl and pipeline.jsonl (and TensorBoard event files) on
    the node that writes, then the caller's sinks; none on the other nodes."""
    if not run.nodes.writes:
        return []
    config = run.config
    run_dirs = {plan.name: plan.run_dir for plan in run.plans}
    own = open_sinks(run.folder, run_dirs, resumed_at=run.steps.start if config.checkpoint.resume else None,
                     tensorboard=config.logging.tensorboard)
    if len(own) > 1:
        print(f"tensorboard: event files next to metrics.jsonl; watch with: tensorboard --logdir {run.folder}",
              file=run.log)
    return [*own, *extra]


def settings_every_node_shares(config: TrainConfig) -> dict[str, Any]:
    """What must be equal on every node, by flag: every setting but the per-node ones (paths,
    devices), and the target's identity (its files, wherever each node mounts them)."""
    shared = {"--" + name.replace("_", "-"): value for name, value in config.flat_values().items()
              if name not in PER_NODE_SETTINGS}
    identity = run_target_identity(config)
    if identity is not None:
        shared["the target (--target's config.json and sampled weights)"] = " ".join(
            f"{key} {value[:16]}" for key, value in sorted(identity.items()))
    return shared


def layout_line(run: Run, pipeline: Pipeline) -> str:
    config, plans, nodes = run.config, run.plans, run.nodes
    backends = attention_backends(config, run.layout)
    drafters = "; ".join(
        f"{p.name}: {p.drafter_config.arch}, {p.drafter_config.num_hidden_layers} layers, B={p.drafter_config.block_size}, "
        f"N={p.objective.num_anchors}, loss={p.objective.loss}, layers {p.drafter_config.target_layer_ids} "
        f"on {', '.join(map(str, p.devices))}, attention {'/'.join(sorted({backends[d] for d in p.devices}))}"
        + (", master weights" if p.config.parallel.master_weights == "on" else "")
        + (", anchors packed" if p.objective.pack_anchors else "")
        for p in plans
    )
    planner = pipeline.planner
    across = ""
    if nodes.distributed:
        across = (f"; {nodes.world_size} nodes x {len(planner.share)} micro-batches = {planner.batches_per_step} per "
                  f"step, this node trains {planner.share.start}..{planner.share.stop - 1}")
    return (
        f"pipeline: {config.parallel.mode}; target on {', '.join(str(t.device) for t in pipeline.targets)}; {drafters}\n"
        f"data: {len(planner.samples)} samples, {planner.batches_per_epoch} batches/epoch of {config.optimizer.batch_size}, "
        f"buckets {planner.buckets}; steps {run.steps.start}->{config.optimizer.steps}{across}"
    )
