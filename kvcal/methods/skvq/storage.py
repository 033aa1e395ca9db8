"""SKVQ's codec and packed storage: per-token group quantization with clipped (scale, zero) per channel group (a
channel permutation and k-means groups, learned offline), codes kept in channel order, and the torch quantizers the
simulation and the storage share."""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.methods.base import FlushPolicy
from kvcal.methods.skvq import kernels as skvq_kernels
from kvcal.methods.skvq.kernels import FP8_MIN_SCALE, SCALE_FLOOR
from kvcal.quant.packing import (
    bytes_per_trit_vector,
    pack_codes,
    pack_trits,
    unpack_codes,
    unpack_trits,
    words_per_vector,
)
from kvcal.quant.uniform import dequantize, minmax_params, quantize, round_params
from kvcal.runtime.storage import BufferSpec, Packed, Storage

PARAM_DTYPES = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}
PARAM_BYTES = {"fp16": 2, "fp8": 1}


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
        n, heads, dim = packed.length(row), packed.heads, packed.dim
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
        skvq_kernels.write_triton(self, packed, keys, values, rows, slots)

    def supports_triton(self, q, packed):
        return skvq_kernels.unsupported(q, self)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        return skvq_kernels.attend_triton(q, packed, scale, fp, self, **knobs)

    def fill_synthetic(self, packed, generator):
        """Random codes; scales and zeros that fp8 holds too (small positive values)."""
        for name, t in packed.buffers.items():
            if name.endswith("codes"):
                t.random_(0, 243 if t.dtype == torch.uint8 else 2**31 - 1, generator=generator)
            else:
                small = torch.empty(t.shape, device=t.device).uniform_(0.01, 0.05, generator=generator)
                t.copy_(small.to(t.dtype))
