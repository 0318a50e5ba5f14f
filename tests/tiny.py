"""Tiny real models and data for fast CPU tests (random init, real Hugging Face classes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from dflash_train.target.model import Target

from dflash_train.config import TrainConfig

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # Gated DeltaNet + full attention
MOE_FAMILIES = ("qwen3_moe", "gpt_oss")
NEW_FAMILIES = HYBRID_FAMILIES + MOE_FAMILIES


def hybrid_layer_types(layers: int) -> list[str]:
    """Qwen3.5's pattern (three linear-attention layers, then a full one), the last layer full."""
    return ["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention" for i in range(layers)]


def tiny_hf_model(family: str = "llama", *, vocab: int = 96, hidden: int = 64, layers: int = 6, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        return transformers.LlamaForCausalLM(config)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=24, **common))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    if family == "gemma3_text":
        config = transformers.Gemma3TextConfig(head_dim=16, sliding_window=16, **common)
        return transformers.Gemma3ForCausalLM(config)
    moe = dict(moe_intermediate_size=hidden // 2, num_experts=4, num_experts_per_tok=2)
    linear = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, layer_types=hybrid_layer_types(layers))
    if family == "qwen3_5_text":
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**linear, **common))
    if family == "qwen3_5_moe_text":
        config = transformers.Qwen3_5MoeTextConfig(shared_expert_intermediate_size=hidden // 2, **moe, **linear, **common)
        return transformers.Qwen3_5MoeForCausalLM(config)
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(shared_expert_intermediate_size=hidden // 2, **moe, **linear, **common)
        return transformers.Qwen3NextForCausalLM(config)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(head_dim=16, **moe, **common))
    if family == "gpt_oss":
        # gpt-oss: attention sinks, alternating 16-token sliding windows, YaRN rope, biased attention.
        rope = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=128, rope_theta=150000.0)
        config = transformers.GptOssConfig(head_dim=16, sliding_window=16, num_local_experts=4, num_experts_per_tok=2,
                                           rope_parameters=rope, **{**common, "intermediate_size": hidden // 2})
        return transformers.GptOssForCausalLM(config)
    raise ValueError(family)


def tiny_target(family: str = "llama", head_scale: float = 1.0, **kw) -> Target:
    """head_scale > 1 gives the frozen LM head room for confident predictions (random init at
    std 0.02 caps logits so low that even a perfect drafter keeps a high loss)."""
    model = tiny_hf_model(family, **kw).float()
    if head_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(head_scale)
    return Target(model)


def slow_decay(target: Target, seed: int = 0) -> Target:
    """A hybrid's linear-attention layers with a slow decay: at random init their recurrent states
    forget within a token or two (decay rates up to 16), so a wrong state would hardly show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in target.layers:
            linear = getattr(layer, "linear_attn", None)
            if linear is not None:
                rates = torch.empty(linear.A_log.shape).uniform_(0.01, 0.2, generator=generator)
                linear.A_log.copy_(rates.log().to(linear.A_log.device, linear.A_log.dtype))
    return target


@dataclass
class Sample:
    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def pattern_samples(count: int, *, vocab: int = 96, min_len: int = 40, max_len: int = 100, prompt_len: int = 8, seed: int = 0):
    """Sequences a drafter can learn: each continues an arithmetic progression mod (vocab - 8),
    after a short 'prompt' that is not supervised."""
    generator = torch.Generator().manual_seed(seed)
    modulus = vocab - 8
    samples = []
    for i in range(count):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        start = int(torch.randint(0, modulus, (1,), generator=generator))
        stride = int(torch.randint(1, 4, (1,), generator=generator))
        ids = torch.tensor([(start + stride * k) % modulus for k in range(length)])
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt_len:] = True
        samples.append(Sample(i, ids, mask))
    return samples


def tiny_train_config(out, **values) -> TrainConfig:
    """A CPU training run on `tiny_target` and `pattern_samples` (mask token 95 is outside the
    patterns); `values` set everything that differs between tests."""
    base = dict(out=str(out), batch_size=4, max_seq_len=128, block_size=4, num_layers=1, mask_token_id=95,
                device="cpu", seed=0)
    return TrainConfig(**{**base, **values})


# A tiny DFlash2 drafter's sizes (small enough for CPU tests, every selector and convolution path taken).
DFLASH2 = dict(arch="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)


def random_dflash2(target: Target, *, block_size=5, layers=2, std=0.2, seed=0, **overrides):
    """A random DFlash2 drafter on `target` (reads target layers 1, 3, 4)."""
    from dflash_train.core.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(seed)
    config = DrafterConfig.from_target(target.spec, num_layers=layers, block_size=block_size, mask_token_id=95,
                                       target_layer_ids=[1, 3, 4], **{**DFLASH2, **overrides})
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, std)
    return drafter
