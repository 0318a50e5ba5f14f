"""The DFlash drafter (docs/SEMANTICS.md), with parameter names the reference and serving engines load.

Given the target's hidden states at a few layers (the context) and a block
[anchor token, MASK × (B−1)], it predicts the B−1 tokens after the anchor in one pass:

    context = hidden_norm(fc(concat(target layers)))           computed once, shared by all layers
    x       = embed([anchor, MASK, ..., MASK])                  frozen target embedding
    per layer (Qwen3-style pre-norm block):
        q   = rope(q_norm(q_proj(norm(x))))                     queries: block tokens only
        k,v = k_proj/v_proj of [context ; norm(x)]              keys: context + block
        x  += o_proj(attention(q, k, v, DFlash mask))
        x  += mlp(norm(x))
    hidden  = norm(x)  ->  frozen target LM head  ->  logits

Positions: context j -> j; block token k of a block anchored at a -> a + k.
DFlash2 (`arch = "dflash2"`, core/dflash2.py): the same, with a grouped dynamic causal convolution
around each layer's attention and MLP, and a candidate selector after the head.
Two entry points share every weight: `forward` (training: N blocks at once under the
DFlash mask) and `draft` (inference: one block, context k/v kept in a cache).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..target.model import TargetError, TargetSpec, apply_rope, check_target_layer_ids, default_target_layer_ids
from .attention import attend
from .dflash2 import ARCHITECTURES, CandidateSelector, GroupedDynamicCausalConv, check_dflash2_dims


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    input_embedding_scale: float = 1.0
    final_logit_softcapping: float | None = None
    hidden_act: str = field(default="silu")
    # DFlash2 only (core/dflash2.py); a DFlash drafter ignores them. Checkpoints without them are DFlash.
    arch: str = "dflash"
    conv_kernel_size: int = 2  # the released DFlash2 drafters' values, which engines' kernels are written for
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 16

    @classmethod
    def from_target(
        cls,
        spec: TargetSpec,
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        num_captured_layers: int | None = None,
        **dflash2: Any,
    ) -> "DrafterConfig":
        """Drafter dims from the target; target layers default to the rule of docs/SEMANTICS.md with
        as many captured layers as draft layers (the paper's choice)."""
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(spec.num_hidden_layers, num_captured_layers or num_layers)
            if len(set(target_layer_ids)) != len(target_layer_ids):
                raise TargetError(
                    f"the default layer rule gives {target_layer_ids} for a {spec.num_hidden_layers}-layer target "
                    f"and {len(target_layer_ids)} captured layers: pass --target-layer-ids explicitly"
                )
        config = cls(
            hidden_size=spec.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            rms_norm_eps=spec.rms_norm_eps,
            vocab_size=spec.vocab_size,
            rope_parameters=dict(spec.rope_parameters),
            max_position_embeddings=spec.max_position_embeddings,
            block_size=block_size,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=spec.num_hidden_layers,
            mask_token_id=mask_token_id,
            input_embedding_scale=spec.input_embedding_scale,
            final_logit_softcapping=spec.final_logit_softcapping,
            **dflash2,
        )
        config.validate()
        return config

    def validate(self) -> None:
        if self.block_size < 2:
            raise TargetError(
                f"block_size {self.block_size}: must be at least 2 (position 0 is the anchor, "
                "so a block of 1 drafts nothing); DFlash uses 16"
            )
        if self.num_hidden_layers < 1:
            raise TargetError("num_layers must be at least 1")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise TargetError(
                f"mask_token_id {self.mask_token_id} is outside the target's embedding table "
                f"(0..{self.vocab_size - 1}); choose an unused row in that range"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise TargetError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.arch not in ARCHITECTURES:
            raise TargetError(f"arch {self.arch!r}: use {' or '.join(ARCHITECTURES)}")
        if self.arch == "dflash2":
            problem = check_dflash2_dims(self.hidden_size, self.vocab_size, self.conv_kernel_size,
                                         self.conv_group_size, self.selector_rank, self.selector_top_k)
            if problem:
                raise TargetError(problem)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DrafterConfig":
        config = cls(**values)
        config.validate()
        return config


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 then cast back before the weight, as the reference does.
        if torch.compiler.is_compiling():  # written out: the compiler fuses it with its neighbours
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)
        # Eager (the decoders): the same float32 reduction and one rounding in a single kernel on
        # CUDA, where the written-out form is six; a small drafter's step is mostly such kernels.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """k, v of `states` [b, L, hidden] -> [b, kv_heads, L, d] each (k normed and rotated)."""
        b, length, _ = states.shape
        k = self.k_norm(self.k_proj(states).view(b, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(states).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q of the block states x [b, L, hidden] -> [b, heads, L, d] (normed and rotated)."""
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, length, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def forward(self, x, cos, sin, context_k, context_v, mask) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.queries(x, cos, sin)
        block_k, block_v = self.keys_values(x, cos, sin)
        k = torch.cat([context_k, block_k], dim=2)
        v = torch.cat([context_v, block_v], dim=2)
        out = attend(q, k, v, mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class DraftMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.attention_conv = self.mlp_conv = None
        if config.arch == "dflash2":
            self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def forward(self, x, cos, sin, context_k, context_v, mask, segment: int | None = None) -> torch.Tensor:
        """`segment`: the block length the DFlash2 convolutions stay inside (None: all of x)."""
        segment = segment or x.shape[1]
        x = x + self.around(self.attention_conv, lambda h: self.self_attn(h, cos, sin, context_k, context_v, mask),
                            self.input_layernorm(x), segment)
        return x + self.around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x), segment)

    @staticmethod
    def around(conv: GroupedDynamicCausalConv | None, sub_block, h: torch.Tensor, segment: int) -> torch.Tensor:
        """sub_block(h), or for DFlash2 its convolved form finish(sub_block(prepare(h)))."""
        if conv is None:
            return sub_block(h)
        h, finish_kernel = conv.prepare(h, segment)
        return conv.finish(sub_block(h), finish_kernel, segment)


class DrafterCache:
    """Per-layer context keys/values for inference; blocks are never stored, so the cache
    holds exactly the verified context, as in the reference loop."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        config.validate()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.candidate_selector = None
        if config.arch == "dflash2":
            self.candidate_selector = CandidateSelector(hidden, config.vocab_size, config.selector_rank,
                                                        config.selector_top_k)
        inv_freq, self.rope_scaling = _rope_frequencies(config)
        # float32 buffer that survives `.to(torch.bfloat16)`: rounded frequencies drift the
        # rotation angles by radians within a few hundred positions (the reference keeps
        # them in float32 too).
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        result = super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        return result

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, L] -> cos, sin [b, L, head_dim] (float32)."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling

    def forward(
        self,
        target_features: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        mask: Any,
        row_length: int | None = None,
    ) -> torch.Tensor:
        """Training forward over N blocks at once.

        target_features [b, S, n·hidden]; block_embeds [b, N·B, hidden];
        block_positions [b, N·B]; mask: the DFlash mask for (anchors, S, B); row_length: the
        length of the rows a packed context lays end to end (each starts again at position 0).
        Returns the final hidden states [b, N·B, hidden] (before the LM head).
        """
        if target_features.dtype != self.fc.weight.dtype and not torch.is_autocast_enabled(target_features.device.type):
            target_features = target_features.to(self.fc.weight.dtype)  # e.g. a float32 drafter on a bf16 target
        context = self.hidden_norm(self.fc(target_features))
        b, context_len, _ = context.shape
        context_positions = torch.arange(context_len, device=context.device)
        if row_length is not None:
            context_positions = context_positions % row_length
        context_positions = context_positions.expand(b, context_len)
        cos_ctx, sin_ctx = self.rope(context_positions)
        cos, sin = self.rope(block_positions)
        x = block_embeds
        for layer in self.layers:
            context_k, context_v = layer.self_attn.keys_values(context, cos_ctx, sin_ctx)
            x = layer(x, cos, sin, context_k, context_v, mask, self.config.block_size)
        return self.norm(x)

    def draft(
        self,
        cache: DrafterCache,
        new_features: torch.Tensor,
        new_positions: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Inference: append newly verified context to `cache`, then run one block that sees
        all cached context and itself (no mask needed). Returns hidden [b, B, hidden]."""
        cos_ctx, sin_ctx = self.rope(new_positions)
        cos, sin = self.rope(block_positions)
        context = self.hidden_norm(self.fc(new_features))
        x = block_embeds
        for i, layer in enumerate(self.layers):
            context_k, context_v = cache.extend(i, *layer.self_attn.keys_values(context, cos_ctx, sin_ctx))
            x = layer(x, cos, sin, context_k, context_v, None)
        return self.norm(x)


def _rope_frequencies(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies exactly as the reference computes them (it builds a Qwen3
    rotary embedding from the exported config), including scaled rope types."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf_config = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=dict(config.rope_parameters),
    )
    rotary = Qwen3RotaryEmbedding(hf_config)
    return rotary.inv_freq.detach().clone(), float(rotary.attention_scaling)


def embed_block_tokens(
    token_ids: torch.Tensor, embed_weight: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """Frozen target embedding of block tokens (scaled for targets such as Gemma that scale)."""
    embeds = F.embedding(token_ids, embed_weight)
    return embeds * scale if scale != 1.0 else embeds


def unwrap_drafter(drafter: nn.Module) -> DFlashDrafter:
    """The DFlashDrafter inside a torch.compile wrapper or a DistributedDataParallel wrapper."""
    for _ in range(4):
        if isinstance(drafter, DFlashDrafter):
            return drafter
        drafter = getattr(drafter, "_orig_mod", None) or getattr(drafter, "module", None) or drafter
    if not isinstance(drafter, DFlashDrafter):
        raise TypeError(f"expected a DFlashDrafter, got {type(drafter).__name__}")
    return drafter
