"""The drafter's training step as CUDA graphs: `core.step.Step`'s phases captured per bucket
before step 1, replayed after.

Per replica, on top of its `Step`:

    accumulate graph (L, R)   `Step.accumulate` of one micro-batch in shape bucket L's buffers with
                              R head rows: forward, chunked frozen-head loss and backward, adding into
                              the persistent gradients; one per shape bucket L and rows bucket R. A
                              shape bucket is a length bucket, or with packed anchors
                              (`core.step.pack_rows`) a length bucket and an anchor capacity
    update graph              `Step.apply_update`: clip, finiteness, fused AdamW at the lr tensors,
                              zero the gradients

A step copies each micro-batch into its shape bucket's buffers and replays its graph (micro-batches
of one step may fall into different buckets); with replicas or nodes the loop sums the persistent
gradients between the accumulates and the update, as it does eagerly. Replays run on the worker's
current stream (its own: parallel/streams.py), the one its eager steps, the copies into the graphs'
input buffers and the gradient sum's load and store use. The host never waits for the GPU inside a
step: the step's numbers are copied into pinned host memory and read when someone asks
(`DeferredStepResult`, normally the coordinator, a step or two later); the host runs at most
`MAX_AHEAD` steps ahead of the GPU (the wait is counted as waiting for the GPU).

`prepare` (warm-up, in the worker's own thread, before step 1; train/startup.py runs one worker's
warm-up at a time) does, per shape bucket: one eager micro-batch on synthetic data (compiles the
drafter forward, its backward and the head chunk), the captures, and a check that a replay on other
data equals the eager micro-batch on that data. Warm-ups, captures and checks all run on one private
stream (autograd caches each parameter's gradient stream: the capture's must be the warm-up's), the
update with its skip flag forced, so no weight and no optimizer moment changes. How captures in
different threads are kept apart: capture.py.

Falling back, never wrong, one warning per worker naming the reason:
  - fused AdamW with a tensor lr does not capture correctly on this torch/device (a probe on a tiny
    model against the eager update, lr changes and a skipped step included): the `Step` runs
    eagerly at each micro-batch's exact head rows and the schedule's float lr (the plain eager step);
  - a capture fails (an op that syncs, ...) or its replay differs from the eager micro-batch: that
    bucket's phase runs eagerly (still no host sync inside the step).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..capture import Captured, GraphPool, ReplayCheck, checked_capture, error_summary
from ..core.master_weights import updated_tensors
from ..core.objective import ObjectiveConfig, block_labels, draw_anchors, head_chunk_rows
from ..core.step import (
    DrafterBatch,
    InputShape,
    StaticInputs,
    Step,
    StepResult,
    anchor_capacity,
    fused_clip_and_step,
    pack_rows,
    rows_bucket,
    rows_buckets,
)

MAX_AHEAD = 2  # steps the host may enqueue before waiting for the oldest one to finish on the GPU
MAX_ROWS_GRAPHS = 48  # rows buckets per length bucket at most (coarser rows buckets past that)
REPLAY_TOLERANCE = 1e-3  # relative difference allowed between a replay and the eager micro-batch

Say = Callable[[str], None]


# --- shapes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepShapes:
    """The buckets a replica's micro-batches fall into (`InputShape.of` the batch as the step runs
    it), each with its rows buckets."""

    granules: dict[InputShape, int]  # rows bucket granule per shape bucket
    rows: dict[InputShape, list[int]]

    @property
    def inputs(self) -> list[InputShape]:
        return sorted(self.rows, key=lambda shape: (shape.row_length or shape.length, shape.num_anchors))

    def rows_for(self, shape: InputShape, scored_rows: int) -> int:
        return rows_bucket(scored_rows, self.granules[shape])


def step_shapes(
    lengths: list[int], batch_size: int, objective: ObjectiveConfig, feature_width: int, feature_dtype: torch.dtype,
    vocab_size: int,
) -> StepShapes:
    """Per length bucket one shape, or with packed anchors one per anchor capacity (whole rows'
    worth of slots up to what the rows can hold). At most MAX_ROWS_GRAPHS rows buckets per shape.
    With a compiled head they are multiples of its chunk rows (it pads its last chunk to that size
    anyway, so rounding up adds no head work); with an eager head, even steps of at most
    1/MAX_ROWS_GRAPHS of the largest count."""
    unit = head_chunk_rows(vocab_size, objective.loss_chunk_rows, True) if objective.compiled_head else 1
    granules, rows = {}, {}
    for length in sorted(set(lengths)):
        most_anchors = batch_size * min(objective.num_anchors, length - 1)
        if objective.pack_anchors:
            shapes = [InputShape(1, batch_size * length, capacity, feature_width, feature_dtype, length)
                      for capacity in range(objective.num_anchors, anchor_capacity(most_anchors, objective.num_anchors) + 1,
                                            objective.num_anchors)]
        else:
            shapes = [InputShape(batch_size, length, objective.num_anchors, feature_width, feature_dtype)]
        for shape in shapes:
            max_rows = min(most_anchors, shape.batch_size * shape.num_anchors) * (objective.block_size - 1)
            units = -(-max_rows // unit)
            granules[shape] = unit * max(1, -(-units // MAX_ROWS_GRAPHS))
            rows[shape] = rows_buckets(max_rows, granules[shape])
    return StepShapes(granules, rows)


# --- the step's numbers, read later -------------------------------------------------------------

class DeferredStepResult:
    """A `StepResult` whose numbers come from pinned host memory the GPU writes after the step:
    read on first access, waiting for the GPU then (in the reader's thread, not the worker's)."""

    def __init__(self, host: torch.Tensor, ready: Any, lr: float, block_size: int):
        self._host, self._ready, self._block_size = host, ready, block_size
        self._result: StepResult | None = None
        self.lr = lr

    def _read(self) -> StepResult:
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._result = StepResult.parse(self._host, self.lr, self._block_size)
        return self._result

    @property
    def loss(self) -> float:
        return self._read().loss

    @property
    def grad_norm(self) -> float:
        return self._read().grad_norm

    @property
    def skipped(self) -> bool:
        return self._read().skipped

    @property
    def metric_sums(self) -> dict[str, torch.Tensor]:
        return self._read().metric_sums


# --- does a captured fused AdamW with a tensor lr work here? ------------------------------------

_PROBES: dict[torch.device, str | None] = {}
_PROBE_LOCK = threading.Lock()


def update_capture_unsupported(device: torch.device) -> str | None:
    """Why a captured update cannot be trusted on `device`, or None (one probe per device)."""
    with _PROBE_LOCK:
        if device not in _PROBES:
            try:
                _PROBES[device] = _probe_update(device)
            except Exception as error:  # noqa: BLE001 - any failure of the probe means: do not capture
                _PROBES[device] = f"the captured fused AdamW probe failed ({type(error).__name__}: {error})"
        return _PROBES[device]


def _probe_update(device: torch.device) -> str | None:
    """A tiny model updated eagerly (`fused_clip_and_step`, float lr) and by a captured
    `fused_clip_and_step` at lr tensors, replayed with the lr changed in between (to 0 once: a baked-in lr would
    still move the weights), a clipped gradient, and a non-finite one (the skip)."""
    with torch.cuda.device(device):
        start = (torch.arange(64, dtype=torch.float32).view(8, 8) - 31.5) / 64
        # Made on the CPU and filled: no CUDA random numbers (another thread may be capturing).
        eager, graphed = (torch.nn.Linear(8, 8, bias=False) for _ in range(2))
        with torch.no_grad():
            eager.weight.copy_(start)
            graphed.weight.copy_(start)
        eager, graphed = eager.to(device), graphed.to(device)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True) for m in (eager, graphed)]
        graphed.weight.grad = torch.zeros_like(graphed.weight)
        grads = [graphed.weight.grad]
        lrs = [torch.zeros((), device=device)]
        skip = torch.zeros((), device=device)
        base = torch.sin(torch.arange(64, device=device, dtype=torch.float32)).view(8, 8)

        def follows_the_eager_update(graph: Any, _: Any) -> str | None:
            for step, (lr, scale) in enumerate([(1e-2, 1e-3), (3e-3, 10.0), (0.0, 1.0), (1e-2, float("inf")), (5e-3, 1.0)]):
                before = graphed.weight.detach().clone()
                for group in opts[0].param_groups:
                    group["lr"] = lr
                eager.weight.grad = base * scale
                fused_clip_and_step(opts[0], [eager.weight.grad], 1.0)
                grads[0].copy_(base * scale)
                lrs[0].fill_(lr)
                graph.replay()
                difference = (graphed.weight - eager.weight).detach()
                error = float(difference.abs().max()) / float(eager.weight.detach().abs().max())
                if not error <= 1e-5:
                    return f"a replayed fused AdamW update differs from the eager one at probe step {step} (relative {error:.1e})"
                if (lr == 0.0 or scale == float("inf")) and not torch.equal(graphed.weight, before):
                    return f"a replayed fused AdamW update moved the weights at probe step {step} (lr 0 or skipped)"
            return None

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            skip.fill_(1.0)
            fused_clip_and_step(opts[1], grads, 1.0, skip, lrs)  # creates the optimizer state, changes nothing
            skip.zero_()
            captured = checked_capture(lambda: fused_clip_and_step(opts[1], grads, 1.0, skip, lrs), device, stream,
                                       follows_the_eager_update)
        torch.cuda.current_stream(device).wait_stream(stream)
    return captured.reason


# --- synthetic micro-batches for warm-ups and checks -------------------------------------------

def synthetic_batch(shape: InputShape, objective: ObjectiveConfig, vocab_size: int, device: torch.device,
                    variant: int) -> DrafterBatch:
    """A micro-batch of `shape` with scored slots, made without any random generator on the GPU
    (the CUDA generator is process-wide and a capture in another thread would see its use); a
    packed shape's rows hold as many valid anchors as its capacity (or all they have)."""
    capacity = None
    if shape.row_length is not None:  # made as its rows, then packed
        capacity = shape.num_anchors
        shape = InputShape(shape.length // shape.row_length, shape.row_length, objective.num_anchors,
                           shape.feature_width, shape.feature_dtype)
    b, length, width = shape.batch_size, shape.length, shape.feature_width
    phase = 0.37 + 0.11 * variant
    features = torch.sin(torch.arange(b * length * width, device=device, dtype=torch.float32) * phase)
    input_ids = (torch.arange(b * length) * 7919 + 13 * variant) % max(1, vocab_size - 1)
    input_ids = input_ids.view(b, length)
    loss_mask = torch.zeros(b, length, dtype=torch.bool)
    loss_mask[:, length // 5:] = True
    drawn = [draw_anchors(loss_mask[i], shape.num_anchors, seed=variant, sample_id=i, epoch=0) for i in range(b)]
    anchors = torch.stack([a for a, _ in drawn])
    valid = torch.stack([v for _, v in drawn])
    if capacity is not None:  # the first `capacity` valid anchors, row by row
        valid &= (valid.flatten().cumsum(0) <= capacity).view_as(valid)
        anchors *= valid
    _, label_valid = block_labels(input_ids, loss_mask, anchors, valid, objective.block_size)
    batch = DrafterBatch(
        features.view(b, length, width).to(shape.feature_dtype), input_ids.to(device), loss_mask.to(device),
        anchors.to(device), valid.to(device), objective.normalizer(label_valid), int(label_valid.sum()),
        anchor_count=int(valid.sum()),
    )
    return batch if capacity is None else pack_rows(batch, capacity)


# --- the graphed step ---------------------------------------------------------------------------

class GraphedStep:
    """One replica's `Step` with its phases captured where they were proven, the same phases eagerly
    where not, or the plain eager step where captured updates cannot be trusted. The loop calls
    `accumulate` per micro-batch and `update`, as it calls the `Step`'s."""

    def __init__(self, *, name: str, step: Step, shapes: StepShapes, capture_graphs: bool = True):
        if not step.fused:
            raise ValueError("a graphed step needs a fused AdamW (grad_scale / found_inf)")
        if not step.gradient_buffers:
            raise ValueError("a graphed step needs the Step's persistent gradient buffers (not hand_over_gradients)")
        self.name, self.step, self.shapes = name, step, shapes
        step.lr_from_tensors = True
        self.device = step.device
        self.inputs = {shape: StaticInputs(shape, self.device) for shape in shapes.inputs}
        self.capture_graphs = capture_graphs and self.device.type == "cuda"
        self.graphs: dict[tuple[InputShape, int], Any] = {}
        self.update_graph: Any = None
        self.classic_reason: str | None = None  # captured updates refused: the plain eager step runs
        self.eager_reasons: dict[str, str] = {}  # bucket -> why it runs eagerly
        self.stream: Any = None
        self.pool: GraphPool | None = None
        self.ahead: collections.deque = collections.deque()
        self.gpu_wait_s = 0.0  # host time spent waiting for the GPU to catch up (MAX_AHEAD)
        self.compile_s = 0.0
        self.capture_s = 0.0
        self._unprepared_warned: set[tuple] = set()

    @property
    def vocab_size(self) -> int:
        return self.step.frozen.head_weight.shape[0]

    # --- prepare ---------------------------------------------------------------------------------

    def prepare(self, say: Say) -> str:
        """Compile and capture every bucket (see the module docstring); returns a one-line summary."""
        if not self.capture_graphs:
            return "static step, no CUDA graphs (not a CUDA device)"
        reason = update_capture_unsupported(self.device)
        if reason is None:
            try:
                return self._prepare_graphs(say)
            except Exception as error:  # noqa: BLE001 - whatever broke the warm-up: the proven eager step
                reason = f"the warm-up failed ({error_summary(error)})"
                self.graphs, self.update_graph = {}, None
                self.step.apply = self.step.apply_update
                if self.stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.classic_reason = reason
        self.step.lr_from_tensors = False
        warnings.warn(f"CUDA graphs: {self.name} runs the eager training step: {reason}", stacklevel=2)
        # Its compiles too happen here, in the warm-up: after it nothing compiles (compile_gate.py).
        return f"eager training step ({reason}); {warm_compile(self.step, self.shapes, say)}"

    def _prepare_graphs(self, say: Say) -> str:
        current = torch.cuda.current_stream(self.device)
        self.stream, self.pool = torch.cuda.Stream(self.device), GraphPool()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.step.skip_update()  # the optimizer's state exists (and its update compiled) before any capture
            for shape in self.shapes.inputs:
                self._prepare_shape(shape, say)
            self._prepare_update()
            self.step.reset()
        current.wait_stream(self.stream)
        self._warn_eager_buckets()
        graphs = len(self.graphs) + (self.update_graph is not None)
        wanted = sum(len(r) for r in self.shapes.rows.values()) + 1
        return (f"{graphs}/{wanted} graphs captured; compile {self.compile_s:.1f}s, capture {self.capture_s:.1f}s"
                + (f"; {len(self.eager_reasons)} bucket(s) eager" if self.eager_reasons else ""))

    def _capture(self, fn: Callable[[], Any], check: ReplayCheck | None) -> Captured:
        started = time.perf_counter()
        try:
            return checked_capture(fn, self.device, self.stream, check, self.pool)
        finally:
            self.capture_s += time.perf_counter() - started

    def _prepare_shape(self, shape: InputShape, say: Say) -> None:
        step, inputs, rows, bucket = self.step, self.inputs[shape], self.shapes.rows[shape], bucket_name(shape)
        largest = rows[-1]
        started = time.perf_counter()
        inputs.fill(synthetic_batch(inputs.shape, step.objective, self.vocab_size, self.device, 0))
        step.accumulate(inputs, largest)  # compiles the forward, its backward and the head chunk
        step.reset()
        self.stream.synchronize()
        self.compile_s += time.perf_counter() - started
        captured_before = self.capture_s
        checked = self._capture(lambda: step.accumulate(inputs, largest),
                                lambda graph, _: self._replay_mismatch(graph, inputs, largest))
        if checked.reason is not None:  # no graph for this shape: its steps run eagerly
            self.eager_reasons[bucket] = checked.reason
            say(f"{bucket}: compiled in {time.perf_counter() - started:.1f}s, not captured ({checked.reason})")
            return
        self.graphs[(shape, largest)] = checked.graph
        for count in rows[:-1]:  # the same function as the checked graph, at fewer rows
            captured = self._capture(lambda count=count: step.accumulate(inputs, count), None)
            if captured.reason is None:
                self.graphs[(shape, count)] = captured.graph
            else:
                self.eager_reasons[f"{bucket} rows {count}"] = captured.reason
        say(f"{bucket}: compiled in {time.perf_counter() - started - (self.capture_s - captured_before):.1f}s, "
            f"{sum(1 for k in self.graphs if k[0] == shape)}/{len(rows)} rows buckets captured in "
            f"{self.capture_s - captured_before:.1f}s")

    def _replay_mismatch(self, graph: Any, inputs: StaticInputs, rows: int) -> str | None:
        """A replay on data the capture never saw must equal the eager micro-batch on that data."""
        step = self.step
        inputs.fill(synthetic_batch(inputs.shape, step.objective, self.vocab_size, self.device, 1))
        step.reset()
        step.accumulate(inputs, rows)
        expected = step.fingerprint()
        step.reset()
        graph.replay()
        got = step.fingerprint()
        step.reset()
        # Entry by entry (gradient norms per parameter, loss, metric counts): one scale for all
        # would let the counts hide a wrong gradient.
        error = float(((got - expected).abs() / (expected.abs() + 1e-6)).max())
        if not (float(expected[-1]) > 0 and error <= REPLAY_TOLERANCE):  # the last entry counts the blocks
            return f"a replay differs from the eager micro-batch (relative error {error:.1e})"
        return None

    def _prepare_update(self) -> None:
        step = self.step
        step.skip_update()  # warm-up on this stream
        # Each tensor once: a float32 run's optimizer updates the parameters themselves.
        written = list({id(t): t for t in [*step.params, *updated_tensors(step.optimizer)]}.values())

        def skips(graph: Any, _: Any) -> str | None:
            with torch.no_grad():
                before = torch.stack(torch._foreach_norm(written))
                step.force_skip.fill_(1.0)
                graph.replay()
                if not torch.equal(torch.stack(torch._foreach_norm(written)), before):
                    return "a replayed skipped update moved the weights"
            return None

        try:
            captured = self._capture(step.apply_update, skips)
        finally:
            step.force_skip.zero_()
        if captured.reason is not None:  # the update then runs eagerly
            self.eager_reasons["update"] = captured.reason
            return
        self.update_graph = captured.graph
        step.apply = captured.graph.replay

    def _warn_eager_buckets(self) -> None:
        if self.eager_reasons:
            listed = "; ".join(f"{bucket}: {why}" for bucket, why in self.eager_reasons.items())
            warnings.warn(f"CUDA graphs: {self.name} runs some step parts eagerly (slower, same result): {listed}",
                          stacklevel=3)

    # --- the phases ------------------------------------------------------------------------------

    def run(self, micro_batches: list[DrafterBatch]) -> StepResult | DeferredStepResult:
        """One whole step with nothing between the phases (one replica, one node)."""
        for batch in micro_batches:
            self.accumulate(batch)
        return self.update()

    def _on_device(self) -> Any:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def accumulate(self, batch: DrafterBatch) -> None:
        """`Step.accumulate` of one micro-batch: copied into its bucket's buffers, its graph replayed."""
        if self.classic_reason is not None:
            self.step.accumulate(batch)
            return
        if batch.scored_rows is None:
            raise ValueError("a graphed step needs the scored-slot count from the host (DrafterBatch.scored_rows)")
        with self._on_device():
            batch = self.step.layout(batch)
            shape = next((shape for shape, inputs in self.inputs.items() if inputs.holds(batch)), None)
            if shape is None:
                self._accumulate_unprepared(batch)
                return
            rows = self.shapes.rows_for(shape, batch.scored_rows)
            inputs = self.inputs[shape]
            inputs.fill(batch)
            graph = self.graphs.get((shape, rows))
            if graph is not None:
                graph.replay()
            else:
                self.step.accumulate(inputs, rows)

    def _accumulate_unprepared(self, batch: DrafterBatch) -> None:
        """A shape no bucket was prepared for (not in a pipeline run): eagerly, with buffers of its own."""
        shape = InputShape.of(batch)
        if shape not in self._unprepared_warned:
            self._unprepared_warned.add(shape)
            warnings.warn(f"CUDA graphs: {self.name} got a micro-batch of {shape}, which no bucket was prepared for; "
                          "it runs eagerly", stacklevel=3)
        inputs = StaticInputs(shape, self.device)
        inputs.fill(batch)
        self.step.accumulate(inputs, max(1, batch.scored_rows))

    def update(self) -> StepResult | DeferredStepResult:
        """`Step.update` (its device part replayed where captured); the numbers read later."""
        with self._on_device():
            lr = self.step.update()
            if self.classic_reason is not None:
                return self.step.result(lr)
            return self._deferred(lr)

    def _deferred(self, lr: float) -> DeferredStepResult:
        outputs, block = self.step.outputs, self.step.drafter.config.block_size
        if self.device.type != "cuda":
            return DeferredStepResult(outputs.clone(), None, lr, block)
        host = torch.empty(outputs.shape, dtype=outputs.dtype, pin_memory=True)
        host.copy_(outputs, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self.ahead.append(ready)
        while len(self.ahead) > MAX_AHEAD:
            started = time.perf_counter()
            self.ahead.popleft().synchronize()
            self.gpu_wait_s += time.perf_counter() - started
        return DeferredStepResult(host, ready, lr, block)

    def take_gpu_wait(self) -> float:
        """Seconds the host waited for the GPU since the last call (the worker counts them as waiting)."""
        seconds, self.gpu_wait_s = self.gpu_wait_s, 0.0
        return seconds


# --- eager runs compile up front too ---------------------------------------------------------------

def warm_compile(step: Step, shapes: StepShapes, say: Say) -> str:
    """The eager step's compiles, done before step 1: one `Step.accumulate` per shape bucket on
    synthetic data, gradients and sums zeroed after (no weight, no optimizer state changes)."""
    device, vocab = step.device, step.frozen.head_weight.shape[0]
    started = time.perf_counter()
    for shape in shapes.inputs:
        bucket_started = time.perf_counter()
        try:
            step.accumulate(synthetic_batch(shape, step.objective, vocab, device, 0))
        except Exception as error:  # noqa: BLE001 - its steps run uncompiled instead (compile_gate.py)
            warnings.warn(f"warm-up: {bucket_name(shape)} did not compile up front ({error_summary(error)}); "
                          "its steps run uncompiled (--fail-on-recompile: the first one stops the run)", stacklevel=2)
            continue
        finally:
            step.reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        say(f"{bucket_name(shape)}: compiled in {time.perf_counter() - bucket_started:.1f}s")
    step.skip_update()  # the optimizer's state, and a compiled update's compile (master weights), before step 1
    return f"eager step, {len(shapes.inputs)} shape bucket(s) compiled in {time.perf_counter() - started:.1f}s"


def bucket_name(shape: InputShape) -> str:
    """How the warm-up's lines name a shape bucket."""
    if shape.row_length is None:
        return f"length {shape.length}"
    return f"length {shape.row_length}, {shape.num_anchors} packed anchors"
