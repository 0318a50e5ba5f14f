"""Tiny real models and data for fast CPU tests (random init, real Hugging Face classes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train.config import TrainConfig
from dflash_train.target import Target

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


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
    raise ValueError(family)


def tiny_target(family: str = "llama", head_scale: float = 1.0, **kw) -> Target:
    """head_scale > 1 gives the frozen LM head room for confident predictions (random init at
    std 0.02 caps logits so low that even a perfect drafter keeps a high loss)."""
    model = tiny_hf_model(family, **kw).float()
    if head_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(head_scale)
    return Target(model)


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
