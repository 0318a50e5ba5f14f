"""The coordinator: builds the pipeline from a TrainConfig, runs it, reports, stops cleanly.

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

import copy
import dataclasses
import json
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

import torch

from ..attention import resolve_backend
from ..checkpoint import load_drafter, read_state, restore_trainer, resumable_checkpoint
from ..config import ConfigError, TrainConfig, unknown_key_error
from ..drafter import DFlashDrafter, DrafterConfig
from ..export import export_model
from ..fp8 import check_fp8_dims, fp8_unsupported, use_fp8_linears
from ..objective import ObjectiveConfig, summarize_metrics
from ..progress import Progress, format_seconds
from ..step import FrozenTargetParts, make_optimizer, warmup_cosine
from ..target import Target, TargetSpec, load_target, resolve_device, resolve_mask_token_id
from .batches import BatchPlanner, HostBatch, auto_buckets
from .runtime import StopSignal
from .workers import DrafterSetup, DrafterWorker, GradientReducer, StepReport, TargetWorker, wait_for_workers

# Keys a variant may override; everything else is shared by construction (one target stream).
VARIANT_KEYS = (
    "name", "block_size", "num_layers", "num_anchors", "target_layer_ids", "loss", "gamma", "dpace_alpha",
    "lr", "weight_decay", "adam_beta1", "adam_beta2", "warmup_ratio", "min_lr_ratio", "clip_grad", "seed", "fp8",
)


def resolve_layout(config: TrainConfig) -> tuple[list[torch.device], list[torch.device]]:
    targets = [resolve_device(d) for d in (config.target_devices or [config.device])]
    drafters = [resolve_device(d) for d in (config.drafter_devices or [config.device])]
    return targets, drafters


@dataclass
class DrafterPlan:
    """One drafter to train: its settings, folder, and the devices of its replicas."""

    name: str
    config: TrainConfig
    run_dir: Path
    devices: list[torch.device]
    drafter_config: DrafterConfig | None = None
    objective: ObjectiveConfig | None = None


def _compiles_drafter(config: TrainConfig, device: torch.device) -> bool:
    return config.compile == "on" or (config.compile == "auto" and device.type == "cuda")


def check_fp8_support(plan: DrafterPlan, spec: TargetSpec) -> None:
    """--fp8 needs FP8 products on every device of the drafter and 16-aligned model dims."""
    dims = {"hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size}
    if plan.config.fp8 == "all":
        dims.update(intermediate_size=spec.intermediate_size, **{
            "num_attention_heads × head_dim": spec.num_attention_heads * spec.head_dim,
            "num_key_value_heads × head_dim": spec.num_key_value_heads * spec.head_dim,
        })
    try:
        check_fp8_dims(dims)
    except ValueError as error:
        raise ConfigError(f"{plan.name}: {error}") from None
    for device in plan.devices:
        reason = fp8_unsupported(device)
        if reason:
            raise ConfigError(f"{plan.name}: --fp8 {plan.config.fp8}: {reason}; use --fp8 off")


def plan_drafters(config: TrainConfig, drafter_devices: list[torch.device]) -> list[DrafterPlan]:
    out = Path(config.out)
    if config.mode == "replicas":
        return [DrafterPlan("drafter", config, out, list(drafter_devices))]
    plans, names = [], set()
    for i, overrides in enumerate(config.variants):
        for key in overrides:
            if key not in VARIANT_KEYS:
                raise unknown_key_error(key, list(VARIANT_KEYS), f"variants[{i}]")
        name = str(overrides.get("name") or f"variant{i}")
        if name in names:
            raise ConfigError(f"variants[{i}]: name {name!r} is used twice")
        names.add(name)
        values = {k: v for k, v in overrides.items() if k != "name"}
        variant = dataclasses.replace(config, **values)
        variant.validate()
        plans.append(DrafterPlan(name, variant, out / name, [drafter_devices[i % len(drafter_devices)]]))
    return plans


class LiveTarget:
    """FeatureSource running the target model on its device."""

    def __init__(self, target: Target, layer_ids: list[int]):
        self.target = target
        self.layer_ids = layer_ids
        self.device = target.device

    def features(self, batch: HostBatch) -> torch.Tensor:
        return self.target.features(batch.input_ids.to(self.device, non_blocking=True), self.layer_ids)


def frozen_parts(target: Target, device: torch.device, dtype: torch.dtype | None, cache: dict) -> FrozenTargetParts:
    """Embedding and head on `device`, copied once per device (and once if tied)."""
    if device not in cache:
        embed = target.embed_weight.detach()
        head = target.head_weight.detach()
        tied = embed.data_ptr() == head.data_ptr()
        embed = embed.to(device=device, dtype=dtype or embed.dtype)
        head = embed if tied else head.to(device=device, dtype=dtype or head.dtype)
        cache[device] = FrozenTargetParts(
            embed, head, target.spec.input_embedding_scale, target.spec.final_logit_softcapping
        )
    return cache[device]


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
    return drafter


@dataclass
class RunningStats:
    """Per drafter: what the step line and the summary show."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    skipped: int = 0
    history: list[dict] = field(default_factory=list)


class MetricsLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "a")

    def write(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def load_samples(config: TrainConfig, tokenizer: Any, log: TextIO):
    from ..data.samples import load_training_samples

    if not config.data:
        raise ConfigError("no training data: pass --data FILE.jsonl (conversations with assistant answers)")
    if tokenizer is None:
        raise ConfigError(f"{config.target}: no tokenizer next to the model; it is needed to render --data")
    samples, stats = load_training_samples(
        config.data, tokenizer, max_length=config.max_seq_len, min_supervised_tokens=config.min_supervised_tokens
    )
    print(stats.summary(), file=log)
    if not samples:
        raise ConfigError(f"no usable training rows in {', '.join(config.data)} (see the reasons above)")
    return samples


def train(
    config: TrainConfig,
    *,
    samples: Sequence[Any] | None = None,
    target: Target | Sequence[Target] | None = None,
    log: TextIO | None = None,
    step_hook: Callable[[DrafterWorker, int], None] | None = None,
    stop_at: int | None = None,
    save_checkpoints: bool = True,
) -> dict:
    """Run training; returns the summary dict (also written to OUT/summary.json).

    `samples`/`target` (one Target, or one per target device) may be given directly (tests,
    quickstart); otherwise they are read from config.data / config.target. `step_hook(worker,
    step)` runs in each drafter thread after each step (tests use it to inspect replicas or
    inject faults). `stop_at` ends the run
    after that step as an interruption would (the LR schedule still spans config.steps).
    `save_checkpoints=False` (benchmarks) writes no checkpoint at all.
    """
    log = log or sys.stdout
    config.validate()
    if not config.out:
        raise ConfigError("no run folder: pass --out RUN_DIR")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    target_devices, drafter_devices = resolve_layout(config)
    plans = plan_drafters(config, drafter_devices)

    # --- target(s) and data ------------------------------------------------------------
    targets: list[Target] = [] if target is None else [target] if isinstance(target, Target) else list(target)
    cache = None
    if config.features:
        from ..data.feature_cache import FeatureCache

        if config.data:
            raise ConfigError(f"pass --data or --features, not both: the feature cache {config.features} holds its own samples")
        cache = FeatureCache(config.features)
        if not targets:
            # No target forward runs; its embedding, head and tokenizer are still needed: one copy,
            # on the CPU, in the drafters' dtype, serves every target worker.
            path = config.target or cache.target
            print(f"loading target {path} on cpu (embedding, head, tokenizer; features from {config.features})", file=log)
            targets.append(load_target(path, "cpu", torch.bfloat16 if any(d.type == "cuda" for d in drafter_devices) else None))
        cache.check_target(targets[0])
        targets += targets[:1] * (len(target_devices) - len(targets))
    for device in target_devices[len(targets):]:
        print(f"loading target {config.target} on {device}", file=log)
        targets.append(load_target(config.target, device))
    tokenizer = targets[0].tokenizer
    spec = targets[0].spec
    if samples is None and cache is not None:
        samples, cache_stats = cache.training_samples(config.max_seq_len, config.min_supervised_tokens)
        print(cache_stats.summary(), file=log)
        if not samples:
            raise ConfigError(f"no usable training rows in the feature cache {config.features} (see the reasons above)")
    if samples is None:
        samples = load_samples(config, tokenizer, log)

    evaluator = None
    if config.eval_every:
        from ..eval.in_training import InTrainingEvaluator

        evaluator = InTrainingEvaluator.from_benchmark(
            targets[0], config.eval_bench, limit=config.eval_limit, max_new_tokens=config.eval_max_new_tokens)
        print(f"in-training eval: real tau every {config.eval_every} steps on {len(evaluator.prompts)} "
              f"{config.eval_bench} prompts, {config.eval_max_new_tokens} new tokens, on {targets[0].device}", file=log)

    mask_token_id = resolve_mask_token_id(config.mask_token_id, tokenizer, targets[0].embed_weight.shape[0])
    for plan in plans:
        plan.drafter_config = DrafterConfig.from_target(
            spec, num_layers=plan.config.num_layers, block_size=plan.config.block_size,
            mask_token_id=mask_token_id, target_layer_ids=plan.config.target_layer_ids or None,
        )
        plan.objective = ObjectiveConfig(
            block_size=plan.config.block_size, num_anchors=plan.config.num_anchors, loss=plan.config.loss,
            gamma=plan.config.gamma, dpace_alpha=plan.config.dpace_alpha, loss_chunk_rows=plan.config.loss_chunk_rows,
            compiled_head=all(_compiles_drafter(config, device) for device in plan.devices),
            fp8_head=plan.config.fp8 != "off",
        )
        if plan.config.fp8 != "off":
            check_fp8_support(plan, spec)
    layer_union = sorted({k for plan in plans for k in plan.drafter_config.target_layer_ids})
    # With a cache, each target worker reads features on its device instead of running the model.
    sources = None
    if cache is not None:
        sources = [cache.source(target_devices[t % len(target_devices)], layer_union) for t in range(len(targets))]
        print(f"features: cache {config.features} ({len(cache)} samples, layers {cache.layer_ids}, {cache.dtype}) "
              f"read on {', '.join(str(s.device) for s in sources)}", file=log)

    # --- resume ----------------------------------------------------------------------------
    start_step, resumed = 0, {}
    if config.resume:
        found = {plan.name: resumable_checkpoint(plan.run_dir, log)[0] for plan in plans}
        steps = {name: read_state(path)["step"] for name, path in found.items() if path is not None}
        if steps:
            if len(set(steps.values())) != 1 or len(steps) != len(plans):
                raise ConfigError(f"cannot resume: drafters have checkpoints at different steps {steps}")
            start_step = next(iter(steps.values()))
            resumed = found
            print(f"resuming from step {start_step} ({', '.join(str(p) for p in found.values())})", file=log)
        else:
            print(f"--resume: no complete checkpoint in {out}, starting from step 0", file=log)
    end_step = min(config.steps, stop_at) if stop_at is not None else config.steps
    if start_step >= end_step:
        print(f"nothing to do: already at step {start_step} of {config.steps}", file=log)

    # --- compile safety (process-wide, idempotent) -----------------------------------------
    backends = {d: resolve_backend(config.attention, d) for d in drafter_devices}
    compiles = "flex" in backends.values() or any(_compiles_drafter(config, d) for d in drafter_devices)
    buckets = sorted(config.seq_buckets) if config.seq_buckets else auto_buckets(config.max_seq_len)
    if compiles:
        from .compile_safety import install_compile_safety, recompile_limit_for

        threads = sum(len(plan.devices) for plan in plans)
        report = install_compile_safety(
            recompile_limit=recompile_limit_for(len(buckets), threads), fail_on_recompile_limit_hit=True,
        )
        print(f"compile safety: {report}", file=log)

    # --- drafters, one worker per (drafter, replica) ------------------------------------------
    def autocast_dtype(device: torch.device) -> torch.dtype | None:
        use_bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
        return torch.bfloat16 if use_bf16 else None

    frozen_cache: dict = {}
    stop = StopSignal()
    reports: queue.Queue = queue.Queue()
    grad_accum = config.grad_accum
    replicas = len(plans[0].devices) if config.mode == "replicas" else 1
    batches_per_step = replicas * grad_accum
    num_targets = len(targets)
    drafter_slots = [(plan, rank) for plan in plans for rank in range(len(plan.devices))]
    queues = [[queue.Queue(maxsize=config.prefetch) for _ in drafter_slots] for _ in range(num_targets)]

    def routes(step: int, index: int) -> list[queue.Queue]:
        producer = (step * batches_per_step + index) % num_targets
        if config.mode == "replicas":
            return [queues[producer][index // grad_accum]]
        return queues[producer]

    def checkpoint_state(plan: DrafterPlan):
        return lambda step: {"train_config": dataclasses.asdict(plan.config), "layer_union": layer_union}

    evaluation = None
    if evaluator is not None:
        evaluation_lock = threading.Lock()  # one decode at a time on the shared target

        def evaluation(worker: DrafterWorker, step: int) -> dict | None:
            if (step + 1) % config.eval_every and step + 1 != end_step:
                return None
            with evaluation_lock:
                return evaluator.measure(worker.setup.drafter)

    drafter_workers: list[DrafterWorker] = []
    reducers: list[GradientReducer] = []
    for plan in plans:
        (plan.run_dir).mkdir(parents=True, exist_ok=True)
        (plan.run_dir / "run.json").write_text(json.dumps({
            "train_config": dataclasses.asdict(plan.config), "drafter_config": plan.drafter_config.to_dict(),
            "target": str(config.target), "mode": config.mode, "name": plan.name,
        }, indent=2))
        if plan.name in resumed:
            base = load_drafter(resumed[plan.name])
            if base.config.to_dict() != plan.drafter_config.to_dict():
                raise ConfigError(
                    f"cannot resume {plan.run_dir}: its checkpoint was trained with a different drafter config"
                )
        else:
            base = init_drafter(plan.drafter_config, plan.config.seed)
        models = [copy.deepcopy(base).to(device) for device in plan.devices]
        reducer = GradientReducer(models, stop) if len(models) > 1 else None
        if reducer is not None:
            reducers.append(reducer)
        for rank, (device, model) in enumerate(zip(plan.devices, models)):
            if _compiles_drafter(config, device):
                # One graph per bucket for the whole drafter forward (flex inside it), so the
                # elementwise work around the matmuls fuses; the module itself stays
                # uncompiled, so checkpoints keep plain parameter names.
                model.forward = torch.compile(model.forward, dynamic=False)
            if plan.config.fp8 == "all":
                use_fp8_linears(model)
            optimizer = make_optimizer(model, plan.config.lr, plan.config.weight_decay,
                                       (plan.config.adam_beta1, plan.config.adam_beta2))
            scheduler = warmup_cosine(optimizer, config.steps, plan.config.warmup_ratio, plan.config.min_lr_ratio)
            if plan.name in resumed:
                restore_trainer(resumed[plan.name], optimizer, scheduler)
            slot = drafter_slots.index((plan, rank))
            setup = DrafterSetup(
                name=plan.name, rank=rank, device=device, drafter=model, optimizer=optimizer, scheduler=scheduler,
                frozen=frozen_parts(targets[0], device, torch.bfloat16 if device.type == "cuda" else None, frozen_cache),
                objective=plan.objective, run_dir=plan.run_dir if rank == 0 and save_checkpoints else None,
                layer_ids=plan.drafter_config.target_layer_ids,
            )
            thread_name = f"drafter-{slot}" + (f"[{plan.name}]" if config.mode == "variants" else "")
            indices = list(range(rank * grad_accum, (rank + 1) * grad_accum))
            drafter_workers.append(DrafterWorker(
                thread_name, stop, setup, inputs=[queues[t][slot] for t in range(num_targets)],
                batch_indices=indices, batches_per_step=batches_per_step, start_step=start_step,
                total_steps=end_step, reports=reports, reducer=reducer,
                attention_backend=backends[device], autocast_dtype=autocast_dtype(device),
                clip_grad=plan.config.clip_grad, save_every=config.save_every,
                keep_checkpoints=config.keep_checkpoints, checkpoint_state=checkpoint_state(plan),
                on_step_done=step_hook, compile_safety=compiles, fail_on_recompile=config.fail_on_recompile,
                evaluate=evaluation if rank == 0 else None,
            ))

    planner = BatchPlanner(
        samples, batch_size=config.batch_size, batches_per_step=batches_per_step, buckets=buckets,
        seed=config.seed, objectives={plan.name: plan.objective for plan in plans},
        pad_id=(tokenizer.pad_token_id or 0) if tokenizer is not None else 0,
        pin_memory=any(d.type == "cuda" for d in [*target_devices, *drafter_devices]),
    )
    target_workers = [
        TargetWorker(f"target-{t}", stop, sources[t] if sources else LiveTarget(tgt, layer_union), planner, index=t,
                     num_target_workers=num_targets, start_step=start_step, total_steps=end_step, routes=routes,
                     compile_safety=compiles)
        for t, tgt in enumerate(targets)
    ]
    workers = target_workers + drafter_workers

    # --- run ---------------------------------------------------------------------------------
    threads_before = torch.get_num_threads()
    if all(w.device.type == "cpu" for w in drafter_workers) and all(t.device.type == "cpu" for t in targets):
        # Every worker computes on the same cores: one intra-op pool each, not one per core each
        # (oversubscribed OpenMP pools run several times slower, not just slower).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(workers)))
    print(_layout_line(config, plans, targets, planner, start_step), file=log)
    logs = {plan.name: MetricsLog(plan.run_dir / "metrics.jsonl") for plan in plans}
    pipeline_log = MetricsLog(out / "pipeline.jsonl")
    stats = {plan.name: RunningStats() for plan in plans}
    progress = Progress(end_step - start_step, "train", stream=log if log is not sys.stdout else sys.stderr)
    pending: dict[tuple[str, int], list[StepReport]] = {}
    queue_depth_sum, queue_samples = 0.0, 0
    started = time.monotonic()
    restore_signals = _install_signal_handlers(stop)
    try:
        for worker in workers:
            worker.start()
        all_queues = [q for row in queues for q in row]
        while any(w.is_alive() for w in drafter_workers):
            try:
                report = reports.get(timeout=0.2)
            except queue.Empty:
                report = None
            queue_depth_sum += sum(q.qsize() for q in all_queues) / max(1, len(all_queues))
            queue_samples += 1
            if report is None:
                continue
            key = (report.drafter, report.step)
            pending.setdefault(key, []).append(report)
            expected = len(next(p for p in plans if p.name == report.drafter).devices)
            if len(pending[key]) < expected:
                continue
            step_reports = pending.pop(key)
            record = _step_record(step_reports, stats[report.drafter], time.monotonic() - started)
            measured = next((r.evaluation for r in step_reports if r.evaluation), None)
            if measured:
                record["tau_real"] = measured["tau"]
                record["tau_real_pooled"] = measured["tau_pooled"]
                record["tau_real_decoder"] = measured["decoder"]
                progress.print(f"{'[' + report.drafter + '] ' if len(plans) > 1 else ''}eval at step {record['step']}: "
                               f"real tau {measured['tau']:.3f} (pooled {measured['tau_pooled']:.3f}, "
                               f"{measured['tokens']} tokens in {measured['seconds']:.1f}s, {measured['decoder']} decoder) "
                               f"| simulated tau {record['tau_sim']:.3f}")
            logs[report.drafter].write(record)
            if report.drafter == plans[0].name:
                progress.update(1, note=f"loss {record['loss']:.3f} acc {record['accuracy']:.3f}")
            if (report.step + 1) % config.log_every == 0 or report.step + 1 == end_step:
                eta = (end_step - report.step - 1) * (time.monotonic() - started) / max(1, report.step + 1 - start_step)
                depth = queue_depth_sum / max(1, queue_samples)
                line = _step_line(record, report.drafter if len(plans) > 1 else None, config.steps, eta)
                progress.print(line + _pipeline_note(workers, depth))
                if report.drafter == plans[0].name:
                    pipeline_log.write({"step": report.step + 1, "elapsed_s": round(time.monotonic() - started, 2),
                                        "mean_queue_depth": round(depth, 3), "workers": _worker_stats(workers),
                                        "compiles": _recompile_snapshot()})
        stop.stop("finished")
        hung = wait_for_workers(workers, stop, timeout=30.0)
    finally:
        restore_signals()
        torch.set_num_threads(threads_before)
        for metrics_log in [*logs.values(), pipeline_log]:
            metrics_log.close()
    progress.close()
    if hung:
        raise RuntimeError(f"workers did not stop within 30 s after the pipeline stopped: {', '.join(hung)}")
    error = stop.error()

    # --- summary -------------------------------------------------------------------------------
    elapsed = time.monotonic() - started
    summary = {
        "steps_done": {p.name: w.completed_step for p in plans for w in drafter_workers if w.setup.name == p.name and w.setup.rank == 0},
        "stop_reason": stop.reason,
        "elapsed_s": round(elapsed, 2),
        "drafters": {},
        "workers": _worker_stats(workers),
        "mean_queue_depth": round(queue_depth_sum / max(1, queue_samples), 2),
        "gradient_sync_s": round(sum(r.seconds for r in reducers), 2),
        "recompiles": _recompile_snapshot(),
    }
    for plan in plans:
        rank0 = next(w for w in drafter_workers if w.setup.name == plan.name and w.setup.rank == 0)
        tail = stats[plan.name].history[-min(50, len(stats[plan.name].history)):]
        entry = {
            "run_dir": str(plan.run_dir),
            "checkpoint": str(rank0.last_checkpoint) if rank0.last_checkpoint else None,
            "samples_per_s": round(stats[plan.name].samples / elapsed, 3) if elapsed > 0 else None,
            "skipped_steps": stats[plan.name].skipped,
        }
        if tail:
            entry.update({k: round(sum(r[k] for r in tail) / len(tail), 4) for k in ("loss", "accuracy", "tau_sim")})
            entry["first_loss"] = stats[plan.name].history[0]["loss"]
        measured = [r for r in stats[plan.name].history if "tau_real" in r]
        if measured:
            entry["tau_real"] = {"step": measured[-1]["step"], "tau": measured[-1]["tau_real"],
                                 "tau_pooled": measured[-1]["tau_real_pooled"]}
        if error is None and rank0.completed_step >= config.steps and config.export_dtype:
            entry["export"] = str(export_model(rank0.setup.drafter, plan.run_dir / "export",
                                               dtype=getattr(torch, config.export_dtype), run_dir=plan.run_dir,
                                               force=True))  # OUT/export belongs to the run
        summary["drafters"][plan.name] = entry
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(_summary_text(summary, config), file=log)
    if error is not None:
        raise error
    return summary


def _install_signal_handlers(stop: StopSignal):
    """Ctrl-C / SIGTERM: finish the current step, checkpoint, exit. A second Ctrl-C aborts."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, _frame):
        if stop.stopped and signum == signal.SIGINT:
            raise KeyboardInterrupt
        print(f"\n{signal.Signals(signum).name}: stopping after the current step and saving a checkpoint "
              "(Ctrl-C again to abort)", file=sys.stderr)
        stop.stop(f"interrupted by {signal.Signals(signum).name}")

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _step_record(reports: list[StepReport], stats: RunningStats, elapsed: float) -> dict:
    sums = {k: sum(r.result.metric_sums[k] for r in reports) for k in reports[0].result.metric_sums}
    metrics = summarize_metrics(sums)
    samples = sum(r.samples for r in reports)
    tokens = sum(r.tokens for r in reports)
    seconds = max(r.seconds + r.waited for r in reports)
    stats.steps += 1
    stats.samples += samples
    stats.tokens += tokens
    stats.skipped += int(reports[0].result.skipped)
    record = {
        "step": reports[0].step + 1,
        "loss": sum(r.result.loss for r in reports),
        "accuracy": metrics["accuracy"],
        "tau_sim": metrics["tau_sim"],
        "position_accuracy": metrics["position_accuracy"],
        "lr": reports[0].result.lr,
        "grad_norm": reports[0].result.grad_norm,
        "skipped": reports[0].result.skipped,
        "step_s": round(seconds, 4),
        "compute_s": round(max(r.seconds for r in reports), 4),
        "wait_s": round(max(r.waited for r in reports), 4),
        "samples": samples,
        "tokens": tokens,
        "elapsed_s": round(elapsed, 2),
    }
    stats.history.append(record)
    return record


def _worker_stats(workers) -> dict:
    stats = {}
    for w in workers:
        entry = {"busy": round(w.times.busy_fraction(), 3), "items": w.times.items,
                 "computing_s": round(w.times.computing, 2), "waiting_s": round(w.times.waiting, 2)}
        if isinstance(w, DrafterWorker):
            entry.update(compiles=w.compiles, recompiles_after_warmup=w.recompiles_after_warmup)
        stats[w.name] = entry
    return stats


def _pipeline_note(workers, depth: float) -> str:
    """Who is the bottleneck at a glance: busy fraction per worker and mean queue depth."""
    busy = " ".join(f"{w.name.split('[')[0].replace('target-', 't').replace('drafter-', 'd')} {w.times.busy_fraction():.2f}"
                    for w in workers)
    drafters = [w for w in workers if isinstance(w, DrafterWorker)]
    compiled = sum(w.compiles for w in drafters)
    recompiled = sum(w.recompiles_after_warmup for w in drafters)
    note = f" | busy {busy} | queue {depth:.1f}"
    return note + (f" | compiles {compiled} (recompiles {recompiled})" if any(w.compile_safety for w in drafters) else "")


def _step_line(record: dict, name: str | None, total: int, eta: float) -> str:
    tau = record["tau_sim"]
    prefix = f"[{name}] " if name else ""
    throughput = record["samples"] / record["step_s"] if record["step_s"] > 0 else 0.0
    tokens = record["tokens"] / record["step_s"] if record["step_s"] > 0 else 0.0
    return (
        f"{prefix}step {record['step']}/{total} | loss {record['loss']:.4f} | acc {record['accuracy']:.3f} | "
        f"tau_sim {tau:.2f} | lr {record['lr']:.2e} | gnorm {record['grad_norm']:.2f} | "
        f"{record['step_s']:.3f} s/step (wait {record['wait_s']:.3f}) | {throughput:.1f} samples/s | "
        f"{tokens / 1000:.1f}k tok/s | eta {format_seconds(eta)}"
    )


def _layout_line(config: TrainConfig, plans: list[DrafterPlan], targets: list[Target], planner: BatchPlanner, start: int) -> str:
    drafters = "; ".join(
        f"{p.name}: {p.drafter_config.num_hidden_layers} layers, B={p.drafter_config.block_size}, "
        f"N={p.objective.num_anchors}, loss={p.objective.loss}, layers {p.drafter_config.target_layer_ids} "
        f"on {', '.join(map(str, p.devices))}"
        for p in plans
    )
    return (
        f"pipeline: {config.mode}; target on {', '.join(str(t.device) for t in targets)}; {drafters}\n"
        f"data: {len(planner.samples)} samples, {planner.batches_per_epoch} batches/epoch of {config.batch_size}, "
        f"buckets {planner.buckets}; steps {start}->{config.steps}"
    )


def _recompile_snapshot() -> dict:
    try:
        from .compile_safety import recompile_snapshot
    except ImportError:
        return {}
    try:
        return recompile_snapshot()
    except Exception:  # noqa: BLE001 - metrics must never fail a finished run
        return {}


def _summary_text(summary: dict, config: TrainConfig) -> str:
    lines = ["", "=" * 72, f"training summary ({summary['stop_reason']}, {format_seconds(summary['elapsed_s'])})"]
    for name, entry in summary["drafters"].items():
        lines.append(f"  {name}: steps {summary['steps_done'].get(name)}/{config.steps}")
        if "loss" in entry:
            lines.append(
                f"    loss {entry['first_loss']:.3f} -> {entry['loss']:.3f} (mean of last steps) | "
                f"accuracy {entry['accuracy']:.3f} | simulated tau {entry['tau_sim']:.2f}"
            )
        if entry.get("tau_real"):
            real = entry["tau_real"]
            lines.append(f"    real tau at step {real['step']}: {real['tau']:.3f} (pooled {real['tau_pooled']:.3f}), "
                         "by speculative decoding")
        lines.append(f"    {entry['samples_per_s']} samples/s | skipped (non-finite) steps: {entry['skipped_steps']}")
        lines.append(f"    checkpoint: {entry['checkpoint']}")
        if entry.get("export"):
            lines.append(f"    exported HF folder: {entry['export']}")
    lines.append("  workers (busy = computing / (computing + waiting)):")
    for name, w in summary["workers"].items():
        compiles = f"  compiles {w['compiles']} (after warm-up {w['recompiles_after_warmup']})" if "compiles" in w else ""
        lines.append(f"    {name:<24} busy {w['busy']:.2f}  compute {w['computing_s']}s  wait {w['waiting_s']}s  "
                     f"items {w['items']}{compiles}")
    lines.append(f"  mean queue depth {summary['mean_queue_depth']} | gradient sync {summary['gradient_sync_s']}s")
    lines.append("=" * 72)
    return "\n".join(lines)
