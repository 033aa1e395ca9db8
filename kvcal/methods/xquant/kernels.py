"""XQuant's decode attention: one query per row over cached latents (X U_k and X U_v, or X itself), keys and
values rematerialized at attention time. The torch reference is XQuantStorage.attend_reference (the storage's `read`:
dequantize, multiply by the factors, add the bias, RoPE at the original positions; kvcal/methods/xquant/storage.py),
with the same signature as `attend_triton` below.

attend_triton: the packed slots in chunks (each chunk one split of runtime/decode.py's partials), per chunk

- `_latent_kernel` dequantizes the key and the value latents once for every KV head, [B, n, width] in the operand
  type (fp16 for fp16 and bf16 queries, else the query dtype; per-channel parameters for the svd variant's keys,
  per-token groups otherwise, latent channel 0 from its fp16 copy with the outlier channel; codes unpacked by a gather
  over their words, bits 16 reads the raw latents);
- one dense product K = Z_k R_k for every KV head at once (tensor cores through cuBLAS for fp16 operands);
- `_rope_scores_kernel` reads each key tile once, adds b_k, rotates it at its positions and scores it against the
  group's query heads (float32, float64 for float64 queries; log2 domain);
- the softmax partials in torch with each row's length masked on the device (no host sync: a CUDA graph replays it);
- values in latent space for every query head at once, P Z_v (a dense product), then R_v per KV head and l b_v (exact
  by linearity: sum_t p_t (z_t R_v + b_v) = (sum_t p_t z_t) R_v + l b_v).

The full-precision part (the residual window) goes into the last splits (runtime.kernels.fp_partials_into). An
earlier design fused everything into split-K programs per (row, KV head): each program rebuilt its head's keys from
the whole latent tile by tile, so R_k's head slice was re-read for every tile and each latent was dequantized once
per KV head; it was an order of magnitude slower (docs/xquant.md).
"""

from __future__ import annotations

import torch

from kvcal.quant.packing import launch_device, pow2
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import LOG2E

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BITS = (2, 3, 4, 8, 16)
if triton is not None:
    from kvcal.quant.tiles import dot

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


    @triton.jit
    def _rope_scores_kernel(k_ptr, skb, skt, bias_ptr, cos_ptr, sin_ptr, POS0, q_ptr, s_ptr, N, HKV,
                            D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_T: tl.constexpr, INTERP: tl.constexpr):
        """Scores of one (row, KV head) over a tile of rebuilt keys: K [B, N, Hkv D] (Z_k R_k, the dot's operand
        type) plus b_k, rotated at positions POS0 + t, against the group's queries q [B Hkv, G, D] (scaled, log2
        domain, float32 or float64) -> s [B Hkv, G, N]; grid (B Hkv, token tiles). Keys are read once."""
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        ACC: tl.constexpr = q_ptr.dtype.element_ty
        HD: tl.constexpr = D // 2
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < N
        hh = tl.arange(0, HD)
        rg = tl.arange(0, GP)
        base = k_ptr + b * skb + t[:, None] * skt + h * D + hh[None, :]
        k1 = tl.load(base, mask=tm[:, None], other=0.0).to(ACC)
        k2 = tl.load(base + HD, mask=tm[:, None], other=0.0).to(ACC)
        if HAS_BIAS:
            k1 += tl.load(bias_ptr + h * D + hh).to(ACC)[None, :]
            k2 += tl.load(bias_ptr + h * D + HD + hh).to(ACC)[None, :]
        toff = (POS0 + t)[:, None] * D + hh[None, :]
        c1 = tl.load(cos_ptr + toff, mask=tm[:, None], other=0.0).to(ACC)
        s1 = tl.load(sin_ptr + toff, mask=tm[:, None], other=0.0).to(ACC)
        c2 = tl.load(cos_ptr + toff + HD, mask=tm[:, None], other=0.0).to(ACC)
        s2 = tl.load(sin_ptr + toff + HD, mask=tm[:, None], other=0.0).to(ACC)
        r1 = k1 * c1 - k2 * s1
        r2 = k2 * c2 + k1 * s2
        qm = (rg < G)[None, :]
        q1 = tl.load(q_ptr + pid * G * D + rg[None, :] * D + hh[:, None], mask=qm, other=0.0)  # [HD, GP]
        q2 = tl.load(q_ptr + pid * G * D + rg[None, :] * D + HD + hh[:, None], mask=qm, other=0.0)
        s = dot(r1, q1, INTERP).to(ACC) + dot(r2, q2, INTERP).to(ACC)  # [BLOCK_T, GP]
        tl.store(s_ptr + pid * G * N + rg[None, :] * N + t[:, None], s, mask=tm[:, None] & qm)


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


GEMM_CHUNK_BYTES = 512 << 20  # one chunk's dequantized key latents (the value latents and rebuilt keys: as many);
# larger chunks launch fewer products (docs/xquant.md compares chunk sizes)


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


def attend_triton(storage, q: torch.Tensor, packed, scale: float, fp, *, chunk_tokens: int | None = None):
    """Partials of q [B, Hq, D] (after RoPE) over the storage's packed latents and the full-precision part `fp`, by
    dense products (tensor cores through cuBLAS for fp16/bf16 queries): the packed slots in chunks of `chunk_tokens`
    (default: the chunk whose dequantized key latents take GEMM_CHUNK_BYTES), each chunk one split. Per chunk the
    latents are dequantized once for all KV heads (_latent_kernel: fp16 for fp16/bf16 queries, else the query dtype);
    keys are rebuilt for every KV head at once, K = Z_k R_k, then _rope_scores_kernel reads each key tile once, adds
    b_k, rotates it and scores it against every query head of its group (float32, float64 for float64 queries); the
    softmax partials in the log2 domain with the row lengths masked on the device (no host sync: CUDA graphs replay
    it); values stay in latent space, P Z_v for every query head at once, then R_v per KV head and l b_v (exact by
    linearity). The full-precision part goes into the last splits (runtime.kernels.fp_partials_into)."""
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
    qg = (q.view(batch, hkv, group, d).to(acc_dtype) * (scale * LOG2E)).contiguous()
    lengths = packed.lengths.to(torch.int64)
    cos, sin = (t.to(acc_dtype).contiguous() for t in (packed.rope_cos, packed.rope_sin))
    dummy, _ = K.placeholders(dev)
    bt = 16 if K.INTERPRET or acc_dtype == torch.float64 else 32
    gp = max(pow2(group), 16)
    x = storage.variant == "x"
    for split, t0 in enumerate(range(0, cap, chunk)):
        t1 = min(cap, t0 + chunk)
        z_v = latent_chunk(storage, packed, "v", t0, t1, operand)
        z_k = z_v if x else latent_chunk(storage, packed, "k", t0, t1, operand)
        k = z_k @ r_k  # [B, n, Hkv D], the keys before bias and RoPE, in the operand type
        n = t1 - t0
        s = torch.empty(batch * hkv, group, n, dtype=acc_dtype, device=dev)
        with launch_device(k):
            _rope_scores_kernel[(batch * hkv, triton.cdiv(n, bt))](
                k, k.stride(0), k.stride(1), b_k if b_k is not None else dummy, cos, sin, packed.pos_offset + t0,
                qg, s, n, hkv, D=d, G=group, GP=gp, HAS_BIAS=int(b_k is not None), BLOCK_T=bt,
                INTERP=K.INTERPRET, num_warps=4)
        s = s.view(batch, hkv, group, n)  # log2 domain
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

