"""XQuant's decode attention: one query per row over cached latents (X U_k and X U_v, or X itself), keys and
values rematerialized at attention time. The torch reference is XQuantStorage.attend_reference (the storage's `read`:
dequantize, multiply by the factors, add the bias, RoPE at the original positions; kvcal/methods/xquant/storage.py),
with the same signature as `attend_triton` below: two Triton kernels whose products run on tensor cores (`tl.dot` with fp16
operands and float32 accumulation for fp16/bf16 queries; float32 and float64 queries keep exact products, as the
tests' exactness modes):

1. `_scores_tc_kernel`, grid (Hkv / HB, token tiles, B), the KV-head block fastest so the programs that share a token
   tile run together and find its codes in L2. A program rebuilds the keys of HB KV heads over BLOCK_T tokens:
   for each chunk of CHUNK latent channels it dequantizes Z_k[tile, chunk] once (`_dequant_tile`: each code word
   loaded once and split in registers, the key block's scales and zeros one vector per tile; float32 as the
   reference, then the operand type) and multiplies it by R_k[chunk, HB heads' columns] split into the two RoPE
   halves (two dots of M = BLOCK_T, N = HB x D / 2, K = CHUNK, accumulated in float32 registers; R_k's chunk is
   loaded asynchronously by the software pipeline, `num_stages`). Then b_k, RoPE at positions pos_offset + t in
   registers, and the scores of the HB heads' query heads by one dot against a block-diagonal query operand
   [HB D / 2, HB GP] per half (fp16 queries; the rotated keys as an fp16 pair hi + lo, so the scores keep ~22
   bits). Scores [B, Hq, T] (float32, float64 for float64 queries, log2 domain; soft-capped where the model caps
   its scores, Gemma 2: runtime/kernels.soft_cap) go to global memory (Hq x 4 bytes a token, against the latent's
   256 B at Llama shapes and 2 bits).
   With `staged_latents`, Z_k is first dequantized once into an fp16 [B, T, width] buffer (_latent_kernel) and the
   scores kernel reads it with plain loads instead of dequantizing.
2. `_values_tc_kernel`, grid (B, splits, width / VC): for one row, one split of its tokens and VC latent channels,
   an online softmax over the split's scores of every query head and P[T, Hq]^T Z_v[T, VC] by `tl.dot` (M = Hq padded
   to 16, fp16 P and Z_v for fp16/bf16 queries): Z_v is dequantized once per token for all query heads (one scale
   and zero per token when a per-token group covers the VC channels). Then in torch: acc_lat R_v per KV head and
   l b_v (exact by linearity: sum_t p_t (z_t R_v + b_v) = (sum_t p_t z_t) R_v + l b_v), written in
   runtime/decode.py's partials layout ([B Hkv, S, G, D]); the full-precision window (its scores capped as the
   packed tokens') goes into the last splits (runtime.kernels.fp_partials_into).

Design choice. The defaults were predicted from the kernels compiled for sm_90 on a CPU (the launch's
16-divisibility of pointers and strides, ptxas's resource use and the SASS of the main loop;
benchmarks/xquant_kernel_sass.py), at Llama-3.1-8B shapes and 2 bits:
- Key product. A 64-channel chunk step of a 128-token tile of one KV head is 2.1 MFLOP, 512 clocks of an H100/H200
  SM's tensor cores. One KV head per program (HB = 1, BLOCK_T = 128, 8 warps, the default) compiles to 222
  registers, no spills, and 411 instructions a thread per step (8 wgmma): 822 issue clocks (8 warps over 4
  schedulers), so the loop is issue-bound at ~1.6x the tensor time (~0.8 ms for the 0.55 TFLOP of keys at 32K x 8,
  one program per SM at a time). R_k's chunk is re-read from L2 for every tile: BLOCK_T FLOP per byte, ~4.3 GB a
  step at 32K x 8 with 128-token tiles.
- HB = 2 reuses each dequantized chunk twice. Its accumulators (HB x BLOCK_T x D float32) must stay near 64
  registers a thread: at BLOCK_T = 128 and 8 warps it spills 1.2 KB a thread; at BLOCK_T = 64 (8 warps) it compiles
  to 230 registers, no spills, 302 instructions a step for the same tensor work (604 issue clocks), but each R_k
  chunk then feeds M = 64 rows, twice the L2 traffic (~8.6 GB a step at 32K x 8, above the L2's bandwidth at that
  speed). 16 warps at HB = 1: 122 registers, 285 instructions a step (1140 issue clocks over 16 warps). Hence the
  default HB = 1 at 128-token tiles; the others are in the tuning grid, and the warps default to ~64 accumulator
  registers a thread (min(16, BLOCK_T HB D / 2048), at least 4).
- `staged_latents` removes the per-head dequantization at the cost of writing and reading the fp16 latents once
  (2 KB a token at width 1024: ~1 GB of HBM traffic at 32K x 8, ~0.2 ms): its scores loop compiles to 114
  instructions a step (228 issue clocks, under the 512 of the tensor cores: the only tensor-bound variant).
- Value pass: 64-token tiles of 128 channels at 4 warps compile to 188 registers, no spills, ~11 instructions a
  thread per latent element (~0.1 ms of issue at 32K x 8); 256 channels spill 1 KB a thread at 4 warps and 96 B at 8
  (value_num_warps defaults to 8 from 64 x 256 elements a tile).
- The scores' block-diagonal query operand wastes (HB - 1) / HB of a product that is ~1/(2 width / G) of the key
  product's size (a few percent at HB <= 4).
- The value pass's 64 latent channels a program (not the 128 the compile predicted) come from timing the knobs on the
  GPU (docs/xquant.md). At 3 bits the scores kernel runs two pipeline stages: with three, the pipelined code-word
  loads of its two word planes ask more shared memory than an SM has (benchmarks/xquant_kernel_sass.py).
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
    from kvcal.quant.packing import _split_bits
    from kvcal.quant.tiles import dot, mma_operand, operand
    from kvcal.runtime.kernels import soft_cap, softmax_tile, split_bounds

    @triton.jit
    def _dequant(codes_base, s_base, z_base, t, tm, ch, sct, sst, BITS: tl.constexpr, RW: tl.constexpr,
                 TDIV: tl.constexpr, CDIV: tl.constexpr):
        """Latent entries [BLOCK_T, C] float32 (float64 for float64 raw latents) of tokens t (valid where tm) and
        channels ch (runtime offsets) of one row: codes_base points at its first code word (raw values for 16 bits), s_base / z_base at its parameters,
        indexed [t // TDIV, ch // CDIV] (per-channel blocks: TDIV = block, CDIV = 1; per-token groups: 1, group)."""
        m2 = tm[:, None]
        row = codes_base + t[:, None] * sct
        if BITS == 16:
            raw = tl.load(row + ch[None, :], mask=m2, other=0.0)
            if raw.dtype != tl.float64:  # a static branch (one return: the compiler wants one type); float64 raw
                raw = raw.to(tl.float32)  # latents (XQuant-CL's X^ for float64 queries) stay exact
            return raw
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
    def _dequant_tile(codes_base, s_base, z_base, t, tm, t0, c0, sct, sst, BITS: tl.constexpr, RW: tl.constexpr,
                      TDIV: tl.constexpr, CDIV: tl.constexpr, BLOCK_T: tl.constexpr, C: tl.constexpr):
        """_dequant of channels [c0, c0 + C) of tokens t = t0 + arange(BLOCK_T) (valid where tm), for the tensor-core
        kernels: at 2, 4 and 8 bits each code word is loaded once and split in registers (_split_bits: a tl.join
        tree, no data movement between threads) instead of once per code, and the scales and zeros are loaded as a
        vector where they are constant along one axis of the tile: per row when a per-token group covers the chunk
        (CDIV % C == 0: values, variant x), per column when a per-channel block covers the tile (TDIV % BLOCK_T ==
        0: keys; tiles start at multiples of BLOCK_T). Masked tokens read as zero (codes and parameters), as in
        _dequant, except per column, where they read as the block's zero point (finite: the tile's first token is
        valid, so its block was written; each token's row only reaches its own key, which is not stored). 3 bits
        and raw latents: _dequant."""
        if BITS == 16 or BITS == 3:
            return _dequant(codes_base, s_base, z_base, t, tm, c0 + tl.arange(0, C), sct, sst, BITS, RW, TDIV, CDIV)
        else:
            PER: tl.constexpr = 32 // BITS
            NW: tl.constexpr = C // PER
            w = tl.load(codes_base + t[:, None] * sct + (c0 // PER + tl.arange(0, NW))[None, :], mask=tm[:, None],
                        other=0).to(tl.uint32, bitcast=True)
            code = tl.reshape(_split_bits(w, 32, BITS), (BLOCK_T, C)).to(tl.float32)
            ch = c0 + tl.arange(0, C)
            if CDIV % C == 0 and TDIV == 1:  # one group per token over the chunk
                poff = t * sst + c0 // CDIV
                s = tl.load(s_base + poff, mask=tm, other=0.0).to(tl.float32)
                z = tl.load(z_base + poff, mask=tm, other=0.0).to(tl.float32)
                return code * s[:, None] + z[:, None]
            elif TDIV % BLOCK_T == 0 and CDIV == 1:  # one block of tokens over the tile
                poff = (t0 // TDIV) * sst + ch
                s = tl.load(s_base + poff).to(tl.float32)
                z = tl.load(z_base + poff).to(tl.float32)
                return code * s[None, :] + z[None, :]
            else:
                poff = (t // TDIV)[:, None] * sst + (ch // CDIV)[None, :]
                s = tl.load(s_base + poff, mask=tm[:, None], other=0.0).to(tl.float32)
                z = tl.load(z_base + poff, mask=tm[:, None], other=0.0).to(tl.float32)
                return code * s + z

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
    def _qk(k, q, PREC: tl.constexpr, INTERP: tl.constexpr):
        """Scores k [BLOCK_T, N] (float32 / float64 rotated keys) times q [N, M] (fp16 queries for PREC 16, else
        k's dtype): for PREC 16 k goes in as an fp16 pair hi + lo (two tensor-core dots, ~22 bits of k kept)."""
        if PREC == 16:
            hi = k.to(tl.float16)
            lo = (k - hi.to(tl.float32)).to(tl.float16)
            return dot(hi, q, INTERP) + dot(lo, q, INTERP)
        else:
            return dot(k, q, INTERP).to(k.dtype)

    @triton.jit
    def _scores_tc_kernel(codes_ptr, scb, sct, sc_ptr, zc_ptr, ssb, sst, ko_ptr, skob, zs_ptr, szb, szt,
                          rk_ptr, bias_ptr, cos_ptr, sin_ptr, POS0, len_ptr, q_ptr, sqb, QSCALE, out_ptr, sob, soh,
                          HKV, BITS: tl.constexpr, RW: tl.constexpr, TDIV: tl.constexpr, CDIV: tl.constexpr,
                          OUTLIER: tl.constexpr, STAGED: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr,
                          G: tl.constexpr, GP: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr,
                          CHUNK: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr, CAP: tl.constexpr = 0.0):
        """Scores of KV heads [h0, h0 + HB) over tokens [t0, t0 + BLOCK_T) of row b (grid (Hkv / HB, token tiles,
        B)): keys rebuilt chunk by chunk of the latent (Z_k[tile, chunk] R_k[chunk, heads' columns], one dot per RoPE
        half), b_k, RoPE at positions POS0 + t, then one dot per half against the block-diagonal queries of the HB
        heads -> out[b, query head, t] (log2 domain: q x QSCALE), soft-capped by CAP (runtime/kernels.soft_cap; 0:
        none). Tokens at or past the row's length are not written (the value kernel never reads them)."""
        ACC: tl.constexpr = out_ptr.dtype.element_ty
        HD: tl.constexpr = D // 2
        NC: tl.constexpr = HB * HD
        h0 = tl.program_id(0) * HB
        t0 = tl.program_id(1) * BLOCK_T
        b = tl.program_id(2)
        length = tl.load(len_ptr + b)
        if t0 < length:
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < length
            c = tl.arange(0, NC)
            j = c % HD
            col = (h0 + c // HD) * D + j  # R_k's column of the first half; the second half is HD further
            acc1 = tl.zeros((BLOCK_T, NC), ACC)
            acc2 = tl.zeros((BLOCK_T, NC), ACC)
            for c0 in range(0, RW, CHUNK):
                ch = c0 + tl.arange(0, CHUNK)
                if STAGED:
                    z = tl.load(zs_ptr + b * szb + t[:, None] * szt + ch[None, :], mask=tm[:, None], other=0.0)
                    z = operand(z, PREC)
                else:
                    z = _dequant_tile(codes_ptr + b * scb, sc_ptr + b * ssb, zc_ptr + b * ssb, t, tm, t0, c0, sct,
                                      sst, BITS, RW, TDIV, CDIV, BLOCK_T, CHUNK)
                    if OUTLIER:  # latent channel 0 from its fp16 copy
                        o = tl.load(ko_ptr + b * skob + t, mask=tm, other=0.0).to(tl.float32)
                        z = tl.where((ch == 0)[None, :], o[:, None], z)
                    z = mma_operand(z, PREC, INTERP)
                r = rk_ptr + ch[:, None] * (HKV * D) + col[None, :]
                acc1 += dot(z, tl.load(r), INTERP).to(ACC)
                acc2 += dot(z, tl.load(r + HD), INTERP).to(ACC)
            if HAS_BIAS:
                acc1 += tl.load(bias_ptr + col).to(ACC)[None, :]
                acc2 += tl.load(bias_ptr + col + HD).to(ACC)[None, :]
            toff = (POS0 + t)[:, None] * D + j[None, :]
            c1 = tl.load(cos_ptr + toff, mask=tm[:, None], other=0.0).to(ACC)
            s1 = tl.load(sin_ptr + toff, mask=tm[:, None], other=0.0).to(ACC)
            c2 = tl.load(cos_ptr + toff + HD, mask=tm[:, None], other=0.0).to(ACC)
            s2 = tl.load(sin_ptr + toff + HD, mask=tm[:, None], other=0.0).to(ACC)
            k1 = acc1 * c1 - acc2 * s1
            k2 = acc2 * c2 + acc1 * s2
            n = tl.arange(0, HB * GP)
            qh = n // GP
            g = n % GP
            qmask = ((c // HD)[:, None] == qh[None, :]) & (g < G)[None, :]  # [NC, HB GP] block diagonal
            qoff = q_ptr + b * sqb + ((h0 + qh) * G + g)[None, :] * D + j[:, None]
            q1 = tl.load(qoff, mask=qmask, other=0.0)
            q2 = tl.load(qoff + HD, mask=qmask, other=0.0)
            s = soft_cap((_qk(k1, q1, PREC, INTERP) + _qk(k2, q2, PREC, INTERP)).to(ACC) * QSCALE, CAP)
            tl.store(out_ptr + b * sob + ((h0 + qh) * G + g)[None, :] * soh + t[:, None], s,
                     mask=tm[:, None] & (g < G)[None, :])

    @triton.jit
    def _values_tc_kernel(codes_ptr, scb, sct, sc_ptr, zc_ptr, ssb, sst, s_ptr, sob, soh, len_ptr, NSPLIT,
                          lat_ptr, m_ptr, l_ptr, BITS: tl.constexpr, RW: tl.constexpr, CDIV: tl.constexpr,
                          HQ: tl.constexpr, HQP: tl.constexpr, BLOCK_T: tl.constexpr, VC: tl.constexpr,
                          INTERP: tl.constexpr, PREC: tl.constexpr):
        """Split `split` of row b's tokens (split_bounds), latent channels [VC c, VC (c + 1)) (grid (B, splits,
        width / VC)): an online softmax over the split's scores s[b, :, t] of every query head and P^T Z_v by
        tl.dot, Z_v dequantized once for all query heads -> lat[b, split, head, channels] (latent space), and the
        split's m, l [b, split, head] (written by the programs of channel block 0)."""
        ACC: tl.constexpr = s_ptr.dtype.element_ty
        b = tl.program_id(0)
        split = tl.program_id(1)
        cb = tl.program_id(2)
        start, end = split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T)
        ch = cb * VC + tl.arange(0, VC)
        rh = tl.arange(0, HQP)
        ok = rh < HQ
        m_i = tl.full((HQP,), float("-inf"), ACC)
        l_i = tl.zeros((HQP,), ACC)
        acc = tl.zeros((HQP, VC), ACC)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < end
            s = tl.load(s_ptr + b * sob + rh[None, :] * soh + t[:, None], mask=tm[:, None] & ok[None, :],
                        other=float("-inf"))
            p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, ok)
            z = _dequant_tile(codes_ptr + b * scb, sc_ptr + b * ssb, zc_ptr + b * ssb, t, tm, t0, cb * VC, sct, sst,
                              BITS, RW, 1, CDIV, BLOCK_T, VC)
            acc = acc * alpha[:, None] + dot(tl.trans(operand(p, PREC)), mma_operand(z, PREC, INTERP), INTERP).to(ACC)
        part = b * NSPLIT + split
        tl.store(lat_ptr + (part * HQ + rh)[:, None] * RW + ch[None, :], acc, mask=ok[:, None])
        if cb == 0:
            tl.store(m_ptr + part * HQ + rh, m_i, mask=ok)
            tl.store(l_ptr + part * HQ + rh, l_i, mask=ok)


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


def latent_args(storage, packed, side: str) -> tuple:
    """What _dequant reads of the key latents (side "k") or the value latents ("v"): (codes or raw latents, scales,
    zeros, the parameters' (row, slot) strides, TDIV, CDIV); variant x's keys read the value buffers."""
    keys = side == "k" and storage.variant != "x"
    dummy, _ = K.placeholders(packed.lengths.device)
    if storage.bits == 16:
        return packed["k_raw" if keys else "v_raw"], dummy, dummy, (0, 0), 1, 1
    codes = packed["k_codes" if keys else "v_codes"]
    sc, zc = (packed["k_scale"], packed["k_zero"]) if keys else (packed["v_scale"], packed["v_zero"])
    tdiv, cdiv = (storage.group_tokens, 1) if keys else (1, storage.group_channels)
    return codes, sc, zc, (sc.stride(0), sc.stride(2)), tdiv, cdiv


def latent_chunk(storage, packed, side: str, t0: int, t1: int, dtype) -> torch.Tensor:
    """Dequantized latents Z_k (side "k") or Z_v ("v") of slots [t0, t1) of every row, [B, t1 - t0, width] in dtype
    (one Triton launch: _latent_kernel; slots past a row's length hold whatever the buffer holds, finite)."""
    width = storage.width
    dummy, _ = K.placeholders(packed.lengths.device)
    codes, sc, zc, s_strides, tdiv, cdiv = latent_args(storage, packed, side)
    outlier = side == "k" and storage.variant != "x" and storage.outlier
    ko = packed["k_outlier"] if outlier else dummy
    out = torch.empty(packed.batch, t1 - t0, width, dtype=dtype, device=codes.device)
    bt, c = (16, _chunk(width, 16)) if K.INTERPRET else (32, _chunk(width, 64))
    with launch_device(out):
        _latent_kernel[(packed.batch, triton.cdiv(t1 - t0, bt), width // c)](
            codes, codes.stride(0), codes.stride(2), sc, zc, *s_strides, ko, ko.stride(0) if outlier else 0, out,
            out.stride(0), out.stride(1), t0, t1, BITS=storage.bits, RW=width, TDIV=tdiv, CDIV=cdiv,
            OUTLIER=int(outlier), BLOCK_T=bt, C=c, num_warps=4)
    return out


def _pow2_divisor(n: int, want: int) -> int:
    """The largest power of two <= want dividing n (at least 1)."""
    h = 1
    while h * 2 <= want and n % (h * 2) == 0:
        h *= 2
    return h


def attend_triton(storage, q: torch.Tensor, packed, scale: float, fp, *, block_t: int | None = None,
              chunk: int | None = None, heads_per_program: int | None = None, staged_latents: bool = False,
              value_block_t: int | None = None, value_chunk: int | None = None, num_warps: int | None = None,
              value_num_warps: int | None = None, num_stages: int | None = None, max_registers: int | None = None,
              programs_per_sm: int | None = None, num_splits: int | None = None):
    """Partials of q [B, Hq, D] (after RoPE) over the storage's packed latents and the full-precision part `fp`, by
    the two tensor-core kernels (the module docstring). Knobs: block_t tokens per
    scores program, chunk latent channels per key-product step (a power of two dividing the width, at least 16),
    heads_per_program KV heads per scores program (a power of two dividing Hkv), staged_latents (Z_k dequantized
    once into fp16 first), value_block_t / value_chunk tokens per step and latent channels per value program,
    num_warps / value_num_warps / num_stages / max_registers (a register cap per thread) of the two kernels, and the
    value pass's token splits (num_splits, or programs_per_sm programs per SM over the (row, channel block) pairs).
    Defaults on the GPU for fp16/bf16 queries: 128-token tiles, chunks of 64, one KV head per program, 8 warps (two
    pipeline stages at 3 bits); value tiles of 64 tokens by 64 channels, 4 warps (the module docstring says why); float32 queries 32 x 32 and float64
    16 x 16 scores steps, float64 value tiles of 16 tokens by 32 channels."""
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
    hq = hkv * group
    prec = {torch.float64: 64, torch.float32: 32}.get(q.dtype, 16)
    acc_dtype = torch.float64 if prec == 64 else torch.float32
    operand = torch.float16 if prec == 16 else q.dtype
    width, cap, bits = storage.width, packed.capacity, storage.bits
    interp = K.INTERPRET
    # exactness modes on the GPU: float32 in 32 x 32 steps, float64 (products summed on the FP64 units, tiles.dot) in
    # 16 x 16 steps and 16 x 32 value tiles, where larger ones spill kilobytes a thread (compiled for sm_90 as
    # benchmarks/xquant_kernel_sass.py does: 47 KB of stack at 32 x 64, 30 KB for 64 x 128 value tiles)
    bt = block_t or (16 if interp else {16: 128, 32: 32, 64: 16}[prec])
    c = _chunk(width, chunk or (16 if interp else {16: 64, 32: 32, 64: 16}[prec]))
    hb = _pow2_divisor(hkv, heads_per_program or 1)
    gp = max(pow2(group), pow2(-(-16 // hb)))
    vbt = value_block_t or (16 if interp or prec == 64 else 64)
    vc = _chunk(width, value_chunk or (16 if interp else (32 if prec == 64 else 64)))
    warps = num_warps or min(16, max(4, bt * hb * d // 2048))  # <= 64 float32 accumulator registers a thread
    value_warps = value_num_warps or (8 if vbt * vc >= 16384 else 4)
    dummy, _ = K.placeholders(dev)
    lengths = packed.lengths

    # scores
    if prec == 16:
        qs, qscale = q.to(torch.float16).contiguous(), float(scale) * LOG2E
    else:
        qs, qscale = (q.to(acc_dtype) * (scale * LOG2E)).contiguous(), 1.0
    cos, sin = (packed.rope_cos.to(acc_dtype).contiguous(), packed.rope_sin.to(acc_dtype).contiguous())
    r_k = storage.factor("r_k", operand)
    b_k, b_v = storage.factor("b_k", acc_dtype), storage.factor("b_v", acc_dtype)
    s = torch.empty(batch, hq, cap, dtype=acc_dtype, device=dev)
    codes, sc, zc, s_strides, tdiv, cdiv = latent_args(storage, packed, "k")
    outlier = storage.variant != "x" and storage.outlier
    ko = packed["k_outlier"] if outlier else dummy
    zs = latent_chunk(storage, packed, "k", 0, cap, operand) if staged_latents else dummy
    with launch_device(q):
        _scores_tc_kernel[(hkv // hb, triton.cdiv(cap, bt), batch)](
            codes, codes.stride(0), codes.stride(2), sc, zc, *s_strides, ko, ko.stride(0) if outlier else 0,
            zs, zs.stride(0) if staged_latents else 0, zs.stride(1) if staged_latents else 0,
            r_k, b_k if b_k is not None else dummy, cos, sin, packed.pos_offset, lengths, qs, qs.stride(0), qscale,
            s, s.stride(0), s.stride(1), hkv, BITS=bits, RW=width, TDIV=tdiv, CDIV=cdiv,
            OUTLIER=int(outlier and not staged_latents), STAGED=int(staged_latents), HAS_BIAS=int(b_k is not None),
            D=d, G=group, GP=gp, HB=hb, BLOCK_T=bt, CHUNK=c, INTERP=interp, PREC=prec,
            CAP=K.cap_log2(packed.softcap),
            **K.launch_options(q, warps, num_stages or (2 if bits == 3 and prec == 16 else None), max_registers))

    # values in latent space, every query head at once
    nsplit = K.split_count(num_splits, programs_per_sm, dev, batch * (width // vc), cap, vbt, default_programs=4)
    lat = torch.empty(batch, nsplit, hq, width, dtype=acc_dtype, device=dev)
    m = torch.empty(batch, nsplit, hq, dtype=acc_dtype, device=dev)
    l_sum = torch.empty_like(m)
    codes, sc, zc, s_strides, _, cdiv = latent_args(storage, packed, "v")
    with launch_device(q):
        _values_tc_kernel[(batch, nsplit, width // vc)](
            codes, codes.stride(0), codes.stride(2), sc, zc, *s_strides, s, s.stride(0), s.stride(1), lengths, nsplit,
            lat, m, l_sum, BITS=bits, RW=width, CDIV=cdiv, HQ=hq, HQP=max(pow2(hq), 16), BLOCK_T=vbt, VC=vc,
            INTERP=interp, PREC=prec, **K.launch_options(q, value_warps, num_stages, max_registers))

    # R_v once per KV head over every (row, split, query head): one batched product of M = B S G rows
    total = nsplit + K.fp_splits(fp)
    parts = K.Partials.empty(batch * hkv, total, group, d, q.dtype, dev)
    r_v = storage.factor("r_v", acc_dtype).view(width, hkv, d).transpose(0, 1)  # [Hkv, width, D]
    lv = lat.view(batch * nsplit, hkv, group, width).transpose(0, 1).reshape(hkv, batch * nsplit * group, width)
    acc = torch.bmm(lv, r_v).view(hkv, batch, nsplit, group, d).transpose(0, 1)  # [B, Hkv, S, G, D]
    m = m.view(batch, nsplit, hkv, group).transpose(1, 2)
    l_sum = l_sum.view(batch, nsplit, hkv, group).transpose(1, 2)
    if b_v is not None:
        acc = acc + l_sum[..., None] * b_v.view(hkv, 1, 1, d)
    parts.m.view(batch, hkv, total, group)[:, :, :nsplit] = m
    parts.l.view(batch, hkv, total, group)[:, :, :nsplit] = l_sum
    parts.acc.view(batch, hkv, total, group, d)[:, :, :nsplit] = acc
    if fp is not None:
        K.fp_partials_into(q, fp, scale, parts, nsplit, softcap=packed.softcap)
    return parts
