"""KVQuant's storages: nuq codes against sorted per-layer tables (keys per channel before RoPE with
calibrated ranges, values per token or per token and KV head with ranges computed online), dense-and-sparse outliers
in fp16 slots, and the torch round trips the simulation uses (kvcal/quant/nonuniform.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.methods.base import FlushPolicy
from kvcal.methods.kvquant import kernels as kvquant_kernels
from kvcal.quant.nonuniform import (
    dequantize_lut_dynamic,
    dequantize_lut_static,
    quantize_lut_dynamic,
    quantize_lut_dynamic_into,
    quantize_lut_static,
    quantize_lut_static_into,
    range_params,
)
from kvcal.quant.nonuniform_kernels import quantize_lut_dynamic_into_triton, quantize_lut_static_into_triton
from kvcal.quant.packing import words_per_vector
from kvcal.runtime.storage import BufferSpec, Packed, ReconstructionStorage, Storage


def per_side_outliers(fraction: float, channels: int) -> int:
    """Outliers per side of a per-token vector: floor(fraction/2 * C) + 1 (0 when fraction is 0)."""
    return 0 if fraction <= 0 else int(fraction / 2 * channels) + 1


def key_round_trip(x: torch.Tensor, tables: dict, bits: int, key_granularity: str, outliers: float, exact: bool,
                   capacity: int) -> torch.Tensor:
    """Keys x [N, H, D] quantized and read back with the packed quantizers of kvcal/quant/nonuniform.py: per channel
    with the calibrated ranges (outliers: out-of-range elements, their residuals exact, or as a cache stores them,
    fp16 and at most `capacity` per token and head), or per token (the key_granularity ablation; `outliers` the
    fraction of each vector kept exact)."""
    dtype = torch.float64 if exact else torch.float16
    n, h, d = x.shape
    if key_granularity == "per_token":
        per_side = per_side_outliers(outliers, h * d)
        codes, s, z, idx, val = quantize_lut_dynamic(x, tables["k_encode"], tables["k_decode"], bits, per_side,
                                                     residual_dtype=dtype)
        return dequantize_lut_dynamic(codes, s, z, tables["k_decode"], bits, d, idx, val)
    capacity = (d if exact else capacity) if outliers else 0
    codes, idx, val = quantize_lut_static(x, tables["k_lo"], tables["k_hi"], tables["k_encode"], tables["k_decode"],
                                          bits, capacity, dtype)
    zero, scale = range_params(tables["k_lo"], tables["k_hi"])
    return dequantize_lut_static(codes, zero, scale, tables["k_decode"], bits, d, idx, val)


def value_round_trip(x: torch.Tensor, tables: dict, bits: int, per_side: int, per_head: bool,
                     exact: bool) -> torch.Tensor:
    """Values x [N, H, D] quantized per token (or per token and head) and read back, residuals exact or fp16."""
    codes, s, z, idx, val = quantize_lut_dynamic(x, tables["v_encode"], tables["v_decode"], bits, per_side,
                                                 per_head, torch.float64 if exact else torch.float16)
    return dequantize_lut_dynamic(codes, s, z, tables["v_decode"], bits, x.shape[-1], idx, val)


class KVQuantStorage(Storage):
    """Keys before RoPE (rotated at attention time) per channel with the calibrated ranges: codes [B, Hkv, T, W] and
    `capacity` outlier slots per token and KV head, [B, T, Hkv, capacity] (int16 channel over all heads, -1 empty;
    fp16 residual). Values per token: codes [B, Hkv, T, W], fp16 scale and zero [B, T] ([B, Hkv, T] per head), 2
    per_side outlier slots per vector [B, T, 2 per_side] ([B, T, Hkv, 2 per_side]). The first `sink` tokens stay in
    full precision. Tables and ranges are per layer (the storage's own tensors)."""

    keys_pre_rope = True

    def __init__(self, bits: int, tables: dict, capacity: int, value_per_side: int, per_head: bool, sink: int,
                 fp_window: int = 0, exact_outliers: bool = False, outliers: float = 0.0):
        self.bits, self.capacity, self.value_per_side, self.per_head = bits, capacity, value_per_side, per_head
        # the simulation's view: exact outliers (the paper's), or as this storage keeps them
        self.how = RoundTrip(bits, "per_channel", outliers, exact_outliers, capacity, value_per_side, per_head)
        self.policy = FlushPolicy(sink=sink, residual=fp_window)
        self.tables = tables
        self.key_zero, self.key_scale = range_params(tables["k_lo"], tables["k_hi"])  # as the quantizer uses them
        self.key_table, self.value_table = tables["k_decode"], tables["v_decode"]

    def to(self, device) -> KVQuantStorage:
        if self.key_table.device != torch.device(device):
            self.tables = {k: t.to(device) for k, t in self.tables.items()}
            self.key_zero, self.key_scale = self.key_zero.to(device), self.key_scale.to(device)
            self.key_table, self.value_table = self.tables["k_decode"], self.tables["v_decode"]
        return self

    def buffers(self, batch, capacity, heads, dim):
        codes = BufferSpec((batch, heads, capacity, words_per_vector(dim, self.bits)), torch.int32, 2)
        specs = {"k_codes": codes, "v_codes": codes}
        if self.capacity:
            slots = (batch, capacity, heads, self.capacity)
            specs["k_out_idx"] = BufferSpec(slots, torch.int16, 1)
            specs["k_out_val"] = BufferSpec(slots, torch.float16, 1)
        heads_axis = (heads,) if self.per_head else ()
        params = BufferSpec((batch, *heads_axis, capacity), torch.float16, 1 + len(heads_axis))
        specs["v_scale"] = specs["v_zero"] = params
        if self.value_per_side:
            slots = BufferSpec((batch, capacity, *heads_axis, 2 * self.value_per_side), torch.int16, 1)
            specs["v_out_idx"] = slots
            specs["v_out_val"] = BufferSpec(slots.shape, torch.float16, 1)
        return specs

    def _write(self, packed, keys, values, rows, slots, static_into, dynamic_into):
        t, buf = self.tables, packed.buffers
        static_into(keys, t["k_lo"], t["k_hi"], t["k_encode"], t["k_decode"], self.bits, self.capacity, buf["k_codes"],
                    buf.get("k_out_idx"), buf.get("k_out_val"), rows, slots)
        dynamic_into(values, t["v_encode"], t["v_decode"], self.bits, self.value_per_side, self.per_head,
                     buf["v_codes"], buf["v_scale"], buf["v_zero"], buf.get("v_out_idx"), buf.get("v_out_val"), rows,
                     slots)

    def write_reference(self, packed, keys, values, rows, slots):
        self._write(packed, keys, values, rows, slots, quantize_lut_static_into, quantize_lut_dynamic_into)

    def write_triton(self, packed, keys, values, rows, slots):
        self._write(packed, keys, values, rows, slots, quantize_lut_static_into_triton,
                    quantize_lut_dynamic_into_triton)

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        n, d, buf = packed.length(row), packed.dim, packed.buffers

        def slots(name):
            return None if name not in buf else buf[name][row, :n]

        k = dequantize_lut_static(buf["k_codes"][row, :, :n].transpose(0, 1), self.key_zero, self.key_scale,
                                  self.key_table, self.bits, d, slots("k_out_idx"), slots("k_out_val"))
        params = (buf["v_scale"][row, :, :n].transpose(0, 1), buf["v_zero"][row, :, :n].transpose(0, 1)) \
            if self.per_head else (buf["v_scale"][row, :n], buf["v_zero"][row, :n])
        v = dequantize_lut_dynamic(buf["v_codes"][row, :, :n].transpose(0, 1), *params, self.value_table, self.bits,
                                   d, slots("v_out_idx"), slots("v_out_val"))
        k, v = k.transpose(0, 1), v.transpose(0, 1).to(dtype)  # [H, n, D]
        return (packed.rotate_keys(k, dtype) if rotate else k.to(dtype)), v

    def reconstruct(self, k, v):
        """exact_outliers: the same quantizers with every outlier kept and its residual exact (the paper's simulation,
        digest #7); otherwise the storage itself (fp16 residuals, `capacity` slots per token and head)."""
        self.to(k.device)
        return kv_round_trip(k, v, self.tables, self.how)

    def supports_triton(self, q, packed):
        return kvquant_kernels.unsupported(q, self.bits)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        return kvquant_kernels.attend_triton(q, packed, scale, fp, self, **knobs)

    def fill_synthetic(self, packed, generator):
        """Random codes and ranges; about half the key outlier slots of a token and head used (cap // 2 + 1 of cap: 2 of
        3 at head_dim 128, as with 1% outliers), each with a channel of its own head; every value slot used, with
        channels of its vector."""
        heads, dim = packed.heads, packed.dim
        for name, t in packed.buffers.items():
            if name.endswith("codes"):
                t.random_(generator=generator)
            elif name == "k_out_idx":
                t.random_(0, dim, generator=generator)
                t += (torch.arange(heads, device=t.device, dtype=t.dtype) * dim)[:, None]
                t[..., t.shape[-1] // 2 + 1:] = -1
            elif name == "v_out_idx" and self.per_head:
                t.random_(0, dim, generator=generator)
                t += (torch.arange(heads, device=t.device, dtype=t.dtype) * dim)[:, None]
            elif name == "v_out_idx":
                t.random_(0, heads * dim, generator=generator)
            else:  # scales, zeros, residuals: small positive values
                t.uniform_(0.01, 0.05, generator=generator)


@dataclass(frozen=True)
class RoundTrip:
    """How the simulation reads a KVQuant setting back (`kv_round_trip`): the packed storage's quantizers, with
    every outlier kept and its residual exact (`exact`, the paper's simulation, digest #7) or as the storage keeps
    them (fp16 residuals, `capacity` key outlier slots per token and head: what decode mode gives)."""

    bits: int
    key_granularity: str
    outliers: float
    exact: bool
    capacity: int
    value_per_side: int
    per_head: bool


def kv_round_trip(k: torch.Tensor, v: torch.Tensor, tables: dict, how: RoundTrip):
    """k, v [B, H, T, D] -> what the simulation sees of them (same shapes and dtypes)."""
    b, h, n, d = k.shape
    k_hat = key_round_trip(k.transpose(1, 2).reshape(-1, h, d), tables, how.bits, how.key_granularity, how.outliers,
                           how.exact, how.capacity)
    v_hat = value_round_trip(v.transpose(1, 2).reshape(-1, h, d), tables, how.bits, how.value_per_side,
                             how.per_head, how.exact)
    return (k_hat.reshape(b, n, h, d).transpose(1, 2).to(k.dtype),
            v_hat.reshape(b, n, h, d).transpose(1, 2).to(v.dtype))


def layer_tables(tensors: dict[str, torch.Tensor], num_layers: int) -> list[dict[str, torch.Tensor]]:
    """Each layer's tables from an artifact's tensors: {"k_encode", "k_decode", "k_lo", "k_hi", "v_encode",
    "v_decode"} (those present), float32."""
    tables = []
    for i in range(num_layers):
        layer = {}
        for kind in ("k", "v"):
            for name in ("encode", "decode", "lo", "hi"):
                key = f"layers.{i}.{kind}.{name}"
                if key in tensors:
                    layer[f"{kind}_{name}"] = tensors[key].to(torch.float32)
        tables.append(layer)
    return tables


class KVQuantReconstruction(ReconstructionStorage):
    """An ablation the packed storage does not hold (post-RoPE keys, per-token keys): its round trip kept as is."""

    refusal = "a KVQuant ablation (the packed runtime holds pre-RoPE per-channel keys only) kept as its " \
              "reconstruction (torch only)"

    def __init__(self, tables: dict, how: RoundTrip, keys_pre_rope: bool, sink: int, fp_window: int):
        super().__init__()
        self.tables, self.how = tables, how
        self.keys_pre_rope = keys_pre_rope
        self.policy = FlushPolicy(sink=sink, residual=fp_window)

    def reconstruct(self, k, v):
        self.tables = {name: t.to(k.device) for name, t in self.tables.items()}
        return kv_round_trip(k, v, self.tables, self.how)
