"""Triton kernels of the packed lookup-table quantizers in kvcal/quant/nonuniform.py, bit for bit.

Same arithmetic as the references: parameters rounded to fp16 where the format stores them, IEEE division
(tl.math.div_rn), no FMA contraction (enable_fp_fusion=False), nearest level = number of midpoints below x
(searchsorted, side='left'). Outliers are chosen by repeated argmax, which gives topk's order (largest |residual|
first); on exact ties of |residual| the chosen element may differ from torch.topk. The `_into` versions write token
n of x [N, H, D] to row rows[n], slot slots[n] of a cache's buffers (codes [B, H, T, W], key outlier slots
[B, T, H, cap], value scale/zero [B, T] or [B, H, T], value outlier slots [B, T, cap] or [B, T, H, cap]).
"""

from __future__ import annotations

import torch

from kvcal.quant.packing import launch_device, pow2, words_per_vector
from kvcal.quant.uniform_kernels import (
    cache_strides,
    destination_args,
    fresh_strides,
    pow2_sizes,
    rows_contiguous,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from kvcal.quant.packing import pack_tile
    from kvcal.quant.uniform_kernels import destinations

if triton is not None:

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
        b, t = destinations(n, n >= 0, row_ptr, slot_ptr, DEST)
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
        b, t = destinations(n, n >= 0, row_ptr, slot_ptr, DEST)
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


def _f32(t: torch.Tensor, dev) -> torch.Tensor:
    return t.to(device=dev, dtype=torch.float32).contiguous()


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
    if not n:
        return
    w = words_per_vector(d, bits)
    row_arg, slot_arg, dest = destination_args(rows, slots, x.device)
    dev = x.device
    with launch_device(x):
        _lut_static_kernel[(n,)](x, _f32(lo, dev), _f32(hi, dev), _f32(encode, dev), _f32(decode, dev), codes, idx,
                                 val, row_arg, slot_arg, x.stride(0), x.stride(1), h, *cs, *os_,
                                 pow2(h), d, bits, w, pow2(w), capacity, dest, enable_fp_fusion=False)


def quantize_lut_static_triton(x, lo, hi, encode, decode, bits: int, capacity: int):
    n, h, d = x.shape
    _check(x, bits)
    x = rows_contiguous(x)
    codes = torch.empty(n, h, words_per_vector(d, bits), dtype=torch.int32, device=x.device)
    idx, val, idx_arg, val_arg = _outlier_buffers((n, h, capacity), x.device)
    _lut_static_launch(x, lo, hi, encode, decode, bits, capacity, codes, fresh_strides(codes), idx_arg, val_arg,
                       fresh_strides(idx_arg) if capacity else (0, 0, 0))
    return codes, idx, val


def quantize_lut_static_into_triton(x, lo, hi, encode, decode, bits: int, capacity: int, codes, out_idx, out_val,
                                    rows, slots) -> None:
    _check(x, bits)
    if not capacity:
        _, _, out_idx, out_val = _outlier_buffers((0,), x.device)
    _lut_static_launch(rows_contiguous(x), lo, hi, encode, decode, bits, capacity, codes, cache_strides(codes, 2, 1), out_idx, out_val,
                       cache_strides(out_idx, 1, 2) if capacity else (0, 0, 0), rows, slots)


def _lut_dynamic_launch(x, encode, decode, bits, per_side, per_head, codes, cs, scale, zero, ss, idx, val, os_,
                        rows=None, slots=None) -> None:
    n, h, d = x.shape
    if not n:
        return
    w = words_per_vector(d, bits)
    row_arg, slot_arg, dest = destination_args(rows, slots, x.device)
    dev = x.device
    with launch_device(x):
        _lut_dynamic_kernel[(n, h if per_head else 1)](
            x, _f32(encode, dev), _f32(decode, dev), codes, scale, zero, idx, val, row_arg, slot_arg,
            x.stride(0), x.stride(1), h, *cs, *ss, *os_, 1 if per_head else pow2(h), d, bits, w, pow2(w),
            per_side, int(per_head), dest, enable_fp_fusion=False)


def quantize_lut_dynamic_triton(x, encode, decode, bits: int, per_side: int, per_head: bool = False):
    n, h, d = x.shape
    _check(x, bits)
    x = rows_contiguous(x)
    heads = (h,) if per_head else ()
    codes = torch.empty(n, h, words_per_vector(d, bits), dtype=torch.int32, device=x.device)
    scale = torch.empty(n, *heads, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    idx, val, idx_arg, val_arg = _outlier_buffers((n, *heads, 2 * per_side), x.device)
    _lut_dynamic_launch(x, encode, decode, bits, per_side, per_head, codes, fresh_strides(codes), scale, zero,
                        fresh_strides(scale, per_head), idx_arg, val_arg, fresh_strides(idx_arg, per_head) if per_side else (0, 0, 0))
    return codes, scale, zero, idx, val


def quantize_lut_dynamic_into_triton(x, encode, decode, bits: int, per_side: int, per_head: bool, codes, scale, zero,
                                     out_idx, out_val, rows, slots) -> None:
    _check(x, bits)
    if not per_side:
        _, _, out_idx, out_val = _outlier_buffers((0,), x.device)
    ss = cache_strides(scale, 2, 1) if per_head else cache_strides(scale, 1, None)
    os_ = (cache_strides(out_idx, 1, 2 if per_head else None)) if per_side else (0, 0, 0)
    _lut_dynamic_launch(rows_contiguous(x), encode, decode, bits, per_side, per_head, codes, cache_strides(codes, 2, 1), scale, zero,
                        ss, out_idx, out_val, os_, rows, slots)


def lut_unsupported(x: torch.Tensor, bits: int) -> str | None:
    """Why the lookup-table quantize kernels cannot take x [N, H, D] (None: they can)."""
    d = x.shape[-1]
    if triton is None:
        return "triton is not installed"
    if not (pow2_sizes(d) and d >= 32 and bits <= 8):
        return f"head_dim {d} at {bits} bits (a power of two >= 32, bits <= 8)"
    return None


def _check(x, bits) -> None:
    reason = lut_unsupported(x, bits)
    if reason:
        raise ValueError(f"no Triton quantize kernel: {reason}")
