"""Synthetic drafter batches of a given shape: random features, ids and anchors, for benchmarks
and the tests that check a step's behaviour on the GPU (no model, no data files)."""

from __future__ import annotations

import torch

from ..core.drafter import DFlashDrafter, DrafterConfig
from ..core.fp8 import use_fp8_linears
from ..core.objective import ObjectiveConfig, block_labels, draw_anchors
from ..core.step import DrafterBatch

TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=512, target_layers=8,
            layer_ids=[1, 3, 5])


def drafter_config(dims: dict, block_size: int, arch: str = "dflash") -> DrafterConfig:
    return DrafterConfig(arch=arch,
        hidden_size=dims["hidden"], num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], intermediate_size=dims["mlp"],
        rms_norm_eps=1e-6, vocab_size=dims["vocab"], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=40960, block_size=block_size,
        target_layer_ids=dims["layer_ids"],
        num_target_layers=dims["target_layers"], mask_token_id=dims["vocab"] - 1,
    )


def random_drafter(config: DrafterConfig, device, *, compiled: bool, fp8: str = "off") -> DFlashDrafter:
    """A drafter with random weights (N(0, 0.02), norms at 1) drawn on `device` from torch's global
    generator, its forward compiled and its linears in FP8 (`--fp8 all`) as asked."""
    drafter = DFlashDrafter(config).to(device)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    if compiled:
        drafter.forward = torch.compile(drafter.forward, dynamic=False)
    if fp8 == "all":
        use_fp8_linears(drafter)
    return drafter


def make_batch(config: DrafterConfig, batch: int, seq: int, anchors: int, device, dtype, seed: int = 0,
               host_count: bool = True, valid_anchors: int | None = None):
    """`valid_anchors`: that many valid anchors in all, spread evenly over the rows (each row's
    drawn at random among its positions), the rest of the slots padded; None: every slot valid
    where the row has the positions."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size - 1, (batch, seq), generator=generator)
    loss_mask = torch.zeros(batch, seq, dtype=torch.bool)
    loss_mask[:, int(0.2 * seq):] = True
    per_row = [anchors] * batch if valid_anchors is None else [
        min(anchors, valid_anchors // batch + (i < valid_anchors % batch)) for i in range(batch)]
    drawn = [draw_anchors(loss_mask[i], per_row[i], seed=seed, sample_id=i, epoch=0) for i in range(batch)]
    anchor_pos = torch.zeros(batch, anchors, dtype=torch.long)
    anchor_valid = torch.zeros(batch, anchors, dtype=torch.bool)
    for i, (positions, valid) in enumerate(drawn):
        anchor_pos[i, :len(positions)], anchor_valid[i, :len(valid)] = positions, valid
    objective = ObjectiveConfig(block_size=config.block_size, num_anchors=anchors)
    _, label_valid = block_labels(ids, loss_mask, anchor_pos, anchor_valid, config.block_size)
    features = torch.randn(batch, seq, len(config.target_layer_ids) * config.hidden_size, generator=generator)
    drafter_batch = DrafterBatch(
        features.to(device, dtype), ids.to(device), loss_mask.to(device), anchor_pos.to(device),
        anchor_valid.to(device), objective.normalizer(label_valid),
        scored_rows=int(label_valid.sum()) if host_count else None,
        anchor_count=int(anchor_valid.sum()) if host_count else None,
    )
    return drafter_batch, objective, anchor_valid
