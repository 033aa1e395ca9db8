"""SKVQ: Sliding-window Key and Value Cache Quantization (Duanmu et al. 2024, arXiv 2405.06219).

What calibration learns, per layer and separately for K and V (digest: papers/skvq.md):
- a channel permutation and variable-size groups: k-means over each channel's (min, max) on the
  calibration tokens puts channels with similar ranges in one quantization group (§2.1);
- clip ratios alpha: at runtime each group's min and max are multiplied by alpha before the scale and
  zero point are computed; alpha is searched on a grid to minimise the MSE of the attention output
  after o_proj on calibration data (§2.2).

What the cache stores per token: the [Hkv*D] channel vector of each token (keys before RoPE), read in
permuted order and quantized group by group (asymmetric, per token, clipped min/max, scale and zero in
fp16 or fp8 e4m3, 1.5 bits = ternary), except the first `sink` tokens and the `window` most recent
ones, which stay fp16; tokens leave the window one at a time (FlushPolicy(sink, window, 1)).

Where the paper and the official code disagree we follow the digest's recommendations (section 7,
cited as rec #N below); every such place says which source it follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcal.accounting import fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import Codec, FlushPolicy, Method
from kvcal.methods.registry import register
from kvcal.models.devmap import device_scope
from kvcal.quant.kmeans import weighted_kmeans
from kvcal.quant.packing import (
    bytes_per_trit_vector,
    pack_codes,
    pack_trits,
    unpack_codes,
    unpack_trits,
    words_per_vector,
)
from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.quant.uniform import dequantize, minmax_params, quantize, round_params
from kvcal.runtime.storage import BufferSpec, Packed, Storage

SUPPORTED_BITS = (1.5, 2.0, 3.0, 4.0, 8.0)
CLIP_MODES = ("none", "global", "layer", "group")
PARAM_DTYPES = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}
PARAM_BYTES = {"fp16": 2, "fp8": 1}
TERNARY_STORAGE = ("base3", "2bit")
CLIP_STEP = 0.01
SCALE_FLOOR = 1e-5  # [code]: scale = max((M - m) / qmax, 1e-5)
FP8_MIN_SCALE = 2.0**-9  # smallest e4m3 subnormal: a smaller scale would round to 0 (rec #10)
KMEANS_N_INIT = 10  # [code]: sklearn KMeans(n_init=10)


def clip_grid(lowest: float) -> tuple[float, ...]:
    """alpha in {1.00, 0.99, ..., lowest} (rec #8 with lowest = 0.80; the paper gives no grid). Descending,
    so that on a tie the search keeps the weaker clip."""
    return tuple(round(1.0 - CLIP_STEP * i, 2) for i in range(round((1.0 - lowest) / CLIP_STEP) + 1))


CLIP_GRID = clip_grid(0.8)


def levels_for(bits: float) -> int:
    """Number of code levels: 2**bits, and 3 for "1.5-bit" (ternary, q_max = 2, as the [code] does)."""
    return 3 if bits == 1.5 else 1 << int(bits)


def code_bytes_per_token(heads: int, head_dim: int, bits: float, ternary_storage: str) -> int:
    """Bytes of one token's codes for one tensor as the storage holds them: per KV head, base-3 bytes (1.5 bits,
    base3) or int32 words of 2-bit slots (the [code] stores ternary codes in 2-bit slots) or of `bits`-bit codes."""
    if bits == 1.5 and ternary_storage == "base3":
        return heads * bytes_per_trit_vector(head_dim)
    slot_bits = 2 if bits == 1.5 else int(bits)
    return heads * words_per_vector(head_dim, slot_bits) * 4


class GroupLayout:
    """A channel permutation and contiguous groups over the permuted axis.

    `perm[p]` is the original channel (head * head_dim + d) stored at permuted position p; group g covers
    permuted positions [offsets[g], offsets[g+1]). Groups may differ in size (they are k-means clusters).
    """

    def __init__(self, perm: torch.Tensor, offsets: torch.Tensor, where: str = "layout"):
        perm, offsets = perm.to(torch.int64), offsets.to(torch.int64)
        channels = perm.numel()
        if perm.dim() != 1 or not torch.equal(torch.sort(perm).values, torch.arange(channels)):
            raise KvcalError(f"{where}: perm is not a permutation of the {channels} channels")
        sizes = offsets.diff()
        if offsets.dim() != 1 or offsets.numel() < 2 or offsets[0] != 0 or offsets[-1] != channels or (sizes <= 0).any():
            raise KvcalError(f"{where}: group_offsets must rise strictly from 0 to {channels}, got {offsets.tolist()}")
        self.perm, self.offsets = perm, offsets
        self.inverse = torch.argsort(perm)
        self.group_of_position = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
        # [n_groups, largest group] permuted positions, short groups padded by repeating their last
        # position: one gather then gives every group's min and max (a repeat changes neither).
        ends = offsets[1:, None] - 1
        self.padded = torch.minimum(offsets[:-1, None] + torch.arange(int(sizes.max()))[None, :], ends)

    @property
    def channels(self) -> int:
        return self.perm.numel()

    @property
    def num_groups(self) -> int:
        return self.offsets.numel() - 1

    @property
    def sizes(self) -> list[int]:
        return self.offsets.diff().tolist()

    @classmethod
    def contiguous(cls, channels: int, group_size: int) -> GroupLayout:
        """No reorder: consecutive channels form groups (what RTN with channel groups does)."""
        return cls(torch.arange(channels), torch.arange(0, channels + 1, group_size))

    @classmethod
    def from_clusters(cls, labels: torch.Tensor, centers: torch.Tensor) -> GroupLayout:
        """Groups = clusters. The [code] orders clusters by their arbitrary k-means label and argsorts
        unstably; we order clusters by centroid range (max - min), then centroid min, and keep channels
        ascending inside a cluster, so equal inputs give identical, diffable artifacts (rec #2)."""
        labels = labels.to(torch.int64)
        # An empty cluster (possible only with fewer distinct channels than clusters) is dropped: the
        # layout then has fewer groups than C // G, and the bits accounting is an upper bound.
        used = torch.bincount(labels, minlength=centers.shape[0]).nonzero().flatten().tolist()
        order = sorted(used, key=lambda c: (float(centers[c, 1] - centers[c, 0]), float(centers[c, 0]), c))
        rank = torch.full((centers.shape[0],), -1, dtype=torch.int64)
        rank[torch.tensor(order)] = torch.arange(len(order))
        group = rank[labels]
        perm = torch.argsort(group, stable=True)
        sizes = torch.bincount(group, minlength=len(order))
        return cls(perm, torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)]))

    def reorder(self, x: torch.Tensor) -> torch.Tensor:
        """[..., C] in original channel order -> permuted order."""
        return x[..., self.perm.to(x.device)]

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `reorder`."""
        return x[..., self.inverse.to(x.device)]


def clipped_group_params(x: torch.Tensor, layout: GroupLayout, alpha: torch.Tensor, levels: int,
                         param_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [..., n_groups] of each token's groups, as stored (rounded to `param_dtype`).

    x is [..., C] in permuted order. m = alpha * min, M = alpha * max (the clip shrinks the range toward
    0, [paper] Eq. 2), scale = max((M - m) / q_max, 1e-5), zero = m as a float offset (rec #12).
    """
    grouped = x[..., layout.padded.to(x.device)]  # [..., n_groups, largest group]
    scale, zero = minmax_params(grouped.amin(-1) * alpha, grouped.amax(-1) * alpha, levels, param_dtype=None)
    dtype = PARAM_DTYPES[param_dtype]
    # Clamp into the storage range before the cast (rec #10): e4m3 has no inf (casts beyond +-448 give
    # NaN), and an e4m3 scale below its smallest subnormal 2^-9 would round to 0.
    limit = torch.finfo(dtype).max
    floor = FP8_MIN_SCALE if param_dtype == "fp8" else SCALE_FLOOR
    return round_params(scale.clamp(floor, limit), dtype), round_params(zero.clamp(-limit, limit), dtype)


def fake_quant_clipped(x: torch.Tensor, layout: GroupLayout, alpha: torch.Tensor, levels: int,
                       param_dtype: str) -> torch.Tensor:
    """Quantize then dequantize x [..., C] (permuted order). Codes are computed against the *stored*
    (rounded) parameters, so this is what a runtime reconstructs (rec #10; the [code] computes codes
    with unrounded parameters). Rounding is half to even, as torch.round and the [code]."""
    scale, zero = clipped_group_params(x, layout, alpha, levels, param_dtype)
    position = layout.group_of_position.to(x.device)
    scale, zero = scale[..., position], zero[..., position]
    return dequantize(quantize(x, scale, zero, levels), scale, zero)


class ChannelQuantizer:
    """SKVQ quantization of one tensor kind (K or V) of one layer."""

    def __init__(self, layout: GroupLayout, alpha: torch.Tensor, bits: float, param_dtype: str):
        self.layout = layout
        self.alpha = alpha.to(torch.float32)
        self.levels = levels_for(bits)
        self.param_dtype = param_dtype

    def apply(self, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] -> reconstruction, with one clip ratio per group."""
        b, h, t, d = x.shape
        flat = x.transpose(1, 2).reshape(b, t, h * d).to(torch.float32)
        permuted = self.layout.reorder(flat)
        recon = self.layout.restore(fake_quant_clipped(permuted, self.layout, alpha.to(x.device),
                                                       self.levels, self.param_dtype))
        return recon.reshape(b, t, h, d).transpose(1, 2).to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.alpha)


class SKVQStorage(Storage):
    """One layer's SKVQ cache. Codes stay in the model's channel order, one row per (token, KV head) like any
    per-head cache: [B, Hkv, T, W] int32 words of `slot bits` (2 for ternary codes in 2-bit slots, the [code]'s), or
    [B, Hkv, T, ceil(D / 5)] uint8 for base-3 ternary codes (5 per byte). Each token's groups (k-means clusters over
    all of the layer's channels, across heads) have one clipped (scale, zero) each, [B, T, n_groups] in fp16 or fp8
    e4m3. A static map [Hkv * D] gives each channel its group, so a kernel's program for one KV head reads its own
    codes and gathers its channels' parameters: the permutation is never applied to the cache (digest rec #5 gathers
    channels by `perm` at write time and scatters them back at read time; storing codes in channel order is the same
    quantization with no scatter at read time). Keys before RoPE (rotated at attention time)."""

    keys_pre_rope = True  # [code] pre_rope=True in every config: quantize pre-RoPE keys, rotate after

    def __init__(self, keys: ChannelQuantizer, values: ChannelQuantizer, sink: int, window: int,
                 ternary_storage: str):
        # Sinks and the W most recent tokens (the current one included, [code] semantics, rec #14) stay in
        # fp16; the oldest window token is quantized as each new token arrives.
        self.policy = FlushPolicy(sink=sink, residual=window, block=1)
        self.sides = {"k": keys, "v": values}
        self.ternary_storage = ternary_storage
        # channel (original order) -> its group; the clip ratios as the kernels read them
        self.group_maps = {side: q.layout.group_of_position[q.layout.inverse].to(torch.int32)
                           for side, q in self.sides.items()}
        self.alphas = {side: q.alpha.to(torch.float32) for side, q in self.sides.items()}

    def to(self, device) -> SKVQStorage:
        self.group_maps = {side: m.to(device) for side, m in self.group_maps.items()}
        self.alphas = {side: a.to(device) for side, a in self.alphas.items()}
        return self

    def base3(self, side: str) -> bool:
        return self.sides[side].levels == 3 and self.ternary_storage == "base3"

    def slot_bits(self, side: str) -> int:
        """Bits per code slot (0: base-3 bytes)."""
        levels = self.sides[side].levels
        return 0 if self.base3(side) else (2 if levels == 3 else levels.bit_length() - 1)

    def num_groups(self, side: str) -> int:
        return self.sides[side].layout.num_groups

    def check(self, heads: int, dim: int) -> None:
        channels = self.sides["k"].layout.channels
        if heads * dim != channels:
            raise KvcalError(f"skvq layout of {channels} channels for a layer of {heads} KV heads x head_dim {dim}")

    def buffers(self, batch, capacity, heads, dim):
        specs = {}
        for side, q in self.sides.items():
            if self.base3(side):
                specs[f"{side}_codes"] = BufferSpec((batch, heads, capacity, bytes_per_trit_vector(dim)), torch.uint8, 2)
            else:
                words = words_per_vector(dim, self.slot_bits(side))
                specs[f"{side}_codes"] = BufferSpec((batch, heads, capacity, words), torch.int32, 2)
            params = BufferSpec((batch, capacity, q.layout.num_groups), PARAM_DTYPES[q.param_dtype], 1)
            specs[f"{side}_scale"] = specs[f"{side}_zero"] = params
        return specs

    def _quantize(self, side: str, x: torch.Tensor):
        """x [M, H, D] -> integer codes [M, H, D] in channel order, scale and zero [M, n_groups] as stored."""
        q = self.sides[side]
        m, h, d = x.shape
        permuted = q.layout.reorder(x.reshape(m, h * d).to(torch.float32))
        scale, zero = clipped_group_params(permuted, q.layout, self.alphas[side].to(x.device), q.levels,
                                           q.param_dtype)
        position = q.layout.group_of_position.to(x.device)
        codes = quantize(permuted, scale[..., position], zero[..., position], q.levels)
        return q.layout.restore(codes).reshape(m, h, d).to(torch.int64), scale, zero

    def write_reference(self, packed, keys, values, rows, slots):
        for side, x in (("k", keys), ("v", values)):
            codes, scale, zero = self._quantize(side, x)
            bits = self.slot_bits(side)
            packed[f"{side}_codes"][rows, :, slots] = pack_trits(codes) if bits == 0 else pack_codes(codes, bits)
            dtype = packed[f"{side}_scale"].dtype
            packed[f"{side}_scale"][rows, slots] = scale.to(dtype)
            packed[f"{side}_zero"][rows, slots] = zero.to(dtype)

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        n, heads, dim = int(packed.lengths[row]), packed.heads, packed.dim
        out = []
        for side in "kv":
            words = packed[f"{side}_codes"][row, :, :n]  # [H, n, W]
            bits = self.slot_bits(side)
            codes = unpack_trits(words, dim) if bits == 0 else unpack_codes(words, bits, dim)
            group = self.group_maps[side].to(words.device).long().reshape(heads, dim)
            scale = packed[f"{side}_scale"][row, :n].float()[:, group].permute(1, 0, 2)  # [H, n, D]
            zero = packed[f"{side}_zero"][row, :n].float()[:, group].permute(1, 0, 2)
            out.append(dequantize(codes.to(torch.float32), scale, zero))
        k, v = out
        return (packed.rotate_keys(k, dtype) if rotate else k.to(dtype)), v.to(dtype)

    def write_triton(self, packed, keys, values, rows, slots):
        from kvcal.methods.skvq.method import kernels as skvq_kernels

        skvq_kernels.write_triton(self, packed, keys, values, rows, slots)

    def supports_triton(self, q, packed):
        from kvcal.methods.skvq.method import kernels as skvq_kernels

        return skvq_kernels.unsupported(q, self)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        from kvcal.methods.skvq.method import kernels as skvq_kernels

        return skvq_kernels.attend_triton(q, packed, scale, fp, self, **knobs)

    def fill_synthetic(self, packed, generator):
        """Random codes; scales and zeros that fp8 holds too (small positive values)."""
        for name, t in packed.buffers.items():
            if name.endswith("codes"):
                t.random_(0, 243 if t.dtype == torch.uint8 else 2**31 - 1, generator=generator)
            else:
                small = torch.empty(t.shape, device=t.device).uniform_(0.01, 0.05, generator=generator)
                t.copy_(small.to(t.dtype))


class SKVQCodec(Codec):
    keys_pre_rope = True  # [code] pre_rope=True in every config: quantize pre-RoPE keys, rotate after

    def __init__(self, keys: list[ChannelQuantizer], values: list[ChannelQuantizer], sink: int, window: int,
                 ternary_storage: str):
        self.storages = [SKVQStorage(k, v, sink, window, ternary_storage) for k, v in zip(keys, values)]
        self.policy = self.storages[0].policy

    def storage(self, layer: int) -> SKVQStorage:
        return self.storages[layer]


class AttentionOutputError:
    """The clip search objective of one layer ([paper] §3.1): MSE of the attention output after o_proj
    when K and/or V are fake-quantized, against the full-precision output (rec #9).

    Every layer sees full-precision inputs (captured from the unquantized model, so errors do not
    propagate across layers), every non-sink token is quantized (window 0: independent of W), and
    only a subset is used for speed: the first `windows` calibration windows and `queries` query
    positions spread evenly over each, each query attending causally to all keys of its window.

    The search calls `probabilities` once per key candidate and `loss` once per (keys, values) pair, so a
    value search over a fixed key reconstruction costs one matmul per candidate.
    """

    def __init__(self, rows: dict[str, torch.Tensor], positions: torch.Tensor, module, dims, inv_freq,
                 sink: int, windows: int, queries: int):
        starts = torch.nonzero(positions == 0).flatten().tolist()
        length = (starts[1] if len(starts) > 1 else positions.numel()) - starts[0]
        if length <= sink:
            raise KvcalError(f"calibration windows of {length} tokens leave nothing to quantize after {sink} sinks")
        device = module.o_proj.weight.device
        n = min(windows, len(starts))
        kv_heads, head_dim = dims.num_kv_heads, dims.head_dim

        def heads(name: str, num_heads: int) -> torch.Tensor:  # [N, H*D] rows -> [n, H, T, D]
            t = rows[name][: n * length].to(device, torch.float32)
            return t.reshape(n, length, num_heads, head_dim).transpose(1, 2)

        self.k, self.v = heads("k", kv_heads), heads("v", kv_heads)
        self.cos, self.sin = rope_cos_sin(inv_freq.to(device), torch.arange(length, device=device)[None], torch.float32)
        self.sink, self.scale = sink, module.scaling
        picked = torch.linspace(sink, length - 1, min(queries, length - sink), device=device).round().long().unique()
        q = apply_rope(heads("q", dims.num_heads), self.cos, self.sin)[:, :, picked]
        # GQA as in transformers' repeat_kv: query head j reads KV head j // (Hq / Hkv). Queries are laid out
        # [n, Hkv, Hq/Hkv * nq, D] so that one batched matmul per KV head covers its query heads.
        self.q = q.reshape(n, kv_heads, -1, head_dim)
        self.query_heads, self.num_queries = dims.num_heads, picked.numel()
        causal = torch.arange(length, device=device)[None, :] <= picked[:, None]  # [nq, T]
        self.blocked = ~causal.repeat(dims.num_heads // kv_heads, 1)
        self.weight = module.o_proj.weight.detach().to(torch.float32)
        bias = module.o_proj.bias
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self.reference = self._output(self.probabilities(self.k), self.v)

    @property
    def tokens(self) -> dict:
        return {"windows": self.k.shape[0], "queries_per_window": self.num_queries, "keys_per_window": self.k.shape[2]}

    def quantize(self, x: torch.Tensor, quantizer: ChannelQuantizer, alpha: torch.Tensor) -> torch.Tensor:
        out = quantizer.apply(x, alpha)
        out[:, :, : self.sink] = x[:, :, : self.sink]  # sinks are never quantized
        return out

    def probabilities(self, k_pre: torch.Tensor) -> torch.Tensor:
        """Attention weights [n, Hkv, Hq/Hkv * nq, T] of the picked queries over pre-RoPE keys."""
        scores = self.q @ apply_rope(k_pre, self.cos, self.sin).transpose(-1, -2) * self.scale
        return torch.softmax(scores.masked_fill(self.blocked, float("-inf")), dim=-1)

    def _output(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, head_dim = v.shape[0], v.shape[-1]
        out = (probs @ v).reshape(n, self.query_heads, self.num_queries, head_dim)
        return F.linear(out.transpose(1, 2).flatten(2), self.weight, self.bias)

    def loss(self, probs: torch.Tensor, v: torch.Tensor) -> float:
        return float(F.mse_loss(self._output(probs, v), self.reference))


def grid_search(loss, alpha: torch.Tensor, grid: tuple[float, ...], groups: list[int] | None = None,
                ) -> tuple[torch.Tensor, list[float]]:
    """Try every grid value for the given groups (all of them at once if None) and keep the best.

    Returns the updated alpha and the loss at each grid point. The first minimum wins, i.e. the largest
    ratio among equal losses.
    """
    losses = []
    for value in grid:
        trial = alpha.clone()
        trial[groups if groups is not None else slice(None)] = value
        losses.append(loss(trial))
    best = min(range(len(grid)), key=losses.__getitem__)
    alpha = alpha.clone()
    alpha[groups if groups is not None else slice(None)] = grid[best]
    return alpha, losses


@register
@dataclass
class SKVQ(Method):
    """SKVQ: k-means channel groups (reorder), clipped per-token group quantization, fp16 window + sinks.

    Defaults are the paper's main setting (K2V2, average group 128, W = 128, 5 sinks). The ablation rows
    of the paper are configs: reorder=false (contiguous groups), clip=none, window=0, sink=0.
    """

    name = "skvq"
    summary = "k-means channel reorder, clipped per-token group quant, fp16 window + sinks"
    # the window never enters calibration (the clip search quantizes every non-sink token): a runtime setting
    runtime_fields = ("window",)
    fp_window_field = "window"
    learns = True
    captures = ("k", "v", "q")  # pre-RoPE K and V (stats, search), pre-RoPE Q (clip search objective)
    test_config = {"k_bits": 2.0, "v_bits": 1.5, "group_size": 8, "window": 8, "sink": 2, "clip_queries": 16}
    tensor_kinds = {f"{side}.{name}": kind for side in "kv" for name, kind in (
        ("clip", "range"), ("clip_loss", "diagnostic"), ("group_offsets", "index"), ("perm", "index"))}

    k_bits: float = 2.0  # 1.5 (ternary), 2, 3, 4 or 8
    v_bits: float = 2.0
    group_size: int = 128  # nominal: C // group_size groups per layer; sizes vary when reordered
    window: int = 128  # most recent tokens kept fp16
    sink: int = 5  # first tokens kept fp16 (the paper's only enabled filter rule)
    reorder: bool = True  # false: consecutive channels form the groups (ablation)
    clip: str = "layer"  # none | global (clip_value everywhere, the [code]) | layer (alpha_K, alpha_V) | group
    clip_value: float = 0.96  # clip=global: the [code]'s PPL-script value (0.92 for LongBench)
    clip_min: float = 0.8  # clip=layer|group: the searched grid is 1.00, 0.99, ..., clip_min
    param_dtype: str = "fp16"  # scale and zero storage: fp16 or fp8 (e4m3)
    ternary_storage: str = "base3"  # 1.5-bit codes: base3 (5 per byte, 1.6 bits) or 2bit ([code] slots)
    clip_windows: int = 2  # clip search: calibration windows used
    clip_queries: int = 256  # clip search: query positions per window
    seed: int = 0  # k-means seed

    def validate(self):
        for key in ("k_bits", "v_bits"):
            if getattr(self, key) not in SUPPORTED_BITS:
                raise KvcalError(f"skvq {key} must be one of {', '.join(f'{b:g}' for b in SUPPORTED_BITS)}, "
                                 f"got {getattr(self, key):g}")
        _choice("clip", self.clip, CLIP_MODES)
        _choice("param_dtype", self.param_dtype, tuple(PARAM_DTYPES))
        _choice("ternary_storage", self.ternary_storage, TERNARY_STORAGE)
        for key in ("group_size", "clip_windows", "clip_queries"):
            if getattr(self, key) <= 0:
                raise KvcalError(f"skvq {key} must be positive, got {getattr(self, key)}")
        for key in ("window", "sink"):
            if getattr(self, key) < 0:
                raise KvcalError(f"skvq {key} must be >= 0, got {getattr(self, key)}")
        for key in ("clip_value", "clip_min"):
            if not 0 < getattr(self, key) <= 1:
                raise KvcalError(f"skvq {key} must be in (0, 1], got {getattr(self, key)}")

    def capture_needs(self) -> set[str]:
        # Queries serve only the clip search's attention-output objective.
        return {"k", "v"} | ({"q"} if self.clip in ("layer", "group") else set())

    def check_model(self, dims):
        channels = dims.kv_channels
        if self.group_size > channels:
            raise KvcalError(f"skvq group_size {self.group_size} is larger than the {channels} K/V channels "
                             f"per token ({dims.num_kv_heads} KV heads x head_dim {dims.head_dim})")
        if not self.reorder and channels % self.group_size:
            raise KvcalError(f"skvq without reorder needs group_size to divide the {channels} K/V channels, "
                             f"got {self.group_size}")

    def spans_heads(self, dims) -> str | None:
        """A warning when the average group is wider than a head: the paper's group sizes (128) assume thousands of
        channels per layer, and on a small model one group spans several heads (smollm2-135m, 3 KV heads x 64
        channels: g128 is a single group per token, and perplexity about 1000)."""
        if self.group_size <= dims.head_dim:
            return None
        groups = self.num_groups(dims)
        return (f"skvq group_size {self.group_size} is wider than head_dim {dims.head_dim}: {groups} group"
                f"{'s' if groups > 1 else ''} over the {dims.kv_channels} channels of a layer, each spanning heads "
                "(the paper's g128 assumes thousands of channels; use group_size <= head_dim on this model)")

    def num_groups(self, dims) -> int:
        # [code]: n_clusters = C // G, so G is only the *average* group size (C / n_groups).
        return dims.kv_channels // self.group_size

    def tag(self) -> str:
        clip = f"clip{self.clip_value:g}" if self.clip == "global" else f"clip-{self.clip}"
        parts = [f"k{self.k_bits:g}v{self.v_bits:g}", f"g{self.group_size}", f"w{self.window}", f"s{self.sink}",
                 "reorder" if self.reorder else "noreorder", clip, self.param_dtype]
        return "-".join(parts)

    # -- calibration --
    def calibrate(self, loaded, store):
        from kvcal.models.adapter import attention_modules

        dims = loaded.dims
        self.check_model(dims)
        spans = self.spans_heads(dims)
        if spans:
            from kvcal.progress import stderr_console

            stderr_console.print(f"warning: {spans}", markup=False, highlight=False, soft_wrap=True)
        positions = store.token_positions
        # Channel statistics leave out the sink positions: those tokens are never quantized, and the
        # first tokens carry extreme values that would skew the ranges (rec #1; the [code] uses all).
        stats_rows = positions >= self.sink
        if not stats_rows.any():
            raise KvcalError(f"skvq sink={self.sink} covers every calibration token: use a longer --seqlen")
        modules = attention_modules(loaded.model)
        tensors, alphas, group_sizes, search = {}, {"k": [], "v": []}, {"k": [], "v": []}, None
        for i in range(dims.num_layers):
            rows = store.layer(i)
            quantizers = {}
            for kind, bits in (("k", self.k_bits), ("v", self.v_bits)):
                layout = self._layout(rows[kind][stats_rows], dims)
                quantizers[kind] = ChannelQuantizer(layout, torch.ones(layout.num_groups), bits, self.param_dtype)
            curves = {}
            if self.clip in ("layer", "group"):  # on the layer's device (where its o_proj is)
                with device_scope(loaded.layer_device(i)):
                    objective = AttentionOutputError(rows, positions, modules[i], dims, loaded.adapter.inv_freq,
                                                     self.sink, self.clip_windows, self.clip_queries)
                    curves = self._search_clips(objective, quantizers["k"], quantizers["v"])
                search = objective.tokens
            elif self.clip == "global":
                for q in quantizers.values():
                    q.alpha = torch.full_like(q.alpha, self.clip_value)
            for kind, q in quantizers.items():
                prefix = f"layers.{i}.{kind}."
                tensors[prefix + "perm"] = q.layout.perm.to(torch.int32)
                tensors[prefix + "group_offsets"] = q.layout.offsets.to(torch.int32)
                tensors[prefix + "clip"] = q.alpha.clone()
                if kind in curves:
                    tensors[prefix + "clip_loss"] = torch.tensor(curves[kind], dtype=torch.float32)
                alphas[kind].append([round(a, 2) for a in q.alpha.tolist()])
                group_sizes[kind].append(q.layout.sizes)
            del rows
        info = {
            "warning": spans,
            "kmeans": {"features": "per-channel (min, max), sink positions excluded", "n_init": KMEANS_N_INIT,
                       "seed": self.seed} if self.reorder else None,
            "group_sizes_k": group_sizes["k"],
            "group_sizes_v": group_sizes["v"],
            "clip_k": alphas["k"],
            "clip_v": alphas["v"],
        }
        if search is not None:
            info["clip_search"] = {"grid": list(clip_grid(self.clip_min)),
                                   "objective": "attention output MSE after o_proj",
                                   "quantized": "all non-sink tokens (window 0)", **search}
        return tensors, info

    def _layout(self, rows: torch.Tensor, dims) -> GroupLayout:
        channels = dims.kv_channels
        if not self.reorder:
            return GroupLayout.contiguous(channels, self.group_size)
        # [code]: features = each channel's raw global (min, max) over the calibration tokens.
        features = torch.stack([rows.amin(0), rows.amax(0)], dim=1)
        result = weighted_kmeans(features, self.num_groups(dims), seed=self.seed, n_init=KMEANS_N_INIT)
        return GroupLayout.from_clusters(result.labels.cpu(), result.centers.cpu())

    def _search_clips(self, objective: AttentionOutputError, k_quant: ChannelQuantizer,
                      v_quant: ChannelQuantizer) -> dict[str, list[float]]:
        """Per layer, alpha_K and alpha_V searched separately (rec #7; the paper says per group, the [code]
        uses one hand-set ratio): alpha_K with V in full precision, then alpha_V with K quantized at the
        chosen alpha_K. clip=group then refines group by group (coordinate descent, one sweep, K then V,
        both quantized). Sets the quantizers' alpha; returns the per-layer loss curves."""
        k, v, grid = objective.k, objective.v, clip_grid(self.clip_min)

        def key_loss(alpha, v_hat):
            return objective.loss(objective.probabilities(objective.quantize(k, k_quant, alpha)), v_hat)

        def value_loss(alpha, probs):
            return objective.loss(probs, objective.quantize(v, v_quant, alpha))

        k_quant.alpha, k_curve = grid_search(lambda a: key_loss(a, v), k_quant.alpha, grid)
        probs = objective.probabilities(objective.quantize(k, k_quant, k_quant.alpha))
        v_quant.alpha, v_curve = grid_search(lambda a: value_loss(a, probs), v_quant.alpha, grid)
        if self.clip == "group":
            v_hat = objective.quantize(v, v_quant, v_quant.alpha)
            for g in range(k_quant.layout.num_groups):
                k_quant.alpha, _ = grid_search(lambda a: key_loss(a, v_hat), k_quant.alpha, grid, [g])
            probs = objective.probabilities(objective.quantize(k, k_quant, k_quant.alpha))
            for g in range(v_quant.layout.num_groups):
                v_quant.alpha, _ = grid_search(lambda a: value_loss(a, probs), v_quant.alpha, grid, [g])
        return {"k": k_curve, "v": v_curve}

    # -- runtime --
    def build_codec(self, tensors, dims) -> Codec:
        self.check_model(dims)
        quantizers: dict[str, list[ChannelQuantizer]] = {"k": [], "v": []}
        for i in range(dims.num_layers):
            for kind, bits in (("k", self.k_bits), ("v", self.v_bits)):
                prefix = f"layers.{i}.{kind}."
                missing = [n for n in ("perm", "group_offsets", "clip") if prefix + n not in tensors]
                if missing:
                    raise KvcalError(f"skvq artifact lacks {prefix}{missing[0]}: re-run kvcal calibrate --method skvq")
                layout = GroupLayout(tensors[prefix + "perm"], tensors[prefix + "group_offsets"], prefix.rstrip("."))
                if layout.channels != dims.kv_channels:
                    raise KvcalError(f"{prefix}perm has {layout.channels} channels, the model has {dims.kv_channels}")
                alpha = tensors[prefix + "clip"]
                if alpha.dim() != 1 or alpha.numel() != layout.num_groups:
                    raise KvcalError(f"{prefix}clip has shape {list(alpha.shape)}, expected [{layout.num_groups}] "
                                     "(one ratio per group)")
                if not (torch.isfinite(alpha) & (alpha > 0)).all():  # a ratio of 0 makes every scale 0
                    raise KvcalError(f"{prefix}clip holds a ratio that is not a positive number: "
                                     f"{alpha.flatten().tolist()[:8]}")
                quantizers[kind].append(ChannelQuantizer(layout, alpha, bits, self.param_dtype))
        return SKVQCodec(quantizers["k"], quantizers["v"], self.sink, self.window, self.ternary_storage)

    def synthetic_tensors(self, dims, seed: int = 0):
        """A random channel permutation cut into C // group_size groups of equal size, clip ratios 0.96 (speed
        benchmarks at shapes no artifact exists for; the kernel's work does not depend on them)."""
        gen = torch.Generator().manual_seed(seed)
        channels, groups = dims.kv_channels, self.num_groups(dims)
        offsets = torch.linspace(0, channels, groups + 1).round().to(torch.int32)
        tensors = {}
        for i in range(dims.num_layers):
            for kind in "kv":
                prefix = f"layers.{i}.{kind}."
                tensors[prefix + "perm"] = torch.randperm(channels, generator=gen).to(torch.int32)
                tensors[prefix + "group_offsets"] = offsets.clone()
                tensors[prefix + "clip"] = torch.full((groups,), 0.96)
        return tensors

    def footprint(self, dims, tokens):
        quantized = FlushPolicy(sink=self.sink, residual=self.window).compressed_count(tokens)
        rows = dims.num_layers * quantized  # quantized token rows per tensor kind, all layers
        code_bytes = sum(code_bytes_per_token(dims.num_kv_heads, dims.head_dim, bits, self.ternary_storage)
                         for bits in (self.k_bits, self.v_bits))
        params_per_row = self.num_groups(dims) * 2 * PARAM_BYTES[self.param_dtype]  # scale + zero per group
        return {
            "codes": rows * code_bytes,
            "scales_zeros": rows * 2 * params_per_row,  # K and V
            "fp16_window_sink": fp16_token_bytes(dims, tokens - quantized),
        }


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise KvcalError(f"skvq {key} must be one of {', '.join(allowed)}, got {value!r}")
