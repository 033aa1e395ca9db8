"""The sparse outliers of a dense-and-sparse cache (KVQuant) as two light passes around the decode kernel, for
fp16 and bf16 queries (float32 and float64 add the residuals inside the decode kernel, as the reference does and
without this module's atomics).

A KVQuant cache stores nuq codes plus fp16 residuals at a few channels per token (1% by default): key slots per
(token, KV head), value slots per token over all heads or per (token, head). Each decode step adds two sums:

1. `key_outlier_scores`, before the decode kernel: a key residual r at channel d of token t adds
   r (R(p_t)^T q)[d] to each query head's score (two query entries times cos/sin at the token's position, not a
   pass over every channel). One float32 per (token, query head), in the buffer the decode kernel then reads
   and adds to its scores.
2. The decode kernel writes each tile's scores (log2 domain, softmax scale applied) over those corrections.
3. `value_outlier_sums`, after it: a value residual r at channel d of token t adds p_t r to channel d of the
   output, with p_t = 2^(s_t - m) and m the final max of the token's split (the decode kernel's partial): relaxed
   vector atomics into a [row and KV head, split, channel, head of the group] buffer, which the reduction adds to
   each split's partial sum before merging them. Their order, and so a float32 sum's last bits, changes from run to
   run; under torch.use_deterministic_algorithms(True) the sums are int64 fixed point instead (integer additions:
   the same bits in any order; about 2x the float pass's time).

Inside the decode kernel's loop the same sums cost more than its dense part: each slot was a gather and a
layout change, and one-warp programs waited on loads that depended on other loads: nuq4 at 32K x 8 on an H100 took
753.9 us in the kernel, 444.4 with the passes (benchmarks/NOTES-kernels.md, "nuq: sparse outliers as passes around
the kernel"). Here they are kernels of their own, each reading its slots once. Each has a torch reference with the
same signature; tests compare them.
"""

from __future__ import annotations

import torch

from kvcal.runtime.packing import _pow2
from kvcal.runtime.splits import split_share

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch references still work
    triton = None
else:
    from kvcal.runtime.splits import split_share_tl


# ---- torch references -------------------------------------------------------------------------------------------

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


# Fixed-point value sums (an int64 out; torch's deterministic mode): terms rounded to multiples of 2^-FIXED_BITS, far
# below float32's rounding of sums of order 1 (GPU check at Llama-3.1-8B shapes: 2.5e-8 to 6.5e-8 from the float64
# reference, the float32 atomics 1.9e-8 to 7.6e-8). A term is below 2^16 (p <= 1, |r| <= 65504, fp16), so sums of up
# to 2^19 tokens cannot overflow 2^63; longer rows get fewer fraction bits (fixed_point_bits). Four scalar int64
# atomics per slot instead of one 16-byte float32 vector: the pass took 130.8 us against 62.7 at 32K x 8 (H100,
# results/bench/value-pass-fixed-h100-s28.json).
FIXED_BITS = 28


def fixed_point_bits(max_tokens: int) -> int:
    """Fraction bits of the fixed-point value sums for splits of up to max_tokens tokens: FIXED_BITS, fewer where
    max_tokens terms below 2^16 each could reach 2^63."""
    return min(FIXED_BITS, 47 - max(0, int(max_tokens) - 1).bit_length())

# Tokens and warps per program, H100, nuq4 at 32K x 8 (results/bench/outlier-pass-configs-h100.json): the key pass
# took 52.9 us at (32, 1) against 92.5 at (64, 4), 55.4 at (64, 2) and 84.0 at (16, 1) (reading cos/sin table rows
# instead of computing the angles: 87.9 at (32, 1)); the value pass 62.6-64.9 us at every setting but (32, 2).
KEY_PASS_TOKENS, KEY_PASS_WARPS = 32, 1
VALUE_PASS_TOKENS, VALUE_PASS_WARPS = 32, 4


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
        D=d, G=hq // hkv, GP=out.shape[2], CAP=cap, CAPP=_pow2(cap), ROPE=rope, BLOCK_T=KEY_PASS_TOKENS,
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
        D=out.shape[2], G=m_part.shape[2], GP=scores.shape[2], CAP=cap, NS=slots, NSP=_pow2(slots), TILE=block_t,
        BLOCK_T=VALUE_PASS_TOKENS, FIXED_SCALE=float(2**fixed_bits) if out.dtype == torch.int64 else 0.0,
        num_warps=VALUE_PASS_WARPS)
    return out
