"""dflash-train: train DFlash block-diffusion drafters for lossless speculative decoding."""

__version__ = "0.1.0"
