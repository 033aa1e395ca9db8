"""Triton kernels of CalibQuantStorage (kvcal/methods/calibquant/storage.py), beside its torch references.

Layout: codes [B, Hkv, T, W] int32 (kvcal/quant/packing.py: b-bit codes, 32/b per word, code d at bits [d b, d b + b)
of the row's little-endian stream), per (row, head, range group, channel) float32 step and minimum for K and V
[B, Hkv, NG, D] (NG 1 in the bulk regime, one group over the whole compressed span; T / G with groups of G tokens).

- `write_triton` (reference: CalibQuantStorage.write_reference): program (run, head, K|V) reduces the min and max of
  each channel over its run of tokens (the whole prompt span after the sinks in the bulk regime, a group of G tokens
  otherwise), shrinks them by c, derives step and minimum as the reference rounds them (IEEE division, no FMA
  contraction), stores them, then quantizes and packs the run's tokens into their (row, slot).
- `attend_triton` (reference: CalibQuantStorage.attend_reference): post-scaling, the cache is never dequantized:
  scores x = ((q * step_k) . codes + q . min_k) / sqrt(d), one tensor-core dot per tile with q * step_k made once per
  range group; values (P codes) * step_v + (sum P) min_v. With fp16 / bf16 queries the codes are unpacked by
  unpack_mma (kvcal/quant/packing.py): one mask per pair of codes leaves each code in place inside an fp16 half as an
  exact subnormal code * f * 2^-24, so there is no shift and no int-to-float conversion per code; q * step_k is
  divided by f (a power of two) and 2^24 folded into the scores' scale, and the value columns (in mma_channels order)
  are scaled by step_v * 2^24 / f. float32 / float64 queries unpack with shifts (unpack_tile) and convert.
  The remap of the compressed block's scores (Eq. 7) needs each query head's min and max score over all of the row's
  compressed tokens before its softmax, so:
    pass 1 (`_range_kernel`, only with the remap on): grid (row and KV head, split): the raw dots of the split's
      tiles (scores with groups of tokens), their min and max kept per (token slot, head) and reduced once after
      the loop -> [R, S, G] each (reads the key codes once);
    pass 2 (the split-K skeleton runtime/kernels.split_k_kernel with `_prepare`, `_scores`, `_remap_softmax`,
      `_values`, `_finish`; TAIL): grid (row and KV head, split [+ 1]): every split program reduces pass 1's S minima and
      maxima of its (row, KV head) itself (2 S floats per head), computes the slope (clamped at 0; split 0 counts the
      rows and the clamped rows into a device counter), recomputes its tiles' scores as (raw - min raw) times one
      factor plus one shift per head (scale, remap and log2(e) folded; the difference first, so a row whose scores
      span nothing keeps g exact), and writes its softmax partial (m, l, acc) from the key and value
      codes. Under the remap the softmax reference is fixed: the remap is nondecreasing, so g(delta) is each head's
      largest score, and P = exp2(min(s, m) - m) needs no running max and no rescaling of acc per tile. The full-
      precision part (sinks and generated tokens) is the last split's fp_segment, or from FP_KERNEL_MIN_ROWS (row, KV
      head) pairs the generic kernel's own launch (runtime.kernels.fp_partials_into: fp_segment's registers then do
      not limit pass 2's occupancy). runtime.decode's merge combines the partials.
  Both passes run a split's whole tiles without masks and its last, partial tile after them. With the remap off
  (b >= 4 by default) pass 1 does not run and pass 2 keeps the online softmax.
"""

from __future__ import annotations

import struct
from collections import namedtuple

import torch

from kvcal.quant.packing import launch_device, pow2, words_per_vector
from kvcal.runtime import kernels as K

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # dot operands: fp16 for fp16 and bf16 queries
UNPACK_BITS = (1, 2, 4, 8)
LOG2E = 1.4426950408889634
SCORE_EPS = 1e-8  # [C] in the remap's denominator (storage.SCORE_EPS)
STEP_FLOOR = 1e-6  # storage.STEP_FLOOR
DEFAULT_BLOCK_T = 32  # tokens per tile (1 warp): a tile lies inside one range group
# pass 1's register cap for one-warp programs on the unpack_mma path: 128 a thread lets 16 programs share an SM (the
# default split count's 16 per SM in one wave); uncapped, sm_90 ptxas gives it 129 (15 per SM), capped no spills
RANGE_REGISTERS = 128
FP_KERNEL_MIN_ROWS = 64
# pass 2's constants C (runtime/kernels.split_k_kernel's tile functions)
Consts = namedtuple("Consts", "D G GP SP BITS GROUP REMAP BLOCK_T PREC MMA ALIGN INTERP")  # (row, KV head) pairs from which the full-precision part is a launch of its own (fp_kernel)

if triton is not None:
    from kvcal.quant.packing import mma_channels, mma_code_scale, pack_tile, unpack_mma, unpack_tile
    from kvcal.quant.tiles import dot, mma_operand, operand
    from kvcal.quant.uniform_kernels import rint
    from kvcal.runtime.kernels import split_bounds

    @triton.jit
    def _div(a, b, ACC: tl.constexpr):
        if ACC == tl.float64:
            return a / b
        else:
            return tl.math.div_rn(a, b)

    # ---- write: ranges over a run of tokens, codes packed into (row, slot)

    @triton.jit
    def _write_kernel(x_ptr, sxn, sxh, row_ptr, slot_ptr, RUN, c_ptr, scb, sch, sct, s_ptr, m_ptr, ssb, ssh, ssg,
                      c, GROUP: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                      WP: tl.constexpr, R: tl.constexpr):
        """Program (j, h): tokens [j RUN, (j + 1) RUN) of x [N, H, D] (keys or values), head h; c the range shrink."""
        LEVELS: tl.constexpr = (1 << BITS) - 1
        j = tl.program_id(0)
        h = tl.program_id(1)
        ACC: tl.constexpr = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
        d = tl.arange(0, D)
        first = j * RUN
        mn = tl.full((D,), float("inf"), ACC)
        mx = tl.full((D,), float("-inf"), ACC)
        for n0 in range(0, RUN, R):
            n = n0 + tl.arange(0, R)
            nm = n < RUN
            x = tl.load(x_ptr + (first + n)[:, None] * sxn + h * sxh + d[None, :], mask=nm[:, None],
                        other=0.0).to(ACC)
            mn = tl.minimum(mn, tl.min(tl.where(nm[:, None], x, float("inf")), 0))
            mx = tl.maximum(mx, tl.max(tl.where(nm[:, None], x, float("-inf")), 0))
        alpha = mn * tl.cast(c, ACC)
        beta = mx * tl.cast(c, ACC)
        step = _div(beta - alpha, tl.full((D,), LEVELS, ACC), ACC)
        floor = 1e-6 * tl.maximum(tl.maximum(tl.abs(alpha), tl.abs(beta)), 1.0)  # STEP_FLOOR (§7.9)
        step = tl.maximum(step, floor)
        step32 = step.to(tl.float32)  # stored as float32 (digest §7.14); codes from the stored values
        min32 = alpha.to(tl.float32)
        b0 = tl.load(row_ptr + first).to(tl.int64)
        t0 = tl.load(slot_ptr + first).to(tl.int64)
        if GROUP == 0:
            g = t0 * 0
        else:
            g = t0 // GROUP
        at = b0 * ssb + h * ssh + g * ssg + d
        tl.store(s_ptr + at, step32)
        tl.store(m_ptr + at, min32)
        w = tl.arange(0, WP)
        for n0 in range(0, RUN, R):
            n = n0 + tl.arange(0, R)
            nm = n < RUN
            x = tl.load(x_ptr + (first + n)[:, None] * sxn + h * sxh + d[None, :], mask=nm[:, None],
                        other=0.0).to(ACC)
            y = _div(x - min32.to(ACC)[None, :], tl.broadcast_to(step32.to(ACC)[None, :], (R, D)), ACC)
            codes = tl.minimum(tl.maximum(rint(y), 0.0), LEVELS * 1.0).to(tl.int32)
            words = pack_tile(codes, R, D, BITS, WP)
            b = tl.load(row_ptr + first + n, mask=nm, other=0).to(tl.int64)
            t = tl.load(slot_ptr + first + n, mask=nm, other=0).to(tl.int64)
            tl.store(c_ptr + (b * scb + h * sch + t * sct)[:, None] + w[None, :], words,
                     mask=nm[:, None] & (w < W)[None, :])

    # ---- decode attention

    @triton.jit
    def _channels(D: tl.constexpr, BITS: tl.constexpr, MMA: tl.constexpr):
        """The channel of each code column: unpack_mma's order (mma_channels) or the natural one."""
        if MMA:
            return mma_channels(0, D, BITS)
        else:
            return tl.arange(0, D)

    @triton.jit
    def _codes(rowptr, tm, D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr,
               MMA: tl.constexpr, INTERP: tl.constexpr, ACC: tl.constexpr):
        """A tile's codes [BLOCK_T, D] as a dot operand. MMA (fp16 operands): unpack_mma's in-register masking, column
        c holds code * f_c * 2^-24 in the order of _channels (no integer shift, no conversion per code); else
        unpack_tile's codes in channel order, converted."""
        if MMA:
            return mma_operand(unpack_mma(rowptr, tm, 0, D, D, BITS, BLOCK_T), PREC, INTERP)
        else:
            return operand(unpack_tile(rowptr, tm, 0, D, D, BITS, BLOCK_T).to(ACC), PREC)

    @triton.jit
    def _query_terms(q_row, sqh, s_base, m_base, rk, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                     PREC: tl.constexpr, MMA: tl.constexpr, ACC: tl.constexpr):
        """q * step [D, GP] as a dot operand (rows in _channels order; MMA: divided by the code columns' f, exact: a
        power of two) and q . min [GP] of one range group (post-scaling, Eq. 6)."""
        ch = _channels(D, BITS, MMA)
        qf = tl.load(q_row + rk[None, :] * sqh + ch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
        step = tl.load(s_base + ch).to(ACC)
        minimum = tl.load(m_base + ch).to(ACC)
        qs = qf * step[:, None]
        if MMA:
            qs = qs / mma_code_scale(D, BITS).to(ACC)[:, None]
        return operand(qs, PREC), tl.sum(qf * minimum[:, None], 0)

    @triton.jit
    def _raw_scores(kc_base, t, tm, skt, qs, ALIGN: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                    BLOCK_T: tl.constexpr, PREC: tl.constexpr, MMA: tl.constexpr, INTERP: tl.constexpr,
                    ACC: tl.constexpr):
        """(q * step) . codes [BLOCK_T, GP] of a tile, times 2^-24 under MMA (callers fold CODE_UNIT)."""
        codes = _codes(kc_base + tl.multiple_of(t * skt, ALIGN), tm, D, BITS, BLOCK_T, PREC, MMA, INTERP, ACC)
        return dot(codes, qs, INTERP).to(ACC)

    @triton.jit
    def _tile_mask(t0, end, BLOCK_T: tl.constexpr, MASKED: tl.constexpr):
        """The tile's token slots and their mask (a constant true one for a whole tile: unmasked loads)."""
        t = t0 + tl.arange(0, BLOCK_T)
        if MASKED:
            return t, t < end
        else:
            return t, tl.full((BLOCK_T,), 1, tl.int1)

    @triton.jit
    def _range_tile(kc_base, t0, end, skt, q_row, sqh, s_base, m_base, ssg, rk, qs, qc, lo, hi, scale,
                    UNIT: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_T: tl.constexpr, PREC: tl.constexpr, MMA: tl.constexpr, ALIGN: tl.constexpr,
                    MASKED: tl.constexpr, INTERP: tl.constexpr, ACC: tl.constexpr):
        """Pass 1 over one tile: the per-slot minima and maxima lo, hi [BLOCK_T, GP] updated (raw dots with one range
        group, scores with groups of GROUP tokens)."""
        t, tm = _tile_mask(t0, end, BLOCK_T, MASKED)
        if GROUP != 0:
            g = t0 // GROUP
            qs, qc = _query_terms(q_row, sqh, s_base + g * ssg, m_base + g * ssg, rk, G, D, BITS, PREC, MMA, ACC)
            x = (_raw_scores(kc_base, t, tm, skt, qs, ALIGN, D, BITS, BLOCK_T, PREC, MMA, INTERP, ACC) * UNIT
                 + qc[None, :]) * scale
        else:
            x = _raw_scores(kc_base, t, tm, skt, qs, ALIGN, D, BITS, BLOCK_T, PREC, MMA, INTERP, ACC)
        if MASKED:
            return (tl.minimum(lo, tl.where(tm[:, None], x, float("inf"))),
                    tl.maximum(hi, tl.where(tm[:, None], x, float("-inf"))))
        else:
            return tl.minimum(lo, x), tl.maximum(hi, x)

    @triton.jit
    def _range_kernel(q_ptr, sqb, sqh, len_ptr, kc_ptr, skb, skh, skt, ks_ptr, km_ptr, ssb, ssh, ssg,
                      mn_ptr, mx_ptr, HKV, scale_hi, scale_lo, NSPLIT,
                      D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_T: tl.constexpr, PREC: tl.constexpr, MMA: tl.constexpr, ALIGN: tl.constexpr,
                      INTERP: tl.constexpr):
        """Pass 1: min and max of the scores per query head over the tokens of split `split` of a (row, KV head)."""
        ACC: tl.constexpr = mn_ptr.dtype.element_ty
        if PREC == 64:
            scale = tl.cast(scale_hi, ACC) + tl.cast(scale_lo, ACC)
        else:
            scale = scale_hi
        UNIT: tl.constexpr = 16777216.0 if MMA else 1.0  # unpack_mma's codes are code * f * 2^-24
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        q_row = q_ptr + b * sqb + h * G * sqh
        rk = tl.arange(0, GP)
        start, end = split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T)
        kc_base = kc_ptr + tl.multiple_of(b * skb + h * skh, ALIGN)
        s_base = ks_ptr + b * ssb + h * ssh
        m_base = km_ptr + b * ssb + h * ssh
        # the min and max per (token slot, head) of the tile, reduced over the slots once after the loop, not per
        # tile (no shuffles in the loop)
        lo = tl.full((BLOCK_T, GP), float("inf"), ACC)
        hi = tl.full((BLOCK_T, GP), float("-inf"), ACC)
        if GROUP == 0:
            qs, qc = _query_terms(q_row, sqh, s_base, m_base, rk, G, D, BITS, PREC, MMA, ACC)
        else:  # per tile (_range_tile)
            qs, qc = _query_terms(q_row, sqh, s_base, m_base, rk, G, D, BITS, PREC, MMA, ACC)
        # whole tiles without masks, then the split's last, partial tile (splits start on tile boundaries)
        full = start + tl.maximum(end - start, 0) // BLOCK_T * BLOCK_T
        for t0 in range(start, full, BLOCK_T):
            lo, hi = _range_tile(kc_base, t0, end, skt, q_row, sqh, s_base, m_base, ssg, rk, qs, qc, lo, hi, scale,
                                 UNIT, G, D, BITS, GROUP, BLOCK_T, PREC, MMA, ALIGN, False, INTERP, ACC)
        for t0 in range(full, end, BLOCK_T):
            lo, hi = _range_tile(kc_base, t0, end, skt, q_row, sqh, s_base, m_base, ssg, rk, qs, qc, lo, hi, scale,
                                 UNIT, G, D, BITS, GROUP, BLOCK_T, PREC, MMA, ALIGN, True, INTERP, ACC)
        # GROUP 0: the raw dots' (pass 2 needs raw - min raw exactly: see the notes above _prepare); groups: the scores
        lo = tl.min(lo, 0)
        hi = tl.max(hi, 0)
        part = pid * NSPLIT + split
        tl.store(mn_ptr + part * G + rk, lo, mask=rk < G)
        tl.store(mx_ptr + part * G + rk, hi, mask=rk < G)

    # ---- pass 2: tile functions of runtime/kernels.split_k_kernel (whole tiles, then the tail: TAIL). args: (key
    # codes, their (row, head, token) strides, the same for values, key step, minimum, value step, minimum, their
    # (row, head, group) strides, pass 1's minima and maxima, tau1, tau2, the counters, the score scale's float32
    # parts, the row lengths, pass 1's splits); C: Consts. Scores s in log2 units: raw * sa + sb without the remap;
    # under it (x - gamma) * sa + sb with x - gamma taken before the slope multiplies it: the slope is huge where a
    # row's scores span nothing (one compressed token, tau1 > tau2: (tau1 - tau2) / 1e-8), and g(x) = slope (x -
    # gamma) + gamma - tau1 stays exact only when x - gamma is (0 at the minimum's token, whose raw dot pass 1
    # computed the same way). GROUP 0: x - gamma = (raw - min raw) * scale * UNIT (ref: min raw); groups: x as pass 1
    # computes it, minus ref = gamma. The state st: (code bases, parameter bases, the value columns' channels and
    # unit, q * step and q . min, sa, sb, ref, scale, m_fix, the query row and its head stride).

    @triton.jit
    def _prepare(args, C: tl.constexpr, q_row, sqh, b, h, pid, start, end, qk_scale):
        """Per (row, KV head): the query terms and, under the remap, gamma and delta of each query head over all of
        the row's compressed tokens (pass 1's splits), the slope and the fixed softmax reference m_fix."""
        D: tl.constexpr = C[0]
        G: tl.constexpr = C[1]
        GP: tl.constexpr = C[2]
        SP: tl.constexpr = C[3]
        BITS: tl.constexpr = C[4]
        GROUP: tl.constexpr = C[5]
        REMAP: tl.constexpr = C[6]
        BLOCK_T: tl.constexpr = C[7]
        PREC: tl.constexpr = C[8]
        MMA: tl.constexpr = C[9]
        ALIGN: tl.constexpr = C[10]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        kc_ptr, skb, skh, skt, vc_ptr, svb, svh, svt, ks_ptr, km_ptr, vs_ptr, vm_ptr, ssb, ssh, ssg, mn_ptr, mx_ptr, \
            tau1_ptr, tau2_ptr, count_ptr, scale_hi, scale_lo, len_ptr, NSPLIT = args
        if PREC == 64:
            scale = tl.cast(scale_hi, ACC) + tl.cast(scale_lo, ACC)
        else:
            scale = scale_hi
        UNIT: tl.constexpr = 16777216.0 if MMA else 1.0  # unpack_mma's codes are code * f * 2^-24
        rk = tl.arange(0, GP)
        kc_base = kc_ptr + tl.multiple_of(b * skb + h * skh, ALIGN)
        vc_base = vc_ptr + tl.multiple_of(b * svb + h * svh, ALIGN)
        ks_base = ks_ptr + b * ssb + h * ssh
        km_base = km_ptr + b * ssb + h * ssh
        vs_base = vs_ptr + b * ssb + h * ssh
        vm_base = vm_ptr + b * ssb + h * ssh
        vch = _channels(D, BITS, MMA)  # the channel of each value code column (and of acc's columns)
        if MMA:
            vunit = 16777216.0 / mma_code_scale(D, BITS).to(ACC)
        else:
            vunit = tl.full((D,), 1.0, ACC)
        # s = x' log2(e) with x' the (remapped) score, per head: raw * sa + sb, or (x - ref) * sa + sb under the remap
        sa = tl.full((GP,), scale * UNIT * 1.4426950408889634, ACC)
        qs, qc = _query_terms(q_row, sqh, ks_base, km_base, rk, G, D, BITS, PREC, MMA, ACC)
        sb = qc * scale * 1.4426950408889634  # GROUP 0 without the remap (groups: per tile)
        ref = sa  # not read without the remap
        m_fix = sa  # not read without the remap
        if REMAP:
            sp = tl.arange(0, SP)
            at = (pid * NSPLIT + sp)[:, None] * G + rk[None, :]
            ok = (sp < NSPLIT)[:, None] & (rk < G)[None, :]
            has = tl.load(len_ptr + b) > 0
            live = (rk < G) & has  # padding heads and empty rows: 0, as the reference (no nan in padding)
            lo = tl.where(live, tl.min(tl.load(mn_ptr + at, mask=ok, other=float("inf")), 0), 0.0)
            hi = tl.where(live, tl.max(tl.load(mx_ptr + at, mask=ok, other=float("-inf")), 0), 0.0)
            if GROUP == 0:  # raw dots -> scores, increasing (scale > 0); span from the raw difference
                gamma = (lo * UNIT + qc) * scale
                span = (hi - lo) * UNIT * scale
                ref = lo
            else:
                gamma = lo
                span = hi - lo
                ref = lo
            tau1 = tl.load(tau1_ptr + h * G + rk, mask=rk < G, other=0.0).to(ACC)
            tau2 = tl.load(tau2_ptr + h * G + rk, mask=rk < G, other=0.0).to(ACC)
            slope = (span + tau1 - tau2) / (span + 1e-8)  # SCORE_EPS
            clamped = (slope < 0) & live
            slope = tl.maximum(slope, 0.0)
            # Eq. 7 with the slope clamp: g(x) = slope (x - gamma) + gamma - tau1
            if GROUP == 0:
                sa = sa * slope
            else:
                sa = slope * 1.4426950408889634
            sb = (gamma - tau1) * 1.4426950408889634
            # g is nondecreasing, so g(delta) is each head's largest remapped score over the row's compressed tokens:
            # a fixed softmax reference instead of a running max (no rescaling of acc per tile). The recomputed
            # scores may exceed it by a rounding: clamped to it (exp2 <= 1, no overflow).
            m_fix = (hi - lo) * sa + sb
            if tl.program_id(1) == 0:
                tl.atomic_add(count_ptr, tl.where(has, G, 0).to(tl.int64))
                tl.atomic_add(count_ptr + 1, tl.sum(clamped.to(tl.int64), 0))
        st = (kc_base, vc_base, ks_base, km_base, vs_base, vm_base, vch, vunit, qs, qc, sa, sb, ref, scale, m_fix,
              q_row, sqh)
        # REMAP: sum P per (token slot, head), reduced after the loop
        return st, (tl.zeros((GP, D), ACC), tl.zeros((BLOCK_T, GP), ACC))

    @triton.jit
    def _scores(args, C: tl.constexpr, st, t0, t, tm, end, qk_scale):
        """A tile's (remapped) scores; with range groups, the group's query terms and value parameters per tile."""
        D: tl.constexpr = C[0]
        G: tl.constexpr = C[1]
        GP: tl.constexpr = C[2]
        BITS: tl.constexpr = C[4]
        GROUP: tl.constexpr = C[5]
        REMAP: tl.constexpr = C[6]
        BLOCK_T: tl.constexpr = C[7]
        PREC: tl.constexpr = C[8]
        MMA: tl.constexpr = C[9]
        ALIGN: tl.constexpr = C[10]
        INTERP: tl.constexpr = C[11]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        UNIT: tl.constexpr = 16777216.0 if MMA else 1.0
        skt = args[3]
        ssg = args[14]
        kc_base, vc_base, ks_base, km_base, vs_base, vm_base, vch, vunit, qs, qc, sa, sb, ref, scale, m_fix, q_row, \
            sqh = st
        rk = tl.arange(0, GP)
        if GROUP != 0:
            g = t0 // GROUP
            qs, qc = _query_terms(q_row, sqh, ks_base + g * ssg, km_base + g * ssg, rk, G, D, BITS, PREC, MMA, ACC)
            if not REMAP:
                sb = qc * scale * 1.4426950408889634
            v_step = tl.load(vs_base + g * ssg + vch).to(ACC) * vunit
            v_min = tl.load(vm_base + g * ssg + vch).to(ACC)
        else:
            v_step = vunit  # not read: step and minimum are applied after the loop (_finish)
            v_min = vunit
        raw = _raw_scores(kc_base, t, tm, skt, qs, ALIGN, D, BITS, BLOCK_T, PREC, MMA, INTERP, ACC)
        if REMAP:
            if GROUP == 0:
                s = (raw - ref[None, :]) * sa[None, :] + sb[None, :]
            else:
                s = ((raw * UNIT + qc[None, :]) * scale - ref[None, :]) * sa[None, :] + sb[None, :]
        else:
            s = raw * sa[None, :] + sb[None, :]
        return s, (v_step, v_min), st

    @triton.jit
    def _remap_softmax(C: tl.constexpr, st, s, m_i, l_i, ok):
        """Under the remap the softmax reference is fixed (m_fix): P = exp2(min(s, m) - m), nothing to rescale."""
        m_fix = st[14]
        p = tl.where(ok[None, :], tl.exp2(tl.minimum(s, m_fix[None, :]) - m_fix[None, :]), 0.0)
        return p, m_fix, m_i, l_i

    @triton.jit
    def _values(args, C: tl.constexpr, st, tile, acc, p, alpha, t, tm):
        """The value codes' contribution to acc [GP, D] (columns in vch order); under the remap also sum P per slot."""
        D: tl.constexpr = C[0]
        BITS: tl.constexpr = C[4]
        GROUP: tl.constexpr = C[5]
        REMAP: tl.constexpr = C[6]
        BLOCK_T: tl.constexpr = C[7]
        PREC: tl.constexpr = C[8]
        MMA: tl.constexpr = C[9]
        ALIGN: tl.constexpr = C[10]
        INTERP: tl.constexpr = C[11]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        svt = args[7]
        v_step, v_min = tile
        acc, l_t = acc
        vcodes = _codes(st[1] + tl.multiple_of(t * svt, ALIGN), tm, D, BITS, BLOCK_T, PREC, MMA, INTERP, ACC)
        pv = dot(operand(tl.trans(p), PREC), vcodes, INTERP).to(ACC)  # [GP, D], columns in vch order
        if REMAP:  # fixed reference: nothing to rescale
            l_t += p
            if GROUP == 0:  # one range group: step and minimum applied once, after the loop (sum P is l)
                acc = acc + pv
            else:
                acc = acc + pv * v_step[None, :] + tl.sum(p, 0)[:, None] * v_min[None, :]
        else:
            if GROUP == 0:
                acc = acc * alpha[:, None] + pv
            else:
                acc = acc * alpha[:, None] + pv * v_step[None, :] + tl.sum(p, 0)[:, None] * v_min[None, :]
        return acc, l_t

    @triton.jit
    def _finish(args, C: tl.constexpr, st, acc, m_i, l_i):
        """Under the remap l from the per-slot sums and m the fixed reference (a split without tokens: the empty
        partial); one range group: its step and minimum applied once."""
        GROUP: tl.constexpr = C[5]
        PREC: tl.constexpr = C[8]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        acc, l_t = acc
        vch = st[6]
        if C[6]:  # REMAP
            l_i = tl.sum(l_t, 0)
            m_i = tl.where(l_i > 0, st[14], float("-inf"))
        if GROUP == 0:
            v_step = tl.load(st[4] + vch).to(ACC) * st[7]
            v_min = tl.load(st[5] + vch).to(ACC)
            acc = acc * v_step[None, :] + l_i[:, None] * v_min[None, :]
        return acc, vch, tl.arange(0, C[2]), m_i, l_i  # heads first (launch_split_k heads_first)


def write_triton(packed, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                 bits: int, group: int, run: int, k_scale: float, v_scale: float) -> None:
    """Quantize and pack keys / values [M, H, D] (runs of `run` consecutive slots of one row each) into `packed`."""
    count, heads, dim = keys.shape
    if count == 0:
        return
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    nwords = words_per_vector(dim, bits)
    opts = {"enable_fp_fusion": False}  # the reference's roundings: no FMA contraction
    with launch_device(keys):
        for x, side, c in ((keys, "k", k_scale), (values, "v", v_scale)):
            codes, step, minimum = packed[f"{side}_codes"], packed[f"{side}_step"], packed[f"{side}_min"]
            _write_kernel[(count // run, heads)](
                x, x.stride(0), x.stride(1), rows, slots, run, codes, *codes.stride()[:3], step, minimum,
                *step.stride()[:3], float(c), GROUP=group, D=dim, BITS=bits, W=nwords, WP=pow2(nwords), R=16, **opts)


def block_tokens(group: int, block_t: int | None = None) -> int:
    """Tokens per tile: `block_t` (default 32), halved until it divides a range group of `group` tokens (0: one
    group)."""
    bt = block_t or DEFAULT_BLOCK_T
    if group:
        while group % bt:
            bt //= 2
    return bt


def unsupported(q: torch.Tensor, packed, bits: int, group: int) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    if bits not in UNPACK_BITS:
        return f"{bits}-bit codes (the kernels unpack {', '.join(map(str, UNPACK_BITS))} bits)"
    if group and group % 16:
        return f"range groups of {group} tokens (the kernel's tiles of >= 16 tokens lie inside one group)"
    return None


def attend_triton(q: torch.Tensor, packed, scale: float, fp, bits: int, group: int, remap: bool,
                  tau1: torch.Tensor | None, tau2: torch.Tensor | None, counts: torch.Tensor, *,
                  block_t: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, programs_per_sm: int | None = None, block_f: int | None = None,
                  mma: bool | None = None, fp_kernel: bool | None = None, range_registers: int | None = None):
    """Partials of q [B, Hq, D] over CalibQuant's packed tokens (pass 1 and pass 2 of the module docstring) and the
    full-precision part `fp`. counts [2] int64 (device): rows remapped and rows whose slope was clamped, added to.
    Keyword-only tuning knobs: block_t, num_splits (default from programs_per_sm, 16, x SMs), num_warps, num_stages,
    block_f (full-precision tile), mma (fp16 / bf16 queries: codes unpacked by unpack_mma's in-register masking,
    the default; False: unpack_tile's shifts and conversions), fp_kernel (fp16 / bf16 queries: the full-precision
    part by the generic kernel (runtime.kernels.fp_partials_into, chunks of FP_CHUNK tokens) in a second launch
    instead of pass 2's last split, whose fp_segment sets pass 2's register count (246 against 172 registers a
    thread at one warp, sm_90 ptxas: 8 against 11 one-warp programs per SM); default from FP_KERNEL_MIN_ROWS (row,
    KV head) pairs), range_registers (pass 1's register cap a thread, 0 none; default RANGE_REGISTERS for one-warp
    programs on the unpack_mma path)."""
    q, batch, hkv, group_q, d, dev = K.decode_dims(q, packed.heads)
    kc, vc = packed["k_codes"], packed["v_codes"]
    ks, km, vs, vm = packed["k_step"], packed["k_min"], packed["v_step"], packed["v_min"]
    bt = block_tokens(group, block_t)
    if q.dtype == torch.float64 and block_t is None:
        bt = min(bt, 16)  # the float64 dot is a broadcast product: keep its block small
    nsplit = K.split_count(num_splits, programs_per_sm, dev, batch * hkv, kc.shape[2], bt)
    gp = max(pow2(group_q), 16)
    prec = PREC.get(q.dtype, 16)
    separate = fp is not None and prec == 16 and (
        batch * hkv >= FP_KERNEL_MIN_ROWS if fp_kernel is None else bool(fp_kernel))
    opts = {"num_warps": num_warps or (4 if q.dtype == torch.float64 else 1)}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    use_mma = prec == 16 and (mma is None or bool(mma))
    hi, lo = _scale_parts(scale)
    kc_s, vc_s, st_s = kc.stride()[:3], vc.stride()[:3], ks.stride()[:3]
    align = _alignment(kc, vc)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dummy, _ = K.placeholders(dev)
    if remap:
        mn = torch.empty(batch * hkv, nsplit, group_q, dtype=acc_dtype, device=dev)
        mx = torch.empty_like(mn)
    else:
        mn = mx = dummy  # not read
    range_opts = dict(opts)
    cap = range_registers if range_registers is not None else (
        RANGE_REGISTERS if use_mma and opts["num_warps"] == 1 and not K.INTERPRET else 0)
    if cap:
        range_opts["maxnreg"] = int(cap)
    with launch_device(q):
        if remap:
            _range_kernel[(batch * hkv, nsplit)](
                q, q.stride(0), q.stride(1), packed.lengths, kc, *kc_s, ks, km, *st_s, mn, mx, hkv, hi, lo, nsplit,
                D=d, G=group_q, GP=gp, BITS=bits, GROUP=group, BLOCK_T=bt, PREC=prec, MMA=int(use_mma), ALIGN=align,
                INTERP=K.INTERPRET, **range_opts)
    args = (kc, *kc_s, vc, *vc_s, ks, km, vs, vm, *st_s, mn, mx, tau1 if remap else dummy, tau2 if remap else dummy,
            counts, hi, lo, packed.lengths, nsplit)
    consts = Consts(d, group_q, gp, pow2(nsplit), bits, group, int(remap), bt, prec, int(use_mma), align, K.INTERPRET)
    return K.launch_split_k((_prepare, _scores, _values, _finish), q, packed.lengths, scale, fp, nsplit, hkv, args,
                            consts, gpk=gp, block_t=bt, block_f=block_f, prec=prec, opts=opts,
                            fp_in_kernel=not separate, softmax=_remap_softmax if remap else None, whole_tiles=True,
                            heads_first=True)


def _alignment(*codes: torch.Tensor) -> int:
    """Words (1, 2 or 4) by which every code row of these buffers is aligned: row, head and token strides and the
    storage offsets are multiples of it (the kernels' tl.multiple_of hints: 16-byte loads of a 1-bit row of 128
    channels instead of four 4-byte ones)."""
    align = 4
    for t in codes:
        for n in (*t.stride()[:3], t.storage_offset(), t.shape[-1]):
            while n % align:
                align //= 2
    return align


def _scale_parts(scale: float) -> tuple[float, float]:
    """scale as a float32 part and the rest (kernels take scalars as float32; float64 kernels add both)."""
    hi = struct.unpack("f", struct.pack("f", float(scale)))[0]
    return hi, float(scale) - hi
