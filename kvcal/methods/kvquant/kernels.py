"""KVQuant's decode kernels: attention of one query per row over nuq codes (a sorted table of 2^b levels per layer)
with sparse fp16 outliers: keys per channel before RoPE with calibrated ranges, values per token (or per token and
head) with ranges of their own. The torch reference is KVQuantStorage.attend_reference
(kvcal/methods/kvquant/storage.py).

The tile kernel (the split-K skeleton runtime/kernels.split_k_kernel with this module's tile functions `_prepare`,
`_scores`, `_values`, `_finish`; grid (B * Hkv, S)): program (row, KV head, split) over all G query heads of the KV
head, an online softmax over BLOCK_T-token tiles; split NSPLIT takes the full-precision part (the sink tokens).
Keys are rotated at attention time. RoPE by angle addition (default): q.R(p0 + j)k = (R(-p0) q).(R(j) k) with R(j)
from table rows 0..BLOCK_T-1 kept in registers and R(-p0) applied to q once per tile; this needs cos/sin tables that
are cos/sin(position * inv_freq) duplicated over the two halves (what rope_cos_sin builds). rope_mode="table" reads
the tables at each token's position instead (any tables, more traffic). Two key paths:

- the lookup-table path (LUT_MMA: fp16/bf16 queries, <= 4 bits): table values straight into fp16 dot operands
  (packing.unpack_lut: two warp shuffles per 32-bit pair), the keys' static per-channel scale/zero and R(j) applied to
  the two halves in fp16 pairs (_dequant_rotate);
- the float32 path (float32 and float64 queries): a tile dequantized in float32 in two halves (table by tl.gather
  from a register table), rotated, two dots.

Sparse outliers. A cache stores fp16 residuals at a few channels per token (1% by default): key slots per (token, KV
head), value slots per token over all heads or per (token, head). For fp16 and bf16 queries they run as two light
passes around the tile kernel; float32 and float64 add them to the dequantized tiles inside it, as the reference
does, without atomics:

1. `key_outlier_scores`, before the tile kernel: a key residual r at channel d of token t adds r (R(p_t)^T q)[d] to
   each query head's score (two query entries times cos/sin at the token's position, not a pass over every channel).
   One float32 per (token, query head), in the buffer the tile kernel then reads and adds to its scores.
2. The tile kernel writes each tile's scores (log2 domain, softmax scale applied) over those corrections.
3. `value_outlier_sums`, after it: a value residual r at channel d of token t adds p_t r to channel d of the output,
   with p_t = 2^(s_t - m) and m the final max of the token's split (the kernel's partial): relaxed vector atomics
   into a [row and KV head, split, channel, head of the group] buffer that the merge adds to each split's
   accumulator (Partials.extra). Their order, and so a float32 sum's last bits, changes from run to run; under
   torch.use_deterministic_algorithms(True) the sums are int64 fixed point instead (integer additions: the same bits
   in any order; about 2x the float pass's time).

Inside the tile kernel's loop the same sums cost more than its dense part: each slot was a gather and a layout
change, and one-warp programs waited on loads that depended on other loads; the passes are faster (measured at 32K x
batch 8, docs/runtime.md). Each pass has a torch reference with the same signature; tests compare them.
"""

from __future__ import annotations

from collections import namedtuple

import torch

from kvcal.quant.packing import launch_device, pow2
from kvcal.runtime import kernels as K
from kvcal.runtime.kernels import split_share

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # rounded dot operands: fp16 for fp16 and bf16 queries
UNPACK_BITS = (1, 2, 3, 4, 8)
# (block_t, num_warps, num_stages, max registers), chosen by measurement at 32K x batch 8 (docs/runtime.md): the
# float32 path and the lookup-table path (fp16 operands from table lookups)
DEFAULTS = {"generic": (32, 4, 2, None), "lut": (16, 1, 2, None)}
# tiles ahead whose code rows are prefetched into L2 (one tile ahead: faster for nuq4 at 32K x batch 8)
PREFETCH_DEFAULT = 1
# The value pass (fp16 / bf16) sums in float32 (the atomics' order, and so the last bits, change from run to run)
# unless torch.use_deterministic_algorithms(True) is on, then in int64 fixed point (slower, docs/runtime.md); True:
# fixed point always
VALUE_PASS_FIXED = False
MERGE_WARPS = 4


# ---- torch references of the outlier passes ---------------------------------------------------------------------

def key_outlier_scores_ref(q, out_idx, out_val, lengths, cos, sin, pos_offset: int, out, inv_freq=None):
    """Score corrections of the key residuals into `out` [B * Hkv, Tcap, GP] float32 (column g < G: query head
    h G + g; rows past a row's length are left as they are). q [B, Hq, D] post-RoPE query; out_idx / out_val
    [B, Tcap, Hkv, cap] (int16 channel index over all heads, -1 empty; fp16 residual); cos / sin [Tmax, D]
    position tables or None (keys stored after RoPE); slot t of a row sits at position pos_offset + t. inv_freq
    [D / 2] where the tables are cos/sin(position * inv_freq): the kernel then computes the angles (the reference
    reads the tables either way)."""
    batch, hq, d = q.shape
    hkv = out_idx.shape[2]
    group = hq // hkv
    qf = q.float().reshape(batch, hkv, group, d)
    for b in range(batch):
        n = int(lengths[b])
        for h in range(hkv):
            idx = out_idx[b, :n, h].long() - h * d  # [n, cap]
            ok = (idx >= 0) & (idx < d)
            r = torch.where(ok, out_val[b, :n, h].float(), 0.0)
            kres = torch.zeros(n, d, device=q.device)
            kres.scatter_add_(1, torch.where(ok, idx, 0), r)
            if cos is not None:  # R(p) of the residual vector: k cos + rotate_half(k) sin
                pos = slice(pos_offset, pos_offset + n)
                half = d // 2
                rot = torch.cat([-kres[:, half:], kres[:, :half]], 1)
                kres = kres * cos[pos].float() + rot * sin[pos].float()
            out[b * hkv + h, :n, :group] = kres @ qf[b, h].T
    return out


def value_outlier_sums_ref(scores, m_part, out_idx, out_val, lengths, num_splits: int, block_t: int, out):
    """Add sum_t 2^(s_t - m) r_t to out[row, split, d, g] (float32 [B * Hkv, S, D, GP], zeroed by the caller; the
    reduction adds it to the split's partial sum) for the value residuals r_t at channel d of row and KV head `row`;
    scores [B * Hkv, Tcap, GP] (log2 domain), m_part [B * Hkv, S, G] (each split's final max); out_idx / out_val
    [B, Tcap, cap] per token over all heads or [B, Tcap, Hkv, cap]."""
    batch = out_idx.shape[0]
    hkv = scores.shape[0] // batch
    head_dim, group = out.shape[2], m_part.shape[-1]
    for b in range(batch):
        n = int(lengths[b])
        if n == 0:
            continue
        share = split_share(n, num_splits, block_t)
        idx = out_idx[b, :n].reshape(n, -1).long()  # [n, slots]: channel over all heads
        val = out_val[b, :n].reshape(n, -1).float()
        t, j = torch.nonzero(idx >= 0, as_tuple=True)
        c = idx[t, j]
        row = b * hkv + torch.div(c, head_dim, rounding_mode="floor")
        split = torch.div(t, share, rounding_mode="floor")
        for g in range(group):
            p = torch.exp2(scores[row, t, g] - m_part[row, split, g])
            out[..., g].index_put_((row, split, c % head_dim), p * val[t, j], accumulate=True)
    return out



# ---- Triton -----------------------------------------------------------------------------------------------------

if triton is not None:
    from kvcal.quant.packing import lane_entry, load_words, mma_channels, unpack_lut_words, unpack_tile
    from kvcal.quant.tiles import dot, mma_operand, operand, regroup
    from kvcal.runtime.kernels import prefetch_tiles, rotate_query, soft_cap, split_share_tl

    @triton.jit
    def _key_outlier_kernel(q_ptr, sqb, sqh, len_ptr, oi_ptr, ov_ptr, sob, sot, soh, cos_ptr, sin_ptr, if_ptr,
                            pos_offset, out_ptr, sor, HKV, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                            CAP: tl.constexpr, CAPP: tl.constexpr, ROPE: tl.constexpr, BLOCK_T: tl.constexpr):
        """Program (row and KV head, token block): key_outlier_scores_ref for BLOCK_T tokens."""
        HD: tl.constexpr = D // 2
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < tl.load(len_ptr + b)
        j = tl.arange(0, CAPP)
        so = b * sob + h * soh + t[:, None] * sot + j[None, :]
        sm = tm[:, None] & (j < CAP)[None, :]
        c = tl.load(oi_ptr + so, mask=sm, other=-1).to(tl.int32) - h * D
        r = tl.load(ov_ptr + so, mask=sm, other=0.0).to(tl.float32)  # not masked by c: both loads at once
        ok = (c >= 0) & (c < D)
        r = tl.where(ok, r, 0.0)
        c = tl.where(ok, c, 0)
        upper = c >= HD
        i = c % HD
        g = tl.arange(0, GP)
        qrow = q_ptr + b * sqb + (h * G + g) * sqh
        qm = ok[:, :, None] & (g < G)[None, None, :]
        qa = tl.load(qrow[None, None, :] + i[:, :, None], mask=qm, other=0.0).to(tl.float32)  # q at channel i
        qb = tl.load(qrow[None, None, :] + HD + i[:, :, None], mask=qm, other=0.0).to(tl.float32)  # ... i + HD
        # R(p) e_d = cos(p)_d e_d + sin(p)_{d'} rotate_half(e_d) (rotate_half(e_d) = +e_{d+HD} for d < HD, -e_{d-HD}
        # above; d' its partner)
        if ROPE == 1:  # angles p * inv_freq[i], as rope_cos_sin computes the tables (one float32 product)
            ang = (pos_offset + t).to(tl.float32)[:, None] * tl.load(if_ptr + i, mask=ok, other=0.0)
            cs = tl.cos(ang)[:, :, None]
            sn = tl.sin(ang)[:, :, None]
        elif ROPE == 2:  # general tables, read at the token's row (a gather per slot: a cache line each)
            prow = (pos_offset + t)[:, None] * D
            cs = tl.load(cos_ptr + prow + c, mask=ok, other=0.0)[:, :, None]
            sn = tl.load(sin_ptr + prow + tl.where(upper, c - HD, c + HD), mask=ok, other=0.0)[:, :, None]
        if ROPE > 0:
            eff = tl.where(upper[:, :, None], qb * cs - qa * sn, qa * cs + qb * sn)
        else:
            eff = tl.where(upper[:, :, None], qb, qa)
        corr = tl.sum(eff * r[:, :, None], 1)  # [BLOCK_T, GP]
        tl.store(out_ptr + pid * sor + t[:, None] * GP + g[None, :], corr, mask=tm[:, None])

    @triton.jit
    def _value_outlier_kernel(sc_ptr, ssr, m_ptr, out_ptr, len_ptr, oi_ptr, ov_ptr, sob, sot, soh, HKV, NSPLIT, S,
                              D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, CAP: tl.constexpr,
                              NS: tl.constexpr, NSP: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
                              FIXED_SCALE: tl.constexpr):
        """Program (row, token block): value_outlier_sums_ref for BLOCK_T tokens, all their slots (NS = CAP per
        token, or Hkv CAP per (token, head) with head stride soh). FIXED_SCALE > 0: int64 sums of fixed-point terms
        (round(FIXED_SCALE x term)): integer additions, so the same sums in any order."""
        b = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        length = tl.load(len_ptr + b)
        tm = t < length
        share = tl.maximum(split_share_tl(length, NSPLIT, TILE), 1)  # the decode kernel's splits (1: no division
        # by zero on an empty row, whose tokens are all masked)
        split = t // share
        j = tl.arange(0, NSP)
        so = b * sob + t[:, None] * sot + (j // CAP)[None, :] * soh + (j % CAP)[None, :]
        sm = tm[:, None] & (j < NS)[None, :]
        c = tl.load(oi_ptr + so, mask=sm, other=-1).to(tl.int32)
        r = tl.load(ov_ptr + so, mask=sm, other=0.0).to(tl.float32)
        ok = c >= 0
        c = tl.where(ok, c, 0)
        row = b * HKV + c // D  # [BLOCK_T, NSP]: the slot's KV head
        part = row * S + split[:, None]
        # [BLOCK_T, NSP, GP]: a slot's GP scores are one 16-byte row, its GP sums too, so the loads and the atomics
        # are vectors (atom.add.v4.f32 at GP 4: a quarter of the scalar atomics, which bound this pass). Columns
        # g >= G hold padding and are not read by the reduction.
        g = tl.arange(0, GP)[None, None, :]
        ok3 = ok[:, :, None]
        s = tl.load(sc_ptr + (row * ssr + t[:, None] * GP)[:, :, None] + g, mask=ok3, other=0.0)
        m = tl.load(m_ptr + (part * G)[:, :, None] + g, mask=ok3 & (g < G), other=0.0)
        term = tl.exp2(s - m) * r[:, :, None]
        if FIXED_SCALE > 0:
            term = tl.floor(term * FIXED_SCALE + 0.5).to(tl.int64)
        tl.atomic_add(out_ptr + ((part * D + c % D) * GP)[:, :, None] + g, term, mask=ok3, sem="relaxed")

    @triton.jit
    def _dequant_rotate(t1, t2, s1, z1, s2, z2, c, sn, ROPE: tl.constexpr, INTERP: tl.constexpr):
        """Key halves k1 = t1 * s1 + z1, k2 = t2 * s2 + z2 (t: table values [T, HD] fp16; s, z: per-channel [HD]
        float32) rotated by R(j): (k1 c - k2 sn, k2 c + k1 sn), c and sn [T, HD] fp16 (ROPE == 0: not rotated).
        On the GPU in fp16 pairs: per pair of registers (two channels of each half) one fma.f16x2 per half for the
        dequantization, two mul.f16x2, two fma.f16x2 and one xor (-sn) for the rotation. A key is rounded to fp16
        three times instead of the float32 path's once (the kernel's output error against the reference is close
        to the float32 path's: docs/runtime.md). The interpreter
        computes in float32 and rounds once."""
        s1 = tl.broadcast_to(s1.to(tl.float16)[None, :], t1.shape)
        z1 = tl.broadcast_to(z1.to(tl.float16)[None, :], t1.shape)
        s2 = tl.broadcast_to(s2.to(tl.float16)[None, :], t1.shape)
        z2 = tl.broadcast_to(z2.to(tl.float16)[None, :], t1.shape)
        if INTERP:
            k1 = t1.to(tl.float32) * s1.to(tl.float32) + z1.to(tl.float32)
            k2 = t2.to(tl.float32) * s2.to(tl.float32) + z2.to(tl.float32)
            if ROPE == 1:
                cf = c.to(tl.float32)
                sf = sn.to(tl.float32)
                return (k1 * cf - k2 * sf).to(tl.float16), (k2 * cf + k1 * sf).to(tl.float16)
            else:
                return k1.to(tl.float16), k2.to(tl.float16)
        elif ROPE == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 k1, k2, ns, u, v; fma.rn.f16x2 k1, $2, $4, $5; fma.rn.f16x2 k2, $3, $6, $7; "
                "xor.b32 ns, $9, 0x80008000; mul.rn.f16x2 u, k2, ns; fma.rn.f16x2 $0, k1, $8, u; "
                "mul.rn.f16x2 v, k1, $9; fma.rn.f16x2 $1, k2, $8, v; }",
                "=r,=r,r,r,r,r,r,r,r,r", [t1, t2, s1, z1, s2, z2, c, sn], dtype=(tl.float16, tl.float16),
                is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ fma.rn.f16x2 $0, $2, $4, $5; fma.rn.f16x2 $1, $3, $6, $7; }",
                "=r,=r,r,r,r,r,r,r", [t1, t2, s1, z1, s2, z2], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)

    @triton.jit
    def _pass_rows(sc_row, t, tm, GPK: tl.constexpr, GPQ: tl.constexpr):
        """Pointers and mask of a tile's rows [BLOCK_T, GPK] in the outlier passes' buffer (GPQ columns per
        token), read for the key pass's terms and written with the scores."""
        rk = tl.arange(0, GPK)
        return sc_row + t[:, None] * GPQ + rk[None, :], tm[:, None] & (rk < GPQ)[None, :]

    @triton.jit
    def _lut_tile_loads(krow, vrow, t0, end, skt, svt, KALIGN: tl.constexpr, VALIGN: tl.constexpr, D: tl.constexpr,
                        KBITS: tl.constexpr, VBITS: tl.constexpr, BLOCK_T: tl.constexpr, sc_row, KCORR: tl.constexpr,
                        GPK: tl.constexpr, GPQ: tl.constexpr):
        """The loads of one lookup-table tile (tokens t0 .. t0 + BLOCK_T - 1, those < end): load_words of the key
        halves and the value row (3 + 3 + 3 tensors) and, with KCORR, the key pass's score terms [BLOCK_T, GPK]
        (the key pass; else a placeholder)."""
        HD: tl.constexpr = D // 2
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < end
        kptr = krow + tl.multiple_of(t * skt, KALIGN)  # rows start on KALIGN-word boundaries (the host checked)
        ka0, ka1, ka2 = load_words(kptr, tm, 0, HD, D, KBITS)
        kb0, kb1, kb2 = load_words(kptr, tm, HD, HD, D, KBITS)
        va0, va1, va2 = load_words(vrow + tl.multiple_of(t * svt, VALIGN), tm, 0, D, D, VBITS)
        if KCORR:
            rows, rows_ok = _pass_rows(sc_row, t, tm, GPK, GPQ)
            kx = tl.load(rows, mask=rows_ok, other=0.0)
        else:
            kx = 0.0
        return ka0, ka1, ka2, kb0, kb1, kb2, va0, va1, va2, kx

    @triton.jit
    def _add_residuals(x, oi_ptr, ov_ptr, rowoff, tm, ch0, W: tl.constexpr, CAP: tl.constexpr):
        """x [BLOCK_T, W] float32 (channels ch0 .. ch0 + W - 1 of each token) plus the sparse residuals that land
        there, one float32 addition per residual as the reference's scatter_add does. Only the float64 path uses
        it (exactness, not speed: a pass over the tile per slot); the fast paths add residuals to the scores."""
        ch = ch0 + tl.arange(0, W)
        for j in range(CAP):
            oi = tl.load(oi_ptr + rowoff + j, mask=tm, other=-1).to(tl.int32)
            ov = tl.load(ov_ptr + rowoff + j, mask=tm, other=0.0).to(tl.float32)
            x = x + tl.where(ch[None, :] == oi[:, None], ov[:, None], 0.0)
        return x

    @triton.jit
    def _key_half(kptr, tm, C0: tl.constexpr, HD: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr, ktab_ptr,
                  kscl, kzer):
        """Dequantized channels [C0, C0 + HD) of a key tile, fp32 [BLOCK_T, HD]: table level x the channel's static
        scale + zero (the float32 path)."""
        c = unpack_tile(kptr, tm, C0, HD, 2 * HD, BITS, BLOCK_T)
        NL: tl.constexpr = 1 << BITS
        tab = tl.broadcast_to(tl.load(ktab_ptr + tl.arange(0, NL))[None, :], (BLOCK_T, NL))
        return tl.gather(tab, c.to(tl.int32), 1) * kscl[None, :] + kzer[None, :]

    @triton.jit
    def _value_params(vs_base, vz_base, t0, end, svst, BLOCK_T: tl.constexpr):
        """Per-token value scale and zero [BLOCK_T] (fp16 as stored), loaded one tile ahead."""
        t = t0 + tl.arange(0, BLOCK_T)
        return tl.load(vs_base + t * svst, mask=t < end, other=1.0), tl.load(vz_base + t * svst, mask=t < end,
                                                                           other=0.0)

    # ---- tile functions of runtime/kernels.split_k_kernel. args: (key codes, their (row, head, token) strides, the
    # per-channel key scale and zero, the key table, key outlier indices, residuals, their (row, token, head)
    # strides, value codes, their strides, per-token value scales, zeros, their strides, the value table, value outlier
    # indices, residuals, their strides, RoPE cos and sin tables, the first packed token's position, the tables' rows,
    # the outlier passes' buffer, its row stride); C: (D, G, GPK, GPV, GPQ, KALIGN, VALIGN, KBITS, KCAP, ROPE, VBITS,
    # VCAP, BLOCK_T, INTERP, PREC, PREFETCH, KROW, VROW, LUT_MMA, LUT_AHEAD, KCORR, SAVE_S).
    # Sparse outliers: KCAP / VCAP > 0 only for float32 and float64, whose residuals are added to the float32
    # dequantized tile as the reference does (float64: the result equals it up to float64 summation order); fp16 and
    # bf16 run them as passes around this kernel (KCORR: the key pass's score terms; SAVE_S: scores for the value
    # pass). The state st: (q halves, the query operands, the key range, R(j), the value table, each lane's table
    # entries, the value parameters of the next tile, the rows' bases, the passes' row, the outlier slots' offsets,
    # the value rows' offset, the next tile's words (LUT_AHEAD), h).

    @triton.jit
    def _prepare(args, C: tl.constexpr, q_row, sqh, b, h, pid, start, end, qk_scale):
        """Per-program key setup: the query halves, the calibrated per-channel key range, R(j) for the offsets j of a
        tile, the tables (or each lane's entries for the shuffles), the first tile's value parameters and, with
        LUT_AHEAD, its code words."""
        D: tl.constexpr = C[0]
        G: tl.constexpr = C[1]
        GPK: tl.constexpr = C[2]
        GPV: tl.constexpr = C[3]
        GPQ: tl.constexpr = C[4]
        KALIGN: tl.constexpr = C[5]
        VALIGN: tl.constexpr = C[6]
        KBITS: tl.constexpr = C[7]
        ROPE: tl.constexpr = C[9]
        VBITS: tl.constexpr = C[10]
        BLOCK_T: tl.constexpr = C[12]
        INTERP: tl.constexpr = C[13]
        PREC: tl.constexpr = C[14]
        LUT_MMA: tl.constexpr = C[18]
        LUT_AHEAD: tl.constexpr = C[19]
        KCORR: tl.constexpr = C[20]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        kc_ptr, skb, skh, skt, ks_ptr, kz_ptr, ktab_ptr, koi_ptr, kov_ptr, skob, skot, skoh, vc_ptr, svb, svh, svt, \
            vs_ptr, vz_ptr, svsb, svsh, svst, vtab_ptr, voi_ptr, vov_ptr, svob, svot, svoh, cos_ptr, sin_ptr, \
            pos_offset, TMAX, sc_ptr, sscr = args
        HD: tl.constexpr = D // 2
        rk = tl.arange(0, GPK)
        sc_row = sc_ptr + pid * sscr  # outlier passes: this (row, KV head)'s score terms / scores
        hh = tl.arange(0, HD)
        # LUT_MMA: the key halves come from unpack_lut in mma_channels' column order, so every per-channel operand of
        # the dot (q, the static scale and zero, R(j)) is loaded in that order
        if LUT_MMA:
            kch = mma_channels(0, HD, KBITS)
        else:
            kch = hh
        q1 = tl.load(q_row + rk[None, :] * sqh + kch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
        q2 = tl.load(q_row + rk[None, :] * sqh + HD + kch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
        # the calibrated per-channel range as the quantizer used it: level x scale + zero
        kzer1 = tl.load(kz_ptr + h * D + kch)
        kscl1 = tl.load(ks_ptr + h * D + kch)
        kzer2 = tl.load(kz_ptr + h * D + HD + kch)
        kscl2 = tl.load(ks_ptr + h * D + HD + kch)
        if LUT_MMA:  # _dequant_rotate works in fp16: convert before the loop (ptxas may hoist it anyway)
            kzer1 = kzer1.to(tl.float16)
            kscl1 = kscl1.to(tl.float16)
            kzer2 = kzer2.to(tl.float16)
            kscl2 = kscl2.to(tl.float16)
        if ROPE == 1:  # R(j) for the offsets j of a tile, kept in registers (LUT_MMA: fp16, column order)
            jr = tl.arange(0, BLOCK_T)
            cj = tl.load(cos_ptr + jr[:, None] * D + kch[None, :], mask=(jr < TMAX)[:, None], other=1.0)
            sj = tl.load(sin_ptr + jr[:, None] * D + kch[None, :], mask=(jr < TMAX)[:, None], other=0.0)
            if LUT_MMA:
                cj = cj.to(tl.float16)
                sj = sj.to(tl.float16)
            qa = operand(q1, PREC)  # not used: the query is rotated per tile
            qb = operand(q2, PREC)
        else:
            cj = tl.zeros((BLOCK_T, HD), tl.float32)
            sj = cj
            qa = operand(q1, PREC)
            qb = operand(q2, PREC)
        if not LUT_MMA:
            NL: tl.constexpr = 1 << VBITS
            vtab = tl.broadcast_to(tl.load(vtab_ptr + tl.arange(0, NL))[None, :], (BLOCK_T, NL))
        else:
            vtab = 0
        if LUT_MMA and not INTERP:  # each lane's table entries for unpack_lut's shuffles, once per program
            kent = lane_entry(ktab_ptr, KBITS)
            vent = lane_entry(vtab_ptr, VBITS)
        else:
            kent = 0
            vent = 0
        vs_base = vs_ptr + b * svsb + h * svsh
        vz_base = vz_ptr + b * svsb + h * svsh
        vp_s, vp_z = _value_params(vs_base, vz_base, start, end, svst, BLOCK_T)
        krow0 = kc_ptr + b * skb + h * skh  # this (row, KV head)'s code rows
        vrow0 = vc_ptr + b * svb + h * svh
        if LUT_MMA and LUT_AHEAD:
            # LUT_AHEAD: the lookup-table path loads each tile's code words (and key-pass terms) one iteration
            # ahead into registers: Triton did not pipeline these loads (ncu, nuq4 at 32K x 8: 44% of the stall
            # samples were waits on them)
            kw_n = _lut_tile_loads(krow0, vrow0, start, end, skt, svt, KALIGN, VALIGN, D, KBITS, VBITS, BLOCK_T,
                                   sc_row, KCORR, GPK, GPQ)
        else:
            kw_n = 0
        # float32 / float64: key outlier slots of this row and head (only its own), value outlier slots (per token
        # over all heads: head stride 0)
        st = (q1, q2, qa, qb, kscl1, kzer1, kscl2, kzer2, cj, sj, vtab, kent, vent, vp_s, vp_z, krow0, vrow0, vs_base,
              vz_base, sc_row, b * skob + h * skoh, b * svob + h * svoh, b * svb + h * svh, kw_n, h)
        return st, (tl.zeros((D, GPV), ACC), tl.zeros((GPV,), ACC))

    @triton.jit
    def _scores(args, C: tl.constexpr, st, t0, t, tm, end, qk_scale):
        """Scores [BLOCK_T, GPK]: table values straight into fp16 operands, scaled, shifted and rotated in fp16
        pairs (LUT_MMA: unpack_lut_words, _dequant_rotate), or keys dequantized in float32 as the reference does and
        rotated in ACC; plus the key pass's terms (KCORR); saved for the value pass (SAVE_S)."""
        D: tl.constexpr = C[0]
        GPK: tl.constexpr = C[2]
        GPQ: tl.constexpr = C[4]
        KALIGN: tl.constexpr = C[5]
        VALIGN: tl.constexpr = C[6]
        KBITS: tl.constexpr = C[7]
        KCAP: tl.constexpr = C[8]
        ROPE: tl.constexpr = C[9]
        VBITS: tl.constexpr = C[10]
        BLOCK_T: tl.constexpr = C[12]
        INTERP: tl.constexpr = C[13]
        PREC: tl.constexpr = C[14]
        LUT_MMA: tl.constexpr = C[18]
        LUT_AHEAD: tl.constexpr = C[19]
        KCORR: tl.constexpr = C[20]
        SAVE_S: tl.constexpr = C[21]
        CAP: tl.constexpr = C[22]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        HD: tl.constexpr = D // 2
        skt = args[3]
        ktab_ptr = args[6]
        koi_ptr = args[7]
        kov_ptr = args[8]
        skot = args[10]
        svt = args[15]
        svst = args[20]
        cos_ptr = args[27]
        sin_ptr = args[28]
        pos_offset = args[29]
        q1, q2, qa, qb, kscl1, kzer1, kscl2, kzer2, cj, sj, vtab, kent, vent, vs_cur, vz_cur, krow0, vrow0, vs_base, \
            vz_base, sc_row, ko, vo, voff, kw_n, h = st
        # rows start on KALIGN-word boundaries (the host checked the strides): without the hint Triton assumes
        # 16-word strides or nothing, and 2-/3-bit rows (8 / 12 words) were loaded 4 bytes at a time
        kptr = krow0 + tl.multiple_of(t * skt, KALIGN)
        prefetch_tiles(krow0, vrow0, t0, end, skt, svt, C[15], BLOCK_T, C[16], C[17], INTERP)
        vp_s, vp_z = _value_params(vs_base, vz_base, t0 + BLOCK_T, end, svst, BLOCK_T)
        if LUT_MMA:
            if LUT_AHEAD:  # this tile's loads came last iteration; issue the next tile's
                kw = kw_n
                kw_n = _lut_tile_loads(krow0, vrow0, t0 + BLOCK_T, end, skt, svt, KALIGN, VALIGN, D, KBITS, VBITS,
                                       BLOCK_T, sc_row, KCORR, GPK, GPQ)
            else:
                kw = _lut_tile_loads(krow0, vrow0, t0, end, skt, svt, KALIGN, VALIGN, D, KBITS, VBITS, BLOCK_T,
                                     sc_row, KCORR, GPK, GPQ)
            if ROPE == 1:
                ra, rb = rotate_query(q1, q2, cos_ptr, sin_ptr, pos_offset + t0, mma_channels(0, HD, KBITS), D)
            else:
                ra = q1
                rb = q2
            t1 = unpack_lut_words(kw[0], kw[1], kw[2], HD, KBITS, BLOCK_T, ktab_ptr, kent, INTERP)
            t2 = unpack_lut_words(kw[3], kw[4], kw[5], HD, KBITS, BLOCK_T, ktab_ptr, kent, INTERP)
            ka, kb = _dequant_rotate(t1, t2, kscl1, kzer1, kscl2, kzer2, cj, sj, ROPE, INTERP)
            s = (dot(mma_operand(ka, PREC, INTERP), operand(ra, PREC), INTERP)
                 + dot(mma_operand(kb, PREC, INTERP), operand(rb, PREC), INTERP))
            if KCORR:  # the key residuals' score terms (the key pass)
                s += kw[9]
            tile = (vs_cur, vz_cur, kw[6], kw[7], kw[8])
        else:
            hh = tl.arange(0, HD)
            k1 = _key_half(kptr, tm, 0, HD, KBITS, BLOCK_T, ktab_ptr, kscl1, kzer1)
            k2 = _key_half(kptr, tm, HD, HD, KBITS, BLOCK_T, ktab_ptr, kscl2, kzer2)
            if KCAP > 0:  # float32 / float64: residuals added to the tile, as the reference does
                k1 = _add_residuals(k1, koi_ptr + ko, kov_ptr + ko, t * skot, tm, h * D, HD, KCAP)
                k2 = _add_residuals(k2, koi_ptr + ko, kov_ptr + ko, t * skot, tm, h * D + HD, HD, KCAP)
            k1 = k1.to(ACC)
            k2 = k2.to(ACC)
            if ROPE == 1:
                ra, rb = rotate_query(q1, q2, cos_ptr, sin_ptr, pos_offset + t0, hh, D)
                qra = operand(ra, PREC)
                qrb = operand(rb, PREC)
                ka = k1 * cj - k2 * sj  # R(j) k
                kb = k2 * cj + k1 * sj
            elif ROPE == 2:
                qra = qa
                qrb = qb
                pos = (pos_offset + t)[:, None] * D
                ca = tl.load(cos_ptr + pos + hh[None, :], mask=tm[:, None], other=1.0)
                sa = tl.load(sin_ptr + pos + hh[None, :], mask=tm[:, None], other=0.0)
                cb = tl.load(cos_ptr + pos + HD + hh[None, :], mask=tm[:, None], other=1.0)
                sb = tl.load(sin_ptr + pos + HD + hh[None, :], mask=tm[:, None], other=0.0)
                ka = k1 * ca - k2 * sa
                kb = k2 * cb + k1 * sb
            else:
                qra = qa
                qrb = qb
                ka = k1
                kb = k2
            s = dot(operand(ka, PREC), qra, INTERP) + dot(operand(kb, PREC), qrb, INTERP)
            if KCORR:
                rows, rows_ok = _pass_rows(sc_row, t, tm, GPK, GPQ)
                s += tl.load(rows, mask=rows_ok, other=0.0)
            tile = (vs_cur, vz_cur, 0, 0, 0)
        s = s * qk_scale
        if SAVE_S:  # for the value pass (over the key pass's terms: same elements), soft-capped as the skeleton
            s = tl.where(tm[:, None], s, float("-inf"))  # caps the scores returned
            rows, rows_ok = _pass_rows(sc_row, t, tm, GPK, GPQ)
            tl.store(rows, soft_cap(s, CAP), mask=rows_ok)
        st = (q1, q2, qa, qb, kscl1, kzer1, kscl2, kzer2, cj, sj, vtab, kent, vent, vp_s, vp_z, krow0, vrow0, vs_base,
              vz_base, sc_row, ko, vo, voff, kw_n, h)
        return s, tile, st

    @triton.jit
    def _values(args, C: tl.constexpr, st, tile, acc, p, alpha, t, tm):
        """acc^T [D, GPV] += T[codes]^T [D, BLOCK_T] x (p * scale) [BLOCK_T, GPV] + p . zero."""
        D: tl.constexpr = C[0]
        GPK: tl.constexpr = C[2]
        GPV: tl.constexpr = C[3]
        VALIGN: tl.constexpr = C[6]
        VBITS: tl.constexpr = C[10]
        VCAP: tl.constexpr = C[11]
        BLOCK_T: tl.constexpr = C[12]
        INTERP: tl.constexpr = C[13]
        PREC: tl.constexpr = C[14]
        LUT_MMA: tl.constexpr = C[18]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        vc_ptr = args[12]
        svt = args[15]
        vtab_ptr = args[21]
        voi_ptr = args[22]
        vov_ptr = args[23]
        svot = args[25]
        vs_cur, vz_cur, va0, va1, va2 = tile
        acc, corr = acc
        pr = regroup(p, GPK, GPV, BLOCK_T)  # [BLOCK_T, GPV]
        ar = tl.reshape(regroup(alpha[None, :], GPK, GPV, 1), (GPV,))
        vptr = vc_ptr + tl.multiple_of(st[22] + t * svt, VALIGN)
        if LUT_MMA:  # fp16 table values in mma_channels order
            vt = unpack_lut_words(va0, va1, va2, D, VBITS, BLOCK_T, vtab_ptr, st[12], INTERP)
        else:
            vt = tl.gather(st[10], unpack_tile(vptr, tm, 0, D, D, VBITS, BLOCK_T).to(tl.int32), 1)
        vsc = tl.maximum(vs_cur.to(tl.float32), 1e-8)  # as dequantize_lut_dynamic floors it
        if PREC == 64 or VCAP > 0:  # float64, or float32 with residuals: dequantize in float32 as the reference
            # does (T[c] s rounds), then add the residuals
            vdq = vt * vsc[:, None] + vz_cur.to(tl.float32)[:, None]
            if VCAP > 0:
                vo = st[21]
                vdq = _add_residuals(vdq, voi_ptr + vo, vov_ptr + vo, t * svot, tm, st[24] * D, D, VCAP)
            acc = acc * ar[None, :] + dot(tl.trans(vdq.to(ACC)), pr, INTERP)
        else:
            pw = operand(pr * vsc[:, None], PREC)
            if LUT_MMA:
                vop = tl.trans(mma_operand(vt, PREC, INTERP))
            else:
                vop = tl.trans(operand(vt, PREC))
            acc = acc * ar[None, :] + dot(vop, pw, INTERP)
            corr = corr * ar + tl.sum(pr * vz_cur.to(ACC)[:, None], 0)
        return acc, corr

    @triton.jit
    def _finish(args, C: tl.constexpr, st, acc, m_i, l_i):
        D: tl.constexpr = C[0]
        VBITS: tl.constexpr = C[10]
        if C[18]:  # LUT_MMA: value rows in mma_channels order
            vch = mma_channels(0, D, VBITS)
        else:
            vch = tl.arange(0, D)
        return acc[0] + acc[1][None, :], vch, tl.arange(0, C[3]), m_i, l_i


# Tokens and warps per program, chosen by measurement (nuq4 at 32K x batch 8): the key pass is fastest at (32, 1)
# (and computing the angles beats reading cos/sin table rows); the value pass takes about the same time at every
# setting but (32, 2).
KEY_PASS_TOKENS, KEY_PASS_WARPS = 32, 1
# the tile functions' C
Consts = namedtuple("Consts", "D G GPK GPV GPQ KALIGN VALIGN KBITS KCAP ROPE VBITS VCAP BLOCK_T INTERP PREC PREFETCH "
                              "KROW VROW LUT_MMA LUT_AHEAD KCORR SAVE_S CAP")
VALUE_PASS_TOKENS, VALUE_PASS_WARPS = 32, 4

# Fixed-point value sums (an int64 out; torch's deterministic mode): terms rounded to multiples of 2^-FIXED_BITS, far
# below float32's rounding of sums of order 1 (GPU check at Llama-3.1-8B shapes: 2.5e-8 to 6.5e-8 from the float64
# reference, the float32 atomics 1.9e-8 to 7.6e-8). A term is below 2^16 (p <= 1, |r| <= 65504, fp16), so sums of up
# to 2^19 tokens cannot overflow 2^63; longer rows get fewer fraction bits (fixed_point_bits). Four scalar int64
# atomics per slot instead of one 16-byte float32 vector: about twice the pass's time (docs/runtime.md).
FIXED_BITS = 28


def fixed_point_bits(max_tokens: int) -> int:
    """Fraction bits of the fixed-point value sums for splits of up to max_tokens tokens: FIXED_BITS, fewer where
    max_tokens terms below 2^16 each could reach 2^63."""
    return min(FIXED_BITS, 47 - max(0, int(max_tokens) - 1).bit_length())


def key_outlier_scores_triton(q, out_idx, out_val, lengths, cos, sin, pos_offset: int, out, inv_freq=None):
    """Triton version of key_outlier_scores_ref (same arguments and result)."""
    batch, hq, d = q.shape
    hkv, cap = out_idx.shape[2], out_idx.shape[3]
    if out_val.stride() != out_idx.stride():
        out_idx, out_val = out_idx.contiguous(), out_val.contiguous()
    rope = 0 if cos is None else (1 if inv_freq is not None else 2)
    if rope:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    else:
        cos = sin = out
    inv_freq = inv_freq.float().contiguous() if rope == 1 else out
    tcap = out.shape[1]
    _key_outlier_kernel[(batch * hkv, triton.cdiv(tcap, KEY_PASS_TOKENS))](
        q, q.stride(0), q.stride(1), lengths, out_idx, out_val, out_idx.stride(0), out_idx.stride(1),
        out_idx.stride(2), cos, sin, inv_freq, int(pos_offset), out, out.stride(0), hkv,
        D=d, G=hq // hkv, GP=out.shape[2], CAP=cap, CAPP=pow2(cap), ROPE=rope, BLOCK_T=KEY_PASS_TOKENS,
        num_warps=KEY_PASS_WARPS)
    return out


def value_outlier_sums_triton(scores, m_part, out_idx, out_val, lengths, num_splits: int, block_t: int, out,
                              fixed_bits: int = FIXED_BITS):
    """Triton version of value_outlier_sums_ref (same arguments and result; an int64 out holds the sums in fixed
    point, 2^fixed_bits x the reference's, the same bits every run)."""
    batch = out_idx.shape[0]
    hkv = scores.shape[0] // batch
    if out_val.stride() != out_idx.stride():
        out_idx, out_val = out_idx.contiguous(), out_val.contiguous()
    per_head = out_idx.dim() == 4
    cap = out_idx.shape[-1]
    slots = cap * (hkv if per_head else 1)
    _value_outlier_kernel[(batch, triton.cdiv(scores.shape[1], VALUE_PASS_TOKENS))](
        scores, scores.stride(0), m_part, out, lengths, out_idx, out_val, out_idx.stride(0), out_idx.stride(1),
        out_idx.stride(2) if per_head else 0, hkv, int(num_splits), m_part.shape[1],
        D=out.shape[2], G=m_part.shape[2], GP=scores.shape[2], CAP=cap, NS=slots, NSP=pow2(slots), TILE=block_t,
        BLOCK_T=VALUE_PASS_TOKENS, FIXED_SCALE=float(2**fixed_bits) if out.dtype == torch.int64 else 0.0,
        num_warps=VALUE_PASS_WARPS)
    return out


def _outlier_args(idx, val, capacity: int, dev):
    """(index tensor, residual tensor, (row, token, head) strides) of a sparse-outlier store ([B, T, H, cap] per head,
    or [B, T, cap] per token: head stride 0), placeholders without one."""
    if not capacity:
        dummy, dummy_i = K.placeholders(dev)
        return dummy_i, dummy, (0, 0, 0)
    idx, val = K.same_layout(idx, val)
    return idx, val, (*idx.stride()[:2], idx.stride(2) if idx.dim() == 4 else 0)


def unsupported(q: torch.Tensor, bits: int) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    if bits not in UNPACK_BITS:
        return f"{bits}-bit codes (the kernels unpack {', '.join(map(str, UNPACK_BITS))} bits)"
    if q.shape[-1] < 64:
        return f"head_dim {q.shape[-1]} (the key paths need head_dim >= 64)"
    return None


def attend_triton(q: torch.Tensor, packed, scale: float, fp, storage, *, block_t: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  programs_per_sm: int | None = None, block_f: int | None = None, max_registers: int | None = None,
                  prefetch: int | None = None, rope_mode: str | None = None, lut_mma: bool | None = None,
                  lut_ahead: bool | None = None):
    """Partials of q [B, Hq, D] over KVQuant's packed tokens (`storage`: the layer's KVQuantStorage, holding the
    tables and ranges) and the full-precision part `fp`. Keyword-only tuning knobs: block_t, num_splits (default from
    programs_per_sm, 16, x SMs), num_warps, num_stages, max_registers, block_f, prefetch (tiles ahead prefetched into
    L2 on sm_90+), rope_mode ('angle' | 'table'; default 'angle', 'table' for float32 and float64 queries: angle
    addition rotates by fl(p0 t) + fl(j t) instead of the table's fl((p0 + j) t): with Llama-3.1's frequencies up to
    2e-3 rad apart below 32K positions and 8e-3 below 128K, far below a 4-bit key's quantization error, not below
    float32 rounding), lut_mma (the lookup-table path for fp16/bf16 queries and <= 4 bits; default on where it
    applies, False: the float32 path), lut_ahead (the lookup-table path loads each tile's code words and key-pass terms
    one iteration ahead into registers; default on).
    The sparse outliers run as passes around the kernel for fp16 and bf16 queries, the value pass with float32 atomics
    (run-dependent order: repeated decodes can differ in their last bits) or, while
    torch.use_deterministic_algorithms(True) is on, int64 fixed-point ones (the same bits every run; slower); float32
    and float64 queries add them to the dequantized tiles as the reference does (slower, and without atomics)."""
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
    kbits = vbits = storage.bits
    kc, vc = packed["k_codes"], packed["v_codes"]
    lengths = packed.lengths
    tcap = kc.shape[2]
    gp = pow2(group)
    if rope_mode is None:
        rope_mode = "table" if q.dtype in (torch.float32, torch.float64) else "angle"
    rope = 2 if rope_mode == "table" else 1
    k_out_idx, k_out_val = packed.buffers.get("k_out_idx"), packed.buffers.get("k_out_val")
    v_out_idx, v_out_val = packed.buffers.get("v_out_idx"), packed.buffers.get("v_out_val")
    kcap = 0 if k_out_idx is None else k_out_idx.shape[-1]
    vcap = 0 if v_out_idx is None else v_out_idx.shape[-1]
    pass_kcap = pass_vcap = 0
    # sparse outliers as passes around the kernel for fp16 / bf16. float32 and float64 add them in it, as the
    # reference does: the value pass's atomics add in a run-dependent order, which moved float32 decodes'
    # perplexity from run to run (docs/runtime.md)
    # A compressed sliding-window layer (packed.first) adds them in the kernel whatever the dtype: the passes split a
    # row's tokens from slot 0, the kernel from the window's first tile (and the lookup-table path has no in-kernel
    # residuals, so it is off there too)
    if q.dtype not in (torch.float32, torch.float64) and packed.first is None:
        pass_kcap, pass_vcap, kcap, vcap = kcap, vcap, 0, 0
    lut_ok = (rope == 1 and q.dtype in (torch.float16, torch.bfloat16) and max(kbits, vbits) <= 4
              and packed.first is None)
    use_lut = lut_ok if lut_mma is None else bool(lut_mma) and lut_ok
    path = "lut" if use_lut else "generic"
    bt = block_t or DEFAULTS["generic"][0]
    nsplit = K.split_count(num_splits, programs_per_sm, dev, batch * hkv, tcap, bt)
    if use_lut:
        bt = block_t or DEFAULTS["lut"][0]
    default_warps = 4 if q.dtype == torch.float64 and num_warps is None and block_t is None else DEFAULTS[path][1]
    warps = min(num_warps or default_warps, 4)  # Triton 3.6 asserts in OptimizeThreadLocality on tl.gather at 8 warps
    wide = warps >= 4 and bt >= 64  # wgmma wants dots of >= 16 columns; mma.sync pads N itself
    gpk = gpv = max(gp, 16) if wide else gp
    dummy, _ = K.placeholders(dev)
    ks, kz = storage.key_scale.to(dev), storage.key_zero.to(dev)
    ktab, vtab = storage.key_table.to(dev), storage.value_table.to(dev)
    koi, kov, ko_strides = _outlier_args(k_out_idx, k_out_val, kcap, dev)
    vs, vz = K.same_layout(packed["v_scale"], packed["v_zero"])
    per_token = vs.dim() == 2  # one range per token over all heads: head stride 0
    vs_strides = (vs.stride(0), 0, vs.stride(1)) if per_token else vs.stride()[:3]
    voi, vov, vo_strides = _outlier_args(v_out_idx, v_out_val, vcap, dev)
    cos, sin = packed.rope_cos.float().contiguous(), packed.rope_sin.float().contiguous()
    if num_warps is None and block_t is None:  # the measured defaults belong to the default tile
        num_stages = DEFAULTS[path][2] if num_stages is None else num_stages
        max_registers = DEFAULTS[path][3] if max_registers is None else max_registers
    kalign, valign, krow, vrow, can = K.code_rows(kc, vc, dev)
    prefetch_tiles = (PREFETCH_DEFAULT if prefetch is None else int(prefetch)) if can else 0
    prec = PREC.get(q.dtype, 16)
    with launch_device(q):
        if pass_kcap or pass_vcap:  # [row and KV head, token, head of the group]: key-residual terms, then scores
            scores = torch.empty(batch * hkv, tcap, gp, dtype=torch.float32, device=dev)
            if pass_kcap:
                key_outlier_scores_triton(q, k_out_idx, k_out_val, lengths, packed.rope_cos, packed.rope_sin,
                                          packed.pos_offset, scores, packed.inv_freq)
        else:
            scores = dummy
        args = (kc, *kc.stride()[:3], ks, kz, ktab, koi, kov, *ko_strides,
                vc, *vc.stride()[:3], vs, vz, *vs_strides, vtab, voi, vov, *vo_strides,
                cos, sin, packed.pos_offset, cos.shape[0], scores, scores.stride(0))
        consts = Consts(d, group, gpk, gpv, gp, kalign, valign, kbits, kcap, rope, vbits, vcap, bt, K.INTERPRET, prec,
                        prefetch_tiles, krow, vrow, int(use_lut), int(use_lut and lut_ahead is not False),
                        int(pass_kcap > 0), int(pass_vcap > 0), K.cap_log2(packed.softcap))
        # block_f small: the fp tiles' buffers count against every program
        parts = K.launch_split_k((_prepare, _scores, _values, _finish), q, lengths, scale, fp, nsplit, hkv, args,
                                 consts, gpk=gpk, block_t=bt, block_f=block_f, prec=prec, merge_warps=MERGE_WARPS,
                                 opts=K.launch_options(q, warps, num_stages, max_registers), softcap=packed.softcap,
                                 first=packed.first)
        if pass_vcap:
            # float32 sums, or int64 fixed point (the same bits in any order) in torch's deterministic mode
            fixed = VALUE_PASS_FIXED or torch.are_deterministic_algorithms_enabled()
            parts.extra = torch.zeros(batch * hkv, parts.splits, d, gp, dtype=torch.int64 if fixed else torch.float32,
                                      device=dev)
            bits = fixed_point_bits(tcap)  # a split holds at most a row's tcap tokens
            value_outlier_sums_triton(scores, parts.m, v_out_idx, v_out_val, lengths, nsplit, bt, parts.extra, bits)
            parts.extra_unit = 2.0**-bits
    return parts
