"""`dflash-train export`: write the Hugging Face folder of a trained drafter from a run or checkpoint."""

from __future__ import annotations

import dataclasses

from ..config import DTYPE_NAMES, ConfigError, option


@dataclasses.dataclass
class ExportConfig:
    checkpoint: str = option("", "a run folder (its latest checkpoint) or a checkpoint folder")
    out: str = option("", "the Hugging Face folder to write (new, empty, or an earlier export of this run)")
    dtype: str = option("bfloat16", "weight dtype: bfloat16, float16 or float32")
    force: bool = option(False, "replace a non-empty --out that is not an earlier export of this run")

    def validate(self) -> None:
        if not self.checkpoint or not self.out:
            raise ConfigError("export needs RUN_DIR_OR_CHECKPOINT and --out DIR")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype {self.dtype!r}: use {', '.join(DTYPE_NAMES)}")


def run_export(config: ExportConfig) -> int:
    import torch

    from ..checkpoint import load_drafter, resolve_checkpoint
    from ..export import export_model

    checkpoint = resolve_checkpoint(config.checkpoint)
    drafter = load_drafter(checkpoint)
    out = export_model(drafter, config.out, dtype=getattr(torch, config.dtype), run_dir=checkpoint.parent.parent,
                       source=checkpoint, force=config.force)
    cfg = drafter.config
    print(f"exported {checkpoint} -> {out}")
    print(f"  DFlashDraftModel: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, block {cfg.block_size}, "
          f"target layers {cfg.target_layer_ids}, mask token {cfg.mask_token_id}, {config.dtype}")
    return 0
