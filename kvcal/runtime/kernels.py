"""Shared Triton building blocks of the decode kernels, with no method names in them.

- RoPE by angle addition (`rotate_query`), L2 prefetch (dot operands and products, `dot` / `operand` /
  `mma_operand`, are below in kvcal/quant/tiles.py, shared with the quantizers' kernels);
- the split-K decode skeleton (`split_k_kernel`, launched by `launch_split_k`): program ids, split bounds, online
  softmax, the full-precision split and the partial stores around a method's own `@triton.jit` tile functions, and
  the host pieces around it (`decode_dims`, `split_count`, `launch_options`, `code_rows`);
- the split of a row's packed tokens among its split programs (`split_share`, `split_share_tl`);
- the full-precision part of a decode step (`fp_segment` inside a storage's own kernel, or the generic kernel
  through `fp_partials_into` / `fp_partials_triton`) and the split-K merge of the partials (`merge_triton`), the
  Triton side of runtime/decode.py;
- fragment-MMA helpers for one-warp kernels that unpack codes straight into tensor-core registers (warp shuffles,
  movmatrix, mma.sync m16n8k16, vector loads, programmatic dependent launch);
- small launch utilities (device properties, placeholder tensors, alignment hints).

Bit packing and unpacking live in kvcal/quant/packing.py. Every jit function has the same semantics under
TRITON_INTERPRET=1 (no inline PTX there).
"""

from __future__ import annotations

import functools
import os

import torch

from kvcal.quant.packing import launch_device, pow2
from kvcal.quant.tiles import head_dim_unsupported
from kvcal.runtime.partials import Partials

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The merge: one program per (row, query head, REDUCE_CHANNELS channels), REDUCE_CHUNK partials per step at 4 warps (a
# quarter of that at 1 warp). At batch 1 a tile kernel leaves ~265 partials per head and the merge has only B x Hq =
# 32 (row, head) pairs: one program per pair over all 128 channels takes 9 steps of 32 partials in a row, so 32
# channels per program and 256 partials per step (timings: docs/runtime.md).
REDUCE_CHANNELS = 32
REDUCE_CHUNK = 256
# Full-precision tokens per program of the generic full-precision kernel: chunks of a few tiles, since one program
# walking a whole window tile by tile waits on load latency; 16 with a 1-warp merge measured fastest
# (docs/runtime.md).
FP_CHUNK = 16


def split_share(length: int, num_splits: int, block_t: int) -> int:
    """Tokens per split of a row of `length` packed tokens (0 when the row is empty): each split takes an equal share
    rounded up to whole tiles; split s covers [s share, min((s + 1) share, length)), and one past the row's end is
    empty. Kernels compute it from the row's own length (split_share_tl: no host sync, rows differ in length)."""
    per_split = -(-length // num_splits)
    return -(-per_split // block_t) * block_t


def unsupported(q: torch.Tensor) -> str | None:
    """Why no decode kernel can take these queries (None: they can)."""
    if triton is None:
        return "triton is not installed"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"query dtype {q.dtype} (fp16, bf16, fp32 and fp64 are supported)"
    return head_dim_unsupported(q.shape[-1])


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm90_or_newer(device) -> bool:
    """Whether the device is sm_90 or newer, as cp.async.bulk.prefetch.L2 and griddepcontrol (programmatic dependent
    launch) need (and a real GPU: the interpreter has no inline asm). Looked up once per device."""
    if device.type != "cuda" or INTERPRET:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, dtype=torch.float32, device=device), torch.zeros(1, dtype=torch.int32, device=device)


def placeholders(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32, int32) placeholder tensors for a kernel's absent arguments, made once per device (no per-call
    launches)."""
    return _placeholders(torch.device(device))


def qk_scale_parts(scale: float) -> tuple[float, float]:
    """scale x log2(e) as a float32 part and the rest (kernels take scalars as float32; float64 kernels add both)."""
    import struct

    hi = struct.unpack("f", struct.pack("f", float(scale) * LOG2E))[0]
    return hi, float(scale) * LOG2E - hi


if triton is not None:
    from kvcal.quant.tiles import dot

    @triton.jit
    def split_share_tl(length, NSPLIT, TILE: tl.constexpr):
        """split_share inside a kernel."""
        return tl.cdiv(tl.cdiv(length, NSPLIT), TILE) * TILE

    @triton.jit
    def split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T: tl.constexpr, first_ptr=None, FIRST: tl.constexpr = 0):
        """[start, end) of split `split` of row b's packed tokens (split_share; an empty split has end <= start). FIRST:
        the splits share the tokens from the tile holding first_ptr[b] (a sliding window's first slot) on, not from
        0; they still start on tile bounds."""
        length = tl.load(len_ptr + b)
        lo = 0
        if FIRST:
            lo = tl.load(first_ptr + b) // BLOCK_T * BLOCK_T
        share = split_share_tl(length - lo, NSPLIT, BLOCK_T)
        start = lo + split * share
        return start, tl.minimum(start + share, length)

    @triton.jit
    def soft_cap(s, CAP: tl.constexpr):
        """Log2-domain scores s -> CAP tanh(s / CAP), the model's score soft-cap (Gemma 2: 50 tanh(x / 50) on the
        natural scores, so CAP = 50 log2(e)); CAP 0: s unchanged. tanh(x) = 1 - 2 / (e^(2x) + 1): +-1 at +-inf;
        -inf (a masked score) stays -inf."""
        if CAP > 0:
            e = tl.exp2(s * (2.8853900817779268 / CAP))  # 2 log2(e) / CAP: e^(2 s / CAP) in natural units
            s = tl.where(s == float("-inf"), s, CAP * (1.0 - 2.0 / (e + 1.0)))  # a masked score stays masked
        return s

    @triton.jit
    def softmax_tile(s, m_i, l_i, ok):
        """Online softmax over one tile of scores s [BLOCK_T, heads] (log2 domain; -inf where masked) for the heads
        whose `ok` is set: returns (p [BLOCK_T, heads], alpha [heads], the new max, the new sum). Padding heads get
        p = alpha = 0."""
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(ok, tl.exp2(m_i - m_use), 0.0)
        p = tl.where(ok[None, :], tl.exp2(s - m_use[None, :]), 0.0)
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)

    @triton.jit
    def store_partial(m_ptr, l_ptr, acc_ptr, part, G: tl.constexpr, D: tl.constexpr, out, channels, rv, m_i, l_i,
                      rk, HEADS_FIRST: tl.constexpr):
        """Partial `part` of a (row, KV head): out [D, heads] (rows in `channels` order, columns rv; HEADS_FIRST:
        out [heads, D], rows rv, columns in `channels` order), m and l [heads] (columns rk); only the G real heads
        are stored."""
        if HEADS_FIRST:  # stored as it is: a transpose in the epilogue needs a shared-memory layout conversion
            tl.store(acc_ptr + (part * G + rv)[:, None] * D + channels[None, :], out, mask=(rv < G)[:, None])
        else:
            tl.store(acc_ptr + (part * G + rv)[None, :] * D + channels[:, None], out, mask=(rv < G)[None, :])
        tl.store(m_ptr + part * G + rk, m_i, mask=rk < G)
        tl.store(l_ptr + part * G + rk, l_i, mask=rk < G)

    @triton.jit
    def split_k_kernel(q_ptr, sqb, sqh, len_ptr, first_ptr, args, fp, m_ptr, l_ptr, acc_ptr, HKV, qk_scale_hi,
                       qk_scale_lo, NSPLIT, S, C: tl.constexpr, PREPARE: tl.constexpr, SCORES: tl.constexpr,
                       VALUES: tl.constexpr, FINISH: tl.constexpr, SOFTMAX: tl.constexpr, TAIL: tl.constexpr,
                       HEADS_FIRST: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GPK: tl.constexpr, GPF: tl.constexpr, HAS_FP: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
                       CAP: tl.constexpr = 0.0, FIRST: tl.constexpr = 0):
        """The split-K decode skeleton: program (row b and KV head h, split) over all G query heads of the KV head.
        Splits < NSPLIT walk an equal BLOCK_T-aligned share of row b's packed tokens (split_bounds: no host sync, a
        share past the row's end writes a neutral partial) with an online softmax (softmax_tile) in float32 (float64
        for float64 queries) and store partial pid S + split (store_partial); with HAS_FP, split NSPLIT takes the
        full-precision part `fp` (fp_args' tuple and the slot count; fp_segment). S: partials per (row, KV head).

        A method brings its own tile functions (`@triton.jit`, passed as constexprs) and `args`, a tuple of its
        pointers and strides; C is a namedtuple of its compile-time constants:
        - PREPARE(args, C, q_row, sqh, b, h, pid, start, end, qk_scale) -> (st, acc): per-(row, head) state (a tuple
          carried through the loop: query operands, parameters loaded a tile ahead) and its accumulator (any tuple);
        - SCORES(args, C, st, t0, t, tm, end, qk_scale) -> (s, tile, st): scores [BLOCK_T, GPK] of tokens t (tm: the
          valid ones), log2 domain (the scale folded in), masked here afterwards; `tile`: what VALUES needs of it;
        - VALUES(args, C, st, tile, acc, p, alpha, t, tm) -> acc: acc rescaled by alpha [GPK] plus p [BLOCK_T, GPK]
          times the tile's values (p and alpha are 0 on padding heads);
        - FINISH(args, C, st, acc, m, l) -> (out, channels, cols, m, l): the weighted value sum [D, GPV] with its
          rows' channels and its columns' heads (HEADS_FIRST: [GPV, D], rows the heads), and the softmax state;
        - SOFTMAX(C, st, s, m, l, ok) -> (p, alpha, m, l), or None for the online softmax (softmax_tile): a method's
          own weights of a tile (CalibQuant's fixed reference).
        TAIL: a split's whole tiles run without masks (tm a constant true), its last, partial tile after them.
        FIRST (a compressed sliding-window layer): row b attends to its slots from first_ptr[b] on; the tile holding
        that slot is the first one walked, its earlier slots masked like those past the end (tm false; no TAIL).
        CAP: the model's score soft-cap in log2 units (soft_cap; 0: none), applied to every tile's scores and the
        full-precision part's before the softmax, to the scores SCORES returns (one that also writes its scores out
        caps that copy itself: KVQuant's value pass).
        A tile function reads its constants as `X: tl.constexpr = C[i]` (Triton 3.6 drops constexpr-ness when a
        tuple is unpacked), and no assignment unpacks a nested tuple (3.6's dependency finder fails on one)."""
        ACC: tl.constexpr = m_ptr.dtype.element_ty  # softmax state and sums: float64 for float64, else float32
        # (not a tl.dtype launch argument: one, and a torch scalar built per call, made int4 measurably slower at
        # 32K x 8, small shapes more so)
        # scalar arguments arrive as float32: the scale comes in two parts so float64 gets it to ~2^-48
        if PREC == 64:
            qk_scale = tl.cast(qk_scale_hi, ACC) + tl.cast(qk_scale_lo, ACC)
        else:
            qk_scale = qk_scale_hi
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        q_row = q_ptr + b * sqb + h * G * sqh
        part = pid * S + split
        if split < NSPLIT:
            start, end = split_bounds(len_ptr, b, split, NSPLIT, BLOCK_T, first_ptr, FIRST)
            first = 0
            if FIRST:
                first = tl.load(first_ptr + b)
            rk = tl.arange(0, GPK)
            st, acc = PREPARE(args, C, q_row, sqh, b, h, pid, start, end, qk_scale)
            m_i = tl.full((GPK,), float("-inf"), ACC)
            l_i = tl.zeros((GPK,), ACC)
            if TAIL and not FIRST:  # whole tiles without masks, then the split's last, partial tile (splits start on
                # tile bounds)
                full = start + tl.maximum(end - start, 0) // BLOCK_T * BLOCK_T
                st, acc, m_i, l_i = _split_k_tiles(args, C, st, acc, m_i, l_i, start, full, end, qk_scale, rk, SCORES,
                                                   VALUES, SOFTMAX, G, BLOCK_T, False, CAP, first)
                st, acc, m_i, l_i = _split_k_tiles(args, C, st, acc, m_i, l_i, full, end, end, qk_scale, rk, SCORES,
                                                   VALUES, SOFTMAX, G, BLOCK_T, True, CAP, first)
            else:
                st, acc, m_i, l_i = _split_k_tiles(args, C, st, acc, m_i, l_i, start, end, end, qk_scale, rk, SCORES,
                                                   VALUES, SOFTMAX, G, BLOCK_T, True, CAP, first)
            out, channels, cols, m_i, l_i = FINISH(args, C, st, acc, m_i, l_i)
            store_partial(m_ptr, l_ptr, acc_ptr, part, G, D, out, channels, cols, m_i, l_i, rk, HEADS_FIRST)
        if HAS_FP:
            if split == NSPLIT:  # the full-precision part (sinks, window, residual), post-RoPE
                fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, F = fp
                fp_segment(q_row, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, 0, F, b, h, part, m_ptr, l_ptr,
                           acc_ptr, qk_scale, D, G, GPF, BLOCK_F, INTERP, CAP)

    @triton.jit
    def _split_k_tiles(args, C: tl.constexpr, st, acc, m_i, l_i, lo, hi, end, qk_scale, rk, SCORES: tl.constexpr,
                       VALUES: tl.constexpr, SOFTMAX: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr,
                       MASKED: tl.constexpr, CAP: tl.constexpr, first):
        """split_k_kernel's tiles t0 in [lo, hi) of a split ending at `end` (MASKED False: whole tiles, no masks), the
        tokens before `first` masked too (MASKED)."""
        for t0 in range(lo, hi, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            if MASKED:
                tm = (t < end) & (t >= first)
            else:
                tm = tl.full((BLOCK_T,), 1, tl.int1)
            s, tile, st = SCORES(args, C, st, t0, t, tm, end, qk_scale)
            s = soft_cap(s, CAP)
            if MASKED:
                s = tl.where(tm[:, None], s, float("-inf"))
            if SOFTMAX is None:
                p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, rk < G)
            else:
                p, alpha, m_i, l_i = SOFTMAX(C, st, s, m_i, l_i, rk < G)
            acc = VALUES(args, C, st, tile, acc, p, alpha, t, tm)
        return st, acc, m_i, l_i

    @triton.jit
    def prefetch_tiles(krow0, vrow0, t0, end, skt, svt, AHEAD: tl.constexpr, BLOCK_T: tl.constexpr,
                       KROW: tl.constexpr, VROW: tl.constexpr, INTERP: tl.constexpr):
        """The key and value code rows of the tile AHEAD tiles past t0 into L2 (nothing for AHEAD 0 or under the
        interpreter); the rows of a tile are contiguous, KROW / VROW bytes each (code_rows checked it)."""
        if AHEAD > 0 and not INTERP:
            tp = t0 + AHEAD * BLOCK_T
            nrow = tl.minimum(end - tp, BLOCK_T)
            prefetch_l2(krow0 + tp * skt, nrow * KROW)
            prefetch_l2(vrow0 + tp * svt, nrow * VROW)

    @triton.jit
    def rotate_query(q1, q2, cos_ptr, sin_ptr, p0, ch, D: tl.constexpr):
        """R(-p0) q for the query halves q1, q2 [HD, heads] whose rows are channels ch: (q1 c + q2 s, q2 c - q1 s)."""
        c0 = tl.load(cos_ptr + p0 * D + ch)[:, None]
        s0 = tl.load(sin_ptr + p0 * D + ch)[:, None]
        return q1 * c0 + q2 * s0, q2 * c0 - q1 * s0

    @triton.jit
    def prefetch_l2(ptr, nbytes):
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
    def fp_segment(q_row, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, F0, F, b, h, part, m_ptr, l_ptr,
                    acc_ptr, qk_scale, D: tl.constexpr, G: tl.constexpr, GPF: tl.constexpr, BLOCK_F: tl.constexpr,
                    INTERP: tl.constexpr, CAP: tl.constexpr = 0.0):
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
            s = tl.where(ok[None, :], soft_cap(dot(qx, tl.trans(kf), INTERP) * qk_scale, CAP), float("-inf"))
            m_new = tl.maximum(mf, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(mf - m_use)
            p = tl.exp2(s - m_use[:, None])
            lf = lf * alpha + tl.sum(p, 1)
            mf = m_new
            p_hi = p.to(DT)  # p = p_hi + p_lo: two dots keep P at ~fp32 precision (F is small)
            p_lo = (p - p_hi.to(ACC)).to(DT)
            af = af * alpha[:, None] + dot(p_hi, vf, INTERP) + dot(p_lo, vf, INTERP)
        tl.store(acc_ptr + (part * G + rf)[:, None] * D + dd[None, :], af, mask=(rf < G)[:, None])
        tl.store(m_ptr + part * G + rf, mf, mask=rf < G)
        tl.store(l_ptr + part * G + rf, lf, mask=rf < G)

    @triton.jit
    def _fp_kernel(q_ptr, sqb, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, F, m_ptr, l_ptr, acc_ptr, HKV,
                   qk_scale, S, CHUNK, D: tl.constexpr, G: tl.constexpr, GPF: tl.constexpr, BLOCK_F: tl.constexpr,
                   INTERP: tl.constexpr, WAIT_PRIOR: tl.constexpr, CAP: tl.constexpr = 0.0):
        """The full-precision segment alone, where the packed kernel should not carry the segment's shared-memory
        tiles (attention_frag): program (row and KV head, j) takes tokens [j CHUNK, (j + 1) CHUNK), into partial
        S - num_programs(1) + j of the row and head's S (chunks of a few tiles: one program walking a whole window tile
        by tile waits on load latency)."""
        pid = tl.program_id(0)
        j = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        f0 = j * CHUNK
        fp_segment(q_ptr + b * sqb + h * G * sqh, sqh, fk_ptr, fv_ptr, sfb, sfh, sft, fval_ptr, sfvb, f0,
                    tl.minimum(F, f0 + CHUNK), b, h, pid * S + S - tl.num_programs(1) + j, m_ptr, l_ptr, acc_ptr,
                    qk_scale, D, G, GPF, BLOCK_F, INTERP, CAP)
        if WAIT_PRIOR:  # launched to overlap the fragment kernel: finish only after it, so the reduction sees both
            wait_prior_grid()

    @triton.jit
    def _reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, vo_ptr, G: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                       D: tl.constexpr, VO_GP: tl.constexpr, VO_UNIT: tl.constexpr, SC: tl.constexpr,
                       DC: tl.constexpr):
        """Merge the S partials (max, sum, acc) of one query head for DC of its channels, SC partials at a time (each
        of a head's D / DC programs reads all S maxima and sums itself, S floats each; all S at once over 128
        channels spilled at batch 1: 265 partials took 168 bytes of stack per thread, and with the value sums a
        launch failed with "out of memory" in kvcal bench generate). VO_GP > 0: add the extra sums vo_ptr [row and
        KV head, S, D, VO_GP] (a storage's separate pass, e.g. sparse value residuals: float32, or int64 fixed point
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
                if vo_ptr.dtype.element_ty == tl.int64:  # fixed point
                    vo = vo.to(tl.float32) * VO_UNIT
                acc += vo
            o += tl.sum(wc[:, None] * acc, 0)
        o = o / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + pid * D + dd, o.to(out_ptr.dtype.element_ty))

    # ---- fragment-MMA helpers: one warp, every tensor 32 elements (one per lane); PTX on the GPU, the same
    # semantics from tensor ops under the interpreter

    @triton.jit
    def halves(x):
        """int32 [32] holding fp16 pairs -> (low half, high half) as float32."""
        lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((x >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def pack_half2(lo, hi, INTERP: tl.constexpr):
        """Two float32 [32] -> one int32 [32] of fp16 (lo, hi), each rounded to nearest."""
        if INTERP:
            lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            return lo16 | (hi16 << 16)
        else:
            return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                             is_pure=True, pack=1)

    @triton.jit
    def shfl_xor(x, MASK: tl.constexpr, INTERP: tl.constexpr):
        """x of lane (l xor MASK), float32 [32]."""
        if INTERP:
            return tl.gather(x, tl.arange(0, 32) ^ MASK, 0)
        else:
            y = tl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {MASK}, 0x1f, 0xffffffff;", "=r,r",
                                          [x.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1)
            return y.to(tl.float32, bitcast=True)

    @triton.jit
    def shfl_idx(x, src, INTERP: tl.constexpr):
        """x of lane src (int32 [32] in [0, 32)), float32 [32]."""
        if INTERP:
            return tl.gather(x, src, 0)
        else:
            y = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                                          [x.to(tl.int32, bitcast=True), src], dtype=tl.int32, is_pure=True, pack=1)
            return y.to(tl.float32, bitcast=True)

    @triton.jit
    def transpose8(x, INTERP: tl.constexpr):
        """Transpose of the 8 x 8 fp16 matrix whose row g, cols (2c, 2c + 1) lane 4g + c holds (movmatrix)."""
        if INTERP:
            lo, hi = halves(x)
            m = tl.trans(tl.reshape(tl.join(lo, hi), (8, 8)))
            e0, e1 = tl.split(tl.reshape(m, (8, 4, 2)))
            return pack_half2(tl.reshape(e0, (32,)), tl.reshape(e1, (32,)), INTERP)
        else:
            return tl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [x],
                                             dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def byte_pair(x, y, K: tl.constexpr, INTERP: tl.constexpr):
        """Byte K of x in bits [0, 8) and byte K of y in bits [16, 24) (one prmt on the GPU)."""
        if INTERP:
            return ((x >> (8 * K)) & 0xFF) | (((y >> (8 * K)) & 0xFF) << 16)
        else:
            sel: tl.constexpr = K | (K << 4) | ((4 + K) << 8) | ((4 + K) << 12)
            return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [x, y], dtype=tl.int32,
                                             is_pure=True, pack=1)

    @triton.jit
    def lane_words(ptr, N: tl.constexpr, VEC: tl.constexpr, INTERP: tl.constexpr):
        """N consecutive int32 words from each lane's `ptr` as a tuple. VEC (ptr 4 N-byte aligned; N = 2 or 4): one
        vector load (ld.global.nc.v2 / v4) instead of N scalar ones, whose warp-wide loads would each touch every
        sector of the rows and use a quarter of it (a lane's words are 16 bytes apart from the next lane's)."""
        if INTERP or N == 1 or not VEC:
            words = ()
            for w in tl.static_range(N):
                words = words + (tl.load(ptr + w),)
            return words
        elif N == 2:
            return tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [ptr.to(tl.int64)],
                                             dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                             [ptr.to(tl.int64)], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                             is_pure=True, pack=1)

    @triton.jit
    def launch_dependents():
        """Programmatic dependent launch (sm_90): the next kernel, if launched with launch_pdl, may start once every
        program of this one has run this (a no-op otherwise)."""
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def wait_prior_grid():
        """Block until the kernel before this one in the stream has completed and its writes are visible (a no-op
        when this kernel was not launched with launch_pdl)."""
        tl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)

    @triton.jit
    def _emulated_a(x0, x1):
        """A fragment registers (row g, cols 2c + e) and (row g, cols 8 + 2c + e) -> the 8 x 16 matrix rows."""
        lo0, hi0 = halves(x0)
        lo1, hi1 = halves(x1)
        m0 = tl.reshape(tl.join(lo0, hi0), (8, 8))
        m1 = tl.reshape(tl.join(lo1, hi1), (8, 8))
        return tl.reshape(tl.permute(tl.join(m0, m1), (0, 2, 1)), (8, 16))

    @triton.jit
    def _emulated_d(d):
        """8 x 8 result block (row g, col n) -> the fragment halves (row g, col 2c) and (row g, col 2c + 1)."""
        e0, e1 = tl.split(tl.reshape(d, (8, 4, 2)))
        return tl.reshape(e0, (32,)), tl.reshape(e1, (32,))

    @triton.jit
    def mma16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, INTERP: tl.constexpr):
        """D = A B + C for one warp-wide mma.sync.m16n8k16 (fp16 operands as int32 pairs, float32 C and D)."""
        if INTERP:
            bt = _emulated_a(b0, b1)  # B^T [8 cols, 16 rows]: same register pattern as A's rows
            top = tl.sum(_emulated_a(a0, a2)[:, None, :] * bt[None, :, :], 2)
            bot = tl.sum(_emulated_a(a1, a3)[:, None, :] * bt[None, :, :], 2)
            d0, d1 = _emulated_d(top)
            d2, d3 = _emulated_d(bot)
            return c0 + d0, c1 + d1, c2 + d2, c3 + d3
        else:
            return tl.inline_asm_elementwise(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
                "{$10,$11,$12,$13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


def word_alignment(codes: torch.Tensor, strides) -> int:
    """Largest of 4, 2, 1 words that divides every row start of `codes` (its (batch, head, token) strides and
    its address): the kernel's hint for 16-byte loads."""
    align = 4
    while align > 1 and (any(s % align for s in strides) or codes.data_ptr() % (4 * align)):
        align //= 2
    return align


def same_layout(a: torch.Tensor, b: torch.Tensor):
    if a.stride() == b.stride():
        return a, b
    return a.contiguous(), b.contiguous()


def fp_args(fp_k, fp_v, fp_valid, has_fp: bool, dev):
    """(keys, values, valid mask as uint8, (row, head, token) strides, mask row stride) of the full-precision
    segment, placeholders without one."""
    if not has_fp:
        dummy, dummy_i = placeholders(dev)
        return dummy, dummy, dummy_i, (0, 0, 0), 0
    fk, fv = fp_k, fp_v
    if fk.stride() != fv.stride() or fk.stride(-1) != 1:
        fk, fv = fk.contiguous(), fv.contiguous()
    fval = fp_valid.to(torch.bool).contiguous().view(torch.uint8)
    return fk, fv, fval, fk.stride()[:3], fval.stride(0)


def decode_dims(q: torch.Tensor, heads: int):
    """(q with unit channel stride, batch, KV heads, query heads per KV head, head_dim, device) of a decode step's
    queries q [B, Hq, D] over `heads` KV heads."""
    batch, hq, d = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q, batch, heads, hq // heads, d, q.device


def split_count(num_splits: int | None, programs_per_sm: int | None, dev, rows: int, tokens: int, block_t: int,
                default_programs: int = 16) -> int:
    """Token splits per (row, KV head) of a split-K kernel: num_splits if given, else enough programs for
    programs_per_sm (default_programs) per SM over the `rows` (row, KV head) pairs, at most one per 4 tiles of the
    `tokens`-slot buffer."""
    if num_splits:
        return int(num_splits)
    target = (programs_per_sm or default_programs) * sm_count(dev)
    return max(1, min(triton.cdiv(target, rows), triton.cdiv(tokens, 4 * block_t)))


def launch_options(q: torch.Tensor, num_warps: int, num_stages: int | None = None,
                   max_registers: int | None = None) -> dict:
    """Launch options of a decode kernel: warps, pipeline stages and a register cap where given, and no FMA
    contraction for float64 queries (their float32 dequantization rounds as the reference's)."""
    opts = {"num_warps": num_warps}
    if max_registers:
        opts["maxnreg"] = int(max_registers)
    if num_stages is not None:
        opts["num_stages"] = num_stages
    if q.dtype == torch.float64:
        opts["enable_fp_fusion"] = False
    return opts


def code_rows(kc: torch.Tensor, vc: torch.Tensor, dev):
    """(key and value row alignment in words (word_alignment), key and value row bytes, whether the tiles' rows can be
    prefetched into L2) of code buffers [B, H, T, words]: bulk prefetch needs sm_90+, a tile's rows contiguous, 16-byte
    aligned and a multiple of 16 bytes each."""
    ks, vs = kc.stride()[:3], vc.stride()[:3]
    kalign, valign = word_alignment(kc, ks), word_alignment(vc, vs)
    krow, vrow = 4 * kc.shape[-1], 4 * vc.shape[-1]
    can = (sm90_or_newer(dev) and krow % 16 == 0 and vrow % 16 == 0 and ks[2] == kc.shape[-1]
           and vs[2] == vc.shape[-1] and kalign == 4 and valign == 4)
    return kalign, valign, krow, vrow, can


def launch_split_k(tiles, q: torch.Tensor, lengths: torch.Tensor, scale: float, fp, nsplit: int, heads: int, args,
                   consts, *, gpk: int, block_t: int, opts: dict, prec: int, block_f: int | None = None,
                   fp_in_kernel: bool = True, merge_warps: int | None = None, softmax=None,
                   whole_tiles: bool = False, heads_first: bool = False, softcap: float | None = None,
                   first: torch.Tensor | None = None) -> Partials:
    """Partials of q [B, Hq, D] by split_k_kernel with a method's tile functions `tiles` (PREPARE, SCORES, VALUES,
    FINISH), its argument tuple `args` and constants `consts` (a namedtuple: the tile functions index it, tests and
    readers see the names), over `nsplit` splits of each row's packed tokens (`lengths` [B]) and the full-precision
    part `fp` (runtime.decode.FullPrecision or None): as the kernel's last split (fp_in_kernel) or by the generic
    full-precision kernel into splits of their own (fp_partials_into). softmax: the method's SOFTMAX tile function
    (None: the online softmax); whole_tiles: TAIL; heads_first: FINISH returns the sums heads first (HEADS_FIRST);
    softcap: the model's score soft-cap (Gemma 2: s -> softcap tanh(s / softcap)), None for none; first: a compressed
    sliding-window layer's first slot per row (Packed.first), None for none."""
    q, batch, heads, group, d, dev = decode_dims(q, heads)
    has_fp = fp is not None and fp_in_kernel
    splits = nsplit + (1 if has_fp else fp_splits(fp))
    parts = Partials.empty(batch * heads, splits, group, d, q.dtype, dev)
    if merge_warps is not None:
        parts.merge_warps = merge_warps
    fk, fv, fval, f_strides, sfvb = fp_args(fp.k if has_fp else None, fp.v if has_fp else None,
                                            fp.valid if has_fp else None, has_fp, dev)
    qk_hi, qk_lo = qk_scale_parts(scale)
    prepare, scores, values, finish = tiles
    with launch_device(q):
        split_k_kernel[(batch * heads, nsplit + int(has_fp))](
            q, q.stride(0), q.stride(1), lengths, lengths if first is None else first, tuple(args),
            (fk, fv, *f_strides, fval, sfvb, fp.slots if has_fp else 0),
            parts.m, parts.l, parts.acc, heads, qk_hi, qk_lo, nsplit, splits,
            C=consts, PREPARE=prepare, SCORES=scores, VALUES=values, FINISH=finish, SOFTMAX=softmax,
            TAIL=int(whole_tiles), HEADS_FIRST=int(heads_first), D=d, G=group, GPK=gpk,
            GPF=max(pow2(group), 16), HAS_FP=int(has_fp), BLOCK_T=block_t, BLOCK_F=block_f or 16,
            INTERP=INTERPRET, PREC=prec, CAP=cap_log2(softcap), FIRST=int(first is not None), **opts,
        )
    if fp is not None and not fp_in_kernel:
        fp_partials_into(q, fp, scale, parts, nsplit, block_f=block_f or 16, softcap=softcap)
    return parts


def cap_log2(softcap: float | None) -> float:
    """The CAP constant of the kernels (soft_cap) for a model's score soft-cap: softcap log2(e), 0.0 for none."""
    return 0.0 if softcap is None else float(softcap) * LOG2E


def fp_partials_into(q: torch.Tensor, fp, scale: float, parts, first: int, pdl: bool = False,
                     block_f: int = 16, softcap: float | None = None) -> None:
    """The full-precision part's partials into splits [first, first + fp_splits(fp)) of `parts` (runtime.decode.
    Partials with S splits per (row, KV head)): one program per FP_CHUNK tokens. pdl (sm_90): launched to overlap the
    kernel before it (launched with launch_dependents), finishing only after it. softcap: as launch_split_k's."""
    batch, hq, d = q.shape
    hkv = fp.k.shape[1]
    group = hq // hkv
    nf = fp.slots
    fk, fv, fval, f_strides, sfvb = fp_args(fp.k, fp.v, fp.valid, True, q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    splits = parts.m.shape[1]
    if first + fp_splits(fp) != splits:
        raise ValueError("the full-precision splits must be the last ones of the partials")
    with launch_device(q):
        _fp_kernel[(batch * hkv, fp_splits(fp))](
            q, q.stride(0), q.stride(1), fk, fv, *f_strides, fval, sfvb, nf, parts.m, parts.l, parts.acc, hkv,
            float(scale) * LOG2E, splits, FP_CHUNK, D=d, G=group, GPF=max(pow2(group), 16), BLOCK_F=block_f,
            INTERP=INTERPRET, WAIT_PRIOR=int(pdl), CAP=cap_log2(softcap), num_warps=1,
            **({"launch_pdl": True} if pdl else {}))


def fp_splits(fp) -> int:
    """Splits the generic full-precision kernel writes for `fp` (0 for None)."""
    return 0 if fp is None else triton.cdiv(fp.slots, FP_CHUNK)


def fp_partials_triton(q: torch.Tensor, fp, scale: float, softcap: float | None = None):
    """Partials of the full-precision part alone (a cache whose storage holds no token yet)."""
    batch, hq, d = q.shape
    hkv = fp.k.shape[1]
    parts = Partials.empty(batch * hkv, fp_splits(fp), hq // hkv, d, q.dtype, q.device)
    fp_partials_into(q, fp, scale, parts, 0, softcap=softcap)
    return parts


def merge_triton(parts, q: torch.Tensor) -> torch.Tensor:
    """Combine the S splits of `parts` into the output [B, Hq, D] in q's dtype: one program per (row, query head,
    REDUCE_CHANNELS channels), REDUCE_CHUNK partials per step at 4 warps (a quarter at 1 warp, the same registers per
    thread). Extra sums (parts.extra [R, S, D, GP], float32 or int64 fixed point) are added to each acc."""
    batch, hq, d = q.shape
    splits = parts.m.shape[1]
    group = parts.m.shape[2]
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=q.device)
    extra = parts.extra if parts.extra is not None else parts.m
    extra_gp = parts.extra.shape[-1] if parts.extra is not None else 0
    warps = parts.merge_warps
    dc = min(d, REDUCE_CHANNELS)
    chunk = min(pow2(splits), max(1, REDUCE_CHUNK * warps // 4))
    with launch_device(q):
        _reduce_kernel[(batch * hq, d // dc)](parts.m, parts.l, parts.acc, out, extra, group, splits, pow2(splits), d,
                                              extra_gp, float(parts.extra_unit), chunk, dc, num_warps=warps)
    return out
