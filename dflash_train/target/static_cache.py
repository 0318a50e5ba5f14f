"""The target's forward over preallocated key/value caches (`StaticTarget`), for the static
decoder (decode/static.py) and the batched generator (generate/engine.py).

It is `target.walk.LayerWalk` with each layer's attention over the caches: the model's own
submodules run (norms, projections, MLP, rotary embedding), so bias terms, q/k norms and scaled
RoPE variants are the model's; only the attention over the cache is ours (`ATTENTION`: SDPA,
two batched matrix products, or on CUDA a Triton kernel that reads each row only up to its own
position, `row_attention_kernel`), and the layer norms where their class computes
`weight · rms_norm(x)` (`fused_norm`). A hybrid's linear-attention (Gated DeltaNet) layers run
over per-row convolution and recurrent states (`target.linear_attention.LinearStates`); its full
attention layers may gate their output (Qwen3.5, Qwen3-Next: a query projection of twice the
width) and rotate part of each head. Which models it runs is `target.probe.static_unsupported`.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .linear_attention import LinearStates, attention_layers, linear_attention_module, linear_attention_modules
from .model import Target, apply_rope
from .row_attention_kernel import attend_cache_rows
from .row_attention_kernel import available as row_attention_available
from .walk import LayerWalk

CAPACITY_STEP = 512  # caches are sized in multiples of this, so most prompts share captured graphs


def cache_capacity(tokens: int) -> int:
    """The positions of a static cache holding `tokens`: the next multiple of CAPACITY_STEP."""
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


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


# How StaticTarget attends over its cache: these two read which keys a query sees from
# `attention_bias`; "rows" (`row_attention_kernel.attend_cache_rows`, where it is `available`)
# from each row's positions, reading a row only up to its own last one.
ATTENTION = {"sdpa": grouped_attention, "matmul": matmul_attention}
CACHE_ATTENTIONS = (*ATTENTION, "rows")


def cache_attentions(device: torch.device) -> list[str]:
    """The cache attentions that run on `device`."""
    return [name for name in CACHE_ATTENTIONS if name in ATTENTION or row_attention_available(device)]


def check_cache_attention(name: str, device: torch.device) -> None:
    """Raise ValueError unless `name` is a cache attention that runs on `device`."""
    if name not in CACHE_ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(CACHE_ATTENTIONS)}, not {name!r}")
    if name not in cache_attentions(device):
        raise ValueError(f"attention {name!r} needs a CUDA device with Triton; {device} has "
                         f"{', '.join(cache_attentions(device))}")


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

    Each layer is the model's block with its attention over the cache (module doc).

    A hybrid's linear-attention layers keep their states per cache row (`self.linear`): a forward
    advances rows 0..b−1 by all their new tokens, or by the first `lengths[r]` (a right-padded
    prompt), from zero states with `fresh` (a new prompt); `prefill_rows` starts its rows from zero
    states. With `pending` (a verify step) the states stay as they were until `commit(counts,
    length)` advances each row by exactly its kept block tokens. A dense target has none of these
    states, and the options change nothing for it.
    """

    def __init__(self, target: Target, capacity: int, layer_ids: list[int] | None = None, batch: int = 1,
                 attention: str = "sdpa", pending_tokens: int = 0):
        self.model, self.layers = target.model, target.layers
        self.input_norms = [fused_norm(layer.input_layernorm) for layer in self.layers]
        self.post_attention_norms = [fused_norm(layer.post_attention_layernorm) for layer in self.layers]
        self.walk = LayerWalk(target, final_norm=fused_norm(target.model.model.norm))
        self.layer_ids = list(layer_ids or [])
        mixers = [linear_attention_module(layer) for layer in self.layers]
        attention_layers = [i for i, mixer in enumerate(mixers) if mixer is None]
        # Cache slot of each attention layer, position in the linear states of each linear one.
        self.cache_slot = {layer: slot for slot, layer in enumerate(attention_layers)}
        self.linear_slot = {layer: slot for slot, layer in enumerate(i for i, m in enumerate(mixers) if m is not None)}
        attn = self.layers[attention_layers[0]].self_attn
        self.head_dim = attn.head_dim
        kv_heads = attn.k_proj.out_features // self.head_dim
        # A gated attention's query projection holds each head's query and output gate.
        self.gated = attn.q_proj.out_features == 2 * attn.o_proj.in_features
        self.groups = attn.q_proj.out_features // (2 if self.gated else 1) // self.head_dim // kv_heads
        weight = target.embed_weight
        self.device, self.capacity, self.batch, self.dtype = weight.device, capacity, batch, weight.dtype
        self.use_attention(attention)
        shape = (len(attention_layers), batch, kv_heads, capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.key_positions = torch.arange(capacity, device=self.device)
        linear = [mixer for mixer in mixers if mixer is not None]
        self.linear = LinearStates(linear, batch, weight.dtype, self.device, pending_tokens) if linear else None

    def use_attention(self, name: str) -> None:
        """Attend over the cache with `name` (one of `cache_attentions(device)`) from the next forward on."""
        check_cache_attention(name, self.device)
        self.attention = name

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """The linear-attention states a step reads and overwrites (none for a dense target): a
        captured step that advances them restores them before its checking replay."""
        return self.linear.tensors() if self.linear is not None else ()

    def commit(self, counts: torch.Tensor, length: int) -> None:
        """After a `pending` forward of `length` tokens: advance each row's linear-attention
        states by exactly its first counts[r] of them (nothing to do for a dense target)."""
        if self.linear is not None:
            self.linear.commit(counts, length)

    def move_rows(self, source: list[int], destination: list[int], chunk: int = 16) -> None:
        """Copy cache rows `source` to rows `destination` (disjoint sets), a few rows at a time so
        the copy needs little memory of its own."""
        for i in range(0, len(source), chunk):
            src = torch.tensor(source[i:i + chunk], device=self.device)
            dst = torch.tensor(destination[i:i + chunk], device=self.device)
            for cache in (self.keys, self.values):
                cache.index_copy_(1, dst, cache.index_select(1, src))
            if self.linear is not None:
                self.linear.move_rows(src, dst)

    @staticmethod
    def bytes_per_position(target: Target) -> int:
        """Cache bytes one row needs per position (keys and values of every attention layer)."""
        attention = attention_layers(target.layers)
        attn = attention[0].self_attn
        return 2 * len(attention) * attn.k_proj.out_features * target.embed_weight.element_size()

    @staticmethod
    def bytes_per_row(target: Target) -> int:
        """State bytes one row needs whatever its length (a hybrid's linear-attention states; 0 else)."""
        linear = linear_attention_modules(target.layers)
        return LinearStates.bytes_per_row(linear, target.embed_weight.dtype) if linear else 0

    def forward(
        self, ids: torch.Tensor, start: torch.Tensor, *, last_only: bool = False, features: bool = True,
        attend: int | None = None, float_logits: bool = True, logits_at: torch.Tensor | None = None,
        fresh: bool = False, lengths: torch.Tensor | None = None, pending: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        span = attend or self.capacity
        positions = start.reshape(-1, 1) + torch.arange(ids.shape[1], device=self.device)  # [b or 1, q]
        positions = positions.expand(ids.shape[0], -1)
        bias = None
        if self.attention in ATTENTION:
            visible = self.key_positions[:span] <= positions[:, :, None]  # causal, over the cache
            bias = attention_bias(visible, self.groups, self.dtype)
        index = positions[:, None, :, None].expand(-1, self.keys.shape[2], -1, self.head_dim)

        rows = ids.shape[0]  # the first `rows` cache rows

        def over_cache(layer: int, query, key, value, scale: float) -> torch.Tensor:
            slot = self.cache_slot[layer]
            keys, values = self.keys[slot][:rows], self.values[slot][:rows]
            keys.scatter_(2, index, key)
            values.scatter_(2, index, value)
            keys, values = keys[:, :, :span], values[:, :, :span]
            if bias is None:
                return attend_cache_rows(query, keys, values, positions, scale)
            return ATTENTION[self.attention](query, keys, values, bias, scale)

        def recurrent(layer: int, x: torch.Tensor) -> torch.Tensor:
            return self.linear.run(self.linear_slot[layer], x, fresh=fresh, lengths=lengths, pending=pending)

        hidden, states = self._run(ids, positions, over_cache, features, recurrent)
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
            slot = self.cache_slot[layer]
            self.keys[slot][:, :, :width].index_copy_(0, rows, key)
            self.values[slot][:, :, :width].index_copy_(0, rows, value)
            # Keys repeated per query head (Hugging Face's repeat_kv): a plain causal call, which
            # every SDPA backend (flash included) takes.
            key, value = key.repeat_interleave(self.groups, dim=1), value.repeat_interleave(self.groups, dim=1)
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
            return out.transpose(1, 2).reshape(count, width, -1)

        def new_states(layer: int, x: torch.Tensor) -> torch.Tensor:  # from zero states, into cache rows `rows`
            return self.linear.run(self.linear_slot[layer], x, rows=rows, fresh=True, lengths=lengths)

        hidden, _ = self._run(ids, positions, own_prompt, False, new_states)
        last = hidden.gather(1, (lengths - 1).view(count, 1, 1).expand(-1, 1, hidden.shape[-1]))
        logits = self.model.lm_head(last)[:, 0]
        return logits.float() if float_logits else logits

    def _run(self, ids, positions, attend, features: bool, recurrent) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The walk through every decoder layer (`attend` does the attention and its cache writes,
        `recurrent` a linear-attention layer with its states) -> (normed hidden [b, q, hidden],
        the requested layers' states or None)."""

        def block(i: int, x: torch.Tensor, rotary) -> torch.Tensor:
            layer = self.layers[i]
            if i in self.linear_slot:
                x = x + recurrent(i, self.input_norms[i](x))
            elif self.gated:
                attn = layer.self_attn
                query, key, value, gate = self._project_gated(attn, self.input_norms[i](x), *rotary)
                x = x + attn.o_proj(attend(i, query, key, value, attn.scaling) * torch.sigmoid(gate))
            else:
                attn = layer.self_attn
                query, key, value = self._project(attn, self.input_norms[i](x), *rotary)
                x = x + attn.o_proj(attend(i, query, key, value, attn.scaling))
            return x + layer.mlp(self.post_attention_norms[i](x))

        return self.walk(ids, positions, block, self.walk.last, self.layer_ids if features else [])

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

    def _project_gated(self, attn, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_project` of a gated attention (Qwen3.5, Qwen3-Next): each head's query projection is
        followed by its output gate, and RoPE may turn only the first dimensions of a head.
        -> (queries, keys, values, the gate [b, q, heads·d] applied to the attention's output)."""
        batch, length, d = x.shape[0], x.shape[1], self.head_dim
        query, gate = attn.q_proj(x).view(batch, length, -1, 2 * d).split(d, dim=-1)
        gate = gate.reshape(batch, length, -1)
        query, key = attn.q_norm(query), attn.k_norm(attn.k_proj(x).view(batch, length, -1, d))
        heads = query.shape[2]
        both = torch.cat((query, key), dim=2).transpose(1, 2)
        turned = cos.shape[-1]
        if turned == d:
            rotated = apply_rope(both, cos, sin)
        else:  # partial rotary: the rest of each head passes unrotated
            rotated = torch.cat((apply_rope(both[..., :turned], cos, sin), both[..., turned:]), dim=-1)
        value = attn.v_proj(x).view(batch, length, -1, d).transpose(1, 2)
        return rotated[:, :heads], rotated[:, heads:], value, gate
