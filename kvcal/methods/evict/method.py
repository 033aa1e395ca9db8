"""Eviction baseline: StreamingLLM's rule (Xiao et al. 2023, arXiv 2309.17453). The cache keeps the first `sink`
tokens and the newest `window` tokens in fp16 and drops every other token. Nothing to learn.

It is the generic cache's flush rule with nothing stored: FlushPolicy(sink=S, residual=W, block=1) keeps the sinks and
the window in the cache's full-precision part, and what that policy hands to the storage is dropped. The storage's
buffer holds zero bytes per token, its write stores nothing, its attention returns the full-precision part's softmax
partials alone (no token to add), and the simulation gives every dropped key the score NEG (weight exactly 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.accounting import fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import Codec, Method
from kvcal.methods.registry import register
from kvcal.models.attention import NEG
from kvcal.runtime.storage import BufferSpec, FlushPolicy, Packed, Storage


class EvictStorage(Storage):
    """The dropped tokens: one uint8 buffer [B, T, 0] (no byte per token; the cache still counts each row's dropped
    tokens in `lengths`, grows it and counts its bytes like any other buffer)."""

    def __init__(self, sink: int, window: int):
        self.policy = FlushPolicy(sink=sink, residual=window, block=1)

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
        from kvcal.runtime.decode import fp_partials_reference, partials_from_rows

        if fp is None:
            return partials_from_rows(q, [None] * q.shape[0], scale, packed.heads)
        return fp_partials_reference(q, fp, scale)

    def attend_triton(self, q, packed, scale, fp):
        """attend_reference's partials from the generic full-precision kernel."""
        from kvcal.runtime import kernels as K
        from kvcal.runtime.decode import partials_from_rows

        if fp is None:
            return partials_from_rows(q, [None] * q.shape[0], scale, packed.heads)
        return K.fp_partials_triton(q, fp, scale)


class EvictCodec(Codec):
    remaps_scores = True  # a dropped key is not a K-hat: its score is NEG, so its weight is exactly 0

    def __init__(self, sink: int, window: int):
        self._storage = EvictStorage(sink, window)
        self.policy = self._storage.policy

    def storage(self, layer: int) -> Storage:
        return self._storage

    def reconstruct(self, layer, k, v):
        """What is left of dropped tokens: zeros (their scores are NEG, remap_scores)."""
        return torch.zeros_like(k), torch.zeros_like(v)

    def remap_scores(self, layer, scores, compressed):
        return torch.where(compressed, torch.full_like(scores, NEG), scores)


@register
@dataclass
class Evict(Method):
    """StreamingLLM eviction: the first `sink` tokens and the newest `window` in fp16, every other token dropped."""

    name = "evict"
    summary = "StreamingLLM eviction: sink tokens + newest window in fp16, the rest dropped"
    test_config = {"sink": 2, "window": 8}  # tokens are dropped within the 48-token test windows
    sink: int = 4
    window: int = 252  # the budget: 4 + 252 = 256 tokens kept, 1.0 bit per element at 4096 tokens

    def validate(self):
        if self.sink < 0:
            raise KvcalError(f"evict sink must be >= 0, got {self.sink}")
        if self.window < 1:
            raise KvcalError(f"evict window must be >= 1 (the newest token attends to itself), got {self.window}")

    def check_protocol(self, protocol: str) -> None:
        if protocol == "tail":
            raise KvcalError("evict keeps sinks and a sliding window as tokens arrive; the tail protocol compresses a "
                             "block in bulk, which for evict would drop the whole block whatever its budget: use "
                             "--protocol gptq or prefill-decode")

    def with_fp_window(self, window: int) -> Method:
        """The allowance's newest `window` tokens are already in fp16 when they fit in this setting's window (its
        budget, which the allowance does not change); a larger allowance is refused."""
        if window < 0:
            return super().with_fp_window(window)
        if window > self.window:
            raise KvcalError(f"evict keeps its newest {self.window} tokens (its budget): --fp-window {window} asks for "
                             f"more; raise its window (--set window={window}) or lower the allowance")
        return self

    def tag(self) -> str:
        return f"s{self.sink}-w{self.window}"

    def build_codec(self, tensors, dims) -> Codec:
        return EvictCodec(self.sink, self.window)

    def footprint(self, dims, tokens):
        return {"fp16_kept": fp16_token_bytes(dims, min(tokens, self.sink + self.window))}
