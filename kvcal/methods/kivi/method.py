"""KIVI (Liu et al., 2024): keys per channel over blocks of G tokens, values per token over groups of G channels, and
a full-precision residual of the R most recent tokens, flushed one block of G at a time. Nothing to learn. Storage:
storage.py; kernels: kernels.py."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.accounting import fp16_token_bytes, kv_elements
from kvcal.errors import KvcalError
from kvcal.methods.base import Method, Storages, check_bits
from kvcal.methods.kivi.storage import KiviStorage
from kvcal.methods.registry import register
from kvcal.quant.packing import words_per_vector
from kvcal.runtime.storage import FlushPolicy

PARAM_BYTES = 2  # fp16 scale and fp16 zero per quantization group


@register
@dataclass
class KIVI(Method):
    """KIVI: keys per channel in groups of G tokens, values per token in groups of G channels, and
    an fp16 residual of the R most recent tokens, flushed one group of G at a time."""

    name = "kivi"
    summary = "per-channel keys, per-token values, fp16 residual window"
    fp_window_field = "residual"  # the newest R tokens, plus the unfinished key block (its format needs whole blocks)
    test_config = {"bits": 2, "group_size": 8, "residual": 8}  # blocks flush during a short decode
    bits: int = 2
    group_size: int = 32
    residual: int = 128

    def validate(self):
        check_bits(self.bits)
        if self.group_size <= 0 or self.residual < 0:
            raise KvcalError("kivi needs group_size > 0 and residual >= 0")

    def check_model(self, dims):
        if dims.head_dim % self.group_size:
            raise KvcalError(f"kivi group_size {self.group_size} does not divide head_dim {dims.head_dim}")

    def tag(self) -> str:
        return f"{self.bits}bit-g{self.group_size}-r{self.residual}"

    def build_storages(self, tensors, dims) -> Storages:
        self.check_model(dims)
        storage = KiviStorage(self.bits, self.group_size, self.residual)  # stateless: one object for every layer
        return Storages([storage] * dims.num_layers)

    def footprint(self, dims, tokens):
        policy = FlushPolicy(residual=self.residual, block=self.group_size)
        quantized = policy.compressed_count(tokens)
        elements = kv_elements(dims, quantized)
        return {
            # each (token, KV head, K or V) vector's codes in whole int32 words
            "codes": elements / dims.head_dim * words_per_vector(dims.head_dim, self.bits) * 4,
            # keys: one (scale, zero) per channel per G tokens; values: per token per G channels
            "scales_zeros": elements / self.group_size * 2 * PARAM_BYTES,
            "fp16_residual": fp16_token_bytes(dims, tokens - quantized),
        }
