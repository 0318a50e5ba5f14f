"""Where this package's Triton kernels can run: one rule for all of them."""

from __future__ import annotations

import os

import torch


def triton_available(device: torch.device) -> bool:
    """Whether a Triton kernel can run on `device`: CUDA with Triton importable, or Triton's CPU
    interpreter (`TRITON_INTERPRET=1`, which the tests turn on)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
