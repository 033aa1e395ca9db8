"""Bits per element: the one accounting function every method, `inspect` and `eval ppl` use.

Bytes of the compressed cache for a reference sequence of 4096 tokens (batch 1), counting codes,
scales, zero points, outliers (value + index), norms and full-precision windows/sinks, times 8,
divided by 2 x tokens x layers x kv_heads x head_dim (the README's Conventions). Static per-model tensors (codebooks,
LUTs, ranges) are not in the cache: they are reported separately as artifact bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

REFERENCE_TOKENS = 4096
FP16_BYTES = 2


@dataclass(frozen=True)
class BitsReport:
    bits_per_element: float
    parts: dict[str, float]  # bits per element by category; they sum to bits_per_element
    tokens: int

    def to_dict(self) -> dict:
        return {
            "bits_per_element": round(self.bits_per_element, 6),
            "parts": {k: round(v, 6) for k, v in self.parts.items()},
            "tokens": self.tokens,
        }


def kv_elements(dims, tokens: int) -> int:
    """The denominator: elements an uncompressed K and V cache holds for `tokens` tokens."""
    return 2 * tokens * dims.num_layers * dims.num_kv_heads * dims.head_dim


def cache_footprint(method, dims, tokens: int = REFERENCE_TOKENS, compress_local: bool = False) -> dict[str, float]:
    """Bytes by part of the cache `method` keeps for `tokens` tokens (batch 1), all layers. On a model with
    sliding-window layers (ModelDims.hybrid) only the global layers hold the method's cache; a local layer holds the
    newest min(window - 1, tokens) tokens in fp16 between steps (part `local_window`), as transformers' own sliding
    cache does, or with `compress_local` in the method's format (its footprint at that many tokens)."""
    footprint = method.footprint(dims, tokens)
    if getattr(dims, "hybrid", False):
        local = sum(kind == "sliding_attention" for kind in dims.layer_types)
        share = (dims.num_layers - local) / dims.num_layers  # a method's footprint is the same for every layer
        footprint = {name: nbytes * share for name, nbytes in footprint.items()}
        held = min(dims.sliding_window - 1, tokens)
        if compress_local:
            for name, nbytes in method.footprint(dims, held).items():
                footprint[name] = footprint.get(name, 0.0) + nbytes * local / dims.num_layers
        else:
            footprint["local_window"] = FP16_BYTES * 2 * held * local * dims.kv_channels
    return footprint


def bits_per_element(method, dims, tokens: int = REFERENCE_TOKENS, compress_local: bool = False) -> BitsReport:
    """cache_footprint x 8 over every layer's K and V elements at `tokens` tokens."""
    footprint = cache_footprint(method, dims, tokens, compress_local)
    denominator = kv_elements(dims, tokens)
    parts = {name: 8.0 * nbytes / denominator for name, nbytes in footprint.items() if nbytes}
    return BitsReport(sum(parts.values()), parts, tokens)


def fp16_token_bytes(dims, tokens: int) -> float:
    """Bytes of `tokens` tokens kept in fp16 for both K and V, all layers."""
    return float(FP16_BYTES * kv_elements(dims, tokens))
