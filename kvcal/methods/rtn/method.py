"""RTN int-N: round-to-nearest per token (keys after RoPE), one fp16 scale and zero per token, KV head and group of
channels; the newest `fp_window` tokens stay in fp16 (0: every token is quantized as it enters the cache). Nothing to
learn. Kernels: kvcal/methods/rtn/kernels.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.accounting import fp16_token_bytes, kv_elements
from kvcal.errors import KvcalError
from kvcal.methods.base import Codec, Method, check_bits
from kvcal.methods.registry import register
from kvcal.quant.packing import words_per_vector
from kvcal.quant.uniform import dequantize_per_token, quantize_per_token_into
from kvcal.runtime.storage import BufferSpec, FlushPolicy, Packed, Storage

PARAM_BYTES = 2  # fp16 scale and fp16 zero (the group minimum) per quantization group


class RtnStorage(Storage):
    """Codes [B, Hkv, T, W] int32 for keys and values; scale and zero [B, Hkv, T, D / group] fp16 each."""

    def __init__(self, bits: int, group: int, fp_window: int = 0):
        self.bits, self.group = bits, group
        self.policy = FlushPolicy(sink=0, residual=fp_window, block=1)

    def check(self, heads: int, dim: int) -> None:
        if dim % self.group:
            raise KvcalError(f"rtn group_size {self.group} does not divide head_dim {dim}")

    def buffers(self, batch, capacity, heads, dim):
        codes = BufferSpec((batch, heads, capacity, words_per_vector(dim, self.bits)), torch.int32, 2)
        params = BufferSpec((batch, heads, capacity, dim // self.group), torch.float16, 2)
        return {"k_codes": codes, "k_scale": params, "k_zero": params,
                "v_codes": codes, "v_scale": params, "v_zero": params}

    def write_reference(self, packed, keys, values, rows, slots):
        for side, x in (("k", keys), ("v", values)):
            quantize_per_token_into(x, self.bits, self.group, packed[f"{side}_codes"], packed[f"{side}_scale"],
                                    packed[f"{side}_zero"], rows, slots)

    def write_triton(self, packed, keys, values, rows, slots):
        from kvcal.quant.uniform_kernels import quantize_per_token_into_triton

        for side, x in (("k", keys), ("v", values)):
            quantize_per_token_into_triton(x, self.bits, self.group, packed[f"{side}_codes"], packed[f"{side}_scale"],
                                           packed[f"{side}_zero"], rows, slots)

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        t = int(packed.lengths[row])
        k, v = (dequantize_per_token(packed[f"{side}_codes"][row, :, :t], packed[f"{side}_scale"][row, :, :t],
                                     packed[f"{side}_zero"][row, :, :t], self.bits, packed.dim) for side in "kv")
        return k.to(dtype), v.to(dtype)

    def supports_triton(self, q, packed):
        from kvcal.methods.rtn.method import kernels as rtn_kernels

        return rtn_kernels.unsupported(q, packed, self.bits)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        from kvcal.methods.rtn.method import kernels as rtn_kernels

        return rtn_kernels.attend_triton(q, packed, scale, fp, self.bits, **knobs)


class RTNCodec(Codec):
    def __init__(self, bits: int, group: int, fp_window: int = 0):
        self._storage = RtnStorage(bits, group, fp_window)
        self.policy = self._storage.policy

    def storage(self, layer: int) -> Storage:
        return self._storage


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

    def build_codec(self, tensors, dims) -> Codec:
        self.check_model(dims)
        return RTNCodec(self.bits, self.group(dims), self.fp_window)

    def footprint(self, dims, tokens):
        quantized = FlushPolicy(residual=self.fp_window).compressed_count(tokens)
        elements = kv_elements(dims, quantized)
        return {
            # each (token, KV head, K or V) vector's codes in whole int32 words
            "codes": elements / dims.head_dim * words_per_vector(dims.head_dim, self.bits) * 4,
            "scales_zeros": elements / self.group(dims) * 2 * PARAM_BYTES,
            "fp16_window": fp16_token_bytes(dims, tokens - quantized),
        }
