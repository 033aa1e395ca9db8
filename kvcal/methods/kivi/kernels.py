"""KIVI's decode kernel: attention of one query per row over per-channel key codes (one fp16 scale and zero per
channel and block of `block` tokens) and per-token value codes (groups of channels), the torch reference being
KiviStorage.attend_reference (kvcal/methods/kivi/storage.py).

Grid (B * Hkv, S), one program per (row, KV head, split) over all G query heads of the KV head; splits s < NSPLIT take
an equal BLOCK_T-aligned share of the row's packed tokens, split NSPLIT the full-precision part (the residual window;
runtime/kernels.fp_segment). Keys: a tile lies inside one key block (the host sizes it), so the block's scale folds
into the query once per tile: q.k = (q * s_blk) . c + q . z_blk, one tensor-core dot. Where the block is not a
multiple of 16 tokens (or `generic_keys`), the keys are dequantized in float32 per tile instead (the generic path).
Values: the per-token format of quant/uniform_kernels (token_group_values).
"""

from __future__ import annotations

import torch

from kvcal.quant.packing import launch_device, pow2
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import Partials

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # rounded dot operands: fp16 for fp16 and bf16 queries
UNPACK_BITS = (1, 2, 3, 4, 8)
# (block_t, num_warps, num_stages, max registers) chosen by measurement at 32K x 8: one warp, a tile inside one key
# block (q scaled once per tile); the generic path 4 warps
DEFAULTS = {"tile": (32, 1, 3, None), "generic": (32, 4, 2, None)}
# tiles ahead whose code rows are prefetched into L2: none on the fast path, where it gained nothing for kivi4 (32K x 8)
PREFETCH = {"tile": 0, "generic": 1}

if triton is not None:
    from kvcal.quant.packing import mma_channels, mma_code_scale, unpack_mma, unpack_tile
    from kvcal.quant.uniform_kernels import token_group_output, token_group_values, token_params
    from kvcal.runtime.kernels import (
        dot,
        fp_segment,
        mma_operand,
        operand,
        prefetch_l2,
        regroup,
        softmax_tile,
        split_bounds,
        store_partial,
    )

    @triton.jit
    def _block_params(ks_base, kz_base, t0, end, skst, KEY_BLOCK: tl.constexpr, D: tl.constexpr,
                      BITS: tl.constexpr):
        """The key scale and zero [D] of the block holding tile t0 (in mma_channels order), loaded a tile ahead."""
        ch = mma_channels(0, D, BITS)
        off = (t0 // KEY_BLOCK) * skst + ch
        m = (t0 + ch * 0) < end
        return tl.load(ks_base + off, mask=m, other=0.0), tl.load(kz_base + off, mask=m, other=0.0)

    @triton.jit
    def _key_half(kptr, tm, t, C0: tl.constexpr, HD: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
                  ks_base, kz_base, skst, KEY_BLOCK: tl.constexpr):
        """Dequantized channels [C0, C0 + HD) of a key tile, fp32 [BLOCK_T, HD] (generic path)."""
        c = unpack_tile(kptr, tm, C0, HD, 2 * HD, BITS, BLOCK_T)
        ch = C0 + tl.arange(0, HD)
        off = (t // KEY_BLOCK)[:, None] * skst + ch[None, :]
        s = tl.load(ks_base + off, mask=tm[:, None], other=0.0).to(tl.float32)
        z = tl.load(kz_base + off, mask=tm[:, None], other=0.0).to(tl.float32)
        return c.to(tl.float32) * s + z

    @triton.jit
    def _tile_kernel(
        q_ptr, sqb, sqh, len_ptr,
        kc_ptr, skb, skh, skt, ks_ptr, kz_ptr, sksb, sksh, skst,
        vc_ptr, svb, svh, svt, vs_ptr, vz_ptr, svsb, svsh, svst,
        fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, F,
        m_ptr, l_ptr, acc_ptr, HKV, qk_scale_hi, qk_scale_lo, NSPLIT,
        D: tl.constexpr, G: tl.constexpr, GPK: tl.constexpr, GPV: tl.constexpr, GV: tl.constexpr,
        GPF: tl.constexpr, KALIGN: tl.constexpr, VALIGN: tl.constexpr, KBITS: tl.constexpr, KEY_BLOCK: tl.constexpr,
        GENERIC_K: tl.constexpr, VBITS: tl.constexpr, HAS_FP: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
        PREFETCH: tl.constexpr, KROW: tl.constexpr, VROW: tl.constexpr,
    ):
        ACC: tl.constexpr = m_ptr.dtype.element_ty  # softmax state and sums: float64 for float64, else float32
        # scalar arguments arrive as float32: the scale comes in two parts so float64 gets it to ~2^-48
        if PREC == 64:
            qk_scale = tl.cast(qk_scale_hi, ACC) + tl.cast(qk_scale_lo, ACC)
        else:
            qk_scale = qk_scale_hi
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        S = NSPLIT + HAS_FP
        q_row = q_ptr + b * sqb + h * G * sqh
        part = pid * S + split
        if split < NSPLIT:
            start, end = split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T)
            HD: tl.constexpr = D // 2
            MV: tl.constexpr = GPV * GV
            rk = tl.arange(0, GPK)
            rv = tl.arange(0, GPV)
            ks_base = ks_ptr + b * sksb + h * sksh
            kz_base = kz_ptr + b * sksb + h * sksh
            vs_base = vs_ptr + b * svsb + h * svsh
            vz_base = vz_ptr + b * svsb + h * svsh
            # ---- per-program key setup
            if GENERIC_K:
                hh = tl.arange(0, HD)
                q1 = tl.load(q_row + rk[None, :] * sqh + hh[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
                q2 = tl.load(q_row + rk[None, :] * sqh + HD + hh[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
                qa = operand(q1, PREC)
                qb = operand(q2, PREC)
                kp_s = tl.zeros((1,), tl.float16)
                kp_z = kp_s
            else:
                kch = mma_channels(0, D, KBITS)
                qf = tl.load(q_row + rk[None, :] * sqh + kch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
                kinv = 1.0 / mma_code_scale(D, KBITS).to(ACC)  # code columns hold code * f (unpack_mma)
                kp_s, kp_z = _block_params(ks_base, kz_base, start, end, skst, KEY_BLOCK, D, KBITS)
            m_i = tl.full((GPK,), float("-inf"), ACC)
            l_i = tl.zeros((GPK,), ACC)
            acc = tl.zeros((D, MV), ACC)
            corr = tl.zeros((MV,), ACC)
            vp_s, vp_z = token_params(vs_base, vz_base, start, end, svst, GV, BLOCK_T)
            krow0 = kc_ptr + b * skb + h * skh  # this (row, KV head)'s code rows
            vrow0 = vc_ptr + b * svb + h * svh
            for t0 in range(start, end, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tm = t < end
                # rows start on KALIGN-word boundaries (the host checked the strides)
                kptr = krow0 + tl.multiple_of(t * skt, KALIGN)
                if PREFETCH > 0 and not INTERP:  # the code rows of the tile PREFETCH tiles ahead into L2
                    tp = t0 + PREFETCH * BLOCK_T  # rows are contiguous (the host checked): one range each
                    nrow = tl.minimum(end - tp, BLOCK_T)
                    prefetch_l2(krow0 + tp * skt, nrow * KROW)
                    prefetch_l2(vrow0 + tp * svt, nrow * VROW)
                ks_cur, kz_cur, vs_cur, vz_cur = kp_s, kp_z, vp_s, vp_z
                if not GENERIC_K:
                    kp_s, kp_z = _block_params(ks_base, kz_base, t0 + BLOCK_T, end, skst, KEY_BLOCK, D, KBITS)
                vp_s, vp_z = token_params(vs_base, vz_base, t0 + BLOCK_T, end, svst, GV, BLOCK_T)
                # ---- scores [BLOCK_T, GPK], log2 domain
                if GENERIC_K:
                    # dequantized in float32 as the reference does
                    k1 = _key_half(kptr, tm, t, 0, HD, KBITS, BLOCK_T, ks_base, kz_base, skst, KEY_BLOCK).to(ACC)
                    k2 = _key_half(kptr, tm, t, HD, HD, KBITS, BLOCK_T, ks_base, kz_base, skst, KEY_BLOCK).to(ACC)
                    s = (dot(operand(k1, PREC), qa, INTERP) + dot(operand(k2, PREC), qb, INTERP)) * qk_scale
                else:  # the tile inside one block (the host sizes it): q.k = (q * s_blk) . c + q . z_blk
                    qs = operand(qf * (ks_cur.to(ACC) * kinv)[:, None], PREC)  # [D, GPK]
                    zq = tl.sum(qf * kz_cur.to(ACC)[:, None], 0)  # [GPK]
                    kcodes = mma_operand(unpack_mma(kptr, tm, 0, D, D, KBITS, BLOCK_T), PREC, INTERP)
                    s = (dot(kcodes, qs, INTERP) * 16777216.0 + zq[None, :]) * qk_scale
                s = tl.where(tm[:, None], s, float("-inf"))
                p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, rk < G)
                pr = regroup(p, GPK, GPV, BLOCK_T)  # [BLOCK_T, GPV]
                ar = tl.reshape(regroup(alpha[None, :], GPK, GPV, 1), (GPV,))
                # ---- values
                vptr = vc_ptr + tl.multiple_of(b * svb + h * svh + t * svt, VALIGN)
                acc, corr = token_group_values(acc, corr, pr, ar, vs_cur, vz_cur, vptr, tm, D, VBITS, GPV, GV,
                                               BLOCK_T, PREC, INTERP, ACC)
            out = token_group_output(acc, corr, D, VBITS, GPV, GV, ACC)
            store_partial(m_ptr, l_ptr, acc_ptr, part, G, D, out, mma_channels(0, D, VBITS), rv, m_i, l_i, rk)
        if HAS_FP:
            if split == NSPLIT:  # the full-precision part (the residual window), post-RoPE
                fp_segment(q_row, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, 0, F, b, h, part, m_ptr, l_ptr,
                           acc_ptr, qk_scale, D, G, GPF, BLOCK_F, INTERP)


def unsupported(q: torch.Tensor, packed, bits: int, block: int) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    d = q.shape[-1]
    if bits not in UNPACK_BITS:
        return f"{bits}-bit codes (the kernels unpack {', '.join(map(str, UNPACK_BITS))} bits)"
    groups = packed["v_scale"].shape[-1]
    if groups & (groups - 1) or d % groups:
        return f"{groups} value groups per head of {d} channels (a power of two that divides head_dim)"
    if block % 16 and d < 64:
        return f"key blocks of {block} tokens (not a multiple of 16: the generic key path) need head_dim >= 64"
    return None


def attend_triton(q: torch.Tensor, packed, scale: float, fp, bits: int, block: int, *, block_t: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  programs_per_sm: int | None = None, block_f: int | None = None, max_registers: int | None = None,
                  prefetch: int | None = None, generic_keys: bool = False):
    """Partials of q [B, Hq, D] over KIVI's packed tokens and the full-precision part `fp`. Keyword-only tuning knobs:
    block_t (tokens per tile: at most 32, inside one key block), num_splits (default from programs_per_sm, 16, x SMs),
    num_warps, num_stages, max_registers, block_f (full-precision tile), prefetch (tiles ahead prefetched into L2 on
    sm_90+), generic_keys (the float32 dequantizing key path, for tests)."""
    batch, hq, d = q.shape
    hkv = packed.heads
    group = hq // hkv
    dev = q.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    kc, vc = packed["k_codes"], packed["v_codes"]
    ks, kz = K.same_layout(packed["k_scale"], packed["k_zero"])
    vs, vz = K.same_layout(packed["v_scale"], packed["v_zero"])
    gv = vs.shape[-1]
    gp = pow2(group)
    generic = bool(generic_keys) or block % 16 != 0
    path = "generic" if generic else "tile"
    bt = block_t or DEFAULTS[path][0]
    default_warps = DEFAULTS[path][1]
    if not generic:
        # a tile lies inside one key block (q is scaled once per tile) and holds at most 32 tokens: with 64 tokens on
        # 4+ warps Triton 3.6 lowers the key dot (its B operand, q x the block's scales, is made every tile) to wgmma,
        # and that gives wrong sums or an illegal address on the H100; the same kernel with DISABLE_MMA_V3=1
        # (mma.sync) is right (docs/runtime.md). 32-token tiles never take wgmma and are the fastest.
        bt = min(bt, 32)
        while block % bt:
            bt //= 2
    if q.dtype == torch.float64 and num_warps is None and block_t is None:
        # the float64 dot is a broadcast product: keep its [M, K, N] block small (4 warps; 16-token tiles except on
        # the generic path, where Triton 3.6 fails to compile 2-bit tables at 16 tokens)
        default_warps = 4
        if not generic:
            bt = 16
            while block % bt and bt > 1:
                bt //= 2
    tcap = kc.shape[2]
    if num_splits:
        nsplit = int(num_splits)
    else:
        target = (programs_per_sm or 16) * K.sm_count(dev)
        nsplit = max(1, min(triton.cdiv(target, batch * hkv), triton.cdiv(tcap, 4 * bt)))
    warps = num_warps or default_warps
    if generic and warps > 4:  # Triton 3.6 asserts in OptimizeThreadLocality on the generic path with 8 warps
        warps = 4
    wide = warps >= 4 and bt >= 64  # wgmma wants dots of >= 16 columns; mma.sync pads N itself
    gpk = max(gp, 16) if wide else gp
    gpv = max(gp, 16 // gv) if wide else gp
    has_fp = fp is not None
    splits = nsplit + int(has_fp)
    parts = Partials.empty(batch * hkv, splits, group, d, q.dtype, dev)
    fk, fv, fval, f_strides, sfvb = K.fp_args(fp.k if has_fp else None, fp.v if has_fp else None,
                                              fp.valid if has_fp else None, has_fp, dev)
    opts = {"num_warps": warps}
    if num_warps is None and block_t is None:  # the measured defaults belong to the default tile
        num_stages = DEFAULTS[path][2] if num_stages is None else num_stages
        max_registers = DEFAULTS[path][3] if max_registers is None else max_registers
    if max_registers:
        opts["maxnreg"] = int(max_registers)
    if num_stages is not None:
        opts["num_stages"] = num_stages
    if q.dtype == torch.float64:  # no FMA contraction: the float32 dequantization rounds as the reference's
        opts["enable_fp_fusion"] = False
    kc_strides, vc_strides = kc.stride()[:3], vc.stride()[:3]
    kalign, valign = K.word_alignment(kc, kc_strides), K.word_alignment(vc, vc_strides)
    krow, vrow = 4 * kc.shape[-1], 4 * vc.shape[-1]
    can = (K.sm90_or_newer(dev) and krow % 16 == 0 and vrow % 16 == 0 and kc_strides[2] == kc.shape[-1]
           and vc_strides[2] == vc.shape[-1] and kalign == 4 and valign == 4)
    prefetch_tiles = (PREFETCH[path] if prefetch is None else int(prefetch)) if can else 0
    qk_hi, qk_lo = K.qk_scale_parts(scale)
    with launch_device(q):
        _tile_kernel[(batch * hkv, splits)](
            q, q.stride(0), q.stride(1), packed.lengths,
            kc, *kc_strides, ks, kz, *ks.stride()[:3],
            vc, *vc_strides, vs, vz, *vs.stride()[:3],
            fk, fv, *f_strides, fval, sfvb, fp.slots if has_fp else 0,
            parts.m, parts.l, parts.acc, hkv, qk_hi, qk_lo, nsplit,
            D=d, G=group, GPK=gpk, GPV=gpv, GV=gv, GPF=max(gp, 16), KALIGN=kalign, VALIGN=valign, KBITS=bits,
            KEY_BLOCK=block, GENERIC_K=int(generic), VBITS=bits, HAS_FP=int(has_fp), BLOCK_T=bt,
            BLOCK_F=block_f or 16, INTERP=K.INTERPRET, PREC=PREC.get(q.dtype, 16), PREFETCH=prefetch_tiles,
            KROW=krow, VROW=vrow, **opts,
        )
    return parts
