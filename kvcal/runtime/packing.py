"""Bit packing of b-bit codes into int32 words, along the channel axis of each token.

Layout (shared by every packed cache and kernel): the D codes of one (token, head) form a little-endian
bit stream; code d occupies bits [d*b, d*b + b). Word w holds stream bits [32w, 32w + 32). With b = 3 some
codes straddle two words (their high bits continue at bit 0 of the next word), so 3-bit codes cost
exactly 3 bits. A (token, head) takes `words_per_vector(D, b)` = ceil(D*b/32) int32 words.
"""

from __future__ import annotations

import torch


def words_per_vector(dim: int, bits: int) -> int:
    return (dim * bits + 31) // 32


def _positions(dim: int, bits: int, device):
    start = torch.arange(dim, device=device) * bits
    return start // 32, start % 32


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] with values in [0, 2^bits) -> int32 words [..., ceil(D*bits/32)]."""
    dim = codes.shape[-1]
    nwords = words_per_vector(dim, bits)
    word, shift = _positions(dim, bits, codes.device)
    c = codes.to(torch.int64)
    out = torch.zeros(*codes.shape[:-1], nwords + 1, dtype=torch.int64, device=codes.device)
    out.scatter_add_(-1, word.expand_as(c), (c << shift) & 0xFFFFFFFF)  # disjoint bits: add == or
    spill = torch.where(shift + bits > 32, c >> (32 - shift), torch.zeros_like(c))
    out.scatter_add_(-1, (word + 1).expand_as(c), spill)
    out = out[..., :nwords]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)  # two's complement view


def unpack_codes(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack_codes: int32 words [..., W] -> codes [..., dim] as int64."""
    word, shift = _positions(dim, bits, words.device)
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=-1)
    lo = w.index_select(-1, word) >> shift
    hi = w.index_select(-1, word + 1) << (32 - shift)
    return (lo | hi) & ((1 << bits) - 1)
