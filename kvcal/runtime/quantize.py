"""Quantize-and-pack for the packed KV cache: torch references (the Triton kernels sit next to them).

Every function takes a block of N tokens x [N, H, D] (one row of the batch; keys in the codec's key
space) and returns packed codes [N, H, W] int32 (see runtime/packing.py) plus the parameters the
format needs. `dequantize_*` inverts them. Their arithmetic is exactly the codecs' fake quantization
(kvcal/methods), so a packed cache reconstructs what the gptq simulation assumed:

- affine_channels: per token, asymmetric min/max over groups of `group` channels of each head (RTN keys
  and values, KIVI values); fp16 scale and zero (the group minimum) per (token, head, group).
- affine_tokens: per channel over the N tokens of a block (KIVI keys); fp16 scale/zero per (head, channel).
- lut_static: per channel with calibrated ranges and a non-uniform table (KVQuant keys); elements out
  of range are outliers whose fp16 residual over the clamped code is kept, up to `capacity` per token
  (over all heads; overflow keeps the largest residuals, the rest stay clamped to the extreme level).
- lut_dynamic: per token over all heads with the `per_side` largest and smallest elements as outliers
  (KVQuant values); fp16 scale/zero per token, fp16 residuals of the 2*per_side outliers.
"""

from __future__ import annotations

import torch

from kvcal.quant.nonuniform import nearest_level, outlier_bounds
from kvcal.quant.uniform import dequantize, minmax_params, quantize
from kvcal.runtime.packing import pack_codes, unpack_codes

# ---- affine, groups of channels per token ---------------------------------------------------------


def quantize_affine_channels(x: torch.Tensor, bits: int, group: int):
    n, h, d = x.shape
    g = x.to(torch.float32).reshape(n, h, d // group, group)
    scale, zero = minmax_params(g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), 1 << bits)
    codes = quantize(g, scale, zero, 1 << bits).reshape(n, h, d)
    return pack_codes(codes, bits), scale[..., 0].half(), zero[..., 0].half()


def dequantize_affine_channels(codes, scale, zero, bits: int, dim: int) -> torch.Tensor:
    q = unpack_codes(codes, bits, dim).to(torch.float32)
    groups = scale.shape[-1]
    q = q.reshape(*q.shape[:-1], groups, dim // groups)
    return dequantize(q, scale.float()[..., None], zero.float()[..., None]).reshape(*q.shape[:-2], dim)


# ---- affine, one (scale, zero) per channel over a block of tokens (KIVI keys) ---------------------


def quantize_affine_tokens(x: torch.Tensor, bits: int):
    xf = x.to(torch.float32)
    scale, zero = minmax_params(xf.amin(0), xf.amax(0), 1 << bits)  # [H, D]
    codes = quantize(xf, scale, zero, 1 << bits)
    return pack_codes(codes, bits), scale.half(), zero.half()


def dequantize_affine_tokens(codes, scale, zero, bits: int, dim: int) -> torch.Tensor:
    """codes [N, H, W] of one block; scale/zero [H, D] (or [..., H, D] broadcast over the block)."""
    q = unpack_codes(codes, bits, dim).to(torch.float32)
    return dequantize(q, scale.float(), zero.float())


# ---- non-uniform tables with dense-and-sparse outliers (KVQuant) ----------------------------------


def _keep_largest(residual: torch.Tensor, candidate: torch.Tensor, capacity: int):
    """Indices [N, capacity] and fp16 residuals of the `capacity` largest |residual| among candidates
    of each row (-1 / 0 where a row has fewer)."""
    score = torch.where(candidate, residual.abs(), torch.full_like(residual, -1.0))
    top = torch.topk(score, capacity, dim=-1)
    valid = top.values >= 0
    idx = torch.where(valid, top.indices, torch.full_like(top.indices, -1)).to(torch.int16)
    val = torch.where(valid, residual.gather(-1, top.indices), torch.zeros_like(top.values)).half()
    return idx, val


def quantize_lut_static(x, lo, hi, encode, decode, bits: int, capacity: int):
    n, h, d = x.shape
    rows = x.to(torch.float32).reshape(n, h * d)
    zero, scale = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-8)
    codes = nearest_level(((rows - zero) / scale).clamp(-1, 1), encode)
    dense = decode[codes] * scale + zero
    idx, val = _keep_largest(rows - dense, (rows > hi) | (rows < lo), capacity) if capacity else (None, None)
    return pack_codes(codes.reshape(n, h, d), bits), idx, val


def quantize_lut_dynamic(x, encode, decode, bits: int, per_side: int):
    n, h, d = x.shape
    rows = x.to(torch.float32).reshape(n, h * d)
    lo, hi, outlier = outlier_bounds(rows, per_side, dim=-1)
    zero = ((hi + lo) / 2).half()
    scale = ((hi - lo) / 2).half()
    z, s = zero.float(), scale.float().clamp_min(1e-8)
    codes = nearest_level(((rows - z) / s).clamp(-1, 1), encode)
    dense = decode[codes] * s + z
    idx, val = _keep_largest(rows - dense, outlier, 2 * per_side) if per_side else (None, None)
    return pack_codes(codes.reshape(n, h, d), bits), scale[:, 0], zero[:, 0], idx, val


def add_outliers(rows: torch.Tensor, idx: torch.Tensor | None, val: torch.Tensor | None) -> torch.Tensor:
    """rows [..., C] + the sparse residuals (idx -1 = empty slot)."""
    if idx is None:
        return rows
    valid = idx >= 0
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    return rows.scatter_add(-1, safe, torch.where(valid, val.float(), torch.zeros_like(val, dtype=torch.float32)))


def dequantize_lut_static(codes, lo, hi, decode, bits: int, dim: int, idx=None, val=None) -> torch.Tensor:
    q = unpack_codes(codes, bits, dim)
    shape = q.shape
    q = q.reshape(*shape[:-2], shape[-2] * dim)
    zero, scale = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-8)
    rows = add_outliers(decode[q] * scale + zero, idx, val)
    return rows.reshape(shape)


def dequantize_lut_dynamic(codes, scale, zero, decode, bits: int, dim: int, idx=None, val=None) -> torch.Tensor:
    q = unpack_codes(codes, bits, dim)
    shape = q.shape
    q = q.reshape(*shape[:-2], shape[-2] * dim)
    s, z = scale.float().clamp_min(1e-8)[..., None], zero.float()[..., None]
    rows = add_outliers(decode[q] * s + z, idx, val)
    return rows.reshape(shape)
