"""Uniform asymmetric (min/max) quantization, the building block of RTN, KIVI and SKVQ.

Parameters are rounded to their storage dtype (fp16 by default) *before* codes are computed, so the
fake-quantized values here are exactly what a runtime that stores those parameters reconstructs.
"""

from __future__ import annotations

import torch


def round_params(t: torch.Tensor, param_dtype: torch.dtype | None) -> torch.Tensor:
    if param_dtype is None:
        return t.to(torch.float32)
    return t.to(param_dtype).to(torch.float32)


def minmax_params(xmin: torch.Tensor, xmax: torch.Tensor, levels: int, param_dtype=torch.float16):
    """Scale and zero (the group minimum) for codes 0..levels-1 covering [xmin, xmax]."""
    zero = round_params(xmin, param_dtype)
    # divided by a tensor, not a Python number: CUDA torch multiplies by the reciprocal of a scalar divisor
    # (1 ulp off the IEEE quotient at times), and the Triton quantize kernels and CPU torch divide exactly
    span = xmax - xmin
    scale = round_params(span / torch.full_like(span, levels - 1), param_dtype)
    return scale, zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes in [0, levels-1] (as float32), round half to even. A zero scale gives code 0."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.clamp(torch.round((x.to(torch.float32) - zero) / safe), 0, levels - 1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes * scale + zero


def fake_quant_minmax(x: torch.Tensor, bits: int, dim: int, param_dtype=torch.float16) -> torch.Tensor:
    """Quantize then dequantize x with one (scale, zero) per slice along `dim` (reduced over `dim`)."""
    xf = x.to(torch.float32)
    levels = 1 << bits
    scale, zero = minmax_params(xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True), levels, param_dtype)
    return dequantize(quantize(xf, scale, zero, levels), scale, zero).to(x.dtype)


def fake_quant_groups(x: torch.Tensor, bits: int, dim: int, group: int, param_dtype=torch.float16) -> torch.Tensor:
    """Split axis `dim` into consecutive groups of `group` elements and quantize each group on its own."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % group:
        raise ValueError(f"axis of size {size} is not a multiple of the group size {group}")
    grouped = x.reshape(*x.shape[:dim], size // group, group, *x.shape[dim + 1 :])
    return fake_quant_minmax(grouped, bits, dim + 1, param_dtype).reshape(x.shape)
