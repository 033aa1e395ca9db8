"""KIVI's decode kernel: attention of one query per row over per-channel key codes (one fp16 scale and zero per
channel and block of `block` tokens) and per-token value codes (groups of channels), the torch reference being
KiviStorage.attend_reference (kvcal/methods/kivi/storage.py).

The split-K skeleton (runtime/kernels.split_k_kernel) with this module's tile functions: grid (B * Hkv, S), one
program per (row, KV head, split) over all G query heads of the KV head; splits s < NSPLIT take
an equal BLOCK_T-aligned share of the row's packed tokens, split NSPLIT the full-precision part (the residual window;
runtime/kernels.fp_segment). Keys: a tile lies inside one key block (the host sizes it), so the block's scale folds
into the query once per tile: q.k = (q * s_blk) . c + q . z_blk, one tensor-core dot. Where the block is not a
multiple of 16 tokens (or `generic_keys`), the keys are dequantized in float32 per tile instead (the generic path).
Values: the per-token format of quant/uniform_kernels (token_group_values).
"""

from __future__ import annotations

from collections import namedtuple

import torch

from kvcal.quant.packing import pow2
from kvcal.quant.uniform_kernels import TOKEN_GROUP_CONSTS, token_groups_unsupported
from kvcal.runtime import kernels as K

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
Consts = namedtuple("Consts", (*TOKEN_GROUP_CONSTS, "KEY_BLOCK", "GENERIC_K"))  # the tile functions' C

if triton is not None:
    from kvcal.quant.packing import mma_channels, mma_code_scale, unpack_mma, unpack_tile
    from kvcal.quant.tiles import dot, mma_operand, operand
    from kvcal.quant.uniform_kernels import (
        token_group_state,
        token_group_tile_finish,
        token_group_tile_values,
        token_params,
    )
    from kvcal.runtime.kernels import prefetch_tiles

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

    # ---- tile functions of runtime/kernels.split_k_kernel, values by quant/uniform_kernels' token_group_tile_values
    # / _finish (args, C and the state in their layout; C ends with KEY_BLOCK, GENERIC_K)

    @triton.jit
    def _prepare(args, C: tl.constexpr, q_row, sqh, b, h, pid, start, end, qk_scale):
        """The query as the key dot's operand: halves on the generic path; in mma_channels order with the first
        tile's block scale and zero on the fast path."""
        D: tl.constexpr = C[0]
        G: tl.constexpr = C[1]
        GPK: tl.constexpr = C[2]
        KBITS: tl.constexpr = C[7]
        PREC: tl.constexpr = C[11]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        HD: tl.constexpr = D // 2
        rk = tl.arange(0, GPK)
        if C[16]:  # GENERIC_K
            hh = tl.arange(0, HD)
            q1 = tl.load(q_row + rk[None, :] * sqh + hh[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
            q2 = tl.load(q_row + rk[None, :] * sqh + HD + hh[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
            qk = (operand(q1, PREC), operand(q2, PREC))
            kp_s = tl.zeros((1,), tl.float16)
            kp_z = kp_s
        else:
            kch = mma_channels(0, D, KBITS)
            qf = tl.load(q_row + rk[None, :] * sqh + kch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
            qk = (qf, 1.0 / mma_code_scale(D, KBITS).to(ACC))  # code columns hold code * f (unpack_mma)
            kp_s, kp_z = _block_params(args[4] + b * args[6] + h * args[7], args[5] + b * args[6] + h * args[7], start,
                                       end, args[8], C[15], D, KBITS)
        return token_group_state(args, C, qk, kp_s, kp_z, b, h, start, end)

    @triton.jit
    def _scores(args, C: tl.constexpr, st, t0, t, tm, end, qk_scale):
        """Scores [BLOCK_T, GPK] of a key tile; the next tile's parameters are loaded here (a tile ahead)."""
        D: tl.constexpr = C[0]
        KALIGN: tl.constexpr = C[5]
        KBITS: tl.constexpr = C[7]
        BLOCK_T: tl.constexpr = C[9]
        INTERP: tl.constexpr = C[10]
        PREC: tl.constexpr = C[11]
        KEY_BLOCK: tl.constexpr = C[15]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        HD: tl.constexpr = D // 2
        skt = args[3]
        skst = args[8]
        qk, ks_cur, kz_cur, vs_cur, vz_cur, krow0, vrow0, ks_base, kz_base, vs_base, vz_base, voff = st
        kptr = krow0 + tl.multiple_of(t * skt, KALIGN)  # rows start on KALIGN-word boundaries (the host checked)
        prefetch_tiles(krow0, vrow0, t0, end, skt, args[12], C[12], BLOCK_T, C[13], C[14], INTERP)
        vp_s, vp_z = token_params(vs_base, vz_base, t0 + BLOCK_T, end, args[17], C[4], BLOCK_T)
        if C[16]:  # GENERIC_K: dequantized in float32 as the reference does
            k1 = _key_half(kptr, tm, t, 0, HD, KBITS, BLOCK_T, ks_base, kz_base, skst, KEY_BLOCK).to(ACC)
            k2 = _key_half(kptr, tm, t, HD, HD, KBITS, BLOCK_T, ks_base, kz_base, skst, KEY_BLOCK).to(ACC)
            s = (dot(operand(k1, PREC), qk[0], INTERP) + dot(operand(k2, PREC), qk[1], INTERP)) * qk_scale
            kp_s = ks_cur
            kp_z = kz_cur
        else:  # the tile inside one block (the host sizes it): q.k = (q * s_blk) . c + q . z_blk
            kp_s, kp_z = _block_params(ks_base, kz_base, t0 + BLOCK_T, end, skst, KEY_BLOCK, D, KBITS)
            qf = qk[0]
            qs = operand(qf * (ks_cur.to(ACC) * qk[1])[:, None], PREC)  # [D, GPK]
            zq = tl.sum(qf * kz_cur.to(ACC)[:, None], 0)  # [GPK]
            kcodes = mma_operand(unpack_mma(kptr, tm, 0, D, D, KBITS, BLOCK_T), PREC, INTERP)
            s = (dot(kcodes, qs, INTERP) * 16777216.0 + zq[None, :]) * qk_scale
        return s, (vs_cur, vz_cur), (qk, kp_s, kp_z, vp_s, vp_z, krow0, vrow0, ks_base, kz_base, vs_base, vz_base, voff)


def unsupported(q: torch.Tensor, packed, bits: int, block: int) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    d = q.shape[-1]
    reason = token_groups_unsupported(d, bits, packed["v_scale"].shape[-1], UNPACK_BITS, "value groups")
    if reason:
        return reason
    if block % 16 and d < 64:
        return f"key blocks of {block} tokens (not a multiple of 16: the generic key path) need head_dim >= 64"
    group = q.shape[1] // packed.heads
    if q.dtype == torch.float64 and not K.INTERPRET and d * pow2(group) > 512:
        # the float64 exactness mode's broadcast products outgrow the shared memory there (head_dim 256 with 4 query
        # heads per KV head on an H200: docs/models.md)
        return f"float64 queries at head_dim {d} with {group} query heads per KV head (shared memory)"
    return None


def attend_triton(q: torch.Tensor, packed, scale: float, fp, bits: int, block: int, *, block_t: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  programs_per_sm: int | None = None, block_f: int | None = None, max_registers: int | None = None,
                  prefetch: int | None = None, generic_keys: bool = False):
    """Partials of q [B, Hq, D] over KIVI's packed tokens and the full-precision part `fp`. Keyword-only tuning knobs:
    block_t (tokens per tile: at most 32, inside one key block), num_splits (default from programs_per_sm, 16, x SMs),
    num_warps, num_stages, max_registers, block_f (full-precision tile), prefetch (tiles ahead prefetched into L2 on
    sm_90+), generic_keys (the float32 dequantizing key path, for tests)."""
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
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
    nsplit = K.split_count(num_splits, programs_per_sm, dev, batch * hkv, kc.shape[2], bt)
    warps = num_warps or default_warps
    if generic and warps > 4:  # Triton 3.6 asserts in OptimizeThreadLocality on the generic path with 8 warps
        warps = 4
    wide = warps >= 4 and bt >= 64  # wgmma wants dots of >= 16 columns; mma.sync pads N itself
    gpk = max(gp, 16) if wide else gp
    gpv = max(gp, 16 // gv) if wide else gp
    if num_warps is None and block_t is None:  # the measured defaults belong to the default tile
        num_stages = DEFAULTS[path][2] if num_stages is None else num_stages
        max_registers = DEFAULTS[path][3] if max_registers is None else max_registers
    kalign, valign, krow, vrow, can = K.code_rows(kc, vc, dev)
    prefetch_tiles = (PREFETCH[path] if prefetch is None else int(prefetch)) if can else 0
    prec = PREC.get(q.dtype, 16)
    args = (kc, *kc.stride()[:3], ks, kz, *ks.stride()[:3], vc, *vc.stride()[:3], vs, vz, *vs.stride()[:3])
    consts = Consts(d, group, gpk, gpv, gv, kalign, valign, bits, bits, bt, K.INTERPRET, prec, prefetch_tiles, krow,
                    vrow, block, int(generic))
    tiles = (_prepare, _scores, token_group_tile_values, token_group_tile_finish)
    return K.launch_split_k(tiles, q, packed.lengths, scale, fp, nsplit, hkv, args, consts, gpk=gpk, block_t=bt,
                            block_f=block_f, prec=prec, opts=K.launch_options(q, warps, num_stages, max_registers),
                            softcap=packed.softcap, first=packed.first)
