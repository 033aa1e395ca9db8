"""Triton kernels of the packed uniform quantizers in kvcal/quant/uniform.py, bit for bit.

Decode side: the per-token format's parts of a tile decode kernel (`token_params`, `token_group_query` /
`token_group_scores` for keys, `token_group_values` / `token_group_output` for values), with the scales and zeros
folded around tensor-core dots (post-scaling), never dequantizing element by element:
  keys, group g:   q.k = s_g (q_g . c_g) + z_g sum(q_g)
  values, group g: sum_t p_t v_t = (p * s_g) . c_g + (p . z_g)
Codes enter the dot as exact fp16 values made without int-to-float conversions (packing.unpack_mma: a code's field,
masked in place, is the fp16 subnormal c * f * 2^-24 with f a power of two per column); 2^24 goes into the scales,
1/f into q's columns for keys and the output rows for values.

Quantizers, same arithmetic as the references: parameters rounded to fp16 before the codes are computed, IEEE division
(tl.math.div_rn, not Triton's approximate '/'), round half to even, no FMA contraction (launched with
enable_fp_fusion=False). `quantize_per_token_into_triton` writes token n of x [N, H, D] straight into row rows[n],
slot slots[n] of a cache's buffers (codes [B, H, T, W], scale/zero [B, H, T, G]); rows/slots are device tensors, so a
decode step appends its token with one kernel and no host-side index.
"""

from __future__ import annotations

import torch

from kvcal.quant.packing import launch_device, pow2, words_per_vector

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# The constants C of the per-token-group tile functions below (RTN and KIVI add their own after these)
TOKEN_GROUP_CONSTS = ("D", "G", "GPK", "GPV", "GV", "KALIGN", "VALIGN", "KBITS", "VBITS", "BLOCK_T", "INTERP", "PREC",
                      "PREFETCH", "KROW", "VROW")

if triton is not None:
    from kvcal.quant.packing import mma_channels, mma_code_scale, pack_tile, unpack_mma
    from kvcal.quant.tiles import dot, mma_operand, operand, regroup

if triton is not None:

    @triton.jit
    def rint(y):
        """Round half to even (torch.round) without libdevice, so the interpreter runs it too."""
        f = tl.floor(y)
        diff = y - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        up = (diff > 0.5) | ((diff == 0.5) & odd)
        return tl.where(up, f + 1.0, f)

    @triton.jit
    def affine_params(mn, mx, LEVELS: tl.constexpr):
        """(zero, scale) of a min-max range as minmax_params rounds them: fp16 values, returned as float32."""
        zero = mn.to(tl.float16).to(tl.float32)
        scale = tl.math.div_rn(mx - mn, LEVELS - 1.0).to(tl.float16).to(tl.float32)
        return zero, scale

    @triton.jit
    def affine_codes(x, zero, scale, LEVELS: tl.constexpr):
        safe = tl.where(scale == 0.0, 1.0, scale)
        y = tl.math.div_rn(x - zero, safe)
        return tl.minimum(tl.maximum(rint(y), 0.0), LEVELS - 1.0).to(tl.int32)

    @triton.jit
    def destinations(n, nm, row_ptr, slot_ptr, DEST: tl.constexpr):
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
    def _per_token_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, row_ptr, slot_ptr, N, sxn, sxh,
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
        zero, scale = affine_params(tl.min(x3, 2), tl.max(x3, 2), LEVELS)
        codes = tl.reshape(affine_codes(x3, zero[:, :, None], scale[:, :, None], LEVELS), (R, D))
        words = pack_tile(codes, R, D, BITS, WP)
        w = tl.arange(0, WP)
        b, t = destinations(n, nm, row_ptr, slot_ptr, DEST)
        tl.store(codes_ptr + (b * scb + t * sct + h * sch)[:, None] + w[None, :], words,
                 mask=nm[:, None] & (w < W)[None, :])
        gi = tl.arange(0, GROUPS)
        at = (b * spb + t * spt + h * sph)[:, None] + gi[None, :]
        tl.store(scale_ptr + at, scale.to(tl.float16), mask=nm[:, None])
        tl.store(zero_ptr + at, zero.to(tl.float16), mask=nm[:, None])

    @triton.jit
    def _per_channel_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, N, H, sxn, sxh,
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
        zero, scale = affine_params(mn, mx, LEVELS)
        tl.store(scale_ptr + (j * H + h) * D + d, scale.to(tl.float16))
        tl.store(zero_ptr + (j * H + h) * D + d, zero.to(tl.float16))
        w = tl.arange(0, WP)
        for n0 in range(0, N, R):
            n = n0 + tl.arange(0, R)
            nm = n < N
            x = tl.load(x_ptr + n[:, None] * sxn + h * sxh + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
            codes = affine_codes(x, zero[None, :], scale[None, :], LEVELS)
            words = pack_tile(codes, R, D, BITS, WP)
            row = (j * N + n) * H + h
            tl.store(codes_ptr + row[:, None] * W + w[None, :], words, mask=nm[:, None] & (w < W)[None, :])


    # ---- decode side: per-token groups of channels (scale and zero per token, head and group)

    @triton.jit
    def token_params(s_base, z_base, t0, end, sst, GROUPS: tl.constexpr, BLOCK_T: tl.constexpr):
        """Scale and zero [BLOCK_T, GROUPS] of tokens t0 .. t0 + BLOCK_T - 1 (those < end), as stored (fp16). Kernels
        load them one tile ahead: they are not pipelined by Triton, and waiting for them each tile made the loop
        latency-bound."""
        t = t0 + tl.arange(0, BLOCK_T)
        off = t[:, None] * sst + tl.arange(0, GROUPS)[None, :]
        m = (t < end)[:, None]
        return tl.load(s_base + off, mask=m, other=0.0), tl.load(z_base + off, mask=m, other=0.0)

    @triton.jit
    def token_group_query(q_row, sqh, G: tl.constexpr, GPK: tl.constexpr, GK: tl.constexpr, D: tl.constexpr,
                          KBITS: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
        """The query of a GQA group as the B operand of the key dot: columns (head, key group), each holding q on its
        group's channels only, in mma_channels' row order and divided by the code columns' f; and the per-column
        sums of q (the zero term)."""
        GS: tl.constexpr = D // GK
        MQ: tl.constexpr = GPK * GK
        kch = mma_channels(0, D, KBITS)  # channel of each code column
        rq = tl.arange(0, MQ)
        qg = operand(tl.load(q_row + (rq // GK)[None, :] * sqh + kch[:, None],
                             mask=((rq // GK) < G)[None, :] & ((kch // GS)[:, None] == (rq % GK)[None, :]),
                             other=0.0), PREC)  # [D, MQ]
        sq = tl.reshape(tl.sum(qg.to(ACC), 0), (GPK, GK))
        # code columns hold code * f (unpack_mma): q / f, exact (a power of two; an entry below
        # fp16's normal range keeps an absolute error under 2^-25 * f <= 2^-18)
        qg = operand(qg.to(ACC) / mma_code_scale(D, KBITS).to(ACC)[:, None], PREC)
        return qg, sq

    @triton.jit
    def token_group_scores(kptr, tm, qg, sq, ks, kz, qk_scale, GPK: tl.constexpr, GK: tl.constexpr,
                           D: tl.constexpr, KBITS: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr,
                           INTERP: tl.constexpr, ACC: tl.constexpr):
        """Scores [BLOCK_T, GPK] (log2 domain, not masked) of a key tile whose code rows start at kptr (rows tm
        valid), with its per-token scales / zeros ks, kz [BLOCK_T, GK]."""
        kcodes = mma_operand(unpack_mma(kptr, tm, 0, D, D, KBITS, BLOCK_T), PREC, INTERP)
        raw = tl.reshape(dot(kcodes, qg, INTERP), (BLOCK_T, GPK, GK))
        kscale = ks.to(ACC) * (qk_scale * 16777216.0)  # codes are c * 2^-24
        kzero = kz.to(ACC) * qk_scale
        return tl.sum(kscale[:, None, :] * raw + kzero[:, None, :] * sq[None, :, :], 2)

    @triton.jit
    def token_group_values(acc, corr, pr, ar, vs, vz, vptr, tm, D: tl.constexpr, VBITS: tl.constexpr,
                           GPV: tl.constexpr, GV: tl.constexpr, BLOCK_T: tl.constexpr, PREC: tl.constexpr,
                           INTERP: tl.constexpr, ACC: tl.constexpr):
        """acc^T [D, MV] += codes^T [D, BLOCK_T] x (p * scale) [BLOCK_T, MV] and the zero term corr [MV] += p . zero,
        after rescaling both by the tile's alpha ar [GPV] (MV = GPV x GV columns: head, value group)."""
        MV: tl.constexpr = GPV * GV
        vscale = vs.to(ACC)  # [T, GV]
        vzero = vz.to(ACC)
        pw = operand(tl.reshape(pr[:, :, None] * vscale[:, None, :], (BLOCK_T, MV)), PREC)
        pz = tl.reshape(tl.sum(pr[:, :, None] * vzero[:, None, :], 0), (MV,))
        arow = tl.reshape(tl.broadcast_to(ar[:, None], (GPV, GV)), (MV,))
        vcodes = mma_operand(unpack_mma(vptr, tm, 0, D, D, VBITS, BLOCK_T), PREC, INTERP)
        return acc * arow[None, :] + dot(tl.trans(vcodes), pw, INTERP), corr * arow + pz

    @triton.jit
    def token_group_output(acc, corr, D: tl.constexpr, VBITS: tl.constexpr, GPV: tl.constexpr, GV: tl.constexpr,
                           ACC: tl.constexpr):
        """The weighted value sum [D, GPV] (rows in mma_channels(0, D, VBITS) order) from
        token_group_values' acc and corr: codes were c * f * 2^-24."""
        vch = mma_channels(0, D, VBITS)
        out = acc * (16777216.0 / mma_code_scale(D, VBITS).to(ACC))[:, None] + corr[None, :]
        if GV > 1:  # columns (head, value group) -> heads: each channel from its group's column
            gv = tl.arange(0, GV)
            sel = (vch // (D // GV))[:, None, None] == gv[None, None, :]
            out = tl.sum(tl.where(sel, tl.reshape(out, (D, GPV, GV)), 0.0), 2)
        return out


    # ---- tile functions of runtime/kernels.split_k_kernel for per-token value groups (RTN, KIVI). Their args
    # start with (key codes, (row, head, token) strides, key scales, zeros, strides, value codes, strides, value
    # scales, zeros, strides); C with TOKEN_GROUP_CONSTS; the state st with (key operands, next key scale, zero, next value scale, zero, key rows,
    # value rows, key scale, zero, value scale, zero bases, the value rows' offset)

    @triton.jit
    def token_group_state(args, C: tl.constexpr, qk, kp_s, kp_z, b, h, start, end):
        """The state st of a (row, KV head) from its key operands qk and first key parameters, and the accumulator
        (acc [D, GPV GV], corr [GPV GV])."""
        D: tl.constexpr = C[0]
        MV: tl.constexpr = C[3] * C[4]
        ACC: tl.constexpr = tl.float64 if C[11] == 64 else tl.float32
        kc_ptr, skb, skh, skt, ks_ptr, kz_ptr, sksb, sksh, skst, vc_ptr, svb, svh, svt, vs_ptr, vz_ptr, svsb, svsh, \
            svst = args
        vs_base = vs_ptr + b * svsb + h * svsh
        vz_base = vz_ptr + b * svsb + h * svsh
        vp_s, vp_z = token_params(vs_base, vz_base, start, end, svst, C[4], C[9])
        st = (qk, kp_s, kp_z, vp_s, vp_z, kc_ptr + b * skb + h * skh, vc_ptr + b * svb + h * svh,
              ks_ptr + b * sksb + h * sksh, kz_ptr + b * sksb + h * sksh, vs_base, vz_base, b * svb + h * svh)
        return st, (tl.zeros((D, MV), ACC), tl.zeros((MV,), ACC))

    @triton.jit
    def token_group_tile_values(args, C: tl.constexpr, st, tile, acc, p, alpha, t, tm):
        """token_group_values over a tile (tile: its value scales and zeros, loaded a tile ahead)."""
        GPK: tl.constexpr = C[2]
        GPV: tl.constexpr = C[3]
        VALIGN: tl.constexpr = C[6]
        BLOCK_T: tl.constexpr = C[9]
        pr = regroup(p, GPK, GPV, BLOCK_T)  # [BLOCK_T, GPV]
        ar = tl.reshape(regroup(alpha[None, :], GPK, GPV, 1), (GPV,))
        # rows start on VALIGN-word boundaries (the host checked the strides)
        vptr = args[9] + tl.multiple_of(st[11] + t * args[12], VALIGN)
        return token_group_values(acc[0], acc[1], pr, ar, tile[0], tile[1], vptr, tm, C[0], C[8], GPV, C[4], BLOCK_T,
                                  C[11], C[10], tl.float64 if C[11] == 64 else tl.float32)

    @triton.jit
    def token_group_tile_finish(args, C: tl.constexpr, st, acc, m_i, l_i):
        out = token_group_output(acc[0], acc[1], C[0], C[8], C[3], C[4], tl.float64 if C[11] == 64 else tl.float32)
        return out, mma_channels(0, C[0], C[8]), tl.arange(0, C[3]), m_i, l_i


def token_groups_unsupported(d: int, bits: int, groups: int, unpack_bits, what: str = "groups") -> str | None:
    """Why a decode kernel with per-token groups cannot take b-bit codes in `groups` groups of a d-channel head
    (None: it can): the bits must be ones it unpacks, the groups a power of two that divides d."""
    if bits not in unpack_bits:
        return f"{bits}-bit codes (the kernels unpack {', '.join(map(str, unpack_bits))} bits)"
    if groups & (groups - 1) or d % groups:
        return f"{groups} {what} per head of {d} channels (a power of two that divides head_dim)"
    return None


def pow2_sizes(*sizes: int) -> bool:
    return all(s >= 1 and s & (s - 1) == 0 for s in sizes)


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fresh_strides(t: torch.Tensor, head_axis: bool = True) -> tuple[int, int, int]:
    """(row, slot, head) strides of a fresh output [N, H, ...] (or [N, ...] without a head axis): one row."""
    return 0, t.stride(0), t.stride(1) if head_axis else 0


def cache_strides(t: torch.Tensor, token_axis: int, head_axis: int | None) -> tuple[int, int, int]:
    """(row, slot, head) strides of a cache buffer whose axis 0 is the row."""
    return t.stride(0), t.stride(token_axis), 0 if head_axis is None else t.stride(head_axis)


def destination_args(rows, slots, dev):
    if rows is None:
        dummy = torch.empty(1, dtype=torch.int32, device=dev)
        return dummy, dummy, 0
    return rows.contiguous(), slots.contiguous(), 1  # the kernels index them densely (an expanded row has stride 0)


def _per_token_launch(x, bits, group, codes, cs, scale, zero, ps, rows=None, slots=None) -> None:
    n, h, d = x.shape
    w = words_per_vector(d, bits)
    block = 4  # tokens per program
    row_arg, slot_arg, dest = destination_args(rows, slots, x.device)
    with launch_device(x):
        _per_token_kernel[(triton.cdiv(n, block), h)](
            x, codes, scale, zero, row_arg, slot_arg, n, x.stride(0), x.stride(1), *cs, *ps,
            d, d // group, bits, w, pow2(w), block, dest, enable_fp_fusion=False)


def per_token_unsupported(x: torch.Tensor, bits: int, group: int) -> str | None:
    """Why quantize_per_token_*_triton cannot take x [N, H, D] (None: it can)."""
    d = x.shape[-1]
    if triton is None:
        return "triton is not installed"
    if not (pow2_sizes(d, d // group) and not d % group and d >= 32 and bits <= 8):
        return f"head_dim {d} in groups of {group} at {bits} bits (powers of two, head_dim >= 32, bits <= 8)"
    return None


def per_channel_unsupported(x: torch.Tensor, bits: int, block: int) -> str | None:
    d = x.shape[-1]
    if triton is None:
        return "triton is not installed"
    if not (pow2_sizes(d) and d >= 32 and bits <= 8) or x.shape[0] % block:
        return f"head_dim {d} at {bits} bits over {x.shape[0]} tokens in blocks of {block}"
    return None


def _check(reason: str | None) -> None:
    if reason:
        raise ValueError(f"no Triton quantize kernel: {reason}")


def quantize_per_token_triton(x: torch.Tensor, bits: int, group: int):
    """uniform.quantize_per_token (same arguments and results)."""
    _check(per_token_unsupported(x, bits, group))
    n, h, d = x.shape
    x = rows_contiguous(x)
    codes = torch.empty(n, h, words_per_vector(d, bits), dtype=torch.int32, device=x.device)
    scale = torch.empty(n, h, d // group, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if n:
        _per_token_launch(x, bits, group, codes, fresh_strides(codes), scale, zero, fresh_strides(scale))
    return codes, scale, zero


def quantize_per_token_into_triton(x, bits: int, group: int, codes, scale, zero, rows, slots) -> None:
    """uniform.quantize_per_token_into: token n into row rows[n], slot slots[n] of codes [B, H, T, W] and scale / zero
    [B, H, T, G]."""
    _check(per_token_unsupported(x, bits, group))
    if x.shape[0]:
        _per_token_launch(rows_contiguous(x), bits, group, codes, cache_strides(codes, 2, 1), scale, zero,
                          cache_strides(scale, 2, 1), rows, slots)


def quantize_per_channel_triton(x: torch.Tensor, bits: int, block: int):
    """uniform.quantize_per_channel (same arguments and results)."""
    _check(per_channel_unsupported(x, bits, block))
    n, h, d = x.shape
    x = rows_contiguous(x)
    w = words_per_vector(d, bits)
    codes = torch.empty(n, h, w, dtype=torch.int32, device=x.device)
    scale = torch.empty(n // block, h, d, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if n:
        with launch_device(x):
            _per_channel_kernel[(h, n // block)](x, codes, scale, zero, block, h, x.stride(0), x.stride(1), d, bits,
                                                 w, pow2(w), 4, enable_fp_fusion=False)
    return codes, scale, zero
