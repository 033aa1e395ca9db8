"""A static decode step of a cache with a residual ring (KIVI): append the new token to its row's ring and, in
the rows whose ring is full, pack the oldest block, with every position read on the device.

`ring_step(...)` (torch reference) and `ring_step_triton(...)` (two kernels: the step per (row, head), then
the per-row counters) have the same signature and leave the same buffers, bit for bit. Eager steps do the
same on host-side positions (PackedLayer._append_step, then _flush_rows); a static step cannot, because a
CUDA graph replays fixed kernels and indices, and which rows flush is known only on the device.

Formats: keys affine_tokens (per channel over a block of `block` tokens, one scale/zero per block), values
affine_channels (per token, groups of `value_group` channels): what KIVI stores. Buffers as in
runtime/cache.py: ring slots fp_k/fp_v [B, H, sink + ring, D] (keys after RoPE), fp_valid [B, sink + ring];
codes [B, H, T, W]; key scale/zero [B, H, T / block, D]; value scale/zero [B, H, T, D / value_group];
ring_start, ring_count [B] int64 and lengths [B] int32 (packed tokens per row), updated in place.
Slots [lengths[b], lengths[b] + block) must exist in every row (PackedLayer.static_room accounts for it).
"""

from __future__ import annotations

import torch

from kvcal.runtime.quantize import quantize_affine_channels, quantize_affine_token_blocks


def ring_step(k, v, fp_k, fp_v, fp_valid, ring_start, ring_count, lengths, k_codes, k_scale, k_zero, v_codes,
              v_scale, v_zero, *, sink: int, residual: int, block: int, key_bits: int, value_bits: int,
              value_group: int) -> None:
    """Token k, v [B, H, D] per row. Vectorized over rows with no host synchronization: every row's oldest
    block is quantized, and written where its row flushes (torch.where keeps the other rows' slots)."""
    batch, heads, dim = k.shape
    ring = fp_valid.shape[1] - sink
    rows = torch.arange(batch, device=k.device)
    slot = sink + (ring_start + ring_count) % ring
    fp_k[rows, :, slot] = k
    fp_v[rows, :, slot] = v
    fp_valid[rows, slot] = torch.ones(batch, dtype=torch.bool, device=k.device)
    flush = ring_count + 1 >= residual + block  # [B]: what _flush_rows decides on the host
    oldest = sink + (ring_start[:, None] + torch.arange(block, device=k.device)) % ring  # [B, block], oldest first
    at = (rows[:, None], slice(None), lengths.long()[:, None] + torch.arange(block, device=k.device))
    tokens = (batch * block, heads, dim)
    kc, ks, kz = quantize_affine_token_blocks(fp_k[rows[:, None], :, oldest].reshape(tokens), key_bits, block)
    vc, vs, vz = quantize_affine_channels(fp_v[rows[:, None], :, oldest].reshape(tokens), value_bits, value_group)
    per_token = flush[:, None, None, None]
    k_codes[at] = torch.where(per_token, kc.view(batch, block, heads, -1), k_codes[at])
    v_codes[at] = torch.where(per_token, vc.view(batch, block, heads, -1), v_codes[at])
    v_scale[at] = torch.where(per_token, vs.view(batch, block, heads, -1), v_scale[at])
    v_zero[at] = torch.where(per_token, vz.view(batch, block, heads, -1), v_zero[at])
    key_block = (rows, slice(None), lengths.long() // block)
    k_scale[key_block] = torch.where(flush[:, None, None], ks, k_scale[key_block])
    k_zero[key_block] = torch.where(flush[:, None, None], kz, k_zero[key_block])
    fp_valid[rows[:, None], oldest] = fp_valid[rows[:, None], oldest] & ~flush[:, None]
    _advance(ring_start, ring_count, lengths, flush, block, ring)


def _advance(ring_start, ring_count, lengths, flush, block: int, ring: int) -> None:
    moved = flush.to(torch.int64) * block
    lengths += moved.to(lengths.dtype)
    ring_start.copy_((ring_start + moved) % ring)
    ring_count += 1 - moved


# ---- Triton ---------------------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from kvcal.runtime.packing import _pow2, launch_device, words_per_vector  # noqa: E402

if triton is not None:
    from kvcal.runtime.packing import pack_tile
    from kvcal.runtime.quantize import _affine_codes, _affine_params

    @triton.jit
    def _ring_step_kernel(k_ptr, skb, skh, v_ptr, svb, svh, fpk_ptr, fpv_ptr, sfb, sfh, sft, valid_ptr, sval,
                          start_ptr, count_ptr, len_ptr,
                          kc_ptr, skcb, skch, skct, ks_ptr, kz_ptr, sksb, sksh, skst,
                          vc_ptr, svcb, svch, svct, vs_ptr, vz_ptr, svsb, svsh, svst,
                          SINK: tl.constexpr, RING: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                          D: tl.constexpr, KBITS: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr,
                          VBITS: tl.constexpr, VW: tl.constexpr, VWP: tl.constexpr, VGROUPS: tl.constexpr,
                          R: tl.constexpr):
        """Program (b, h): append row b's token for head h, then, if the row's ring is full, pack head h of its
        oldest block, R tokens at a time (head 0 also releases the row's fp slots). The counters are left to
        _ring_counters_kernel (the other heads' programs still read them)."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        start = tl.load(start_ptr + b)
        count = tl.load(count_ptr + b)
        slot = SINK + (start + count) % RING
        fp_row = b * sfb + h * sfh
        tl.store(fpk_ptr + fp_row + slot * sft + d, tl.load(k_ptr + b * skb + h * skh + d))
        tl.store(fpv_ptr + fp_row + slot * sft + d, tl.load(v_ptr + b * svb + h * svh + d))
        if h == 0:
            tl.store(valid_ptr + b * sval + slot, 1)
        if count + 1 >= RESIDUAL + BLOCK:
            tl.debug_barrier()  # with residual 0 the block holds the token just stored (by other threads)
            length = tl.load(len_ptr + b).to(tl.int64)
            # keys: one scale/zero per channel over the block (quantize_affine_token_blocks' arithmetic)
            KLEVELS: tl.constexpr = 1 << KBITS
            ts = SINK + (start + tl.arange(0, BLOCK)) % RING
            x = tl.load(fpk_ptr + fp_row + ts[:, None] * sft + d[None, :]).to(tl.float32)
            zero, scale = _affine_params(tl.min(x, 0), tl.max(x, 0), KLEVELS)
            at = b * sksb + h * sksh + (length // BLOCK) * skst + d
            tl.store(ks_ptr + at, scale.to(tl.float16))
            tl.store(kz_ptr + at, zero.to(tl.float16))
            # values: per token, groups of D / VGROUPS channels (quantize_affine_channels' arithmetic)
            VLEVELS: tl.constexpr = 1 << VBITS
            GS: tl.constexpr = D // VGROUPS
            kw = tl.arange(0, KWP)
            vw = tl.arange(0, VWP)
            g = tl.arange(0, VGROUPS)
            for c0 in tl.static_range(0, BLOCK, R):  # R tokens at a time: pack_tile's [R, WP, D] stays small
                j = c0 + tl.arange(0, R)
                tj = SINK + (start + j) % RING
                dest = length + j
                xj = tl.load(fpk_ptr + fp_row + tj[:, None] * sft + d[None, :]).to(tl.float32)
                words = pack_tile(_affine_codes(xj, zero[None, :], scale[None, :], KLEVELS), R, D, KBITS, KWP)
                tl.store(kc_ptr + b * skcb + h * skch + dest[:, None] * skct + kw[None, :], words,
                         mask=(kw < KW)[None, :])
                y = tl.reshape(tl.load(fpv_ptr + fp_row + tj[:, None] * sft + d[None, :]).to(tl.float32),
                               (R, VGROUPS, GS))
                vzero, vscale = _affine_params(tl.min(y, 2), tl.max(y, 2), VLEVELS)
                codes = tl.reshape(_affine_codes(y, vzero[:, :, None], vscale[:, :, None], VLEVELS), (R, D))
                tl.store(vc_ptr + b * svcb + h * svch + dest[:, None] * svct + vw[None, :],
                         pack_tile(codes, R, D, VBITS, VWP), mask=(vw < VW)[None, :])
                vat = b * svsb + h * svsh + dest[:, None] * svst + g[None, :]
                tl.store(vs_ptr + vat, vscale.to(tl.float16))
                tl.store(vz_ptr + vat, vzero.to(tl.float16))
            if h == 0:
                tl.store(valid_ptr + b * sval + ts, tl.zeros((BLOCK,), tl.int8))

    @triton.jit
    def _ring_counters_kernel(start_ptr, count_ptr, len_ptr, B, RING: tl.constexpr, RESIDUAL: tl.constexpr,
                              BLOCK: tl.constexpr, BP: tl.constexpr):
        r = tl.arange(0, BP)
        m = r < B
        start = tl.load(start_ptr + r, mask=m, other=0)
        count = tl.load(count_ptr + r, mask=m, other=0) + 1
        moved = tl.where(count >= RESIDUAL + BLOCK, BLOCK, 0)
        tl.store(start_ptr + r, (start + moved) % RING, mask=m)
        tl.store(count_ptr + r, count - moved, mask=m)
        length = tl.load(len_ptr + r, mask=m, other=0)
        tl.store(len_ptr + r, length + moved.to(length.dtype), mask=m)


def _triton_ok(k, v, block: int, value_group: int, key_bits: int, value_bits: int) -> bool:
    dim = k.shape[2]
    sizes = (dim, block, dim // value_group)
    return (triton is not None and all(s >= 1 and s & (s - 1) == 0 for s in sizes) and not dim % value_group
            and dim >= 32 and max(key_bits, value_bits) <= 8 and k.stride(2) == 1 and v.stride(2) == 1)


def ring_step_triton(k, v, fp_k, fp_v, fp_valid, ring_start, ring_count, lengths, k_codes, k_scale, k_zero, v_codes,
                     v_scale, v_zero, *, sink: int, residual: int, block: int, key_bits: int, value_bits: int,
                     value_group: int) -> None:
    args = (k, v, fp_k, fp_v, fp_valid, ring_start, ring_count, lengths, k_codes, k_scale, k_zero, v_codes, v_scale,
            v_zero)
    settings = dict(sink=sink, residual=residual, block=block, key_bits=key_bits, value_bits=value_bits,
                    value_group=value_group)
    if not _triton_ok(k, v, block, value_group, key_bits, value_bits):
        return ring_step(*args, **settings)
    batch, heads, dim = k.shape
    ring = fp_valid.shape[1] - sink
    kw, vw = words_per_vector(dim, key_bits), words_per_vector(dim, value_bits)
    valid = fp_valid.view(torch.int8)  # bool storage, written as bytes
    with launch_device(k):
        _ring_step_kernel[(batch, heads)](
            k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), fp_k, fp_v, fp_k.stride(0), fp_k.stride(1),
            fp_k.stride(2), valid, valid.stride(0), ring_start, ring_count, lengths,
            k_codes, k_codes.stride(0), k_codes.stride(1), k_codes.stride(2), k_scale, k_zero, k_scale.stride(0),
            k_scale.stride(1), k_scale.stride(2),
            v_codes, v_codes.stride(0), v_codes.stride(1), v_codes.stride(2), v_scale, v_zero, v_scale.stride(0),
            v_scale.stride(1), v_scale.stride(2),
            sink, ring, residual, block, dim, key_bits, kw, _pow2(kw), value_bits, vw, _pow2(vw), dim // value_group,
            min(4, block), enable_fp_fusion=False)
        _ring_counters_kernel[(1,)](ring_start, ring_count, lengths, batch, ring, residual, block, _pow2(batch))
