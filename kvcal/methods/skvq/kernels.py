"""SKVQ's decode kernel: attention of one query per row over codes kept in channel order, one row per (token, KV
head), whose (scale, zero) come from the token's clipped groups (k-means clusters across heads); the torch reference
is SKVQStorage.attend_reference (kvcal/methods/skvq/storage.py).

The split-K skeleton (runtime/kernels.split_k_kernel) with this module's tile functions: grid (B * Hkv, S), program
(row, KV head, split) over all G query heads of the KV head, an online softmax over
BLOCK_T-token tiles; split NSPLIT takes the full-precision part (sinks and the recent window; runtime/kernels
fp_segment). Per tile, the key codes of the head's two halves (packing.unpack_tile, or base-3 bytes) are dequantized
in float32 with each channel's group parameters, gathered in registers from the token's [n_groups] row (the static
channel -> group map is loaded once per program); the keys are stored before RoPE and rotated by angle addition
(q.R(p0 + j)k = (R(-p0) q).(R(j) k), R(j) kept in registers, R(-p0) applied to q once per tile), then two dots.
Values are dequantized the same way and accumulated by one dot. fp8 (e4m3) parameters are decoded from their bits
(the same on the GPU and under the interpreter).
"""

from __future__ import annotations

from collections import namedtuple

import torch

from kvcal.quant.packing import launch_device, pow2
from kvcal.runtime import kernels as K

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # rounded dot operands: fp16 for fp16 and bf16 queries
SLOT_BITS = (0, 2, 3, 4, 8)  # 0: base-3 bytes
# (block_t, num_warps), chosen by measurement at 32K x batch 8 (K2V2 g128, bf16; with ternary values too, against
# (32, 4)): benchmarks/skvq_launch_sweep.py, docs/runtime.md
DEFAULTS = (16, 2)
# The clipped scale's lower bounds, shared with the torch quantizer (storage.clipped_group_params):
SCALE_FLOOR = 1e-5  # [code]: scale = max((M - m) / qmax, 1e-5)
Consts = namedtuple("Consts", "D G GP KBITS VBITS KNG KNGP VNG VNGP FP8 BLOCK_T INTERP PREC ROPE")  # tiles' C
FP8_MIN_SCALE = 2.0**-9  # smallest e4m3 subnormal: a smaller scale would round to 0 (rec #10)

if triton is not None:
    from kvcal.quant.packing import pack_tile, unpack_tile, unpack_trits_tile
    from kvcal.quant.tiles import dot, operand
    from kvcal.quant.uniform_kernels import destinations, rint
    from kvcal.runtime.kernels import rotate_query

    @triton.jit
    def _e4m3(bits):
        """fp8 e4m3 bit patterns (int32) -> float32: subnormals m 2^-9, normals (8 + m) 2^(e - 10)."""
        e = (bits >> 3) & 15
        m = (bits & 7).to(tl.float32)
        value = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
        return tl.where((bits & 128) != 0, -value, value)

    @triton.jit
    def _params(base, t, tm, sst, NG: tl.constexpr, NGP: tl.constexpr, FP8: tl.constexpr):
        """Scale or zero rows [BLOCK_T, NGP] of tokens t (groups past NG: 0), as float32."""
        g = tl.arange(0, NGP)
        mask = tm[:, None] & (g < NG)[None, :]
        if FP8:
            raw = tl.load(base + t[:, None] * sst + g[None, :], mask=mask, other=0).to(tl.int32)
            return _e4m3(raw)
        else:
            return tl.load(base + t[:, None] * sst + g[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _dequantized(rowptr, tm, C0: tl.constexpr, NC: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                     BLOCK_T: tl.constexpr, scale, zero, group):
        """Channels [C0, C0 + NC) of a tile, float32 [BLOCK_T, NC]: code x its group's scale + zero (scale, zero
        [BLOCK_T, NGP] per token; group [NC] the channels' groups)."""
        if BITS == 0:
            codes = unpack_trits_tile(rowptr, tm, C0, NC)
        else:
            codes = unpack_tile(rowptr, tm, C0, NC, D, BITS, BLOCK_T)
        if scale.shape[1] == 1:  # one group over every channel (e.g. g128 on 192 channels): no gather, whose
            # lowering asserts on a 1-wide source in Triton 3.6 (OptimizeThreadLocality, isWarpLocal)
            return codes.to(tl.float32) * scale + zero
        idx = tl.broadcast_to(group[None, :], (BLOCK_T, NC))
        return codes.to(tl.float32) * tl.gather(scale, idx, 1) + tl.gather(zero, idx, 1)

    # ---- write: one program per token, all its KV heads (its groups span them)

    @triton.jit
    def _round_e4m3(v):
        """v float32 (finite, |v| <= 448) rounded to fp8 e4m3, nearest even, as torch's cast: (the value as float32,
        its bits as int32). The exponent comes from the float32 bits (exact, unlike log2), subnormals share
        quantum 2^-9."""
        a = tl.abs(v)
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127
        e = tl.maximum(e, -6)
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3), exact
        r = rint(a / quantum) * quantum  # a power-of-two quotient: exact
        er = ((r.to(tl.int32, bitcast=True) >> 23) & 255) - 127
        normal = r >= 0.015625  # 2^-6
        field = tl.where(normal, er + 7, 0)
        unit = tl.where(normal, ((er - 3 + 127) << 23).to(tl.float32, bitcast=True), 0.001953125)
        mantissa = (r / unit).to(tl.int32) - tl.where(normal, 8, 0)
        bits = tl.where(r == 0.0, 0, (field << 3) | mantissa) | tl.where(v < 0, 128, 0)
        return tl.where(v < 0, -r, r), bits

    @triton.jit
    def _write_kernel(x_ptr, sxm, sxh, gmap_ptr, alpha_ptr, codes_ptr, scb, sch, sct, scale_ptr, zero_ptr, spb, spt,
                      row_ptr, slot_ptr, H,
                      HP: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, LEVELS: tl.constexpr,
                      BITS: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, FP8: tl.constexpr, FLOOR: tl.constexpr,
                      LIMIT: tl.constexpr):
        """Token m (program_id 0) of x [M, H, D] into row rows[m], slot slots[m]: each group's clipped min/max over its
        channels (the static map gmap [H * D]), scale = max(alpha (M - m) / (LEVELS - 1), FLOOR) and zero = alpha m
        rounded to fp16 (or fp8 e4m3, FP8), codes against the rounded parameters, packed per head (BITS 0: base-3
        bytes)."""
        m = tl.program_id(0)
        hh = tl.arange(0, HP)
        dd = tl.arange(0, D)
        hm = (hh < H)[:, None]
        x = tl.load(x_ptr + m * sxm + hh[:, None] * sxh + dd[None, :], mask=hm, other=0.0).to(tl.float32)
        group = tl.load(gmap_ptr + hh[:, None] * D + dd[None, :], mask=hm, other=-1)  # [HP, D]
        g = tl.arange(0, NGP)
        member = group[None, :, :] == g[:, None, None]  # [NGP, HP, D]
        mn = tl.min(tl.min(tl.where(member, x[None, :, :], float("inf")), 2), 1)
        mx = tl.max(tl.max(tl.where(member, x[None, :, :], float("-inf")), 2), 1)
        alpha = tl.load(alpha_ptr + g, mask=g < NG, other=1.0)
        lo = tl.where(g < NG, mn * alpha, 0.0)
        hi = tl.where(g < NG, mx * alpha, 0.0)
        scale = tl.minimum(tl.maximum(tl.math.div_rn(hi - lo, LEVELS - 1.0), FLOOR), LIMIT)
        zero = tl.minimum(tl.maximum(lo, -LIMIT), LIMIT)
        b, t = destinations(m, m >= 0, row_ptr, slot_ptr, 1)
        gm = g < NG
        if FP8:
            scale, scale_bits = _round_e4m3(scale)
            zero, zero_bits = _round_e4m3(zero)
            tl.store(scale_ptr + b * spb + t * spt + g, scale_bits.to(tl.uint8), mask=gm)
            tl.store(zero_ptr + b * spb + t * spt + g, zero_bits.to(tl.uint8), mask=gm)
        else:
            scale = scale.to(tl.float16).to(tl.float32)
            zero = zero.to(tl.float16).to(tl.float32)
            tl.store(scale_ptr + b * spb + t * spt + g, scale.to(tl.float16), mask=gm)
            tl.store(zero_ptr + b * spb + t * spt + g, zero.to(tl.float16), mask=gm)
        # each channel's group's parameters, as masked sums over the membership (tl.gather here failed Triton 3.6's
        # OptimizeThreadLocality pass on the H100)
        sc = tl.sum(tl.where(member, scale[:, None, None], 0.0), 0)
        zr = tl.sum(tl.where(member, zero[:, None, None], 0.0), 0)
        sc = tl.where(hm, sc, 1.0)
        codes = tl.minimum(tl.maximum(rint(tl.math.div_rn(x - zr, sc)), 0.0), LEVELS - 1.0).to(tl.int32)
        row = codes_ptr + b * scb + t * sct + hh[:, None] * sch
        if BITS == 0:  # base 3: byte j holds codes 5j .. 5j + 4 as sum_i code 3^i
            j = tl.arange(0, WP)
            i = dd % 5
            power = tl.where(i == 0, 1, tl.where(i == 1, 3, tl.where(i == 2, 9, tl.where(i == 3, 27, 81))))
            weighted = codes * power[None, :]  # [HP, D]
            into = (dd // 5)[None, None, :] == j[None, :, None]  # [1, WP, D]: channel d lands in byte d // 5
            byte = tl.sum(tl.where(into, weighted[:, None, :], 0), 2)
            tl.store(row + j[None, :], byte.to(tl.uint8), mask=hm & (j < W)[None, :])
        else:
            words = pack_tile(codes, HP, D, BITS, WP)
            w = tl.arange(0, WP)
            tl.store(row + w[None, :], words, mask=hm & (w < W)[None, :])

    # ---- tile functions of runtime/kernels.split_k_kernel. args: (key codes, their (row, head, token) strides, key
    # scales, zeros, their (row, token) strides, the key channel -> group map, the same for values, RoPE cos and sin
    # tables, the first packed token's position, the tables' rows); C: (D, G, GP, KBITS, VBITS, KNG, KNGP, VNG, VNGP,
    # FP8, BLOCK_T, INTERP, PREC, ROPE)

    @triton.jit
    def _prepare(args, C: tl.constexpr, q_row, sqh, b, h, pid, start, end, qk_scale):
        """The query halves, each channel's group, R(j) for the offsets j of a tile (in registers), the rows'
        bases."""
        D: tl.constexpr = C[0]
        G: tl.constexpr = C[1]
        GP: tl.constexpr = C[2]
        BLOCK_T: tl.constexpr = C[10]
        PREC: tl.constexpr = C[12]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        kc_ptr, skb, skh, skt, ks_ptr, kz_ptr, sksb, skst, kmap_ptr, vc_ptr, svb, svh, svt, vs_ptr, vz_ptr, svsb, \
            svst, vmap_ptr, cos_ptr, sin_ptr, pos_offset, TMAX = args
        HD: tl.constexpr = D // 2
        rk = tl.arange(0, GP)
        hh = tl.arange(0, HD)
        dd = tl.arange(0, D)
        q1 = tl.load(q_row + rk[None, :] * sqh + hh[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
        q2 = tl.load(q_row + rk[None, :] * sqh + HD + hh[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
        kg1 = tl.load(kmap_ptr + h * D + hh)  # each channel's group
        kg2 = tl.load(kmap_ptr + h * D + HD + hh)
        vg = tl.load(vmap_ptr + h * D + dd)
        jr = tl.arange(0, BLOCK_T)  # R(j) for the offsets j of a tile, kept in registers
        cj = tl.load(cos_ptr + jr[:, None] * D + hh[None, :], mask=(jr < TMAX)[:, None], other=1.0)
        sj = tl.load(sin_ptr + jr[:, None] * D + hh[None, :], mask=(jr < TMAX)[:, None], other=0.0)
        st = (q1, q2, kg1, kg2, vg, cj, sj, kc_ptr + b * skb + h * skh, vc_ptr + b * svb + h * svh, ks_ptr + b * sksb,
              kz_ptr + b * sksb, vs_ptr + b * svsb, vz_ptr + b * svsb)
        return st, tl.zeros((D, GP), ACC)

    @triton.jit
    def _scores(args, C: tl.constexpr, st, t0, t, tm, end, qk_scale):
        """Keys dequantized in float32 with each channel's group parameters, rotated (angle addition, or the tables
        at each token's position), then two dots."""
        D: tl.constexpr = C[0]
        KBITS: tl.constexpr = C[3]
        KNG: tl.constexpr = C[5]
        KNGP: tl.constexpr = C[6]
        FP8: tl.constexpr = C[9]
        BLOCK_T: tl.constexpr = C[10]
        INTERP: tl.constexpr = C[11]
        PREC: tl.constexpr = C[12]
        ROPE: tl.constexpr = C[13]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        HD: tl.constexpr = D // 2
        skt = args[3]
        skst = args[7]
        cos_ptr = args[18]
        sin_ptr = args[19]
        pos_offset = args[20]
        q1, q2, kg1, kg2, vg, cj, sj, krow0, vrow0, ks_base, kz_base, vs_base, vz_base = st
        hh = tl.arange(0, HD)
        kptr = krow0 + t * skt
        ks = _params(ks_base, t, tm, skst, KNG, KNGP, FP8)
        kz = _params(kz_base, t, tm, skst, KNG, KNGP, FP8)
        k1 = _dequantized(kptr, tm, 0, HD, D, KBITS, BLOCK_T, ks, kz, kg1).to(ACC)
        k2 = _dequantized(kptr, tm, HD, HD, D, KBITS, BLOCK_T, ks, kz, kg2).to(ACC)
        if ROPE == 1:  # angle addition
            ra, rb = rotate_query(q1, q2, cos_ptr, sin_ptr, pos_offset + t0, hh, D)
            ka = k1 * cj - k2 * sj  # R(j) k
            kb = k2 * cj + k1 * sj
        else:  # the tables at each token's position (float32 and float64: as the reference rotates)
            ra = q1
            rb = q2
            pos = (pos_offset + t)[:, None] * D
            ca = tl.load(cos_ptr + pos + hh[None, :], mask=tm[:, None], other=1.0).to(ACC)
            sa = tl.load(sin_ptr + pos + hh[None, :], mask=tm[:, None], other=0.0).to(ACC)
            cb = tl.load(cos_ptr + pos + HD + hh[None, :], mask=tm[:, None], other=1.0).to(ACC)
            sb = tl.load(sin_ptr + pos + HD + hh[None, :], mask=tm[:, None], other=0.0).to(ACC)
            ka = k1 * ca - k2 * sa
            kb = k2 * cb + k1 * sb
        s = dot(operand(ka, PREC), operand(ra, PREC), INTERP) + dot(operand(kb, PREC), operand(rb, PREC), INTERP)
        return s * qk_scale, 0, st

    @triton.jit
    def _values(args, C: tl.constexpr, st, tile, acc, p, alpha, t, tm):
        """Values dequantized the same way, accumulated by one dot."""
        D: tl.constexpr = C[0]
        VBITS: tl.constexpr = C[4]
        VNG: tl.constexpr = C[7]
        VNGP: tl.constexpr = C[8]
        FP8: tl.constexpr = C[9]
        BLOCK_T: tl.constexpr = C[10]
        INTERP: tl.constexpr = C[11]
        PREC: tl.constexpr = C[12]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        svt = args[12]
        svst = args[16]
        vg = st[4]
        vrow0 = st[8]
        vs = _params(st[11], t, tm, svst, VNG, VNGP, FP8)
        vz = _params(st[12], t, tm, svst, VNG, VNGP, FP8)
        v = _dequantized(vrow0 + t * svt, tm, 0, D, D, VBITS, BLOCK_T, vs, vz, vg)
        v = tl.where(tm[:, None], v, 0.0)
        return acc * alpha[None, :] + dot(tl.trans(operand(v.to(ACC), PREC)), operand(p, PREC), INTERP)

    @triton.jit
    def _finish(args, C: tl.constexpr, st, acc, m_i, l_i):
        return acc, tl.arange(0, C[0]), tl.arange(0, C[2]), m_i, l_i


def write_triton(storage, packed, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """SKVQStorage.write_reference's Triton kernel, bit for bit: one program per token."""
    m, h, d = keys.shape
    if not m:
        return
    for side, x in (("k", keys), ("v", values)):
        q = storage.sides[side]
        x = x if x.stride(-1) == 1 else x.contiguous()
        codes, scale, zero = packed[f"{side}_codes"], packed[f"{side}_scale"], packed[f"{side}_zero"]
        fp8 = scale.dtype == torch.float8_e4m3fn
        if fp8:
            scale, zero = scale.view(torch.uint8), zero.view(torch.uint8)
        bits = storage.slot_bits(side)
        words = codes.shape[-1]
        ng = q.layout.num_groups
        with launch_device(x):
            _write_kernel[(m,)](
                x, x.stride(0), x.stride(1), storage.group_maps[side], storage.alphas[side], codes, codes.stride(0),
                codes.stride(1), codes.stride(2), scale, zero, scale.stride(0), scale.stride(1), rows, slots, h,
                HP=pow2(h), D=d, NG=ng, NGP=pow2(ng), LEVELS=q.levels, BITS=bits, W=words, WP=pow2(words),
                FP8=int(fp8), FLOOR=FP8_MIN_SCALE if fp8 else SCALE_FLOOR,
                LIMIT=float(torch.finfo(torch.float8_e4m3fn if fp8 else torch.float16).max), enable_fp_fusion=False,
            )


def unsupported(q: torch.Tensor, storage) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    for side in "kv":
        if storage.slot_bits(side) not in SLOT_BITS:
            return f"{storage.slot_bits(side)}-bit code slots"
    if q.shape[-1] < 32:
        return f"head_dim {q.shape[-1]}"
    return None


def attend_triton(q: torch.Tensor, packed, scale: float, fp, storage, *, block_t: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None, programs_per_sm: int | None = None,
                  block_f: int | None = None, rope_mode: str | None = None):
    """Partials of q [B, Hq, D] over SKVQ's packed tokens and the full-precision part `fp`. Keyword-only tuning knobs:
    block_t, num_splits (default from programs_per_sm, 16, x SMs), num_warps, block_f, rope_mode ('angle': angle
    addition, the default for fp16/bf16; 'table': each token's table row, the default for float32 and float64, whose
    results then follow the reference's rotation to their own rounding)."""
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
    gp = pow2(group)
    bt = block_t or DEFAULTS[0]
    warps = num_warps or DEFAULTS[1]
    if q.dtype == torch.float64 and block_t is None:
        bt = 16  # the float64 dot is a broadcast product: keep its [M, K, N] block small
    kc, vc = packed["k_codes"], packed["v_codes"]
    nsplit = K.split_count(num_splits, programs_per_sm, dev, batch * hkv, kc.shape[2], bt)
    params = {}
    for side in "kv":
        s, z = K.same_layout(packed[f"{side}_scale"], packed[f"{side}_zero"])
        if s.dtype == torch.float8_e4m3fn:  # decoded from their bits in the kernel
            s, z = s.view(torch.uint8), z.view(torch.uint8)
        params[side] = (s, z)
    fp8 = params["k"][0].dtype == torch.uint8
    cos, sin = packed.rope_cos.float().contiguous(), packed.rope_sin.float().contiguous()
    kng, vng = storage.num_groups("k"), storage.num_groups("v")
    if rope_mode is None:
        rope_mode = "table" if q.dtype in (torch.float32, torch.float64) else "angle"
    (ks, kz), (vs, vz) = params["k"], params["v"]
    prec = PREC.get(q.dtype, 16)
    args = (kc, *kc.stride()[:3], ks, kz, ks.stride(0), ks.stride(1), storage.group_maps["k"],
            vc, *vc.stride()[:3], vs, vz, vs.stride(0), vs.stride(1), storage.group_maps["v"],
            cos, sin, packed.pos_offset, cos.shape[0])
    consts = Consts(d, group, gp, storage.slot_bits("k"), storage.slot_bits("v"), kng, pow2(kng), vng, pow2(vng),
                    int(fp8), bt, K.INTERPRET, prec, 1 if rope_mode == "angle" else 2)
    return K.launch_split_k((_prepare, _scores, _values, _finish), q, packed.lengths, scale, fp, nsplit, hkv, args,
                            consts, gpk=gp, block_t=bt, block_f=block_f, prec=prec, opts=K.launch_options(q, warps),
                            softcap=packed.softcap, first=packed.first)
