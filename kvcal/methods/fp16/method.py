"""fp16: no compression, the reference every comparison includes. The cache keeps K and V in the model's dtype."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.accounting import fp16_token_bytes
from kvcal.methods.base import Method, Storage, Storages
from kvcal.methods.registry import register


class LosslessStorage(Storage):
    """Nothing compressed: the cache keeps plain K and V (its lossless layer), the simulation the inputs."""

    lossless = True

    def reconstruct(self, k, v):
        return k, v

    def kernel_refusal(self) -> str | None:
        return None  # nothing to pack: the lossless layer attends with SDPA


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

    def build_storages(self, tensors, dims) -> Storages:
        return Storages(LosslessStorage() for _ in range(dims.num_layers))

    def footprint(self, dims, tokens: int) -> dict[str, float]:
        return {"fp16": fp16_token_bytes(dims, tokens)}
