"""The `gptq` protocol's simulation: every query sees every key exactly as token-by-token decoding would (and the
`tail` protocol's: a block compressed in bulk between a full-precision prefix and a full-precision tail).

Compression in every method is either per token or per aligned block of tokens, so the reconstructed
value of token j does not depend on when it is compressed. We therefore reconstruct all tokens once,
and let the storages' FlushPolicy decide, per (query, key) pair, whether the full-precision or the
reconstructed value is seen (sinks, recent window, KIVI's unflushed residual). A test checks this
against a cache fed one token at a time (kvcal.runtime.cache).
"""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.models.adapter import AttentionInputs
from kvcal.models.attention import NEG, additive_mask, attention, mixed_attention, remapped_attention
from kvcal.models.loaded import LOCAL
from kvcal.quant.rope import apply_rope


def reconstruct(storages, inp: AttentionInputs, k_fp: torch.Tensor, state: dict,
                span: tuple[int, int] | None = None):
    """Reconstructed K (after RoPE, as attention sees it) and V for every token compressed at some point of a window
    of this length (or of the tokens [start, end) of `span`, compressed together). The others (sinks, the final
    residual) are returned unchanged: no query in the window sees them compressed. Keys are compressed in the
    storage's key space (before RoPE for keys_pre_rope, then rotated); storages of source "x" rebuild K and V from the
    layer input.
    """
    storage = storages[inp.layer_idx]
    k_src = inp.k_pre if storage.keys_pre_rope else k_fp
    start, end = storage.policy.compressed_span(k_src.shape[2]) if span is None else span
    k_hat, v_hat = k_src.clone(), inp.v.clone()
    if end > start:
        span = slice(start, end)
        if storage.source == "x":
            k_hat[:, :, span], v_hat[:, :, span] = storage.rematerialize(inp.x[:, span], inp, state)
        else:
            k_hat[:, :, span], v_hat[:, :, span] = storage.reconstruct(k_src[:, :, span], inp.v[:, :, span])
    if storage.keys_pre_rope:
        k_hat = apply_rope(k_hat, inp.cos, inp.sin)
    return k_hat, v_hat


def exact_local_layer(inp: AttentionInputs, storages) -> bool:
    """Whether this is a sliding-window layer of a hybrid model (Gemma 2/3) that keeps its bounded window of exact
    tokens (the model's own attention, the window in transformers' mask): the method compresses the global layers
    only, unless storages.compress_local (then a local layer's window is compressed too, the mask still bounding
    it)."""
    binding = getattr(inp.module, "_kvcal_binding", None)
    return (binding is not None and binding[0].dims.hybrid and binding[0].dims.layer_types[inp.layer_idx] == LOCAL
            and not storages.compress_local)


def refuse_remap_with_softcap(storages, inp: AttentionInputs) -> None:
    if storages.remaps_scores and inp.softcap is not None:
        raise KvcalError("a method that remaps attention scores (CalibQuant) on a model whose scores are soft-capped "
                         "(Gemma 2) is not supported yet")


class SimulatedAttention:
    """Adapter handler for whole-window forwards (no cache) under the gptq or prefill-decode protocol."""

    def __init__(self, storages, prompt_len: int = 0):
        self.storages = storages
        self.prompt_len = prompt_len
        self.state: dict = {}  # what a cross-layer method passes from layer to layer within one forward

    def attend(self, inp: AttentionInputs) -> torch.Tensor:
        if inp.cache is not None:
            raise RuntimeError("the gptq simulation runs whole windows without a cache (use_cache=False)")
        q, k_fp = inp.rotated()
        if self.storages.lossless or exact_local_layer(inp, self.storages):
            return attention(q, k_fp, inp.v, inp.mask, inp.scale, inp.softcap)
        refuse_remap_with_softcap(self.storages, inp)
        if self.storages.bulk_only:
            raise KvcalError(self.storages.bulk_only)
        length = inp.k_pre.shape[2]
        k_hat, v_hat = reconstruct(self.storages, inp, k_fp, self.state)
        full_precision = self.storages.policy.full_precision_mask(length, self.prompt_len, q.device)
        if self.storages.remaps_scores:  # one softmax over [k_fp; k_hat], exactly one copy of each key allowed
            bias = additive_mask(inp.mask, q.shape[2], length, q.device)
            fp = full_precision[None, None]
            both = torch.cat([torch.where(fp, bias, NEG), torch.where(fp, NEG, bias)], dim=-1)
            compressed = torch.cat([torch.zeros_like(fp), ~fp], dim=-1)
            return remapped_attention(q, torch.cat([k_fp, k_hat], 2), torch.cat([inp.v, v_hat], 2), both, compressed,
                                      inp.scale, self.storages[inp.layer_idx].remap_scores)
        if not full_precision.any():
            return attention(q, k_hat, v_hat, inp.mask, inp.scale, inp.softcap)
        return mixed_attention(q, k_fp, inp.v, k_hat, v_hat, full_precision, inp.mask, inp.scale, inp.softcap)


def tail_layout(seqlen: int, prefix_len: int | None = None, block_len: int | None = None) -> tuple[int, int]:
    """(S, P) of the tail protocol for windows of `seqlen`: a full-precision prefix of S tokens (default seqlen/64:
    32 at 2048), a compressed block of P tokens (default 3/4 of seqlen: 1536 at 2048) and a full-precision tail of the
    rest (480 at 2048; digest calibquant §8.1). One-line error unless S >= 0, P >= 1 and the tail holds at least
    two tokens (its first query predicts a counted target)."""
    prefix = seqlen // 64 if prefix_len is None else prefix_len
    block = 3 * seqlen // 4 if block_len is None else block_len
    if prefix < 0 or block < 1 or prefix + block > seqlen - 2:
        raise KvcalError(f"the tail protocol needs prefix >= 0, block >= 1 and prefix + block <= seqlen - 2; got "
                         f"prefix {prefix}, block {block}, seqlen {seqlen}")
    return prefix, block


class TailAttention:
    """Adapter handler for whole-window forwards under the `tail` protocol (any method).

    Tokens [0, S+P) are the full-precision prefill: their queries attend exactly. Then the block [S, S+P) is
    compressed in bulk, the storages' `reconstruct` (or `rematerialize`) taking the whole block as one span (a
    whole-block statistic, such as CalibQuant's per-channel ranges, spans all P tokens), and the tail queries
    [S+P, T) see [full-precision prefix | the reconstructed block | the causal full-precision tail], with the
    storages' score remap on the block. The storages' own flush policy (sinks, residual window) does not apply: the
    protocol's prefix and tail are its full-precision tokens. The full-precision allowance `fp_window` W keeps the
    newest W tokens of the prefill out of the block: [S, S+P-W) is compressed. P - W must be a multiple of the
    policy's block."""

    def __init__(self, storages, prefix: int, block: int, fp_window: int = 0):
        if not 0 <= fp_window < block:
            raise KvcalError(f"--fp-window {fp_window} must leave some of the tail protocol's {block}-token block")
        if not storages.lossless and (block - fp_window) % storages.policy.block:
            raise KvcalError(f"the tail protocol's compressed block of {block - fp_window} tokens is not a multiple "
                             f"of the method's {storages.policy.block}-token blocks: choose --block-len accordingly")
        self.storages, self.prefix, self.block, self.fp_window = storages, prefix, block, fp_window
        self.state: dict = {}

    def attend(self, inp: AttentionInputs) -> torch.Tensor:
        if inp.cache is not None:
            raise RuntimeError("the tail simulation runs whole windows without a cache (use_cache=False)")
        q, k_fp = inp.rotated()
        if self.storages.lossless or exact_local_layer(inp, self.storages):
            return attention(q, k_fp, inp.v, inp.mask, inp.scale, inp.softcap)
        refuse_remap_with_softcap(self.storages, inp)
        length = k_fp.shape[2]
        start, end = self.prefix, self.prefix + self.block - self.fp_window  # the compressed span
        prefill = self.prefix + self.block  # queries before it run in the exact prefill
        if prefill >= length:
            raise KvcalError(f"the tail protocol's prefix + block ({prefill}) leaves no tail in a window of {length}")
        mask = inp.mask
        head_mask = None if mask is None else mask[..., :prefill, :prefill]
        head = attention(q[:, :, :prefill], k_fp[:, :, :prefill], inp.v[:, :, :prefill], head_mask, inp.scale,
                         inp.softcap)
        k_hat, v_hat = reconstruct(self.storages, inp, k_fp, self.state, (start, end))
        k_mix, v_mix = k_fp.clone(), inp.v.clone()  # each key in one version for every tail query
        k_mix[:, :, start:end], v_mix[:, :, start:end] = k_hat[:, :, start:end], v_hat[:, :, start:end]
        q_tail = q[:, :, prefill:]
        if self.storages.remaps_scores:
            bias = additive_mask(mask, q_tail.shape[2], length, q.device)
            compressed = torch.zeros(length, dtype=torch.bool, device=q.device)
            compressed[start:end] = True
            tail = remapped_attention(q_tail, k_mix, v_mix, bias, compressed, inp.scale,
                                      self.storages[inp.layer_idx].remap_scores)
        else:
            tail = attention(q_tail, k_mix, v_mix, mask, inp.scale, inp.softcap)
        return torch.cat([head, tail], dim=2)
