"""Bit packing of b-bit codes into int32 words, along the channel axis of each token.

Layout (shared by every packed cache and kernel): the D codes of one (token, head) form a little-endian
bit stream; code d occupies bits [d*b, d*b + b). Word w holds stream bits [32w, 32w + 32). With b = 3 some
codes straddle two words (their high bits continue at bit 0 of the next word), so 3-bit codes cost
exactly 3 bits. A (token, head) takes `words_per_vector(D, b)` = ceil(D*b/32) int32 words.

3 bits, word order: every 32 codes fill three stream words (a, b, c). The NG = D // 32 whole groups are
stored plane by plane: words [0, NG) are each group's a, [NG, 2NG) its b, [2NG, 3NG) its c (the D % 32
codes left over, if any, follow as plain stream words). A kernel then loads a row's a, b and c words as
three contiguous runs (16-byte loads at D = 128) instead of NG runs of 3 words, which could only be read
4 bytes at a time.
"""

from __future__ import annotations

import contextlib
import os

import torch


def words_per_vector(dim: int, bits: int) -> int:
    return (dim * bits + 31) // 32


def _positions(dim: int, bits: int, device):
    start = torch.arange(dim, device=device) * bits
    return start // 32, start % 32


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] with values in [0, 2^bits) -> int32 words [..., ceil(D*bits/32)]."""
    dim = codes.shape[-1]
    nwords = words_per_vector(dim, bits)
    word, shift = _positions(dim, bits, codes.device)
    c = codes.to(torch.int64)
    out = torch.zeros(*codes.shape[:-1], nwords + 1, dtype=torch.int64, device=codes.device)
    out.scatter_add_(-1, word.expand_as(c), (c << shift) & 0xFFFFFFFF)  # disjoint bits: add == or
    spill = torch.where(shift + bits > 32, c >> (32 - shift), torch.zeros_like(c))
    out.scatter_add_(-1, (word + 1).expand_as(c), spill)
    out = _planes_from_stream(out[..., :nwords], dim, bits)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)  # two's complement view


def _planes_from_stream(words: torch.Tensor, dim: int, bits: int, inverse: bool = False) -> torch.Tensor:
    """3 bits: stream word order <-> the plane order of the module docstring (other widths: unchanged)."""
    ng = dim // 32
    if bits != 3 or ng < 2:
        return words
    head, tail = words[..., : 3 * ng], words[..., 3 * ng :]
    shape = (ng, 3) if not inverse else (3, ng)
    head = head.reshape(*head.shape[:-1], *shape).transpose(-1, -2).reshape(head.shape)
    return torch.cat([head, tail], -1)


def unpack_codes(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack_codes: int32 words [..., W] -> codes [..., dim] as int64."""
    word, shift = _positions(dim, bits, words.device)
    w = _planes_from_stream(words.to(torch.int64) & 0xFFFFFFFF, dim, bits, inverse=True)
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=-1)
    lo = w.index_select(-1, word) >> shift
    hi = w.index_select(-1, word + 1) << (32 - shift)
    return (lo | hi) & ((1 << bits) - 1)


TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: base-3 packing stores a ternary code in 1.6 bits


def bytes_per_trit_vector(dim: int) -> int:
    return -(-dim // TRITS_PER_BYTE)


def pack_trits(codes: torch.Tensor) -> torch.Tensor:
    """Ternary codes [..., D] in {0, 1, 2} -> uint8 [..., ceil(D / 5)]: byte j holds codes 5j .. 5j + 4 as
    sum_i code_{5j+i} 3^i (the missing codes of the last byte count as 0)."""
    dim = codes.shape[-1]
    pad = bytes_per_trit_vector(dim) * TRITS_PER_BYTE - dim
    c = torch.nn.functional.pad(codes.to(torch.int32), (0, pad)).reshape(*codes.shape[:-1], -1, TRITS_PER_BYTE)
    weights = torch.tensor([3**i for i in range(TRITS_PER_BYTE)], dtype=torch.int32, device=codes.device)
    return (c * weights).sum(-1).to(torch.uint8)


def unpack_trits(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of pack_trits: uint8 [..., ceil(D / 5)] -> codes [..., dim] as int64."""
    weights = torch.tensor([3**i for i in range(TRITS_PER_BYTE)], dtype=torch.int64, device=packed.device)
    c = (packed.to(torch.int64)[..., None] // weights) % 3
    return c.reshape(*packed.shape[:-1], -1)[..., :dim]


# ---- Triton ---------------------------------------------------------------------------------------
# The device functions below are shared by every kernel of the runtime (quantize-and-pack kernels pack
# with `pack_tile`, the decode-attention kernel unpacks with `unpack_tile`); `pack_codes_triton` and
# `unpack_codes_triton` expose them as ops so the bit layout is tested on its own against the references.

try:  # triton is a Linux-only dependency; the torch references above work without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def pack_tile(codes, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr):
        """codes [R, D] (int32 in [0, 2^BITS)) -> words [R, WP] int32 (WP >= ceil(D*BITS/32), pow2).

        Word w collects, for every channel d, the part of code d that falls in stream bits [32w, 32w+32):
        its low bits shifted left when the code starts inside the word, its high bits shifted right when
        it started in the previous word (3-bit codes straddle). Contributions are disjoint bits."""
        c = codes.to(tl.uint32, bitcast=True)
        d = tl.arange(0, D)
        w = tl.arange(0, WP)
        if BITS == 3:  # stored word w is stream word 3 * (w % NG) + w // NG (planes; tail words as they are)
            NG: tl.constexpr = D // 32
            if NG > 1:  # one group (D < 64): planes and stream coincide
                w = tl.where(w < 3 * NG, 3 * (w % NG) + w // NG, w)
        s = d[None, :] * BITS - w[:, None] * 32  # [WP, D] start of code d relative to (stream) word w
        left = c[:, None, :] << tl.minimum(tl.maximum(s, 0), 31).to(tl.uint32)[None, :, :]
        right = c[:, None, :] >> tl.minimum(tl.maximum(-s, 0), 31).to(tl.uint32)[None, :, :]
        zero = tl.zeros_like(left)
        part = tl.where(((s >= 0) & (s < 32))[None, :, :], left, tl.where(((s < 0) & (s > -BITS))[None, :, :], right, zero))
        return tl.sum(part, 2).to(tl.int32, bitcast=True)  # disjoint bits: the sum is the or (no carries)

    @triton.jit
    def _split_bits(x, WIDTH: tl.constexpr, BITS: tl.constexpr):
        """x holds WIDTH-bit fields of codes (code 0 lowest): halve the field until it is one code,
        appending a minor axis of 2 each time (tl.join keeps the new axis inside the thread, so
        unpacking needs no data movement between threads). WIDTH / BITS must be a power of two."""
        if WIDTH > BITS:
            half: tl.constexpr = WIDTH // 2
            x = tl.join(x & ((1 << half) - 1), x >> half)
            return _split_bits(x, half, BITS)
        else:
            return x

    @triton.jit
    def _planes3(rowptr, rmask, C0: tl.constexpr, NC: tl.constexpr, D: tl.constexpr):
        """3-bit rows: the words a, b, c [R, NC / 32] of each group of 32 codes in channels [C0, C0 + NC), from the
        three word planes (module docstring)."""
        NG: tl.constexpr = NC // 32
        PLANE: tl.constexpr = D // 32
        p = rowptr[:, None] + (C0 // 32 + tl.arange(0, NG))[None, :]  # group g's words: p, p + PLANE, p + 2 PLANE
        m = rmask[:, None]
        wa = tl.load(p, mask=m, other=0).to(tl.uint32, bitcast=True)
        wb = tl.load(p + PLANE, mask=m, other=0).to(tl.uint32, bitcast=True)
        wc = tl.load(p + 2 * PLANE, mask=m, other=0).to(tl.uint32, bitcast=True)
        return wa, wb, wc

    @triton.jit
    def _chunks3_of(wa, wb, wc):
        """The 24-bit chunks of 8 codes of 3-bit groups with words wa, wb, wc [R, NG]: [R, NG, 2, 2] uint32 with
        chunk 2i + o of each group at [i, o] (chunks 1 and 2 straddle two words)."""
        c0 = wa & 0xFFFFFF
        c1 = ((wa >> 24) | (wb << 8)) & 0xFFFFFF
        c2 = ((wb >> 16) | (wc << 16)) & 0xFFFFFF
        c3 = wc >> 8
        return tl.join(tl.join(c0, c2), tl.join(c1, c3))

    @triton.jit
    def _chunks3(rowptr, rmask, C0: tl.constexpr, NC: tl.constexpr, D: tl.constexpr):
        """_chunks3_of the groups of channels [C0, C0 + NC) of R rows."""
        wa, wb, wc = _planes3(rowptr, rmask, C0, NC, D)
        return _chunks3_of(wa, wb, wc)

    @triton.jit
    def unpack_trits_tile(rowptr, rmask, C0: tl.constexpr, NC: tl.constexpr):
        """Codes of channels [C0, C0 + NC) of base-3 packed rows (pack_trits; rowptr [R] uint8 pointers, rows rmask
        valid) as int32 [R, NC]: one byte load per code (the row's bytes are few and stay in L1)."""
        c = C0 + tl.arange(0, NC)
        byte = tl.load(rowptr[:, None] + (c // 5)[None, :], mask=rmask[:, None], other=0).to(tl.int32)
        i = c % 5
        power = tl.where(i == 0, 1, tl.where(i == 1, 3, tl.where(i == 2, 9, tl.where(i == 3, 27, 81))))
        return (byte // power[None, :]) % 3

    @triton.jit
    def unpack_tile(rowptr, rmask, C0: tl.constexpr, NC: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                    R: tl.constexpr):
        """Load and unpack channels [C0, C0 + NC) of R packed D-channel vectors: rowptr [R] points at each
        vector's first int32 word (rows with rmask False read as zeros). Returns codes [R, NC] uint32.

        BITS in {1, 2, 4, 8}: a word holds 32/BITS whole codes. BITS == 3: the three words of each group of
        32 codes come from the three word planes (module docstring), cut into four 24-bit chunks of 8 codes
        (chunks 1 and 2 straddle two words). C0, NC and D are multiples of 32. Fields are split by halving
        (see _split_bits)."""
        if BITS == 3:
            x = _chunks3(rowptr, rmask, C0, NC, D)
            x = _split_bits(x, 24, 3)
            return tl.reshape(x, (R, NC))
        else:
            PER: tl.constexpr = 32 // BITS
            NW: tl.constexpr = NC // PER
            w = C0 // PER + tl.arange(0, NW)
            words = tl.load(rowptr[:, None] + w[None, :], mask=rmask[:, None], other=0).to(tl.uint32, bitcast=True)
            return tl.reshape(_split_bits(words, 32, BITS), (R, NC))

    @triton.jit
    def _mask_tree(x, BITS: tl.constexpr, J0: tl.constexpr, STRIDE: tl.constexpr, N: tl.constexpr):
        """x & ((M | M << 16) << BITS * j) for j = J0, J0 + STRIDE, ... (N of them), appended as minor axes
        in the order of j (the even j's tree first, so the last axis is j's low bit), inside the thread."""
        if N > 1:
            return tl.join(_mask_tree(x, BITS, J0, 2 * STRIDE, N // 2),
                           _mask_tree(x, BITS, J0 + STRIDE, 2 * STRIDE, N // 2))
        else:
            MASK: tl.constexpr = (((1 << BITS) - 1) * 65537) << (BITS * J0)
            return x & MASK

    @triton.jit
    def unpack_mma(rowptr, rmask, C0: tl.constexpr, NC: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                   R: tl.constexpr):
        """Like unpack_tile, but returns a tensor-core operand: fp16 values code * f * 2^-24, in the column
        order of mma_channels, f = mma_code_scale of the column. A field inside the low 10 bits (the
        mantissa) of a 16-bit half *is* the fp16 subnormal (field value) * 2^-24, so no int-to-float
        conversion, no exponent or and no subtraction is needed; the tensor cores multiply subnormals
        exactly, and callers fold 2^24 / f into the other operand or the result.

        BITS in {1, 2, 4, 8}: codes k and k + PER/2 of a word (PER = 32 / BITS) are 16 bits apart, so a mask
        (M | M << 16) << BITS*j keeps both as a pair of fp16 in one 32-bit register, each worth code * 2^(BITS*j)
        (after FasterTransformer's int4 converters, without their magic bias). The fields of a half's low byte
        are masked in place (j < PER/4: scale 2^(BITS*j), at most 2^7 = 128 for 1 bit, 64 for 2 bits, 16 for
        4 bits), those of its high byte after one shift by 8: one and per two codes plus one shift per word
        (shifting every field down to bit 0 took ~10 instructions per 4-bit word instead of 5; measured in the
        SASS of the decode kernel). Codes come out in the order k0, k0 + PER/2, k1, k1 + PER/2, ...
        BITS == 3: chunks of 8 codes as pairs (k, k + 4), scales 1, 8, 64, 1 (below)."""
        if BITS == 3:
            # Each 24-bit chunk x of 8 codes (code k at bit 3k; chunks as in unpack_tile) becomes four fp16 pairs
            # (k, k + 4): pa = x bits 0-8 | x bits 12-20 << 4 holds codes 0-2 and 4-6 at the same offsets of the
            # two halves, masked in place (scales 1, 8, 64); codes 3 and 7 (bits 9-11, 21-23) are shifted down
            # (scale 1). Before, every code was its own 32-bit value and the operand went to shared memory by
            # 2-byte stores (260 STS.U16 per 32-token tile, bank conflicts among them): int3 was the slowest int.
            x = _chunks3(rowptr, rmask, C0, NC, D)
            pa = (x & 0x1FF) | ((x << 4) & 0x1FF0000)
            pb = ((x >> 9) & 0x7) | ((x >> 5) & 0x70000)
            y = tl.join(tl.join(pa & 0x70007, pa & 0x1C001C0), tl.join(pa & 0x380038, pb))  # pair j = 2a + b at [a, b]
            lo = y.to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            return tl.reshape(tl.join(lo, hi), (R, NC))
        else:
            PER: tl.constexpr = 32 // BITS
            NW: tl.constexpr = NC // PER
            w = C0 // PER + tl.arange(0, NW)
            words = tl.load(rowptr[:, None] + w[None, :], mask=rmask[:, None], other=0).to(tl.uint32, bitcast=True)
            # [R, NW, 2 (low / high byte), PER / 4 (j)]: code k = (PER / 4) * byte + j and its partner k + PER/2
            x = _mask_tree(tl.join(words, words >> 8), BITS, 0, 1, PER // 4)
            lo = x.to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            y = tl.join(lo, hi)  # [R, NW, PER]: a word's columns (byte, j, half) are contiguous
            # Whole words change places (see mma_channels) so that the kernel's 16-byte shared-memory stores of
            # this operand do not conflict: the loads give each thread V consecutive words of a row and TW
            # threads span a row, so with words in order the 8 lanes of a quarter warp (RQ rows x TW threads)
            # stored to only 8 / NJL distinct bank groups of the swizzled tile (2-way conflicts at 4 bits, D =
            # 128: ncu counted 8 wavefronts per 16-byte store instead of 4). Putting the thread index g in the
            # chunk bits the rows' swizzle does not cover (chunk = (j_hi * TW + g) * NJL + j_lo words) spreads
            # them; the column order is free because mma_channels tells the kernel which channel each column is.
            return _mma_word_order(y, R, NW, BITS)

    @triton.jit
    def _mma_word_order(y, R: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr):
        """[R, NW, PER] columns of whole words -> [R, NW * PER] in the word order of mma_channels (unpack_mma's
        comment says why)."""
        PER: tl.constexpr = 32 // BITS
        V: tl.constexpr = 4 if NW >= 4 else NW  # words per thread (16-byte loads)
        TW: tl.constexpr = NW // V
        RQ: tl.constexpr = 8 // TW if TW <= 8 else 1  # rows per quarter warp
        NJL: tl.constexpr = (RQ * BITS // 4 if RQ * BITS >= 4 else 1) if RQ * BITS // 4 <= V else V
        if NJL < V:
            y = tl.permute(tl.reshape(y, (R, TW, V // NJL, NJL, PER)), (0, 2, 1, 3, 4))
        return tl.reshape(y, (R, NW * PER))

    @triton.jit
    def lane_entry(tab_ptr, BITS: tl.constexpr):
        """This lane's entry T[laneid mod 2^BITS] of a float32 table, as fp16 bits (uint32): the source of the
        warp-shuffle lookups in unpack_lut. Call it once, before a loop. The lane index and the load stay inside
        one asm block: a Triton scalar is assumed to be the same in every thread, and a per-lane scalar load in a
        loop was pipelined into one shared-memory word (every lane then saw one lane's entry)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 l; .reg .b64 a; .reg .f32 v; .reg .b16 h; mov.u32 l, %laneid; and.b32 l, l, $2; "
            "mul.wide.u32 a, l, 4; add.s64 a, a, $1; ld.global.nc.f32 v, [a]; cvt.rn.f16.f32 h, v; "
            "cvt.u32.u16 $0, h; }",
            "=r,l,r", [tab_ptr.to(tl.int64), tl.program_id(0) * 0 + ((1 << BITS) - 1)], dtype=tl.uint32,
            is_pure=True, pack=1)

    @triton.jit
    def _lut_pair(x, entry, DIST: tl.constexpr):
        """Table lookups of the two codes held in x at bit 0 and bit DIST: (T[lo] | T[hi] << 16) as fp16 bits.
        Each lookup is one warp shuffle from the lane whose `entry` is T[code]: shfl reads only the low 5 bits of
        the lane index, and every lane L holds T[L mod 2^BITS], so the code needs no masking (bits of the next
        code above it only pick another lane with the same entry)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; shfl.sync.idx.b32 a, $3, $1, 31, 0xffffffff; "
            "shfl.sync.idx.b32 b, $3, $2, 31, 0xffffffff; prmt.b32 $0, a, b, 0x5410; }",
            "=r,r,r,r", [x, x >> DIST, entry], dtype=tl.uint32, is_pure=True, pack=1)

    @triton.jit
    def _lut_tree(x, entry, BITS: tl.constexpr, DIST: tl.constexpr, J0: tl.constexpr, STRIDE: tl.constexpr,
                  N: tl.constexpr):
        """_lut_pair of the code pairs starting at bit BITS * j for j = J0, J0 + STRIDE, ... (N of them), appended
        as minor axes in the order of j like _mask_tree (joins keep them inside the thread, so the operand's
        columns stay contiguous per thread: 16-byte shared-memory stores as for unpack_mma)."""
        if N > 1:
            return tl.join(_lut_tree(x, entry, BITS, DIST, J0, 2 * STRIDE, N // 2),
                           _lut_tree(x, entry, BITS, DIST, J0 + STRIDE, 2 * STRIDE, N // 2))
        else:
            return _lut_pair(x >> (BITS * J0), entry, DIST)

    @triton.jit
    def load_words(rowptr, rmask, C0: tl.constexpr, NC: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
        """The packed words of channels [C0, C0 + NC) of R rows, as unpack_lut_words takes them: BITS 3: the
        words a, b, c [R, NC / 32] of each group (_planes3); otherwise (words [R, NC * BITS / 32], 0, 0). A
        kernel can load a tile's words one iteration before it unpacks them."""
        if BITS == 3:
            return _planes3(rowptr, rmask, C0, NC, D)
        else:
            PER: tl.constexpr = 32 // BITS
            w = C0 // PER + tl.arange(0, NC // PER)
            words = tl.load(rowptr[:, None] + w[None, :], mask=rmask[:, None], other=0).to(tl.uint32, bitcast=True)
            z = tl.zeros((1,), tl.uint32)
            return words, z, z

    @triton.jit
    def unpack_lut_words(w0, w1, w2, NC: tl.constexpr, BITS: tl.constexpr, R: tl.constexpr, tab_ptr, entry,
                         INTERP: tl.constexpr):
        """unpack_lut of words already loaded by load_words (w0, w1, w2 as it returns them)."""
        NL: tl.constexpr = 1 << BITS
        if INTERP:
            if BITS == 3:
                codes = tl.reshape(_split_bits(_chunks3_of(w0, w1, w2), 24, 3), (R, NC))
            else:
                codes = tl.reshape(_split_bits(w0, 32, BITS), (R, NC))
            order = tl.broadcast_to(mma_channels(0, NC, BITS)[None, :], (R, NC))
            tab = tl.broadcast_to(tl.load(tab_ptr + tl.arange(0, NL))[None, :], (R, NL))
            return tl.gather(tab, tl.gather(codes.to(tl.int32), order, 1), 1).to(tl.float16)
        else:
            if BITS == 3:  # chunks of 8 codes: pairs (k, k + 4) 12 bits apart
                y = _lut_tree(_chunks3_of(w0, w1, w2), entry, 3, 12, 0, 1, 4)
            else:
                PER: tl.constexpr = 32 // BITS
                y = _lut_tree(w0, entry, BITS, 16, 0, 1, PER // 2)  # [R, NW, (PER / 2 as joined axes)]
            lo = y.to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            z = tl.join(lo, hi)
            if BITS == 3:
                return tl.reshape(z, (R, NC))
            else:
                return _mma_word_order(tl.reshape(z, (R, NC * BITS // 32, 32 // BITS)), R, NC * BITS // 32, BITS)

    @triton.jit
    def unpack_lut(rowptr, rmask, C0: tl.constexpr, NC: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                   R: tl.constexpr, tab_ptr, entry, INTERP: tl.constexpr):
        """Like unpack_mma, but each column holds T[code] in fp16 (T: the float32 table at tab_ptr, 2^BITS entries),
        in the column order of mma_channels: a non-uniform (lookup-table) code's dot operand. On the GPU the
        lookups are warp shuffles of two codes per 32-bit result (_lut_pair): the pairs unpack_mma would mask
        out of a word (codes k, k + PER/2 of 2- and 4-bit words, 16 bits apart; codes k, k + 4 of a 3-bit
        chunk, 12 bits apart) become the two halves of one register, so the operand has unpack_mma's layout.
        entry: lane_entry(tab_ptr, BITS) (GPU; unused by the interpreter, which has no inline asm and gathers from
        the table instead). load_words + unpack_lut_words."""
        w0, w1, w2 = load_words(rowptr, rmask, C0, NC, D, BITS)
        return unpack_lut_words(w0, w1, w2, NC, BITS, R, tab_ptr, entry, INTERP)

    @triton.jit
    def mma_channels(C0: tl.constexpr, NC: tl.constexpr, BITS: tl.constexpr):
        """Channel index of each column of unpack_mma's result."""
        p = tl.arange(0, NC)
        if BITS == 3:  # column ((chunk * 4 + j) * 2 + half) -> code j + 4 * half of the 8-code chunk
            return C0 + (p // 8) * 8 + (p // 2) % 4 + (p % 2) * 4
        else:
            PER: tl.constexpr = 32 // BITS
            r = p % PER
            word = _word_of_slot(p // PER, NC // PER, BITS)
            return C0 + word * PER + r // 2 + (r % 2) * (PER // 2)

    @triton.jit
    def _word_of_slot(x, NW: tl.constexpr, BITS: tl.constexpr):
        """unpack_mma's word order (its comment says why; the constants are _mma_word_order's): the word at word
        position x. Position (j_hi * TW + g) * NJL + j_lo holds word g * V + j_hi * NJL + j_lo."""
        V: tl.constexpr = 4 if NW >= 4 else NW
        TW: tl.constexpr = NW // V
        RQ: tl.constexpr = 8 // TW if TW <= 8 else 1
        NJL: tl.constexpr = (RQ * BITS // 4 if RQ * BITS >= 4 else 1) if RQ * BITS // 4 <= V else V
        return (x // NJL) % TW * V + x // (NJL * TW) * NJL + x % NJL

    @triton.jit
    def mma_code_scale(NC: tl.constexpr, BITS: tl.constexpr):
        """float32 [NC]: the power of two f by which each column of unpack_mma's result holds its code
        (value = code * f * 2^-24)."""
        p = tl.arange(0, NC)
        if BITS == 3:
            j = (p // 2) % 4
            return tl.where(j == 1, 8.0, tl.where(j == 2, 64.0, 1.0))
        else:
            PER: tl.constexpr = 32 // BITS
            j = (p % PER) // 2 % (PER // 4)  # k = (p % PER) // 2; j = k % (PER / 4)
            return (tl.full((NC,), 1, tl.int32) << (BITS * j)).to(tl.float32)

    @triton.jit
    def _pack_kernel(codes_ptr, out_ptr, N, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                     WP: tl.constexpr, R: tl.constexpr):
        n = tl.program_id(0) * R + tl.arange(0, R)
        nm = n < N
        d = tl.arange(0, D)
        c = tl.load(codes_ptr + n[:, None] * D + d[None, :], mask=nm[:, None], other=0)
        words = pack_tile(c, R, D, BITS, WP)
        w = tl.arange(0, WP)
        tl.store(out_ptr + n[:, None] * W + w[None, :], words, mask=nm[:, None] & (w < W)[None, :])

    @triton.jit
    def _unpack_kernel(words_ptr, out_ptr, N, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                       R: tl.constexpr):
        n = tl.program_id(0) * R + tl.arange(0, R)
        nm = n < N
        c = unpack_tile(words_ptr + n * W, nm, 0, D, D, BITS, R)
        d = tl.arange(0, D)
        tl.store(out_ptr + n[:, None] * D + d[None, :], c.to(tl.int32, bitcast=True), mask=nm[:, None])


if triton is not None:

    @triton.jit
    def _unpack_mma_kernel(words_ptr, out_ptr, N, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                           R: tl.constexpr):
        n = tl.program_id(0) * R + tl.arange(0, R)
        nm = n < N
        v = unpack_mma(words_ptr + n * W, nm, 0, D, D, BITS, R).to(tl.float32) * 16777216.0
        v = v / mma_code_scale(D, BITS)[None, :]
        ch = mma_channels(0, D, BITS)
        tl.store(out_ptr + n[:, None] * D + ch[None, :], v, mask=nm[:, None])


    @triton.jit
    def _unpack_lut_kernel(words_ptr, tab_ptr, out_ptr, N, D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                           R: tl.constexpr, INTERP: tl.constexpr):
        n = tl.program_id(0) * R + tl.arange(0, R)
        nm = n < N
        if INTERP:
            entry = 0
        else:
            entry = lane_entry(tab_ptr, BITS)
        v = unpack_lut(words_ptr + n * W, nm, 0, D, D, BITS, R, tab_ptr, entry, INTERP).to(tl.float32)
        ch = mma_channels(0, D, BITS)
        tl.store(out_ptr + n[:, None] * D + ch[None, :], v, mask=nm[:, None])


def unpack_lut_triton(words: torch.Tensor, bits: int, dim: int, table: torch.Tensor) -> torch.Tensor:
    """table[codes] in fp16 (as float32) through the attention kernel's lookup-table operand path (unpack_lut +
    mma_channels): on the GPU by warp shuffles; under the interpreter by gathers. Reference:
    table.half().float()[unpack_codes(words)]."""
    nwords = words.shape[-1]
    flat = words.reshape(-1, nwords).contiguous()
    out = torch.empty(flat.shape[0], dim, dtype=torch.float32, device=words.device)
    rows = 16
    with launch_device(words):
        _unpack_lut_kernel[(triton.cdiv(flat.shape[0], rows),)](
            flat, table.float().contiguous(), out, flat.shape[0], dim, bits, nwords, rows,
            os.environ.get("TRITON_INTERPRET") == "1")
    return out.reshape(*words.shape[:-1], dim)


def _launch_unpack(kernel, words: torch.Tensor, bits: int, dim: int, out_dtype) -> torch.Tensor:
    """Run an unpack kernel over every vector of `words` [..., W] -> int64 codes [..., dim]."""
    nwords = words.shape[-1]
    flat = words.reshape(-1, nwords).contiguous()
    out = torch.empty(flat.shape[0], dim, dtype=out_dtype, device=words.device)
    rows = 16
    with launch_device(words):
        kernel[(triton.cdiv(flat.shape[0], rows),)](flat, out, flat.shape[0], dim, bits, nwords, rows)
    return out.reshape(*words.shape[:-1], dim).to(torch.int64)


def unpack_codes_mma_triton(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """unpack_codes through the attention kernel's dot-operand path (unpack_mma + mma_channels), as int64."""
    return _launch_unpack(_unpack_mma_kernel, words, bits, dim, torch.float32)


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pack_codes_triton(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Triton version of pack_codes (D a power of two >= 32, bits <= 8)."""
    dim = codes.shape[-1]
    nwords = words_per_vector(dim, bits)
    flat = codes.reshape(-1, dim).to(torch.int32).contiguous()
    out = torch.empty(flat.shape[0], nwords, dtype=torch.int32, device=codes.device)
    rows = 4
    with launch_device(codes):
        _pack_kernel[(triton.cdiv(flat.shape[0], rows),)](flat, out, flat.shape[0], dim, bits, nwords,
                                                          pow2(nwords), rows)
    return out.reshape(*codes.shape[:-1], nwords)


def unpack_codes_triton(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Triton version of unpack_codes (bits in {1, 2, 3, 4, 8}, D a power of two >= 32)."""
    return _launch_unpack(_unpack_kernel, words, bits, dim, torch.int32)


def launch_device(t: torch.Tensor):
    """Context for a kernel launch: the tensor's CUDA device (multi-GPU safe), nothing on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
