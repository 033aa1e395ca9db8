"""KIVI's codec and storage: keys per channel over blocks of G tokens, values per token over groups of channels (torch
reference: kvcal/quant/uniform.py; Triton: kvcal/quant/uniform_kernels.py and kernels.py here)."""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.methods.kivi import kernels as kivi_kernels
from kvcal.quant.packing import words_per_vector
from kvcal.quant.uniform import (
    dequantize_per_channel,
    dequantize_per_token,
    quantize_per_channel,
    quantize_per_token_into,
)
from kvcal.quant.uniform_kernels import quantize_per_channel_triton, quantize_per_token_into_triton
from kvcal.runtime.storage import BufferSpec, FlushPolicy, Packed, Storage


class KiviStorage(Storage):
    """Key codes [B, Hkv, T, W] with one fp16 (scale, zero) per channel and block, [B, Hkv, T / G, D]; value codes
    [B, Hkv, T, W] with fp16 (scale, zero) per token and group, [B, Hkv, T, D / Gv] (Gv = G unless `value_group` says
    otherwise). Tokens arrive one whole key block at a time (the policy's block), keys after RoPE. (XQuant stores its
    SVD latents in this format, one "head" as wide as all KV heads.)"""

    def __init__(self, bits: int, group: int, residual: int, value_group: int | None = None):
        self.bits, self.group = bits, group
        self.value_group = value_group or group
        # Keys are quantized per channel over blocks of `group` tokens, so tokens leave the fp16
        # residual one whole block at a time, and only while `residual` newer tokens remain.
        self.policy = FlushPolicy(sink=0, residual=residual, block=group)

    def check(self, heads: int, dim: int) -> None:
        if dim % self.value_group:
            raise KvcalError(f"kivi group_size {self.value_group} does not divide head_dim {dim}")

    def buffers(self, batch, capacity, heads, dim):
        codes = BufferSpec((batch, heads, capacity, words_per_vector(dim, self.bits)), torch.int32, 2)
        key_params = BufferSpec((batch, heads, capacity // self.group, dim), torch.float16, 2)
        value_params = BufferSpec((batch, heads, capacity, dim // self.value_group), torch.float16, 2)
        return {"k_codes": codes, "k_scale": key_params, "k_zero": key_params,
                "v_codes": codes, "v_scale": value_params, "v_zero": value_params}

    def _write(self, packed, keys, values, rows, slots, per_channel, per_token_into):
        heads, dim = packed.heads, packed.dim
        codes, scale, zero = per_channel(keys, self.bits, self.group)  # one (scale, zero) per block and channel
        first = slice(None, None, self.group)  # the first token of each block: its row and block index
        block_rows, blocks = rows[first], slots[first] // self.group
        packed["k_scale"][block_rows, :, blocks] = scale.reshape(-1, heads, dim)
        packed["k_zero"][block_rows, :, blocks] = zero.reshape(-1, heads, dim)
        packed["k_codes"][rows, :, slots] = codes
        per_token_into(values, self.bits, self.value_group, packed["v_codes"], packed["v_scale"], packed["v_zero"],
                       rows, slots)

    def write_reference(self, packed, keys, values, rows, slots):
        self._write(packed, keys, values, rows, slots, quantize_per_channel, quantize_per_token_into)

    def write_triton(self, packed, keys, values, rows, slots):
        self._write(packed, keys, values, rows, slots, quantize_per_channel_triton, quantize_per_token_into_triton)

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        t, dim = packed.length(row), packed.dim
        blocks = torch.arange(t, device=packed.lengths.device) // self.group
        k = dequantize_per_channel(packed["k_codes"][row, :, :t], packed["k_scale"][row][:, blocks],
                                   packed["k_zero"][row][:, blocks], self.bits, dim)
        v = dequantize_per_token(packed["v_codes"][row, :, :t], packed["v_scale"][row, :, :t],
                                 packed["v_zero"][row, :, :t], self.bits, dim)
        return k.to(dtype), v.to(dtype)

    def supports_triton(self, q, packed):
        return kivi_kernels.unsupported(q, packed, self.bits, self.group)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        return kivi_kernels.attend_triton(q, packed, scale, fp, self.bits, self.group, **knobs)
