"""The `gptq` protocol's simulation: every query sees every key exactly as token-by-token decoding would.

Compression in every method is either per token or per aligned block of tokens, so the reconstructed
value of token j does not depend on when it is compressed. We therefore reconstruct all tokens once,
and let the codec's FlushPolicy decide, per (query, key) pair, whether the full-precision or the
reconstructed value is seen (sinks, recent window, KIVI's unflushed residual). A test checks this
against a cache fed one token at a time (kvcal.runtime.cache).
"""

from __future__ import annotations

import torch

from kvcal.models.adapter import AttentionInputs
from kvcal.models.attention import attention, mixed_attention
from kvcal.quant.rope import apply_rope


def reconstruct(codec, inp: AttentionInputs, k_src: torch.Tensor, state: dict):
    """Reconstructed K (in the codec's key space) and V for every token compressed at some point of a
    window of this length. The others (sinks, the final residual) are returned unchanged: no query in
    the window sees them compressed. Codecs of source "x" rebuild them from the layer input.
    """
    start, end = codec.policy.compressed_span(k_src.shape[2])
    k_hat, v_hat = k_src.clone(), inp.v.clone()
    if end > start:
        span = slice(start, end)
        if codec.source == "x":
            k_hat[:, :, span], v_hat[:, :, span] = codec.rematerialize(inp.layer_idx, inp.x[:, span], inp, state)
        else:
            k_hat[:, :, span], v_hat[:, :, span] = codec.reconstruct(inp.layer_idx, k_src[:, :, span],
                                                                     inp.v[:, :, span])
    return k_hat, v_hat


class SimulatedAttention:
    """Adapter handler for whole-window forwards (no cache) under the gptq or prefill-decode protocol."""

    def __init__(self, codec, prompt_len: int = 0):
        self.codec = codec
        self.prompt_len = prompt_len
        self.state: dict = {}  # what a cross-layer codec passes from layer to layer within one forward

    def attend(self, inp: AttentionInputs) -> torch.Tensor:
        if inp.cache is not None:
            raise RuntimeError("the gptq simulation runs whole windows without a cache (use_cache=False)")
        q, k_fp = inp.rotated()
        if self.codec.lossless:
            return attention(q, k_fp, inp.v, inp.mask, inp.scale)
        length = inp.k_pre.shape[2]
        k_src = inp.k_pre if self.codec.keys_pre_rope else k_fp
        k_hat, v_hat = reconstruct(self.codec, inp, k_src, self.state)
        if self.codec.keys_pre_rope:
            k_hat = apply_rope(k_hat, inp.cos, inp.sin)
        full_precision = self.codec.policy.full_precision_mask(length, self.prompt_len, q.device)
        if not full_precision.any():
            return attention(q, k_hat, v_hat, inp.mask, inp.scale)
        return mixed_attention(q, k_fp, inp.v, k_hat, v_hat, full_precision, inp.mask, inp.scale)
