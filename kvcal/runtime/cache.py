"""KvcalCache: a transformers `Cache` whose layers store K/V the way a codec compresses them.

This is the stateful, token-by-token counterpart of the gptq simulation. The reference backend keeps
the reconstructed values (what dequantization gives) in torch tensors:

- prefill (several tokens at once, first call): attention over the full-precision prompt, then the
  prompt is compressed in bulk as far as the codec's FlushPolicy allows;
- decode (one token per call): the token is appended, the oldest tokens are flushed one block at a
  time while the policy allows, and only then attention runs (the gptq protocol's semantics).

Sinks stay in full precision; a flush compresses the oldest full block after the sinks.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvcal.models.attention import attention
from kvcal.quant.rope import apply_rope


class KvcalLayer(DynamicLayer):
    def __init__(self, codec, layer_idx: int):
        super().__init__()
        self.codec = codec
        self.layer_idx = layer_idx
        self.length = 0
        self.compressed = 0  # tokens after the sinks that are compressed
        self.k_src = None  # full-precision keys in the codec's key space [B, H, n, D]
        self.v_src = None
        self.cos = self.sin = None  # RoPE tables of the cached positions [B, n, D]
        self.k_seen = None  # what attention sees: post-RoPE keys, reconstructed where compressed
        self.v_seen = None

    # -- transformers Cache API (the mask builder and generate() ask for lengths) --
    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("KvcalCache layers are driven by kvcal's attention adapter, not Cache.update")

    # -- kvcal --
    def append(self, inp) -> None:
        k_rot = apply_rope(inp.k_pre, inp.cos, inp.sin)
        k_src = inp.k_pre if self.codec.keys_pre_rope else k_rot
        if self.k_src is None:
            self.k_src, self.v_src, self.cos, self.sin = k_src, inp.v, inp.cos, inp.sin
            self.k_seen, self.v_seen = k_rot, inp.v.clone()
        else:
            self.k_src = torch.cat([self.k_src, k_src], dim=2)
            self.v_src = torch.cat([self.v_src, inp.v], dim=2)
            self.cos, self.sin = torch.cat([self.cos, inp.cos], 1), torch.cat([self.sin, inp.sin], 1)
            self.k_seen = torch.cat([self.k_seen, k_rot], dim=2)
            self.v_seen = torch.cat([self.v_seen, inp.v], dim=2)
        self.length += inp.k_pre.shape[2]
        self.is_initialized = True

    def flush(self) -> None:
        """Compress the oldest blocks after the sinks for as long as the policy allows."""
        policy = self.codec.policy
        if self.codec.lossless:
            return
        target = policy.compressed_count(self.length)
        while self.compressed < target:
            start = policy.sink + self.compressed
            end = start + policy.block
            k_hat = self.codec.quantize_keys(self.layer_idx, self.k_src[:, :, start:end])
            v_hat = self.codec.quantize_values(self.layer_idx, self.v_src[:, :, start:end])
            if self.codec.keys_pre_rope:
                k_hat = apply_rope(k_hat, self.cos[:, start:end], self.sin[:, start:end])
            self.k_seen[:, :, start:end] = k_hat
            self.v_seen[:, :, start:end] = v_hat
            self.compressed += policy.block

    def attend(self, inp) -> torch.Tensor:
        q = apply_rope(inp.q, inp.cos, inp.sin)
        prefill = self.length == 0 and inp.q.shape[2] > 1
        self.append(inp)
        if prefill:  # full-precision prompt attention, then bulk compression
            out = attention(q, self.k_seen, self.v_seen, inp.mask, inp.scale)
            self.flush()
            return out
        self.flush()
        return attention(q, self.k_seen, self.v_seen, inp.mask, inp.scale)


class KvcalCache(Cache):
    """Pass as `past_key_values` to a model loaded by kvcal (its adapter routes attention here)."""

    def __init__(self, codec, num_layers: int):
        super().__init__(layers=[KvcalLayer(codec, i) for i in range(num_layers)])
        self.codec = codec

    def kvcal_attend(self, inp) -> torch.Tensor:
        return self.layers[inp.layer_idx].attend(inp)
