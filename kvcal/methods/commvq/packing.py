"""CommVQ's bit streams, shared by the torch storage (storage.py) and the Triton key encoder (kernels.py): the key
codes of a token as one little-endian stream of index fields, the value code bits one per bit, and the fp16 bound of
the per-token norms."""

from __future__ import annotations

import torch

FP16_MAX = 65504.0


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., K] in [0, 2^bits) -> int32 words [..., ceil(K bits / 32)]: one little-endian bit stream, code k at
    stream bits [k bits, k bits + bits) (a code may straddle two words). The plain stream of quant/packing.py for
    every width (no 3-bit plane order: the key codes of a token are gathered one field at a time, never as a run)."""
    k = codes.shape[-1]
    nwords = (k * bits + 31) // 32
    start = torch.arange(k, device=codes.device) * bits
    word, shift = start // 32, start % 32
    c = codes.to(torch.int64)
    out = torch.zeros(*codes.shape[:-1], nwords + 1, dtype=torch.int64, device=codes.device)
    out.scatter_add_(-1, word.expand_as(c), (c << shift) & 0xFFFFFFFF)  # disjoint bits: add == or
    out.scatter_add_(-1, (word + 1).expand_as(c), torch.where(shift + bits > 32, c >> (32 - shift), 0))
    out = out[..., :nwords]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def unpack_stream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of pack_stream: int32 words [..., W] -> codes [..., count] as int64."""
    start = torch.arange(count, device=words.device) * bits
    word, shift = start // 32, start % 32
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=-1)
    lo = w.index_select(-1, word) >> shift
    hi = w.index_select(-1, word + 1) << (32 - shift)
    return (lo | hi) & ((1 << bits) - 1)
