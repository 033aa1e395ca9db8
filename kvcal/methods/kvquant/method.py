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
from kvcal.methods.base import FlushPolicy, Method, Storages
from kvcal.methods.kvquant.calibrate import fit_tables
from kvcal.methods.kvquant.storage import (
    KVQuantReconstruction,
    KVQuantStorage,
    RoundTrip,
    layer_tables,
    per_side_outliers,
)
from kvcal.methods.registry import register
from kvcal.quant.packing import words_per_vector

WEIGHTINGS = ("fisher_scale", "fisher", "none")
DATATYPES = ("nuq", "int")
GRANULARITIES = ("per_channel", "per_token")
VALUE_SCOPES = ("token", "head")
OUTLIER_ENTRY_BYTES = 4  # fp16 value + 16-bit index within the vector
OUTLIER_POINTER_BYTES = 4  # 32-bit CSR/CSC pointer per token, for K and for V


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
    test_ablations = {"post-rope-keys": {"pre_rope": False, "weighting": "none"}, "per-token-keys": {"key_granularity": "per_token"},
                      "per-head-values": {"value_scope": "head"}}
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
        if self.datatype == "nuq" and self.weighting != "none" and not self.pre_rope:
            raise KvcalError("kvquant: Fisher weights are taken before RoPE; use pre_rope=true or weighting=none")
        dims = loaded.dims
        return fit_tables(loaded, store, bits=self.bits, outliers=self.outliers, sink=self.sink,
                          weighting=self.weighting, datatype=self.datatype, use_qnorm=self.use_qnorm,
                          key_granularity=self.key_granularity, value_scope=self.value_scope, pre_rope=self.pre_rope,
                          key_per_side=per_side_outliers(self.outliers, dims.kv_channels),
                          value_per_side=self.value_per_side(dims), kmeans_inits=self.kmeans_inits,
                          kmeans_iters=self.kmeans_iters, seed=self.seed)

    # ---- runtime -------------------------------------------------------------------------------------
    def build_storages(self, tensors, dims) -> Storages:
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
        capacity, per_head = self.key_capacity(dims.head_dim), self.value_scope == "head"
        tables = layer_tables(tensors, dims.num_layers)
        if not self.packs():  # post-RoPE or per-token keys: an ablation the packed storage does not hold
            how = RoundTrip(self.bits, self.key_granularity, self.outliers, self.exact_outliers, capacity,
                            self.value_per_side(dims), per_head)
            return Storages(KVQuantReconstruction(t, how, self.pre_rope, self.sink, self.fp_window) for t in tables)
        return Storages(KVQuantStorage(self.bits, t, capacity, self.value_per_side(dims), per_head, self.sink,
                                       self.fp_window, self.exact_outliers, self.outliers) for t in tables)

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
