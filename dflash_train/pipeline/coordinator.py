"""The coordinator: runs a built pipeline, reports every step, finishes the run.

    run      start the workers (signals handled), then the report loop until every drafter
             thread has exited and every report it queued has been read
    report   complete steps become records: sinks (metrics.jsonl, pipeline.jsonl, ...), the
             progress bar, a step line every --log-every steps
    finish   stop and join the workers, write summary.json, export finished drafters, print the
             summary

If the coordinator itself fails (a sink cannot write, a bug), it stops the workers and waits for
them before the error leaves `run`: nothing trains or writes after `train()` has failed.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import torch

from ..config import TrainConfig
from ..export import export_model
from ..progress import Progress
from .build import DrafterPlan, Pipeline, cpu_threads_per_worker
from .reporting import (
    RunningStats, Sink, StepAssembler, drafter_compiles, eval_line, pipeline_bottleneck, pipeline_note,
    recompile_snapshot, step_line, step_record, summary_text, worker_stats,
)
from .startup import StartupClock
from .runtime import StopSignal
from .workers import StepRange, wait_for_workers

JOIN_SECONDS = 30.0  # how long workers may take to stop once asked


class InterruptHandler:
    """Ctrl-C / SIGTERM: finish the current step, checkpoint, exit. A second Ctrl-C aborts.
    Installed only in the main thread (signals can only be handled there)."""

    def __init__(self, stop: StopSignal):
        self.stop = stop
        self.signal_name: str | None = None  # the first signal received
        self._previous: dict = {}

    def __enter__(self) -> "InterruptHandler":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            for sig in self._previous:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame) -> None:
        if self.stop.stopped and signum == signal.SIGINT:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping after the current step and saving a checkpoint (Ctrl-C again to abort)",
              file=sys.stderr)
        self.signal_name = self.signal_name or name
        self.stop.stop(f"interrupted by {name}")

    def __exit__(self, *_exc) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)


class Coordinator:
    def __init__(self, config: TrainConfig, plans: list[DrafterPlan], pipeline: Pipeline, steps: StepRange,
                 sinks: list[Sink], log: TextIO):
        self.config = config
        self.plans = plans
        self.pipeline = pipeline
        self.steps = steps
        self.sinks = sinks
        self.log = log
        self.stop = pipeline.stop
        self.stats = {plan.name: RunningStats() for plan in plans}
        self.assembler = StepAssembler({plan.name: len(plan.devices) for plan in plans})
        self.progress = Progress(len(steps), "train", stream=log if log is not sys.stdout else sys.stderr)
        self.queue_depth_sum = 0.0
        self.queue_samples = 0
        self.started = time.monotonic()
        self.interrupts = InterruptHandler(self.stop)
        self.clock = StartupClock(pipeline.warmup)

    # --- run -------------------------------------------------------------------------------------

    def run(self) -> dict:
        threads_before = torch.get_num_threads()
        threads = cpu_threads_per_worker(self.pipeline)
        if threads is not None:
            torch.set_num_threads(threads)
        self.started = time.monotonic()
        try:
            with self.interrupts:
                for worker in self.pipeline.workers:
                    worker.start()
                self._report_loop()
                self.stop.stop("finished")
                hung = wait_for_workers(self.pipeline.workers, self.stop, timeout=JOIN_SECONDS)
        finally:
            torch.set_num_threads(threads_before)
            for sink in self.sinks:
                sink.close()
        self.progress.close()
        if hung:
            raise RuntimeError(f"workers did not stop within {JOIN_SECONDS:.0f} s after the pipeline stopped: "
                               f"{', '.join(hung)}")
        return self.finish()

    def _report_loop(self) -> None:
        drafters = self.pipeline.drafter_workers
        while any(w.is_alive() for w in drafters):
            try:
                report = self.pipeline.reports.get(timeout=0.2)
            except queue.Empty:
                report = None
            self.queue_depth_sum += self.pipeline.router.mean_depth()
            self.queue_samples += 1
            if report is None:
                continue
            complete = self.assembler.add(report)
            if complete is not None:
                self.report_step(complete)

    # --- report ----------------------------------------------------------------------------------

    def report_step(self, reports) -> None:
        name = reports[0].drafter
        many = len(self.plans) > 1
        record = step_record(reports, time.monotonic() - self.started)
        self.stats[name].add(record)
        measured = next((r.evaluation for r in reports if r.evaluation), None)
        if measured:
            self.progress.print(eval_line(record, measured, name if many else None))
        first = name == self.plans[0].name
        if first:
            startup = self.clock.observe(record, drafter_compiles(self.pipeline.drafter_workers))
            if startup:
                self.progress.print(startup)
        for sink in self.sinks:
            sink.write_step(name, record)
        if first:
            self.progress.update(1, note=f"loss {record['loss']:.3f} acc {record['accuracy']:.3f}")
        step = record["step"]
        if step % self.config.log_every == 0 or step == self.steps.end:
            elapsed = time.monotonic() - self.started
            eta = (self.steps.end - step) * elapsed / max(1, step - self.steps.start)
            depth = self.mean_queue_depth()
            workers = self.pipeline.workers
            limit = pipeline_bottleneck(workers, depth, self.config.prefetch)
            self.progress.print(step_line(record, name if many else None, self.config.steps, eta)
                                + pipeline_note(workers, depth, limit))
            if first:
                pipeline_record = {"step": step, "elapsed_s": round(elapsed, 2), "mean_queue_depth": round(depth, 3),
                                   "workers": worker_stats(workers), "bottleneck": limit.label,
                                   "bottleneck_detail": limit.detail, "compiles": recompile_snapshot()}
                for sink in self.sinks:
                    sink.write_pipeline(pipeline_record)

    def mean_queue_depth(self) -> float:
        return self.queue_depth_sum / max(1, self.queue_samples)

    # --- finish ----------------------------------------------------------------------------------

    def finish(self) -> dict:
        error = self.stop.error()
        elapsed = time.monotonic() - self.started
        pipeline = self.pipeline
        summary = {
            "steps_done": {p.name: pipeline.rank0(p).completed_step for p in self.plans},
            "stop_reason": self.stop.reason,
            "elapsed_s": round(elapsed, 2),
            "drafters": {},
            "workers": worker_stats(pipeline.workers),
            "mean_queue_depth": round(self.mean_queue_depth(), 2),
            "gradient_sync_s": round(sum(r.seconds for r in pipeline.reducers), 2),
            "recompiles": recompile_snapshot(),
            "startup": self.clock.summary(),
            "bottleneck": str(pipeline_bottleneck(pipeline.workers, self.mean_queue_depth(), self.config.prefetch)),
        }
        for plan in self.plans:
            rank0 = pipeline.rank0(plan)
            stats = self.stats[plan.name]
            tail = stats.history[-min(50, len(stats.history)):]
            entry = {
                "run_dir": str(plan.run_dir),
                "checkpoint": str(rank0.last_checkpoint) if rank0.last_checkpoint else None,
                "samples_per_s": round(stats.samples / elapsed, 3) if elapsed > 0 else None,
                "skipped_steps": stats.skipped,
            }
            if tail:
                entry.update({k: round(sum(r[k] for r in tail) / len(tail), 4) for k in ("loss", "accuracy", "tau_sim")})
                entry["first_loss"] = stats.history[0]["loss"]
            measured = [r for r in stats.history if "tau_real" in r]
            if measured:
                entry["tau_real"] = {"step": measured[-1]["step"], "tau": measured[-1]["tau_real"],
                                     "tau_pooled": measured[-1]["tau_real_pooled"]}
            if error is None and rank0.completed_step >= self.config.steps and self.config.export_dtype:
                entry["export"] = str(self.export(plan, rank0.replica.drafter))
            summary["drafters"][plan.name] = entry
        (Path(self.config.out) / "summary.json").write_text(json.dumps(summary, indent=2))
        print(summary_text(summary, self.config.steps), file=self.log)
        if error is not None:
            raise error
        return summary

    def export(self, plan: DrafterPlan, drafter: torch.nn.Module) -> Path:
        return export_model(drafter, plan.run_dir / "export", dtype=getattr(torch, self.config.export_dtype),
                            run_dir=plan.run_dir, force=True)  # OUT/export belongs to the run
