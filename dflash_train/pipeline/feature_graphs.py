"""The target's feature forward as one CUDA graph per length bucket (a FeatureSource).

`feature_forward.FeatureForward` runs the target's modules up to the deepest captured layer with
no hooks and no early-exit exception, so it can be captured. `prepare` (in the target worker's
thread, before step 1, one worker at a time: pipeline/startup.py) checks the model on behaviour
(`feature_forward_unsupported`), then per length bucket runs the forward once eagerly on a private
stream, captures it there, and checks that a replay on other ids equals `Target.features` on them.
A batch then costs one copy of its ids in, one replay and one copy of the features out (the queue
holds several batches, and the graph's own output is rewritten by the next replay).

A model or bucket that fails any of this keeps `Target.features` (one warning naming the reason).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch

from ..feature_forward import FeatureForward, feature_forward_unsupported
from ..graph_capture import CaptureError, GraphPool, capture
from ..target import Target
from .batches import HostBatch

FEATURE_TOLERANCE = 2e-2  # relative: the replay runs the same modules; bf16 last bits may differ


class GraphedFeatures:
    """A FeatureSource over a live target whose `features` replays a captured forward where one
    was prepared for the batch's shape, and calls `fallback.features` otherwise."""

    def __init__(self, fallback: Any, target: Target, lengths: list[int], batch_size: int):
        self.fallback = fallback  # the eager FeatureSource (build.LiveTarget)
        self.target = target
        self.device = fallback.device
        self.layer_ids = list(fallback.layer_ids)
        self.lengths = sorted(set(lengths))
        self.batch_size = batch_size
        self.forward = FeatureForward(target, self.layer_ids)
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
                    self._prepare_length(length, stream, pool)
                except Exception as error:  # noqa: BLE001 - this length keeps Target.features
                    text = str(error).strip()
                    self.eager_reasons[length] = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
                    self.graphs.pop(length, None)
        current.wait_stream(stream)
        if self.eager_reasons:
            listed = "; ".join(f"length {length}: {why}" for length, why in self.eager_reasons.items())
            warnings.warn(f"CUDA graphs: the target's feature forward runs eagerly for {listed}", stacklevel=2)
        say(f"feature forward: {len(self.graphs)}/{len(self.lengths)} length bucket(s) captured "
            f"in {time.perf_counter() - started:.1f}s")
        return f"{len(self.graphs)}/{len(self.lengths)} feature graphs"

    def _prepare_length(self, length: int, stream: Any, pool: GraphPool) -> None:
        reason = feature_forward_unsupported(self.target, length)
        if reason is not None:
            raise CaptureError(reason)
        vocab = self.target.embed_weight.shape[0]
        ids = torch.zeros(self.batch_size, length, dtype=torch.long, device=self.device)
        ids.copy_(_synthetic_ids(self.batch_size, length, vocab, 0))
        self.forward(ids)  # warm-up on this stream (also makes the positions buffer)
        graph, output = capture(lambda: self.forward(ids), self.device, stream, pool)
        other = _synthetic_ids(self.batch_size, length, vocab, 1).to(self.device)
        ids.copy_(other)
        graph.replay()
        expected = self.target.features(other, self.layer_ids)
        scale = float(expected.abs().max())
        error = float((output - expected).abs().max()) / (scale + 1e-12)
        if not error <= FEATURE_TOLERANCE:
            raise CaptureError(f"a replay differs from Target.features (relative error {error:.1e})")
        self.inputs[length], self.outputs[length], self.graphs[length] = ids, output, graph

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
