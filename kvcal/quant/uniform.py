"""Uniform asymmetric (min/max) quantization, the building block of RTN, KIVI and SKVQ, and its packed form.

Parameters are rounded to their storage dtype (fp16 by default) *before* codes are computed, so the
fake-quantized values here are exactly what a runtime that stores those parameters reconstructs.
"""

from __future__ import annotations

import torch

from kvcal.quant.packing import pack_codes, unpack_codes


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


# ---- packed codes: what a cache stores (codes bit-packed along the channels, fp16 scale and zero) ------------------


def quantize_per_token(x: torch.Tensor, bits: int, group: int):
    """Tokens x [N, H, D]: each token and head quantized over groups of `group` consecutive channels (asymmetric
    min/max). Returns packed codes [N, H, W] (kvcal/quant/packing.py), fp16 scale and zero (the group minimum)
    [N, H, D / group]."""
    n, h, d = x.shape
    g = x.to(torch.float32).reshape(n, h, d // group, group)
    scale, zero = minmax_params(g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), 1 << bits)
    codes = quantize(g, scale, zero, 1 << bits).reshape(n, h, d)
    return pack_codes(codes, bits), scale[..., 0].half(), zero[..., 0].half()


def quantize_per_token_into(x: torch.Tensor, bits: int, group: int, codes, scale, zero, rows, slots) -> None:
    """quantize_per_token, token n written to row rows[n], slot slots[n] of a cache's codes [B, H, T, W] and scale /
    zero [B, H, T, G] (rows, slots: int64 tensors on the buffers' device)."""
    c, s, z = quantize_per_token(x, bits, group)
    codes[rows, :, slots], scale[rows, :, slots], zero[rows, :, slots] = c, s, z


def dequantize_per_token(codes, scale, zero, bits: int, dim: int) -> torch.Tensor:
    """Packed codes [..., W] with scale / zero [..., G] -> float32 [..., dim]."""
    q = unpack_codes(codes, bits, dim).to(torch.float32)
    groups = scale.shape[-1]
    q = q.reshape(*q.shape[:-1], groups, dim // groups)
    return dequantize(q, scale.float()[..., None], zero.float()[..., None]).reshape(*q.shape[:-2], dim)


def quantize_per_channel(x: torch.Tensor, bits: int, block: int):
    """Tokens x [N, H, D], N a multiple of `block`: each channel quantized over blocks of `block` consecutive tokens.
    Returns packed codes [N, H, W] and one fp16 (scale, zero) per channel and block, [N / block, H, D]."""
    n, h, d = x.shape
    xf = x.to(torch.float32).reshape(n // block, block, h, d)
    scale, zero = minmax_params(xf.amin(1, keepdim=True), xf.amax(1, keepdim=True), 1 << bits)
    codes = quantize(xf, scale, zero, 1 << bits).reshape(n, h, d)
    return pack_codes(codes, bits), scale[:, 0].half(), zero[:, 0].half()


def dequantize_per_channel(codes, scale, zero, bits: int, dim: int) -> torch.Tensor:
    """Packed codes [..., H, W] with each token's block parameters scale / zero [..., H, D] (broadcast) -> float32."""
    q = unpack_codes(codes, bits, dim).to(torch.float32)
    return dequantize(q, scale.float(), zero.float())
