"""Non-uniform (lookup-table) quantization helpers: nearest level, percentile ranges, per-vector outliers.

Used by KVQuant (nuqX datatypes with dense-and-sparse outliers); shaped to be reused by any method that
stores indices into a sorted table.
"""

from __future__ import annotations

import torch

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
