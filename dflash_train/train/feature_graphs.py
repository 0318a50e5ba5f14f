"""The target's feature forward as one CUDA graph per length bucket (a FeatureSource).

`target.walk.FeatureForward` walks the target's layers up to the deepest captured layer with
no hooks and no early-exit exception, so it can be captured. `prepare` (in the target worker's
thread, before step 1, one worker at a time: train/startup.py) checks the model on behaviour
(`feature_forward_unsupported`), then per length bucket runs the forward once on a private
stream, captures it there, and checks that a replay on other ids equals `Target.features` on them.

With `compiled` (train/precision.compiles_target: on CUDA, under --compile-target auto for a
dense target only) the captured forward is the torch.compile'd one, one compile per length
bucket in that first run: a Hugging Face layer is
dozens of small kernels (RMSNorm, rotary embedding, SiLU, residual adds) that inductor fuses; on
SmolLM2 such kernels led the target's profile (1,036 kernels a batch eagerly). A bucket whose
compiled forward fails to compile, to capture or to pass the replay check captures the plain
forward instead, and the warning says why. The check: a replay within FEATURE_TOLERANCE of
`Target.features`, or, for the compiled forward, no further from the float32 features of the same
weights than the eager forward is (`judge_features`): it rounds elsewhere, so it may
differ from the eager one and be as right. (On SmolLM2 in bf16 the compiled forward differed from
the eager one by 3.1-3.7e-2 at 512 and 768 tokens on an H200 and an H100, and was refused before
this rule; on the CPU it is closer to float32 than the eager one: bench/feature_compile_error.py.)
A batch then costs one copy of its ids in, one replay and one copy of the features out (the queue
holds several batches, and the graph's own output is rewritten by the next replay).

A model or bucket that fails any of this keeps `Target.features` (one warning naming the reason).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch

from ..capture import GraphPool, checked_capture, error_summary
from ..target.model import Target
from ..target.probe import feature_forward_unsupported
from ..target.walk import FeatureForward
from .batches import HostBatch

FEATURE_TOLERANCE = 2e-2  # relative: the replay runs the same modules; bf16 last bits may differ
# A compiled forward rounds elsewhere than the eager one: it may differ from it by more than the
# tolerance and still be as right. It passes when it is no further from the float32 features of
# the same weights than the eager forward is, times this (largest difference and norm both).
ROUNDING_MARGIN = 1.25


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(the largest difference over the largest expected value, the difference's norm over the
    expected norm)."""
    difference, expected = got.float() - expected.float(), expected.float()
    return (float(difference.abs().max() / expected.abs().max().clamp(min=1e-12)),
            float(difference.norm() / expected.norm().clamp(min=1e-12)))


def judge_features(replayed: torch.Tensor, eager: torch.Tensor, float32: Callable[[], torch.Tensor] | None = None,
                   tolerance: float = FEATURE_TOLERANCE) -> str | None:
    """None when a replay's features may stand in for the eager ones: within `tolerance` of them,
    or, for a compiled forward (`float32` given), no further from the float32 features
    (`float32()`, computed only then) than the eager ones are, times ROUNDING_MARGIN. Else why
    not, with the figures."""
    largest, spread = relative_difference(replayed, eager)
    if largest <= tolerance:
        return None
    # The norm figure too: whether the largest error is one outlier or everywhere.
    differs = f"a replay differs from Target.features (relative error {largest:.1e}; {spread:.1e} in norm)"
    if float32 is None:
        return differs
    try:
        reference = float32()
    except Exception as error:  # noqa: BLE001 - a layer that will not run in float32: the plain forward instead
        return f"{differs}, and no float32 features to judge it by ({error_summary(error)})"
    compiled_error, eager_error = relative_difference(replayed, reference), relative_difference(eager, reference)
    if all(c <= ROUNDING_MARGIN * e for c, e in zip(compiled_error, eager_error)):
        return None
    return (f"{differs} and from the float32 features by {compiled_error[0]:.1e} ({compiled_error[1]:.1e} in norm), where the eager "
            f"forward differs by {eager_error[0]:.1e} ({eager_error[1]:.1e})")


class GraphedFeatures:
    """A FeatureSource over a live target whose `features` replays a captured forward where one
    was prepared for the batch's shape, and calls `fallback.features` otherwise."""

    def __init__(self, fallback: Any, target: Target, lengths: list[int], batch_size: int, compiled: bool = False):
        self.fallback = fallback  # the eager FeatureSource (build.LiveTarget)
        self.target = target
        self.device = fallback.device
        self.layer_ids = list(fallback.layer_ids)
        self.lengths = sorted(set(lengths))
        self.batch_size = batch_size
        self.forward = FeatureForward(target, self.layer_ids)
        self.compiled_forward = torch.compile(self.forward, dynamic=False) if compiled else None
        self.plain_reasons: dict[int, str] = {}  # length -> why its graph holds the uncompiled forward
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.eager_reasons: dict[int, str] = {}

    def prepare(self, say: Callable[[str], None]) -> str:
        if self.device.type != "cuda":
            return "eager features (not a CUDA device)"
        started = time.perf_counter()
        stream, pool = torch.cuda.Stream(self.device), GraphPool()
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for length in self.lengths:
                try:
                    reason = self._prepare_length(length, stream, pool)
                except Exception as error:  # noqa: BLE001 - this length keeps Target.features
                    reason = error_summary(error)
                if reason is not None:
                    self.eager_reasons[length] = reason
                    self.graphs.pop(length, None)
        current.wait_stream(stream)
        if self.eager_reasons:
            listed = "; ".join(f"length {length}: {why}" for length, why in self.eager_reasons.items())
            warnings.warn(f"CUDA graphs: the target's feature forward runs eagerly for {listed}", stacklevel=2)
        if self.plain_reasons:
            listed = "; ".join(f"length {length}: {why}" for length, why in self.plain_reasons.items())
            warnings.warn(f"torch.compile: the target's feature forward is captured uncompiled for {listed}", stacklevel=2)
        compiled = sum(1 for length in self.graphs if length not in self.plain_reasons) if self.compiled_forward else 0
        say(f"feature forward: {len(self.graphs)}/{len(self.lengths)} length bucket(s) captured "
            f"({compiled} compiled) in {time.perf_counter() - started:.1f}s")
        return f"{len(self.graphs)}/{len(self.lengths)} feature graphs, {compiled} compiled"

    def _prepare_length(self, length: int, stream: Any, pool: GraphPool) -> str | None:
        """This length's graph: of the compiled forward where it compiles, captures and passes the
        replay check; else of the plain forward (the reason in `plain_reasons`); else none, and
        the reason is returned."""
        reason = feature_forward_unsupported(self.target, length)
        if reason is not None:
            return reason
        ids = torch.zeros(self.batch_size, length, dtype=torch.long, device=self.device)
        forward = self._warm_forward(ids, length)
        if forward is not self.forward:
            reason = self._capture_checked(forward, ids, stream, pool)
            if reason is None:
                return None
            self.plain_reasons[length] = reason  # the plain forward's graph instead (GraphPool: a fresh pool)
        return self._capture_checked(self.forward, ids, stream, pool)

    def _capture_checked(self, forward: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, stream: Any,
                         pool: GraphPool) -> str | None:
        """Capture `forward(ids)` and check that a replay on other ids equals Target.features (a
        compiled forward: or rounds no worse, `judge_features`); returns why not, or None
        with the graph kept for this length."""
        length, vocab = ids.shape[1], self.target.embed_weight.shape[0]
        ids.copy_(_synthetic_ids(self.batch_size, length, vocab, 0))

        def equals_the_target_features(graph: Any, output: torch.Tensor) -> str | None:
            other = _synthetic_ids(self.batch_size, length, vocab, 1).to(self.device)
            ids.copy_(other)
            graph.replay()
            expected = self.target.features(other, self.layer_ids)
            compiled = forward is not self.forward
            return judge_features(output, expected, (lambda: self.forward.float32(other)) if compiled else None)

        captured = checked_capture(lambda: forward(ids), self.device, stream, equals_the_target_features, pool)
        if captured.reason is None:
            self.inputs[length], self.outputs[length], self.graphs[length] = ids, captured.outputs, captured.graph
        return captured.reason

    def _warm_forward(self, ids: torch.Tensor, length: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The forward to capture for this length, run on this stream first (the compile, lazily
        made state): the compiled one, or the plain one where it fails. The plain forward runs
        first either way: it makes the positions buffer, which a compile must find already made,
        or the call under capture would fail its guards and recompile (the capture then fails)."""
        self.forward(ids)
        if self.compiled_forward is not None:
            try:
                self.compiled_forward(ids)
                self.compiled_forward(ids)  # guards pass now: nothing is compiled under capture
                return self.compiled_forward
            except Exception as error:  # noqa: BLE001 - the plain forward captures as well, slower
                self.plain_reasons[length] = error_summary(error)
        return self.forward

    def features(self, batch: HostBatch) -> torch.Tensor:
        ids = batch.input_ids
        graph = self.graphs.get(ids.shape[1]) if ids.shape[0] == self.batch_size else None
        if graph is None:
            return self.fallback.features(batch)
        length = ids.shape[1]
        self.inputs[length].copy_(ids, non_blocking=True)
        graph.replay()
        return self.outputs[length].clone()


def _synthetic_ids(batch: int, length: int, vocab: int, variant: int) -> torch.Tensor:
    return ((torch.arange(batch * length) * 7919 + 31 * variant) % max(1, vocab)).view(batch, length)
