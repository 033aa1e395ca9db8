"""Non-uniform (lookup-table) quantization: nearest level, percentile ranges, per-vector outliers, and the packed
form a cache stores (kvcal/quant/nonuniform_kernels.py holds the Triton kernels of the packed quantizers).

Used by KVQuant (nuqX datatypes with dense-and-sparse outliers); shaped to be reused by any method that
stores indices into a sorted table. Packed quantizers take a block of N tokens x [N, H, D] and return packed codes
[N, H, W] (kvcal/quant/packing.py) plus what the format needs:

- static (`quantize_lut_static`): per channel with calibrated ranges [H*D] and a sorted table; elements out of range
  are outliers whose fp16 residual over the clamped code is kept, up to `capacity` per token and head (overflow keeps
  the head's largest residuals, the rest stay clamped to the extreme level). Slots [N, H, capacity] hold the channel
  in [0, H*D) (-1: empty), so a decode kernel's program for one KV head reads only its own.
- dynamic (`quantize_lut_dynamic`): per token over all heads, with the `per_side` largest and smallest elements as
  outliers; fp16 scale/zero per token, fp16 residuals of the 2*per_side outliers. With `per_head`, each head's vector
  is its own (scale, zero, 2*per_side outliers): scale/zero [N, H], slots [N, H, 2*per_side].
"""

from __future__ import annotations

import torch

from kvcal.quant.packing import pack_codes, unpack_codes
from kvcal.quant.uniform import round_params


def range_params(lo: torch.Tensor, hi: torch.Tensor, param_dtype: torch.dtype | None = None):
    """Zero (center) and scale (half width) that map [lo, hi] onto a table's [-1, 1]: x = level * scale + zero.

    With `param_dtype` both are rounded as stored (fp16 for per-token ranges). The scale is floored at 1e-8
    so a flat range divides safely; the floor rounds to 0 in fp16, so a stored scale needs no separate copy.
    """
    zero, scale = (hi + lo) / 2, (hi - lo) / 2
    if param_dtype is not None:
        zero, scale = round_params(zero, param_dtype), round_params(scale, param_dtype)
    return zero, scale.clamp_min(1e-8)


def nearest_level(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of sorted `levels` [k] for every element of x (ties go to the lower)."""
    mids = (levels[1:] + levels[:-1]) / 2
    return torch.searchsorted(mids.contiguous(), x.contiguous())


def quantile(x: torch.Tensor, q: float, dim: int = 0) -> torch.Tensor:
    """numpy.percentile(x, 100 q, axis=dim) with linear interpolation; any size (torch.quantile caps at 2**24)."""
    n = x.shape[dim]
    sorted_x = torch.sort(x, dim=dim).values
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    a, b = sorted_x.select(dim, lo), sorted_x.select(dim, hi)
    return a + (b - a) * frac


def outlier_bounds(x: torch.Tensor, per_side: int, dim: int = -1):
    """Per-vector dense-and-sparse split: the `per_side` largest and smallest elements of each vector
    along `dim` are outliers; the next ones inward bound the dense range.

    Returns (lo, hi, outlier_mask). With per_side = 0 the range is the vector's min/max and no element
    is an outlier.
    """
    if per_side == 0:
        return x.amin(dim, keepdim=True), x.amax(dim, keepdim=True), torch.zeros_like(x, dtype=torch.bool)
    top = torch.topk(x, per_side + 1, dim=dim, largest=True)
    bottom = torch.topk(x, per_side + 1, dim=dim, largest=False)
    hi = top.values.narrow(dim, per_side, 1)
    lo = bottom.values.narrow(dim, per_side, 1)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask.scatter_(dim, top.indices.narrow(dim, 0, per_side), True)
    mask.scatter_(dim, bottom.indices.narrow(dim, 0, per_side), True)
    return lo, hi, mask


def largest_residuals(residual: torch.Tensor, candidate: torch.Tensor, capacity: int):
    """The `capacity` candidates of each row with the largest |residual| (the packed runtime's key-outlier
    overflow rule; the simulation applies the same one). Returns (indices [..., capacity], valid [..., capacity]):
    topk's order, largest first; valid is False where a row has fewer candidates."""
    score = torch.where(candidate, residual.abs(), torch.full_like(residual, -1.0))
    top = torch.topk(score, min(capacity, score.shape[-1]), dim=-1)
    return top.indices, top.values >= 0


# ---- packed: what a cache stores ---------------------------------------------------------------------------------


def keep_largest(residual: torch.Tensor, candidate: torch.Tensor, capacity: int, dtype=torch.float16):
    """Indices [N, capacity] and residuals (in `dtype`) of the `capacity` largest |residual| among candidates
    of each row (-1 / 0 where a row has fewer)."""
    top, valid = largest_residuals(residual, candidate, capacity)
    idx = torch.where(valid, top, torch.full_like(top, -1)).to(torch.int16)
    val = torch.where(valid, residual.gather(-1, top), 0.0).to(dtype)
    return idx, val


def _residual(rows: torch.Tensor, dense: torch.Tensor, dtype) -> torch.Tensor:
    """x - dense: in float32 for stored (fp16) residuals, in float64 for exact ones (the difference of two float32
    numbers is exact in float64, and dense + it gives x back)."""
    wide = torch.promote_types(dtype, torch.float32)
    return rows.to(wide) - dense.to(wide)


def quantize_lut_static(x, lo, hi, encode, decode, bits: int, capacity: int, residual_dtype=torch.float16):
    """Codes [N, H, W] and, with a capacity, the outlier slots [N, H, capacity]: channel in [0, H*D) (-1 =
    empty) and residual, fp16 as a cache stores it (float64 keeps outliers exact: the paper's simulation)."""
    n, h, d = x.shape
    rows = x.to(torch.float32).reshape(n, h * d)
    zero, scale = range_params(lo, hi)
    codes = nearest_level(((rows - zero) / scale).clamp(-1, 1), encode)
    dense = decode[codes] * scale + zero
    idx = val = None
    if capacity:
        outlier = ((rows > hi) | (rows < lo)).reshape(n, h, d)
        idx, val = keep_largest(_residual(rows, dense, residual_dtype).reshape(n, h, d), outlier, capacity,
                                residual_dtype)
        idx = global_channels(idx, d)
    return pack_codes(codes.reshape(n, h, d), bits), idx, val


def quantize_lut_dynamic(x, encode, decode, bits: int, per_side: int, per_head: bool = False,
                         residual_dtype=torch.float16):
    """Codes [N, H, W], fp16 scale and zero per token ([N]; [N, H] per head) and the 2 per_side outlier slots per
    vector ([N, 2 per_side]; [N, H, 2 per_side] per head), residuals in `residual_dtype` as quantize_lut_static."""
    if per_head:
        return _per_head(x, encode, decode, bits, per_side, residual_dtype)
    n, h, d = x.shape
    rows = x.to(torch.float32).reshape(n, h * d)
    lo, hi, outlier = outlier_bounds(rows, per_side, dim=-1)
    z, s = range_params(lo, hi, torch.float16)  # as stored: fp16
    codes = nearest_level(((rows - z) / s).clamp(-1, 1), encode)
    dense = decode[codes] * s + z
    idx, val = (keep_largest(_residual(rows, dense, residual_dtype), outlier, 2 * per_side, residual_dtype)
                if per_side else (None, None))
    return pack_codes(codes.reshape(n, h, d), bits), s[:, 0].half(), z[:, 0].half(), idx, val


def _per_head(x, encode, decode, bits: int, per_side: int, residual_dtype):
    """lut_dynamic with one vector per (token, head): the per-token quantizer on [N*H, 1, D], reshaped back;
    outlier channels made global (head * D + channel) as everywhere else."""
    n, h, d = x.shape
    codes, scale, zero, idx, val = quantize_lut_dynamic(x.reshape(n * h, 1, d), encode, decode, bits, per_side,
                                                        residual_dtype=residual_dtype)
    codes, scale, zero = codes.reshape(n, h, -1), scale.reshape(n, h), zero.reshape(n, h)
    if idx is not None:
        idx, val = global_channels(idx.reshape(n, h, -1), d), val.reshape(n, h, -1)
    return codes, scale, zero, idx, val


def global_channels(idx: torch.Tensor, d: int) -> torch.Tensor:
    """Slots [N, H, cap] holding channels within each head -> channels in [0, H*d) (-1 stays empty)."""
    head_base = (torch.arange(idx.shape[1], device=idx.device) * d).to(idx.dtype)[None, :, None]
    return torch.where(idx >= 0, idx + head_base, idx)


def add_outliers(rows: torch.Tensor, idx: torch.Tensor | None, val: torch.Tensor | None) -> torch.Tensor:
    """rows [..., C] + the sparse residuals (idx -1 = empty slot), added in float32 (float64 for float64 residuals,
    whose sums are then exact), returned in rows' dtype."""
    if idx is None:
        return rows
    wide = torch.promote_types(val.dtype, rows.dtype)
    valid = idx >= 0
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    added = rows.to(wide).scatter_add(-1, safe, torch.where(valid, val.to(wide), torch.zeros((), dtype=wide,
                                                                                            device=val.device)))
    return added.to(rows.dtype)


def dequantize_lut_static(codes, zero, scale, decode, bits: int, dim: int, idx=None, val=None) -> torch.Tensor:
    """codes [..., H, W] -> [..., H, dim]: table level x scale + zero per channel (zero, scale [H*dim] from
    range_params of the calibrated range, as quantize_lut_static used them), plus the sparse residuals
    (idx, val [..., H, capacity])."""
    q = unpack_codes(codes, bits, dim)
    shape = q.shape
    q = q.reshape(*shape[:-2], shape[-2] * dim)
    if idx is not None:
        idx, val = idx.flatten(-2), val.flatten(-2)
    rows = add_outliers(decode[q] * scale + zero, idx, val)
    return rows.reshape(shape)


def dequantize_lut_dynamic(codes, scale, zero, decode, bits: int, dim: int, idx=None, val=None) -> torch.Tensor:
    """codes [..., H, W] -> [..., H, dim]; scale/zero [...] per token or [..., H] per head; slots [..., cap]
    per token or [..., H, cap] per head."""
    q = unpack_codes(codes, bits, dim)
    shape = q.shape
    per_token = scale.dim() == q.dim() - 2
    s, z = scale.float().clamp_min(1e-8), zero.float()
    s, z = (s[..., None, None], z[..., None, None]) if per_token else (s[..., None], z[..., None])
    rows = (decode[q] * s + z).reshape(*shape[:-2], shape[-2] * dim)
    if idx is not None:
        idx, val = idx.reshape(*shape[:-2], -1), val.reshape(*shape[:-2], -1)
    return add_outliers(rows, idx, val).reshape(shape)


def quantize_lut_static_into(x, lo, hi, encode, decode, bits: int, capacity: int, codes, out_idx, out_val,
                             rows, slots) -> None:
    c, idx, val = quantize_lut_static(x, lo, hi, encode, decode, bits, capacity)
    rows, slots = rows.long(), slots.long()
    codes[rows, :, slots] = c
    if capacity:
        out_idx[rows, slots], out_val[rows, slots] = idx, val


def quantize_lut_dynamic_into(x, encode, decode, bits: int, per_side: int, per_head: bool, codes, scale, zero,
                              out_idx, out_val, rows, slots) -> None:
    c, s, z, idx, val = quantize_lut_dynamic(x, encode, decode, bits, per_side, per_head)
    rows, slots = rows.long(), slots.long()
    codes[rows, :, slots] = c
    at = (rows, slice(None), slots) if per_head else (rows, slots)
    scale[at], zero[at] = s, z
    if per_side:
        out_idx[rows, slots], out_val[rows, slots] = idx, val
