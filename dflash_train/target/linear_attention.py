"""A hybrid target's linear-attention (Gated DeltaNet) layers over preallocated states, for the
static forward (target/static_cache.py): the static decoder and the batched generator.

A Gated DeltaNet layer keeps, per sequence, a causal-convolution window (the last K − 1 inputs of
its K-tap depthwise convolution) and a recurrent state S [heads, d_k, d_v] that every token
updates: S ← e^g·S, then S ← S + k·β(v − Sᵀk)ᵀ (the delta rule), and the token's output is Sᵀq.
Nothing here is per position, so a cache of these states cannot be cropped after a rejected
draft; `LinearStates` holds them per cache row and advances them by exactly the tokens asked:

- a forward advances each row by all its new tokens, or by the first `lengths[r]` of them (a
  right-padded prompt: positions past a row's length get β = 0 and g = 0, which leaves the state
  exactly as it was, so one pass gives the real positions' outputs and the state after the last
  real token);
- a verify step (`pending`) leaves the states as they were and keeps what its block computed
  (the block's convolution inputs and each position's k, v, g, β); `commit(counts)` then advances
  row r by exactly its first counts[r] block tokens, as a forward of those tokens alone would,
  with no second pass through the layer's projections. Shapes never depend on the count (a
  device tensor), so a verify step, its agreement and the commit replay as one CUDA graph.

The projections, the gated norm and the output projection are the model's own modules; the
convolution and the delta rule are computed here (the chunked form for several tokens, the
one-token recurrence otherwise), in float32 as Hugging Face's torch path computes them. Two
layouts of the projections are known (`layer_layout`): Qwen3.5's separate qkv/z/b/a projections
and Qwen3-Next's interleaved qkvz/ba ones; another layout is refused, never guessed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 64  # tokens per chunk of the chunked delta rule (the prompt's pass)


def linear_attention_module(layer: nn.Module) -> nn.Module | None:
    """The layer's linear-attention module (`linear_attn`), or None for an attention layer."""
    return getattr(layer, "linear_attn", None)


def linear_attention_modules(layers: list[nn.Module]) -> list[nn.Module]:
    """The linear-attention modules of a model's decoder layers, in order (none for a dense model)."""
    return [module for module in map(linear_attention_module, layers) if module is not None]


def attention_layers(layers: list[nn.Module]) -> list[nn.Module]:
    """The decoder layers that are not linear-attention ones (a hybrid's full attention layers;
    every layer of a dense model)."""
    return [layer for layer in layers if linear_attention_module(layer) is None]


def layer_layout(module: nn.Module) -> str | None:
    """'qwen3_5' (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), 'qwen3_next' (in_proj_qkvz and
    in_proj_ba, split by the module's own `fix_query_key_value_ordering`), or None."""
    if all(hasattr(module, name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        return "qwen3_5"
    if all(hasattr(module, name) for name in ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")):
        return "qwen3_next"
    return None


_NEEDED = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def linear_layer_unsupported(module: nn.Module) -> str | None:
    """Why this linear-attention module cannot run over `LinearStates`, or None."""
    if layer_layout(module) is None:
        return f"its {type(module).__name__} projections are laid out in a way not known here"
    missing = [name for name in _NEEDED if getattr(module, name, None) is None]
    if missing:
        return f"its {type(module).__name__} lacks {', '.join(missing)}"
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        return f"its {type(module).__name__} convolution activation is {module.activation!r}, not silu"
    return None


# ---------------------------------------------------------------------------------------------
# The gated delta rule
# ---------------------------------------------------------------------------------------------


def delta_rule(
    query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gated delta rule over T tokens from `state` -> (outputs [b, H, T, d_v] or None without
    `query`, the state after the last token [b, H, d_k, d_v]).

    query/key [b, H, T, d_k] (normalised, the query scaled), value [b, H, T, d_v], decay (log
    space, ≤ 0) and beta [b, H, T], state [b, H, d_k, d_v]; all float32. One token is the
    recurrence itself; more go by chunks: within a chunk with cumulative decay γ, the state after
    token t is e^{γ_t}·S₀ + Σ_{s≤t} e^{γ_t−γ_s}·k_s·u_sᵀ, where the corrections u solve the unit
    lower-triangular system u_t + Σ_{s<t} β_t e^{γ_t−γ_s}(k_t·k_s)·u_s = β_t(v_t − e^{γ_t}·S₀ᵀk_t)."""
    if key.shape[2] == 1:
        state = state * decay[..., None].exp()
        correction = beta[..., None] * (value - key @ state)  # [b, H, 1, d_v]
        state = state + key.transpose(-1, -2) @ correction
        return (query @ state if query is not None else None), state
    batch, heads, length, _ = key.shape
    chunk = min(chunk, length)
    pad = -length % chunk
    if pad:
        key, value = F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
        decay, beta = F.pad(decay, (0, pad)), F.pad(beta, (0, pad))
        query = F.pad(query, (0, 0, 0, pad)) if query is not None else None
    chunks = (length + pad) // chunk

    def by_chunk(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, heads, chunks, chunk, *x.shape[3:])

    key, value, decay, beta = by_chunk(key), by_chunk(value), by_chunk(decay), by_chunk(beta)
    gamma = decay.cumsum(-1)  # [b, H, n, C]
    earlier = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).tril()  # s ≤ t
    # e^{γ_t−γ_s} for s ≤ t; the exponent is masked before exp (for s > t it may overflow).
    between = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~earlier, float("-inf")).exp()
    weighted_key = key * beta[..., None]
    system = (weighted_key @ key.transpose(-1, -2)) * between
    system = system.masked_fill(~earlier.tril(-1), 0.0)  # strictly lower: the diagonal is 1 (unitriangular)
    corrections = torch.linalg.solve_triangular(system, value * beta[..., None], upper=False, unitriangular=True)
    from_state = torch.linalg.solve_triangular(system, weighted_key * gamma.exp()[..., None], upper=False,
                                               unitriangular=True)
    to_end = (gamma[..., -1:] - gamma).exp()[..., None]  # e^{γ_C−γ_s}
    if query is not None:
        query = by_chunk(query)
        scores = (query @ key.transpose(-1, -2)) * between
        decayed_query = query * gamma.exp()[..., None]
        outputs = []
    for i in range(chunks):
        u = corrections[:, :, i] - from_state[:, :, i] @ state
        if query is not None:
            outputs.append(decayed_query[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * gamma[:, :, i, -1, None, None].exp() + (key[:, :, i] * to_end[:, :, i]).transpose(-1, -2) @ u
    if query is None:
        return None, state
    return torch.cat(outputs, dim=2)[:, :, :length], state


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# ---------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------


class GatedDeltaLayer:
    """The model's Gated DeltaNet module split at its states: `inputs` (projections), `features`
    (after the convolution: q, k, v, g, β for the delta rule) and `output` (gated norm and output
    projection), so that `LinearStates` decides where the states come from and go."""

    def __init__(self, module: nn.Module):
        self.module, self.layout = module, layer_layout(module)
        self.key_heads, self.value_heads = int(module.num_k_heads), int(module.num_v_heads)
        self.key_dim, self.value_dim = int(module.head_k_dim), int(module.head_v_dim)
        weight = module.conv1d.weight  # [channels, 1, K]
        self.channels, self.kernel = weight.shape[0], weight.shape[-1]
        self.conv_weight, self.conv_bias = weight, module.conv1d.bias

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, T, hidden] -> (convolution inputs [b, channels, T], z [b, T, H_v, d_v], b and a [b, T, H_v])."""
        module = self.module
        if self.layout == "qwen3_5":
            mixed = module.in_proj_qkv(x)
            z = module.in_proj_z(x).reshape(x.shape[0], x.shape[1], -1, self.value_dim)
            b, a = module.in_proj_b(x), module.in_proj_a(x)
        else:
            query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
            mixed = torch.cat([t.reshape(x.shape[0], x.shape[1], -1) for t in (query, key, value)], dim=-1)
        return mixed.transpose(1, 2), z, b, a

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        """window [b, channels, K − 1 + T] (the state, then the new inputs) -> [b, T, channels]."""
        out = F.conv1d(window.to(self.conv_weight.dtype), self.conv_weight, self.conv_bias, groups=self.channels)
        return F.silu(out).transpose(1, 2)

    def features(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Convolved inputs [b, T, channels] and b, a -> float32 query, key [b, H_v, T, d_k] (l2
        normalised, the query scaled, key heads repeated for grouped value heads), value
        [b, H_v, T, d_v], decay and beta [b, H_v, T]."""
        batch, length = mixed.shape[:2]
        keys = self.key_heads * self.key_dim
        query, key, value = torch.split(mixed, [keys, keys, self.value_heads * self.value_dim], dim=-1)
        query = query.reshape(batch, length, self.key_heads, self.key_dim).transpose(1, 2).float()
        key = key.reshape(batch, length, self.key_heads, self.key_dim).transpose(1, 2).float()
        value = value.reshape(batch, length, self.value_heads, self.value_dim).transpose(1, 2).float()
        groups = self.value_heads // self.key_heads
        if groups > 1:
            query, key = query.repeat_interleave(groups, dim=1), key.repeat_interleave(groups, dim=1)
        query = _l2_normalised(query) * self.key_dim**-0.5
        key = _l2_normalised(key)
        module = self.module
        decay = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        beta = b.sigmoid().float()
        return query, key, value, decay.transpose(1, 2), beta.transpose(1, 2)

    def output(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """core [b, H_v, T, d_v] (float32) -> the layer's output [b, T, hidden]."""
        batch, _, length, _ = core.shape
        core = core.transpose(1, 2).to(dtype).reshape(-1, self.value_dim)
        normed = self.module.norm(core, z.reshape(-1, self.value_dim))
        return self.module.out_proj(normed.reshape(batch, length, -1))


class LinearStates:
    """Every linear-attention layer's states for `batch` cache rows: the convolution windows
    [layers, batch, channels, K − 1] (the model's dtype) and the recurrent states
    [layers, batch, H_v, d_k, d_v] (float32). With `pending_tokens`, room for one verify step of
    up to that many tokens per row (`pending`, `commit`: module doc)."""

    def __init__(self, modules: list[nn.Module], batch: int, dtype: torch.dtype, device: torch.device,
                 pending_tokens: int = 0):
        self.layers = [GatedDeltaLayer(m) for m in modules]
        first = self.layers[0]
        count, self.dtype = len(self.layers), dtype
        self.window = first.kernel - 1
        self.conv = torch.zeros(count, batch, first.channels, self.window, dtype=dtype, device=device)
        recurrent = (first.value_heads, first.key_dim, first.value_dim)
        self.recurrent = torch.zeros(count, batch, *recurrent, dtype=torch.float32, device=device)
        self.pending_tokens = pending_tokens
        if pending_tokens:
            self.before_conv, self.before_recurrent = torch.zeros_like(self.conv), torch.zeros_like(self.recurrent)
            heads = first.value_heads
            self.pending_inputs = torch.zeros(count, batch, first.channels, pending_tokens, dtype=dtype, device=device)
            self.pending_keys = torch.zeros(count, batch, heads, pending_tokens, first.key_dim, device=device)
            self.pending_values = torch.zeros(count, batch, heads, pending_tokens, first.value_dim, device=device)
            self.pending_decay = torch.zeros(count, batch, heads, pending_tokens, device=device)
            self.pending_beta = torch.zeros(count, batch, heads, pending_tokens, device=device)

    @staticmethod
    def bytes_per_row(modules: list[nn.Module], dtype: torch.dtype) -> int:
        """State bytes one cache row needs (every linear-attention layer's window and state)."""
        total = 0
        for module in modules:
            layer = GatedDeltaLayer(module)
            total += layer.channels * (layer.kernel - 1) * dtype.itemsize
            total += layer.value_heads * layer.key_dim * layer.value_dim * 4
        return total

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The states a step reads and overwrites (a captured step's `restore`)."""
        return (self.conv, self.recurrent)

    def move_rows(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        for states in (self.conv, self.recurrent):
            states.index_copy_(1, destination, states.index_select(1, source))

    def run(self, index: int, x: torch.Tensor, *, rows: torch.Tensor | None = None, fresh: bool = False,
            lengths: torch.Tensor | None = None, pending: bool = False) -> torch.Tensor:
        """Linear-attention layer `index` over x [b, T, hidden] -> its output [b, T, hidden].

        The states of cache rows 0..b−1 (or `rows`) are read (zeros with `fresh`: a new prompt)
        and advanced by every token, or by each row's first `lengths` tokens; with `pending` they
        are left as they were and the block is kept for `commit`."""
        layer = self.layers[index]
        batch, length = x.shape[:2]
        mixed, z, b, a = layer.inputs(x)
        if fresh:
            conv = mixed.new_zeros(batch, layer.channels, self.window)
            recurrent = x.new_zeros(batch, *self.recurrent.shape[2:], dtype=torch.float32)
        elif rows is not None:
            conv, recurrent = self.conv[index].index_select(0, rows), self.recurrent[index].index_select(0, rows)
        else:
            conv, recurrent = self.conv[index][:batch], self.recurrent[index][:batch]
        window = torch.cat([conv.to(mixed.dtype), mixed], dim=-1)
        query, key, value, decay, beta = layer.features(layer.convolve(window), b, a)
        if pending:
            if length > self.pending_tokens:
                raise ValueError(f"a pending step of {length} tokens; the states keep room for {self.pending_tokens}")
            self.before_conv[index][:batch].copy_(conv)
            self.before_recurrent[index][:batch].copy_(recurrent)
            self.pending_inputs[index][:batch, :, :length].copy_(mixed)
            for buffer, computed in ((self.pending_keys, key), (self.pending_values, value),
                                     (self.pending_decay, decay), (self.pending_beta, beta)):
                buffer[index][:batch, :, :length].copy_(computed)
            core, _ = delta_rule(query, key, value, decay, beta, recurrent)
            return layer.output(core, z, x.dtype)
        if length == 1 and rows is None and not fresh and lengths is None:
            # A decode step: the state is updated where it lies (a batched generator's slots hold
            # a few MB each at real shapes; a copy would double the step's state traffic).
            state = self.recurrent[index][:batch]
            state.mul_(decay[..., None].exp())
            correction = beta[..., None] * (value - key @ state)  # [b, H, 1, d_v]
            state.view(-1, *state.shape[2:]).baddbmm_(key.reshape(-1, layer.key_dim, 1),
                                                      correction.reshape(-1, 1, layer.value_dim))
            self.conv[index][:batch].copy_(window[:, :, 1:])
            return layer.output(query @ state, z, x.dtype)
        if lengths is not None:
            real = (torch.arange(length, device=x.device) < lengths.reshape(-1, 1))[:, None]  # [b, 1, T]
            decay, beta = decay * real, beta * real
            new_conv = _window_after(window, lengths, self.window)
        else:
            new_conv = window[:, :, length:]
        core, new_recurrent = delta_rule(query, key, value, decay, beta, recurrent)
        if rows is not None:
            self.conv[index].index_copy_(0, rows, new_conv.to(self.dtype))
            self.recurrent[index].index_copy_(0, rows, new_recurrent)
        else:
            self.conv[index][:batch].copy_(new_conv)
            self.recurrent[index][:batch].copy_(new_recurrent)
        return layer.output(core, z, x.dtype)

    def commit(self, counts: torch.Tensor, length: int) -> None:
        """Advance rows 0..b−1 (b = counts' length) from their states before the pending step of
        `length` tokens by exactly their first counts[r] block tokens (1 ≤ counts[r] ≤ length)."""
        batch = counts.shape[0]
        kept = (torch.arange(length, device=counts.device) < counts.reshape(-1, 1))[:, None]  # [b, 1, L]
        for index in range(len(self.layers)):
            window = torch.cat([self.before_conv[index][:batch], self.pending_inputs[index][:batch, :, :length]], dim=-1)
            self.conv[index][:batch].copy_(_window_after(window, counts, self.window))
            _, state = delta_rule(None, self.pending_keys[index][:batch, :, :length],
                                  self.pending_values[index][:batch, :, :length],
                                  self.pending_decay[index][:batch, :, :length] * kept,
                                  self.pending_beta[index][:batch, :, :length] * kept, self.before_recurrent[index][:batch])
            self.recurrent[index][:batch].copy_(state)


def _window_after(window: torch.Tensor, counts: torch.Tensor, size: int) -> torch.Tensor:
    """The convolution window after each row's first counts[r] new inputs: window [b, channels,
    size + T] holds the old window then the T new inputs -> [b, channels, size]."""
    index = counts.reshape(-1, 1, 1) + torch.arange(size, device=window.device)
    return window.gather(2, index.expand(-1, window.shape[1], -1))
