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
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from ..config import ConfigError, TrainConfig
from ..target import Target
from .build import (
    build_evaluation, build_pipeline, describe_drafters, find_resume_point, layer_union, load_feature_supply,
    load_samples, plan_drafters, prepare_compile_safety, resolve_layout, step_range,
)
from .compile_cache import load_compile_cache
from .coordinator import Coordinator
from .reporting import Sink, open_sinks
from .startup import choose_cuda_graphs
from .workers import StepHook


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
    quickstart); otherwise they are read from config.data / config.target. `step_hook(worker,
    step)` runs in each drafter thread after each step (tests use it to inspect replicas or
    inject faults). `stop_at` ends the run after that step as an interruption would (the LR
    schedule still spans config.steps). `save_checkpoints=False` (benchmarks) writes no
    checkpoint at all. `sinks` receive every step record besides the run's own files.
    """
    log = log or sys.stdout
    config.validate()
    if not config.out:
        raise ConfigError("no run folder: pass --out RUN_DIR")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)

    layout = resolve_layout(config)
    graphs = choose_cuda_graphs(config, [*layout.target_devices, *layout.drafter_devices])
    plans = plan_drafters(config, layout)
    supply = load_feature_supply(config, layout, target, log)
    if samples is None:
        samples = load_samples(config, supply, log)
    describe_drafters(plans, config, supply.first)
    sources = supply.sources(layout, layer_union(plans), log)
    resume = find_resume_point(config, plans, log)
    steps = step_range(config, resume, stop_at, log)
    compiles = prepare_compile_safety(config, layout, plans, log)
    compile_cache = load_compile_cache(out, log) if compiles else None
    evaluation = build_evaluation(config, supply.first, steps, log)
    pipeline = build_pipeline(config, layout, plans, supply, sources, samples, resume, steps, compiles=compiles,
                              evaluation=evaluation, step_hook=step_hook, save_checkpoints=save_checkpoints,
                              graphs=graphs, log=log, compile_cache=compile_cache)
    print(layout_line(config, plans, pipeline, steps.start) + f"\ncuda graphs: {graphs.reason}", file=log)

    all_sinks = [*open_sinks({plan.name: plan.run_dir / "metrics.jsonl" for plan in plans}, out / "pipeline.jsonl"),
                 *sinks]
    return Coordinator(config, plans, pipeline, steps, all_sinks, log).run()


def layout_line(config: TrainConfig, plans, pipeline, start: int) -> str:
    drafters = "; ".join(
        f"{p.name}: {p.drafter_config.num_hidden_layers} layers, B={p.drafter_config.block_size}, "
        f"N={p.objective.num_anchors}, loss={p.objective.loss}, layers {p.drafter_config.target_layer_ids} "
        f"on {', '.join(map(str, p.devices))}"
        for p in plans
    )
    planner = pipeline.planner
    return (
        f"pipeline: {config.mode}; target on {', '.join(str(t.device) for t in pipeline.targets)}; {drafters}\n"
        f"data: {len(planner.samples)} samples, {planner.batches_per_epoch} batches/epoch of {config.batch_size}, "
        f"buckets {planner.buckets}; steps {start}->{config.steps}"
    )
