"""RTN int-N: round-to-nearest per token (keys after RoPE), one fp16 scale and zero per token, KV head and group of
channels; the newest `fp_window` tokens stay in fp16 (0: every token is quantized as it enters the cache). Nothing to
learn. Storage: storage.py; kernels: kernels.py."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.accounting import fp16_token_bytes, kv_elements
from kvcal.errors import KvcalError
from kvcal.methods.base import Method, Storages, check_bits
from kvcal.methods.registry import register
from kvcal.methods.rtn.storage import RtnStorage
from kvcal.quant.packing import words_per_vector
from kvcal.runtime.storage import FlushPolicy

PARAM_BYTES = 2  # fp16 scale and fp16 zero (the group minimum) per quantization group


@register
@dataclass
class RTN(Method):
    """Round-to-nearest int-N per token (keys after RoPE), one fp16 scale and zero per group of channels of a head."""

    name = "rtn"
    summary = "asymmetric min/max int-N per token, keys post-RoPE"
    runtime_fields = ("fp_window",)
    fp_window_field = "fp_window"
    bits: int = 4
    group_size: int | None = None  # channels per group, inside one head; None = one group per head (head_dim)
    fp_window: int = 0  # newest tokens kept in fp16 (the comparison's full-precision allowance)

    def validate(self):
        check_bits(self.bits)
        if self.group_size is not None and self.group_size <= 0:
            raise KvcalError(f"group_size must be positive, got {self.group_size}")
        if self.fp_window < 0:
            raise KvcalError(f"rtn fp_window must be >= 0, got {self.fp_window}")

    def group(self, dims) -> int:
        return self.group_size or dims.head_dim

    def check_model(self, dims):
        if dims.head_dim % self.group(dims):
            raise KvcalError(f"rtn group_size {self.group(dims)} does not divide head_dim {dims.head_dim} (groups "
                             "lie inside one head)")

    def tag(self) -> str:
        return (f"int{self.bits}" + (f"-g{self.group_size}" if self.group_size else "")
                + (f"-w{self.fp_window}" if self.fp_window else ""))

    def build_storages(self, tensors, dims) -> Storages:
        self.check_model(dims)
        storage = RtnStorage(self.bits, self.group(dims), self.fp_window)  # stateless: one object for every layer
        return Storages([storage] * dims.num_layers)

    def footprint(self, dims, tokens):
        quantized = FlushPolicy(residual=self.fp_window).compressed_count(tokens)
        elements = kv_elements(dims, quantized)
        return {
            # each (token, KV head, K or V) vector's codes in whole int32 words
            "codes": elements / dims.head_dim * words_per_vector(dims.head_dim, self.bits) * 4,
            "scales_zeros": elements / self.group(dims) * 2 * PARAM_BYTES,
            "fp16_window": fp16_token_bytes(dims, tokens - quantized),
        }
