"""Decode attention over a packed KV cache plus a full-precision token segment.

`PackedKV` describes one layer's compressed tokens for the whole batch: row b holds `lengths[b]` tokens
in slots [0, lengths[b]) of its buffers (left padding is never stored, so rows differ in length). The
full-precision segment (sinks, recent window, unflushed residual) is passed separately as post-RoPE
keys and values with a validity mask; its slot order is free (softmax does not care), so a ring buffer
works as is.

`decode_attention_ref` is the torch reference: it dequantizes everything and runs plain attention in
float32. The Triton kernel (same signature) must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.quant.rope import apply_rope
from kvcal.runtime.quantize import (
    dequantize_affine_channels,
    dequantize_affine_tokens,
    dequantize_lut_dynamic,
    dequantize_lut_static,
)

KEY_FORMATS = ("affine_channels", "affine_tokens", "lut_static")
VALUE_FORMATS = ("affine_channels", "lut_dynamic")


@dataclass
class PackedKV:
    head_dim: int
    lengths: torch.Tensor  # [B] int32: compressed tokens per row
    key_format: str
    key_bits: int
    k_codes: torch.Tensor  # [B, Hkv, Tcap, Wk] int32
    k_scale: torch.Tensor | None  # affine_channels [B,Hkv,Tcap,Gk] fp16 | affine_tokens [B,Hkv,Tcap/block,D] fp16 | lut_static [C] fp32
    k_zero: torch.Tensor | None
    value_format: str
    value_bits: int
    v_codes: torch.Tensor  # [B, Hkv, Tcap, Wv] int32
    v_scale: torch.Tensor | None  # affine_channels [B,Hkv,Tcap,Gv] fp16 | lut_dynamic [B,Tcap] or [B,Hkv,Tcap] fp16
    v_zero: torch.Tensor | None
    key_block: int = 1  # affine_tokens: tokens sharing one (scale, zero) per channel
    k_table: torch.Tensor | None = None  # lut_static decode table [2^bits] fp32
    k_out_idx: torch.Tensor | None = None  # [B, Tcap, Hkv, capk] int16 channel in [0, C), -1 = empty
    k_out_val: torch.Tensor | None = None  # [B, Tcap, Hkv, capk] fp16 residual
    v_table: torch.Tensor | None = None
    v_out_idx: torch.Tensor | None = None  # [B, Tcap, capv] per token over all heads, or [B, Tcap, Hkv, capv]
    v_out_val: torch.Tensor | None = None
    # Pre-RoPE keys are rotated at attention time: slot i of a row sits at position pos_offset + i.
    rope_cos: torch.Tensor | None = None  # [Tmax, D] float32 (None: keys are stored post-RoPE)
    rope_sin: torch.Tensor | None = None
    pos_offset: int = 0
    # [D / 2] float32 where the tables are cos/sin(position * inv_freq) (rope_cos_sin's): kernels may compute a
    # token's angle instead of reading its table row (attention_outliers' key pass)
    rope_inv_freq: torch.Tensor | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    def row_keys(self, b: int, dtype=torch.float32) -> torch.Tensor:
        """Reconstructed post-RoPE keys of row b: [Hkv, T_b, D] in `dtype` (float32, or float64 for
        exactness checks: dequantization is exact in float32, the rotation is done in `dtype`)."""
        t, d = int(self.lengths[b]), self.head_dim
        codes = self.k_codes[b, :, :t].transpose(0, 1)  # [T, H, W]
        if self.key_format == "affine_channels":
            k = dequantize_affine_channels(codes, self.k_scale[b, :, :t].transpose(0, 1),
                                           self.k_zero[b, :, :t].transpose(0, 1), self.key_bits, d)
        elif self.key_format == "affine_tokens":
            blocks = torch.arange(t, device=codes.device) // self.key_block
            scale = self.k_scale[b][:, blocks].transpose(0, 1)  # [T, H, D]
            zero = self.k_zero[b][:, blocks].transpose(0, 1)
            k = dequantize_affine_tokens(codes, scale, zero, self.key_bits, d)
        else:
            idx = None if self.k_out_idx is None else self.k_out_idx[b, :t]
            val = None if self.k_out_val is None else self.k_out_val[b, :t]
            k = dequantize_lut_static(codes, self.k_zero, self.k_scale, self.k_table,
                                      self.key_bits, d, idx, val)
        k = k.transpose(0, 1).to(dtype)  # [H, T, D]
        if self.rope_cos is not None:
            pos = slice(self.pos_offset, self.pos_offset + t)
            k = apply_rope(k[None], self.rope_cos[None, pos].to(dtype), self.rope_sin[None, pos].to(dtype))[0]
        return k

    def row_values(self, b: int, dtype=torch.float32) -> torch.Tensor:
        t, d = int(self.lengths[b]), self.head_dim
        codes = self.v_codes[b, :, :t].transpose(0, 1)
        if self.value_format == "affine_channels":
            v = dequantize_affine_channels(codes, self.v_scale[b, :, :t].transpose(0, 1),
                                           self.v_zero[b, :, :t].transpose(0, 1), self.value_bits, d)
        else:
            idx = None if self.v_out_idx is None else self.v_out_idx[b, :t]
            val = None if self.v_out_val is None else self.v_out_val[b, :t]
            if self.v_scale.dim() == 3:  # per (token, head)
                scale, zero = self.v_scale[b, :, :t].transpose(0, 1), self.v_zero[b, :, :t].transpose(0, 1)
            else:
                scale, zero = self.v_scale[b, :t], self.v_zero[b, :t]
            v = dequantize_lut_dynamic(codes, scale, zero, self.v_table, self.value_bits, d, idx, val)
        return v.transpose(0, 1).to(dtype)


def decode_attention_ref(q, kv: PackedKV | None, fp_k, fp_v, fp_valid, scale: float) -> torch.Tensor:
    """One query token per row: q [B, Hq, D] (post-RoPE) over the packed tokens and the valid
    full-precision tokens fp_k/fp_v [B, Hkv, F, D] (fp_valid [B, F] bool). Returns [B, Hq, D] in q's dtype.
    Computes in float32, or in float64 for float64 inputs (the simulation's attention does the same)."""
    batch, hq, d = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(batch, hq, d, dtype=compute, device=q.device)
    for b in range(batch):
        keys = [fp_k[b][:, fp_valid[b]].to(compute)]
        values = [fp_v[b][:, fp_valid[b]].to(compute)]
        if kv is not None and int(kv.lengths[b]) > 0:
            keys.insert(0, kv.row_keys(b, compute))
            values.insert(0, kv.row_values(b, compute))
        k, v = torch.cat(keys, 1), torch.cat(values, 1)  # [Hkv, T, D]
        group = hq // k.shape[0]
        qg = q[b].to(compute).reshape(k.shape[0], group, d)
        p = torch.softmax(qg @ k.transpose(1, 2) * scale, dim=-1)
        out[b] = (p @ v).reshape(hq, d)
    return out.to(q.dtype)


# ---- Triton ---------------------------------------------------------------------------------------
# decode_attention_triton: one decode step = two launches.
#
# 1. _decode_kernel, grid (B * Hkv, S). Program (row b, KV head h, split s) handles all G = Hq/Hkv query
#    heads of that KV head (GQA in-kernel, K/V read once per group). Splits s < NSPLIT take an equal,
#    BLOCK_T-aligned share of that row's own length (no host sync, rows differ in length; a share past
#    the row's end writes a neutral partial); split s == NSPLIT takes the full-precision segment. Each
#    program runs an online softmax in fp32 over BLOCK_T-token tiles and writes (max, sum, acc).
# 2. _reduce_kernel, grid (B * Hq): merges the S partials of each query head.
#
# Packed keys and values are never dequantized element by element on the fast paths; scales and zeros
# are folded around tensor-core dots (post-scaling):
#   affine_channels keys, group g:  q.k = s_g (q_g . c_g) + z_g sum(q_g)
#   affine_tokens keys (per channel): q.k = (q * s_blk) . c + q . z_blk  (a tile lies inside one token block)
#   affine_channels values, group g: sum_t p_t v_t = (p * s_g) . c_g + (p . z_g)
#   lut_dynamic values (per token):  sum_t p_t v_t = (p * s) . T[c] + p . z  (+ sparse residuals, below)
# Codes enter the dot as exact fp16 values made without int-to-float conversions (packing.unpack_mma: a
# code's field, masked in place, is the fp16 subnormal c * f * 2^-24 with f a power of two per column, two
# codes per 32-bit and; 2^24 goes into the scales, 1/f into q's columns for keys and the output rows for values).
# Lookup-table codes (lut_static keys, lut_dynamic values; LUT_MMA, fp16/bf16 queries, <= 4 bits) enter the dot
# the same way as fp16 table values T[c] (packing.unpack_lut: two warp shuffles per 32-bit pair, in unpack_mma's
# register pairs and column order); the keys' static per-channel scale/zero and R(j) are applied to the two halves
# in fp16 pairs (_dequant_rotate).
# The generic key path (float32 queries, rope_mode="table", or any key format stored before RoPE) dequantizes a
# tile in fp32 in two halves (LUT by tl.gather from a register table), rotates and calls two dots. Sparse
# outliers (KVQuant) run as passes around _decode_kernel (attention_outliers): a key pass writes each token's
# score terms of its key residuals, the kernel adds them and writes its scores over them, and a value pass adds
# p_t r_t of the value residuals into per-split sums that the reduction adds (float32 atomics, or int64 fixed point
# under torch.use_deterministic_algorithms(True); float32 and float64 add the residuals to the dequantized tiles
# instead, as the reference does, and without atomics). RoPE by angle addition (default):
# q.R(p0 + j)k = (R(-p0) q).(R(j) k) with R(j) from table rows 0..BLOCK_T-1 kept in registers and R(-p0)
# applied to q once per tile; this needs cos/sin tables that are cos/sin(position * inv_freq) duplicated
# over the two halves (what rope_cos_sin builds). rope_mode="table" reads the tables at each token's
# position instead (any tables, more traffic).

import os  # noqa: E402
import struct  # noqa: E402
import warnings  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from kvcal.runtime import attention_outliers  # noqa: E402
from kvcal.runtime.attention_frag import BLOCK_T as FRAG_BLOCK_T  # noqa: E402
from kvcal.runtime.attention_frag import FRAG_OCCUPANCY, frag_supported  # noqa: E402
from kvcal.runtime.packing import _pow2, launch_device  # noqa: E402

_KEY_CODE = {"affine_channels": 0, "affine_tokens": 1, "lut_static": 2}
_VALUE_CODE = {"affine_channels": 0, "lut_dynamic": 1}
_UNPACK_BITS = (1, 2, 3, 4, 8)
_PREC = {torch.float32: 32, torch.float64: 64}  # rounded dot operands: fp16 for fp16 and bf16 queries
LOG2E = 1.4426950408889634
# Launch defaults per path, chosen by measurement at 32K x batch 8 on an H100 (benchmarks/NOTES-kernels.md):
# (block_t, num_warps, num_stages, max registers or None).
DEFAULTS = {
    "affine_channels": (32, 1, 2, 128),  # one-warp programs: every reduction stays in the warp
    "affine_tokens": (32, 1, 3, None),  # kivi: one warp, a tile inside one key block (q scaled once per tile)
    "generic": (32, 4, 2, None),  # lut_static / pre-RoPE keys
    "lut": (16, 1, 2, None),  # lut_static keys and lut_dynamic values, fp16 operands from table lookups
}
# Tiles ahead whose code rows are prefetched into L2 (0: none), measured at 32K x 8 on the H100 (tune rounds
# 15-16): one tile ahead saves 5% for int4 and 4% for nuq4, nothing for kivi4; two or more tiles ahead thrash the
# L2 (16 programs per SM x 4 KB per tile x tiles ahead, over 132 SMs, against 50 MB): int4 183 us at 4 ahead
PREFETCH_DEFAULTS = {"affine_channels": 1, "affine_tokens": 0, "generic": 1, "lut": 1}
FRAG_MIN_ROWS = 64  # (row, KV head) pairs from which int caches take attention_frag's kernel by default
# attention_frag: the fp-segment launch overlaps the fragment kernel's tail (sm_90 PDL); a switch for A/B timing
FRAG_OVERLAP_FP = True
# attention_frag: full-precision tokens per program of the separate fp-segment launch, and warps per program of the
# reduction. H100, 32K x 8, three passes alternating (results/bench/frag-fp-chunk-reduce-warps-h100-s25-pass2.json),
# (chunk, warps) (32, 4) -> (16, 1): int2 72.1 -> 70.9 us with the read flush, 81.5 -> 80.3 with do_bench's; int4
# 112.3 -> 110.6 and 121.8 -> 120.0; 4K x 32 int2 51.7 -> 49.6, int4 69.0 -> 66.8; 131K x 32 within 1% (int2 884.4 ->
# 891.3, int4 1562.7 -> 1559.5, one pass). Chunks of 64 were slower (int2 74.8 us).
FRAG_FP_CHUNK = 16
FRAG_REDUCE_WARPS = 1
# The reduction: one program per (row, query head, REDUCE_CHANNELS channels), REDUCE_CHUNK partials per step at 4
# warps (a quarter of that at 1 warp). At batch 1 the tile kernel leaves 265 partials per head and the reduction has
# only B x Hq = 32 (row, head) pairs: one program per pair over all 128 channels took 9 steps of 32 partials in a row,
# and 32K x 1 went from 33.7 us (stop 25: all partials at once, which spilled 168 bytes of stack, 5.4 KB with
# KVQuant's value sums) to 40.3 for int4. 32 channels per program and 256 partials per step: int4 32.5 us, int2 28.2,
# kivi4 41.2, nuq4 87.5 (was 108.2); 131K x 1 int4 94.0 -> 82.7; batch 8 within 1% (H100,
# results/bench/reduce-channels-h100-s27.json). sm_90 SASS at 265 partials: 96 registers, 166 with the value sums,
# no stack.
REDUCE_CHANNELS = 32
REDUCE_CHUNK = 256
TILE_REDUCE_WARPS = 4  # warps per program of the tile kernel's reduction
# KVQuant's value pass (fp16 / bf16) sums in float32 (the atomics' order, and so the last bits, change from run to
# run) unless torch.use_deterministic_algorithms(True) is on, then in int64 fixed point; True: fixed point always
VALUE_PASS_FIXED = False

if triton is not None:
    from kvcal.runtime.attention_frag import _frag_decode_kernel, wait_prior_grid
    from kvcal.runtime.attention_outliers import key_outlier_scores_triton, value_outlier_sums_triton
    from kvcal.runtime.packing import (
        lane_entry,
        load_words,
        mma_channels,
        mma_code_scale,
        unpack_lut_words,
        unpack_mma,
        unpack_tile,
    )
    from kvcal.runtime.splits import split_share_tl

    @triton.jit
    def _dot(a, b, INTERP: tl.constexpr):
        # Triton's interpreter multiplies bf16 operands as raw integers (3.6 and 3.9): upcast there
        # (exact: the tensor cores also multiply bf16/fp16 exactly and accumulate in fp32).
        if a.dtype == tl.float64:
            # float64 inputs (an exactness mode, not a fast path): products and sums on the FP64 units.
            # Triton 3.6's float64 tl.dot fails to compile on these operand layouts ("fp64 don't support
            # largeK MMA") and gave wrong sums in a 1-warp N=4 test on the H100, so no tensor cores here.
            return tl.sum(a[:, :, None] * b[None, :, :], 1)
        elif INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif a.dtype == tl.float32:  # float32 inputs: exact products, no TF32
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _opnd(x, PREC: tl.constexpr):
        """A rounded dot operand: fp16 for fp16/bf16 inputs (PREC 16; bf16 queries are converted: exact in
        fp16's range), float32 / float64 for float32 / float64 inputs (PREC 32 / 64: nothing rounded beyond
        the input's own precision)."""
        if PREC == 64:
            return x.to(tl.float64)
        elif PREC == 32:
            return x.to(tl.float32)
        else:
            return x.to(tl.float16)

    @triton.jit
    def _mma_operand(x, PREC: tl.constexpr, INTERP: tl.constexpr):
        """_opnd for a dot operand built in registers from packed codes. On the GPU an fp16 operand also goes
        through an opaque identity (one mov per register pair): Triton 3.6 picks the operands' kWidth from
        the narrowest type in their backward slice of pure elementwise/view ops and halves it when a tl.join
        is in it, so unpacked codes got kWidth 4, whose A operand is read back from shared memory with 64-bit
        loads and register moves instead of ldmatrix. A non-pure inline asm ends that slice (kWidth 2). SASS
        for sm_90, int4 decode main loop: 815 -> 627 instructions per 32-token tile, the 161 IMAD.MOV gone."""
        y = _opnd(x, PREC)
        if INTERP or PREC != 16:  # the interpreter has no inline asm; fp32/fp64 operands are not affected
            return y
        else:
            return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=tl.float16, is_pure=False,
                                             pack=2)

    @triton.jit
    def _rotate_query(q1, q2, cos_ptr, sin_ptr, p0, ch, D: tl.constexpr):
        """R(-p0) q for the query halves q1, q2 [HD, heads] whose rows are channels ch: (q1 c + q2 s, q2 c - q1 s)."""
        c0 = tl.load(cos_ptr + p0 * D + ch)[:, None]
        s0 = tl.load(sin_ptr + p0 * D + ch)[:, None]
        return q1 * c0 + q2 * s0, q2 * c0 - q1 * s0

    @triton.jit
    def _dequant_rotate(t1, t2, s1, z1, s2, z2, c, sn, ROPE: tl.constexpr, INTERP: tl.constexpr):
        """Key halves k1 = t1 * s1 + z1, k2 = t2 * s2 + z2 (t: table values [T, HD] fp16; s, z: per-channel [HD]
        float32) rotated by R(j): (k1 c - k2 sn, k2 c + k1 sn), c and sn [T, HD] fp16 (ROPE == 0: not rotated).
        On the GPU in fp16 pairs: per pair of registers (two channels of each half) one fma.f16x2 per half for the
        dequantization, two mul.f16x2, two fma.f16x2 and one xor (-sn) for the rotation. A key is rounded to fp16
        three times instead of the float32 path's once (not measured per key; the kernel's output differs from
        the reference by 1.44e-3 against the float32 path's 1.41e-3, bf16, 2 x 3000 tokens, H100). The interpreter
        computes in float32 and rounds once."""
        s1 = tl.broadcast_to(s1.to(tl.float16)[None, :], t1.shape)
        z1 = tl.broadcast_to(z1.to(tl.float16)[None, :], t1.shape)
        s2 = tl.broadcast_to(s2.to(tl.float16)[None, :], t1.shape)
        z2 = tl.broadcast_to(z2.to(tl.float16)[None, :], t1.shape)
        if INTERP:
            k1 = t1.to(tl.float32) * s1.to(tl.float32) + z1.to(tl.float32)
            k2 = t2.to(tl.float32) * s2.to(tl.float32) + z2.to(tl.float32)
            if ROPE == 1:
                cf = c.to(tl.float32)
                sf = sn.to(tl.float32)
                return (k1 * cf - k2 * sf).to(tl.float16), (k2 * cf + k1 * sf).to(tl.float16)
            else:
                return k1.to(tl.float16), k2.to(tl.float16)
        elif ROPE == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 k1, k2, ns, u, v; fma.rn.f16x2 k1, $2, $4, $5; fma.rn.f16x2 k2, $3, $6, $7; "
                "xor.b32 ns, $9, 0x80008000; mul.rn.f16x2 u, k2, ns; fma.rn.f16x2 $0, k1, $8, u; "
                "mul.rn.f16x2 v, k1, $9; fma.rn.f16x2 $1, k2, $8, v; }",
                "=r,=r,r,r,r,r,r,r,r,r", [t1, t2, s1, z1, s2, z2, c, sn], dtype=(tl.float16, tl.float16),
                is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ fma.rn.f16x2 $0, $2, $4, $5; fma.rn.f16x2 $1, $3, $6, $7; }",
                "=r,=r,r,r,r,r,r,r", [t1, t2, s1, z1, s2, z2], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)

    @triton.jit
    def _prefetch_l2(ptr, nbytes):
        """Ask the L2 for nbytes (a multiple of 16; nothing when <= 0) from the 16-byte aligned address ptr:
        one sm_90 bulk prefetch for the warp (a uniform address; per-lane addresses made ptxas serialize the
        instruction over the lanes). Nothing comes back to the thread: the tile's own loads later hit L2.
        Triton's two-stage pipeline issues a tile's copy only one iteration ahead, so each one-warp program
        had a single tile in flight; prefetching further ahead costs no registers or shared memory."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [tl.full((1,), 0, tl.int64) + ptr.to(tl.int64), tl.full((1,), 0, tl.int32) + nbytes],
            dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _regroup(x, SRC: tl.constexpr, DST: tl.constexpr, N: tl.constexpr):
        """Columns [N, SRC] -> [N, DST] keeping columns < min(SRC, DST) (columns >= G must be zero)."""
        if SRC == DST:
            return x
        elif SRC > DST:
            return tl.sum(tl.reshape(x, (N, SRC // DST, DST)), 1)
        else:
            r = tl.arange(0, DST // SRC)
            y = tl.where((r == 0)[None, :, None], tl.broadcast_to(x[:, None, :], (N, DST // SRC, SRC)), 0.0)
            return tl.reshape(y, (N, DST))

    @triton.jit
    def _key_half(kptr, tm, t, C0: tl.constexpr, HD: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
                  KEY_FORMAT: tl.constexpr, ks_base, kz_base, skst, GS: tl.constexpr, KEY_BLOCK: tl.constexpr,
                  ktab_ptr, kscl, kzer):
        """Dequantized channels [C0, C0 + HD) of a key tile, fp32 [BLOCK_T, HD] (generic path)."""
        c = unpack_tile(kptr, tm, C0, HD, 2 * HD, BITS, BLOCK_T)
        ch = C0 + tl.arange(0, HD)
        if KEY_FORMAT == 0:
            off = t[:, None] * skst + (ch // GS)[None, :]
            s = tl.load(ks_base + off, mask=tm[:, None], other=0.0).to(tl.float32)
            z = tl.load(kz_base + off, mask=tm[:, None], other=0.0).to(tl.float32)
            return c.to(tl.float32) * s + z
        elif KEY_FORMAT == 1:
            off = (t // KEY_BLOCK)[:, None] * skst + ch[None, :]
            s = tl.load(ks_base + off, mask=tm[:, None], other=0.0).to(tl.float32)
            z = tl.load(kz_base + off, mask=tm[:, None], other=0.0).to(tl.float32)
            return c.to(tl.float32) * s + z
        else:
            NL: tl.constexpr = 1 << BITS
            tab = tl.broadcast_to(tl.load(ktab_ptr + tl.arange(0, NL))[None, :], (BLOCK_T, NL))
            return tl.gather(tab, c.to(tl.int32), 1) * kscl[None, :] + kzer[None, :]

    @triton.jit
    def _pass_rows(sc_row, t, tm, GPK: tl.constexpr, GPQ: tl.constexpr):
        """Pointers and mask of a tile's rows [BLOCK_T, GPK] in the outlier passes' buffer (attention_outliers: GPQ
        columns per token), read for the key pass's terms and written with the scores."""
        rk = tl.arange(0, GPK)
        return sc_row + t[:, None] * GPQ + rk[None, :], tm[:, None] & (rk < GPQ)[None, :]

    @triton.jit
    def _lut_tile_loads(krow, vrow, t0, end, skt, svt, KALIGN: tl.constexpr, VALIGN: tl.constexpr, D: tl.constexpr,
                        KBITS: tl.constexpr, VBITS: tl.constexpr, BLOCK_T: tl.constexpr, sc_row, KCORR: tl.constexpr,
                        GPK: tl.constexpr, GPQ: tl.constexpr):
        """The loads of one lookup-table tile (tokens t0 .. t0 + BLOCK_T - 1, those < end): load_words of the key
        halves and the value row (3 + 3 + 3 tensors) and, with KCORR, the key pass's score terms [BLOCK_T, GPK]
        (attention_outliers; else a placeholder)."""
        HD: tl.constexpr = D // 2
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < end
        kptr = krow + tl.multiple_of(t * skt, KALIGN)  # rows start on KALIGN-word boundaries (the host checked)
        ka0, ka1, ka2 = load_words(kptr, tm, 0, HD, D, KBITS)
        kb0, kb1, kb2 = load_words(kptr, tm, HD, HD, D, KBITS)
        va0, va1, va2 = load_words(vrow + tl.multiple_of(t * svt, VALIGN), tm, 0, D, D, VBITS)
        if KCORR:
            rows, rows_ok = _pass_rows(sc_row, t, tm, GPK, GPQ)
            kx = tl.load(rows, mask=rows_ok, other=0.0)
        else:
            kx = 0.0
        return ka0, ka1, ka2, kb0, kb1, kb2, va0, va1, va2, kx

    @triton.jit
    def _add_residuals(x, oi_ptr, ov_ptr, rowoff, tm, ch0, W: tl.constexpr, CAP: tl.constexpr):
        """x [BLOCK_T, W] float32 (channels ch0 .. ch0 + W - 1 of each token) plus the sparse residuals that land
        there, one float32 addition per residual as the reference's scatter_add does. Only the float64 path uses
        it (exactness, not speed: a pass over the tile per slot); the fast paths add residuals to the scores."""
        ch = ch0 + tl.arange(0, W)
        for j in range(CAP):
            oi = tl.load(oi_ptr + rowoff + j, mask=tm, other=-1).to(tl.int32)
            ov = tl.load(ov_ptr + rowoff + j, mask=tm, other=0.0).to(tl.float32)
            x = x + tl.where(ch[None, :] == oi[:, None], ov[:, None], 0.0)
        return x

    @triton.jit
    def _key_params(ks_base, kz_base, t0, end, skst, KEY_FORMAT: tl.constexpr, GENERIC_K: tl.constexpr,
                    GK: tl.constexpr, KEY_BLOCK: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                    BLOCK_T: tl.constexpr):
        """Per-tile key scales/zeros of the fast paths, loaded one tile ahead (they are not pipelined by
        Triton, and waiting for them each tile made the loop latency-bound)."""
        if GENERIC_K:
            z = tl.zeros((1,), tl.float16)
            return z, z
        elif KEY_FORMAT == 0:  # [BLOCK_T, GK]
            t = t0 + tl.arange(0, BLOCK_T)
            off = t[:, None] * skst + tl.arange(0, GK)[None, :]
            m = (t < end)[:, None]
            return tl.load(ks_base + off, mask=m, other=0.0), tl.load(kz_base + off, mask=m, other=0.0)
        else:  # affine_tokens, [D]: the tile lies inside one token block
            ch = mma_channels(0, D, BITS)
            off = (t0 // KEY_BLOCK) * skst + ch
            m = (t0 + ch * 0) < end
            return tl.load(ks_base + off, mask=m, other=0.0), tl.load(kz_base + off, mask=m, other=0.0)

    @triton.jit
    def _value_params(vs_base, vz_base, t0, end, svst, VALUE_FORMAT: tl.constexpr, GV: tl.constexpr,
                      BLOCK_T: tl.constexpr):
        t = t0 + tl.arange(0, BLOCK_T)
        if VALUE_FORMAT == 0:  # [BLOCK_T, GV]
            off = t[:, None] * svst + tl.arange(0, GV)[None, :]
            m = (t < end)[:, None]
            return tl.load(vs_base + off, mask=m, other=0.0), tl.load(vz_base + off, mask=m, other=0.0)
        else:  # [BLOCK_T] per token
            return tl.load(vs_base + t * svst, mask=t < end, other=1.0), tl.load(vz_base + t * svst, mask=t < end, other=0.0)

    @triton.jit
    def _fp_segment(q_row, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, F0, F, b, h, part, m_ptr, l_ptr,
                    acc_ptr, qk_scale, D: tl.constexpr, G: tl.constexpr, GPF: tl.constexpr, BLOCK_F: tl.constexpr,
                    INTERP: tl.constexpr):
        """Tokens [F0, F) of the full-precision segment (sinks, window, residual; post-RoPE) of one (row, KV head):
        their softmax partial (m, l, acc) into partial `part`. Shared by the packed-cache kernels."""
        DT: tl.constexpr = q_row.dtype.element_ty
        ACC: tl.constexpr = m_ptr.dtype.element_ty
        dd = tl.arange(0, D)
        rf = tl.arange(0, GPF)
        qx = tl.load(q_row + rf[:, None] * sqh + dd[None, :], mask=(rf < G)[:, None], other=0.0)
        mf = tl.full((GPF,), float("-inf"), ACC)
        lf = tl.zeros((GPF,), ACC)
        af = tl.zeros((GPF, D), ACC)
        for f0 in range(F0, F, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            fin = f < F
            ok = (tl.load(fval_ptr + b * sfvb + f, mask=fin, other=0) != 0) & fin
            fo = b * sfb + h * sfh + f[:, None] * sft + dd[None, :]
            kf = tl.load(fk_ptr + fo, mask=fin[:, None], other=0.0).to(DT)
            vf = tl.load(fv_ptr + fo, mask=fin[:, None], other=0.0).to(DT)  # issued with the keys: one wait, not two
            s = tl.where(ok[None, :], _dot(qx, tl.trans(kf), INTERP) * qk_scale, float("-inf"))
            m_new = tl.maximum(mf, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(mf - m_use)
            p = tl.exp2(s - m_use[:, None])
            lf = lf * alpha + tl.sum(p, 1)
            mf = m_new
            p_hi = p.to(DT)  # p = p_hi + p_lo: two dots keep P at ~fp32 precision (F is small)
            p_lo = (p - p_hi.to(ACC)).to(DT)
            af = af * alpha[:, None] + _dot(p_hi, vf, INTERP) + _dot(p_lo, vf, INTERP)
        tl.store(acc_ptr + (part * G + rf)[:, None] * D + dd[None, :], af, mask=(rf < G)[:, None])
        tl.store(m_ptr + part * G + rf, mf, mask=rf < G)
        tl.store(l_ptr + part * G + rf, lf, mask=rf < G)

    @triton.jit
    def _fp_kernel(q_ptr, sqb, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, F, m_ptr, l_ptr, acc_ptr, HKV,
                   qk_scale, S, CHUNK, D: tl.constexpr, G: tl.constexpr, GPF: tl.constexpr, BLOCK_F: tl.constexpr,
                   INTERP: tl.constexpr, WAIT_PRIOR: tl.constexpr):
        """The full-precision segment alone, where the packed kernel should not carry the segment's shared-memory
        tiles (attention_frag): program (row and KV head, j) takes tokens [j CHUNK, (j + 1) CHUNK), into partial
        S - num_programs(1) + j of the row and head's S (chunks of a few tiles: one program walking a 128-token
        window tile by tile took 10.5 us at 32K x 8 on the H100, most of it load latency)."""
        pid = tl.program_id(0)
        j = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        f0 = j * CHUNK
        _fp_segment(q_ptr + b * sqb + h * G * sqh, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, f0,
                    tl.minimum(F, f0 + CHUNK), b, h, pid * S + S - tl.num_programs(1) + j, m_ptr, l_ptr, acc_ptr,
                    qk_scale, D, G, GPF, BLOCK_F, INTERP)
        if WAIT_PRIOR:  # launched to overlap the fragment kernel: finish only after it, so the reduction sees both
            wait_prior_grid()

    @triton.jit
    def _decode_kernel(
        q_ptr, sqb, sqh, len_ptr,
        kc_ptr, skb, skh, skt, ks_ptr, kz_ptr, sksb, sksh, skst, ktab_ptr, koi_ptr, kov_ptr, skob, skot, skoh,
        vc_ptr, svb, svh, svt, vs_ptr, vz_ptr, svsb, svsh, svst, vtab_ptr, voi_ptr, vov_ptr, svob, svot, svoh,
        cos_ptr, sin_ptr, pos_offset, TMAX,
        fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, F,
        m_ptr, l_ptr, acc_ptr, HKV, qk_scale_hi, qk_scale_lo, NSPLIT, sc_ptr, sscr,
        D: tl.constexpr, G: tl.constexpr, GPK: tl.constexpr, GK: tl.constexpr, GPV: tl.constexpr,
        GV: tl.constexpr, GPF: tl.constexpr, GPQ: tl.constexpr, KALIGN: tl.constexpr,
        VALIGN: tl.constexpr,
        KEY_FORMAT: tl.constexpr, KBITS: tl.constexpr, KEY_BLOCK: tl.constexpr, KCAP: tl.constexpr,
        GENERIC_K: tl.constexpr, ROPE: tl.constexpr,
        VALUE_FORMAT: tl.constexpr, VBITS: tl.constexpr, VCAP: tl.constexpr, HAS_PACKED: tl.constexpr,
        HAS_FP: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
        PREFETCH: tl.constexpr, KROW: tl.constexpr, VROW: tl.constexpr, LUT_MMA: tl.constexpr,
        LUT_AHEAD: tl.constexpr, KCORR: tl.constexpr, SAVE_S: tl.constexpr,
    ):
        ACC: tl.constexpr = m_ptr.dtype.element_ty  # softmax state and sums: float64 for float64, else float32
        # (not a tl.dtype launch argument: a run with one, and a torch scalar built per call, timed int4 at
        # 301 us instead of 200 us at 32K x 8, small shapes slower still; the two were not separated)
        # sparse outliers: KCAP / VCAP > 0 only for float32 and float64, whose residuals are added to the float32
        # dequantized tile as the reference does (float64: the result equals it up to float64 summation order);
        # fp16 and bf16 run them as passes around this kernel (KCORR: the key pass's score terms; SAVE_S: scores
        # for the value pass)
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
        dd = tl.arange(0, D)
        q_row = q_ptr + b * sqb + h * G * sqh
        part = pid * S + split
        if HAS_PACKED:
            if split < NSPLIT:
                # Token-major tiles: scores are [BLOCK_T, heads] = codes [BLOCK_T, D] x q^T [D, heads], so the
                # big operand is the M side of the tensor-core dot (wgmma on Hopper for BLOCK_T >= 64).
                length = tl.load(len_ptr + b)
                share = split_share_tl(length, NSPLIT, BLOCK_T)
                start = split * share
                end = tl.minimum(start + share, length)
                HD: tl.constexpr = D // 2
                GS: tl.constexpr = D // GK
                MQ: tl.constexpr = GPK * GK
                MV: tl.constexpr = GPV * GV
                rk = tl.arange(0, GPK)
                ks_base = ks_ptr + b * sksb + h * sksh
                kz_base = kz_ptr + b * sksb + h * sksh
                sc_row = sc_ptr + pid * sscr  # outlier passes: this (row, KV head)'s score terms / scores
                ko = b * skob + h * skoh  # float32 / float64: key outlier slots of this row and head (only its own)
                vo = b * svob + h * svoh  # ... value outlier slots (per token over all heads: head stride 0)
                # ---- per-program key setup
                if GENERIC_K:
                    hh = tl.arange(0, HD)
                    # LUT_MMA: the key halves come from unpack_lut in mma_channels' column order, so every per-channel
                    # operand of the dot (q, the static scale and zero, R(j)) is loaded in that order
                    if LUT_MMA:
                        kch = mma_channels(0, HD, KBITS)
                    else:
                        kch = hh
                    q1 = tl.load(q_row + rk[None, :] * sqh + kch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
                    q2 = tl.load(q_row + rk[None, :] * sqh + HD + kch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
                    if KEY_FORMAT == 2:  # per-channel static range: the zero/scale quantization used (fp32)
                        kzer1 = tl.load(kz_ptr + h * D + kch)
                        kscl1 = tl.load(ks_ptr + h * D + kch)
                        kzer2 = tl.load(kz_ptr + h * D + HD + kch)
                        kscl2 = tl.load(ks_ptr + h * D + HD + kch)
                        if LUT_MMA:  # _dequant_rotate works in fp16: convert before the loop (ptxas may hoist it anyway)
                            kzer1 = kzer1.to(tl.float16)
                            kscl1 = kscl1.to(tl.float16)
                            kzer2 = kzer2.to(tl.float16)
                            kscl2 = kscl2.to(tl.float16)
                    else:
                        kzer1 = tl.zeros((HD,), tl.float32)
                        kscl1 = kzer1
                        kzer2 = kzer1
                        kscl2 = kzer1
                    if ROPE == 1:  # R(j) for the offsets j of a tile, kept in registers (LUT_MMA: fp16, column order)
                        jr = tl.arange(0, BLOCK_T)
                        cj = tl.load(cos_ptr + jr[:, None] * D + kch[None, :], mask=(jr < TMAX)[:, None], other=1.0)
                        sj = tl.load(sin_ptr + jr[:, None] * D + kch[None, :], mask=(jr < TMAX)[:, None], other=0.0)
                        if LUT_MMA:
                            cj = cj.to(tl.float16)
                            sj = sj.to(tl.float16)
                    else:
                        cj = tl.zeros((BLOCK_T, HD), tl.float32)
                        sj = cj
                        qa = _opnd(q1, PREC)
                        qb = _opnd(q2, PREC)
                elif KEY_FORMAT == 0:
                    kch = mma_channels(0, D, KBITS)  # channel of each code column
                    rq = tl.arange(0, MQ)  # columns (head, key group): q restricted to the group's channels
                    qg = _opnd(tl.load(q_row + (rq // GK)[None, :] * sqh + kch[:, None],
                                 mask=((rq // GK) < G)[None, :] & ((kch // GS)[:, None] == (rq % GK)[None, :]),
                                 other=0.0), PREC)  # [D, MQ]
                    sq = tl.reshape(tl.sum(qg.to(ACC), 0), (GPK, GK))
                    # code columns hold code * f (unpack_mma): q / f, exact (a power of two; an entry below
                    # fp16's normal range keeps an absolute error under 2^-25 * f <= 2^-18)
                    qg = _opnd(qg.to(ACC) / mma_code_scale(D, KBITS).to(ACC)[:, None], PREC)
                else:
                    kch = mma_channels(0, D, KBITS)
                    qf = tl.load(q_row + rk[None, :] * sqh + kch[:, None], mask=(rk < G)[None, :], other=0.0).to(ACC)
                    kinv = 1.0 / mma_code_scale(D, KBITS).to(ACC)  # code columns hold code * f (unpack_mma)
                if VALUE_FORMAT == 0 or LUT_MMA:
                    vch = mma_channels(0, D, VBITS)
                else:
                    vch = dd
                m_i = tl.full((GPK,), float("-inf"), ACC)
                l_i = tl.zeros((GPK,), ACC)
                acc = tl.zeros((D, MV), ACC)
                corr = tl.zeros((MV,), ACC)
                gv = tl.arange(0, GV)
                vs_base = vs_ptr + b * svsb + h * svsh
                vz_base = vz_ptr + b * svsb + h * svsh
                rv = tl.arange(0, GPV)
                if VALUE_FORMAT == 1:
                    if not LUT_MMA:
                        NL: tl.constexpr = 1 << VBITS
                        vtab = tl.broadcast_to(tl.load(vtab_ptr + tl.arange(0, NL))[None, :], (BLOCK_T, NL))
                if LUT_MMA and not INTERP:  # each lane's table entries for unpack_lut's shuffles, once per program
                    kent = lane_entry(ktab_ptr, KBITS)
                    vent = lane_entry(vtab_ptr, VBITS)
                else:
                    kent = 0
                    vent = 0
                kp_s, kp_z = _key_params(ks_base, kz_base, start, end, skst, KEY_FORMAT, GENERIC_K, GK, KEY_BLOCK, D,
                                         KBITS, BLOCK_T)
                vp_s, vp_z = _value_params(vs_base, vz_base, start, end, svst, VALUE_FORMAT, GV, BLOCK_T)
                krow0 = kc_ptr + b * skb + h * skh  # this (row, KV head)'s code rows
                vrow0 = vc_ptr + b * svb + h * svh
                if LUT_MMA and LUT_AHEAD:
                    # LUT_AHEAD: the lookup-table path loads each tile's code words (and key-pass terms) one iteration
                    # ahead into registers: Triton did not pipeline these loads (ncu, nuq4 at 32K x 8: 44% of the
                    # stall samples were waits on them)
                    ka0, ka1, ka2, kb0, kb1, kb2, va0, va1, va2, kx_n = _lut_tile_loads(
                        krow0, vrow0, start, end, skt, svt, KALIGN, VALIGN, D, KBITS, VBITS, BLOCK_T, sc_row, KCORR,
                        GPK, GPQ)
                for t0 in range(start, end, BLOCK_T):
                    t = t0 + tl.arange(0, BLOCK_T)
                    tm = t < end
                    # rows start on KALIGN-word boundaries (the host checked the strides): without the hint Triton
                    # assumes 16-word strides or nothing, and 2-/3-bit rows (8 / 12 words) were loaded 4 bytes at a time
                    kptr = krow0 + tl.multiple_of(t * skt, KALIGN)
                    if PREFETCH > 0 and not INTERP:  # the code rows of the tile PREFETCH tiles ahead into L2
                        tp = t0 + PREFETCH * BLOCK_T  # rows are contiguous (the host checked): one range each
                        nrow = tl.minimum(end - tp, BLOCK_T)
                        _prefetch_l2(krow0 + tp * skt, nrow * KROW)
                        _prefetch_l2(vrow0 + tp * svt, nrow * VROW)
                    ks_cur, kz_cur, vs_cur, vz_cur = kp_s, kp_z, vp_s, vp_z
                    kp_s, kp_z = _key_params(ks_base, kz_base, t0 + BLOCK_T, end, skst, KEY_FORMAT, GENERIC_K, GK,
                                             KEY_BLOCK, D, KBITS, BLOCK_T)
                    vp_s, vp_z = _value_params(vs_base, vz_base, t0 + BLOCK_T, end, svst, VALUE_FORMAT, GV, BLOCK_T)
                    # ---- scores [BLOCK_T, GPK], log2 domain
                    if LUT_MMA:
                        # table values straight into fp16 operands (unpack_lut_words), scaled, shifted and rotated in
                        # fp16 pairs (_dequant_rotate)
                        if LUT_AHEAD:  # this tile's loads came last iteration; issue the next tile's
                            kw = (ka0, ka1, ka2, kb0, kb1, kb2, va0, va1, va2, kx_n)
                            ka0, ka1, ka2, kb0, kb1, kb2, va0, va1, va2, kx_n = _lut_tile_loads(
                                krow0, vrow0, t0 + BLOCK_T, end, skt, svt, KALIGN, VALIGN, D, KBITS, VBITS, BLOCK_T,
                                sc_row, KCORR, GPK, GPQ)
                        else:
                            kw = _lut_tile_loads(krow0, vrow0, t0, end, skt, svt, KALIGN, VALIGN, D, KBITS, VBITS,
                                                 BLOCK_T, sc_row, KCORR, GPK, GPQ)
                        if ROPE == 1:
                            p0 = pos_offset + t0
                            ra, rb = _rotate_query(q1, q2, cos_ptr, sin_ptr, p0, kch, D)
                        else:
                            ra = q1
                            rb = q2
                        qa = _opnd(ra, PREC)
                        qb = _opnd(rb, PREC)
                        t1 = unpack_lut_words(kw[0], kw[1], kw[2], HD, KBITS, BLOCK_T, ktab_ptr, kent, INTERP)
                        t2 = unpack_lut_words(kw[3], kw[4], kw[5], HD, KBITS, BLOCK_T, ktab_ptr, kent, INTERP)
                        ka, kb = _dequant_rotate(t1, t2, kscl1, kzer1, kscl2, kzer2, cj, sj, ROPE, INTERP)
                        s = _dot(_mma_operand(ka, PREC, INTERP), qa, INTERP) + _dot(_mma_operand(kb, PREC, INTERP), qb,
                                                                                      INTERP)
                        if KCORR:  # the key residuals' score terms (attention_outliers' key pass)
                            s += kw[9]
                        s = s * qk_scale
                    elif GENERIC_K:
                        # dequantized in float32 as the reference does, rotated in ACC (float64 for float64)
                        k1 = _key_half(kptr, tm, t, 0, HD, KBITS, BLOCK_T, KEY_FORMAT, ks_base, kz_base, skst, GS,
                                       KEY_BLOCK, ktab_ptr, kscl1, kzer1)
                        k2 = _key_half(kptr, tm, t, HD, HD, KBITS, BLOCK_T, KEY_FORMAT, ks_base, kz_base, skst, GS,
                                       KEY_BLOCK, ktab_ptr, kscl2, kzer2)
                        if KCAP > 0:  # float32 / float64: residuals added to the tile, as the reference does
                            k1 = _add_residuals(k1, koi_ptr + ko, kov_ptr + ko, t * skot, tm, h * D, HD, KCAP)
                            k2 = _add_residuals(k2, koi_ptr + ko, kov_ptr + ko, t * skot, tm, h * D + HD, HD,
                                                KCAP)
                        k1 = k1.to(ACC)
                        k2 = k2.to(ACC)
                        if ROPE == 1:
                            p0 = pos_offset + t0
                            ra, rb = _rotate_query(q1, q2, cos_ptr, sin_ptr, p0, hh, D)
                            qa = _opnd(ra, PREC)
                            qb = _opnd(rb, PREC)
                            ka = k1 * cj - k2 * sj  # R(j) k
                            kb = k2 * cj + k1 * sj
                        elif ROPE == 2:
                            pos = (pos_offset + t)[:, None] * D
                            ca = tl.load(cos_ptr + pos + hh[None, :], mask=tm[:, None], other=1.0)
                            sa = tl.load(sin_ptr + pos + hh[None, :], mask=tm[:, None], other=0.0)
                            cb = tl.load(cos_ptr + pos + HD + hh[None, :], mask=tm[:, None], other=1.0)
                            sb = tl.load(sin_ptr + pos + HD + hh[None, :], mask=tm[:, None], other=0.0)
                            ka = k1 * ca - k2 * sa
                            kb = k2 * cb + k1 * sb
                        else:
                            ka = k1
                            kb = k2
                        s = _dot(_opnd(ka, PREC), qa, INTERP) + _dot(_opnd(kb, PREC), qb, INTERP)
                        if KCORR:
                            rows, rows_ok = _pass_rows(sc_row, t, tm, GPK, GPQ)
                            s += tl.load(rows, mask=rows_ok, other=0.0)
                        s = s * qk_scale
                    elif KEY_FORMAT == 0:
                        kcodes = _mma_operand(unpack_mma(kptr, tm, 0, D, D, KBITS, BLOCK_T), PREC, INTERP)
                        raw = tl.reshape(_dot(kcodes, qg, INTERP), (BLOCK_T, GPK, GK))
                        kscale = ks_cur.to(ACC) * (qk_scale * 16777216.0)  # codes are c * 2^-24
                        kzero = kz_cur.to(ACC) * qk_scale
                        s = tl.sum(kscale[:, None, :] * raw + kzero[:, None, :] * sq[None, :, :], 2)
                    else:  # affine_tokens, the tile inside one block (the host sizes it): q.k = (q * s_blk) . c + q . z_blk
                        qs = _opnd(qf * (ks_cur.to(ACC) * kinv)[:, None], PREC)  # [D, GPK]
                        zq = tl.sum(qf * kz_cur.to(ACC)[:, None], 0)  # [GPK]
                        kcodes = _mma_operand(unpack_mma(kptr, tm, 0, D, D, KBITS, BLOCK_T), PREC, INTERP)
                        s = (_dot(kcodes, qs, INTERP) * 16777216.0 + zq[None, :]) * qk_scale
                    s = tl.where(tm[:, None], s, float("-inf"))
                    if SAVE_S:  # for attention_outliers' value pass (over the key pass's terms: same elements)
                        rows, rows_ok = _pass_rows(sc_row, t, tm, GPK, GPQ)
                        tl.store(rows, s, mask=rows_ok)
                    # ---- online softmax (fp32)
                    m_new = tl.maximum(m_i, tl.max(s, 0))
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.where(rk < G, tl.exp2(m_i - m_use), 0.0)
                    p = tl.where((rk < G)[None, :], tl.exp2(s - m_use[None, :]), 0.0)
                    l_i = l_i * alpha + tl.sum(p, 0)
                    m_i = m_new
                    pr = _regroup(p, GPK, GPV, BLOCK_T)  # [BLOCK_T, GPV]
                    ar = tl.reshape(_regroup(alpha[None, :], GPK, GPV, 1), (GPV,))
                    # ---- values: acc^T [D, MV] += codes^T [D, BLOCK_T] x (p * scale) [BLOCK_T, MV]
                    vptr = vc_ptr + tl.multiple_of(b * svb + h * svh + t * svt, VALIGN)
                    if VALUE_FORMAT == 0:
                        vscale = vs_cur.to(ACC)  # [T, GV]
                        vzero = vz_cur.to(ACC)
                        pw = _opnd(tl.reshape(pr[:, :, None] * vscale[:, None, :], (BLOCK_T, MV)), PREC)
                        pz = tl.reshape(tl.sum(pr[:, :, None] * vzero[:, None, :], 0), (MV,))
                        arow = tl.reshape(tl.broadcast_to(ar[:, None], (GPV, GV)), (MV,))
                        vcodes = _mma_operand(unpack_mma(vptr, tm, 0, D, D, VBITS, BLOCK_T), PREC, INTERP)
                        acc = acc * arow[None, :] + _dot(tl.trans(vcodes), pw, INTERP)
                        corr = corr * arow + pz
                    else:
                        if LUT_MMA:  # fp16 table values in mma_channels order
                            vt = unpack_lut_words(kw[6], kw[7], kw[8], D, VBITS, BLOCK_T, vtab_ptr, vent, INTERP)
                        else:
                            vt = tl.gather(vtab, unpack_tile(vptr, tm, 0, D, D, VBITS, BLOCK_T).to(tl.int32), 1)
                        vsc = tl.maximum(vs_cur.to(tl.float32), 1e-8)  # as dequantize_lut_dynamic floors it
                        if PREC == 64 or VCAP > 0:  # float64, or float32 with residuals: dequantize in float32 as
                            # the reference does (T[c] s rounds), then add the residuals
                            vdq = vt * vsc[:, None] + vz_cur.to(tl.float32)[:, None]
                            if VCAP > 0:
                                vdq = _add_residuals(vdq, voi_ptr + vo, vov_ptr + vo, t * svot, tm, h * D, D, VCAP)
                            acc = acc * ar[None, :] + _dot(tl.trans(vdq.to(ACC)), pr, INTERP)
                        else:
                            pw = _opnd(pr * vsc[:, None], PREC)
                            if LUT_MMA:
                                vop = tl.trans(_mma_operand(vt, PREC, INTERP))
                            else:
                                vop = tl.trans(_opnd(vt, PREC))
                            acc = acc * ar[None, :] + _dot(vop, pw, INTERP)
                            corr = corr * ar + tl.sum(pr * vz_cur.to(ACC)[:, None], 0)
                if VALUE_FORMAT == 0:
                    # [D, MV], rows in vch order; codes were c * f * 2^-24
                    out = acc * (16777216.0 / mma_code_scale(D, VBITS).to(ACC))[:, None] + corr[None, :]
                else:
                    out = acc + corr[None, :]
                if GV > 1:  # columns (head, value group) -> heads: each channel from its group's column
                    sel = (vch // (D // GV))[:, None, None] == gv[None, None, :]
                    out = tl.sum(tl.where(sel, tl.reshape(out, (D, GPV, GV)), 0.0), 2)
                tl.store(acc_ptr + (part * G + rv)[None, :] * D + vch[:, None], out, mask=(rv < G)[None, :])
                tl.store(m_ptr + part * G + rk, m_i, mask=rk < G)
                tl.store(l_ptr + part * G + rk, l_i, mask=rk < G)
        if HAS_FP:
            if split == NSPLIT:  # the full-precision segment (sinks, window, residual), post-RoPE
                _fp_segment(q_row, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, 0, F, b, h, part, m_ptr, l_ptr,
                            acc_ptr, qk_scale, D, G, GPF, BLOCK_F, INTERP)

    @triton.jit
    def _reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, vo_ptr, G: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                       D: tl.constexpr, VO_GP: tl.constexpr, VO_UNIT: tl.constexpr, SC: tl.constexpr,
                       DC: tl.constexpr):
        """Merge the S partials (max, sum, acc) of one query head for DC of its channels, SC partials at a time (each
        of a head's D / DC programs reads all S maxima and sums itself, S floats each; all S at once over 128
        channels spilled at batch 1: 265 partials took 168 bytes of stack per thread, and with the value sums a
        launch failed with "out of memory" in kvcal bench generate). VO_GP > 0: add the value-outlier
        sums vo_ptr [row and KV head, S, D, VO_GP] (attention_outliers' value pass: float32, or int64 fixed point
        in units of VO_UNIT) to each acc."""
        pid = tl.program_id(0)  # = (b * Hkv + h) * G + g = b * Hq + h * G + g
        dc = tl.program_id(1)  # channels [dc DC, (dc + 1) DC) of the head
        bh = pid // G
        g = pid % G
        s = tl.arange(0, SP)
        sm = s < S
        row = (bh * S + s) * G + g
        m = tl.load(m_ptr + row, mask=sm, other=float("-inf"))
        lsum = tl.load(l_ptr + row, mask=sm, other=0.0)
        mx = tl.max(m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.sum(tl.exp2(m - mx) * lsum, 0)
        dd = dc * DC + tl.arange(0, DC)
        o = tl.zeros((DC,), acc_ptr.dtype.element_ty)
        for s0 in range(0, S, SC):  # a loop, not unrolled: unrolled, the loads of every step were live at once
            sc = s0 + tl.arange(0, SC)
            scm = sc < S
            rc = (bh * S + sc) * G + g
            wc = tl.exp2(tl.load(m_ptr + rc, mask=scm, other=float("-inf")) - mx)
            acc = tl.load(acc_ptr + rc[:, None] * D + dd[None, :], mask=scm[:, None], other=0.0)
            if VO_GP > 0:
                vo = tl.load(vo_ptr + ((bh * S + sc)[:, None] * D + dd[None, :]) * VO_GP + g, mask=scm[:, None],
                             other=0)
                if vo_ptr.dtype.element_ty == tl.int64:  # fixed point (attention_outliers.FIXED_BITS)
                    vo = vo.to(tl.float32) * VO_UNIT
                acc += vo
            o += tl.sum(wc[:, None] * acc, 0)
        o = o / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + pid * D + dd, o.to(out_ptr.dtype.element_ty))


_SM_COUNT: dict = {}


_SM90: dict = {}


def _reduce(m_part, l_part, acc_part, out, vsums, group: int, splits: int, d: int, vo_gp: int, warps: int,
            vo_bits: int = 0):
    """Launch _reduce_kernel: one program per (row, query head, REDUCE_CHANNELS channels); int64 value sums hold
    multiples of 2^-vo_bits."""
    dc = min(d, REDUCE_CHANNELS)
    chunk = min(_pow2(splits), max(1, REDUCE_CHUNK * warps // 4))  # the same registers per thread at any warps
    _reduce_kernel[(out.shape[0] * out.shape[1], d // dc)](m_part, l_part, acc_part, out, vsums, group, splits,
                                                           _pow2(splits), d, vo_gp, 2.0**-vo_bits, chunk, dc,
                                                           num_warps=warps)


def _sm90_or_newer(device) -> bool:
    """Whether the device is sm_90 or newer, as cp.async.bulk.prefetch.L2 and griddepcontrol (programmatic dependent
    launch) need (and a real GPU: the interpreter has no inline asm).
    Looked up once per device: this runs on every decode-attention call."""
    if device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM90:
        _SM90[key] = torch.cuda.get_device_capability(key)[0] >= 9
    return _SM90[key]


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


_DUMMIES: dict = {}


def _dummies(dev):
    """Placeholder tensors for a format's absent arguments, made once per device (no per-call launches)."""
    if dev not in _DUMMIES:
        _DUMMIES[dev] = (torch.zeros(1, dtype=torch.float32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev))
    return _DUMMIES[dev]


def _fallback(reason: str, *args):
    # Python's default warning filter shows each distinct message once; tests turn it into an error
    warnings.warn(f"decode_attention_triton: {reason}; using the torch reference", stacklevel=3)
    return decode_attention_ref(*args)


def _unsupported(q, kv: PackedKV | None, fp_k) -> str | None:
    if triton is None:
        return "triton is not installed"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"query dtype {q.dtype} (fp16, bf16, fp32 and fp64 are supported)"
    d = q.shape[-1]
    if d < 32 or d & (d - 1):
        return f"head_dim {d} (a power of two >= 32 is supported)"
    if kv is None:
        return None
    if kv.key_bits not in _UNPACK_BITS or kv.value_bits not in _UNPACK_BITS:
        return f"bits {kv.key_bits}/{kv.value_bits} (supported: {_UNPACK_BITS})"
    generic = kv.key_format == "lut_static" or kv.rope_cos is not None
    if generic and d < 64:
        return "generic key path needs head_dim >= 64"
    if kv.key_format == "affine_channels":
        gk = kv.k_scale.shape[-1]
        if gk & (gk - 1) or d % gk:
            return f"{gk} key groups"
    if kv.value_format == "affine_channels":
        gv = kv.v_scale.shape[-1]
        if gv & (gv - 1) or d % gv:
            return f"{gv} value groups"
    return None


def _word_alignment(codes: torch.Tensor, strides) -> int:
    """Largest of 4, 2, 1 words that divides every row start of `codes` (its (batch, head, token) strides and
    its address): the kernel's hint for 16-byte loads."""
    align = 4
    while align > 1 and (any(s % align for s in strides) or codes.data_ptr() % (4 * align)):
        align //= 2
    return align


def _same_layout(a: torch.Tensor, b: torch.Tensor):
    if a.stride() == b.stride():
        return a, b
    return a.contiguous(), b.contiguous()


def _outlier_args(idx, val, capacity: int, dev):
    """(index tensor, residual tensor, (row, token, head) strides) of a sparse-outlier store ([B, T, H, cap]
    per head, or [B, T, cap] per token: head stride 0), placeholders without one."""
    if not capacity:
        dummy, dummy_i = _dummies(dev)
        return dummy_i, dummy, (0, 0, 0)
    idx, val = _same_layout(idx, val)
    return idx, val, (*idx.stride()[:2], idx.stride(2) if idx.dim() == 4 else 0)


def _fp_args(fp_k, fp_v, fp_valid, has_fp: bool, dev):
    """(keys, values, valid mask as uint8, (row, head, token) strides, mask row stride) of the full-precision
    segment, placeholders without one."""
    if not has_fp:
        dummy, dummy_i = _dummies(dev)
        return dummy, dummy, dummy_i, (0, 0, 0), 0
    fk, fv = fp_k, fp_v
    if fk.stride() != fv.stride() or fk.stride(-1) != 1:
        fk, fv = fk.contiguous(), fv.contiguous()
    fval = fp_valid.to(torch.bool).contiguous().view(torch.uint8)
    return fk, fv, fval, fk.stride()[:3], fval.stride(0)


def _frag_applies(q, kv: PackedKV, group: int) -> bool:
    """Whether attention_frag's kernel takes this call: rtn-style int caches (affine keys and values, one fp16
    (scale, zero) per token and KV head, post-RoPE keys), fp16/bf16 queries, a GQA group of at most 8 heads, and
    scale rows with token stride 1."""
    if kv.key_format != "affine_channels" or kv.value_format != "affine_channels" or kv.rope_cos is not None:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or group > 8:
        return False
    if not frag_supported(q.shape[-1], kv.key_bits, kv.value_bits):
        return False
    for t in (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero):
        if t.dtype != torch.float16 or t.dim() != 4 or t.shape[-1] != 1 or t.stride(2) != 1:
            return False
    return kv.k_codes.stride(-1) == 1 and kv.v_codes.stride(-1) == 1


def _decode_frag(q, kv: PackedKV, fp_k, fp_v, fp_valid, scale: float, hkv: int, group: int, num_splits: int | None,
                 programs_per_sm: int, block_f: int | None, max_registers: int | None = None,
                 frag_vector: bool | None = None):
    """decode_attention_triton through attention_frag's register-fragment kernel (one warp per program)."""
    batch, hq, d = q.shape
    dev = q.device
    tcap = kv.k_codes.shape[2]
    # one wave: at most `programs_per_sm` programs per SM (FRAG_OCCUPANCY: 12 at 4 bits under a 168-register cap, 16
    # at 2 bits under 128), rounded down, since a second partial wave costs a whole program's time
    default_programs, default_registers = FRAG_OCCUPANCY[max(kv.key_bits, kv.value_bits)]
    max_registers = max_registers or default_registers
    nsplit = num_splits or max(1, min((programs_per_sm or default_programs) * _sm_count(dev) // (batch * hkv),
                                      triton.cdiv(tcap, 4 * FRAG_BLOCK_T)))
    nf = fp_k.shape[2] if fp_k is not None else 0
    has_fp = nf > 0
    fsplit = triton.cdiv(nf, FRAG_FP_CHUNK) if has_fp else 0
    splits = nsplit + fsplit
    m_part = torch.empty(batch * hkv, splits, group, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(batch * hkv, splits, group, d, dtype=torch.float32, device=dev)
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=dev)
    kc, vc = kv.k_codes, kv.v_codes
    ks, kz = _same_layout(kv.k_scale, kv.k_zero)
    vs, vz = _same_layout(kv.v_scale, kv.v_zero)
    fk, fv, fval, f_strides, sfvb = _fp_args(fp_k, fp_v, fp_valid, has_fp, dev)
    kc_strides, vc_strides = kc.stride()[:3], vc.stride()[:3]
    # vector loads: each lane's words of a row start 16 (keys) / 4 NWV (values) bytes apart; the row starts and the
    # base must keep that alignment
    kvec, vvec = min(4, d * kv.key_bits // 128), min(4, d * kv.value_bits // 256)
    vec_ok = _word_alignment(kc, kc_strides) >= kvec and _word_alignment(vc, vc_strides) >= vvec
    vec = vec_ok if frag_vector is None else bool(frag_vector) and vec_ok
    # tiles start at multiples of FRAG_BLOCK_T: buffers of whole tiles let the kernel clamp tiles, not rows, and load
    # per-token scales without masks (from scale buffers at least as long)
    row_clamp = tcap % FRAG_BLOCK_T != 0 or tcap == 0 or min(ks.shape[2], vs.shape[2]) < tcap
    # a lane's four tokens of a tile are adjacent: their scales are one 8-byte load per parameter where every scale
    # row starts 8-byte aligned
    scale_words = (not row_clamp
                   and all(t.data_ptr() % 8 == 0 and t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0
                           for t in (ks, kz, vs, vz)))
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    # programmatic dependent launch (sm_90; griddepcontrol does not assemble for older targets): the window's
    # programs start in the slots of fragment programs that finish early instead of after the whole kernel; they
    # read only what was ready before it (launching the reduction the same way gained nothing measurable: 123.8
    # against 123.1-123.3 us)
    pdl = bool(FRAG_OVERLAP_FP and has_fp and not interp and _sm90_or_newer(dev))
    with launch_device(q):
        _frag_decode_kernel[(batch * hkv, nsplit)](
            q, q.stride(0), q.stride(1), kv.lengths.to(device=dev, dtype=torch.int32),
            kc, *kc_strides, ks, kz, *ks.stride()[:2],
            vc, *vc_strides, vs, vz, *vs.stride()[:2],
            m_part, l_part, acc_part, hkv, float(scale) * LOG2E, splits, max(tcap - FRAG_BLOCK_T, 0),
            D=d, G=group, KBITS=kv.key_bits, VBITS=kv.value_bits, INTERP=interp, BLOCK_T=FRAG_BLOCK_T,
            VEC=int(vec), ROW_CLAMP=int(row_clamp), SCALE_WORDS=int(scale_words), PDL=int(pdl), num_warps=1,
            **({"maxnreg": int(max_registers)} if max_registers else {}),
        )
        if has_fp:
            _fp_kernel[(batch * hkv, fsplit)](q, q.stride(0), q.stride(1), fk, fv, *f_strides, fval, sfvb, nf, m_part,
                                              l_part, acc_part, hkv, float(scale) * LOG2E, splits, FRAG_FP_CHUNK, D=d,
                                              G=group, GPF=max(_pow2(group), 16), BLOCK_F=block_f or 16,
                                              INTERP=interp, WAIT_PRIOR=int(pdl), num_warps=1,
                                              **({"launch_pdl": True} if pdl else {}))
        _reduce(m_part, l_part, acc_part, out, m_part, group, splits, d, 0, FRAG_REDUCE_WARPS)
    return out


def decode_attention_triton(q, kv: PackedKV | None, fp_k, fp_v, fp_valid, scale: float, *, block_t: int | None = None,
                            num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                            rope_mode: str | None = None, generic_keys: bool = False, programs_per_sm: int | None = None,
                            block_f: int | None = None, max_registers: int | None = None,
                            prefetch: int | None = None, lut_mma: bool | None = None, lut_ahead: bool | None = None,
                            frag: bool | None = None, frag_vector: bool | None = None):
    """Triton version of decode_attention_ref (same arguments and result). Keyword-only tuning knobs:
    block_t (tokens per tile; KIVI: at most 32, inside one key block), num_splits (token splits per row; default from programs_per_sm x SMs, programs_per_sm 16 for the tile kernel
    and, for the fragment kernel, whose splits fill exactly one wave, FRAG_OCCUPANCY's: 12 at 4 bits, 16 at 2 bits),
    num_warps, num_stages, max_registers, block_f (fp-segment tile), rope_mode ('angle' | 'table'; default
    'angle', 'table' for float32 and float64 inputs: angle addition rotates by fl(p0 t) + fl(j t) instead of the table's
    fl((p0 + j) t): with Llama-3.1's frequencies up to 2e-3 rad apart below 32K positions and 8e-3 below 128K,
    far below a 4-bit key's quantization error, not below float32 rounding),
    generic_keys (force the elementwise key path, for tests), prefetch (tiles ahead whose code rows are
    prefetched into L2 on sm_90+; 0 = off; default per path), lut_mma (lookup-table codes of up to 4 bits with
    fp16/bf16 queries: table values straight into fp16 dot operands and fp16-pair key dequantization and rotation;
    default on where it applies, False: the float32 generic path), lut_ahead (lut_mma: load each tile's code words
    and key-pass terms one iteration ahead into registers; default on), frag (int caches with one scale per token and head: the
    register-fragment kernel of attention_frag; default on where it applies, from FRAG_MIN_ROWS (row, KV head)
    pairs and when no tile-kernel knob (block_t, num_warps, num_stages, prefetch, generic_keys) is given;
    False: the tile kernel), frag_vector (the fragment kernel loads each lane's code words with one vector load;
    default on where the rows are aligned for it, False: one load per word).
    Sparse outliers (KVQuant caches) run as passes around the kernel (attention_outliers) for fp16 and bf16 inputs,
    the value pass with float32 atomics (run-dependent order: repeated decodes can differ in their last bits) or,
    while torch.use_deterministic_algorithms(True) is on, int64 fixed-point ones (the same bits every run; slower);
    for float32 and float64 inputs the kernel adds them to the dequantized tiles as the reference does (slower, and
    without atomics)."""
    args = (q, kv, fp_k, fp_v, fp_valid, scale)
    reason = _unsupported(q, kv, fp_k)
    if reason:
        return _fallback(reason, *args)
    batch, hq, d = q.shape
    hkv = fp_k.shape[1] if kv is None else kv.num_kv_heads
    group = hq // hkv
    dev = q.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    has_packed = kv is not None and kv.k_codes.shape[2] > 0
    nf = fp_k.shape[2] if fp_k is not None else 0
    has_fp = nf > 0
    dummy, dummy_i = _dummies(dev)
    gp = _pow2(group)
    # ---- packed segment
    use_lut = False
    key_code = value_code = 0
    kbits = vbits = 4
    gk = gv = 1
    key_block = 1
    kcap = vcap = 0
    generic = rope = 0
    nsplit = 0
    pass_kcap = pass_vcap = 0
    bt = block_t or DEFAULTS["affine_channels"][0]
    default_warps = DEFAULTS["affine_channels"][1]
    path = "affine_channels"
    if has_packed:
        key_code, value_code = _KEY_CODE[kv.key_format], _VALUE_CODE[kv.value_format]
        kbits, vbits = kv.key_bits, kv.value_bits
        generic = int(generic_keys or key_code == 2 or kv.rope_cos is not None)
        if rope_mode is None:
            rope_mode = "table" if q.dtype in (torch.float32, torch.float64) else "angle"
        rope = 0 if kv.rope_cos is None else (2 if rope_mode == "table" else 1)
        gk = kv.k_scale.shape[-1] if key_code == 0 else 1
        gv = kv.v_scale.shape[-1] if value_code == 0 else 1
        key_block = max(1, int(kv.key_block))
        path = "generic" if generic else kv.key_format
        bt = block_t or DEFAULTS[path][0]
        default_warps = DEFAULTS[path][1]
        if key_code == 1 and not generic:
            if key_block % 16:
                generic = 1
                path = "generic"
                bt = block_t or DEFAULTS[path][0]
                default_warps = DEFAULTS[path][1]
            # a tile lies inside one key block (q is scaled once per tile) and holds at most 32 tokens: with 64
            # tokens on 4+ warps Triton 3.6 lowers the key dot (its B operand, q x the block's scales, is made
            # every tile) to wgmma, and that gives wrong sums or an illegal address on the H100; the same kernel
            # with DISABLE_MMA_V3=1 (mma.sync) and the int / nuq paths' 64 x 4 tiles are right
            # (benchmarks/NOTES-kernels.md). 32-token tiles never take wgmma and are also the fastest.
            bt = min(bt, 32)
            while key_block % bt:
                bt //= 2
        tcap = kv.k_codes.shape[2]
        if num_splits:
            nsplit = int(num_splits)
        else:
            target = (programs_per_sm or 16) * _sm_count(dev)
            nsplit = max(1, min(triton.cdiv(target, batch * hkv), triton.cdiv(tcap, 4 * bt)))
        if kv.k_out_idx is not None and key_code == 2:
            kcap = kv.k_out_idx.shape[-1]
        if kv.v_out_idx is not None and value_code == 1:
            vcap = kv.v_out_idx.shape[-1]
        # sparse outliers as passes around the kernel for fp16 / bf16. float32 and float64 add them in it, as the
        # reference does: the value pass's atomics add in a run-dependent order, and two float32 decodes of
        # smollm2-135m (2 x 512 tokens, H100) differed by up to 2.5% in perplexity (nuq2 0.15% and 2.66% from the
        # simulation; results/runtime/parity-cuda-float32-2x512-kvquant-passes*.json)
        if q.dtype not in (torch.float32, torch.float64):
            pass_kcap, pass_vcap, kcap, vcap = kcap, vcap, 0, 0
        lut_ok = (key_code == 2 and value_code == 1 and rope in (0, 1) and q.dtype in (torch.float16, torch.bfloat16)
                  and max(kbits, vbits) <= 4)
        use_lut = lut_ok if lut_mma is None else bool(lut_mma) and lut_ok
        if use_lut:
            path = "lut"
            bt = block_t or DEFAULTS[path][0]
            default_warps = DEFAULTS[path][1]
    # the fragment kernel by default from FRAG_MIN_ROWS (row, KV head) pairs: with fewer, each split is short and
    # its fixed per-program cost shows (H100, batch 1, 8 KV heads: 26.4 vs 19.5 us at 4K, 43.4 vs 34.5 at 32K;
    # batch 8 and 32: faster or equal, results/bench/decode-frag-h100.json)
    # (and not when a tile-kernel knob is given: those ask for the tile kernel)
    tile_knobs = any(x is not None for x in (block_t, num_warps, num_stages, prefetch)) or generic_keys
    want_frag = frag if frag is not None else batch * hkv >= FRAG_MIN_ROWS and not tile_knobs
    if has_packed and want_frag and _frag_applies(q, kv, group):
        return _decode_frag(q, kv, fp_k, fp_v, fp_valid, scale, hkv, group, nsplit if num_splits else None,
                            programs_per_sm, block_f, max_registers, frag_vector)
    if q.dtype == torch.float64 and num_warps is None and block_t is None:
        # the float64 dot is a broadcast product: keep its [M, K, N] block small (4 warps; 16-token tiles
        # except on the generic path, where Triton 3.6 fails to compile 2-bit tables at 16 tokens)
        default_warps = 4
        if not generic:
            bt = 16
            while key_code == 1 and key_block % bt and bt > 1:
                bt //= 2
    # wgmma (4 warps, BLOCK_T >= 64) wants dots of >= 16 columns; mma.sync pads N itself, so with fewer
    # warps the heads are padded only to a power of two (less softmax work on padding)
    wide = (num_warps or default_warps) >= 4 and bt >= 64
    if generic:  # padded only for wgmma: 16 columns cost nuq4 1897 us at 32K x 8, 4 (mma.sync) 1473 us
        gpk = max(gp, 16) if wide else gp
    else:
        gpk = max(gp, 16 // gk) if wide else gp
    gpv = max(gp, 16 // gv) if wide else gp
    gpf = max(gp, 16)
    splits = nsplit + int(has_fp)
    if splits == 0:
        return torch.zeros_like(q)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # softmax state, partials
    m_part = torch.empty(batch * hkv, splits, group, dtype=acc_dtype, device=dev)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(batch * hkv, splits, group, d, dtype=acc_dtype, device=dev)
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=dev)
    # ---- arguments (placeholders where a format has no such tensor)
    if has_packed:
        lengths = kv.lengths.to(device=dev, dtype=torch.int32)
        kc, vc = kv.k_codes, kv.v_codes
        if kc.stride(-1) != 1:
            kc = kc.contiguous()
        if vc.stride(-1) != 1:
            vc = vc.contiguous()
        if key_code == 2:
            ks, kz = kv.k_scale.float().contiguous(), kv.k_zero.float().contiguous()
            ks_strides = (0, 0, 0)
        else:
            ks, kz = _same_layout(kv.k_scale, kv.k_zero)
            ks_strides = ks.stride()[:3]
        ktab = kv.k_table.float().contiguous() if kv.k_table is not None else dummy
        koi, kov, ko_strides = _outlier_args(kv.k_out_idx, kv.k_out_val, kcap, dev)
        vs, vz = _same_layout(kv.v_scale, kv.v_zero)
        per_token = value_code == 1 and vs.dim() == 2  # lut_dynamic per token over all heads: head stride 0
        vs_strides = (vs.stride(0), 0, vs.stride(1)) if per_token else vs.stride()[:3]
        vtab = kv.v_table.float().contiguous() if kv.v_table is not None else dummy
        voi, vov, vo_strides = _outlier_args(kv.v_out_idx, kv.v_out_val, vcap, dev)
        if rope:
            cos, sin = kv.rope_cos.float().contiguous(), kv.rope_sin.float().contiguous()
            tmax = cos.shape[0]
        else:
            cos = sin = dummy
            tmax = 0
        kc_strides, vc_strides = kc.stride()[:3], vc.stride()[:3]
        pos_offset = int(kv.pos_offset)
    else:
        lengths = dummy_i
        kc = vc = dummy_i
        ks = kz = vs = vz = ktab = vtab = cos = sin = kov = vov = dummy
        koi = voi = dummy_i
        ks_strides = vs_strides = kc_strides = vc_strides = (0, 0, 0)
        ko_strides = vo_strides = (0, 0, 0)
        tmax = pos_offset = 0
    fk, fv, fval, f_strides, sfvb = _fp_args(fp_k, fp_v, fp_valid, has_fp, dev)
    warps = num_warps or default_warps
    if generic and warps > 4:  # Triton 3.6 asserts in OptimizeThreadLocality on tl.gather with 8 warps
        warps = 4
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
    # L2 prefetch of code tiles (bulk prefetch: sm_90+, a tile's rows contiguous, 16-byte aligned, a multiple
    # of 16 bytes each)
    krow = vrow = prefetch_tiles = 0
    kalign, valign = _word_alignment(kc, kc_strides), _word_alignment(vc, vc_strides)  # 16-byte rows: 4 words
    if has_packed:
        krow, vrow = 4 * kc.shape[-1], 4 * vc.shape[-1]
        can = (_sm90_or_newer(dev) and krow % 16 == 0 and vrow % 16 == 0
               and kc_strides[2] == kc.shape[-1] and vc_strides[2] == vc.shape[-1] and kalign == 4 and valign == 4)
        prefetch_tiles = (PREFETCH_DEFAULTS[path] if prefetch is None else int(prefetch)) if can else 0
    qk_hi = struct.unpack("f", struct.pack("f", float(scale) * LOG2E))[0]  # float32 part; the rest as qk_lo
    with launch_device(q):
        if pass_kcap or pass_vcap:  # [row and KV head, token, head of the group]: key-residual terms, then scores
            scores = torch.empty(batch * hkv, kv.k_codes.shape[2], gp, dtype=torch.float32, device=dev)
            if pass_kcap:
                key_outlier_scores_triton(q, kv.k_out_idx, kv.k_out_val, lengths, kv.rope_cos, kv.rope_sin,
                                          pos_offset, scores, kv.rope_inv_freq)
        else:
            scores = dummy
        _decode_kernel[(batch * hkv, splits)](
            q, q.stride(0), q.stride(1), lengths,
            kc, *kc_strides, ks, kz, *ks_strides, ktab, koi, kov, *ko_strides,
            vc, *vc_strides, vs, vz, *vs_strides, vtab, voi, vov, *vo_strides,
            cos, sin, pos_offset, tmax,
            fk, fv, *f_strides, fval, sfvb, nf,
            m_part, l_part, acc_part, hkv, qk_hi, float(scale) * LOG2E - qk_hi, nsplit, scores, scores.stride(0),
            D=d, G=group, GPK=gpk, GK=gk, GPV=gpv, GV=gv, GPF=gpf, GPQ=gp, KALIGN=kalign, VALIGN=valign,
            KEY_FORMAT=key_code, KBITS=kbits, KEY_BLOCK=key_block, KCAP=kcap, GENERIC_K=generic, ROPE=rope,
            VALUE_FORMAT=value_code, VBITS=vbits, VCAP=vcap,
            HAS_PACKED=int(has_packed), HAS_FP=int(has_fp),
            BLOCK_T=bt, BLOCK_F=block_f or 16,  # small: the fp tiles' buffers count against every program
            INTERP=os.environ.get("TRITON_INTERPRET") == "1", PREC=_PREC.get(q.dtype, 16),
            PREFETCH=prefetch_tiles, KROW=krow, VROW=vrow, LUT_MMA=int(use_lut),
            LUT_AHEAD=int(use_lut and lut_ahead is not False), KCORR=int(pass_kcap > 0),
            SAVE_S=int(pass_vcap > 0), **opts,
        )
        vsums = m_part
        if pass_vcap:
            # float32 sums, or int64 fixed point (the same bits in any order) in torch's deterministic mode: nuq4 at
            # 32K x 8 took 517.3 / 519.7 us per call in fixed point against 447.1 / 440.6 (bf16, H100,
            # results/bench/value-pass-fixed-h100-s28.json), so only where asked for
            fixed = VALUE_PASS_FIXED or torch.are_deterministic_algorithms_enabled()
            vsums = torch.zeros(batch * hkv, splits, d, gp, dtype=torch.int64 if fixed else torch.float32, device=dev)
            fixed_bits = attention_outliers.fixed_point_bits(tcap)  # a split holds at most a row's tcap tokens
            value_outlier_sums_triton(scores, m_part, kv.v_out_idx, kv.v_out_val, lengths, nsplit, bt, vsums,
                                      fixed_bits)
        _reduce(m_part, l_part, acc_part, out, vsums, group, splits, d, gp if pass_vcap else 0, TILE_REDUCE_WARPS,
                fixed_bits if pass_vcap else 0)
    return out
