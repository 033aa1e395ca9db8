"""fp16: no compression, the reference every comparison includes. The cache keeps K and V in the model's dtype."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.accounting import fp16_token_bytes
from kvcal.methods.base import Codec, Method
from kvcal.methods.registry import register


class LosslessCodec(Codec):
    lossless = True

    def reconstruct(self, layer, k, v):
        return k, v


@register
@dataclass
class FP16(Method):
    name = "fp16"
    summary = "no compression (reference)"

    def tag(self) -> str:
        return "fp16"

    def with_fp_window(self, window: int) -> Method:
        """Every token stays in full precision: any allowance holds."""
        if window < 0:
            return super().with_fp_window(window)
        return self

    def build_codec(self, tensors, dims) -> Codec:
        return LosslessCodec()

    def footprint(self, dims, tokens: int) -> dict[str, float]:
        return {"fp16": fp16_token_bytes(dims, tokens)}
