"""The local answer engines of `regenerate`: a static continuous-batching generator, and the
Hugging Face eager fallback for targets the static forward cannot run.

Static generator (`StaticBatchEngine`). `slots` rows decode at once over preallocated KV caches
(`target.static_cache.StaticTarget` with one cache row per slot; the batch-1 static decoder uses
the same class). Prompts are taken shortest first. When rows finish, waiting prompts take their
slots: once 1/`admit_fraction` of the slots are free (a few large prefills cost the host far less
than one per finished row), the admitted prompts are prefilled together, right-padded, straight
into their cache rows (at most `prefill_tokens` tokens per forward); with CUDA graphs the prefill
is captured too, one graph per (rows, width) bucket (rows a power of two, width a multiple of
PREFILL_WIDTH_STEP), its padding rows written to one scratch cache row that no step reads; every
bucket a phase's prompts can reach is captured before the phase starts. Each
row has its own position, stop flag, token count and seed in device tensors, so one decode step
serves rows at any point of their answers, and has one shape per (rows, attention span): the span
is the number of cache positions attended, a multiple of ATTENTION_STEP that covers the furthest
row, so short rows do not pay for a long capacity; rows is the slot count, until no prompt waits
and at most a quarter of the slots are busy: then the last rows are moved into the lowest slots
and the steps run over fewer rows (a power of two, at least MIN_ROWS). Each shape's step is
captured in a CUDA graph (`capture.CapturedStep`; never on CPU): the all-slots steps of every span before the first
prompt starts, the tail's when first needed; the graphs of one cache share a memory pool. The
attention over the cache is SDPA, two batched matrix products, or (CUDA) a Triton kernel that
reads each row only up to its own position (`target.static_cache.cache_attentions`, the same
result to rounding); with `attention="auto"` the all-slots, full-span step of each is captured and
timed once, and the fastest is used for every step of that cache. Nothing inside a step
waits for the host: a row that stops keeps its slot, frozen, until the host reads the finished
flags, which it does every `read_every` steps with a small non-blocking copy and acts on one
round later, so the GPU runs the next steps meanwhile. Greedy takes the argmax; sampling draws on
the device from a counter-based hash of (row seed, token index) (`decode.sampling`), so a row's
answer never depends on its neighbours.

Memory. On CUDA the slot count is capped so the caches fit in 3/4 of the memory free when the
engine starts; when even that cannot hold the longest prompts, they run after the others in a
phase of their own with fewer slots. A CUDA out-of-memory error halves the slots (said in one
line) and the rows in flight start again.

Which targets. `local_engine` asks the layer walk's probe (`target.probe.static_unsupported`,
which also checks the batched path). A hybrid target's linear-attention layers keep their
convolution window and recurrent state per slot (`target.linear_attention.LinearStates`): a
prefill starts a slot's states from zero and advances them by its prompt's real tokens only, a
step by one token, a moved row takes them along. A target the probe refuses is answered by `EagerBatchEngine`
(`generate_batch`: Hugging Face forwards with a DynamicCache, rows leaving the batch as they
finish), which says so in its description line; `StaticBatchEngine` asked directly raises the
probe's reason before its first forward.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence, TextIO

import torch

from ..capture import CapturedStep, GraphPool
from ..data.render import decode_text, stop_token_ids
from ..decode.recurrent import select_rows
from ..decode.sampling import choose_tokens
from ..target.model import Target, cache_argument
from ..target.probe import static_unsupported
from ..target.static_cache import ATTENTION, CAPACITY_STEP, StaticTarget, cache_attentions, cache_capacity, check_cache_attention
from .regenerate import SETUP_FAILURES, Answer, GenerationSettings, Job

ATTENTION_STEP = 256  # attention spans (one captured step each) are multiples of this many positions
DEFAULT_SLOTS = {"cuda": 1024, "cpu": 8}
EAGER_BATCH = {"cuda": 64, "cpu": 8}
READ_EVERY = 4  # decode steps between two reads of the finished flags
MIN_ROWS = 8  # once no prompt waits, the last rows are moved together into this many slots or more
PREFILL_TOKENS = 16384  # prompt tokens (padding included) per prefill forward
ADMIT_FRACTION = 16  # free slots are refilled once 1/ADMIT_FRACTION of them are free (prefills are eager: few, large ones)
MEMORY_FRACTION = 0.75  # of the CUDA memory free at start that the caches may take
PREFILL_WIDTH_STEP = 64  # captured prefills pad their prompts to a multiple of this many positions


@dataclass(frozen=True)
class Generated:
    tokens: list[int]  # the answer's tokens, the stop token included when there is one
    finish_reason: str  # "stop" or "length"

    def answer_tokens(self) -> list[int]:
        return self.tokens[:-1] if self.finish_reason == "stop" else self.tokens


def to_answer(tokenizer: Any, generated: Generated) -> Answer:
    """The row's answer: its text, and its tokens as generated (training learns those, not the
    text's canonical tokenization, which the target does not always write)."""
    tokens = generated.answer_tokens()
    text = decode_text(tokenizer, tokens)
    return Answer(text, generated.finish_reason, len(generated.tokens), list(tokens))


def _as_answers(tokenizer: Any, results: Iterator[tuple[Job, Generated | BaseException]]) -> Iterator[tuple[Job, Answer | BaseException]]:
    if tokenizer is None:
        raise ValueError("answers are decoded with the target's tokenizer, and it has none")
    for job, result in results:
        yield job, result if isinstance(result, BaseException) else to_answer(tokenizer, result)


def _check_prompt(job: Job, vocab_rows: int) -> BaseException | None:
    """Why the local engines cannot start `job` (checked on the host: an out-of-range id on
    CUDA is a device assert that ends the process)."""
    if job.ids is None:
        return ValueError("the local engines need the rendered prompt's token ids")
    if not job.ids:
        return ValueError("empty prompt: the target needs at least one token to start from")
    high = max(job.ids)
    if high >= vocab_rows or min(job.ids) < 0:
        return IndexError(f"token id {high} is outside the target's {vocab_rows}-row embedding table")
    return None


def _startable(jobs: Iterable[Job], vocab_rows: int) -> tuple[list[Job], list[tuple[Job, BaseException]]]:
    """The jobs sorted by prompt length (stably), and those that cannot start with their reason."""
    waiting, refused = [], []
    for job in jobs:
        problem = _check_prompt(job, vocab_rows)
        if problem is None:
            waiting.append(job)
        else:
            refused.append((job, problem))
    waiting.sort(key=lambda job: len(job.ids))
    return waiting, refused


class HostCopy:
    """Device tensors copied to host memory without waiting (pinned memory, an event on CUDA);
    `result()` waits for that copy only, not for later work on the stream."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = tensor.clone(), None

    def result(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def _copy_into(buffer: torch.Tensor, values: list) -> None:
    """`values` written into `buffer` (a captured graph's static input) without waiting."""
    host = torch.tensor(values, dtype=buffer.dtype)
    buffer.copy_(host.pin_memory() if buffer.device.type == "cuda" else host, non_blocking=True)


def prefills_bucketed(device: torch.device, graphs: bool, requested: bool | None) -> bool:
    """Whether prefills run as captured (rows, width) buckets with a scratch cache row: with
    CUDA graphs, unless `requested` says otherwise (tests ask for the padding on CPU)."""
    return device.type == "cuda" and graphs if requested is None else requested


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":  # pageable memory would make the copy wait for the stream
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class BatchState:
    """The device side of `slots` rows decoding at once with `capacity`-position caches.

    Per slot: the token to feed (`tokens`) at its position (`positions`), whether the row is
    done (`finished`; empty slots are finished), how many tokens it has (`emitted`), its seed,
    and its answer so far (`generated`). `admit` starts prompts in slots; `step(span, rows)` is
    one decode step of the first `rows` slots, one captured graph per (rows, span); `move`
    packs rows into other slots."""

    def __init__(self, target: Target, slots: int, capacity: int, settings: GenerationSettings, stop_ids: Sequence[int],
                 *, graphs: bool = True, attention: str = "auto", bucket_prefills: bool | None = None):
        self.device, self.slots, self.capacity, self.settings = target.device, slots, capacity, settings
        self.max_new = settings.max_new_tokens
        self.graphs = graphs
        # auto: SDPA until capture_steps has timed each on this device (eager steps: SDPA).
        self.attention = "sdpa" if attention == "auto" else attention
        self.attention_ms: dict[str, float] = {}  # what the choice measured (ms per replayed step)
        self.attention_failed: dict[str, str] = {}  # the row kernel, where it did not build or run here
        self.choose_attention = attention == "auto"
        self.pool = GraphPool() if self.device.type == "cuda" and graphs else None
        # Captured prefills (CUDA graphs; on request elsewhere, for tests): one graph per (rows,
        # width) bucket, padding rows write to one extra cache row that no step reads.
        self.bucket_prefills = prefills_bucketed(self.device, graphs, bucket_prefills)
        self.scratch = slots
        self.prefills: dict[tuple[int, int], _Prefill] = {}
        self.prefill_shapes_late = 0  # buckets first needed by a prefill (capture_prefills had not made them)
        # The prefill graphs share a pool of their own: each one's logits are consumed (in stream
        # order) before the next prefill replays, so a later graph may reuse an earlier one's memory.
        self.prefill_pool = GraphPool() if self.pool is not None else None
        # StaticTarget refuses an attention this device does not run.
        self.model = StaticTarget(target, capacity, batch=slots + 1 if self.bucket_prefills else slots,
                                  attention=self.attention)
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(slots, **long)
        self.positions = torch.zeros(slots, **long)
        self.emitted = torch.zeros(slots, **long)
        self.seeds = torch.zeros(slots, **long)
        self.finished = torch.ones(slots, dtype=torch.bool, device=self.device)
        self.generated = torch.zeros(slots, self.max_new, **long)
        self.stops = torch.tensor(list(stop_ids), **long)
        self.steps: dict[int, CapturedStep[None]] = {}
        self.idle = False  # True while capture_steps runs: no slot holds a prompt

    def admit(self, slots: list[int], prompts: list[list[int]], seeds: list[int]) -> None:
        """Prefill `prompts` (right-padded) into cache rows `slots` and take each one's first token."""
        lengths = _to_device([len(p) for p in prompts], torch.long, self.device)
        rows = _to_device(slots, torch.long, self.device)
        row_seeds = _to_device(seeds, torch.long, self.device)
        if self.bucket_prefills:
            logits = self._bucketed_prefill(slots, prompts)
        else:
            width = max(len(p) for p in prompts)
            ids = _to_device([p + [0] * (width - len(p)) for p in prompts], torch.long, self.device)
            logits = self.model.prefill_rows(ids, lengths, rows, float_logits=False)
        first = choose_tokens(logits, self.settings.temperature, self.settings.top_p, row_seeds, torch.zeros_like(row_seeds))
        done = self._is_stop(first) | (self.max_new <= 1)
        self.tokens.index_copy_(0, rows, first)
        self.positions.index_copy_(0, rows, lengths)
        self.emitted.index_copy_(0, rows, torch.ones_like(lengths))
        self.seeds.index_copy_(0, rows, row_seeds)
        self.generated[:, 0].index_copy_(0, rows, first)
        self.finished.index_copy_(0, rows, done)

    def _bucketed_prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """`prefill_rows` through the captured graph of the (rows, width) bucket that holds these
        prompts: rows a power of two, width a multiple of PREFILL_WIDTH_STEP (at most the
        capacity); the padding rows are one-token prompts into the scratch row. Returns the
        logits of the real rows (the graph's own buffer: consumed before the next prefill)."""
        count, width = len(prompts), max(len(p) for p in prompts)
        key = (1 << (count - 1).bit_length(), min(self.capacity, -(-width // PREFILL_WIDTH_STEP) * PREFILL_WIDTH_STEP))
        prefill = self.prefills.get(key)
        if prefill is None:
            prefill = self.prefills[key] = _Prefill(self, *key)
            self.prefill_shapes_late += 1
        rows, width = key
        padding = rows - count
        ids = [p + [0] * (width - len(p)) for p in prompts] + [[0] * width] * padding
        _copy_into(prefill.ids, ids)
        _copy_into(prefill.lengths, [len(p) for p in prompts] + [1] * padding)
        _copy_into(prefill.rows, slots + [self.scratch] * padding)
        return prefill.step()[:count]

    def prefill_buckets(self, longest: int, prefill_tokens: int) -> list[tuple[int, int]]:
        """Every (rows, width) bucket the prefills of prompts of at most `longest` tokens can use.
        Prompts come shortest first and a prefill takes consecutive ones while (count) × (its
        longest) ≤ `prefill_tokens` (one prompt at least), at most one per slot: a bucket of
        width W holds prompts longer than W − PREFILL_WIDTH_STEP, so at most
        `prefill_tokens` // (W − PREFILL_WIDTH_STEP + 1) of them."""
        buckets = []
        top = -(-min(longest, self.capacity) // PREFILL_WIDTH_STEP) * PREFILL_WIDTH_STEP
        for width in range(PREFILL_WIDTH_STEP, top + 1, PREFILL_WIDTH_STEP):
            count = min(self.slots, max(1, prefill_tokens // (width - PREFILL_WIDTH_STEP + 1)))
            rows = 1
            while rows < 2 * count:
                buckets.append((rows, min(self.capacity, width)))
                rows *= 2
        return buckets

    def capture_prefills(self, buckets: list[tuple[int, int]]) -> int:
        """Make (and on CUDA capture, each from its own padding: one-token prompts into the
        scratch row) the prefills of `buckets` now, so that no prefill waits for a capture once
        rows decode; returns how many were new. A bucket needed later anyway is made then and
        counted in `prefill_shapes_late`."""
        new = [key for key in dict.fromkeys(buckets) if key not in self.prefills]
        for key in new:
            prefill = self.prefills[key] = _Prefill(self, *key)
            if self.graphs and self.device.type == "cuda":
                prefill.step()
        return len(new)

    def capture_steps(self) -> int:
        """Capture the steps of all slots at every attention span (the multiples of
        ATTENTION_STEP up to the capacity) now, while no row decodes, so the steady state
        never waits for a capture (CUDA graphs only; the fewer-row steps of a phase's tail are
        captured when first needed). Returns how many were new. A capture's warm-up run writes
        stale cache positions of empty slots only."""
        if self.pool is None:
            return 0
        self.idle = True
        try:
            chosen = self._choose_attention() if self.choose_attention else 0
            spans = list(range(ATTENTION_STEP, self.capacity, ATTENTION_STEP)) + [self.capacity]
            new = [span for span in spans if (self.slots, span) not in self.steps]
            for span in new:
                self.step(span, self.slots)
        finally:
            self.idle = False
        self.finished.fill_(True)
        return chosen + len(new)

    def _choose_attention(self) -> int:
        """Capture the all-slots, full-span step with each cache attention this device runs, keep
        the one that replays fastest (timed with CUDA events) for every later capture; returns the
        captures made. The slots' positions are spread evenly over the capacity meanwhile, as rows
        at every point of their answers are in steady state: SDPA and the matmuls read the whole
        span whatever they are, the row kernel each row up to its own position."""
        self.choose_attention = False
        candidates = {}
        idle_positions = self.positions.clone()
        self.positions.copy_(torch.arange(self.slots, device=self.device) * self.capacity // self.slots)
        try:
            for name in cache_attentions(self.device):
                self.model.use_attention(name)
                step = self._captured(self.capacity, self.slots)
                try:
                    for _ in range(4):  # the capture, then warm replays
                        step()
                except Exception as error:  # noqa: BLE001 - only the Triton kernel may fail to build here
                    if name in ATTENTION:
                        raise
                    self.attention_failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
                    continue
                candidates[name] = step
                self.attention_ms[name] = round(step.milliseconds_per_call(10), 3)
        finally:
            self.positions.copy_(idle_positions)
        self.attention = min(self.attention_ms, key=self.attention_ms.get)
        self.model.use_attention(self.attention)
        self.steps[(self.slots, self.capacity)] = candidates[self.attention]
        return len(candidates)

    def step(self, span: int, rows: int) -> None:
        """One decode step of slots 0..rows−1 (the others are left as they are)."""
        key = (rows, span)
        if key not in self.steps:
            self.steps[key] = self._captured(span, rows)
        self.steps[key]()

    def _captured(self, span: int, rows: int) -> CapturedStep[None]:
        # The state owns its steps, so a step must not own the state: that cycle would keep the
        # caches and the graphs' memory pools alive after the engine lets go of the state, until
        # a garbage-collector pass (an out-of-memory retry at half the slots would fail again).
        state = weakref.proxy(self)
        # A hybrid's linear-attention states advance with every step: a capture made while rows
        # decode (a tail shape) puts their rows back before its checking replay, or the replay
        # would advance them twice. Up front no slot holds a prompt: nothing to keep, no copy.
        states = () if self.idle else tuple(t[:, :rows] for t in self.model.state_tensors())
        return CapturedStep(
            lambda: state._step(span, rows), self.device, f"batched decode ({rows} rows, {span} positions)",
            restore=(self.tokens, self.positions, self.emitted, self.finished, self.generated) + states,
            graphs=self.graphs, pool=self.pool,
        )

    def _step(self, span: int, rows: int) -> None:
        tokens, positions, emitted = self.tokens[:rows], self.positions[:rows], self.emitted[:rows]
        finished, generated = self.finished[:rows], self.generated[:rows]
        logits = self.model.forward(tokens[:, None], positions, last_only=True, features=False, attend=span,
                                    float_logits=False)[0][:, 0]
        live = ~finished
        chosen = choose_tokens(logits, self.settings.temperature, self.settings.top_p, self.seeds[:rows], emitted)
        column = emitted.clamp(max=self.max_new - 1)[:, None]
        generated.scatter_(1, column, torch.where(live[:, None], chosen[:, None], generated.gather(1, column)))
        emitted.add_(live.long())
        finished.logical_or_(live & (self._is_stop(chosen) | (emitted >= self.max_new)))
        tokens.copy_(torch.where(live, chosen, tokens))
        positions.add_(live.long())

    def move(self, source: list[int], destination: list[int]) -> None:
        """Move the rows in slots `source` to the free slots `destination` (caches and state)."""
        self.model.move_rows(source, destination)
        src, dst = torch.tensor(source, device=self.device), torch.tensor(destination, device=self.device)
        for tensor in (self.tokens, self.positions, self.emitted, self.seeds, self.finished, self.generated):
            tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def _is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.stops[None]).any(-1)

    def flags(self) -> HostCopy:
        """[finished, emitted] of every slot, on its way to the host."""
        return HostCopy(torch.stack([self.finished.long(), self.emitted]))

    def answers_of(self, slots: list[int]) -> HostCopy:
        return HostCopy(self.generated.index_select(0, _to_device(slots, torch.long, self.device)))


class _Prefill:
    """The static inputs and the captured prefill of one (rows, width) bucket."""

    def __init__(self, state: BatchState, rows: int, width: int):
        long = dict(dtype=torch.long, device=state.device)
        self.ids = torch.zeros(rows, width, **long)
        self.lengths = torch.ones(rows, **long)
        self.rows = torch.full((rows,), state.scratch, **long)
        model, ids, lengths, cache_rows = state.model, self.ids, self.lengths, self.rows  # not self: no cycle (BatchState._captured)
        self.step = CapturedStep(
            lambda: model.prefill_rows(ids, lengths, cache_rows, float_logits=False), state.device,
            f"prefill ({rows} prompts of up to {width} tokens)", graphs=state.graphs, pool=state.prefill_pool,
        )


@dataclass
class EngineStats:
    """Where the static generator's host time went, and how full its steps were."""

    steps: int = 0  # decode steps run
    row_steps: int = 0  # rows stepped, summed over steps (slots taking part, busy or not)
    busy_row_steps: int = 0  # of those, rows holding a prompt (finished ones wait for the next read)
    prefills: int = 0  # prefill forwards
    admitted: int = 0  # prompts started
    admit_s: float = 0.0  # host seconds enqueuing prefills
    step_s: float = 0.0  # host seconds enqueuing decode steps (captures on the fly included)
    wait_s: float = 0.0  # host seconds waiting for the device (finished flags, answer tokens)
    capture_s: float = 0.0  # host seconds capturing decode steps and prefills up front

    def as_dict(self) -> dict[str, float]:
        values = dataclasses.asdict(self)
        values["occupancy"] = round(self.busy_row_steps / self.row_steps, 3) if self.row_steps else 0.0
        return values


@dataclass
class _Collected:
    jobs: list[Job]
    tokens: HostCopy  # their `generated` rows
    counts: list[int]  # tokens in each


@dataclass
class _Slot:
    job: Job
    length: int  # prompt tokens
    since_round: int  # the first round whose steps it took part in from this slot (admitted or moved here)
    admitted_step: int  # decode steps run before it was admitted


class StaticBatchEngine:
    """`AnswerEngine` over `BatchState`: continuous batching with slot refill (module doc)."""

    def __init__(self, target: Target, settings: GenerationSettings, stop_ids: Sequence[int], *, slots: int,
                 read_every: int = READ_EVERY, prefill_tokens: int = PREFILL_TOKENS, graphs: bool = True,
                 admit_fraction: int = ADMIT_FRACTION, attention: str = "auto", bucket_prefills: bool | None = None,
                 memory_budget: int | None = None, overlap: bool | None = None, log: TextIO | None = None):
        if slots < 1 or read_every < 1 or admit_fraction < 1:
            raise ValueError("slots, read_every and admit_fraction must be at least 1")
        if attention != "auto":
            check_cache_attention(attention, target.device)
        self.target, self.settings, self.stop_ids = target, settings, list(stop_ids)
        self.slots, self.read_every, self.prefill_tokens, self.graphs = slots, read_every, prefill_tokens, graphs
        self.admit_fraction, self.attention, self.bucket_prefills = admit_fraction, attention, bucket_prefills
        self.stats = EngineStats()
        self.log = log or sys.stdout
        self.device = target.device
        # Act on a round's flags one round later, while the device runs the next (module doc):
        # only an asynchronous device gains from it. On by default on CUDA.
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.stops = set(self.stop_ids)
        self.vocab_rows = target.embed_weight.shape[0]
        self.bytes_per_position = StaticTarget.bytes_per_position(target)
        self.bytes_per_row = StaticTarget.bytes_per_row(target)  # a hybrid's linear-attention states
        self.state: BatchState | None = None
        self.budget = memory_budget  # bytes the caches may take; None = 3/4 of free CUDA memory, no limit on CPU
        self.out_of_memory = 0  # times the slots were halved
        graph_note = "CUDA graphs per (rows, attention span)" if self.device.type == "cuda" and graphs else "no CUDA graphs"
        self.setup_failures = SETUP_FAILURES
        states = ", linear-attention states per slot (reset on refill)" if self.bytes_per_row else ""
        self.description = (f"engine: static batched generator, {slots} slots, continuous batching, {graph_note}, "
                            f"finished rows read every {read_every} steps{states}")

    def answers(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Answer | BaseException]]:
        return _as_answers(self.target.tokenizer, self.generated(jobs))

    def run_note(self) -> str:
        """One line for the run's summary: how full the steps were and where the host's time went."""
        stats = self.stats
        state = self.state
        late = f" ({state.prefill_shapes_late} of them made mid-run)" if state is not None and state.bucket_prefills else ""
        attention = (f", attention {state.attention}, {len(state.steps)} step and {len(state.prefills)} prefill shapes{late}"
                     if state is not None else "")
        return (f"{self.slots} slots{attention}: {stats.steps:,} decode steps at occupancy {stats.as_dict()['occupancy']:.2f}, "
                f"{stats.prefills:,} prefills for {stats.admitted:,} prompts; host seconds: prefill {stats.admit_s:.1f}, "
                f"steps {stats.step_s:.1f}, waiting for the GPU {stats.wait_s:.1f}, captures up front {stats.capture_s:.1f}")

    @torch.no_grad()
    def generated(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Generated | BaseException]]:
        """The answers as tokens (what `answers` decodes), in the order rows finish; rows that
        cannot start come last (so bad rows never look like a failing setup to the driver)."""
        waiting, refused = _startable(jobs, self.vocab_rows)
        queue = deque(waiting)
        while queue:
            slots, capacity, count = self._next_phase(queue)
            in_flight: dict[int, Job] = {}
            try:
                yield from self._phase(queue, count, slots, capacity, in_flight)
            except torch.OutOfMemoryError as error:
                self._release()
                first_line = str(error).splitlines()[0][:120] if str(error) else "out of memory"
                if slots == 1:  # nothing left to halve: the rows in flight fail, the others are tried
                    for job in in_flight.values():
                        yield job, error
                    continue
                self.out_of_memory += 1
                self.slots = slots // 2
                print(f"note: out of memory with {slots} slots of {capacity} positions ({first_line}); "
                      f"halving to {self.slots} and starting the {len(in_flight)} rows in flight again", file=self.log)
                for job in sorted(in_flight.values(), key=lambda job: len(job.ids), reverse=True):
                    queue.appendleft(job)
        yield from refused

    def _release(self) -> None:
        self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _cache_budget(self) -> int | None:
        if self.budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            self.budget = int(free * MEMORY_FRACTION)
        return self.budget

    def _scratch_rows(self) -> int:
        """Cache rows beside the slots: the scratch row of captured prefills (BatchState)."""
        return 1 if prefills_bucketed(self.device, self.graphs, self.bucket_prefills) else 0

    def _slot_bytes(self, capacity: int) -> int:
        # The cache row, its linear-attention states, its answer buffer, and room for the step's
        # logits and sampling buffers.
        return (capacity * self.bytes_per_position + self.bytes_per_row + 8 * self.settings.max_new_tokens
                + 16 * self.vocab_rows)

    def _next_phase(self, queue: deque) -> tuple[int, int, int]:
        """(slots, capacity, how many of the waiting jobs) for the next phase: all of them unless
        the caches for the longest would not fit (module doc)."""
        need = [len(job.ids) + self.settings.max_new_tokens for job in queue]
        capacity = cache_capacity(need[-1])
        budget = self._cache_budget()
        rows = self.slots + self._scratch_rows()
        if budget is None or rows * self._slot_bytes(capacity) <= budget:
            return min(self.slots, len(queue)), capacity, len(queue)
        fitting = (budget // rows - self._slot_bytes(0)) // self.bytes_per_position // CAPACITY_STEP * CAPACITY_STEP
        if fitting >= need[0]:
            count = bisect.bisect_right(need, fitting)
            slots = self.slots
        else:  # even the shortest needs fewer slots
            fitting = cache_capacity(need[0])
            count = bisect.bisect_right(need, fitting)
            slots = max(1, budget // self._slot_bytes(fitting) - self._scratch_rows())
        capacity = cache_capacity(need[count - 1])
        print(f"note: caches for {self.slots} slots of {cache_capacity(need[-1])} positions do not fit in "
              f"{budget / 2**30:.1f} GiB: {count} prompts run with {slots} slots of {capacity} positions first", file=self.log)
        return min(slots, count), capacity, count

    def _state_for(self, slots: int, capacity: int) -> BatchState:
        if self.state is None or (self.state.slots, self.state.capacity) != (slots, capacity):
            # The probe `local_engine` asks (cached): a target it refuses stops here with its
            # reason, before a forward or a capture could fail on the way.
            refusal = static_unsupported(self.target, capacity)
            if refusal is not None:
                raise ValueError(f"the static batched generator cannot run {type(self.target.model).__name__}: "
                                 f"{refusal} (local_engine answers it with Hugging Face eagerly)")
            self._release()
            self.state = BatchState(self.target, slots, capacity, self.settings, self.stop_ids, graphs=self.graphs,
                                    attention=self.attention, bucket_prefills=self.bucket_prefills)
        state = self.state
        state.finished.fill_(True)  # every slot empty
        started = time.perf_counter()
        captured = state.capture_steps()
        if captured:
            seconds = time.perf_counter() - started
            self.stats.capture_s += seconds
            timed = ", ".join([f"{name} {ms:.2f} ms" for name, ms in state.attention_ms.items()]
                              + [f"{name} failed ({why})" for name, why in state.attention_failed.items()])
            chose = f"; attention over the cache: {state.attention} ({timed} per step)" if timed else ""
            print(f"captured {captured} decode steps (rows x attention span) for {slots} slots of {capacity} positions "
                  f"in {seconds:.1f}s{chose}", file=self.log, flush=True)
        return state

    def _capture_prefills(self, state: BatchState, longest: int) -> None:
        started = time.perf_counter()
        made = state.capture_prefills(state.prefill_buckets(longest, self.prefill_tokens))
        if made and state.graphs and self.device.type == "cuda":
            seconds = time.perf_counter() - started
            self.stats.capture_s += seconds
            print(f"captured {made} prefills (rows x width) for prompts of up to {longest} tokens in {seconds:.1f}s",
                  file=self.log, flush=True)

    def _phase(self, queue: deque, count: int, slots: int, capacity: int, in_flight: dict[int, Job]):
        """Answer the next `count` jobs of `queue`; `in_flight` holds those taken and not yet yielded.

        One round: admit waiting prompts into free slots, run `read_every` decode steps, ask for
        the finished flags. On CUDA the host acts on a round's flags (and yields the rows they
        finished) one round later, while the GPU runs the next round; on CPU, at once."""
        state = self._state_for(slots, capacity)
        if state.bucket_prefills:
            self._capture_prefills(state, longest=len(queue[count - 1].ids))
        lag = self.overlap
        occupant: list[_Slot | None] = [None] * slots
        rows = slots  # slots 0..rows−1 take part in the steps
        todo = count
        steps = 0
        round_ = 0
        flags: tuple[int, HostCopy] | None = None  # a round's finished flags, on their way
        collected: list[_Collected] = []  # finished rows' tokens, on their way
        stats = self.stats
        admit_at = max(1, slots // self.admit_fraction)
        while True:
            free = [s for s in range(slots) if occupant[s] is None]
            if free and todo and (len(free) >= min(admit_at, todo) or len(free) == slots):
                clock = time.perf_counter()
                taken = [queue.popleft() for _ in range(min(len(free), todo))]
                todo -= len(taken)
                for job in taken:
                    in_flight[id(job)] = job
                for chunk in self._prefill_chunks(taken):
                    into, free = free[: len(chunk)], free[len(chunk):]
                    state.admit(into, [job.ids for job in chunk], [job.seed for job in chunk])
                    for slot, job in zip(into, chunk):
                        occupant[slot] = _Slot(job, len(job.ids), round_, steps)
                    stats.prefills += 1
                stats.admitted += len(taken)
                stats.admit_s += time.perf_counter() - clock
            busy = [s for s in range(rows) if occupant[s] is not None]
            if not todo and busy and rows > MIN_ROWS and 4 * len(busy) <= rows:
                rows = self._compact(state, occupant, busy, round_)  # the tail: step fewer rows
                busy = [s for s in range(rows) if occupant[s] is not None]
            fresh = None
            if busy:
                clock = time.perf_counter()
                span = self._span(occupant, busy, steps, capacity)
                for _ in range(self.read_every):
                    state.step(span, rows)
                steps += self.read_every
                stats.steps += self.read_every
                stats.row_steps += self.read_every * rows
                stats.busy_row_steps += self.read_every * len(busy)
                fresh = (round_, state.flags())
                stats.step_s += time.perf_counter() - clock
            ready, flags = (flags, fresh) if lag else (fresh, None)
            if lag:  # asked for last round: their copy ran before this round's steps
                yield from self._answers(collected, in_flight)
                collected = []
            if ready is not None:
                flag_round, copy = ready
                clock = time.perf_counter()
                finished, emitted = copy.result().tolist()  # host lists: no per-element tensor indexing
                stats.wait_s += time.perf_counter() - clock
                done = [s for s in range(rows) if finished[s] and occupant[s] is not None
                        and occupant[s].since_round <= flag_round]
                if done:
                    collected.append(_Collected([occupant[s].job for s in done], state.answers_of(done),
                                                [emitted[s] for s in done]))
                    for s in done:
                        occupant[s] = None
            if not lag:
                yield from self._answers(collected, in_flight)
                collected = []
            round_ += 1
            if not busy and not collected and flags is None and not todo:
                return

    def _compact(self, state: BatchState, occupant: list[_Slot | None], busy: list[int], round_: int) -> int:
        """Move the busy rows into the lowest slots and return the new, smaller row count. A moved
        row's earlier flags (read from its old slot) are ignored; its flags moved with it."""
        rows = max(MIN_ROWS, 1 << (len(busy) - 1).bit_length())
        movers = [s for s in busy if s >= rows]
        targets = [s for s in range(rows) if occupant[s] is None][: len(movers)]
        if movers:
            state.move(movers, targets)
        for source, target in zip(movers, targets):
            occupant[target], occupant[source] = occupant[source], None
            occupant[target].since_round = round_
        return rows

    def _answers(self, collected: list[_Collected], in_flight: dict[int, Job]) -> Iterator[tuple[Job, Generated]]:
        for rows in collected:
            clock = time.perf_counter()
            tokens = rows.tokens.result().tolist()
            self.stats.wait_s += time.perf_counter() - clock
            for row, (job, count) in enumerate(zip(rows.jobs, rows.counts)):
                in_flight.pop(id(job), None)
                yield job, self._generated(tokens[row][:count])

    def _generated(self, tokens: list[int]) -> Generated:
        return Generated(tokens, "stop" if tokens and tokens[-1] in self.stops else "length")

    def _span(self, occupant: list[_Slot | None], busy: list[int], steps: int, capacity: int) -> int:
        """Cache positions the next `read_every` steps attend: past every busy row's last position."""
        max_new = self.settings.max_new_tokens
        furthest = max(occupant[s].length + min(steps - occupant[s].admitted_step + self.read_every, max_new) for s in busy)
        return min(capacity, -(-furthest // ATTENTION_STEP) * ATTENTION_STEP)

    def _prefill_chunks(self, jobs: list[Job]) -> Iterator[list[Job]]:
        """Consecutive jobs (sorted by length) whose padded prompts fit `prefill_tokens`."""
        chunk: list[Job] = []
        for job in jobs:
            if chunk and (len(chunk) + 1) * len(job.ids) > self.prefill_tokens:
                yield chunk
                chunk = []
            chunk.append(job)
        if chunk:
            yield chunk


# ---------------------------------------------------------------------------------------------
# The fallback: Hugging Face forwards, eagerly
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    settings: GenerationSettings = GenerationSettings(),
    seeds: Sequence[int] | None = None,
) -> list[Generated]:
    """Answer a batch of tokenized prompts (left-padded here) with a KV cache; rows that finish
    leave the batch (their cache rows are dropped). `seeds` (one per prompt) are required for
    sampling, which draws as the static generator does (`decode.sampling`)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    count = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    attention = torch.zeros((count, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - len(prompt):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    # Left padding shifts every row; positions count real tokens only, as for an unpadded prompt.
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    row_seeds = None
    if not settings.greedy:
        if seeds is None or len(seeds) != count:
            raise ValueError("sampling needs one seed per prompt")
        row_seeds = torch.tensor([int(s) for s in seeds], dtype=torch.long, device=device)
    stops = set(int(s) for s in stop_ids)
    cache = DynamicCache(config=model.config)
    cache_kw = {cache_argument(model): cache}
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                   logits_to_keep=1, **cache_kw).logits[:, -1]
    next_position = positions[:, -1:] + 1
    live = list(range(count))  # original index of each row still in the batch
    tokens: list[list[int]] = [[] for _ in range(count)]
    finish = ["length"] * count
    for step in range(max_new_tokens):
        counters = torch.full((len(live),), step, dtype=torch.long, device=device)
        chosen = choose_tokens(logits, settings.temperature, settings.top_p, row_seeds, counters)
        keep = []
        for slot, (row, token) in enumerate(zip(live, chosen.tolist())):
            tokens[row].append(token)
            if token in stops:
                finish[row] = "stop"
            else:
                keep.append(slot)
        if not keep or step + 1 == max_new_tokens:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            select_rows(cache, index)  # a hybrid's recurrent states too
            chosen, attention, next_position = chosen[index], attention[index], next_position[index]
            live = [live[k] for k in keep]
            if row_seeds is not None:
                row_seeds = row_seeds[index]
        attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=-1)
        logits = model(input_ids=chosen[:, None], attention_mask=attention, position_ids=next_position,
                       use_cache=True, **cache_kw).logits[:, -1]
        next_position = next_position + 1
    return [Generated(tokens[i], finish[i]) for i in range(count)]


class EagerBatchEngine:
    """`AnswerEngine` over `generate_batch`: length-sorted batches of `batch_size`. Out of memory
    halves the batch size (said in one line); any other failure of a batch retries its rows
    one by one, and a row that still fails is yielded with its error."""

    def __init__(self, target: Target, settings: GenerationSettings, stop_ids: Sequence[int], *, batch_size: int,
                 reason: str = "", log: TextIO | None = None):
        self.target, self.settings, self.stop_ids, self.batch_size = target, settings, list(stop_ids), batch_size
        tokenizer = target.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.log = log or sys.stdout
        self.vocab_rows = target.embed_weight.shape[0]
        self.out_of_memory = 0
        because = f" (the static generator cannot run this target: {reason})" if reason else ""
        self.setup_failures = SETUP_FAILURES
        self.description = f"engine: Hugging Face eager batches of {batch_size}{because}"

    def answers(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Answer | BaseException]]:
        return _as_answers(self.target.tokenizer, self.generated(jobs))

    def generated(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Generated | BaseException]]:
        waiting, refused = _startable(jobs, self.vocab_rows)
        start = 0
        while start < len(waiting):
            batch = waiting[start:start + self.batch_size]
            try:
                results: list[Generated | BaseException] = list(self._generate(batch))
            except torch.OutOfMemoryError as error:
                self._release()
                if self.batch_size == 1:
                    results = [error]
                else:
                    self.out_of_memory += 1
                    self.batch_size //= 2
                    print(f"note: out of memory at batch {len(batch)} ({str(error).splitlines()[0][:120]}); "
                          f"halving to {self.batch_size}", file=self.log)
                    continue
            except Exception as error:  # noqa: BLE001 - isolated row by row below
                self._release()
                results = [self._alone(job, error, len(batch)) for job in batch]
            start += len(batch)
            yield from zip(batch, results)
        yield from refused

    def _generate(self, batch: list[Job]) -> list[Generated]:
        return generate_batch(self.target.model, [job.ids for job in batch], max_new_tokens=self.settings.max_new_tokens,
                              stop_ids=self.stop_ids, pad_id=self.pad_id, settings=self.settings,
                              seeds=[job.seed for job in batch])

    def _alone(self, job: Job, batch_error: BaseException, batch_size: int) -> Generated | BaseException:
        if batch_size == 1:
            return batch_error  # that row just failed alone
        try:
            return self._generate([job])[0]
        except Exception as error:  # noqa: BLE001 - the row's own failure
            self._release()
            return error

    def _release(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.empty_cache()


def local_engine(target: Target, settings: GenerationSettings, *, batch_size: int = 0, max_prompt_tokens: int | None = None,
                 log: TextIO | None = None, **static_options: Any) -> StaticBatchEngine | EagerBatchEngine:
    """The engine for a target on this machine: the static generator where the static forward
    reproduces the model (its probe), else Hugging Face eagerly. `batch_size` 0 = the device's
    default (DEFAULT_SLOTS, EAGER_BATCH)."""
    if target.tokenizer is None:
        raise ValueError("the local engines decode answers with the target's tokenizer; it has none")
    stop_ids = stop_token_ids(target.model, target.tokenizer)
    kind = "cuda" if target.device.type == "cuda" else "cpu"
    longest = (max_prompt_tokens or target.spec.max_position_embeddings) + settings.max_new_tokens
    reason = static_unsupported(target, cache_capacity(longest))
    if reason is None:
        return StaticBatchEngine(target, settings, stop_ids, slots=batch_size or DEFAULT_SLOTS[kind], log=log, **static_options)
    return EagerBatchEngine(target, settings, stop_ids, batch_size=batch_size or EAGER_BATCH[kind], reason=reason, log=log)
