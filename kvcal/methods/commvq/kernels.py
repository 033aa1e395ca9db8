"""CommVQ's Triton kernels, beside their torch references in kvcal/methods/commvq/storage.py (CommVQStorage).

Decode attention (`attend_triton`, reference CommVQStorage.attend_reference): two passes over the tokens, then the
codebook product and the generic merge:

1. `_key_scores_kernel`, grid (token tiles, B, Hkv), the KV head slowest (the programs resident together gather from
   one KV head's codebook): per tile of BLOCK_T tokens, for every stage r and code e in (a, b) the token's index is
   cut from its bit stream (`_key_code`) and the codeword row theta_heads[h, r, index] (the group's pairs (x, y),
   contiguous: one vector gather per token, group and stage) is gathered; the stages are summed before the single
   rotation (A = sum_r w_a + i w_b per pair, the commutation of digest §3.4: one rotation per token and pair whatever
   R is), the sum is rotated by the token's position (the model's float32 RoPE tables) and dotted with the GQA group's
   queries: score = kappa * scale * log2(e) * q~ . R_i k_hat, soft-capped where the model caps its scores (Gemma 2:
   runtime/kernels.soft_cap), written to a float32 buffer [B, Hq, T] (4 MB per row at 32K). The same sum as
   fused_key_scores' (Eq. 19), grouped per codeword instead of per table entry: the table of q against the codebook
   (d, c per query head) holds rep = Hq / Hkv times more values than the codebook itself, so the kernel gathers the
   codebook and multiplies by q after the rotation (docs/commvq.md counts both).
2. `_value_mass_kernel`, grid (code chunks, splits, B), the chunk fastest (the chunks of a split read its scores
   together, from the L2): program (chunk c, split s, row b) runs the online softmax of all Hq query heads over its
   split (log2 domain, runtime/kernels.softmax_tile) and accumulates the probability mass of its NCC value-code bits,
   Eq. 22: mass[n, head] += sum_t bit[t, n] rho_t p[t, head], one tensor-core dot of the tile's unpacked bits
   [NCC, BLOCK_T] (0/1, exact in fp16) with rho * p [BLOCK_T, Hq] (fp16 hi + lo parts for fp16/bf16 queries: ~fp32
   precision; float32 / float64 dots otherwise), so each bit is unpacked once for all 32 heads (and the dot has 32
   useful columns). It writes (m, l) and the unnormalized mass [N_c] per query head of its split.
3. `_codebook_kernel`, grid (B * Hkv, N_c / NCC): combines the splits' mass in code chunks of NCC (each split
   rescaled by exp2(m_s - max)), multiplies the chunk by the KV head's slice of the value codebook C_V [NCC, D] and
   the per-channel scale (applied after C_V, digest §8 item 14), and writes it as one softmax partial of the
   runtime's format: every chunk carries m = the row's max, chunk 0 the row's sum l and the others l = 0, so the
   generic merge adds the chunks' products (sum_c w acc_c / sum w l).
4. the full-precision window (its scores capped as the packed tokens'): runtime/kernels.fp_partials_into into the
   last splits; runtime/kernels.merge_triton merges all (decode_attention calls it).

Key encoding (`encode_keys_triton`, reference storage.encode_keys): one program per (block of 16 tokens, group) runs
the greedy residual search over the stages with the fast distance decomposition of quant/vq.py
(|r - c_ab|^2 = |r|^2 + P_a + Q_b + G_ab: two small dots per stage, the [N, N] cross term precomputed per stage),
the argmin over the N^2 centres taken 16 values of a at a time (the first minimum, as torch's), and subtracts the
chosen centre. A stage's tables (u, J u: 2 N 2g floats, 64 KB at N = 64 and g = 64 in fp32) are loaded once per
block of tokens, not per token.
"""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.methods.commvq.packing import FP16_MAX, pack_stream
from kvcal.quant import vq
from kvcal.quant.packing import launch_device, pow2
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import Partials

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # fp16 hi + lo value dots for fp16 and bf16 queries
PROGRAMS_PER_SM = 4  # split programs per SM (each writes a mass partial of N_c x G floats)
CODE_CHUNK = 32  # codes per program of the codebook kernel
KEY_BLOCK_T = 32  # tokens per tile of the key-score pass
KEY_TILES = 1  # tiles per key-score program
KEY_WARPS = 4
VALUE_BLOCK_T = 64  # tokens per tile of the value-mass pass
VALUE_BLOCK_T_FP32 = 32  # float32 queries (float32 dot operands: 64 tokens spill at 2 bits in an sm_90 compile)
VALUE_CHUNK = 256  # value-code bits per value-mass program
# the key pass's epilogue, the dot of the rotated key halves [BLOCK_T, P] with the group's queries [P, GP]:
# "sum" (broadcast product, tl.sum over the pairs: the reduction spread across lanes), "mma" (tl.dot on the tensor
# cores, float32 operands as tf32x3: ~float32 precision), "fma" (tl.dot with ieee float32 operands: Triton's FMA dot,
# each thread sums a token's pairs for its own outputs, the operands staged through shared memory). Not timed yet.
# The dots' N: the group's query heads padded to SCORE_DOT_N (16; Triton 3.9 compiles N = 4, a quarter of the
# products, for sm_90 too: min_dot_size bounds only K for float32 operands).
SCORE_DOT = "sum"
SCORE_DOT_N = 16
SCORE_DOTS = {"sum": 0, "mma": 1, "fma": 2}
FP16_CODEWORDS = True  # 16-bit queries: gather the (fp16-rounded) codewords as fp16, not float32 (same values)
ENCODE_BLOCK_M = 16  # tokens per program of the key encoder (each stage's tables are loaded once per block)


if triton is not None:
    from kvcal.quant.tiles import dot
    from kvcal.runtime.kernels import soft_cap, softmax_tile, split_bounds

    @triton.jit
    def _value_dot(bits, pv, PREC: tl.constexpr, INTERP: tl.constexpr):
        """bits [N, T] (0/1) x pv [T, GPV]: exact bits; pv in fp16 hi + lo parts (PREC 16), float32 or float64."""
        if PREC == 64:
            return dot(bits.to(tl.float64), pv, INTERP)
        elif PREC == 32:
            return dot(bits.to(tl.float32), pv, INTERP)
        else:
            hi = pv.to(tl.float16)
            lo = (pv - hi.to(tl.float32)).to(tl.float16)
            b16 = bits.to(tl.float16)
            return dot(b16, hi, INTERP) + dot(b16, lo, INTERP)

    @triton.jit
    def _key_code(krow, tm, h, r, e, R: tl.constexpr, NPH: tl.constexpr, IB: tl.constexpr, WK: tl.constexpr):
        """The index of code e (a: 0, b: 1) of stage r of the KV head h's NPH groups, for the tile's tokens (code rows
        krow [BLOCK_T], valid tm): [BLOCK_T, NPH] int32, cut from the row's bit stream (an index may straddle two
        words)."""
        MASK: tl.constexpr = (1 << IB) - 1
        gi = tl.arange(0, NPH)
        bit = (((h * NPH + gi) * R + r) * 2 + e) * IB  # [NPH] stream bit of the group's code
        wi = bit // 32
        sh = (bit % 32).to(tl.uint32)
        w0 = tl.load(krow[:, None] + wi[None, :], mask=tm[:, None], other=0).to(tl.uint32, bitcast=True)
        w1 = tl.load(krow[:, None] + wi[None, :] + 1, mask=tm[:, None] & (wi + 1 < WK)[None, :],
                     other=0).to(tl.uint32, bitcast=True)
        hi = tl.where(sh[None, :] > 0, w1 << ((32 - sh) % 32)[None, :], 0)
        return (((w0 >> sh[None, :]) | hi) & MASK).to(tl.int32)

    @triton.jit
    def _add_codeword(kx, ky, x, y, E: tl.constexpr):
        """A stage's codeword (x, y) of each pair into the stage sum: w_a, row 0 of C_a (E 0), or i w_b, row 1 of
        C_b: (-y, x) (E 1)."""
        if E == 0:
            return kx + x, ky + y
        else:
            return kx - y, ky + x

    @triton.jit
    def _rope_tables(cos_ptr, sin_ptr, pos, jj, tm, D: tl.constexpr, ACC: tl.constexpr):
        """cos and sin [BLOCK_T, P] of the tokens at `pos` (HF rotate_half: channel j pairs with j + P)."""
        c = tl.load(cos_ptr + pos[:, None] * D + jj[None, :], mask=tm[:, None], other=0.0).to(ACC)
        sn = tl.load(sin_ptr + pos[:, None] * D + jj[None, :], mask=tm[:, None], other=0.0).to(ACC)
        return c, sn

    @triton.jit
    def _pair_dot(k, q, SCORE_DOT: tl.constexpr, INTERP: tl.constexpr):
        """k [BLOCK_T, P] (float32 or float64) . q [P, GP] over the pairs -> [BLOCK_T, GP]: SCORE_DOT 0 a broadcast
        product and tl.sum, 1 tl.dot as tf32x3 (tensor cores), 2 tl.dot in ieee float32 (Triton's FMA dot); the dots
        need GP >= 16 (the host pads) and are exact float32 products under the interpreter."""
        if SCORE_DOT == 0:
            return tl.sum(k[:, :, None] * q[None, :, :], 1)
        elif SCORE_DOT == 2 or INTERP:
            return dot(k, q, INTERP)  # ieee float32 (exact under the interpreter)
        else:
            return tl.dot(k, q, input_precision="tf32x3")

    @triton.jit
    def _codebook_kernel(
        m_ptr, l_ptr, mass_ptr, cb_ptr, cs_ptr, pm_ptr, pl_ptr, pacc_ptr, HKV, NSPLIT, S_TOTAL, NC,
        C: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, NCB: tl.constexpr,
        NCC: tl.constexpr, SP: tl.constexpr,
    ):
        ACC: tl.constexpr = pm_ptr.dtype.element_ty
        pid = tl.program_id(0)
        chunk = tl.program_id(1)
        h = pid % HKV
        rs = tl.arange(0, SP)
        rg = tl.arange(0, GP)
        ok = (rs < NSPLIT)[:, None] & (rg < G)[None, :]
        ms = tl.load(m_ptr + (pid * NSPLIT + rs[:, None]) * G + rg[None, :], mask=ok, other=float("-inf"))
        ls = tl.load(l_ptr + (pid * NSPLIT + rs[:, None]) * G + rg[None, :], mask=ok, other=0.0)
        top = tl.max(ms, 0)  # [GP]
        top_use = tl.where(top == float("-inf"), 0.0, top)
        l_tot = tl.sum(tl.exp2(ms - top_use[None, :]) * ls, 0)
        n = chunk * NCC + tl.arange(0, NCC)
        mc = tl.zeros((GP, NCC), ACC)
        for s in range(NSPLIT):
            m_s = tl.load(m_ptr + (pid * NSPLIT + s) * G + rg, mask=rg < G, other=float("-inf"))
            w_s = tl.exp2(m_s - top_use)
            chunk_s = tl.load(mass_ptr + ((pid * NSPLIT + s) * G + rg[:, None]) * NCB + n[None, :],
                              mask=(rg < G)[:, None], other=0.0)
            mc += w_s[:, None] * chunk_s
        dd = tl.arange(0, D)
        cb = tl.load(cb_ptr + n[:, None] * C + h * D + dd[None, :], mask=(n < NC)[:, None], other=0.0).to(ACC)
        out = tl.sum(mc[:, :, None] * cb[None, :, :], 1)  # [GP, D]
        out = out * tl.load(cs_ptr + h * D + dd).to(ACC)[None, :]
        part = pid * S_TOTAL + chunk
        tl.store(pacc_ptr + (part * G + rg[:, None]) * D + dd[None, :], out, mask=(rg < G)[:, None])
        tl.store(pm_ptr + part * G + rg, top, mask=rg < G)
        tl.store(pl_ptr + part * G + rg, tl.where(chunk == 0, l_tot, 0.0), mask=rg < G)

    @triton.jit
    def _key_scores_kernel(
        q_ptr, sqb, sqh, len_ptr, kc_ptr, skb, skt, kn_ptr, sknb, th_ptr, cos_ptr, sin_ptr, pos_offset,
        s_ptr, ssb, ssh, qk_scale_hi, qk_scale_lo,
        D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr, NCODE: tl.constexpr, IB: tl.constexpr,
        NPH: tl.constexpr, GPAIRS: tl.constexpr, WK: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr,
        PROBE: tl.constexpr, SCORE_DOT: tl.constexpr, INTERP: tl.constexpr, CAP: tl.constexpr = 0.0,
    ):
        """Pass 1 of the two-pass decode: program (tile group c, row b, KV head h) writes the log2-domain scores
        kappa * scale * log2(e) * q~ . R_t k_hat of the GQA group's queries for TILES tiles of BLOCK_T tokens into
        s [B, Hq, T] (float32; float64 for float64 queries), soft-capped by CAP (runtime/kernels.soft_cap; 0: none).
        The KV head is the slowest grid axis, so the programs resident together gather from one KV head's codebook
        (L1 reuse). Per token and stage, a code's codeword row (the group's GPAIRS pairs, contiguous) is one vector
        gather. SCORE_DOT: the epilogue's dot over the pairs (_pair_dot; 1 and 2 take GP >= 16, the padding heads'
        queries 0 and their scores not stored)."""
        ACC: tl.constexpr = s_ptr.dtype.element_ty
        if ACC == tl.float64:
            qk_scale = tl.cast(qk_scale_hi, ACC) + tl.cast(qk_scale_lo, ACC)
        else:
            qk_scale = qk_scale_hi
        P: tl.constexpr = D // 2
        W2: tl.constexpr = 2 * GPAIRS
        c = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        length = tl.load(len_ptr + b)
        rk = tl.arange(0, GP)
        jj = tl.arange(0, P)
        q_row = q_ptr + b * sqb + h * G * sqh
        q1 = tl.load(q_row + rk[None, :] * sqh + jj[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)  # [P, GP]
        q2 = tl.load(q_row + rk[None, :] * sqh + P + jj[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
        gi = tl.arange(0, NPH)
        w2 = tl.arange(0, W2)
        th_head = th_ptr + h * (R * NCODE * P * 2)
        # the group's GPAIRS (x, y) pairs of a codeword row: [NPH, 2 GPAIRS], contiguous along the last axis
        grp = (gi * W2)[:, None] + w2[None, :]
        t_first = c * (TILES * BLOCK_T)
        for t0 in range(t_first, tl.minimum(t_first + TILES * BLOCK_T, length), BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < length
            krow = kc_ptr + b * skb + t * skt
            kx = tl.zeros((BLOCK_T, P), ACC)
            ky = tl.zeros((BLOCK_T, P), ACC)
            for r in range(R * (PROBE != 2)):  # PROBE 2 (timing only): no codes, no gathers
                for e in tl.static_range(2):
                    if PROBE == 1:  # timing only: constant codes (every gather reads the stage's row 0)
                        code = tl.zeros((BLOCK_T, NPH), tl.int32)
                    else:
                        code = _key_code(krow, tm, h, r, e, R, NPH, IB, WK)  # [BLOCK_T, NPH]
                    off = ((r * NCODE + code) * (2 * P))[:, :, None] + grp[None, :, :]  # [BLOCK_T, NPH, W2]
                    rows = tl.load(th_head + off).to(ACC)
                    x, y = tl.split(tl.reshape(rows, (BLOCK_T, P, 2)))
                    kx, ky = _add_codeword(kx, ky, x, y, e)
            cs, sn = _rope_tables(cos_ptr, sin_ptr, pos_offset + t, jj, tm, D, ACC)
            kappa = tl.load(kn_ptr + b * sknb + t, mask=tm, other=0.0).to(ACC)
            k1 = kx * cs - ky * sn
            k2 = ky * cs + kx * sn
            s = _pair_dot(k1, q1, SCORE_DOT, INTERP) + _pair_dot(k2, q2, SCORE_DOT, INTERP)
            s = soft_cap(s * (kappa * qk_scale)[:, None], CAP)  # [BLOCK_T, GP], capped: the value pass's scores
            tl.store(s_ptr + b * ssb + (h * G + rk)[None, :] * ssh + t[:, None], s,
                     mask=tm[:, None] & (rk < G)[None, :])

    @triton.jit
    def _value_mass_kernel(
        s_ptr, ssb, ssh, len_ptr, first_ptr, vc_ptr, svb, svt, vr_ptr, svrb, m_ptr, l_ptr, mass_ptr, NSPLIT,
        HQ: tl.constexpr, HQP: tl.constexpr, G: tl.constexpr, WV: tl.constexpr, NCB: tl.constexpr,
        NCC: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr, PROBE: tl.constexpr,
        FIRST: tl.constexpr = 0,
    ):
        """Pass 2: program (code chunk c, split s, row b) takes the scores of all Hq query heads over its split's
        tokens (online softmax per head) and accumulates the probability mass of its NCC value-code bits,
        mass[n, head] = sum_t bit[t, n] rho_t p[t, head]: one tensor-core dot per tile of the chunk's unpacked bits
        [NCC, BLOCK_T] with rho p [BLOCK_T, Hq] (fp16 hi + lo parts for fp16/bf16 queries), so each bit is unpacked
        once for all heads. The chunk is the fastest grid axis: the chunks of a split read its scores together (L2).
        Writes the mass [B Hkv, NSPLIT, G, NCB] and (chunk 0) m, l [B Hkv, NSPLIT, G] of _codebook_kernel. FIRST (a
        compressed sliding window): the splits share row b's tokens from the tile holding first_ptr[b] on, the tokens
        before it masked (pass 1 scores them all; nothing reads those scores)."""
        ACC: tl.constexpr = m_ptr.dtype.element_ty
        WC: tl.constexpr = NCC // 32
        chunk = tl.program_id(0)
        split = tl.program_id(1)
        b = tl.program_id(2)
        start, end = split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T, first_ptr, FIRST)
        first = 0
        if FIRST:
            first = tl.load(first_ptr + b)
        hq = tl.arange(0, HQP)
        hok = hq < HQ
        wv = chunk * WC + tl.arange(0, WC)
        sh32 = tl.arange(0, 32).to(tl.uint32)
        m_i = tl.full((HQP,), float("-inf"), ACC)
        l_i = tl.zeros((HQP,), ACC)
        mass = tl.zeros((NCC, HQP), ACC)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = (t < end) & (t >= first)
            s = tl.load(s_ptr + b * ssb + hq[None, :] * ssh + t[:, None], mask=tm[:, None] & hok[None, :],
                        other=float("-inf"))
            p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, hok)
            rho = tl.load(vr_ptr + b * svrb + t, mask=tm, other=0.0).to(ACC)
            pv = p * rho[:, None]
            if PROBE == 3:  # timing only: no value mass
                mass = mass * alpha[None, :]
            else:
                words = tl.load(vc_ptr + b * svb + t[None, :] * svt + wv[:, None],
                                mask=tm[None, :] & (wv < WV)[:, None], other=0).to(tl.uint32, bitcast=True)
                bits = tl.reshape((words[:, None, :] >> sh32[None, :, None]) & 1, (NCC, BLOCK_T))
                mass = mass * alpha[None, :] + _value_dot(bits, pv, PREC, INTERP)
        hkv = hq // G
        part = ((b * (HQ // G) + hkv) * NSPLIT + split) * G + hq % G  # [HQP]
        nn = chunk * NCC + tl.arange(0, NCC)
        tl.store(mass_ptr + part[None, :] * NCB + nn[:, None], mass, mask=hok[None, :])
        if chunk == 0:
            tl.store(m_ptr + part, m_i, mask=hok)
            tl.store(l_ptr + part, l_i, mask=hok)

    @triton.jit
    def _encode_keys_kernel(x_ptr, u_ptr, ju_ptr, sq_ptr, cross_ptr, codes_ptr, M, GROUPS, R: tl.constexpr,
                            N: tl.constexpr, NP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BM: tl.constexpr,
                            AC: tl.constexpr, INTERP: tl.constexpr):
        """Program (block of BM tokens, group grp): x [M, G, W] (the unit keys' pairs of the group, (x, y) interleaved,
        W = 2g), per (group, stage) u, ju [N, W], sq [N], cross [N, N] -> codes [M, G, R, 2] (int32). A stage's tables
        are loaded once for the block's tokens; the N^2 distances of a token are taken AC values of a at a time."""
        pid = tl.program_id(0)
        grp = tl.program_id(1)
        i = pid * BM + tl.arange(0, BM)
        im = i < M
        w = tl.arange(0, WP)
        wm = w < W
        b = tl.arange(0, NP)
        ac = tl.arange(0, AC)
        res = tl.load(x_ptr + (i[:, None] * GROUPS + grp) * W + w[None, :], mask=im[:, None] & wm[None, :], other=0.0)
        flat_index = tl.arange(0, AC * NP)
        for r in range(R):
            st = grp * R + r
            ju = tl.load(ju_ptr + (st * N + b[:, None]) * W + w[None, :], mask=(b < N)[:, None] & wm[None, :],
                         other=0.0)  # [NP, WP]
            sq_b = tl.load(sq_ptr + st * N + b, mask=b < N, other=0.0)
            # as vq.squared_distances: P_a = sq_a - 2 <r, u_a>, Q_b = sq_b - 2 <r, J u_b>, then + G_ab + |r|^2
            qb = sq_b[None, :] + -2.0 * dot(res, tl.trans(ju), INTERP)  # [BM, NP]
            rsq = tl.sum(res * res, 1)
            best = tl.full((BM,), float("inf"), res.dtype)
            best_a = tl.zeros((BM,), tl.int32)
            best_b = tl.zeros((BM,), tl.int32)
            for a0 in range(0, NP, AC):
                a = a0 + ac
                am = a < N
                u = tl.load(u_ptr + (st * N + a[:, None]) * W + w[None, :], mask=am[:, None] & wm[None, :], other=0.0)
                sq_a = tl.load(sq_ptr + st * N + a, mask=am, other=0.0)
                pa = sq_a[None, :] + -2.0 * dot(res, tl.trans(u), INTERP)  # [BM, AC]
                cross = tl.load(cross_ptr + (st * N + a[:, None]) * N + b[None, :],
                                mask=am[:, None] & (b < N)[None, :], other=0.0)
                d2 = pa[:, :, None] + qb[:, None, :]
                d2 = d2 + cross[None, :, :]
                d2 = tl.maximum(d2 + rsq[:, None, None], 0.0)
                d2 = tl.where(am[None, :, None] & (b < N)[None, None, :], d2, float("inf"))
                d2 = tl.reshape(d2, (BM, AC * NP))
                low = tl.min(d2, 1)
                first = tl.min(tl.where(d2 == low[:, None], flat_index[None, :], AC * NP), 1)  # first minimum
                take = low < best  # strictly: an earlier a keeps a tie, as torch's first index of the minimum
                best = tl.where(take, low, best)
                best_a = tl.where(take, a0 + first // NP, best_a)
                best_b = tl.where(take, first % NP, best_b)
            out = codes_ptr + ((i * GROUPS + grp) * R + r) * 2
            tl.store(out, best_a, mask=im)
            tl.store(out + 1, best_b, mask=im)
            # residual -= w_a + J w_b (the centre of (a, b))
            ua = tl.load(u_ptr + (st * N + best_a[:, None]) * W + w[None, :], mask=wm[None, :], other=0.0)
            jub = tl.load(ju_ptr + (st * N + best_b[:, None]) * W + w[None, :], mask=wm[None, :], other=0.0)
            res = res - (ua + jub)


def unsupported(q: torch.Tensor, packed, storage) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    reason = K.unsupported(q)
    if reason:
        return reason
    if packed.rope_cos is None:
        return "no RoPE tables in the packed cache (keys are stored before RoPE)"
    if q.dtype == torch.float64 and q.is_cuda:
        # the float64 value step (a broadcast product, no tensor cores) stages [code bits, tokens, heads] float64
        # operands: over sm_90's 227 KB of shared memory at 2 bits by an sm_90 compile (262144 B with Triton 3.9 at
        # 16 or 32 tokens, 4 MB with Triton 3.6); float64 is an exactness mode, which the torch references serve
        return "float64 queries on a GPU (the kernel's float64 value step exceeds shared memory)"
    return None


def _workspace(storage, dtype, device):
    """The kernels' per-layer constants in the compute dtype: theta_heads [Hkv, R, N, P, 2] and the codebook, the
    channel scale, and the key encoder's stage tables (u, ju, sq, cross)."""
    tables = storage.constants(dtype)
    if "kernel" not in tables:
        theta = tables["theta"]
        groups, stages, n = theta.shape[:3]
        stage_tables = [vq.StageTables.of(theta[g, r]) for g in range(groups) for r in range(stages)]
        tables["kernel"] = {
            "u": torch.stack([t.u for t in stage_tables]).contiguous(),
            "ju": torch.stack([t.ju for t in stage_tables]).contiguous(),
            "sq": torch.stack([t.sq for t in stage_tables]).contiguous(),
            "cross": torch.stack([t.cross for t in stage_tables]).contiguous(),
        }
    return tables


def encode_keys_triton(rows: torch.Tensor, theta: torch.Tensor, channels: torch.Tensor, index_bits: int, *,
                       storage=None, block_m: int = ENCODE_BLOCK_M, codes_chunk: int = 16, num_warps: int = 8):
    """storage.encode_keys with the nearest-code search in Triton: rows [M, C] (pre-RoPE keys) -> (key words
    [M, WK] int32 as pack_stream packs them, kappa [M] fp16). The norms, unit pairs and the packing are torch ops."""
    x = rows.to(theta.dtype)
    norms = x.norm(dim=-1)
    unit = x / norms.clamp_min(torch.finfo(x.dtype).tiny)[..., None]
    groups, stages, n, g = theta.shape[:4]
    pairs = unit[:, channels].reshape(x.shape[0], groups, 2 * g).contiguous()  # (x, y) interleaved per pair
    if storage is not None:
        kt = _workspace(storage, theta.dtype, theta.device)["kernel"]
    else:
        st = [vq.StageTables.of(theta[gi, r]) for gi in range(groups) for r in range(stages)]
        kt = {k: torch.stack([getattr(t, k) for t in st]).contiguous() for k in ("u", "ju", "sq", "cross")}
    m = x.shape[0]
    codes = torch.empty(m, groups, stages, 2, dtype=torch.int32, device=x.device)
    if m:
        with launch_device(x):
            _encode_keys_kernel[(triton.cdiv(m, block_m), groups)](
                pairs, kt["u"], kt["ju"], kt["sq"], kt["cross"], codes, m, groups, R=stages, N=n, NP=max(pow2(n), 16),
                W=2 * g, WP=max(pow2(2 * g), 16), BM=block_m, AC=min(codes_chunk, max(pow2(n), 16)),
                INTERP=K.INTERPRET, num_warps=num_warps, **({"enable_fp_fusion": False} if x.dtype == torch.float64
                                                            else {}))
    return pack_stream(codes.reshape(m, -1), index_bits), norms.clamp(max=FP16_MAX).half()


PROBES = {None: 0, "const_codes": 1, "no_gathers": 2, "no_value_mass": 3, "no_key_pass": 4}


def attend_triton(q: torch.Tensor, packed, scale: float, fp, storage, *, block_t: int | None = None,
                  num_warps: int | None = None, tiles: int | None = None, value_block_t: int | None = None,
                  value_chunk: int | None = None, value_warps: int | None = None, num_splits: int | None = None,
                  programs_per_sm: int | None = None, code_chunk: int | None = None,
                  fp16_codewords: bool | None = None, score_dot: str | None = None, score_dot_n: int | None = None,
                  probe: str | None = None):
    """Partials of q [B, Hq, D] (after RoPE) over CommVQ's packed tokens and the full-precision part `fp` (module
    docstring: _key_scores_kernel writes the scores, _value_mass_kernel the probability mass per code bit,
    _codebook_kernel the partials). Keyword-only tuning knobs: block_t (tokens per key tile, >= 16), num_warps (key
    pass), tiles (key tiles per program), value_block_t, value_chunk (value-code bits per program, a power of two >=
    32), value_warps, num_splits (default from programs_per_sm x SMs), code_chunk (codes per codebook program, >= 16),
    fp16_codewords (fp16/bf16 queries: gather the codewords, which 16-bit queries read rounded to fp16, as fp16 (the
    default: half the bytes) or as float32 copies of the same values (False)), score_dot (the key pass's dot of the
    rotated keys with the group's queries, "sum" (the default), "mma" (tf32x3 tensor cores) or "fma" (Triton's FMA
    dot: a token's pairs summed in one thread); the dots pad the group's query heads to score_dot_n (default 16, a
    power of two); float64 queries always sum), probe (timing only, wrong results: "const_codes", "no_gathers",
    "no_value_mass", "no_key_pass")."""
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
    hq = hkv * group
    score_dot = score_dot or SCORE_DOT
    if score_dot not in SCORE_DOTS:
        raise KvcalError(f"commvq score_dot must be one of {sorted(SCORE_DOTS)}, got '{score_dot}'")
    dot_n = score_dot_n or SCORE_DOT_N
    if dot_n != pow2(dot_n):
        raise KvcalError(f"commvq score_dot_n must be a power of two, got {dot_n}")
    if probe not in PROBES:
        raise KvcalError(f"commvq probe must be one of {sorted(p for p in PROBES if p)}, got '{probe}'")
    tables = _workspace(storage, q.dtype, dev)
    theta_heads, values = tables["theta_heads"], tables["values"]
    if q.dtype in (torch.float16, torch.bfloat16):  # the codewords rounded to fp16 (storage.decode_codewords)
        if "theta_heads_fp16" not in tables:
            tables["theta_heads_fp16"] = theta_heads.half()
        name = "theta_heads_fp16"
        if not (FP16_CODEWORDS if fp16_codewords is None else fp16_codewords):
            name = "theta_heads_rounded"  # the same values gathered as float32, made once, when a call first reads
            if name not in tables:
                tables[name] = tables["theta_heads_fp16"].float()
        theta_heads = tables[name]
    codebook, channel_scale = values["codebook"], values["channel_scale"]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    kc, kn, vc, vr = packed["k_codes"], packed["k_norm"], packed["v_codes"], packed["v_rho"]
    gp = pow2(group)
    tcap = kc.shape[1]
    nc = codebook.shape[0]
    wv = vc.shape[-1]
    ncb = pow2(wv) * 32
    ncc = min(code_chunk or CODE_CHUNK, ncb)
    nchunks = ncb // ncc
    rows = batch * hkv
    target = (programs_per_sm or PROGRAMS_PER_SM) * K.sm_count(dev)
    qk_hi, qk_lo = K.qk_scale_parts(scale)
    opts = {"enable_fp_fusion": False} if q.dtype == torch.float64 else {}
    fp_count = K.fp_splits(fp)
    parts = Partials.empty(rows, nchunks + fp_count, group, d, q.dtype, dev)
    prec = PREC.get(q.dtype, 16)
    kbt = block_t or KEY_BLOCK_T
    ntile = (tiles or KEY_TILES)
    vbt = value_block_t or (VALUE_BLOCK_T_FP32 if q.dtype == torch.float32 else VALUE_BLOCK_T)
    vcc = min(value_chunk or VALUE_CHUNK, ncb)
    vchunks = ncb // vcc
    if num_splits:
        nsplit = int(num_splits)
    else:
        nsplit = max(1, min(triton.cdiv(target, batch * vchunks), triton.cdiv(tcap, 4 * vbt)))
    hqp = max(pow2(hq), 16)
    sdot = 0 if q.dtype == torch.float64 else SCORE_DOTS[score_dot]  # no float64 tl.dot (quant/tiles.dot)
    scores = (torch.zeros if probe == "no_key_pass" else torch.empty)(batch, hq, tcap, dtype=acc_dtype, device=dev)
    m_s = torch.empty(rows, nsplit, group, dtype=acc_dtype, device=dev)
    l_s = torch.empty_like(m_s)
    mass = torch.empty(rows, nsplit, group, ncb, dtype=acc_dtype, device=dev)
    with launch_device(q):
        if probe != "no_key_pass":
            _key_scores_kernel[(triton.cdiv(tcap, kbt * ntile), batch, hkv)](
                q, q.stride(0), q.stride(1), packed.lengths, kc, kc.stride(0), kc.stride(1), kn, kn.stride(0),
                theta_heads, packed.rope_cos, packed.rope_sin, packed.pos_offset,
                scores, scores.stride(0), scores.stride(1), qk_hi, qk_lo,
                D=d, G=group, GP=max(gp, dot_n) if sdot else gp, R=storage.stages, NCODE=storage.codes,
                IB=storage.index_bits, NPH=storage.groups // hkv, GPAIRS=storage.group_pairs, WK=kc.shape[-1],
                BLOCK_T=kbt, TILES=ntile, PROBE=PROBES[probe] % 3, SCORE_DOT=sdot, INTERP=K.INTERPRET,
                CAP=K.cap_log2(packed.softcap),
                num_warps=num_warps or KEY_WARPS, **opts,  # value probes: the full key pass
            )
        _value_mass_kernel[(vchunks, nsplit, batch)](
            scores, scores.stride(0), scores.stride(1), packed.lengths,
            packed.lengths if packed.first is None else packed.first, vc, vc.stride(0), vc.stride(1),
            vr, vr.stride(0), m_s, l_s, mass, nsplit,
            HQ=hq, HQP=hqp, G=group, WV=wv, NCB=ncb, NCC=vcc, BLOCK_T=vbt, INTERP=K.INTERPRET, PREC=prec,
            PROBE=PROBES[probe], FIRST=int(packed.first is not None),
            num_warps=value_warps or max(4, min(16, vcc * hqp // 1024)), **opts,
        )
    with launch_device(q):
        _codebook_kernel[(rows, nchunks)](
            m_s, l_s, mass, codebook, channel_scale, parts.m, parts.l, parts.acc, hkv, nsplit, nchunks + fp_count,
            nc, C=codebook.shape[1], D=d, G=group, GP=gp, NCB=ncb, NCC=ncc, SP=pow2(nsplit), num_warps=4,
        )
    if fp is not None:
        K.fp_partials_into(q, fp, scale, parts, nchunks, softcap=packed.softcap)
    return parts
