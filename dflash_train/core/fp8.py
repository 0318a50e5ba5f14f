"""FP8 matrix products for training (opt-in: `train --fp8 head|all`).

Every product scales its operands by one factor per tensor so the largest magnitude lands on
the format's maximum, multiplies in FP8 with higher-precision accumulation (`torch._scaled_mm`)
and writes bf16 (or float32) out. Activations and weights use e4m3 (more mantissa), gradients
e5m2 (more range), the usual split for FP8 training. Master weights, optimizer state, norms,
attention and the loss stay in their own precision; only the matmul operands are rounded.

- The frozen LM head (`Fp8Weight`): quantised once; the CE chunk computes its logits and the
  input gradient (softmax − onehot)·W in FP8. This is a quarter of the step's FLOPs at 8B shapes.
- Drafter linears (`use_fp8_linears`): forward, input gradient and weight gradient in FP8
  while training; in eval mode or without grad they are plain linears, so drafting, export
  and checkpoints see ordinary bf16/fp32 weights under their usual names.

FP8 products need every matmul dimension to be a multiple of 16; rows (tokens) are padded
with zeros where needed, the model dims are checked by `check_fp8_dims`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATION = torch.float8_e4m3fn
GRADIENT = torch.float8_e5m2
ALIGN = 16


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x in `dtype` scaled so that max |x| maps to the format's largest value, and the float32
    factor that undoes the scaling (what `_scaled_mm` takes)."""
    limit = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = limit / amax
    return (x.float() * scale).clamp(-limit, limit).to(dtype), scale.reciprocal()


def column_major(x: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column by column (the second operand's layout FP8 GEMMs need)."""
    return x.t().contiguous().t()


def scaled_matmul(
    a: torch.Tensor, a_inverse: torch.Tensor, b: torch.Tensor, b_inverse: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a [M, K] row-major @ b [K, N] column-major, both FP8, into `out_dtype`."""
    return torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    extra = -x.shape[0] % ALIGN
    return F.pad(x, (0, 0, 0, extra)) if extra else x


class Fp8Weight(NamedTuple):
    """A frozen [N, K] weight in e4m3, in both layouts the forward and the input gradient read."""

    rows: torch.Tensor  # [N, K] row-major: rows.t() is the forward's column-major [K, N]
    columns: torch.Tensor  # [K, N] row-major: columns.t() is the input gradient's column-major [N, K]
    inverse_scale: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Fp8Weight":
        rows, inverse = quantize(weight.detach(), ACTIVATION)
        return cls(rows, rows.t().contiguous(), inverse)


def frozen_forward(weight: Fp8Weight, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ Wᵀ -> [M, N]. (Functions, not methods: torch.compile traces them plainly.)"""
    x8, x_inverse = quantize(_pad_rows(x), ACTIVATION)
    return scaled_matmul(x8, x_inverse, weight.rows.t(), weight.inverse_scale, out_dtype)[: x.shape[0]]


def frozen_input_grad(weight: Fp8Weight, grad: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """grad [M, N] @ W -> [M, K]."""
    g8, g_inverse = quantize(_pad_rows(grad), GRADIENT)
    return scaled_matmul(g8, g_inverse, weight.columns.t(), weight.inverse_scale, out_dtype)[: grad.shape[0]]


class _Fp8Linear(torch.autograd.Function):
    """y = x Wᵀ with all three products (forward, input and weight gradient) in FP8.
    Saves the FP8 operands, not the bf16 ones, so the activation memory of a linear halves."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        flat = _pad_rows(x.reshape(-1, x.shape[-1]))
        x8, x_inverse = quantize(flat, ACTIVATION)
        w8, w_inverse = quantize(weight, ACTIVATION)
        out = scaled_matmul(x8, x_inverse, w8.t(), w_inverse, out_dtype)
        ctx.save_for_backward(x8, x_inverse, w8, w_inverse)
        ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        rows = x.numel() // x.shape[-1]
        return out[:rows].view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x8, x_inverse, w8, w_inverse = ctx.saved_tensors
        grad = _pad_rows(grad_out.reshape(-1, grad_out.shape[-1]))
        g8, g_inverse = quantize(grad, GRADIENT)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            rows = grad_out.numel() // grad_out.shape[-1]
            grad_x = scaled_matmul(g8, g_inverse, column_major(w8), w_inverse, grad_out.dtype)
            grad_x = grad_x[:rows].view(ctx.input_shape).to(ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_matmul(g8.t().contiguous(), g_inverse, column_major(x8), x_inverse, torch.float32)
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_x, grad_w, None


class Fp8Linear(nn.Linear):
    """nn.Linear whose training products run in FP8 (bias-free, as every drafter linear is)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()) or self.bias is not None:
            return super().forward(x)
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        with torch.autocast(device_type, enabled=False):
            return _Fp8Linear.apply(x, self.weight, out_dtype)


def check_fp8_dims(sizes: dict[str, int]) -> None:
    """FP8 GEMMs need every dimension to be a multiple of 16; name the first that is not."""
    for name, size in sizes.items():
        if size % ALIGN:
            raise ValueError(f"--fp8 needs every matmul dimension to be a multiple of {ALIGN}; {name} is {size}")


def use_fp8_linears(model: nn.Module) -> int:
    """Switch every bias-free nn.Linear of `model` to FP8 training products, in place (same
    parameters, same names); returns how many were switched."""
    switched = 0
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.bias is None:
            check_fp8_dims({f"{name or 'linear'} in_features": module.in_features,
                            f"{name or 'linear'} out_features": module.out_features})
            module.__class__ = Fp8Linear
            switched += 1
    return switched


def fp8_unsupported(device: torch.device) -> str | None:
    """Why FP8 products cannot run on `device` (None when a small one runs and is right).
    Decided by trying one, not by the device's name: GPUs before sm89 refuse it."""
    try:
        a = torch.eye(ALIGN, device=device).to(ACTIVATION)
        b = column_major(torch.eye(ALIGN, device=device).to(GRADIENT))
        one = torch.ones((), device=device)
        product = scaled_matmul(a, one, b, one, torch.float32)
        if not torch.equal(product.cpu(), torch.eye(ALIGN)):
            return f"an FP8 product on {device} gave a wrong result"
    except (RuntimeError, TypeError, NotImplementedError) as error:
        return f"FP8 products do not run on {device}: {str(error).splitlines()[0]}"
    return None
