"""CommVQ's Triton kernels, beside their torch references in kvcal/methods/commvq.py (CommVQStorage).

Decode attention (`attend_triton`, reference CommVQStorage.attend_reference), two launches and the generic ones:

1. `_scores_mass_kernel`, grid (B * Hkv, NSPLIT): program (row b, KV head h, split s) walks an equal BLOCK_T-aligned
   share of row b's tokens (runtime/kernels.split_bounds: no host sync). Per tile of BLOCK_T tokens:
   - keys: for every stage r and code e in (a, b) the token's index is cut from its bit stream, and the codeword
     row theta_heads[h, r, index] (P pairs (x, y), contiguous) is gathered; the stages are summed before the single
     rotation (A = sum_r w_a + i w_b per pair, the commutation of digest §3.4: one rotation per token and pair
     whatever R is), the sum is rotated by the token's position (the model's float32 RoPE tables), and dotted with
     the GQA group's queries: score = kappa * scale * q~ . R_i k_hat. The same sum as fused_key_scores' (Eq. 19),
     grouped per codeword instead of per table entry: the table of q against the codebook (d, c per query head)
     holds rep = Hq / Hkv times more values than the codebook itself, so the kernel gathers the codebook and
     multiplies by q after the rotation (docs/commvq.md counts both).
   - online softmax in the log2 domain (runtime/kernels.softmax_tile);
   - values, Eq. 22: the probability mass per code bit, mass[n, head] += sum_t bit[t, n] rho_t p[t, head], one
     tensor-core dot of the tile's unpacked bits [N_c, BLOCK_T] (0/1, exact in fp16) with rho * p [BLOCK_T, heads]
     (fp16 hi + lo parts for fp16/bf16 queries: ~fp32 precision; float32 / float64 dots otherwise).
   It writes (m, l) and the unnormalized mass [N_c] per query head of its split to a scratch buffer.
2. `_codebook_kernel`, grid (B * Hkv, N_c / NCC): combines the splits' mass in code chunks of NCC (each split
   rescaled by exp2(m_s - max)), multiplies the chunk by the KV head's slice of the value codebook C_V [NCC, D] and
   the per-channel scale (applied after C_V, digest §8 item 14), and writes it as one softmax partial of the
   runtime's format: every chunk carries m = the row's max, chunk 0 the row's sum l and the others l = 0, so the
   generic merge adds the chunks' products (sum_c w acc_c / sum w l).
3. the full-precision window: runtime/kernels.fp_partials_into into the last splits; runtime/kernels.merge_triton
   merges all (decode_attention calls it).

Key encoding (`encode_keys_triton`, reference commvq.encode_keys): one program per (block of 16 tokens, group) runs
the greedy residual search over the stages with the fast distance decomposition of quant/vq.py
(|r - c_ab|^2 = |r|^2 + P_a + Q_b + G_ab: two small dots per stage, the [N, N] cross term precomputed per stage),
the argmin over the N^2 centres taken 16 values of a at a time (the first minimum, as torch's), and subtracts the
chosen centre. A stage's tables (u, J u: 2 N 2g floats, 64 KB at N = 64 and g = 64 in fp32) are loaded once per
block of tokens, not per token.
"""

from __future__ import annotations

import torch

from kvcal.errors import KvcalError
from kvcal.quant.packing import launch_device, pow2
from kvcal.runtime import kernels as K

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # fp16 hi + lo value dots for fp16 and bf16 queries
BLOCK_T = 32  # tokens per tile
# Tokens per tile for float32 queries. Their value dot (PREC 32: ieee float32 operands, no tensor cores) stages the
# tile's bits [N_c, BLOCK_T] and rho p [BLOCK_T, 16] in shared memory as float32: at 2 bits on Llama-3.1-8B shapes
# (N_c 2048) _scores_mass_kernel needed 264192 B with 32-token tiles (2048 x 32 x 4 + 32 x 16 x 4), over sm_90's
# 232448 B (OutOfResources on the H100), and needs 132096 B with 16-token tiles. From a Triton 3.9 compile for sm_90
# (triton.compile, no GPU run; Triton 3.6 gave the same numbers). fp16 / bf16 queries keep BLOCK_T (2 bits 133120 B,
# 1 bit 67584 B). float64 keeps it too: at 2 bits its value sums (no dot) are over the limit at either tile (Triton
# 3.9: 262144 B at 32 and at 16 tokens), not fixed here.
BLOCK_T_FP32 = 16
PROGRAMS_PER_SM = 4  # split programs per SM (each writes a mass partial of N_c x G floats)
CODE_CHUNK = 32  # codes per program of the codebook kernel
ENCODE_BLOCK_M = 16  # tokens per program of the key encoder (each stage's tables are loaded once per block)


if triton is not None:
    from kvcal.runtime.kernels import dot, regroup, softmax_tile, split_bounds

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
    def _scores_mass_kernel(
        q_ptr, sqb, sqh, len_ptr,
        kc_ptr, skb, skt, kn_ptr, sknb,
        vc_ptr, svb, svt, vr_ptr, svrb,
        th_ptr, cos_ptr, sin_ptr, pos_offset,
        m_ptr, l_ptr, mass_ptr, HKV, qk_scale_hi, qk_scale_lo, NSPLIT,
        D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GPV: tl.constexpr, R: tl.constexpr,
        NCODE: tl.constexpr, IB: tl.constexpr, NPH: tl.constexpr, GPAIRS: tl.constexpr, WK: tl.constexpr,
        WV: tl.constexpr, WVP: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
        TABLE: tl.constexpr,
    ):
        ACC: tl.constexpr = m_ptr.dtype.element_ty
        if PREC == 64:
            qk_scale = tl.cast(qk_scale_hi, ACC) + tl.cast(qk_scale_lo, ACC)
        else:
            qk_scale = qk_scale_hi
        P: tl.constexpr = D // 2
        NCB: tl.constexpr = WVP * 32
        MASK: tl.constexpr = (1 << IB) - 1
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        part = pid * NSPLIT + split
        start, end = split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T)
        rk = tl.arange(0, GP)
        jj = tl.arange(0, P)
        q_row = q_ptr + b * sqb + h * G * sqh
        q1 = tl.load(q_row + rk[None, :] * sqh + jj[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)  # [P, GP]
        q2 = tl.load(q_row + rk[None, :] * sqh + P + jj[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
        m_i = tl.full((GP,), float("-inf"), ACC)
        l_i = tl.zeros((GP,), ACC)
        mass = tl.zeros((NCB, GPV), ACC)
        gi = tl.arange(0, NPH)  # the KV head's groups
        xy = tl.arange(0, 2)
        th_head = th_ptr + h * (R * NCODE * P * 2)
        wv = tl.arange(0, WVP)
        sh32 = tl.arange(0, 32).to(tl.uint32)
        tab_head = th_ptr + pid * (R * NCODE * P * GP * 2)  # TABLE: this row's table of q against the codebook
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < end
            krow = kc_ptr + b * skb + t * skt  # [BLOCK_T] code rows
            kx = tl.zeros((BLOCK_T, P), ACC)
            ky = tl.zeros((BLOCK_T, P), ACC)
            if TABLE:
                big_a = tl.zeros((BLOCK_T, P, GP), ACC)
                big_b = tl.zeros((BLOCK_T, P, GP), ACC)
            for r in range(R):
                for e in tl.static_range(2):
                    bit = (((h * NPH + gi) * R + r) * 2 + e) * IB  # [NPH] stream bit of the group's code
                    wi = bit // 32
                    sh = (bit % 32).to(tl.uint32)
                    w0 = tl.load(krow[:, None] + wi[None, :], mask=tm[:, None], other=0).to(tl.uint32, bitcast=True)
                    w1 = tl.load(krow[:, None] + wi[None, :] + 1, mask=tm[:, None] & (wi + 1 < WK)[None, :],
                                 other=0).to(tl.uint32, bitcast=True)
                    hi = tl.where(sh[None, :] > 0, w1 << ((32 - sh) % 32)[None, :], 0)
                    code = (((w0 >> sh[None, :]) | hi) & MASK).to(tl.int32)  # [BLOCK_T, NPH]
                    code = tl.reshape(tl.broadcast_to(code[:, :, None], (BLOCK_T, NPH, GPAIRS)), (BLOCK_T, P))
                    if TABLE:  # the entries (d, c) of the group's query heads: [BLOCK_T, P, GP, 2]
                        off = (((r * NCODE + code) * P + jj[None, :]) * GP)[:, :, None] + rk[None, None, :]
                        dc = tl.load(tab_head + off[:, :, :, None] * 2 + xy[None, None, None, :])
                        dd, cc = tl.split(dc)
                        if e == 0:  # A += d[a], B += c[a]
                            big_a += dd
                            big_b += cc
                        else:  # A += c[b], B -= d[b]
                            big_a += cc
                            big_b -= dd
                    else:
                        off = ((r * NCODE + code) * P + jj[None, :]) * 2  # codeword (x, y) of pair j
                        pair = tl.load(th_head + off[:, :, None] + xy[None, None, :]).to(ACC)  # [BLOCK_T, P, 2]
                        x, y = tl.split(pair)
                        if e == 0:  # w_a: row 0 of C_a
                            kx += x
                            ky += y
                        else:  # i w_b: row 1 of C_b, (-y, x)
                            kx -= y
                            ky += x
            # one rotation per token and pair (HF rotate_half: channel j pairs with j + P)
            pos = pos_offset + t
            c = tl.load(cos_ptr + pos[:, None] * D + jj[None, :], mask=tm[:, None], other=0.0).to(ACC)
            sn = tl.load(sin_ptr + pos[:, None] * D + jj[None, :], mask=tm[:, None], other=0.0).to(ACC)
            kappa = tl.load(kn_ptr + b * sknb + t, mask=tm, other=0.0).to(ACC)
            if TABLE:  # fused_key_scores: sum_p cos A_p + sin B_p
                s = tl.sum(c[:, :, None] * big_a + sn[:, :, None] * big_b, 1)  # [BT, GP]
            else:
                k1 = kx * c - ky * sn
                k2 = ky * c + kx * sn
                s = tl.sum(k1[:, :, None] * q1[None, :, :], 1) + tl.sum(k2[:, :, None] * q2[None, :, :], 1)
            s = tl.where(tm[:, None], s * (kappa * qk_scale)[:, None], float("-inf"))
            p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, rk < G)
            # ---- values: probability mass per code bit (Eq. 22)
            rho = tl.load(vr_ptr + b * svrb + t, mask=tm, other=0.0).to(ACC)
            pv = regroup(p * rho[:, None], GP, GPV, BLOCK_T)  # [BLOCK_T, GPV], padding heads 0
            av = tl.reshape(regroup(alpha[None, :], GP, GPV, 1), (GPV,))
            words = tl.load(vc_ptr + b * svb + t[None, :] * svt + wv[:, None],
                            mask=tm[None, :] & (wv < WV)[:, None], other=0).to(tl.uint32, bitcast=True)  # [WVP, BT]
            bits = tl.reshape((words[:, None, :] >> sh32[None, :, None]) & 1, (NCB, BLOCK_T))
            mass = mass * av[None, :] + _value_dot(bits, pv, PREC, INTERP)
        rv = tl.arange(0, GPV)
        nn = tl.arange(0, NCB)
        tl.store(mass_ptr + (part * G + rv[None, :]) * NCB + nn[:, None], mass, mask=(rv < G)[None, :])
        tl.store(m_ptr + part * G + rk, m_i, mask=rk < G)
        tl.store(l_ptr + part * G + rk, l_i, mask=rk < G)

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
        from kvcal.quant import vq

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
    """commvq.encode_keys with the nearest-code search in Triton: rows [M, C] (pre-RoPE keys) -> (key words
    [M, WK] int32 as pack_stream packs them, kappa [M] fp16). The norms, unit pairs and the packing are torch ops."""
    from kvcal.methods.commvq import FP16_MAX, pack_stream
    from kvcal.quant import vq

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


def query_tables(q: torch.Tensor, theta_heads: torch.Tensor, gp: int, dtype) -> torch.Tensor:
    """The per-step table of Eq. 19 for key_path="table": q [B, Hq, D] (after RoPE) against theta_heads [Hkv, R, N, P,
    2] -> [B, Hkv, R, N, P, GP, 2] entries (d, c) = (qx x + qy y, qy x - qx y) of each of the KV head's query heads
    (padded to GP with zeros), as fused_key_scores builds them."""
    batch, hq, d = q.shape
    hkv, half = theta_heads.shape[0], d // 2
    qg = q.to(dtype).view(batch, hkv, hq // hkv, d)
    if gp > hq // hkv:
        qg = torch.nn.functional.pad(qg, (0, 0, 0, gp - hq // hkv))
    qx, qy = qg[..., :half], qg[..., half:]  # [B, Hkv, GP, P]
    x, y = theta_heads[..., 0].to(dtype), theta_heads[..., 1].to(dtype)  # [Hkv, R, N, P]
    table_d = torch.einsum("bhgp,hrnp->bhrnpg", qx, x) + torch.einsum("bhgp,hrnp->bhrnpg", qy, y)
    table_c = torch.einsum("bhgp,hrnp->bhrnpg", qy, x) - torch.einsum("bhgp,hrnp->bhrnpg", qx, y)
    return torch.stack((table_d, table_c), -1).contiguous()


def attend_triton(q: torch.Tensor, packed, scale: float, fp, storage, *, block_t: int | None = None,
                  num_splits: int | None = None, programs_per_sm: int | None = None, num_warps: int | None = None,
                  code_chunk: int | None = None, fp16_codewords: bool = False, key_path: str = "codewords"):
    """Partials of q [B, Hq, D] (after RoPE) over CommVQ's packed tokens and the full-precision part `fp` (module
    docstring). Keyword-only tuning knobs: block_t (tokens per tile, >= 16; default BLOCK_T, BLOCK_T_FP32 for float32
    queries), num_splits (default from programs_per_sm x SMs), num_warps of the split kernel (default: the
    mass accumulator [N_c, 16] and a tile's unpacked bits at about 64 registers per thread each), code_chunk (codes
    per codebook program, >= 16),
    fp16_codewords (fp16/bf16 queries: gather the codewords in fp16, half the bytes of the gathers that bound the
    kernel (docs/commvq.md), at a rounding of each codeword to 2^-11 relative; off by default: not measured),
    key_path: "codewords" (gather the codewords, rotate their stage sum, dot with the group's queries) or "table" (the
    paper's kernel and fused_key_scores: a table of q against the codebooks built per step in torch, [B, Hkv, R, N', P,
    G, 2] entries (d, c), gathered by the indices, then cos A + sin B), for measuring one against the other."""
    from kvcal.runtime.decode import Partials

    batch, hq, d = q.shape
    hkv = packed.heads
    group = hq // hkv
    dev = q.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables = _workspace(storage, q.dtype, dev)
    theta_heads, values = tables["theta_heads"], tables["values"]
    if fp16_codewords and q.dtype in (torch.float16, torch.bfloat16):
        if "theta_heads_fp16" not in tables:
            tables["theta_heads_fp16"] = theta_heads.half()
        theta_heads = tables["theta_heads_fp16"]
    codebook, channel_scale = values["codebook"], values["channel_scale"]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    kc, kn, vc, vr = packed["k_codes"], packed["k_norm"], packed["v_codes"], packed["v_rho"]
    if key_path not in ("codewords", "table"):
        raise KvcalError(f"commvq key_path must be codewords or table, got '{key_path}'")
    gp = pow2(group)
    if key_path == "table":
        theta_heads = query_tables(q, tables["theta_heads"], gp, acc_dtype)
    bt = block_t or (BLOCK_T_FP32 if q.dtype == torch.float32 else BLOCK_T)
    tcap = kc.shape[1]
    if num_splits:
        nsplit = int(num_splits)
    else:
        target = (programs_per_sm or PROGRAMS_PER_SM) * K.sm_count(dev)
        nsplit = max(1, min(triton.cdiv(target, batch * hkv), triton.cdiv(tcap, 4 * bt)))
    gpv = max(gp, 16)
    nc = codebook.shape[0]
    wv = vc.shape[-1]
    ncb = pow2(wv) * 32
    ncc = min(code_chunk or CODE_CHUNK, ncb)
    rows = batch * hkv
    m_s = torch.empty(rows, nsplit, group, dtype=acc_dtype, device=dev)
    l_s = torch.empty_like(m_s)
    mass = torch.empty(rows, nsplit, group, ncb, dtype=acc_dtype, device=dev)
    nchunks = ncb // ncc
    fp_count = K.fp_splits(fp)
    parts = Partials.empty(rows, nchunks + fp_count, group, d, q.dtype, dev)
    warps = num_warps or max(4, min(16, ncb * gpv // 2048))
    qk_hi, qk_lo = K.qk_scale_parts(scale)
    opts = {"enable_fp_fusion": False} if q.dtype == torch.float64 else {}
    with launch_device(q):
        _scores_mass_kernel[(rows, nsplit)](
            q, q.stride(0), q.stride(1), packed.lengths,
            kc, kc.stride(0), kc.stride(1), kn, kn.stride(0),
            vc, vc.stride(0), vc.stride(1), vr, vr.stride(0),
            theta_heads, packed.rope_cos, packed.rope_sin, packed.pos_offset,
            m_s, l_s, mass, hkv, qk_hi, qk_lo, nsplit,
            D=d, G=group, GP=gp, GPV=gpv, R=storage.stages, NCODE=storage.codes,
            IB=storage.index_bits, NPH=storage.groups // hkv, GPAIRS=storage.group_pairs, WK=kc.shape[-1],
            WV=wv, WVP=pow2(wv), BLOCK_T=bt, INTERP=K.INTERPRET, PREC=PREC.get(q.dtype, 16),
            TABLE=int(key_path == "table"), num_warps=warps,
            **opts,
        )
        _codebook_kernel[(rows, nchunks)](
            m_s, l_s, mass, codebook, channel_scale, parts.m, parts.l, parts.acc, hkv, nsplit, nchunks + fp_count,
            nc, C=codebook.shape[1], D=d, G=group, GP=gp, NCB=ncb, NCC=ncc, SP=pow2(nsplit), num_warps=4,
        )
    if fp is not None:
        K.fp_partials_into(q, fp, scale, parts, nchunks)
    return parts
