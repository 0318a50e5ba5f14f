"""Static-shape decoding: preallocated KV caches, one fixed shape per step kind, CUDA graphs.

Why: at batch 1 a small target's decode step is a few hundred tiny kernels. Run eagerly through
Hugging Face with a growing DynamicCache, each costs tens of µs of host time and the GPU idles
(SmolLM2-135M on an H200: 65 ms per token end to end). Here every step of a kind has one
shape, so each kind is captured once in a CUDA graph and replayed with a single launch:

    target-only step   target forward over [1, 1] (+ argmax when greedy)
    draft step         drafter over ≤ B new context rows (padded to B) + the block [1, B]
    verify step        target forward over [1, B]           (+ the drafter's context layers)
    greedy step        draft + argmax + verify + agreement in one graph, one per block length
                       (a full block, and each shorter last block before max_new_tokens)

What varies between steps lives in device tensors, not in shapes: the position of the first
new token (`start`) and the number of real new context rows (`count`). Key/value caches hold
`capacity` positions; attention reads all of them and masks those past the current position,
so nothing is ever cropped: a rejected draft's keys stay in the cache, masked, until the next
verified tokens overwrite them.

The same functions run without graphs on CPU and for odd shapes (the prefill, a short last
block), so the fast CPU suite checks all of the logic; only capture and replay need a GPU.

Which targets: decoder-only models whose layers are the Llama/Qwen pre-norm block (Llama,
Mistral, Qwen2, Qwen3 and their GGUF conversions). The decision is made on behaviour: on a
float32 2-layer replica of the target's class and config, our forward must reproduce the Hugging
Face forward's logits and hidden states; a model that fails (Gemma's rotary signature and scaled
embeddings, a custom forward) or whose sliding window is shorter than the cache decodes through
Hugging Face eagerly instead.
"""

from __future__ import annotations

import copy
import threading
import warnings
import weakref
from typing import Callable, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..capture import GraphPool, capture
from ..core.drafter import DFlashDrafter, apply_rope, embed_block_tokens
from ..target.features import ProbeVerdicts, float32_replica, sliding_window
from ..target.model import Target, hidden_state_index

Outputs = TypeVar("Outputs")

CAPACITY_STEP = 512  # caches are sized in multiples of this, so most prompts share captured graphs
PREFILL_STEP = 64  # prompts are right-padded to a multiple of this: a few prefill shapes, each captured once


def cache_capacity(tokens: int) -> int:
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


def prefill_width(tokens: int, capacity: int) -> int:
    """The padded width a prompt of `tokens` is prefilled at (never past the cache)."""
    return min(-(-tokens // PREFILL_STEP) * PREFILL_STEP, capacity)


def attention_bias(visible: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of `grouped_attention` from `visible` [b, q or 1, keys] (True = seen):
    [b, 1, groups·q or 1, keys], 0 where seen and −inf elsewhere. Built once per forward and
    shared by every layer (SDPA would otherwise convert a boolean mask in each of them)."""
    if visible.shape[1] > 1:
        visible = visible.repeat(1, groups, 1)  # folded query row g·q + i is query i (see below)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return bias[:, None]


def grouped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [b, heads, q, d] over cache rows keys/values [b, kv_heads, positions, d], `bias` from
    `attention_bias` (which keys each query sees) -> [b, q, heads·d].

    Grouped-query heads are folded into the query axis (query head h uses kv head h // groups,
    as Hugging Face's repeat_kv), so the cache is read once, never repeated per group."""
    batch, heads, length, d = query.shape
    kv_heads = keys.shape[1]
    folded = query.reshape(batch, kv_heads, heads // kv_heads * length, d)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(batch, heads, length, d).transpose(1, 2).reshape(batch, length, heads * d)


def matmul_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """`grouped_attention` as two batched matrix products and a softmax reduced in float32 (Hugging
    Face's eager attention, with the grouped heads folded the same way). For a decode step (a few
    folded query rows over a long cache) cuBLAS reads a strided slice of the cache in place,
    where an SDPA backend that refuses the mask or the strides would copy or upcast it first."""
    batch, heads, length, d = query.shape
    kv_heads = keys.shape[1]
    folded = query.reshape(batch, kv_heads, heads // kv_heads * length, d)
    scores = torch.matmul(folded, keys.transpose(-1, -2))
    # Scale and mask in one kernel: with a bias of 0 or −inf, round(bias + scale·s) is
    # round(scale·s) or −inf, the bits of scaling then masking. Softmax reduces in float32 for
    # bf16/fp16 inputs too and writes the input's dtype: no float32 copies of the scores to write,
    # read and round. At 1,024 rows over 1,024 positions the scores' passes move ~82 MB a layer
    # instead of ~310 (~7 GB less a SmolLM2 step); a last-bit difference at most.
    probs = torch.softmax(torch.add(bias, scores, alpha=scale), dim=-1)
    out = torch.matmul(probs, values)
    return out.reshape(batch, heads, length, d).transpose(1, 2).reshape(batch, length, heads * d)


ATTENTION = {"sdpa": grouped_attention, "matmul": matmul_attention}  # how StaticTarget attends over its cache


def _norm_epsilon(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _computes_plain_rms_norm(module: nn.Module) -> bool:
    """Whether `module(x)` is `weight · rms_norm(x)` (Llama's and Qwen's RMSNorm; not Gemma's
    `(1 + weight)`, nor a norm with a bias or another formula). Decided on a shallow copy with a
    float32 CPU weight of its own, random: the formula is the class's, and no CUDA work is done
    (another thread may be capturing a graph); a module with other CUDA state fails on CPU input
    and is kept."""
    weight, eps = getattr(module, "weight", None), _norm_epsilon(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return False
    generator = torch.Generator().manual_seed(0)
    size = weight.shape[0]
    try:
        probe = copy.copy(module)
        probe._parameters = {**module._parameters, "weight": nn.Parameter(torch.rand(size, generator=generator) + 0.5)}
        x = torch.randn(4, 3, size, generator=generator) * 3
        with torch.no_grad():
            expected = probe(x)
            ours = probe.weight * F.rms_norm(x, (size,), eps=eps)
    except Exception:  # noqa: BLE001 - a module that cannot be called so: keep it
        return False
    return expected.shape == ours.shape and bool(torch.allclose(expected, ours, rtol=1e-5, atol=1e-6))


_PLAIN_NORM_CLASSES: dict[type, bool] = {}  # one verdict per norm class


def fused_norm(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module` as `weight · F.rms_norm(x)` where it computes exactly that: on CUDA the float32
    reduction and its one rounding are a single fused kernel, where Hugging Face's written-out
    form is six (a batch-1 or small-model decode step is mostly such kernels); otherwise the
    module itself."""
    kind = type(module)
    if kind not in _PLAIN_NORM_CLASSES:
        _PLAIN_NORM_CLASSES[kind] = _computes_plain_rms_norm(module)
    if not _PLAIN_NORM_CLASSES[kind]:
        return module
    weight, shape, eps = module.weight, (module.weight.shape[0],), _norm_epsilon(module)
    return lambda x: weight * F.rms_norm(x, shape, eps=eps)


def _output_tensors(outputs: object) -> list[torch.Tensor]:
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _unlike(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of `tensor`'s shape that differs from it at every element."""
    if tensor.dtype == torch.bool:
        return ~tensor
    if tensor.is_floating_point():
        return torch.where(torch.isnan(tensor), torch.zeros_like(tensor), torch.full_like(tensor, float("nan")))
    return tensor + 1


def _replay_mismatch(outputs: object, expected: object) -> str | None:
    """Where the replayed outputs differ from the eager result (None when they agree: floats to
    rounding, integers exactly)."""
    for index, (got, want) in enumerate(zip(_output_tensors(outputs), _output_tensors(expected))):
        want = want.to(got.device)
        same = torch.allclose(got, want, rtol=1e-3, atol=1e-5, equal_nan=True) if got.is_floating_point() else torch.equal(got, want)
        if not same:
            return f"output {index} {tuple(got.shape)}"
    return None


class CapturedStep(Generic[Outputs]):
    """`fn()` (reading and writing only tensors it owns) captured in a CUDA graph on first use
    and replayed afterwards; a plain call on CPU. Outputs are the graph's own tensors: read them
    before the next call.

    Capture needs one eager warm-up run first (lazy cuBLAS/attention workspaces must not be
    allocated inside the capture). That run computes the real result; cache writes are
    idempotent (same slots from the same inputs), and `restore` names the tensors the step
    overwrites that it also reads, which are put back before the captured graph's first replay.

    If capture fails (an operation that syncs with the host, ...), the step runs eagerly from then
    on, with one warning: slower, never wrong. Steps given one `pool` (a GraphPool)
    share their graphs' memory; only do that for steps that return nothing, keep all their state
    in tensors made outside the graphs and are replayed one after the other."""

    def __init__(self, fn: Callable[[], Outputs], device: torch.device, name: str, restore: tuple[torch.Tensor, ...] = (),
                 *, graphs: bool = True, pool: GraphPool | None = None):
        self.fn, self.device, self.name, self.restore, self.pool = fn, device, name, restore, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Outputs | None = None
        self.eager = device.type != "cuda" or not graphs

    def __call__(self) -> Outputs:
        if self.eager:
            return self.fn()
        # Capture and replay on the model's device: a graph captured on another device's stream
        # records none of our kernels (they run eagerly on their own device's stream), and
        # every replay would silently return stale outputs.
        with torch.cuda.device(self.device):
            if self.graph is not None:
                self.graph.replay()
                return self.outputs  # type: ignore[return-value]
            return self._capture()

    def milliseconds_per_call(self, repeats: int) -> float:
        """GPU milliseconds per call over `repeats` calls, timed with CUDA events (CUDA only)."""
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                self()
            end.record()
            end.synchronize()
        return start.elapsed_time(end) / repeats

    def _capture(self) -> Outputs:
        saved = [t.clone() for t in self.restore]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            result = self.fn()
            expected = [t.clone() for t in _output_tensors(result)]  # a copy: an output may be a buffer the step reuses
        torch.cuda.current_stream(self.device).wait_stream(stream)
        try:
            # One capture at a time, thread_local, on our own stream of our device: capture.py
            # says why each matters.
            graph, outputs = capture(self.fn, self.device, stream, self.pool)
            for tensor, value in zip(self.restore, saved):
                tensor.copy_(value)
            # Judge the graph by what it does, not by warnings: replayed from the warm-up's
            # inputs it must overwrite every output with the warm-up's result. Kernels that ran
            # outside the capture (an empty or partial graph) leave the poison in place.
            for tensor in _output_tensors(outputs):
                tensor.copy_(_unlike(tensor))
            graph.replay()
            mismatch = _replay_mismatch(outputs, expected)
            if mismatch is not None:
                raise RuntimeError(f"its first replay did not reproduce the eager result ({mismatch} differs): "
                                   "the graph holds none or only part of the step's kernels")
        except torch.OutOfMemoryError:
            raise  # not a reason to run eagerly: the caller frees memory and retries
        except Exception as error:  # noqa: BLE001 - any other capture failure means: stay eager
            warnings.warn(f"CUDA graph capture of the {self.name} step failed, running it eagerly: {error}", stacklevel=2)
            self.eager = True
            # Whatever the capture or replay wrote is overwritten by one more eager run from the
            # warm-up's inputs (its cache writes are the warm-up's own).
            for tensor, value in zip(self.restore, saved):
                tensor.copy_(value)
            return self.fn()
        self.graph, self.outputs = graph, outputs
        return outputs


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


class StaticTarget:
    """The target's forward over preallocated KV caches: `batch` rows of `capacity` positions.

    `forward(ids [b, q], start)` (the first b ≤ batch cache rows; `start` a scalar or one position
    per row) writes row r's new keys/values at positions start[r]..start[r]+q−1 of cache row r, attends over
    the first `attend` cache positions (default: all of them) and returns float32 logits
    [b, q, vocab] (the last column only with `last_only`, column `logits_at` only with that
    device index) and, when `layer_ids` were given,
    their hidden states concatenated [b, q, n·hidden] (layer id k = output of decoder layer k,
    as Hugging Face's hidden_states[k + 1]). A query sees the positions ≤ its own: whatever a
    cache row holds past that is stale or empty and masked, so nothing has to be cropped after a
    rejection, and a row reused for a new prompt needs no clearing.

    `prefill_rows(ids [k, W], lengths [k], rows [k])` starts new sequences in cache rows `rows`
    (right-padded prompts at positions 0..W−1, attending causally to themselves) and returns the
    logits after each prompt's last real token [k, vocab]. The padding's keys land past each
    prompt's end: masked, and overwritten by the row's next tokens before they can be seen.

    The model's own submodules run (norms, projections, MLP, rotary embedding), so bias terms,
    q/k norms and scaled RoPE variants are the model's; only the attention over the cache is ours,
    and the layer norms where their class computes `weight · rms_norm(x)` (`fused_norm`).
    """

    def __init__(self, target: Target, capacity: int, layer_ids: list[int] | None = None, batch: int = 1,
                 attention: str = "sdpa"):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, not {attention!r}")
        self.attend_cache = ATTENTION[attention]
        body = target.model.model
        self.model, self.body, self.layers = target.model, body, target.layers
        self.input_norms = [fused_norm(layer.input_layernorm) for layer in self.layers]
        self.post_attention_norms = [fused_norm(layer.post_attention_layernorm) for layer in self.layers]
        self.final_norm = fused_norm(body.norm)
        self.layer_ids = list(layer_ids or [])
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        kv_heads = attn.k_proj.out_features // self.head_dim
        self.groups = attn.q_proj.out_features // self.head_dim // kv_heads
        weight = target.embed_weight
        self.device, self.capacity, self.batch, self.dtype = weight.device, capacity, batch, weight.dtype
        shape = (len(self.layers), batch, kv_heads, capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.key_positions = torch.arange(capacity, device=self.device)
        self.last_layer = len(self.layers) - 1

    def move_rows(self, source: list[int], destination: list[int], chunk: int = 16) -> None:
        """Copy cache rows `source` to rows `destination` (disjoint sets), a few rows at a time so
        the copy needs little memory of its own."""
        for i in range(0, len(source), chunk):
            src = torch.tensor(source[i:i + chunk], device=self.device)
            dst = torch.tensor(destination[i:i + chunk], device=self.device)
            for cache in (self.keys, self.values):
                cache.index_copy_(1, dst, cache.index_select(1, src))

    @staticmethod
    def bytes_per_position(target: Target) -> int:
        """Cache bytes one row needs per position (keys and values of every layer)."""
        attn = target.layers[0].self_attn
        return 2 * len(target.layers) * attn.k_proj.out_features * target.embed_weight.element_size()

    def forward(
        self, ids: torch.Tensor, start: torch.Tensor, *, last_only: bool = False, features: bool = True,
        attend: int | None = None, float_logits: bool = True, logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        span = attend or self.capacity
        positions = start.reshape(-1, 1) + torch.arange(ids.shape[1], device=self.device)  # [b or 1, q]
        positions = positions.expand(ids.shape[0], -1)
        visible = self.key_positions[:span] <= positions[:, :, None]  # causal, over the cache
        bias = attention_bias(visible, self.groups, self.dtype)
        index = positions[:, None, :, None].expand(-1, self.keys.shape[2], -1, self.head_dim)

        rows = ids.shape[0]  # the first `rows` cache rows

        def over_cache(layer: int, query, key, value, scale: float) -> torch.Tensor:
            keys, values = self.keys[layer][:rows], self.values[layer][:rows]
            keys.scatter_(2, index, key)
            values.scatter_(2, index, value)
            return self.attend_cache(query, keys[:, :, :span], values[:, :, :span], bias, scale)

        hidden, states = self._run(ids, positions, over_cache, features)
        if logits_at is not None:  # one column, given as a device index (a right-padded prompt's last token)
            hidden = hidden.index_select(1, logits_at.reshape(1))
        logits = self.model.lm_head(hidden[:, -1:] if last_only else hidden)
        return (logits.float() if float_logits else logits), states

    def single(self, ids: torch.Tensor, start: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` of a one-row cache, logits without the batch axis: [q, vocab]."""
        logits, states = self.forward(ids, start, **options)
        return logits[0], states

    def prefill_rows(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, *, float_logits: bool = True) -> torch.Tensor:
        count, width = ids.shape
        positions = torch.arange(width, device=self.device)[None].expand(count, -1)

        def own_prompt(layer: int, query, key, value, scale: float) -> torch.Tensor:
            self.keys[layer][:, :, :width].index_copy_(0, rows, key)
            self.values[layer][:, :, :width].index_copy_(0, rows, value)
            # Keys repeated per query head (Hugging Face's repeat_kv): a plain causal call, which
            # every SDPA backend (flash included) takes.
            key, value = key.repeat_interleave(self.groups, dim=1), value.repeat_interleave(self.groups, dim=1)
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
            return out.transpose(1, 2).reshape(count, width, -1)

        hidden, _ = self._run(ids, positions, own_prompt, False)
        last = hidden.gather(1, (lengths - 1).view(count, 1, 1).expand(-1, 1, hidden.shape[-1]))
        logits = self.model.lm_head(last)[:, 0]
        return logits.float() if float_logits else logits

    def _run(self, ids, positions, attend, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding, every decoder layer (`attend` does the attention and its cache writes), the
        final norm -> (normed hidden [b, q, hidden], the requested layers' states or None)."""
        x = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(x, positions)
        wanted = set(self.layer_ids) if features else set()
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            query, key, value = self._project(attn, self.input_norms[i](x), cos, sin)
            x = x + attn.o_proj(attend(i, query, key, value, attn.scaling))
            x = x + layer.mlp(self.post_attention_norms[i](x))
            if i in wanted:
                captured[i] = x
        hidden = self.final_norm(x)
        if self.last_layer in captured:  # Hugging Face's last hidden state is the normed one
            captured[self.last_layer] = hidden
        states = torch.cat([captured[k] for k in self.layer_ids], dim=-1) if wanted else None
        return hidden, states

    def _project(self, attn, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [b, heads, q, d], keys and values [b, kv_heads, q, d], RoPE applied."""
        batch, length, d = x.shape[0], x.shape[1], self.head_dim
        query = attn.q_proj(x).view(batch, length, -1, d)
        key = attn.k_proj(x).view(batch, length, -1, d)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            query, key = attn.q_norm(query), attn.k_norm(key)
        # Queries and keys rotated together: one concatenation and one rotation's kernels, not two.
        heads = query.shape[2]
        rotated = apply_rope(torch.cat((query, key), dim=2).transpose(1, 2), cos, sin)
        value = attn.v_proj(x).view(batch, length, -1, d).transpose(1, 2)
        return rotated[:, :heads], rotated[:, heads:], value


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------


class StaticDrafter:
    """`DFlashDrafter.draft` over a preallocated context cache: `step(features, count, start,
    block_ids)` appends the first `count` rows of `features` [1, R, n·hidden] as context
    positions start−count .. start−1, runs the block `block_ids` [1, L] anchored at `start`
    and returns float32 draft logits [L − 1, vocab] through the target's frozen head.

    The block's own keys/values go to cache slots start..start+L−1 too: the block then sees
    slots < start + L, i.e. all verified context and itself (bidirectional), in one attention
    call with one mask row. The next step's verified context overwrites those slots.

    Each layer projects the context rows and the block in one pass and writes them with one
    copy, so the two sets of slots must not meet: rows past `count` (padding) go past the block,
    to start+L+i, the last slot at most. Slots ≥ start + L are masked in this step and, as start
    only grows, written with verified context before any later step can see them; the last slot
    is never seen (the cache holds B more positions than a decode reaches)."""

    def __init__(self, drafter: DFlashDrafter, target: Target, capacity: int):
        self.drafter, self.target = drafter, target
        config = drafter.config
        weight = drafter.fc.weight
        self.device = weight.device
        shape = (len(drafter.layers), 1, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.key_positions = torch.arange(capacity, device=self.device)
        self.capacity = capacity
        self.scale = config.head_dim**-0.5

    def add_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Every layer's context keys/values of target features [1, R, n·hidden] at `positions` [R].
        A context position's keys depend only on its own feature row and position, so the prompt's
        are written in the prefill (`step` writes a step's new rows with its block's)."""
        drafter = self.drafter
        cos, sin = drafter.rope(positions[None])
        context = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))  # the drafter may run in another dtype
        for i, layer in enumerate(drafter.layers):
            self._write(i, positions, *layer.self_attn.keys_values(context, cos, sin))

    def step(self, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.hidden(features, count, start, block_ids))

    def hidden(self, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The drafter's final hidden states [L − 1, hidden] of draft positions 1..L−1 (see `step`)."""
        drafter, config = self.drafter, self.drafter.config
        length, rows = block_ids.shape[1], features.shape[1]
        row = torch.arange(rows, device=self.device)
        context_positions = torch.where(row < count, start - count + row, (start + length + row).clamp(max=self.capacity - 1))
        positions = torch.cat([context_positions, start + torch.arange(length, device=self.device)])  # context, then block
        dtype = drafter.fc.weight.dtype  # the drafter may run in another dtype than the target
        # In the drafter's dtype once here, not in each of the 2 × layers rotations (apply_rope casts).
        cos_all, sin_all = (t.to(dtype) for t in drafter.rope(positions[None]))
        cos, sin = cos_all[:, rows:], sin_all[:, rows:]
        context = drafter.hidden_norm(drafter.fc(features.to(dtype)))
        x = embed_block_tokens(block_ids, self.target.embed_weight, config.input_embedding_scale).to(dtype)
        visible = (self.key_positions < start + length)[None, None]
        bias = attention_bias(visible, config.num_attention_heads // config.num_key_value_heads, self.keys.dtype)
        for i, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            if layer.attention_conv is not None:  # DFlash2: the block's states convolved before attention
                h, finish_kernel = layer.attention_conv.prepare(h, length)
            self._write(i, positions, *attn.keys_values(torch.cat([context, h], dim=1), cos_all, sin_all))
            out = attn.o_proj(grouped_attention(attn.queries(h, cos, sin), self.keys[i], self.values[i], bias, self.scale))
            if layer.attention_conv is not None:
                out = layer.attention_conv.finish(out, finish_kernel, length)
            x = x + out
            x = x + layer.around(layer.mlp_conv, layer.mlp, layer.post_attention_layernorm(x), length)
        return drafter.norm(x)[0, 1:]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits through the target's frozen head (softcapped where the target caps)."""
        config = self.drafter.config
        head = self.target.head_weight
        logits = F.linear(hidden.to(head.dtype), head).float()
        if config.final_logit_softcapping:
            logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
        return logits

    def greedy_drafts(self, features: torch.Tensor, count: torch.Tensor, start: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The T = 0 drafts [L − 1]: the argmax, or a DFlash2 drafter's selector path from the anchor."""
        hidden = self.hidden(features, count, start, block_ids)
        logits = self.head_logits(hidden)
        selector = self.drafter.candidate_selector
        if selector is None:
            return logits.argmax(-1)
        return selector.select(hidden[None], logits[None], block_ids[:, 0], 0.0)[0][0]

    def _write(self, index: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[index].index_copy_(2, positions, keys)
        self.values[index].index_copy_(2, positions, values)


# ---------------------------------------------------------------------------------------------
# Which models, and the decoding state for one (target, drafter, capacity)
# ---------------------------------------------------------------------------------------------



def static_unsupported(target: Target, capacity: int) -> str | None:
    """Why the static forward cannot decode `target` with this cache, or None when it can.

    Structure first (the submodules it calls), then behaviour: a 12-token probe, prefilled
    in two chunks through our cache, must give Hugging Face's logits and hidden states on a
    float32 2-layer replica (one verdict per model, cached)."""
    window = sliding_window(target.model.config)
    if window is not None and capacity > window:
        return f"its {window}-token sliding window is shorter than the {capacity}-position cache"
    return _VERDICTS(target)


def _probe(target: Target) -> str | None:
    body = getattr(target.model, "model", None)
    stateful = sorted({str(kind) for layer, kind in zip(target.layers, getattr(target.model.config, "layer_types", None) or ())
                       if getattr(layer, "self_attn", None) is None})
    if stateful:  # a hybrid: its linear-attention layers fold every token into a recurrent state
        return f"its {', '.join(stateful)} layers keep a recurrent state, which the static caches do not hold"
    attn = getattr(target.layers[0], "self_attn", None)
    needed = [(body, "embed_tokens"), (body, "rotary_emb"), (body, "norm"), (target.model, "lm_head")]
    needed += [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")]
    needed += [(target.layers[0], n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")]
    missing = [name for owner, name in needed if getattr(owner, name, None) is None]
    if missing:
        return f"{type(target.model).__name__} lacks {', '.join(missing)}"
    # Behaviour, on a float32 replica: the model's own class and config with 2 layers and a
    # 512-token vocabulary, random weights. In bf16 both forwards round differently (Hugging Face
    # itself gives other bits for another sequence length), so only float32 can tell a rounding
    # difference from a missing scale, softcap or rope variant; the class and config decide those.
    try:
        replica = Target(float32_replica(target.model, target.device))
    except Exception as error:  # noqa: BLE001 - a config that cannot be shrunk: stay on Hugging Face
        return f"a 2-layer replica of {type(target.model).__name__} could not be built ({type(error).__name__}: {error})"
    layers = len(replica.layers)
    device = target.device
    ids = (torch.arange(12, device=device) * 7919 % 512)[None]
    other = (torch.arange(8, device=device) * 104729 % 512)[None]
    with torch.no_grad():
        reference = replica.model(ids, output_hidden_states=True, use_cache=False)
        other_reference = replica.model(other, use_cache=False).logits[0]
        try:
            ours = StaticTarget(replica, 16, list(range(layers)))
            first = ours.single(ids[:, :7], torch.tensor(0, device=device))
            second = ours.single(ids[:, 7:], torch.tensor(7, device=device))
            # The batched generator's path: two prompts of other lengths started in swapped cache
            # rows (right-padded), then one step each at its own position.
            batched = StaticTarget(replica, 16, batch=2)
            padded = torch.cat([ids[:, :10], torch.cat([other[:, :6], other[:, :4]], dim=1)])
            started = batched.prefill_rows(padded, torch.tensor([10, 6], device=device), torch.tensor([1, 0], device=device))
            stepped = batched.forward(torch.stack([other[0, 6:7], ids[0, 10:11]]), torch.tensor([6, 10], device=device),
                                      features=False)[0][:, 0]
        except Exception as error:  # noqa: BLE001 - a module with another signature: not our block
            return f"its modules do not run as a Llama/Qwen block ({type(error).__name__}: {error})"
    logits = torch.cat([first[0], second[0]])
    states = torch.cat([first[1], second[1]], dim=1)
    expected_states = torch.cat([reference.hidden_states[hidden_state_index(k)] for k in range(layers)], dim=-1)
    rows = torch.stack([started[0], started[1], stepped[0], stepped[1]])
    expected_rows = torch.stack([reference.logits[0, 9], other_reference[5], other_reference[6], reference.logits[0, 10]])
    for name, got, expected in (("logits", logits, reference.logits[0]), ("hidden states", states, expected_states),
                                ("batched logits", rows, expected_rows)):
        error = float((got - expected).abs().max()) / (float(expected.abs().max()) + 1e-6)
        if not error <= 1e-4:
            return f"its {name} differ from the Hugging Face forward's (relative error {error:.1e} in float32)"
    return None


_VERDICTS = ProbeVerdicts(_probe)


class StaticState:
    """The caches and captured steps of one (target, drafter, capacity) for one thread.

    Captured steps (inputs are the device buffers below, filled by `StaticDecoder`):
        prefill(W)    target forward of `prompt_ids[:, :W]` (a prompt of `prompt_length` tokens,
                      right-padded to W), the drafter's context keys/values of all W positions
                      -> logits after the last real token [vocab]. One graph per padded width:
                      run eagerly, every new prompt length is a new shape (SmolLM2 on an H200:
                      69 ms at a length not seen before, 4.4 ms captured; the difference is
                      launches and per-shape set-up, not kernel time).
        next_token    target forward of `token`                        -> logits [1, vocab]
        next_greedy   the same, argmax included                         -> [0, token]
        draft         drafter over `new_features` (`count` real rows)   -> draft logits [B − 1, vocab]
        verify        target forward of `verify_ids`, with features     -> logits, features
        greedy(L)     draft + argmax + verify + agreement of an L-token block in one graph
                      -> [accepted, target choices × L]; it leaves the verified features in
                      `new_features` for the next step. One graph per block length: the blocks
                      before max_new_tokens shrink (as the reference's do), and an eager step
                      there costs as much as several captured ones. The first step after the
                      prefill runs it too, with no new context rows (`count` 0): the prompt's
                      context is in the drafter's cache already.
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | None, capacity: int):
        device = target.device
        self.capacity, self.device = capacity, device
        # Steps call the state through a weak proxy: a state that owned steps which owned it would
        # outlive its eviction (and hold its caches and graph pools) until a collector pass.
        me = weakref.proxy(self)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.target = StaticTarget(target, capacity, list(drafter.config.target_layer_ids) if drafter else None)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.prompt_ids = torch.zeros(1, capacity, dtype=torch.long, device=device)
        self.prompt_length = torch.ones((), dtype=torch.long, device=device)
        self.prefill_steps: dict[int, CapturedStep[torch.Tensor]] = {}
        # The prefill graphs share one memory pool (one per width would hold a full forward's
        # activations each): a prefill's logits are read before any other prefill replays.
        self.prefill_pool = GraphPool() if device.type == "cuda" else None
        self.next_token = CapturedStep(lambda: me.target.single(me.token, me.start, features=False)[0], device, "target-only")
        self.next_greedy = CapturedStep(lambda: me._next_greedy(), device, "target-only greedy")
        self.drafter = None
        if drafter is not None:
            block = drafter.config.block_size
            self.drafter = StaticDrafter(drafter, target, capacity)
            self.block = torch.full((1, block), drafter.config.mask_token_id, dtype=torch.long, device=device)
            self.new_features = torch.zeros(1, block, drafter.fc.in_features, dtype=target.embed_weight.dtype, device=device)
            self.count = torch.zeros((), dtype=torch.long, device=device)
            self.bonus = torch.zeros(1, dtype=torch.long, device=device)
            self.draft = CapturedStep(
                lambda: me.drafter.step(me.new_features, me.count, me.start, me.block), device, "draft"
            )
            self.verify_ids = torch.zeros(1, block, dtype=torch.long, device=device)
            self.verify = CapturedStep(lambda: me.target.single(me.verify_ids, me.start), device, "verify")
            self.greedy_steps: dict[int, CapturedStep[torch.Tensor]] = {}

    def capture_all(self) -> None:
        """Capture every step shape now (each prefill width on CUDA, the full block and each
        shorter last block), so no capture lands inside a timed decode. A decode writes every
        cache slot it reads (prefill, verified context, its own block) before reading it."""
        if self.device.type == "cuda":  # elsewhere a prefill runs eagerly whatever its width: nothing to capture
            self.prompt_ids.zero_()
            self.prompt_length.fill_(1)
            for width in range(PREFILL_STEP, self.capacity + 1, PREFILL_STEP):
                self.prefill(width)()
        self.start.zero_()
        self.token.zero_()
        self.next_greedy()
        if self.drafter is not None:
            self.start.fill_(1)  # one context row, at position 0
            self.count.fill_(1)
            self.bonus.zero_()
            for length in range(2, self.block.shape[1] + 1):
                self.greedy(length)()

    def prefill(self, width: int) -> CapturedStep[torch.Tensor]:
        if width not in self.prefill_steps:
            me = weakref.proxy(self)  # not self: see __init__
            self.prefill_steps[width] = CapturedStep(lambda: me._prefill(width), self.device, f"{width}-token prefill",
                                                     pool=self.prefill_pool)
        return self.prefill_steps[width]

    def _prefill(self, width: int) -> torch.Tensor:
        # Padding past the prompt sits at positions ≥ its length: the prompt's own queries never
        # see it (causal), and later steps mask it until verified tokens overwrite it.
        logits, features = self.target.single(self.prompt_ids[:, :width], self.start.new_zeros(()),
                                              features=self.drafter is not None, logits_at=self.prompt_length - 1)
        if self.drafter is not None:
            self.drafter.add_context(features, torch.arange(width, device=self.device))
        return logits[0]

    def _next_greedy(self) -> torch.Tensor:
        token = self.target.single(self.token, self.start, features=False)[0].argmax(-1)
        return torch.cat([torch.zeros_like(token), token])

    def greedy(self, length: int) -> CapturedStep[torch.Tensor]:
        if length not in self.greedy_steps:
            me = weakref.proxy(self)  # not self: see __init__
            self.greedy_steps[length] = CapturedStep(
                lambda: me._greedy(length), self.device, f"greedy {length}-token block", restore=(self.new_features,)
            )
        return self.greedy_steps[length]

    def _greedy(self, length: int) -> torch.Tensor:
        block, ids = self.block[:, :length], self.verify_ids[:, :length]
        block[0, :1].copy_(self.bonus)
        drafts = self.drafter.greedy_drafts(self.new_features, self.count, self.start, block)
        ids[0, :1].copy_(self.bonus)
        ids[0, 1:].copy_(drafts)
        logits, features = self.target.single(ids, self.start)
        self.new_features[:, :length].copy_(features)  # the next step's context: its first `count` rows are kept
        return agreement(ids, logits)


def agreement(block: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[accepted, choice_0, ..., choice_{L−1}] for a verified block [1, L] and the target's
    logits [L, vocab]: choice_i is the target's own token after block position i, and the
    leading `accepted` drafts equal it, so the new tokens are choice[:accepted + 1]."""
    choice = logits.argmax(-1)
    accepted = (block[0, 1:] == choice[:-1]).long().cumprod(0).sum()
    return torch.cat([accepted.view(1), choice])


class _StateShelf:
    """The states cached for one module (a drafter; the target model for target-only decoding),
    kept in that module's __dict__: freed with it (module and states form a cycle the garbage
    collector reclaims; a global table would keep both alive), and never copied with it."""

    def __init__(self) -> None:
        self.states: dict[tuple, tuple[tuple[int, ...], StaticState]] = {}

    def __deepcopy__(self, memo: dict) -> "_StateShelf":
        return _StateShelf()

    def __reduce__(self):
        return (_StateShelf, ())


class _ThreadToken:
    """Held only by a threading.local, so it lives exactly as long as its thread; a weak
    reference to it names the thread (thread ids are reused) and fires when the thread ends."""

    def __init__(self) -> None:
        self.ref = weakref.ref(self, _drop_thread_states)


_SHELF = "_dflash_static_states"
_SHELVES: "weakref.WeakSet[_StateShelf]" = weakref.WeakSet()
_THREADS = threading.local()
_STATES_LOCK = threading.RLock()
_MAX_STATES = 8  # per module: each holds caches and graphs


def _drop_thread_states(thread: weakref.ref) -> None:
    """A thread ended: release its states everywhere."""
    with _STATES_LOCK:
        for shelf in list(_SHELVES):
            for key in [k for k in shelf.states if k[0] is thread]:
                del shelf.states[key]


def _thread_ref() -> weakref.ref:
    token = getattr(_THREADS, "token", None)
    if token is None:
        token = _THREADS.token = _ThreadToken()
    return token.ref


def static_state(target: Target, drafter: DFlashDrafter | None, capacity: int) -> StaticState:
    """The cached state for this target, drafter, capacity and thread: graphs are captured once
    per capacity and reused by every later prompt (two threads never share caches).

    Lifetime: a state lives on its drafter (target-only states on the target model), so it goes
    when that module goes; it is released when its thread ends; at most `_MAX_STATES` per module
    (the oldest is dropped). A state holds its target model, so a target dropped while a drafter
    that decoded with it lives stays until that drafter goes."""
    owner = drafter if drafter is not None else target.model
    storage = _weight_storage(target.model, drafter)
    with _STATES_LOCK:
        shelf = vars(owner).get(_SHELF)
        if shelf is None:
            shelf = vars(owner)[_SHELF] = _StateShelf()
        _SHELVES.add(shelf)
        states = shelf.states
        key = (_thread_ref(), weakref.ref(target.model), capacity)
        # Captured graphs read weights at fixed addresses: in-place updates (an optimizer step,
        # load_state_dict) are seen, a replaced tensor (`param.data = ...`) is not, so rebuild then.
        if key not in states or states[key][0] != storage:
            states.pop(key, None)
            if len(states) >= _MAX_STATES:  # bounded: drop the oldest
                states.pop(next(iter(states)))
            states[key] = (storage, StaticState(target, drafter, capacity))
        return states[key][1]


def _weight_storage(*modules: nn.Module | None) -> tuple[int, ...]:
    return tuple(p.data_ptr() for module in modules if module is not None for p in module.parameters())


class StaticDecoder:
    """The decode loop's operations (see `decode.loop.generate`) on a `StaticState`: fixed shapes go
    through the captured steps, odd ones (the prompt, a short last block, a first context longer
    than a block) run the same functions eagerly. Device scalars are set with fill kernels, so
    nothing here waits for the GPU; `greedy` returns host ints, its one transfer per step."""

    kind = "static"

    def __init__(self, state: StaticState, block_size: int):
        self.state, self.block_size = state, block_size

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt through the target and, with a drafter, into the drafter's context cache
        (one captured step per padded width) -> (logits after the prompt, no new context rows:
        so the first step is a whole-step one too)."""
        state = self.state
        length = prompt.shape[1]
        state.prompt_ids[:, :length].copy_(prompt)
        state.prompt_length.fill_(length)
        logits = state.prefill(prefill_width(length, state.capacity))()
        return logits, (state.new_features[:, :0] if state.drafter is not None else None)

    def draft(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> torch.Tensor:
        state = self.state
        count = features.shape[1]
        state.start.fill_(start)
        state.count.fill_(count)
        if length == self.block_size and count <= self.block_size:
            if features.data_ptr() != state.new_features.data_ptr():
                state.new_features[:, :count].copy_(features)
            state.block[0, :1].copy_(bonus)
            return state.draft()
        block = state.block[:, :length].clone()
        block[0, :1].copy_(bonus)
        return state.drafter.step(features, state.count, state.start, block)

    def draft_hidden(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` eagerly, returning the drafter's hidden states [length − 1, hidden] with the logits
        (what a DFlash2 drafter's selector needs)."""
        state = self.state
        state.start.fill_(start)
        state.count.fill_(features.shape[1])
        block = state.block[:, :length].clone()
        block[0, :1].copy_(bonus)
        hidden = state.drafter.hidden(features, state.count, state.start, block)
        return hidden, state.drafter.head_logits(hidden)

    def greedy_drafts(self, features: torch.Tensor, start: int, bonus: torch.Tensor, length: int) -> torch.Tensor:
        """The T = 0 drafts [length − 1] of a step taken by parts (see `greedy_by_parts`)."""
        selector = self.state.drafter.drafter.candidate_selector
        if selector is None:
            return self.draft(features, start, bonus, length).argmax(-1)
        hidden, logits = self.draft_hidden(features, start, bonus, length)
        return selector.select(hidden[None], logits[None], bonus, 0.0)[0][0]

    def verify(self, block: torch.Tensor, start: int, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        state = self.state
        state.start.fill_(start)
        if features and block.shape[1] == self.block_size:
            state.verify_ids.copy_(block)
            return state.verify()
        if not features and block.shape[1] == 1:
            state.token.copy_(block)
            return state.next_token(), None
        return state.target.single(block, state.start, features=features)

    def greedy(
        self, features: torch.Tensor | None, start: int, bonus: torch.Tensor, length: int
    ) -> tuple[list[int], torch.Tensor | None]:
        state = self.state
        if state.drafter is None and length == 1:
            state.start.fill_(start)
            state.token.copy_(bonus[None])
            return state.next_greedy().tolist(), None
        # One graph for the whole step when the new context rows are the last step's verified
        # ones (views of `new_features`) or none (the first step: the prefill wrote the prompt's);
        # other features (a caller's own) go by parts.
        if features.shape[1] == 0 or features.data_ptr() == state.new_features.data_ptr():
            state.start.fill_(start)
            state.count.fill_(features.shape[1])
            state.bonus.copy_(bonus)
            return state.greedy(length)().tolist(), state.new_features
        host, step_features = greedy_by_parts(self, features, start, bonus, length)
        state.new_features[:, :length].copy_(step_features)
        return host, state.new_features

    def keep(self, length: int) -> None:
        """Nothing to crop: positions ≥ length are masked until verified tokens overwrite them."""

    def prepare(self) -> None:
        """Capture every greedy step's graph before anything is timed (see StaticState.capture_all)."""
        self.state.capture_all()


def greedy_by_parts(decoder, features, start: int, bonus: torch.Tensor, length: int) -> tuple[list[int], torch.Tensor | None]:
    """A greedy step from a decoder's `greedy_drafts` and `verify`: drafts, verify, agreement."""
    if length > 1:
        drafts = decoder.greedy_drafts(features, start, bonus, length)
        block = torch.cat([bonus, drafts])[None]
    else:
        block = bonus[None]
    logits, step_features = decoder.verify(block, start, features=length > 1)
    return agreement(block, logits).tolist(), step_features
