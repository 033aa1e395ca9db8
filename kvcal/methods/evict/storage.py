"""Evict's storage: the dropped tokens, kept as nothing (a buffer of zero bytes per token), their attention
the full-precision part's softmax partials alone, and in the simulation the score NEG (weight exactly 0)."""

from __future__ import annotations

import torch

from kvcal.models.attention import NEG
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import fp_partials_reference, partials_from_rows
from kvcal.runtime.storage import BufferSpec, FlushPolicy, Packed, Storage


class EvictStorage(Storage):
    """The dropped tokens: one uint8 buffer [B, T, 0] (no byte per token; the cache still counts each row's dropped
    tokens in `lengths`, grows it and counts its bytes like any other buffer)."""

    remaps_scores = True  # a dropped key is not a K-hat: its score is NEG, so its weight is exactly 0

    def __init__(self, sink: int, window: int):
        self.policy = FlushPolicy(sink=sink, residual=window, block=1)

    def reconstruct(self, k, v):
        """What is left of dropped tokens: zeros (their scores are NEG, remap_scores)."""
        return torch.zeros_like(k), torch.zeros_like(v)

    def remap_scores(self, scores, compressed):
        return torch.where(compressed, torch.full_like(scores, NEG), scores)

    def buffers(self, batch, capacity, heads, dim):
        return {"dropped": BufferSpec((batch, capacity, 0), torch.uint8, 1)}

    def write_reference(self, packed, keys, values, rows, slots):
        """Dropped: nothing is kept of these tokens."""

    def write_triton(self, packed, keys, values, rows, slots):
        """Dropped: nothing is kept of these tokens (no kernel to launch)."""

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        """No key and no value: [H, 0, D] each, however many tokens the row dropped."""
        empty = torch.zeros(packed.heads, 0, packed.dim, dtype=dtype, device=packed.lengths.device)
        return empty, empty.clone()

    def attend_reference(self, q, packed, scale, fp):
        """The full-precision part's partials (a split of the dropped tokens would be m = -inf, l = 0, acc = 0: weight
        exp2(-inf) = 0 in the merge, nothing added)."""
        if fp is None:
            return partials_from_rows(q, [None] * q.shape[0], scale, packed.heads)
        return fp_partials_reference(q, fp, scale, packed.softcap)

    def attend_triton(self, q, packed, scale, fp):
        """attend_reference's partials from the generic full-precision kernel."""
        if fp is None:
            return partials_from_rows(q, [None] * q.shape[0], scale, packed.heads)
        return K.fp_partials_triton(q, fp, scale, packed.softcap)
