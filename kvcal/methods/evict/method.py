"""Eviction baseline: StreamingLLM's rule (Xiao et al. 2023, arXiv 2309.17453). The cache keeps the first `sink`
tokens and the newest `window` tokens in fp16 and drops every other token. Nothing to learn.

It is the generic cache's flush rule with nothing stored: FlushPolicy(sink=S, residual=W, block=1) keeps the sinks and
the window in the cache's full-precision part, and what that policy hands to the storage is dropped. The storage's
buffer holds zero bytes per token, its write stores nothing, its attention returns the full-precision part's softmax
partials alone (no token to add), and the simulation gives every dropped key the score NEG (weight exactly 0).
Storage: storage.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.accounting import fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import Method, Storages
from kvcal.methods.evict.storage import EvictStorage
from kvcal.methods.registry import register


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

    def build_storages(self, tensors, dims) -> Storages:
        return Storages([EvictStorage(self.sink, self.window)] * dims.num_layers)

    def footprint(self, dims, tokens):
        return {"fp16_kept": fp16_token_bytes(dims, min(tokens, self.sink + self.window))}
