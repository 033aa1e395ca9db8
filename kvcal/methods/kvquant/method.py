"""KVQuant (Hooper et al., 2024): non-uniform KV-cache quantization calibrated with Fisher information.

- Keys are quantized per channel, before RoPE, with ranges calibrated offline (percentiles over the
  calibration tokens); values per token with ranges computed online.
- The datatype (nuqX) is one sorted table of 2^X levels per layer and tensor, in a domain where each
  vector is normalized to [-1, 1]; it is learned by weighted k-means with the diagonal Fisher
  information (squared gradient of the LM loss w.r.t. the key/value activations) as weights.
- Dense-and-sparse: ~1% of elements per vector (0.5% each tail) stay exact; keys use the calibrated
  per-channel thresholds, values the per-token top/bottom elements.
- Attention sink: the first token stays in fp16 and is left out of calibration.
- Q-Norm (optional, on by default at 2 bits): an affine correction of the decode table that restores
  the mean and std of the normalized values (seed paper, section 3.5).

Where the paper versions and the official code disagree we follow ../shared/papers/kvquant.md section 8:
weights F*s^2 (NeurIPS version, App. E) by default rather than the code's F; the sink excluded from the
thresholds as well (paper) and not only from k-means (code); per-token value ranges over the whole
token vector across KV heads (paper and code; `value_scope=head`, the digest's option, gives each KV
head's part of the token its own range and outliers); value outliers per side = floor(0.005*C) + 1 (the
code's deployment rule; 1 per side on C = 192); our own seeded weighted k-means (k-means++, best of 3
inits) instead of sklearn's single init.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvcal.accounting import FP16_BYTES, fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import Codec, FlushPolicy, Method
from kvcal.methods.registry import register
from kvcal.models.devmap import device_scope
from kvcal.quant.kmeans import weighted_kmeans
from kvcal.quant.nonuniform import (
    dequantize_lut_dynamic,
    dequantize_lut_static,
    nearest_level,
    outlier_bounds,
    quantile,
    quantize_lut_dynamic,
    quantize_lut_dynamic_into,
    quantize_lut_static,
    quantize_lut_static_into,
    range_params,
)
from kvcal.quant.packing import words_per_vector
from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.runtime.storage import BufferSpec, Packed, Storage

WEIGHTINGS = ("fisher_scale", "fisher", "none")
DATATYPES = ("nuq", "int")
GRANULARITIES = ("per_channel", "per_token")
VALUE_SCOPES = ("token", "head")
OUTLIER_ENTRY_BYTES = 4  # fp16 value + 16-bit index within the vector
OUTLIER_POINTER_BYTES = 4  # 32-bit CSR/CSC pointer per token, for K and for V


def per_side_outliers(fraction: float, channels: int) -> int:
    """Outliers per side of a per-token vector: floor(fraction/2 * C) + 1 (0 when fraction is 0)."""
    return 0 if fraction <= 0 else int(fraction / 2 * channels) + 1


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H*D] (one row per token, channels in projection order)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def key_round_trip(x: torch.Tensor, tables: dict, method: KVQuant, exact: bool, capacity: int) -> torch.Tensor:
    """Keys x [N, H, D] quantized and read back with the packed quantizers of kvcal/quant/nonuniform.py: per channel
    with the calibrated ranges (outliers: out-of-range elements, their residuals exact, or as a cache stores them,
    fp16 and at most `capacity` per token and head), or per token (the key_granularity ablation)."""
    bits, dtype = method.bits, torch.float64 if exact else torch.float16
    n, h, d = x.shape
    if method.key_granularity == "per_token":
        per_side = per_side_outliers(method.outliers, h * d)
        codes, s, z, idx, val = quantize_lut_dynamic(x, tables["k_encode"], tables["k_decode"], bits, per_side,
                                                     residual_dtype=dtype)
        return dequantize_lut_dynamic(codes, s, z, tables["k_decode"], bits, d, idx, val)
    capacity = (d if exact else capacity) if method.outliers else 0
    codes, idx, val = quantize_lut_static(x, tables["k_lo"], tables["k_hi"], tables["k_encode"], tables["k_decode"],
                                          bits, capacity, dtype)
    zero, scale = range_params(tables["k_lo"], tables["k_hi"])
    return dequantize_lut_static(codes, zero, scale, tables["k_decode"], bits, d, idx, val)


def value_round_trip(x: torch.Tensor, tables: dict, method: KVQuant, per_side: int, exact: bool) -> torch.Tensor:
    """Values x [N, H, D] quantized per token (or per token and head) and read back, residuals exact or fp16."""
    per_head = method.value_scope == "head"
    codes, s, z, idx, val = quantize_lut_dynamic(x, tables["v_encode"], tables["v_decode"], method.bits, per_side,
                                                 per_head, torch.float64 if exact else torch.float16)
    return dequantize_lut_dynamic(codes, s, z, tables["v_decode"], method.bits, x.shape[-1], idx, val)


class KVQuantStorage(Storage):
    """Keys before RoPE (rotated at attention time) per channel with the calibrated ranges: codes [B, Hkv, T, W] and
    `capacity` outlier slots per token and KV head, [B, T, Hkv, capacity] (int16 channel over all heads, -1 empty;
    fp16 residual). Values per token: codes [B, Hkv, T, W], fp16 scale and zero [B, T] ([B, Hkv, T] per head), 2
    per_side outlier slots per vector [B, T, 2 per_side] ([B, T, Hkv, 2 per_side]). The first `sink` tokens stay in
    full precision. Tables and ranges are per layer (the storage's own tensors)."""

    keys_pre_rope = True

    def __init__(self, bits: int, tables: dict, capacity: int, value_per_side: int, per_head: bool, sink: int,
                 fp_window: int = 0):
        self.bits, self.capacity, self.value_per_side, self.per_head = bits, capacity, value_per_side, per_head
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
        from kvcal.quant.nonuniform_kernels import (
            quantize_lut_dynamic_into_triton,
            quantize_lut_static_into_triton,
        )

        self._write(packed, keys, values, rows, slots, quantize_lut_static_into_triton,
                    quantize_lut_dynamic_into_triton)

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        n, d, buf = int(packed.lengths[row]), packed.dim, packed.buffers

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

    def supports_triton(self, q, packed):
        from kvcal.methods.kvquant.method import kernels as kvquant_kernels

        return kvquant_kernels.unsupported(q, self.bits)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        from kvcal.methods.kvquant.method import kernels as kvquant_kernels

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


class KVQuantCodec(Codec):
    def __init__(self, method: KVQuant, tensors: dict[str, torch.Tensor], dims):
        self.method = method
        self.head_dim = dims.head_dim
        self.keys_pre_rope = method.pre_rope
        self.policy = FlushPolicy(sink=method.sink, residual=method.fp_window)
        self.value_per_side = method.value_per_side(dims)
        self.tables = []
        for i in range(dims.num_layers):
            layer = {}
            for kind in ("k", "v"):
                for name in ("encode", "decode", "lo", "hi"):
                    key = f"layers.{i}.{kind}.{name}"
                    if key in tensors:
                        layer[f"{kind}_{name}"] = tensors[key].to(torch.float32)
            self.tables.append(layer)
        self.storages: dict[int, KVQuantStorage] = {}

    def _on(self, layer: int, device) -> dict:
        t = self.tables[layer]
        if next(iter(t.values())).device != torch.device(device):
            t = self.tables[layer] = {k: x.to(device) for k, x in t.items()}
        return t

    def key_capacity(self) -> int:
        """Key outlier slots per token and KV head in the packed runtime (KVQuant.key_capacity)."""
        return self.method.key_capacity(self.head_dim)

    def storage_refusal(self) -> str:
        return "the packed runtime runs KVQuant with pre-RoPE per-channel keys only"

    def storage(self, layer: int) -> KVQuantStorage | None:
        if not self.method.packs():
            return None
        if layer not in self.storages:
            self.storages[layer] = KVQuantStorage(self.method.bits, self.tables[layer], self.key_capacity(),
                                                  self.value_per_side, self.method.value_scope == "head",
                                                  self.method.sink, self.method.fp_window)
        return self.storages[layer]

    def reconstruct(self, layer, k, v):
        """exact_outliers (the paper's simulation, digest #7): the same quantizers as the packed storage, with every
        outlier kept and its residual exact; false: the storage itself (fp16 residuals, key_outlier_capacity slots
        per token and head), what decode mode gives."""
        t = self._on(layer, k.device)
        exact = self.method.exact_outliers
        b, h, n, d = k.shape
        k_hat = key_round_trip(k.transpose(1, 2).reshape(-1, h, d), t, self.method, exact, self.key_capacity())
        v_hat = value_round_trip(v.transpose(1, 2).reshape(-1, h, d), t, self.method, self.value_per_side, exact)
        return (k_hat.reshape(b, n, h, d).transpose(1, 2).to(k.dtype),
                v_hat.reshape(b, n, h, d).transpose(1, 2).to(v.dtype))


@register
@dataclass
class KVQuant(Method):
    """nuqX datatypes by Fisher-weighted k-means, pre-RoPE per-channel keys, dense-and-sparse outliers."""

    name = "kvquant"
    summary = "Fisher-weighted non-uniform datatypes, pre-RoPE per-channel keys, 1% outliers"
    learns = True
    captures = ("k", "v", "fisher")
    runtime_fields = ("key_outlier_capacity", "exact_outliers", "fp_window")
    fp_window_field = "fp_window"
    # the contract compares decoding with the simulation of what the cache stores (exact_outliers=false)
    test_config = {"bits": 3, "outliers": 0.05, "exact_outliers": False}
    tensor_kinds = {f"{side}.{name}": "datatype" for side in "kv" for name in ("encode", "decode")} | {
        "k.lo": "range", "k.hi": "range"}

    bits: int = 4
    outliers: float = 0.01  # fraction of each vector kept exact (half at each tail); 0 = dense only
    sink: int = 1  # first tokens kept in fp16 and left out of calibration
    fp_window: int = 0  # newest tokens kept in fp16 besides the sinks (the comparison's full-precision allowance)
    weighting: str = "fisher_scale"  # k-means weights: F*s^2 (NeurIPS App. E), F (seed paper, code), none
    datatype: str = "nuq"  # nuq: k-means levels; int: uniform levels (the ablation baseline)
    qnorm: bool | None = None  # None: on at 2 bits only, as in the seed paper
    key_granularity: str = "per_channel"  # per_channel (offline ranges) or per_token (online, ablation)
    # value ranges and outliers per token over all KV heads (paper, code) or per (token, KV head): digest #3's
    # option, ranges that follow each head for three times the scales and outliers on smollm2 (+0.5 bits per
    # element: 0.17 for the scales, 0.33 for 1 + 1 outliers per head instead of per token)
    value_scope: str = "token"
    pre_rope: bool = True  # quantize keys before RoPE
    kmeans_inits: int = 3
    kmeans_iters: int = 100
    seed: int = 0
    # Packed runtime: key outlier slots per token and KV head. 0 = twice the nominal count,
    # ceil(2 x outliers x head_dim) (2 per head on smollm2, 3 on Llama-3.1-8B). Counts vary per token
    # (smollm2 at 1%, evaluation windows: mean 2.7 of 192 channels per token); overflow keeps the head's
    # largest residuals and clamps the rest. Runtime-only: `--set key_outlier_capacity=N` works on an artifact.
    key_outlier_capacity: int = 0
    # Simulation: outliers read back exactly (digest #7, the paper's PPL) or, with false, as the packed
    # runtime stores them (fp16 residual over the dense code, at most key_outlier_capacity key outliers per
    # token and head): decode-mode parity compares against that, and the two simulations give the storage's cost.
    exact_outliers: bool = True

    def validate(self):
        if self.bits not in (2, 3, 4):
            raise KvcalError(f"kvquant bits must be 2, 3 or 4, got {self.bits}")
        if not 0 <= self.outliers < 0.5:
            raise KvcalError(f"kvquant outliers is a fraction in [0, 0.5), got {self.outliers}")
        if self.sink < 0 or self.fp_window < 0:
            raise KvcalError("kvquant sink and fp_window must be >= 0")
        for key, value, allowed in (("weighting", self.weighting, WEIGHTINGS), ("datatype", self.datatype, DATATYPES),
                                    ("key_granularity", self.key_granularity, GRANULARITIES),
                                    ("value_scope", self.value_scope, VALUE_SCOPES)):
            if value not in allowed:
                raise KvcalError(f"kvquant {key} must be one of {', '.join(allowed)}, got '{value}'")
        if self.key_outlier_capacity < 0:
            raise KvcalError("kvquant key_outlier_capacity must be >= 0 (0: automatic)")
        if self.kmeans_inits < 1 or self.kmeans_iters < 1:
            raise KvcalError("kvquant kmeans_inits and kmeans_iters must be >= 1")

    def key_capacity(self, head_dim: int) -> int:
        """Key outlier slots per token and KV head in the packed runtime. Key outliers vary per token: the
        runtime keeps a fixed capacity, by default twice the nominal rate (overflow keeps the largest
        residuals, the rest clamp to the extreme level). Per head, so that the decode kernel's program for
        one KV head reads only its own slots."""
        if not self.outliers:
            return 0
        capacity = self.key_outlier_capacity or math.ceil(2 * self.outliers * head_dim)
        return min(capacity, head_dim)  # more slots than channels can never be used

    def packs(self) -> bool:
        """Whether the packed runtime holds this setting (pre-RoPE per-channel keys)."""
        return self.key_granularity == "per_channel" and self.pre_rope

    def value_per_side(self, dims) -> int:
        """Value outliers per side of each value vector (the token's C channels, or one head's)."""
        return per_side_outliers(self.outliers, dims.head_dim if self.value_scope == "head" else dims.kv_channels)

    @property
    def use_qnorm(self) -> bool:
        return self.bits == 2 if self.qnorm is None else self.qnorm

    def capture_needs(self) -> set[str]:
        fisher = self.datatype == "nuq" and self.weighting != "none"
        return {"k", "v"} | ({"fisher"} if fisher else set())

    def tag(self) -> str:
        name = f"{self.datatype}{self.bits}"
        if self.outliers:
            name += f"-{self.outliers * 100:g}pct"
        if self.value_scope == "head":
            name += "-vhead"
        # every other setting that differs from its default, so that two --set runs never share a file name
        named = {"bits", "outliers", "value_scope", "datatype", *self.runtime_fields}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            same = value == f.default
            if f.name == "qnorm":  # None means "on at 2 bits": an explicit value that does the same adds nothing
                same = self.use_qnorm == (self.bits == 2)
            elif f.name == "weighting" and self.datatype == "int":  # uniform levels: no k-means to weight
                same = True
            if f.name not in named and not same:
                name += f"-{f.name}{str(value).lower()}"
        return name

    # ---- calibration -------------------------------------------------------------------------------
    def calibrate(self, loaded, store):
        from kvcal.progress import progress_bar

        if self.datatype == "nuq" and self.weighting != "none" and not self.pre_rope:
            raise KvcalError("kvquant: Fisher weights are taken before RoPE; use pre_rope=true or weighting=none")
        dims = loaded.dims
        per_side = per_side_outliers(self.outliers, dims.kv_channels)
        positions = store.token_positions
        keep_rows = positions >= self.sink  # the sink tokens never enter calibration
        if int(keep_rows.sum()) < 2:
            raise KvcalError(f"kvquant sink={self.sink} leaves {int(keep_rows.sum())} calibration tokens in total: use a "
                             "longer --seqlen")
        tensors, info = {}, {"key_outlier_rate": [], "fisher_err_k": [], "fisher_err_v": []}
        with progress_bar("kvquant: fitting datatypes", dims.num_layers) as advance:
            for i in range(dims.num_layers):
                device = loaded.layer_device(i)  # each layer's fit runs where that layer is
                with device_scope(device):
                    self._fit_layer(i, store, device, keep_rows, positions, loaded, per_side, tensors, info)
                advance()
        return tensors, info

    def _fit_layer(self, i, store, device, keep_rows, positions, loaded, per_side, tensors, info) -> None:
        """Layer i's tables (on `device`) into `tensors` (on the CPU) and its numbers into `info`."""
        dims = loaded.dims
        data = {name: t.to(device) for name, t in store.layer(i).items()}
        k = data["k"]
        if not self.pre_rope:
            k = rotate_rows(k, positions.to(device), loaded.adapter.inv_freq_on(device), dims)
        k, v = k[keep_rows], data["v"][keep_rows]
        fk = data["fisher_k"][keep_rows] if "fisher_k" in data else None
        fv = data["fisher_v"][keep_rows] if "fisher_v" in data else None
        key_tables, k_rate, k_err = self._fit_keys(k, fk, per_side)
        if self.value_scope == "head":  # each (token, head) is a vector of its own
            v, fv = (None if x is None else x.reshape(-1, dims.head_dim) for x in (v, fv))
        value_tables, _, v_err = self._fit_dynamic(v, fv, self.value_per_side(dims))
        for name, t in {**key_tables, **{f"v.{n}": t for n, t in value_tables.items()}}.items():
            tensors[f"layers.{i}.{name}"] = t.cpu()
        info["key_outlier_rate"].append(round(k_rate, 5))
        info["fisher_err_k"].append(k_err)
        info["fisher_err_v"].append(v_err)

    def _fit_keys(self, k, fisher, per_side):
        if self.key_granularity == "per_token":
            tables, rate, err = self._fit_dynamic(k, fisher, per_side)
            return {f"k.{n}": t for n, t in tables.items()}, rate, err
        tail = self.outliers / 2
        lo = quantile(k, tail, dim=0) if self.outliers else k.amin(0)
        hi = quantile(k, 1 - tail, dim=0) if self.outliers else k.amax(0)
        zero, scale = range_params(lo, hi)
        xn = (k - zero) / scale
        inside = xn.abs() <= 1
        weights = self._weights(fisher, scale.expand_as(k))
        encode, decode = self._datatype(xn[inside], None if weights is None else weights[inside])
        tables = {"k.lo": lo, "k.hi": hi, "k.encode": encode, "k.decode": decode}
        k_hat = key_round_trip(k[:, None], {f"k_{n}": t for n, t in (("lo", lo), ("hi", hi), ("encode", encode),
                                                                      ("decode", decode))},
                               self, True, 0)[:, 0]
        return tables, float((~inside).float().mean()), self._fisher_err(fisher, k, k_hat)

    def _fit_dynamic(self, x, fisher, per_side):
        lo, hi, outlier = outlier_bounds(x, per_side, dim=-1)
        zero, scale = range_params(lo, hi)
        xn = (x - zero) / scale
        inside = ~outlier
        weights = self._weights(fisher, scale.expand_as(x))
        encode, decode = self._datatype(xn[inside], None if weights is None else weights[inside])
        codes, s, z, idx, val = quantize_lut_dynamic(x[:, None], encode, decode, self.bits, per_side,
                                                     residual_dtype=torch.float64)
        x_hat = dequantize_lut_dynamic(codes, s, z, decode, self.bits, x.shape[-1], idx, val)[:, 0]
        return {"encode": encode, "decode": decode}, float(outlier.float().mean()), self._fisher_err(fisher, x, x_hat)

    def _weights(self, fisher, scale):
        if self.weighting == "none" or self.datatype != "nuq":
            return None
        if fisher is None:
            raise KvcalError("kvquant: Fisher information was not captured")
        return fisher * scale**2 if self.weighting == "fisher_scale" else fisher

    def _datatype(self, values: torch.Tensor, weights: torch.Tensor | None):
        """(encode, decode) tables [2^bits]: sorted levels, and the Q-Norm-corrected copy."""
        levels = 1 << self.bits
        if self.datatype == "int":
            encode = torch.linspace(-1, 1, levels, device=values.device)
        else:
            encode = weighted_kmeans(values, levels, weights, seed=self.seed, n_init=self.kmeans_inits,
                                     max_iter=self.kmeans_iters).centers[:, 0]
        decode = encode.clone()
        if self.use_qnorm:
            # Match mean and std of the rounded values to the originals (per-matrix, unweighted, [S] eq. 3).
            rounded = encode[nearest_level(values.clamp(-1, 1), encode)]
            a = values.std() / rounded.std().clamp_min(1e-12)
            decode = (encode - rounded.mean()) * a + values.mean()
        return encode, decode

    @staticmethod
    def _fisher_err(fisher, x, x_hat) -> float:
        """Sum of F * (x - Q(x))^2 over the calibration elements (per-layer sensitivity, for diagnostics)."""
        if fisher is None:
            return float(((x - x_hat) ** 2).sum())
        return float((fisher * (x - x_hat) ** 2).sum())

    # ---- runtime -------------------------------------------------------------------------------------
    def build_codec(self, tensors, dims) -> Codec:
        expected = {f"layers.{i}.{kind}.{name}" for i in range(dims.num_layers) for kind in "kv"
                    for name in ("encode", "decode")}
        missing = expected - set(tensors)
        if missing:
            raise KvcalError(f"kvquant artifact is missing {len(missing)} tables (e.g. {sorted(missing)[0]})")
        levels, channels = 1 << self.bits, dims.kv_channels
        for name, t in tensors.items():
            want = (levels,) if name.endswith(("encode", "decode")) else (channels,) if name.endswith(("lo", "hi")) else None
            if want and tuple(t.shape) != want:
                raise KvcalError(f"kvquant table {name} has shape {list(t.shape)}, expected {list(want)} "
                                 f"({self.bits} bits, {channels} channels)")
        return KVQuantCodec(self, tensors, dims)

    def synthetic_tensors(self, dims, seed: int = 0):
        """Random sorted tables in [-1, 1] and key ranges of about unit width per layer (speed benchmarks)."""
        gen = torch.Generator().manual_seed(seed)
        levels, channels = 1 << self.bits, dims.kv_channels
        tensors = {}
        for i in range(dims.num_layers):
            for kind in "kv":
                table = torch.sort(torch.rand(levels, generator=gen) * 2 - 1).values
                tensors[f"layers.{i}.{kind}.encode"] = table
                tensors[f"layers.{i}.{kind}.decode"] = table.clone()
            zero = torch.randn(channels, generator=gen) * 0.1
            half = torch.rand(channels, generator=gen) + 0.5
            tensors[f"layers.{i}.k.lo"], tensors[f"layers.{i}.k.hi"] = zero - half, zero + half
        return tensors

    def footprint(self, dims, tokens):
        """Bytes of the cache. A setting the packed runtime holds: what its storage holds (codes in int32 words per
        KV head, key_capacity outlier slots per token and KV head, value scales and outlier slots), the sinks and the
        window in fp16. The ablations without a packed storage: the paper's accounting (nominal outlier rate, CSR
        pointers)."""
        if self.packs():
            return self._packed_footprint(dims, tokens)
        channels, layers = dims.kv_channels, dims.num_layers
        sinks = min(self.sink, tokens)
        quantized = FlushPolicy(sink=self.sink, residual=self.fp_window).compressed_count(tokens)
        stored = quantized * layers  # tokens x layers held as codes
        per_side = per_side_outliers(self.outliers, channels)
        value_vectors = dims.num_kv_heads if self.value_scope == "head" else 1  # (scale, zero) pairs per token
        dynamic = value_vectors + (self.key_granularity == "per_token")  # ... and one for K if per token
        key_outliers = 2 * per_side if self.key_granularity == "per_token" else self.outliers * channels
        value_outliers = 2 * self.value_per_side(dims) * value_vectors
        parts = {
            "codes": 2 * stored * channels * self.bits / 8,
            "scales_zeros": dynamic * stored * 2 * FP16_BYTES,
        }
        if self.outliers:
            parts["outliers"] = (key_outliers + value_outliers) * stored * OUTLIER_ENTRY_BYTES
            parts["outlier_pointers"] = 2 * stored * OUTLIER_POINTER_BYTES
        parts["fp16_sinks"] = fp16_token_bytes(dims, sinks)
        if tokens - sinks - quantized:
            parts["fp16_window"] = fp16_token_bytes(dims, tokens - sinks - quantized)
        return parts

    def _packed_footprint(self, dims, tokens):
        heads, layers = dims.num_kv_heads, dims.num_layers
        sinks = min(self.sink, tokens)
        quantized = FlushPolicy(sink=self.sink, residual=self.fp_window).compressed_count(tokens)
        stored = quantized * layers
        value_vectors = heads if self.value_scope == "head" else 1
        slots = heads * self.key_capacity(dims.head_dim) + value_vectors * 2 * self.value_per_side(dims)
        parts = {
            "codes": 2 * stored * heads * words_per_vector(dims.head_dim, self.bits) * 4,
            "scales_zeros": stored * value_vectors * 2 * FP16_BYTES,
        }
        if slots:
            parts["outliers"] = stored * slots * OUTLIER_ENTRY_BYTES
        parts["fp16_sinks"] = fp16_token_bytes(dims, sinks)
        if tokens - sinks - quantized:
            parts["fp16_window"] = fp16_token_bytes(dims, tokens - sinks - quantized)
        return parts


def rotate_rows(rows: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, dims) -> torch.Tensor:
    """Apply RoPE to token rows [N, C] at their positions [N] (for the post-RoPE ablation)."""
    cos, sin = rope_cos_sin(inv_freq, positions[None], torch.float32)
    x = rows.view(1, -1, dims.num_kv_heads, dims.head_dim).transpose(1, 2)
    return to_rows(apply_rope(x, cos, sin))[0]
