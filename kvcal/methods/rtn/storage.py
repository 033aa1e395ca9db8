"""RTN's storage: codes [B, Hkv, T, W] int32 per token, one fp16 scale and zero per token, KV head and group
of channels (torch reference: kvcal/quant/uniform.py; Triton: kvcal/quant/uniform_kernels.py and kernels.py here)."""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.methods.rtn import kernels as rtn_kernels
from kvcal.quant.packing import words_per_vector
from kvcal.quant.uniform import dequantize_per_token, quantize_per_token_into
from kvcal.quant.uniform_kernels import quantize_per_token_into_triton
from kvcal.runtime.storage import BufferSpec, FlushPolicy, Packed, Storage


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
        for side, x in (("k", keys), ("v", values)):
            quantize_per_token_into_triton(x, self.bits, self.group, packed[f"{side}_codes"], packed[f"{side}_scale"],
                                           packed[f"{side}_zero"], rows, slots)

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        t = packed.length(row)
        k, v = (dequantize_per_token(packed[f"{side}_codes"][row, :, :t], packed[f"{side}_scale"][row, :, :t],
                                     packed[f"{side}_zero"][row, :, :t], self.bits, packed.dim) for side in "kv")
        return k.to(dtype), v.to(dtype)

    def supports_triton(self, q, packed):
        return rtn_kernels.unsupported(q, packed, self.bits)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        return rtn_kernels.attend_triton(q, packed, scale, fp, self.bits, **knobs)
