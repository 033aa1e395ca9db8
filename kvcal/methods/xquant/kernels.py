"""XQuant's decode kernels: attention of one query per row over cached latents (X U_k and X U_v, or X itself),
keys and values rematerialized inside the kernels. The torch reference is XQuantStorage.attend_reference (the
storage's `read`: dequantize, multiply by the factors, add the bias, RoPE at the original positions; kvcal/methods/
xquant/storage.py), with the same signature as `attend_triton` below.

Two launches and one product, the split-K partials of runtime/decode.py:

- the scores pass (the split-K skeleton runtime/kernels.split_k_kernel with `_prepare`, `_scores` and no value
  step), grid (B * Hkv, NSPLIT): program (row, KV head, split) walks its share of the row's tokens in
  tiles of BLOCK_T; per tile it dequantizes the key latent chunk by chunk (C latent channels at a time: per-channel
  parameters for the svd variant, per-token groups for x; latent channel 0 from its fp16 copy with the outlier
  channel), multiplies each chunk by the head's columns of R_k (two tl.dot, one per RoPE half), adds b_k, rotates
  the tile at its positions (pos_offset + slot) and scores it against the G query heads of the group (log2 domain).
  It writes the scores [R, T, G] and the split's running max m and sum l.
- `_values_kernel`, grid (B * Hkv, NSPLIT, width / CV): P = exp2(s - m) of the split times the dequantized value
  latent, accumulated in latent space: acc_lat [R, NSPLIT, G, width]. No value is rematerialized per token.
- one product per (row, KV head): acc = acc_lat R_v[:, head] + l b_v (exact by linearity: sum_t p_t (z_t R_v + b_v)
  = (sum_t p_t z_t) R_v + l b_v), a batched matmul (torch) into the partials' acc; the full-precision part (the
  residual window) goes into the last splits through runtime.kernels.fp_partials_into.

Latent tiles are dequantized in float32 (as the reference) and rounded to the dot's operand type (fp16 for fp16 and
bf16 queries, float32 / float64 otherwise); codes are unpacked by a gather over their words (any 2/3/4/8-bit width
that is a multiple of 32 for 3 bits, 16 for the others), bits 16 reads the raw latents.
"""

from __future__ import annotations

from collections import namedtuple

import torch

from kvcal.quant.packing import launch_device, pow2
from kvcal.quant.rope import apply_rope
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import LOG2E

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # rounded dot operands: fp16 for fp16 and bf16 queries
BITS = (2, 3, 4, 8, 16)
# Not tuned on a GPU yet. 32-token tiles keep every dot's M at 32 (mma.sync: kivi_kernels' note on Triton 3.6's
# wgmma with 64-token tiles); 4 programs per SM for the splits: each scores program is compute-heavy (a 32 x 64 x 64
# dot pair per 64 latent channels and tile), and the value pass's latent partials, splits x G x d_kv floats per (row,
# KV head), stay small (Llama-3.1-8B 32K x 1: 66 splits, 8.7 MB; 16 per SM would make them larger than the cache)
DEFAULTS = {"block_t": 32, "chunk": 64, "value_chunk": 64, "num_warps": 4, "programs_per_sm": 4}
# float64 dots are broadcast products ([M, K, N] in registers, quant/tiles.dot): small blocks
DEFAULTS_FP64 = {**DEFAULTS, "block_t": 16, "chunk": 16, "value_chunk": 16}
Consts = namedtuple("Consts", "D G GP RW C BITS TDIV CDIV OUTLIER HAS_BIAS BLOCK_T INTERP PREC")  # the scores pass's C

if triton is not None:
    from kvcal.quant.tiles import dot, operand
    from kvcal.runtime.kernels import split_bounds

    @triton.jit
    def _dequant(codes_base, s_base, z_base, t, tm, ch, sct, sst, BITS: tl.constexpr, RW: tl.constexpr,
                 TDIV: tl.constexpr, CDIV: tl.constexpr):
        """Latent entries [BLOCK_T, C] float32 of tokens t (valid where tm) and channels ch (runtime offsets) of one
        row: codes_base points at its first code word (raw values for 16 bits), s_base / z_base at its parameters,
        indexed [t // TDIV, ch // CDIV] (per-channel blocks: TDIV = block, CDIV = 1; per-token groups: 1, group)."""
        m2 = tm[:, None]
        row = codes_base + t[:, None] * sct
        if BITS == 16:
            return tl.load(row + ch[None, :], mask=m2, other=0.0).to(tl.float32)
        else:
            if BITS == 3:  # kvcal/quant/packing.py: groups of 32 codes in three word planes (stream order if 1 group)
                NG: tl.constexpr = RW // 32
                g = ch // 32
                p = (ch % 32) * 3
                k = p // 32
                sh = (p % 32).to(tl.uint32)
                if NG >= 2:
                    wlo = k * NG + g
                    whi = (k + 1) * NG + g
                else:
                    wlo = g * 3 + k
                    whi = wlo + 1
                straddle = (p % 32) > 29
                lo = tl.load(row + wlo[None, :], mask=m2, other=0).to(tl.uint32, bitcast=True)
                hi = tl.load(row + whi[None, :], mask=m2 & straddle[None, :], other=0).to(tl.uint32, bitcast=True)
                up = tl.where(straddle, 32 - sh, 0).to(tl.uint32)
                code = ((lo >> sh[None, :]) | (hi << up[None, :])) & 7
            else:
                PER: tl.constexpr = 32 // BITS
                w = tl.load(row + (ch // PER)[None, :], mask=m2, other=0).to(tl.uint32, bitcast=True)
                sh = ((ch % PER) * BITS).to(tl.uint32)
                code = (w >> sh[None, :]) & ((1 << BITS) - 1)
            poff = (t // TDIV)[:, None] * sst + (ch // CDIV)[None, :]
            s = tl.load(s_base + poff, mask=m2, other=0.0).to(tl.float32)
            z = tl.load(z_base + poff, mask=m2, other=0.0).to(tl.float32)
            return code.to(tl.float32) * s + z

    # ---- the scores pass: tile functions of runtime/kernels.split_k_kernel (no value step: FINISH None, only m and
    # l are stored). args: (key latent codes, their row and token strides, its scales, zeros, their row and token
    # strides, the outlier channel's copy, its row stride, R_k, b_k, RoPE cos and sin tables, the first packed token's
    # position, the scores buffer, its row and token strides, the KV heads); C: (D, G, GP, RW, C, BITS, TDIV, CDIV, OUTLIER,
    # HAS_BIAS, BLOCK_T, INTERP, PREC)

    @triton.jit
    def _prepare(args, C: tl.constexpr, q_row, sqh, b, h, pid, start, end, qk_scale):
        """The query halves as dot operands."""
        D: tl.constexpr = C[0]
        G: tl.constexpr = C[1]
        GP: tl.constexpr = C[2]
        PREC: tl.constexpr = C[12]
        HD: tl.constexpr = D // 2
        rg = tl.arange(0, GP)
        hh = tl.arange(0, HD)
        qm = (rg < G)[None, :]
        q1 = operand(tl.load(q_row + rg[None, :] * sqh + hh[:, None], mask=qm, other=0.0), PREC)  # [HD, GP]
        q2 = operand(tl.load(q_row + rg[None, :] * sqh + HD + hh[:, None], mask=qm, other=0.0), PREC)
        return (q1, q2, b, h, pid), 0

    @triton.jit
    def _scores(args, C: tl.constexpr, st, t0, t, tm, end, qk_scale):
        """Per tile: the key latent dequantized chunk by chunk, times the head's columns of R_k (two dots, one per
        RoPE half), plus b_k, rotated at the tokens' positions, scored against the group's heads; written to the
        scores buffer for the value pass."""
        D: tl.constexpr = C[0]
        G: tl.constexpr = C[1]
        GP: tl.constexpr = C[2]
        RW: tl.constexpr = C[3]
        CH: tl.constexpr = C[4]
        BITS: tl.constexpr = C[5]
        TDIV: tl.constexpr = C[6]
        CDIV: tl.constexpr = C[7]
        OUTLIER: tl.constexpr = C[8]
        HAS_BIAS: tl.constexpr = C[9]
        BLOCK_T: tl.constexpr = C[10]
        INTERP: tl.constexpr = C[11]
        PREC: tl.constexpr = C[12]
        ACC: tl.constexpr = tl.float64 if PREC == 64 else tl.float32
        kc_ptr, skcb, skct, ks_ptr, kz_ptr, sksb, skst, ko_ptr, skob, rk_ptr, bk_ptr, cos_ptr, sin_ptr, POS0, s_ptr, \
            ssr, sst, HKV = args
        q1, q2, b, h, pid = st
        HD: tl.constexpr = D // 2
        rg = tl.arange(0, GP)
        hh = tl.arange(0, HD)
        col = h * D + hh  # this head's columns of R_k (row stride HKV * D)
        k1 = tl.zeros((BLOCK_T, HD), ACC)
        k2 = tl.zeros((BLOCK_T, HD), ACC)
        for c0 in range(0, RW, CH):
            ch = c0 + tl.arange(0, CH)
            z = _dequant(kc_ptr + b * skcb, ks_ptr + b * sksb, kz_ptr + b * sksb, t, tm, ch, skct, skst, BITS, RW, TDIV,
                         CDIV)
            if OUTLIER:  # latent channel 0 from its fp16 copy
                o = tl.load(ko_ptr + b * skob + t, mask=tm, other=0.0).to(tl.float32)
                z = tl.where((ch == 0)[None, :], o[:, None], z)
            za = operand(z, PREC)
            roff = ch[:, None] * (HKV * D) + col[None, :]
            k1 += dot(za, operand(tl.load(rk_ptr + roff), PREC), INTERP).to(ACC)
            k2 += dot(za, operand(tl.load(rk_ptr + roff + HD), PREC), INTERP).to(ACC)
        if HAS_BIAS:
            k1 += tl.load(bk_ptr + col).to(ACC)[None, :]
            k2 += tl.load(bk_ptr + col + HD).to(ACC)[None, :]
        # RoPE at the tokens' positions: (k1 c1 - k2 s1, k2 c2 + k1 s2)
        pos = POS0 + t
        toff = pos[:, None] * D + hh[None, :]
        c1 = tl.load(cos_ptr + toff, mask=tm[:, None], other=0.0).to(ACC)
        s1 = tl.load(sin_ptr + toff, mask=tm[:, None], other=0.0).to(ACC)
        c2 = tl.load(cos_ptr + toff + HD, mask=tm[:, None], other=0.0).to(ACC)
        s2 = tl.load(sin_ptr + toff + HD, mask=tm[:, None], other=0.0).to(ACC)
        r1 = k1 * c1 - k2 * s1
        r2 = k2 * c2 + k1 * s2
        s = (dot(operand(r1, PREC), q1, INTERP).to(ACC) + dot(operand(r2, PREC), q2, INTERP).to(ACC)) * qk_scale
        s = tl.where(tm[:, None], s, float("-inf"))
        tl.store(s_ptr + pid * ssr + t[:, None] * sst + rg[None, :], s, mask=tm[:, None] & (rg < G)[None, :])
        return s, 0, st

    @triton.jit
    def _no_values(args, C: tl.constexpr, st, tile, acc, p, alpha, t, tm):
        """The value pass is its own kernel (_values_kernel)."""
        return acc

    @triton.jit
    def _values_kernel(
        len_ptr, vc_ptr, svcb, svct, vs_ptr, vz_ptr, svsb, svst,
        s_ptr, ssr, sst, m_ptr, out_ptr, HKV, NSPLIT, S_TOTAL,
        G: tl.constexpr, GP: tl.constexpr, RW: tl.constexpr, CV: tl.constexpr, BITS: tl.constexpr,
        CDIV: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
    ):
        ACC: tl.constexpr = m_ptr.dtype.element_ty
        pid = tl.program_id(0)
        split = tl.program_id(1)
        chunk = tl.program_id(2)
        b = pid // HKV
        start, end = split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T)
        rg = tl.arange(0, GP)
        m = tl.load(m_ptr + (pid * S_TOTAL + split) * G + rg, mask=rg < G, other=0.0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        ch = chunk * CV + tl.arange(0, CV)
        acc = tl.zeros((GP, CV), ACC)
        vc_base = vc_ptr + b * svcb
        vs_base = vs_ptr + b * svsb
        vz_base = vz_ptr + b * svsb
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < end
            s = tl.load(s_ptr + pid * ssr + t[:, None] * sst + rg[None, :], mask=tm[:, None] & (rg < G)[None, :],
                        other=float("-inf"))
            p = tl.exp2(s - m_use[None, :])  # [BLOCK_T, GP], 0 where masked
            z = _dequant(vc_base, vs_base, vz_base, t, tm, ch, svct, svst, BITS, RW, 1, CDIV)
            acc += dot(tl.trans(operand(p, PREC)), operand(z, PREC), INTERP).to(ACC)
        off = ((pid * NSPLIT + split) * G + rg)[:, None] * RW + ch[None, :]
        tl.store(out_ptr + off, acc, mask=(rg < G)[:, None])


    @triton.jit
    def _latent_kernel(codes_ptr, scb, sct, s_ptr, z_ptr, ssb, sst, ko_ptr, skob, out_ptr, sob, sot, T0, T1,
                       BITS: tl.constexpr, RW: tl.constexpr, TDIV: tl.constexpr, CDIV: tl.constexpr,
                       OUTLIER: tl.constexpr, BLOCK_T: tl.constexpr, C: tl.constexpr):
        """Latent entries of slots [T0, T1) of every row, dequantized once (_dequant) into out [B, T1 - T0, RW] in
        out's dtype; grid (B, token tiles, RW / C)."""
        b = tl.program_id(0)
        t = T0 + tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T1
        ch = tl.program_id(2) * C + tl.arange(0, C)
        z = _dequant(codes_ptr + b * scb, s_ptr + b * ssb, z_ptr + b * ssb, t, tm, ch, sct, sst, BITS, RW, TDIV, CDIV)
        if OUTLIER:  # latent channel 0 from its fp16 copy
            o = tl.load(ko_ptr + b * skob + t, mask=tm, other=0.0).to(tl.float32)
            z = tl.where((ch == 0)[None, :], o[:, None], z)
        tl.store(out_ptr + b * sob + (t - T0)[:, None] * sot + ch[None, :], z.to(out_ptr.dtype.element_ty),
                 mask=tm[:, None])


def _chunk(width: int, want: int) -> int:
    """The largest power of two <= want dividing width."""
    c = want
    while c > 1 and width % c:
        c //= 2
    return c


def unsupported(storage, q: torch.Tensor, packed) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    if storage.r_k is None:
        return "variant x without the layer's weights (bind them first)"
    if storage.bits not in BITS:
        return f"{storage.bits}-bit latents (the kernels read {', '.join(map(str, BITS))} bits)"
    width = storage.width
    if _chunk(width, 16) < 16 or (storage.bits == 3 and width % 32):
        return f"a latent width of {width} (a multiple of {32 if storage.bits == 3 else 16} is needed)"
    if q.shape[1] % packed.heads:
        return f"{q.shape[1]} query heads over {packed.heads} KV heads"
    if storage.r_k.shape[1] != packed.heads * packed.dim:
        return f"R_k with {storage.r_k.shape[1]} columns for {packed.heads} x {packed.dim} key channels"
    for name, t in packed.buffers.items():
        if t.stride(-1) != 1:
            return f"buffer {name} not contiguous in its last axis"
    return None


GEMM_CHUNK_BYTES = 64 << 20  # one chunk's dequantized key latents (the value latents and rebuilt keys: as many)


def latent_chunk(storage, packed, side: str, t0: int, t1: int, dtype) -> torch.Tensor:
    """Dequantized latents Z_k (side "k") or Z_v ("v") of slots [t0, t1) of every row, [B, t1 - t0, width] in dtype
    (one Triton launch: _latent_kernel; slots past a row's length hold whatever the buffer holds, finite)."""
    x = storage.variant == "x"
    width, bits = storage.width, storage.bits
    batch = packed.batch
    dummy, _ = K.placeholders(packed.lengths.device)
    keys = side == "k" and not x
    if bits == 16:
        codes = packed["k_raw" if keys else "v_raw"]
        sc = zc = dummy
        s_strides, tdiv, cdiv = (0, 0), 1, 1
    else:
        codes = packed["k_codes" if keys else "v_codes"]
        sc, zc = (packed["k_scale"], packed["k_zero"]) if keys else (packed["v_scale"], packed["v_zero"])
        s_strides = (sc.stride(0), sc.stride(2))
        tdiv, cdiv = (storage.group_tokens, 1) if keys else (1, storage.group_channels)
    outlier = keys and storage.outlier
    ko = packed["k_outlier"] if outlier else dummy
    out = torch.empty(batch, t1 - t0, width, dtype=dtype, device=codes.device)
    bt, c = (16, _chunk(width, 16)) if K.INTERPRET else (32, _chunk(width, 64))
    with launch_device(out):
        _latent_kernel[(batch, triton.cdiv(t1 - t0, bt), width // c)](
            codes, codes.stride(0), codes.stride(2), sc, zc, *s_strides, ko, ko.stride(0) if outlier else 0, out,
            out.stride(0), out.stride(1), t0, t1, BITS=bits, RW=width, TDIV=tdiv, CDIV=cdiv, OUTLIER=int(outlier),
            BLOCK_T=bt, C=c, num_warps=4)
    return out


def attend_gemm(storage, q: torch.Tensor, packed, scale: float, fp, *, chunk_tokens: int | None = None):
    """attend_triton's partials by dense products (tensor cores through cuBLAS for fp16/bf16 queries): the packed
    slots in chunks of `chunk_tokens` (default: the chunk whose dequantized key latents take GEMM_CHUNK_BYTES), each
    chunk one split. Per chunk the latents are dequantized once for all KV heads (_latent_kernel, fp16 for fp16/bf16
    queries as the fused path's operands, else the query dtype); keys are rebuilt for every KV head at once, K = Z_k
    R_k (+ b_k), rotated at their positions, scored in float32 (float64 for float64 queries) against every query
    head; the softmax partials in the log2 domain with the row lengths masked on the device (no host sync: CUDA
    graphs replay it); values stay in latent space, P Z_v for every query head at once, then R_v per KV head and l
    b_v (exact by linearity). The full-precision part goes into the last splits (runtime.kernels.fp_partials_into)."""
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    operand = torch.float16 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    width, cap = storage.width, packed.capacity
    if chunk_tokens is None:
        chunk_tokens = max(256, GEMM_CHUNK_BYTES // max(1, batch * width * torch.finfo(operand).bits // 8))
    chunk = min(cap, max(1, chunk_tokens))
    nsplit = triton.cdiv(cap, chunk)
    parts = K.Partials.empty(batch * hkv, nsplit + K.fp_splits(fp), group, d, q.dtype, dev)
    r_k = storage.factor("r_k", operand)
    r_v = storage.factor("r_v", acc_dtype).view(width, hkv, d).transpose(0, 1)  # [Hkv, width, D]
    b_k, b_v = storage.factor("b_k", acc_dtype), storage.factor("b_v", acc_dtype)
    qg = q.view(batch, hkv, group, d).to(acc_dtype) * (scale * LOG2E)
    lengths = packed.lengths.to(torch.int64)
    x = storage.variant == "x"
    for split, t0 in enumerate(range(0, cap, chunk)):
        t1 = min(cap, t0 + chunk)
        z_v = latent_chunk(storage, packed, "v", t0, t1, operand)
        z_k = z_v if x else latent_chunk(storage, packed, "k", t0, t1, operand)
        k = (z_k @ r_k).to(acc_dtype)  # [B, n, Hkv D]
        if b_k is not None:
            k = k + b_k
        pos = packed.pos_offset + torch.arange(t0, t1, device=dev)
        k = apply_rope(k.view(batch, t1 - t0, hkv, d).transpose(1, 2), packed.rope_cos[pos][None].to(acc_dtype),
                       packed.rope_sin[pos][None].to(acc_dtype))  # [B, Hkv, n, D]
        s = qg @ k.transpose(-1, -2)  # [B, Hkv, G, n], log2 domain
        valid = torch.arange(t0, t1, device=dev)[None, :] < lengths[:, None]  # [B, n]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m = s.amax(-1)
        p = torch.exp2(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
        lat = (p.reshape(batch, hkv * group, t1 - t0).to(operand) @ z_v).to(acc_dtype)  # [B, Hq, width]
        acc = lat.view(batch, hkv, group, width) @ r_v[None]  # [B, Hkv, G, D]
        l_sum = p.sum(-1)
        if b_v is not None:
            acc = acc + l_sum[..., None] * b_v.view(hkv, 1, d)
        parts.m[:, split] = m.reshape(batch * hkv, group)
        parts.l[:, split] = l_sum.reshape(batch * hkv, group)
        parts.acc[:, split] = acc.reshape(batch * hkv, group, d)
    if fp is not None:
        K.fp_partials_into(q, fp, scale, parts, nsplit)
    return parts


def attend_triton(storage, q: torch.Tensor, packed, scale: float, fp, *, block_t: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None, chunk: int | None = None,
                  value_chunk: int | None = None, programs_per_sm: int | None = None, path: str = "gemm",
                  chunk_tokens: int | None = None):
    """Partials of q [B, Hq, D] (after RoPE) over the storage's packed latents and the full-precision part `fp`.
    path "gemm" (the default): attend_gemm (chunk_tokens its knob); path "fused": the two fused kernels below, whose
    keyword-only tuning knobs are block_t (tokens per tile), num_splits (default: programs_per_sm, 4, x SMs over the
    (row, KV head) pairs), num_warps, chunk (latent channels per key dot) and value_chunk (latent channels per value
    program)."""
    if path == "gemm":
        return attend_gemm(storage, q, packed, scale, fp, chunk_tokens=chunk_tokens)
    if path != "fused":
        raise ValueError(f"path must be gemm or fused, got {path!r}")
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
    prec = PREC.get(q.dtype, 16)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    operand_dtype = {16: torch.float16, 32: torch.float32, 64: torch.float64}[prec]
    width, bits = storage.width, storage.bits
    x = storage.variant == "x"
    defaults = DEFAULTS_FP64 if q.dtype == torch.float64 else DEFAULTS
    bt = block_t or (16 if K.INTERPRET else defaults["block_t"])
    c = _chunk(width, chunk or defaults["chunk"])
    cv = _chunk(width, value_chunk or defaults["value_chunk"])
    gp = max(pow2(group), 16)
    tcap = packed.capacity
    nsplit = K.split_count(num_splits, programs_per_sm, dev, batch * hkv, tcap, bt, defaults["programs_per_sm"])
    dummy, _ = K.placeholders(dev)
    # key latent: per-channel blocks (svd) or per-token groups (x; the same buffers as the values)
    if bits == 16:
        kc = packed["v_raw"] if x else packed["k_raw"]
        ks = kz = vs = vz = dummy
        ks_strides = vs_strides = (0, 0)
        tdiv, cdiv_k, cdiv_v = 1, 1, 1
    else:
        kc = packed["v_codes"] if x else packed["k_codes"]
        ks, kz = (packed["v_scale"], packed["v_zero"]) if x else (packed["k_scale"], packed["k_zero"])
        vs, vz = packed["v_scale"], packed["v_zero"]
        ks_strides, vs_strides = (ks.stride(0), ks.stride(2)), (vs.stride(0), vs.stride(2))
        tdiv = 1 if x else storage.group_tokens
        cdiv_k = storage.group_channels if x else 1
        cdiv_v = storage.group_channels
    vc = packed["v_raw"] if bits == 16 else packed["v_codes"]
    ko = packed["k_outlier"] if storage.outlier else dummy
    r_k = storage.factor("r_k", operand_dtype)
    b_k = storage.factor("b_k", acc_dtype)
    scores = torch.empty(batch * hkv, tcap, group, dtype=acc_dtype, device=dev)
    lat = torch.empty(batch * hkv, nsplit, group, width, dtype=acc_dtype, device=dev)
    opts = K.launch_options(q, num_warps or defaults["num_warps"])
    args = (kc, kc.stride(0), kc.stride(2), ks, kz, *ks_strides, ko, ko.stride(0) if storage.outlier else 0, r_k,
            b_k if b_k is not None else dummy, packed.rope_cos, packed.rope_sin, packed.pos_offset, scores,
            scores.stride(0), scores.stride(1), hkv)
    consts = Consts(d, group, gp, width, c, bits, tdiv, cdiv_k, int(storage.outlier), int(b_k is not None), bt,
                    K.INTERPRET, prec)
    # the full-precision part by the generic kernel into the last splits
    parts = K.launch_split_k((_prepare, _scores, _no_values, None), q, packed.lengths, scale, fp, nsplit, hkv, args,
                             consts, gpk=gp, block_t=bt, prec=prec, opts=opts, fp_in_kernel=False)
    with launch_device(q):
        _values_kernel[(batch * hkv, nsplit, width // cv)](
            packed.lengths, vc, vc.stride(0), vc.stride(2), vs, vz, *vs_strides,
            scores, scores.stride(0), scores.stride(1), parts.m, lat, hkv, nsplit, parts.splits,
            G=group, GP=gp, RW=width, CV=cv, BITS=bits, CDIV=cdiv_v, BLOCK_T=bt, INTERP=K.INTERPRET, PREC=prec,
            **opts,
        )
    # one product with R_v per (row, KV head): [B, Hkv, S G, width] x [Hkv, width, D], plus l b_v
    r_v = storage.factor("r_v", acc_dtype).view(width, hkv, d).transpose(0, 1)
    out = torch.matmul(lat.view(batch, hkv, nsplit * group, width), r_v).view(batch * hkv, nsplit, group, d)
    b_v = storage.factor("b_v", acc_dtype)
    if b_v is not None:
        out = out + parts.l[:, :nsplit, :, None] * b_v.view(1, hkv, 1, 1, d).expand(
            batch, hkv, 1, 1, d).reshape(batch * hkv, 1, 1, d)
    parts.acc[:, :nsplit] = out
    return parts
