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
from kvcal.quant.kmeans import weighted_kmeans
from kvcal.quant.nonuniform import largest_residuals, nearest_level, outlier_bounds, quantile, range_params
from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.runtime.formats import KeyFormat, ValueFormat

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


def from_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, c = rows.shape
    return rows.reshape(b, t, heads, c // heads).transpose(1, 2)


def lookup(xn: torch.Tensor, encode: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """Nearest level of the encode table (on values clamped to [-1, 1]), read back from the decode table."""
    return decode[nearest_level(xn.clamp(-1, 1), encode)]


def restore_outliers(x, dense, outliers, exact: bool) -> torch.Tensor:
    """Outlier elements read back: exactly x (the digest's decision #7 for fake quantization), or, with
    exact=False, what the packed runtime stores: the dense value plus the residual rounded to fp16."""
    sparse = x if exact else dense + (x - dense).half().float()
    return torch.where(outliers, sparse, dense)


def quantize_static(rows, lo, hi, encode, decode, sparse: bool, exact: bool = True,
                    capacity: int | None = None, head_dim: int | None = None) -> torch.Tensor:
    """Per-channel quantization with calibrated ranges [C]. Elements outside the range are outliers
    (kept, see restore_outliers) when `sparse`, else clamped to the extreme levels. With `capacity`, only
    that many outliers per head of `head_dim` channels of a row are kept (the largest residuals), as in
    the packed runtime (whose slots are per token and KV head)."""
    x = rows.to(torch.float32)
    zero, scale = range_params(lo, hi)
    out = lookup((x - zero) / scale, encode, decode) * scale + zero
    if sparse:
        outliers = (x > hi) | (x < lo)
        if capacity is not None:  # the runtime's overflow rule: the largest residuals stay, the rest clamp
            hd = head_dim or x.shape[-1]
            heads = (*x.shape[:-1], x.shape[-1] // hd, hd)
            top, valid = largest_residuals((x - out).reshape(heads), outliers.reshape(heads), capacity)
            outliers = torch.zeros(heads, dtype=torch.bool, device=x.device).scatter_(-1, top, valid).reshape(x.shape)
        out = restore_outliers(x, out, outliers, exact)
    return out.to(rows.dtype)


def quantize_dynamic(rows, encode, decode, per_side: int, exact: bool = True) -> torch.Tensor:
    """Per-token quantization: each row's range comes from its own values after setting aside its
    `per_side` largest and smallest elements as outliers. Scale and zero are stored in fp16."""
    x = rows.to(torch.float32)
    lo, hi, outliers = outlier_bounds(x, per_side, dim=-1)
    zero, scale = range_params(lo, hi, torch.float16)
    out = lookup((x - zero) / scale, encode, decode) * scale + zero
    return restore_outliers(x, out, outliers, exact).to(rows.dtype)


class KVQuantCodec(Codec):
    def __init__(self, method: KVQuant, tensors: dict[str, torch.Tensor], dims):
        self.method = method
        self.heads = dims.num_kv_heads
        self.head_dim = dims.head_dim
        self.keys_pre_rope = method.pre_rope
        self.policy = FlushPolicy(sink=method.sink)
        self.per_side = per_side_outliers(method.outliers, dims.kv_channels)
        self.value_per_head = method.value_scope == "head"
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
        self._device = None

    def _on(self, device):
        if self._device != device:
            self.tables = [{k: t.to(device) for k, t in layer.items()} for layer in self.tables]
            self._device = device
        return self.tables

    def quantize_keys(self, layer, k):
        t = self._on(k.device)[layer]
        rows = to_rows(k)
        if self.method.key_granularity == "per_channel":
            # runtime-storage mode (exact_outliers=false) also keeps the runtime's slots per token
            capacity = None if self.method.exact_outliers else self.key_capacity()
            out = quantize_static(rows, t["k_lo"], t["k_hi"], t["k_encode"], t["k_decode"], self.per_side > 0,
                                  self.method.exact_outliers, capacity, self.head_dim)
        else:
            out = quantize_dynamic(rows, t["k_encode"], t["k_decode"], self.per_side, self.method.exact_outliers)
        return from_rows(out, self.heads)

    def quantize_values(self, layer, v):
        t = self._on(v.device)[layer]
        rows = to_rows(v)
        if self.value_per_head:  # one vector per (token, head)
            rows = rows.unflatten(-1, (self.heads, self.head_dim))
        values = quantize_dynamic(rows, t["v_encode"], t["v_decode"], self.value_per_side, self.method.exact_outliers)
        return from_rows(values.flatten(-2) if self.value_per_head else values, self.heads)

    def key_capacity(self) -> int:
        """Key outlier slots per token and KV head in the packed runtime. Key outliers vary per token: the
        runtime keeps a fixed capacity, by default twice the nominal rate (overflow keeps the largest
        residuals, the rest clamp to the extreme level). Per head, so that the decode kernel's program for
        one KV head reads only its own slots."""
        if not self.method.outliers:
            return 0
        capacity = self.method.key_outlier_capacity or math.ceil(2 * self.method.outliers * self.head_dim)
        return min(capacity, self.head_dim)  # more slots than channels can never be used

    def runtime_formats(self, layer):
        if self.method.key_granularity != "per_channel" or not self.method.pre_rope:
            raise KvcalError("the packed runtime runs KVQuant with pre-RoPE per-channel keys only")
        t = self.tables[layer]
        keys = KeyFormat("lut_static", self.method.bits, lo=t["k_lo"], hi=t["k_hi"], encode=t["k_encode"],
                         decode=t["k_decode"], capacity=self.key_capacity())
        values = ValueFormat("lut_dynamic", self.method.bits, encode=t["v_encode"], decode=t["v_decode"],
                             per_side=self.value_per_side, per_head=self.value_per_head)
        return keys, values


@register
@dataclass
class KVQuant(Method):
    """nuqX datatypes by Fisher-weighted k-means, pre-RoPE per-channel keys, dense-and-sparse outliers."""

    name = "kvquant"
    summary = "Fisher-weighted non-uniform datatypes, pre-RoPE per-channel keys, 1% outliers"
    learns = True
    captures = ("k", "v", "fisher")
    runtime_fields = ("key_outlier_capacity", "exact_outliers")

    bits: int = 4
    outliers: float = 0.01  # fraction of each vector kept exact (half at each tail); 0 = dense only
    sink: int = 1  # first tokens kept in fp16 and left out of calibration
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
        if self.sink < 0:
            raise KvcalError("kvquant sink must be >= 0")
        for key, value, allowed in (("weighting", self.weighting, WEIGHTINGS), ("datatype", self.datatype, DATATYPES),
                                    ("key_granularity", self.key_granularity, GRANULARITIES),
                                    ("value_scope", self.value_scope, VALUE_SCOPES)):
            if value not in allowed:
                raise KvcalError(f"kvquant {key} must be one of {', '.join(allowed)}, got '{value}'")
        if self.key_outlier_capacity < 0:
            raise KvcalError("kvquant key_outlier_capacity must be >= 0 (0: automatic)")
        if self.kmeans_inits < 1 or self.kmeans_iters < 1:
            raise KvcalError("kvquant kmeans_inits and kmeans_iters must be >= 1")

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
        device = loaded.device
        tensors, info = {}, {"key_outlier_rate": [], "fisher_err_k": [], "fisher_err_v": []}
        with progress_bar("kvquant: fitting datatypes", dims.num_layers) as advance:
            for i in range(dims.num_layers):
                data = {name: t.to(device) for name, t in store.layer(i).items()}
                k = data["k"]
                if not self.pre_rope:
                    k = rotate_rows(k, positions.to(device), loaded.adapter.inv_freq, dims)
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
                advance()
        return tensors, info

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
        err = self._fisher_err(fisher, k, quantize_static(k, lo, hi, encode, decode, self.outliers > 0))
        return tables, float((~inside).float().mean()), err

    def _fit_dynamic(self, x, fisher, per_side):
        lo, hi, outlier = outlier_bounds(x, per_side, dim=-1)
        zero, scale = range_params(lo, hi)
        xn = (x - zero) / scale
        inside = ~outlier
        weights = self._weights(fisher, scale.expand_as(x))
        encode, decode = self._datatype(xn[inside], None if weights is None else weights[inside])
        err = self._fisher_err(fisher, x, quantize_dynamic(x, encode, decode, per_side))
        return {"encode": encode, "decode": decode}, float(outlier.float().mean()), err

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

    def footprint(self, dims, tokens):
        channels, layers = dims.kv_channels, dims.num_layers
        sinks = min(self.sink, tokens)
        stored = (tokens - sinks) * layers  # tokens x layers held as codes
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
        return parts


def rotate_rows(rows: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, dims) -> torch.Tensor:
    """Apply RoPE to token rows [N, C] at their positions [N] (for the post-RoPE ablation)."""
    cos, sin = rope_cos_sin(inv_freq, positions[None], torch.float32)
    x = rows.view(1, -1, dims.num_kv_heads, dims.head_dim).transpose(1, 2)
    return to_rows(apply_rope(x, cos, sin))[0]
