"""RTN's decode kernels: attention of one query per row over int-N per-token codes (one fp16 scale and zero per
token, KV head and group of channels), the torch reference being RtnStorage.attend_reference
(kvcal/methods/rtn/storage.py).

Two kernels, both writing softmax partials that runtime/kernels.merge_triton combines:

- the tile kernel: the split-K skeleton (runtime/kernels.split_k_kernel: program ids, split bounds, online
  softmax, the full-precision split, partial stores) with this module's `_tile_prepare` / `_tile_scores` and quant/
  uniform_kernels' token_group_tile_values / _finish; grid (B * Hkv, S): program (row b, KV head h, split s) handles
  all G = Hq/Hkv query heads of that KV head (GQA in-kernel, K/V read once per group), scales and zeros folded around
  tensor-core dots (token_group_scores, token_group_values).
- the fragment kernel (`_frag_decode_kernel`), for one group per head of 2 or 4 bits and fp16/bf16 queries, from
  FRAG_MIN_ROWS (row, KV head) pairs: codes unpacked straight into tensor-core fragments, no shared memory (below).

Launch defaults were chosen by measurement at 32K x batch 8 (docs/runtime.md).

The fragment kernel. The tile kernel unpacks a tile's codes in a blocked layout and Triton moves them through shared
memory into the `mma` operand layout: per byte of 4-bit codes read from HBM that is about 10 bytes of shared-memory
traffic (staging copy, unpacked fp16 stores, ldmatrix), and a profile showed the L1/shared pipe busier than DRAM.
Here every lane loads exactly the code bits that its own `mma.sync.m16n8k16` fragment registers need, so
unpacking is a mask per register (and a shift by 8 that two registers share).

Programming model: every tensor is one-dimensional with 32 elements, element i living in lane i of the program's
single warp (Triton gives a 32-element tensor one element per lane; `tl.static_range` and tuples hold a lane's
register arrays). Lane l = 4 g + c. The fragments of `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` (PTX ISA,
"Matrix Fragments for mma.m16n8k16"): A [16 x 16]: a0 = (row g, cols 2c, 2c + 1), a1 = (row g + 8, same cols),
a2 = (row g, cols 2c + 8, 2c + 9), a3 = (row g + 8, cols 2c + 8, 2c + 9); B [16 x 8]: b0 = (rows 2c, 2c + 1, col g),
b1 = (rows 2c + 8, 2c + 9, col g); C/D [16 x 8] fp32: (row g, cols 2c, 2c + 1), (row g + 8, cols 2c, 2c + 1).
The codes are always the A operand, so all 16 of its rows are real (the GQA group's heads, at most 8, are N):

* scores S^T [16 tokens, heads] = K Q^T: lane (g, c) holds rows g and g + 8 of the m-tile and, for each, the
  D / 4 channels of bytes [c D b / 32, (c + 1) D b / 32) of the token's code row, which are exactly its A registers
  of every k-block (the channel order of a dot's K axis is free: Q's B fragments are loaded in the same order,
  `key_channel`);
* P: the scores' C fragment (token g, heads 2c, 2c + 1), scaled by each token's value scale and packed to fp16, is
  transposed per 8 x 8 block in registers (`movmatrix`) into (head g, tokens 2c, 2c + 1), the B fragment of
* values O^T [16 channels, heads] += V^T [16 channels, 16 tokens] P^T: a0 / a2 pair two tokens (2c, 2c + 1 /
  2c + 8, 2c + 9) of one channel, so lane (g, c) reads D b / 8 bits of four token rows and interleaves them
  byte-wise (`prmt`); its channels are lane row g's chunk of D / 8 (`value_channel`).
* token order: the 16 rows of m-tile m of a 32-token tile are tokens whose order is free as long as keys, values and
  scales agree; row g + 8 h is token 4 g + 2 m + h (`_score_token`), so a lane's four tokens are adjacent.

A code n becomes an fp16 register half by masking it where it lies in its byte (code j of the byte at bits
[b j, b j + b)): the half is then the subnormal n 2^(b j - 24), which the tensor cores multiply exactly. For keys the
query is scaled by 2^-(b j) to match and 2^24 goes into the score scale; for values 2^(24 - b j) goes into the output
scale. Scores and softmax are float32; the query and P are fp16 operands, as in the tile kernel.
"""

from __future__ import annotations

from collections import namedtuple

import torch

from kvcal.errors import KvcalError
from kvcal.quant.packing import launch_device, pow2
from kvcal.quant.uniform_kernels import TOKEN_GROUP_CONSTS, token_groups_unsupported
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import Partials

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PREC = {torch.float32: 32, torch.float64: 64}  # rounded dot operands: fp16 for fp16 and bf16 queries
# tile kernel: (block_t, num_warps, num_stages, max registers): one-warp programs, every reduction stays in the warp
TILE_DEFAULTS = (32, 1, 2, 128)
# Tiles ahead whose code rows are prefetched into L2 (0: none), chosen by measurement at 32K x 8: one tile ahead is
# faster for int4; two or more thrash the L2 (16 programs per SM x 4 KB per tile x tiles ahead, over 132 SMs, against
# 50 MB)
PREFETCH_DEFAULT = 1
FRAG_MIN_ROWS = 64  # (row, KV head) pairs from which the fragment kernel is the default
# the fragment kernel: the full-precision part's launch overlaps its tail (sm_90 PDL); a switch for A/B timing
FRAG_OVERLAP_FP = True
# warps per program of the merge after the fragment kernel (1) and after the tile kernel (4), chosen by measurement
# at 32K x 8 and 4K x 32: after the fragment kernel, (fp chunk, warps) (16, 1) was faster than (32, 4) for int2 and int4
FRAG_MERGE_WARPS = 1
TILE_MERGE_WARPS = 4
FRAG_BITS = (2, 4)
FRAG_BLOCK_T = 32  # tokens per tile: 2 m-tiles of scores, 2 k-blocks of values
# One-warp programs per SM and the register cap that lets them fit in the SM's 64K registers, by the wider of the key
# and value widths. Without a cap ptxas (Triton 3.6, sm_90) gave 4-bit codes 204 registers once the tile's rows became
# one pointer plus uniform offsets (10 programs: a second wave, slower), 158 with the cap of 168 (faster); 2-bit codes
# took 128 uncapped, so 16 fit (faster than 12). The current kernel takes 150 / 116 under these caps. The register
# file is split among the SM's 4 schedulers (16K registers each), so the warps that fit are 4 floor(16384 / (32 r))
# for r registers rounded up to 8: 150 (152) -> 12, 116 (120) -> 16, not 13 and 17. A 13th int4 or 17th int2 program
# per SM forms a second wave, measurably slower at 32K x 8. More programs would need 128 registers at 4 bits (16) or
# 102 at 2 (20).
FRAG_OCCUPANCY = {4: (12, 168), 2: (16, 128)}


TileConsts = namedtuple("TileConsts", (*TOKEN_GROUP_CONSTS, "GK"))


def frag_supported(head_dim: int, key_bits: int, value_bits: int) -> bool:
    """Shapes the fragment kernel handles: D = 64 or 128; keys and values of 2 or 4 bits with at least 32 bits of a
    value row per lane (D b >= 256)."""
    return (head_dim in (64, 128) and key_bits in FRAG_BITS and value_bits in FRAG_BITS
            and head_dim * value_bits >= 256)


if triton is not None:
    from kvcal.quant.uniform_kernels import (
        token_group_query,
        token_group_scores,
        token_group_state,
        token_group_tile_finish,
        token_group_tile_values,
        token_params,
    )
    from kvcal.runtime.kernels import (
        byte_pair,
        halves,
        lane_words,
        launch_dependents,
        mma16816,
        pack_half2,
        prefetch_tiles,
        shfl_idx,
        shfl_xor,
        split_share_tl,
        transpose8,
    )

    # ---- the tile kernel: tile functions of runtime/kernels.split_k_kernel, values by quant/uniform_kernels'
    # token_group_tile_values / _finish (args, C and the state in their layout; C ends with GK)

    @triton.jit
    def _tile_prepare(args, C: tl.constexpr, q_row, sqh, b, h, pid, start, end, qk_scale):
        """The group's query as the key dot's operand and the first tile's key scales and zeros."""
        GK: tl.constexpr = C[15]
        ACC: tl.constexpr = tl.float64 if C[11] == 64 else tl.float32
        qg, sq = token_group_query(q_row, sqh, C[1], C[2], GK, C[0], C[7], C[11], ACC)
        kp_s, kp_z = token_params(args[4] + b * args[6] + h * args[7], args[5] + b * args[6] + h * args[7], start, end,
                                  args[8], GK, C[9])
        return token_group_state(args, C, (qg, sq), kp_s, kp_z, b, h, start, end)

    @triton.jit
    def _tile_scores(args, C: tl.constexpr, st, t0, t, tm, end, qk_scale):
        """Token-major scores [BLOCK_T, heads] = codes [BLOCK_T, D] x q^T [D, heads]: the big operand is the M side
        of the tensor-core dot. The next tile's scales and zeros are loaded here (a tile ahead)."""
        KALIGN: tl.constexpr = C[5]
        BLOCK_T: tl.constexpr = C[9]
        GK: tl.constexpr = C[15]
        skt = args[3]
        qk, ks_cur, kz_cur, vs_cur, vz_cur, krow0, vrow0, ks_base, kz_base, vs_base, vz_base, voff = st
        # rows start on KALIGN-word boundaries (the host checked the strides): without the hint Triton assumes
        # 16-word strides or nothing, and 2-/3-bit rows (8 / 12 words) were loaded 4 bytes at a time
        kptr = krow0 + tl.multiple_of(t * skt, KALIGN)
        prefetch_tiles(krow0, vrow0, t0, end, skt, args[12], C[12], BLOCK_T, C[13], C[14], C[10])
        kp_s, kp_z = token_params(ks_base, kz_base, t0 + BLOCK_T, end, args[8], GK, BLOCK_T)
        vp_s, vp_z = token_params(vs_base, vz_base, t0 + BLOCK_T, end, args[17], C[4], BLOCK_T)
        s = token_group_scores(kptr, tm, qk[0], qk[1], ks_cur, kz_cur, qk_scale, C[2], GK, C[0], C[7], BLOCK_T, C[11],
                               C[10], tl.float64 if C[11] == 64 else tl.float32)
        return s, (vs_cur, vz_cur), (qk, kp_s, kp_z, vp_s, vp_z, krow0, vrow0, ks_base, kz_base, vs_base, vz_base, voff)

    # ---- the fragment kernel: channel order of the fragments, loads, one tile

    @triton.jit
    def key_channel(c, r, e, D: tl.constexpr, BITS: tl.constexpr):
        """Channel held by half e of key register r of lane column c (k-block r // 2; a0 / a1 for even r, a2 / a3 for
        odd, of the token rows g / g + 8; likewise Q's b0 / b1): register r is the code pair (i, i + P) of word
        w = r // P of the lane's D / 4 channels, i = r % P, P = 16 / b."""
        P: tl.constexpr = 16 // BITS
        return c * (D // 4) + (r // P) * (32 // BITS) + (r % P) + e * P

    @triton.jit
    def value_channel(g, z, D: tl.constexpr):
        """Channel of chunk code z of lane row g (its chunk of D / 8 channels): row g (z even) or g + 8 (z odd) of the
        value dot's m-tile z // 2."""
        return g * (D // 8) + z

    @triton.jit
    def _key_register(words, r: tl.constexpr, BITS: tl.constexpr):
        """Key A register r: the code pair (i, i + P) of word r // P (P = 16 / b), masked where it lies in its byte:
        bits below 8 stay inside an fp16 mantissa, so the half is the subnormal n 2^(b j - 24) for code j of its byte.
        The word's upper bytes come down with one shift by 8 that their registers share, so a register costs one mask
        (shifting each pair down to bits [0, b) first takes 56 shifts per int2 tile against 8, 48 against 16 at int4).
        The query's B register r is
        scaled by 2^-(b j) to match (_query_register), so the product is q n 2^-24."""
        P: tl.constexpr = 16 // BITS
        i: tl.constexpr = r % P
        CPB: tl.constexpr = 8 // BITS
        MASKJ: tl.constexpr = (((1 << BITS) - 1) << (BITS * (i % CPB))) * 0x10001
        if i < CPB:
            return words[r // P] & MASKJ
        else:
            return (words[r // P] >> 8) & MASKJ

    @triton.jit
    def _query_register(reg, lo16, hi16, r: tl.constexpr, BITS: tl.constexpr, INTERP: tl.constexpr):
        """Query B register r (fp16 pair reg = (lo16, hi16)) scaled by 2^-(b j), j the place in its byte of the codes
        that key register r masks (_key_register). A power of two: exact but where the product falls below fp16's
        normal range (|q| < 2^(b j - 14)), where it keeps an absolute error of at most 2^(b j - 25)."""
        EXP: tl.constexpr = BITS * ((r % (16 // BITS)) % (8 // BITS))
        if EXP > 0:
            return pack_half2(lo16 * (1.0 / (1 << EXP)), hi16 * (1.0 / (1 << EXP)), INTERP)
        else:
            return reg

    @triton.jit
    def _score_token(g, j):
        """Token (from the tile's start) of lane row g's score row in 8-token block j (row g of m-tile j // 2 for even
        j, g + 8 for odd): 4 g + j, so a lane's four tokens are adjacent and each of their per-token parameters is one
        8-byte load. Any one-to-one map works as long as keys, values and scales agree (softmax and the value sum do
        not depend on the order of tokens); g + 8 j would take 16 two-byte loads per tile and 10 more registers."""
        return 4 * g + j

    @triton.jit
    def _value_token(c, kb, r: tl.constexpr):
        """Token of value register r of lane column c in k-block kb: the value dot's columns 2c, 2c + 1 (r = 0, 1) and
        2c + 8, 2c + 9 (r = 2, 3) are rows 2c + r % 2 + 8 (r // 2) of the scores' m-tile kb, which _score_token maps to
        4 (2c + r % 2) + 2 kb + r // 2."""
        return 8 * c + 4 * (r % 2) + 2 * kb + (r // 2)

    @triton.jit
    def _scale(sw, p: tl.constexpr, j: tl.constexpr, SCALE_WORDS: tl.constexpr):
        """Parameter p (0 key scale, 1 key zero, 2 value scale, 3 value zero) of the lane's token in block j, float32,
        from _tile_loads' `sw`: SCALE_WORDS, two words of fp16 pairs per parameter (tokens j = 0, 1 and 2, 3); else
        one fp16 per parameter and block."""
        if SCALE_WORDS:
            lo, hi = halves(sw[2 * p + j // 2])
            if j % 2 == 0:
                return lo
            else:
                return hi
        else:
            return sw[4 * j + p].to(tl.float32)

    @triton.jit
    def _tile_loads(krow0, vrow0, ks_base, kz_base, vs_base, vz_base, t0, end, tlast, skt: tl.constexpr,
                    svt: tl.constexpr, lane,
                    D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, VEC: tl.constexpr,
                    ROW_CLAMP: tl.constexpr, SCALE_WORDS: tl.constexpr, INTERP: tl.constexpr):
        """A tile's key words [8-token block][word], value words [k-block][row][word] and the per-token fp16 (scale,
        zero) of keys and values (as _scale reads them), for this lane. Rows past `end` are read but their scores are
        masked. ROW_CLAMP: each row index is clamped to the split's last row; else (the host checked that the code
        buffers hold whole tiles) only the tile's first row, to `tlast` (the buffers' last tile, reached by look-ahead
        loads past the end), so the rows are one pointer plus offsets that do not change from tile to tile."""
        g = lane // 4
        c = lane % 4
        NWK: tl.constexpr = D * KBITS // 128  # words of a key row per lane column
        NWV: tl.constexpr = D * VBITS // 256  # words of a value row per lane row
        last = tl.maximum(end - 1, 0)
        # without row clamps: one lane pointer per side and tile, rows reached by offsets uniform over the warp
        tbase = tl.minimum(t0, tlast)
        klane = krow0 + ((tbase + _score_token(g, 0)) * skt + c * NWK)
        vlane = vrow0 + ((tbase + _value_token(c, 0, 0)) * svt + g * NWV)
        kw = ()
        for j in tl.static_range(4):
            if ROW_CLAMP:
                kptr = krow0 + tl.minimum(t0 + _score_token(g, j), last) * skt + c * NWK
            else:
                kptr = klane + (_score_token(0, j) * skt)
            kw = kw + lane_words(kptr, NWK, VEC, INTERP)
        vw = ()
        for kb in tl.static_range(2):
            for r in tl.static_range(4):
                if ROW_CLAMP:
                    vptr = vrow0 + tl.minimum(t0 + _value_token(c, kb, r), last) * svt + g * NWV
                else:
                    vptr = vlane + (_value_token(0, kb, r) * svt)
                vw = vw + lane_words(vptr, NWV, VEC, INTERP)
        sw = ()
        if ROW_CLAMP:
            for j in tl.static_range(4):  # the lane's token of block j: row g (j even) or g + 8 (j odd) of m-tile j // 2
                t = t0 + _score_token(g, j)
                ok = t < end
                sw = sw + (tl.load(ks_base + t, mask=ok, other=0.0), tl.load(kz_base + t, mask=ok, other=0.0),
                           tl.load(vs_base + t, mask=ok, other=0.0), tl.load(vz_base + t, mask=ok, other=0.0))
        elif SCALE_WORDS:
            # the lane's four tokens are adjacent (_score_token): 8 bytes per parameter, one vector load each (the host
            # checked the 8-byte alignment); 4 loads and 8 registers per tile instead of 16 and 16
            lrow = tbase + _score_token(g, 0)
            sw = (lane_words((ks_base + lrow).to(tl.pointer_type(tl.int32), bitcast=True), 2, True, INTERP)
                  + lane_words((kz_base + lrow).to(tl.pointer_type(tl.int32), bitcast=True), 2, True, INTERP)
                  + lane_words((vs_base + lrow).to(tl.pointer_type(tl.int32), bitcast=True), 2, True, INTERP)
                  + lane_words((vz_base + lrow).to(tl.pointer_type(tl.int32), bitcast=True), 2, True, INTERP))
        else:
            # unmasked, from one lane pointer per side plus immediate offsets (the masked loads cost a predicate, a
            # zeroed destination and a 64-bit address each: ~70 SASS instructions per tile); rows past `end` hold
            # whatever the buffer holds, so _tile_step zeroes their value scales (MASKED)
            lrow = tbase + _score_token(g, 0)
            for j in tl.static_range(4):
                o = _score_token(0, j)
                sw = sw + (tl.load(ks_base + lrow + o), tl.load(kz_base + lrow + o),
                           tl.load(vs_base + lrow + o), tl.load(vz_base + lrow + o))
        return kw, vw, sw

    @triton.jit
    def _tile_step(kw, vw, sw, t0, end, g, qb, qzs0, qzs1, code_scale, m0, m1, l0, l1, z0, z1, acc, D: tl.constexpr,
                   KBITS: tl.constexpr, VBITS: tl.constexpr, MASKED: tl.constexpr, SCALE_WORDS: tl.constexpr,
                   INTERP: tl.constexpr):
        """One 32-token tile from its loaded words (_tile_loads): the softmax state (m, l, zero term, accumulator)
        updated. MASKED: the tile may run past `end` (a split's last tile): those rows' scores are -inf and their
        value scales 0 (p = 0 there, but 0 times a non-finite scale of an unwritten row is not 0)."""
        KB: tl.constexpr = D // 16  # k-blocks of the score dot
        MT: tl.constexpr = D // 16  # m-tiles of the value dot
        VP: tl.constexpr = 8 // VBITS  # codes per byte of a value row
        # ---- scores S^T [tokens, heads] = K Q^T, two m-tiles of 16 tokens: the lane holds tokens g (j even) and
        # g + 8 (j odd) of m-tile j // 2, heads 2c and 2c + 1; log2 domain
        NWK: tl.constexpr = D * KBITS // 128
        s = ()
        oks = ()  # whether token t0 + 8 j + g of the lane's rows is before `end`
        mx0 = tl.full((32,), float("-inf"), tl.float32)
        mx1 = tl.full((32,), float("-inf"), tl.float32)
        for mt in tl.static_range(2):
            top = ()
            bot = ()
            for w in tl.static_range(NWK):
                top = top + (kw[(2 * mt) * NWK + w],)
                bot = bot + (kw[(2 * mt + 1) * NWK + w],)
            c0 = tl.zeros((32,), tl.float32)
            c1 = tl.zeros((32,), tl.float32)
            c2 = tl.zeros((32,), tl.float32)
            c3 = tl.zeros((32,), tl.float32)
            for kb in tl.static_range(KB):
                c0, c1, c2, c3 = mma16816(_key_register(top, 2 * kb, KBITS),
                                          _key_register(bot, 2 * kb, KBITS),
                                          _key_register(top, 2 * kb + 1, KBITS),
                                          _key_register(bot, 2 * kb + 1, KBITS),
                                          qb[2 * kb], qb[2 * kb + 1], c0, c1, c2, c3, INTERP)
            for half in tl.static_range(2):
                ks = _scale(sw, 0, 2 * mt + half, SCALE_WORDS) * code_scale  # 8-token block 2 mt + half
                kz = _scale(sw, 1, 2 * mt + half, SCALE_WORDS)
                if half == 0:
                    ra = c0
                    rb = c1
                else:
                    ra = c2
                    rb = c3
                # q.k = s (q.n) + z sum(q), log2 domain
                sa = ks * ra + kz * qzs0
                sb = ks * rb + kz * qzs1
                if MASKED:
                    ok = t0 + _score_token(g, 2 * mt + half) < end
                    oks = oks + (ok,)
                    sa = tl.where(ok, sa, float("-inf"))
                    sb = tl.where(ok, sb, float("-inf"))
                s = s + (sa, sb)
                mx0 = tl.maximum(mx0, sa)
                mx1 = tl.maximum(mx1, sb)
        for msk in tl.static_range(3):  # over the 8 lanes of a column (its tokens)
            mx0 = tl.maximum(mx0, shfl_xor(mx0, 4 << msk, INTERP))
            mx1 = tl.maximum(mx1, shfl_xor(mx1, 4 << msk, INTERP))
        n0 = tl.maximum(m0, mx0)  # finite: a tile holds at least one valid token
        n1 = tl.maximum(m1, mx1)
        al0 = tl.exp2(m0 - n0)
        al1 = tl.exp2(m1 - n1)
        m0 = n0
        m1 = n1
        # ---- P^T (fp16, scaled by each token's value scale) as the value dot's B fragments: each 8 x 8 block of
        # (tokens, heads) is transposed in registers (movmatrix)
        pb = ()
        ps0 = tl.zeros((32,), tl.float32)
        ps1 = tl.zeros((32,), tl.float32)
        z0 = z0 * al0
        z1 = z1 * al1
        for j in tl.static_range(4):
            pa = tl.exp2(s[2 * j] - n0)
            pbv = tl.exp2(s[2 * j + 1] - n1)
            ps0 += pa
            ps1 += pbv
            vs = _scale(sw, 2, j, SCALE_WORDS)
            vz = _scale(sw, 3, j, SCALE_WORDS)
            if MASKED:
                vs = tl.where(oks[j], vs, 0.0)
                vz = tl.where(oks[j], vz, 0.0)
            z0 += pa * vz
            z1 += pbv * vz
            pb = pb + (transpose8(pack_half2(pa * vs, pbv * vs, INTERP), INTERP),)
        l0 = l0 * al0 + ps0
        l1 = l1 * al1 + ps1
        # ---- values: O^T [D, heads] += V^T [D, 16 tokens] P^T, MT m-tiles of 16 channels x 2 k-blocks
        NWV: tl.constexpr = D * VBITS // 256
        new = ()
        for i in tl.static_range(2 * MT):
            new = new + (acc[2 * i] * al0, acc[2 * i + 1] * al1)
        acc = new
        for kb in tl.static_range(2):
            lo_regs = ()  # tokens (2c, 2c + 1) of each chunk code
            hi_regs = ()  # tokens (2c + 8, 2c + 9)
            for w in tl.static_range(NWV):
                for k in tl.static_range(4):
                    u0 = byte_pair(vw[(kb * 4 + 0) * NWV + w], vw[(kb * 4 + 1) * NWV + w], k, INTERP)
                    u1 = byte_pair(vw[(kb * 4 + 2) * NWV + w], vw[(kb * 4 + 3) * NWV + w], k, INTERP)
                    for mm in tl.static_range(VP):
                        lo_regs = lo_regs + (u0 & ((((1 << VBITS) - 1) << (VBITS * mm)) * 0x10001),)
                        hi_regs = hi_regs + (u1 & ((((1 << VBITS) - 1) << (VBITS * mm)) * 0x10001),)
            new = ()
            for i in tl.static_range(MT):  # rows g, g + 8 of m-tile i: chunk codes 2i, 2i + 1
                d0, d1, d2, d3 = mma16816(lo_regs[2 * i], lo_regs[2 * i + 1], hi_regs[2 * i], hi_regs[2 * i + 1],
                                          pb[2 * kb], pb[2 * kb + 1], acc[4 * i], acc[4 * i + 1], acc[4 * i + 2],
                                          acc[4 * i + 3], INTERP)
                new = new + (d0, d1, d2, d3)
            acc = new
        return m0, m1, l0, l1, z0, z1, acc

    @triton.jit
    def _frag_decode_kernel(
        q_ptr, sqb, sqh, len_ptr,
        kc_ptr, skb, skh, skt: tl.constexpr, ks_ptr, kz_ptr, sksb, sksh,
        vc_ptr, svb, svh, svt: tl.constexpr, vs_ptr, vz_ptr, svsb, svsh,
        m_ptr, l_ptr, acc_ptr, HKV, qk_scale, S, TLAST,
        D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, INTERP: tl.constexpr,
        BLOCK_T: tl.constexpr,  # the module's BLOCK_T (32): the tile's 4 blocks of 8 tokens are unrolled below
        VEC: tl.constexpr,  # code words by vector loads (the host checked the alignment of rows and base)
        ROW_CLAMP: tl.constexpr,  # clamp every code row (buffers not a whole number of tiles) or only tiles (TLAST)
        SCALE_WORDS: tl.constexpr,  # per-token scales by 8-byte vector loads (ROW_CLAMP off, rows 8-byte aligned)
        PDL: tl.constexpr,  # sm_90+: let the window kernel launched after this one start early (griddepcontrol)
    ):
        """Softmax partials (m, l, acc) of token split program_id(1) of (row, KV head) program_id(0), into partial
        pid * S + split (S partials per row and head; those of a full-precision segment, if any, are the last ones:
        _fp_kernel)."""
        if PDL:  # the window kernel after this one may start in the slots of programs that finish early
            launch_dependents()
        pid = tl.program_id(0)
        split = tl.program_id(1)
        NSPLIT = tl.num_programs(1)
        b = pid // HKV
        h = pid % HKV
        part = pid * S + split
        q_row = q_ptr + b * sqb + h * G * sqh
        lane = tl.arange(0, 32)
        g = lane // 4
        c = lane % 4
        head_ok = g < G
        length = tl.load(len_ptr + b)
        share = split_share_tl(length, NSPLIT, BLOCK_T)
        start = split * share
        end = tl.minimum(start + share, length)
        KB: tl.constexpr = D // 16  # k-blocks of the score dot
        MT: tl.constexpr = D // 16  # m-tiles of the value dot
        VP: tl.constexpr = 8 // VBITS  # codes per byte of a value row
        # ---- the query as B fragments (channels 2c + e of a k-block, head g), in key_channel order
        qb = ()
        qsum = tl.zeros((32,), tl.float32)
        for r in tl.static_range(2 * KB):
            lo = tl.load(q_row + g * sqh + key_channel(c, r, 0, D, KBITS), mask=head_ok, other=0.0).to(tl.float32)
            hi = tl.load(q_row + g * sqh + key_channel(c, r, 1, D, KBITS), mask=head_ok, other=0.0).to(tl.float32)
            reg = pack_half2(lo, hi, INTERP)
            lo16, hi16 = halves(reg)
            qsum += lo16 + hi16
            qb = qb + (_query_register(reg, lo16, hi16, r, KBITS, INTERP),)
        qsum += shfl_xor(qsum, 1, INTERP)
        qsum += shfl_xor(qsum, 2, INTERP)  # sum of head g's fp16 query, in every lane of row g
        # heads 2c and 2c + 1 (this lane's score columns), times the log2-domain score scale
        qzs0 = shfl_idx(qsum, 8 * c, INTERP) * qk_scale
        qzs1 = shfl_idx(qsum, 8 * c + 4, INTERP) * qk_scale
        code_scale = qk_scale * 16777216.0  # codes were n 2^-24
        # ---- softmax state of heads 2c, 2c + 1 (m agrees across a column's lanes; l, the zero term and the accumulator
        # are per lane until the end)
        m0 = tl.full((32,), float("-inf"), tl.float32)
        m1 = tl.full((32,), float("-inf"), tl.float32)
        l0 = tl.zeros((32,), tl.float32)
        l1 = tl.zeros((32,), tl.float32)
        z0 = tl.zeros((32,), tl.float32)
        z1 = tl.zeros((32,), tl.float32)
        acc = ()  # O^T [D, heads]: m-tile i of 16 channels = (row g, heads 2c, 2c + 1), (row g + 8, same heads)
        for i in tl.static_range(4 * MT):
            acc = acc + (tl.zeros((32,), tl.float32),)
        krow0 = kc_ptr + b * skb + h * skh
        vrow0 = vc_ptr + b * svb + h * svh
        ks_base = ks_ptr + b * sksb + h * sksh
        kz_base = kz_ptr + b * sksb + h * sksh
        vs_base = vs_ptr + b * svsb + h * svsh
        vz_base = vz_ptr + b * svsb + h * svsh
        # a tile's words are loaded one iteration ahead, into registers; the split's whole tiles need no row masks,
        # only its last tile may be partial (splits are whole tiles: `share`)
        whole_end = start + tl.maximum(end - start, 0) // BLOCK_T * BLOCK_T  # (an empty split has end < start)
        kw_n, vw_n, sw_n = _tile_loads(krow0, vrow0, ks_base, kz_base, vs_base, vz_base, start, end, TLAST, skt, svt,
                                       lane, D, KBITS, VBITS, VEC, ROW_CLAMP, SCALE_WORDS, INTERP)
        for t0 in range(start, whole_end, BLOCK_T):
            kw, vw, sw = kw_n, vw_n, sw_n
            kw_n, vw_n, sw_n = _tile_loads(krow0, vrow0, ks_base, kz_base, vs_base, vz_base, t0 + BLOCK_T, end, TLAST,
                                           skt, svt, lane, D, KBITS, VBITS, VEC, ROW_CLAMP, SCALE_WORDS,
                                           INTERP)
            m0, m1, l0, l1, z0, z1, acc = _tile_step(kw, vw, sw, t0, end, g, qb, qzs0, qzs1, code_scale, m0, m1, l0, l1,
                                                     z0, z1, acc, D, KBITS, VBITS, False, SCALE_WORDS,
                                                     INTERP)
        if whole_end < end:
            m0, m1, l0, l1, z0, z1, acc = _tile_step(kw_n, vw_n, sw_n, whole_end, end, g, qb, qzs0, qzs1, code_scale, m0,
                                                     m1, l0, l1, z0, z1, acc, D, KBITS, VBITS, True,
                                                     SCALE_WORDS, INTERP)
        # ---- combine a column's lanes (l and the zero term were per lane), scale, store
        for msk in tl.static_range(3):
            l0 += shfl_xor(l0, 4 << msk, INTERP)
            l1 += shfl_xor(l1, 4 << msk, INTERP)
            z0 += shfl_xor(z0, 4 << msk, INTERP)
            z1 += shfl_xor(z1, 4 << msk, INTERP)
        h0 = 2 * c
        out0 = acc_ptr + (part * G + h0) * D
        out1 = out0 + D
        for i in tl.static_range(2 * MT):
            # chunk code i is code (i % VP) of a byte, masked at bit VBITS (i % VP): the register half is n 2^(VBITS (i % VP) - 24)
            ch = value_channel(g, i, D)
            tl.store(out0 + ch, acc[2 * i] * (16777216.0 / (1 << (VBITS * (i % VP)))) + z0, mask=h0 < G)
            tl.store(out1 + ch, acc[2 * i + 1] * (16777216.0 / (1 << (VBITS * (i % VP)))) + z1, mask=h0 + 1 < G)
        first = g == 0
        tl.store(m_ptr + part * G + h0, m0, mask=first & (h0 < G))
        tl.store(m_ptr + part * G + h0 + 1, m1, mask=first & (h0 + 1 < G))
        tl.store(l_ptr + part * G + h0, l0, mask=first & (h0 < G))
        tl.store(l_ptr + part * G + h0 + 1, l1, mask=first & (h0 + 1 < G))


UNPACK_BITS = (1, 2, 3, 4, 8)


def unsupported(q: torch.Tensor, packed, bits: int) -> str | None:
    """Why attend_triton cannot take this call (None: it can)."""
    return token_groups_unsupported(q.shape[-1], bits, packed["k_scale"].shape[-1], UNPACK_BITS)


def attend_triton(q: torch.Tensor, packed, scale: float, fp, bits: int, *, block_t: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  programs_per_sm: int | None = None, block_f: int | None = None, max_registers: int | None = None,
                  prefetch: int | None = None, frag: bool | None = None, frag_vector: bool | None = None):
    """Partials of q [B, Hq, D] over RTN's packed tokens and the full-precision part `fp` (runtime.decode.FullPrecision
    or None). Keyword-only tuning knobs: block_t (tokens per tile), num_splits (token splits per row; default from
    programs_per_sm x SMs: 16 for the tile kernel, FRAG_OCCUPANCY's for the fragment kernel, whose splits fill exactly
    one wave), num_warps, num_stages, max_registers, block_f (full-precision tile), prefetch (tiles ahead whose code
    rows are prefetched into L2 on sm_90+; 0 = off), frag (the fragment kernel: default on where it applies, from
    FRAG_MIN_ROWS (row, KV head) pairs and when no tile-kernel knob is given; False: the tile kernel), frag_vector
    (the fragment kernel loads each lane's code words with one vector load; default where the rows are aligned)."""
    q, batch, hkv, group, d, dev = K.decode_dims(q, packed.heads)
    tile_knobs = any(x is not None for x in (block_t, num_warps, num_stages, prefetch))
    want_frag = frag if frag is not None else batch * hkv >= FRAG_MIN_ROWS and not tile_knobs
    if want_frag and packed.softcap is not None:  # the fragment kernel does not soft-cap: the tile kernel does
        if frag:
            raise KvcalError("rtn frag=True: the fragment kernel does not apply the model's score soft-cap (Gemma 2); "
                             "the tile kernel does (frag=False)")
        want_frag = False
    if want_frag and packed.first is not None:  # nor does it take a sliding window's first slot: the tile kernel does
        if frag:
            raise KvcalError("rtn frag=True: the fragment kernel does not take a compressed sliding-window layer's "
                             "first slot (--compress-local); the tile kernel does (frag=False)")
        want_frag = False
    if want_frag and _frag_applies(q, packed, bits, group):
        return _attend_frag(q, packed, scale, fp, bits, hkv, group, num_splits, programs_per_sm, block_f,
                            max_registers, frag_vector)
    kc, vc = packed["k_codes"], packed["v_codes"]
    ks, kz = K.same_layout(packed["k_scale"], packed["k_zero"])
    vs, vz = K.same_layout(packed["v_scale"], packed["v_zero"])
    gk, gv = ks.shape[-1], vs.shape[-1]
    gp = pow2(group)
    bt = block_t or TILE_DEFAULTS[0]
    default_warps = TILE_DEFAULTS[1]
    if q.dtype == torch.float64 and num_warps is None and block_t is None:
        # the float64 dot is a broadcast product: keep its [M, K, N] block small (4 warps, 16-token tiles)
        default_warps, bt = 4, 16
    nsplit = K.split_count(num_splits, programs_per_sm, dev, batch * hkv, kc.shape[2], bt)
    warps = num_warps or default_warps
    # wgmma (4 warps, BLOCK_T >= 64) wants dots of >= 16 columns; mma.sync pads N itself, so with fewer warps the
    # heads are padded only to a power of two (less softmax work on padding)
    wide = warps >= 4 and bt >= 64
    gpk = max(gp, 16 // gk) if wide else gp
    gpv = max(gp, 16 // gv) if wide else gp
    if num_warps is None and block_t is None:  # the measured defaults belong to the default tile
        num_stages = TILE_DEFAULTS[2] if num_stages is None else num_stages
        max_registers = TILE_DEFAULTS[3] if max_registers is None else max_registers
    kalign, valign, krow, vrow, can = K.code_rows(kc, vc, dev)  # 16-byte rows: 4 words
    prefetch_tiles = (PREFETCH_DEFAULT if prefetch is None else int(prefetch)) if can else 0
    args = (kc, *kc.stride()[:3], ks, kz, *ks.stride()[:3], vc, *vc.stride()[:3], vs, vz, *vs.stride()[:3])
    consts = TileConsts(d, group, gpk, gpv, gv, kalign, valign, bits, bits, bt, K.INTERPRET, PREC.get(q.dtype, 16),
                        prefetch_tiles, krow, vrow, gk)
    tiles = (_tile_prepare, _tile_scores, token_group_tile_values, token_group_tile_finish)
    return K.launch_split_k(tiles, q, packed.lengths, scale, fp,
                            nsplit, hkv, args, consts, gpk=gpk, block_t=bt, block_f=block_f,
                            opts=K.launch_options(q, warps, num_stages, max_registers), prec=PREC.get(q.dtype, 16),
                            merge_warps=TILE_MERGE_WARPS, softcap=packed.softcap, first=packed.first)


def _frag_applies(q, packed, bits: int, group: int) -> bool:
    """Whether the fragment kernel takes this call: one fp16 (scale, zero) per token and KV head, fp16/bf16 queries, a
    GQA group of at most 8 heads, and scale rows with token stride 1."""
    if q.dtype not in (torch.float16, torch.bfloat16) or group > 8:
        return False
    if not frag_supported(q.shape[-1], bits, bits):
        return False
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        t = packed[name]
        if t.dtype != torch.float16 or t.dim() != 4 or t.shape[-1] != 1 or t.stride(2) != 1:
            return False
    return packed["k_codes"].stride(-1) == 1 and packed["v_codes"].stride(-1) == 1


def _attend_frag(q, packed, scale: float, fp, bits: int, hkv: int, group: int, num_splits: int | None,
                 programs_per_sm: int | None, block_f: int | None, max_registers: int | None = None,
                 frag_vector: bool | None = None):
    """attend_triton through the fragment kernel (one warp per program), the full-precision part by the generic
    kernel overlapping its tail."""
    batch, hq, d = q.shape
    dev = q.device
    kc, vc = packed["k_codes"], packed["v_codes"]
    tcap = kc.shape[2]
    # one wave: at most `programs_per_sm` programs per SM (FRAG_OCCUPANCY: 12 at 4 bits under a 168-register cap, 16
    # at 2 bits under 128), rounded down, since a second partial wave costs a whole program's time
    default_programs, default_registers = FRAG_OCCUPANCY[bits]
    max_registers = max_registers or default_registers
    nsplit = num_splits or max(1, min((programs_per_sm or default_programs) * K.sm_count(dev) // (batch * hkv),
                                      triton.cdiv(tcap, 4 * FRAG_BLOCK_T)))
    fsplit = K.fp_splits(fp)
    parts = Partials.empty(batch * hkv, nsplit + fsplit, group, d, q.dtype, dev)
    parts.merge_warps = FRAG_MERGE_WARPS
    ks, kz = K.same_layout(packed["k_scale"], packed["k_zero"])
    vs, vz = K.same_layout(packed["v_scale"], packed["v_zero"])
    kc_strides, vc_strides = kc.stride()[:3], vc.stride()[:3]
    # vector loads: each lane's words of a row start 16 (keys) / 4 NWV (values) bytes apart; the row starts and the
    # base must keep that alignment
    kvec, vvec = min(4, d * bits // 128), min(4, d * bits // 256)
    vec_ok = K.word_alignment(kc, kc_strides) >= kvec and K.word_alignment(vc, vc_strides) >= vvec
    vec = vec_ok if frag_vector is None else bool(frag_vector) and vec_ok
    # tiles start at multiples of FRAG_BLOCK_T: buffers of whole tiles let the kernel clamp tiles, not rows, and load
    # per-token scales without masks (from scale buffers at least as long)
    row_clamp = tcap % FRAG_BLOCK_T != 0 or tcap == 0 or min(ks.shape[2], vs.shape[2]) < tcap
    # a lane's four tokens of a tile are adjacent: their scales are one 8-byte load per parameter where every scale
    # row starts 8-byte aligned
    scale_words = (not row_clamp
                   and all(t.data_ptr() % 8 == 0 and t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0
                           for t in (ks, kz, vs, vz)))
    # programmatic dependent launch (sm_90; griddepcontrol does not assemble for older targets): the window's
    # programs start in the slots of fragment programs that finish early instead of after the whole kernel; they
    # read only what was ready before it (launching the merge the same way gained nothing measurable)
    pdl = bool(FRAG_OVERLAP_FP and fsplit and K.sm90_or_newer(dev))
    with launch_device(q):
        _frag_decode_kernel[(batch * hkv, nsplit)](
            q, q.stride(0), q.stride(1), packed.lengths,
            kc, *kc_strides, ks, kz, *ks.stride()[:2],
            vc, *vc_strides, vs, vz, *vs.stride()[:2],
            parts.m, parts.l, parts.acc, hkv, float(scale) * K.LOG2E, nsplit + fsplit, max(tcap - FRAG_BLOCK_T, 0),
            D=d, G=group, KBITS=bits, VBITS=bits, INTERP=K.INTERPRET, BLOCK_T=FRAG_BLOCK_T,
            VEC=int(vec), ROW_CLAMP=int(row_clamp), SCALE_WORDS=int(scale_words), PDL=int(pdl), num_warps=1,
            **({"maxnreg": int(max_registers)} if max_registers else {}),
        )
    if fsplit:
        K.fp_partials_into(q, fp, scale, parts, nsplit, pdl=pdl, block_f=block_f or 16)
    return parts
