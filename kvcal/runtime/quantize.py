"""Quantize-and-pack for the packed KV cache: torch references (the Triton kernels sit next to them).

Every function takes a block of N tokens x [N, H, D] (one row of the batch; keys in the codec's key
space) and returns packed codes [N, H, W] int32 (see runtime/packing.py) plus the parameters the
format needs. `dequantize_*` inverts them. Their arithmetic is exactly the codecs' fake quantization
(kvcal/methods), so a packed cache reconstructs what the gptq simulation assumed:

- affine_channels: per token, asymmetric min/max over groups of `group` channels of each head (RTN keys
  and values, KIVI values); fp16 scale and zero (the group minimum) per (token, head, group).
- affine_tokens: per channel over the N tokens of a block (KIVI keys); fp16 scale/zero per (head, channel).
- lut_static: per channel with calibrated ranges and a non-uniform table (KVQuant keys); elements out
  of range are outliers whose fp16 residual over the clamped code is kept, up to `capacity` per token and
  head (overflow keeps the head's largest residuals, the rest stay clamped to the extreme level). Slots
  are [N, H, capacity] so the decode kernel's program for one KV head reads only its own.
- lut_dynamic: per token over all heads with the `per_side` largest and smallest elements as outliers
  (KVQuant values); fp16 scale/zero per token, fp16 residuals of the 2*per_side outliers. With `per_head`,
  each head's vector is its own (scale, zero, 2*per_side outliers): scale/zero [N, H], slots [N, H, 2*per_side].
"""

from __future__ import annotations

import torch

from kvcal.quant.nonuniform import largest_residuals, nearest_level, outlier_bounds, range_params
from kvcal.quant.uniform import dequantize, minmax_params, quantize
from kvcal.runtime.packing import pack_codes, unpack_codes

# ---- affine, groups of channels per token ---------------------------------------------------------


def quantize_affine_channels(x: torch.Tensor, bits: int, group: int):
    n, h, d = x.shape
    g = x.to(torch.float32).reshape(n, h, d // group, group)
    scale, zero = minmax_params(g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), 1 << bits)
    codes = quantize(g, scale, zero, 1 << bits).reshape(n, h, d)
    return pack_codes(codes, bits), scale[..., 0].half(), zero[..., 0].half()


def dequantize_affine_channels(codes, scale, zero, bits: int, dim: int) -> torch.Tensor:
    q = unpack_codes(codes, bits, dim).to(torch.float32)
    groups = scale.shape[-1]
    q = q.reshape(*q.shape[:-1], groups, dim // groups)
    return dequantize(q, scale.float()[..., None], zero.float()[..., None]).reshape(*q.shape[:-2], dim)


# ---- affine, one (scale, zero) per channel over a block of tokens (KIVI keys) ---------------------


def quantize_affine_token_blocks(x: torch.Tensor, bits: int, block: int):
    """x [N, H, D], N a multiple of `block`: codes [N, H, W] and one (scale, zero) per channel for each
    block of `block` consecutive tokens, [N/block, H, D] (a prompt's key blocks at once)."""
    n, h, d = x.shape
    xf = x.to(torch.float32).reshape(n // block, block, h, d)
    scale, zero = minmax_params(xf.amin(1, keepdim=True), xf.amax(1, keepdim=True), 1 << bits)
    codes = quantize(xf, scale, zero, 1 << bits).reshape(n, h, d)
    return pack_codes(codes, bits), scale[:, 0].half(), zero[:, 0].half()


def quantize_affine_tokens(x: torch.Tensor, bits: int):
    """One block: x [N, H, D] -> codes [N, H, W], scale and zero [H, D]."""
    codes, scale, zero = quantize_affine_token_blocks(x, bits, x.shape[0])
    return codes, scale[0], zero[0]


def dequantize_affine_tokens(codes, scale, zero, bits: int, dim: int) -> torch.Tensor:
    """codes [N, H, W] of one block; scale/zero [H, D] (or [..., H, D] broadcast over the block)."""
    q = unpack_codes(codes, bits, dim).to(torch.float32)
    return dequantize(q, scale.float(), zero.float())


# ---- non-uniform tables with dense-and-sparse outliers (KVQuant) ----------------------------------


def _keep_largest(residual: torch.Tensor, candidate: torch.Tensor, capacity: int):
    """Indices [N, capacity] and fp16 residuals of the `capacity` largest |residual| among candidates
    of each row (-1 / 0 where a row has fewer)."""
    top, valid = largest_residuals(residual, candidate, capacity)
    idx = torch.where(valid, top, torch.full_like(top, -1)).to(torch.int16)
    val = torch.where(valid, residual.gather(-1, top), 0.0).half()
    return idx, val


def quantize_lut_static(x, lo, hi, encode, decode, bits: int, capacity: int):
    """Codes [N, H, W] and, with a capacity, the outlier slots [N, H, capacity]: channel in [0, H*D) (-1 =
    empty) and fp16 residual."""
    n, h, d = x.shape
    rows = x.to(torch.float32).reshape(n, h * d)
    zero, scale = range_params(lo, hi)
    codes = nearest_level(((rows - zero) / scale).clamp(-1, 1), encode)
    dense = decode[codes] * scale + zero
    idx = val = None
    if capacity:
        outlier = ((rows > hi) | (rows < lo)).reshape(n, h, d)
        idx, val = _keep_largest((rows - dense).reshape(n, h, d), outlier, capacity)
        idx = _global_channels(idx, d)
    return pack_codes(codes.reshape(n, h, d), bits), idx, val


def quantize_lut_dynamic(x, encode, decode, bits: int, per_side: int, per_head: bool = False):
    if per_head:
        return _per_head(x, encode, decode, bits, per_side)
    n, h, d = x.shape
    rows = x.to(torch.float32).reshape(n, h * d)
    lo, hi, outlier = outlier_bounds(rows, per_side, dim=-1)
    z, s = range_params(lo, hi, torch.float16)  # as stored: fp16
    codes = nearest_level(((rows - z) / s).clamp(-1, 1), encode)
    dense = decode[codes] * s + z
    idx, val = _keep_largest(rows - dense, outlier, 2 * per_side) if per_side else (None, None)
    return pack_codes(codes.reshape(n, h, d), bits), s[:, 0].half(), z[:, 0].half(), idx, val


def _per_head(x, encode, decode, bits: int, per_side: int):
    """lut_dynamic with one vector per (token, head): the per-token quantizer on [N*H, 1, D], reshaped back;
    outlier channels made global (head * D + channel) as everywhere else."""
    n, h, d = x.shape
    codes, scale, zero, idx, val = quantize_lut_dynamic(x.reshape(n * h, 1, d), encode, decode, bits, per_side)
    codes, scale, zero = codes.reshape(n, h, -1), scale.reshape(n, h), zero.reshape(n, h)
    if idx is not None:
        idx, val = _global_channels(idx.reshape(n, h, -1), d), val.reshape(n, h, -1)
    return codes, scale, zero, idx, val


def _global_channels(idx: torch.Tensor, d: int) -> torch.Tensor:
    """Slots [N, H, cap] holding channels within each head -> channels in [0, H*d) (-1 stays empty)."""
    head_base = (torch.arange(idx.shape[1], device=idx.device) * d).to(idx.dtype)[None, :, None]
    return torch.where(idx >= 0, idx + head_base, idx)


def add_outliers(rows: torch.Tensor, idx: torch.Tensor | None, val: torch.Tensor | None) -> torch.Tensor:
    """rows [..., C] + the sparse residuals (idx -1 = empty slot)."""
    if idx is None:
        return rows
    valid = idx >= 0
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    return rows.scatter_add(-1, safe, torch.where(valid, val.float(), torch.zeros_like(val, dtype=torch.float32)))


def dequantize_lut_static(codes, zero, scale, decode, bits: int, dim: int, idx=None, val=None) -> torch.Tensor:
    """codes [..., H, W] -> [..., H, dim]: table level x scale + zero per channel (zero, scale [H*dim] from
    range_params of the calibrated range, as quantize_lut_static used them), plus the sparse residuals
    (idx, val [..., H, capacity])."""
    q = unpack_codes(codes, bits, dim)
    shape = q.shape
    q = q.reshape(*shape[:-2], shape[-2] * dim)
    if idx is not None:
        idx, val = idx.flatten(-2), val.flatten(-2)
    rows = add_outliers(decode[q] * scale + zero, idx, val)
    return rows.reshape(shape)


def dequantize_lut_dynamic(codes, scale, zero, decode, bits: int, dim: int, idx=None, val=None) -> torch.Tensor:
    """codes [..., H, W] -> [..., H, dim]; scale/zero [...] per token or [..., H] per head; slots [..., cap]
    per token or [..., H, cap] per head."""
    q = unpack_codes(codes, bits, dim)
    shape = q.shape
    per_token = scale.dim() == q.dim() - 2
    s, z = scale.float().clamp_min(1e-8), zero.float()
    s, z = (s[..., None, None], z[..., None, None]) if per_token else (s[..., None], z[..., None])
    rows = (decode[q] * s + z).reshape(*shape[:-2], shape[-2] * dim)
    if idx is not None:
        idx, val = idx.reshape(*shape[:-2], -1), val.reshape(*shape[:-2], -1)
    return add_outliers(rows, idx, val).reshape(shape)


# ---- Triton ---------------------------------------------------------------------------------------
# Same arithmetic as the references, bit for bit: parameters rounded to fp16 before the codes are
# computed, IEEE division (tl.math.div_rn, not Triton's approximate '/'), round half to even, no FMA
# contraction (launched with enable_fp_fusion=False), nearest level = number of midpoints below x
# (searchsorted, side='left'). Outliers are chosen by repeated argmax, which gives topk's order
# (largest |residual| first); on exact ties of |residual| the chosen element may differ from torch.topk.

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from kvcal.runtime.packing import _pow2, launch_device, words_per_vector  # noqa: E402

if triton is not None:
    from kvcal.runtime.packing import pack_tile

    @triton.jit
    def _rint(y):
        """Round half to even (torch.round) without libdevice, so the interpreter runs it too."""
        f = tl.floor(y)
        diff = y - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        up = (diff > 0.5) | ((diff == 0.5) & odd)
        return tl.where(up, f + 1.0, f)

    @triton.jit
    def _affine_params(mn, mx, LEVELS: tl.constexpr):
        """(zero, scale) of a min-max range as minmax_params rounds them: fp16 values, returned as float32."""
        zero = mn.to(tl.float16).to(tl.float32)
        scale = tl.math.div_rn(mx - mn, LEVELS - 1.0).to(tl.float16).to(tl.float32)
        return zero, scale

    @triton.jit
    def _affine_codes(x, zero, scale, LEVELS: tl.constexpr):
        safe = tl.where(scale == 0.0, 1.0, scale)
        y = tl.math.div_rn(x - zero, safe)
        return tl.minimum(tl.maximum(_rint(y), 0.0), LEVELS - 1.0).to(tl.int32)

    @triton.jit
    def _destinations(n, nm, row_ptr, slot_ptr, DEST: tl.constexpr):
        """(row, slot) that token n is written to: read from the device (DEST, a cache's buffers) or (0, n)
        (a fresh [N, ...] output seen as one row: its batch stride is 0)."""
        if DEST:
            b = tl.load(row_ptr + n, mask=nm, other=0).to(tl.int64)
            t = tl.load(slot_ptr + n, mask=nm, other=0).to(tl.int64)
        else:
            b = n.to(tl.int64) * 0
            t = n.to(tl.int64)
        return b, t

    @triton.jit
    def _affine_channels_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, row_ptr, slot_ptr, N, sxn, sxh,
                                scb, sct, sch, spb, spt, sph,
                                D: tl.constexpr, GROUPS: tl.constexpr, BITS: tl.constexpr,
                                W: tl.constexpr, WP: tl.constexpr, R: tl.constexpr, DEST: tl.constexpr):
        GS: tl.constexpr = D // GROUPS
        LEVELS: tl.constexpr = 1 << BITS
        h = tl.program_id(1)
        n = tl.program_id(0) * R + tl.arange(0, R)
        nm = n < N
        d = tl.arange(0, D)
        x = tl.load(x_ptr + n[:, None] * sxn + h * sxh + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
        x3 = tl.reshape(x, (R, GROUPS, GS))
        zero, scale = _affine_params(tl.min(x3, 2), tl.max(x3, 2), LEVELS)
        codes = tl.reshape(_affine_codes(x3, zero[:, :, None], scale[:, :, None], LEVELS), (R, D))
        words = pack_tile(codes, R, D, BITS, WP)
        w = tl.arange(0, WP)
        b, t = _destinations(n, nm, row_ptr, slot_ptr, DEST)
        tl.store(codes_ptr + (b * scb + t * sct + h * sch)[:, None] + w[None, :], words,
                 mask=nm[:, None] & (w < W)[None, :])
        gi = tl.arange(0, GROUPS)
        at = (b * spb + t * spt + h * sph)[:, None] + gi[None, :]
        tl.store(scale_ptr + at, scale.to(tl.float16), mask=nm[:, None])
        tl.store(zero_ptr + at, zero.to(tl.float16), mask=nm[:, None])

    @triton.jit
    def _affine_tokens_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, N, H, sxn, sxh,
                              D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                              R: tl.constexpr):
        """Program (h, j): head h of the j-th block of N consecutive tokens (one scale/zero per channel)."""
        LEVELS: tl.constexpr = 1 << BITS
        h = tl.program_id(0)
        j = tl.program_id(1)
        d = tl.arange(0, D)
        x_ptr += j * N * sxn
        mn = tl.full((D,), float("inf"), tl.float32)
        mx = tl.full((D,), float("-inf"), tl.float32)
        for n0 in range(0, N, R):
            n = n0 + tl.arange(0, R)
            nm = n < N
            x = tl.load(x_ptr + n[:, None] * sxn + h * sxh + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
            mn = tl.minimum(mn, tl.min(tl.where(nm[:, None], x, float("inf")), 0))
            mx = tl.maximum(mx, tl.max(tl.where(nm[:, None], x, float("-inf")), 0))
        zero, scale = _affine_params(mn, mx, LEVELS)
        tl.store(scale_ptr + (j * H + h) * D + d, scale.to(tl.float16))
        tl.store(zero_ptr + (j * H + h) * D + d, zero.to(tl.float16))
        w = tl.arange(0, WP)
        for n0 in range(0, N, R):
            n = n0 + tl.arange(0, R)
            nm = n < N
            x = tl.load(x_ptr + n[:, None] * sxn + h * sxh + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
            codes = _affine_codes(x, zero[None, :], scale[None, :], LEVELS)
            words = pack_tile(codes, R, D, BITS, WP)
            row = (j * N + n) * H + h
            tl.store(codes_ptr + row[:, None] * W + w[None, :], words, mask=nm[:, None] & (w < W)[None, :])

    @triton.jit
    def _nearest(xn, enc_ptr, LEVELS: tl.constexpr):
        """Index of the nearest level (ties to the lower): how many midpoints lie strictly below xn."""
        code = tl.zeros(xn.shape, tl.int32)
        for i in tl.static_range(LEVELS - 1):
            mid = (tl.load(enc_ptr + i + 1) + tl.load(enc_ptr + i)) * 0.5
            code += (xn > mid).to(tl.int32)
        return code

    @triton.jit
    def _store_largest_rows(score, res, c, idx_ptr, val_ptr, rowoff, hm, D: tl.constexpr, CAP: tl.constexpr):
        """Per row of [R, D] (a head, or a whole token as one row): store the CAP largest scores' channels c
        and fp16 residuals at idx_ptr + rowoff + k (-1 / 0 where the score is < 0); rowoff [R] are the rows'
        slot offsets, hm masks the real rows."""
        for k in tl.static_range(CAP):
            best = tl.max(score, 1)
            at = tl.argmax(score, 1)
            hit = (c % D) == at[:, None]  # column `at` of each head's row
            valid = best >= 0.0
            val = tl.sum(tl.where(hit, res, 0.0), 1)
            chan = tl.sum(tl.where(hit, c, 0), 1)
            tl.store(idx_ptr + rowoff + k, tl.where(valid, chan, -1).to(tl.int16), mask=hm)
            tl.store(val_ptr + rowoff + k, tl.where(valid, val, 0.0).to(tl.float16), mask=hm)
            score = tl.where(hit, -2.0, score)

    @triton.jit
    def _lut_static_kernel(x_ptr, lo_ptr, hi_ptr, enc_ptr, dec_ptr, codes_ptr, idx_ptr, val_ptr, row_ptr, slot_ptr,
                           sxn, sxh, H, scb, sct, sch, sob, sot, soh,
                           HP: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                           WP: tl.constexpr, CAP: tl.constexpr, DEST: tl.constexpr):
        n = tl.program_id(0)
        hh = tl.arange(0, HP)  # heads padded to a power of two
        hm = (hh < H)[:, None]
        d = tl.arange(0, D)
        c = hh[:, None] * D + d[None, :]  # [HP, D] channel in [0, C)
        x = tl.load(x_ptr + n * sxn + hh[:, None] * sxh + d[None, :], mask=hm, other=0.0).to(tl.float32)
        lo = tl.load(lo_ptr + c, mask=hm, other=0.0)
        hi = tl.load(hi_ptr + c, mask=hm, other=0.0)
        zero = (hi + lo) * 0.5
        scale = tl.maximum((hi - lo) * 0.5, 1e-8)
        xn = tl.minimum(tl.maximum(tl.math.div_rn(x - zero, scale), -1.0), 1.0)
        codes = _nearest(xn, enc_ptr, 1 << BITS)
        words = pack_tile(codes, HP, D, BITS, WP)
        w = tl.arange(0, WP)
        b, t = _destinations(n, n >= 0, row_ptr, slot_ptr, DEST)
        tl.store(codes_ptr + b * scb + t * sct + hh[:, None] * sch + w[None, :], words, mask=hm & (w < W)[None, :])
        if CAP > 0:
            res = x - (tl.load(dec_ptr + codes) * scale + zero)
            score = tl.where(((x > hi) | (x < lo)) & hm, tl.abs(res), -1.0)
            _store_largest_rows(score, res, c, idx_ptr, val_ptr, b * sob + t * sot + hh * soh, hh < H, D, CAP)

    @triton.jit
    def _lut_dynamic_kernel(x_ptr, enc_ptr, dec_ptr, codes_ptr, scale_ptr, zero_ptr, idx_ptr, val_ptr, row_ptr,
                            slot_ptr, sxn, sxh, H, scb, sct, sch, ssb, sst, ssh, sob, sot, soh,
                            HP: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                            WP: tl.constexpr, PER_SIDE: tl.constexpr, PER_HEAD: tl.constexpr, DEST: tl.constexpr):
        """One vector per program: a token over all heads (grid (N, 1)), or with PER_HEAD one (token, head)
        (grid (N, H), HP = 1)."""
        n = tl.program_id(0)
        if PER_HEAD:
            h0 = tl.program_id(1)
        else:
            h0 = 0
        hh = h0 + tl.arange(0, HP)  # heads padded to a power of two
        hm = (hh < H)[:, None]
        d = tl.arange(0, D)
        x = tl.load(x_ptr + n * sxn + hh[:, None] * sxh + d[None, :], mask=hm, other=0.0).to(tl.float32)
        C: tl.constexpr = HP * D
        row = tl.reshape(x, (C,))
        real = tl.reshape(hm & (d < D)[None, :], (C,))
        c = tl.arange(0, C)  # position in the vector; its channel is h0 * D + c
        outlier = tl.zeros((C,), tl.int1)
        top = tl.where(real, row, float("-inf"))
        bottom = tl.where(real, row, float("inf"))
        if PER_SIDE > 0:
            for k in tl.static_range(PER_SIDE):  # the PER_SIDE largest and smallest are outliers
                a = tl.argmax(top, 0)
                outlier = outlier | (c == a)
                top = tl.where(c == a, float("-inf"), top)
                a = tl.argmin(bottom, 0)
                outlier = outlier | (c == a)
                bottom = tl.where(c == a, float("inf"), bottom)
            hi = tl.max(top, 0)  # the next ones inward bound the dense range
            lo = tl.min(bottom, 0)
        else:
            hi = tl.max(top, 0)
            lo = tl.min(bottom, 0)
        zero16 = ((hi + lo) * 0.5).to(tl.float16)
        scale16 = ((hi - lo) * 0.5).to(tl.float16)
        b, t = _destinations(n, n >= 0, row_ptr, slot_ptr, DEST)
        tl.store(scale_ptr + b * ssb + t * sst + h0 * ssh, scale16)
        tl.store(zero_ptr + b * ssb + t * sst + h0 * ssh, zero16)
        z = zero16.to(tl.float32)
        s = tl.maximum(scale16.to(tl.float32), 1e-8)
        xn = tl.minimum(tl.maximum(tl.math.div_rn(x - z, s), -1.0), 1.0)
        codes = _nearest(xn, enc_ptr, 1 << BITS)
        words = pack_tile(codes, HP, D, BITS, WP)
        w = tl.arange(0, WP)
        tl.store(codes_ptr + b * scb + t * sct + hh[:, None] * sch + w[None, :], words, mask=hm & (w < W)[None, :])
        if PER_SIDE > 0:
            res = tl.reshape(x - (tl.load(dec_ptr + codes) * s + z), (C,))
            score = tl.where(outlier, tl.abs(res), -1.0)
            one = tl.arange(0, 1)  # the vector is one row; its channels are global (h0 * D + c)
            _store_largest_rows(tl.reshape(score, (1, C)), tl.reshape(res, (1, C)), tl.reshape(h0 * D + c, (1, C)),
                                idx_ptr, val_ptr, b * sob + t * sot + h0 * soh + one, one < 1, C, 2 * PER_SIDE)


def _pow2_ok(*sizes: int) -> bool:
    return all(s >= 1 and s & (s - 1) == 0 for s in sizes)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- writing straight into a cache's buffers -------------------------------------------------------
# `*_into(x, ..., rows, slots)`: token n of x [N, H, D] is quantized as above and written to row rows[n], slot
# slots[n] of a cache's buffers (kvcal/runtime/cache.py layouts: codes [B, H, T, W], affine scale/zero
# [B, H, T, G], key outlier slots [B, T, H, cap], value scale/zero [B, T] or [B, H, T], value outlier slots
# [B, T, cap] or [B, T, H, cap]). rows/slots are device tensors: a decode step passes the cache's own
# `lengths` as the slots, so appending a token is one kernel per side and no host-side index.


def quantize_affine_channels_into(x, bits: int, group: int, codes, scale, zero, rows, slots) -> None:
    c, s, z = quantize_affine_channels(x, bits, group)
    rows, slots = rows.long(), slots.long()
    codes[rows, :, slots], scale[rows, :, slots], zero[rows, :, slots] = c, s, z


def quantize_lut_static_into(x, lo, hi, encode, decode, bits: int, capacity: int, codes, out_idx, out_val,
                             rows, slots) -> None:
    c, idx, val = quantize_lut_static(x, lo, hi, encode, decode, bits, capacity)
    rows, slots = rows.long(), slots.long()
    codes[rows, :, slots] = c
    if capacity:
        out_idx[rows, slots], out_val[rows, slots] = idx, val


def quantize_lut_dynamic_into(x, encode, decode, bits: int, per_side: int, per_head: bool, codes, scale, zero,
                              out_idx, out_val, rows, slots) -> None:
    c, s, z, idx, val = quantize_lut_dynamic(x, encode, decode, bits, per_side, per_head)
    rows, slots = rows.long(), slots.long()
    codes[rows, :, slots] = c
    at = (rows, slice(None), slots) if per_head else (rows, slots)
    scale[at], zero[at] = s, z
    if per_side:
        out_idx[rows, slots], out_val[rows, slots] = idx, val


def _fresh(t: torch.Tensor, head_axis: bool = True) -> tuple[int, int, int]:
    """(row, slot, head) strides of a fresh output [N, H, ...] (or [N, ...] without a head axis): one row."""
    return 0, t.stride(0), t.stride(1) if head_axis else 0


def _cache(t: torch.Tensor, token_axis: int, head_axis: int | None) -> tuple[int, int, int]:
    """(row, slot, head) strides of a cache buffer whose axis 0 is the row."""
    return t.stride(0), t.stride(token_axis), 0 if head_axis is None else t.stride(head_axis)


def _destination_args(rows, slots, dev):
    if rows is None:
        dummy = torch.empty(1, dtype=torch.int32, device=dev)
        return dummy, dummy, 0
    return rows.contiguous(), slots.contiguous(), 1  # the kernels index them densely (an expanded row has stride 0)


def _f32(t: torch.Tensor, dev) -> torch.Tensor:
    return t.to(device=dev, dtype=torch.float32).contiguous()


def _affine_channels_launch(x, bits, group, codes, cs, scale, zero, ps, rows=None, slots=None) -> None:
    n, h, d = x.shape
    w = words_per_vector(d, bits)
    block = 4  # tokens per program
    row_arg, slot_arg, dest = _destination_args(rows, slots, x.device)
    with launch_device(x):
        _affine_channels_kernel[(triton.cdiv(n, block), h)](
            x, codes, scale, zero, row_arg, slot_arg, n, x.stride(0), x.stride(1), *cs, *ps,
            d, d // group, bits, w, _pow2(w), block, dest, enable_fp_fusion=False)


def _affine_channels_ok(x, bits, group) -> bool:
    n, _, d = x.shape
    return triton is not None and _pow2_ok(d, d // group) and not d % group and d >= 32 and bits <= 8 and n > 0


def quantize_affine_channels_triton(x: torch.Tensor, bits: int, group: int):
    n, h, d = x.shape
    if not _affine_channels_ok(x, bits, group):
        return quantize_affine_channels(x, bits, group)
    x = _rows(x)
    codes = torch.empty(n, h, words_per_vector(d, bits), dtype=torch.int32, device=x.device)
    scale = torch.empty(n, h, d // group, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    _affine_channels_launch(x, bits, group, codes, _fresh(codes), scale, zero, _fresh(scale))
    return codes, scale, zero


def quantize_affine_channels_into_triton(x, bits: int, group: int, codes, scale, zero, rows, slots) -> None:
    if not _affine_channels_ok(x, bits, group):
        return quantize_affine_channels_into(x, bits, group, codes, scale, zero, rows, slots)
    _affine_channels_launch(_rows(x), bits, group, codes, _cache(codes, 2, 1), scale, zero, _cache(scale, 2, 1),
                            rows, slots)


def quantize_affine_token_blocks_triton(x: torch.Tensor, bits: int, block: int):
    n, h, d = x.shape
    if triton is None or not _pow2_ok(d) or d < 32 or bits > 8 or n == 0 or n % block:
        return quantize_affine_token_blocks(x, bits, block)
    x = _rows(x)
    w = words_per_vector(d, bits)
    codes = torch.empty(n, h, w, dtype=torch.int32, device=x.device)
    scale = torch.empty(n // block, h, d, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    with launch_device(x):
        _affine_tokens_kernel[(h, n // block)](x, codes, scale, zero, block, h, x.stride(0), x.stride(1), d, bits, w,
                                               _pow2(w), 4, enable_fp_fusion=False)
    return codes, scale, zero


def quantize_affine_tokens_triton(x: torch.Tensor, bits: int):
    codes, scale, zero = quantize_affine_token_blocks_triton(x, bits, max(x.shape[0], 1))
    return codes, scale[0], zero[0]


def _lut_ok(x, bits) -> bool:
    n, _, d = x.shape
    return triton is not None and _pow2_ok(d) and d >= 32 and bits <= 8 and n > 0


def _outlier_buffers(shape: tuple[int, ...], device):
    """(idx, val) for a fresh outlier store and the kernel's arguments (placeholders without slots)."""
    if not shape[-1]:
        return None, None, torch.empty(1, dtype=torch.int16, device=device), torch.empty(1, dtype=torch.float16, device=device)
    idx = torch.empty(shape, dtype=torch.int16, device=device)
    val = torch.empty(shape, dtype=torch.float16, device=device)
    return idx, val, idx, val


def _lut_static_launch(x, lo, hi, encode, decode, bits, capacity, codes, cs, idx, val, os_, rows=None,
                       slots=None) -> None:
    n, h, d = x.shape
    w = words_per_vector(d, bits)
    row_arg, slot_arg, dest = _destination_args(rows, slots, x.device)
    dev = x.device
    with launch_device(x):
        _lut_static_kernel[(n,)](x, _f32(lo, dev), _f32(hi, dev), _f32(encode, dev), _f32(decode, dev), codes, idx,
                                 val, row_arg, slot_arg, x.stride(0), x.stride(1), h, *cs, *os_,
                                 _pow2(h), d, bits, w, _pow2(w), capacity, dest, enable_fp_fusion=False)


def quantize_lut_static_triton(x, lo, hi, encode, decode, bits: int, capacity: int):
    n, h, d = x.shape
    if not _lut_ok(x, bits):
        return quantize_lut_static(x, lo, hi, encode, decode, bits, capacity)
    x = _rows(x)
    codes = torch.empty(n, h, words_per_vector(d, bits), dtype=torch.int32, device=x.device)
    idx, val, idx_arg, val_arg = _outlier_buffers((n, h, capacity), x.device)
    _lut_static_launch(x, lo, hi, encode, decode, bits, capacity, codes, _fresh(codes), idx_arg, val_arg,
                       _fresh(idx_arg) if capacity else (0, 0, 0))
    return codes, idx, val


def quantize_lut_static_into_triton(x, lo, hi, encode, decode, bits: int, capacity: int, codes, out_idx, out_val,
                                    rows, slots) -> None:
    if not _lut_ok(x, bits):
        return quantize_lut_static_into(x, lo, hi, encode, decode, bits, capacity, codes, out_idx, out_val, rows, slots)
    if not capacity:
        _, _, out_idx, out_val = _outlier_buffers((0,), x.device)
    _lut_static_launch(_rows(x), lo, hi, encode, decode, bits, capacity, codes, _cache(codes, 2, 1), out_idx, out_val,
                       _cache(out_idx, 1, 2) if capacity else (0, 0, 0), rows, slots)


def _lut_dynamic_launch(x, encode, decode, bits, per_side, per_head, codes, cs, scale, zero, ss, idx, val, os_,
                        rows=None, slots=None) -> None:
    n, h, d = x.shape
    w = words_per_vector(d, bits)
    row_arg, slot_arg, dest = _destination_args(rows, slots, x.device)
    dev = x.device
    with launch_device(x):
        _lut_dynamic_kernel[(n, h if per_head else 1)](
            x, _f32(encode, dev), _f32(decode, dev), codes, scale, zero, idx, val, row_arg, slot_arg,
            x.stride(0), x.stride(1), h, *cs, *ss, *os_, 1 if per_head else _pow2(h), d, bits, w, _pow2(w),
            per_side, int(per_head), dest, enable_fp_fusion=False)


def quantize_lut_dynamic_triton(x, encode, decode, bits: int, per_side: int, per_head: bool = False):
    n, h, d = x.shape
    if not _lut_ok(x, bits):
        return quantize_lut_dynamic(x, encode, decode, bits, per_side, per_head)
    x = _rows(x)
    heads = (h,) if per_head else ()
    codes = torch.empty(n, h, words_per_vector(d, bits), dtype=torch.int32, device=x.device)
    scale = torch.empty(n, *heads, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    idx, val, idx_arg, val_arg = _outlier_buffers((n, *heads, 2 * per_side), x.device)
    _lut_dynamic_launch(x, encode, decode, bits, per_side, per_head, codes, _fresh(codes), scale, zero,
                        _fresh(scale, per_head), idx_arg, val_arg, _fresh(idx_arg, per_head) if per_side else (0, 0, 0))
    return codes, scale, zero, idx, val


def quantize_lut_dynamic_into_triton(x, encode, decode, bits: int, per_side: int, per_head: bool, codes, scale, zero,
                                     out_idx, out_val, rows, slots) -> None:
    if not _lut_ok(x, bits):
        return quantize_lut_dynamic_into(x, encode, decode, bits, per_side, per_head, codes, scale, zero, out_idx,
                                         out_val, rows, slots)
    if not per_side:
        _, _, out_idx, out_val = _outlier_buffers((0,), x.device)
    ss = _cache(scale, 2, 1) if per_head else _cache(scale, 1, None)
    os_ = (_cache(out_idx, 1, 2 if per_head else None)) if per_side else (0, 0, 0)
    _lut_dynamic_launch(_rows(x), encode, decode, bits, per_side, per_head, codes, _cache(codes, 2, 1), scale, zero,
                        ss, out_idx, out_val, os_, rows, slots)
