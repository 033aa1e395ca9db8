"""The E-step of the commutative-codebook EM as one Triton kernel (the torch reference: vq.e_step_groups).

The torch E-step writes a [G, chunk, N, N] block of squared distances and passes over it about ten times (the
broadcast sum, the cross term, the clamp, the min, sqrt, shift, scale, exp, two marginal sums, the counts): at
Llama-3.1-8B shapes (8 groups x 16384 points x 4096 centres) that is ~2 GB per pass, and the E-step is bound by
memory. The squared distance is p_a + q_b + G_ab (vq.squared_distances: p holds |r|^2), so one program can build a
point's N x N tile in registers from p [N], q [N] and G [N, N] and never store it:

- grid (point blocks, groups); program (m, g) loads G_g once and runs over its BLOCK_P points;
- per point: d2 = max(p_a + q_b + G_ab, 0) on the [NP, NP] tile (NP = N padded to a power of two >= 16, padding at
  +inf), its min and argmin (first index, as torch.min), then the weights w = exp((sqrt(min) - sqrt(d2)) / T)
  (the nearest centre weighs exactly 1, as the reference) or the one-hot of the argmin (HARD), Z = sum w, the
  marginals sum_b w / Z and sum_a w / Z (stored per point: the right-hand sides are two small GEMMs in torch),
  1 / Z (the max weight), and w / Z added to the program's counts tile;
- the counts tile of a program is stored as a partial [G, blocks, NP, NP] that torch sums in a fixed order
  (deterministic: no atomics).

Global traffic is O(G M N), the arithmetic ~15 flops per (point, centre). Float32 throughout; exp2 with the log2(e)
factor folded into 1/T, sqrt rounded to nearest (tl.sqrt_rn, as torch).
"""

from __future__ import annotations

import torch

from kvcal.quant.packing import launch_device, pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

LOG2E = 1.4426950408889634
BLOCK_P = 64  # points per program: its counts partial is amortised over them


if triton is not None:

    @triton.jit
    def _e_step_kernel(p_ptr, q_ptr, cross_ptr, best_ptr, index_ptr, wa_ptr, wb_ptr, inv_z_ptr, counts_ptr,
                       m, n, scale, NP: tl.constexpr, BLOCK_P: tl.constexpr, HARD: tl.constexpr):
        pid = tl.program_id(0)
        g = tl.program_id(1)
        blocks = tl.num_programs(0)
        offs_a = tl.arange(0, NP)
        offs_b = tl.arange(0, NP)
        mask_a = offs_a < n
        mask_b = offs_b < n
        mask2 = mask_a[:, None] & mask_b[None, :]
        tile = offs_a[:, None] * NP + offs_b[None, :]
        cross = tl.load(cross_ptr + g * NP * NP + tile)
        flat_index = offs_a[:, None] * n + offs_b[None, :]  # code a * N + b, as the reference's flat index
        counts = tl.zeros([NP, NP], dtype=tl.float32)
        mp = blocks * BLOCK_P  # rows padded to whole blocks on the host: no masks on rows
        for i in range(BLOCK_P):
            row = pid * BLOCK_P + i
            base = (g * mp + row) * NP
            pa = tl.load(p_ptr + base + offs_a)
            qb = tl.load(q_ptr + base + offs_b)
            d2 = tl.maximum(pa[:, None] + qb[None, :] + cross, 0.0)
            d2 = tl.where(mask2, d2, float("inf"))
            best = tl.min(tl.min(d2, axis=1), axis=0)
            # first (a, b) in row-major order reaching the min (torch.min over the flattened block)
            cand = tl.where(d2 == best, flat_index, NP * NP * 2)
            index = tl.min(tl.min(cand, axis=1), axis=0)
            if HARD:
                w = tl.where(flat_index == index, 1.0, 0.0)
                w = tl.where(mask2, w, 0.0)
            else:
                w = tl.exp2((tl.sqrt_rn(best) - tl.sqrt_rn(d2)) * scale)  # padding: exp2(-inf) = 0
            wa = tl.sum(w, axis=1)
            wb = tl.sum(w, axis=0)
            inv_z = 1.0 / tl.sum(wa, axis=0)
            inv_z = tl.where(row < m, inv_z, 0.0)  # padding rows add nothing
            counts += w * inv_z
            tl.store(wa_ptr + base + offs_a, wa * inv_z)
            tl.store(wb_ptr + base + offs_b, wb * inv_z)
            tl.store(best_ptr + g * mp + row, best)
            tl.store(index_ptr + g * mp + row, index)
            tl.store(inv_z_ptr + g * mp + row, inv_z)
        tl.store(counts_ptr + (g * blocks + pid) * NP * NP + tile, counts)


def e_step_blocks(p: torch.Tensor, q: torch.Tensor, cross: torch.Tensor, temperature: float | None,
                  block_p: int = BLOCK_P):
    """The per-point part of the E-step for p, q [G, M, N] (p including |r|^2) and cross [G, N, N]:
    (best [G, M] clamped min squared distance, index [G, M] int64 = a N + b, wa [G, M, N] and wb [G, M, N]
    normalised marginals, inv_z [G, M] = max weight, counts [G, N, N] = sum over points of W / Z). Soft
    weights at `temperature`, one-hot at None. Float32."""
    groups, m, n = p.shape
    np_ = max(16, pow2(n))
    dev = p.device
    blocks = triton.cdiv(max(m, 1), block_p)
    mp = blocks * block_p

    def padded(t, rows):  # [G, rows', n] -> [G, rows, NP], zeros around
        if t.shape[1] == rows and n == np_:
            return t.float().contiguous()
        out = torch.zeros(groups, rows, np_, dtype=torch.float32, device=dev)
        out[:, : t.shape[1], :n] = t
        return out

    p_pad, q_pad, cross_pad = padded(p, mp), padded(q, mp), padded(cross, np_)
    best = torch.empty(groups, mp, dtype=torch.float32, device=dev)
    index = torch.empty(groups, mp, dtype=torch.int32, device=dev)
    wa = torch.empty(groups, mp, np_, dtype=torch.float32, device=dev)
    wb = torch.empty(groups, mp, np_, dtype=torch.float32, device=dev)
    inv_z = torch.empty(groups, mp, dtype=torch.float32, device=dev)
    partial = torch.empty(groups, blocks, np_, np_, dtype=torch.float32, device=dev)
    hard = temperature is None
    scale = 0.0 if hard else LOG2E / temperature
    with launch_device(p):
        _e_step_kernel[(blocks, groups)](p_pad, q_pad, cross_pad, best, index, wa, wb, inv_z, partial, m, n, scale,
                                         NP=np_, BLOCK_P=block_p, HARD=hard,
                                         num_warps=4 if np_ <= 64 else 8)
    counts = partial.sum(1)[:, :n, :n]
    return best[:, :m], index[:, :m].long(), wa[:, :m, :n], wb[:, :m, :n], inv_z[:, :m], counts
