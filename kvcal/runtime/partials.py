"""What a storage's decode attention takes and returns: the full-precision part of a layer (FullPrecision) and softmax
partials per split (Partials), which runtime.decode.merge combines (kvcal/runtime/decode.py says how)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FullPrecision:
    """The full-precision part of one layer: keys (after RoPE) and values [B, Hkv, F, D], valid [B, F] bool (slot order
    is free: softmax does not care, so a ring buffer works as is)."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor

    @property
    def slots(self) -> int:
        return self.k.shape[2]


@dataclass
class Partials:
    """Softmax partials of one decode step. m, l [R, S, G] and acc [R, S, G, D] (R = B x Hkv rows and KV heads, S
    splits, G query heads per KV head), in float32 (float64 for float64 queries). `extra` [R, S, D, GP]: optional
    additive terms of each acc (float32, or int64 fixed point in units of `extra_unit`), e.g. sparse residuals a
    separate pass summed. `merge_warps`: warps per program of the merge kernel (a tuning hint of the kernel that
    wrote them)."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the softmax sum, as in the papers
    acc: torch.Tensor
    extra: torch.Tensor | None = None
    extra_unit: float = 1.0
    merge_warps: int = 4

    @classmethod
    def empty(cls, rows: int, splits: int, group: int, dim: int, dtype, device) -> Partials:
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        m = torch.empty(rows, splits, group, dtype=acc_dtype, device=device)
        return cls(m, torch.empty_like(m), torch.empty(rows, splits, group, dim, dtype=acc_dtype, device=device))

    @property
    def splits(self) -> int:
        return self.m.shape[1]

    def cat(self, other: Partials) -> Partials:
        """The splits of both (torch references; the kernels write into one buffer instead)."""
        if self.extra is not None or other.extra is not None:
            return Partials(torch.cat([self.m, other.m], 1), torch.cat([self.l, other.l], 1),
                            torch.cat([with_extra(self), with_extra(other)], 1))
        return Partials(torch.cat([self.m, other.m], 1), torch.cat([self.l, other.l], 1),
                        torch.cat([self.acc, other.acc], 1))


def with_extra(p: Partials) -> torch.Tensor:
    if p.extra is None:
        return p.acc
    extra = p.extra.to(p.acc.dtype) * p.extra_unit if p.extra.dtype == torch.int64 else p.extra.to(p.acc.dtype)
    return p.acc + extra[..., : p.acc.shape[2]].permute(0, 1, 3, 2)  # [R, S, D, GP] -> [R, S, G, D]
