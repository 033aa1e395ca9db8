"""Decode attention of one query per row over a packed storage plus a full-precision part, whatever the method.

A storage's `attend` returns softmax partials: for each (row, KV head) and each of S splits of its tokens, the
running maximum m and sum l of exp2(s - m) and the accumulator sum exp2(s - m) v, per query head of the GQA group,
with scores s = q.k x scale x log2(e). `merge` combines the partials of every split into the output. The partials a storage returns
cover the full-precision part too (sinks, recent window, unflushed residual; keys after RoPE): its kernel takes it
into its own launch (the shared `fp_segment` helper of runtime/kernels.py) or launches the generic full-precision
kernel into the last splits (`kernels.fp_partials_into`); the torch reference appends `fp_partials_reference`.

`decode_attention` is what the cache calls: the storage's Triton kernel on CUDA (one clear error where it cannot
run: there is no silent fallback), or the torch references (`kernels=False`: the CPU, the reference backend).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from kvcal.errors import KvcalError
from kvcal.runtime import kernels as K
from kvcal.runtime.partials import FullPrecision, Partials, with_extra

LOG2E = 1.4426950408889634


# ---- torch references ------------------------------------------------------------------------------------------


SOFTCAP_REFUSAL = "soft-capped attention scores (Gemma 2): this kernel does not apply the cap"


def partials_from_rows(q: torch.Tensor, rows: list, scale: float, heads: int, remap=None,
                       softcap: float | None = None) -> Partials:
    """Partials (one split) of q [B, Hq, D] over each row's keys and values: rows[b] = (k, v) [Hkv, T_b, D] in the
    compute dtype, or None for a row with no tokens (m = -inf, l = 0, acc = 0). remap: a storage's remap_scores,
    applied to the scores q.k x scale [1, Hq, 1, T_b] of these (compressed) keys before the softmax. softcap: the
    model's soft-cap of every score, s -> softcap tanh(s / softcap) (Gemma 2; a storage that remaps is refused on
    such a model)."""
    batch, hq, d = q.shape
    group = hq // heads
    parts = Partials.empty(batch * heads, 1, group, d, q.dtype, q.device)
    compute = parts.m.dtype
    parts.m.fill_(-math.inf)
    parts.l.zero_()
    parts.acc.zero_()
    for b, kv in enumerate(rows):
        if kv is None or kv[0].shape[1] == 0:
            continue
        k, v = kv
        qg = q[b].to(compute).reshape(heads, group, d)
        if softcap is not None:
            if remap is not None:
                raise KvcalError("a storage that remaps its scores (CalibQuant) cannot also soft-cap them (Gemma 2)")
            s = qg @ k.to(compute).transpose(1, 2) * scale
            s = softcap * torch.tanh(s / softcap) * LOG2E
        elif remap is None:
            s = qg @ k.to(compute).transpose(1, 2) * (scale * LOG2E)  # [Hkv, G, T]
        else:
            s = (qg @ k.to(compute).transpose(1, 2) * scale).reshape(1, hq, 1, -1)
            s = remap(s, torch.ones((), dtype=torch.bool, device=q.device)).reshape(heads, group, -1) * LOG2E
        m = s.amax(-1)
        p = torch.exp2(s - m[..., None])
        at = slice(b * heads, (b + 1) * heads)
        parts.m[at, 0] = m
        parts.l[at, 0] = p.sum(-1)
        parts.acc[at, 0] = p @ v.to(compute)
    return parts


def fp_partials_reference(q: torch.Tensor, fp: FullPrecision, scale: float, softcap: float | None = None) -> Partials:
    compute = torch.promote_types(q.dtype, torch.float32)
    rows = [(fp.k[b][:, fp.valid[b]].to(compute), fp.v[b][:, fp.valid[b]].to(compute)) for b in range(q.shape[0])]
    return partials_from_rows(q, rows, scale, fp.k.shape[1], softcap=softcap)


def with_fp_reference(parts: Partials, q: torch.Tensor, fp: FullPrecision | None, scale: float,
                      softcap: float | None = None) -> Partials:
    """`parts` of the packed tokens followed by the full-precision part's split (what a reference attend returns)."""
    return parts if fp is None else parts.cat(fp_partials_reference(q, fp, scale, softcap))


def merge_reference(parts: Partials, batch: int, out_dtype) -> torch.Tensor:
    """Combine the splits of `parts` into the output [B, Hq, D]."""
    m, l_sum, acc = parts.m, parts.l, with_extra(parts)
    top = m.amax(1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp2(m - top)  # [R, S, G]
    total = (w * l_sum).sum(1)
    out = (w[..., None] * acc).sum(1) / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    rows, group, d = out.shape
    return out.reshape(batch, rows // batch * group, d).to(out_dtype)


@contextmanager
def one_cpu_thread():
    """torch's CPU ops on one intra-op thread inside the block. A decode step's attention on a CPU (the torch
    references: a [KV heads, group, tokens] score and its softmax per layer) is many ops of microseconds each, and every
    parallel region of an op waits for all the pool's threads: on a machine whose other cores are busy, each wait
    is a scheduler time slice, which made these steps tens of times slower than the work (docs/runtime.md)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- dispatch --------------------------------------------------------------------------------------------------


def decode_attention(q: torch.Tensor, storage, packed, fp: FullPrecision | None, scale: float,
                     kernels: bool, softcap: float | None = None) -> torch.Tensor:
    """q [B, Hq, D] (after RoPE) over the packed tokens of `storage` (packed: runtime.storage.Packed, or None before
    the storage holds anything) and the full-precision part -> [B, Hq, D] in q's dtype. kernels: the Triton kernels
    (the storage's and the generic ones); a storage whose kernel cannot take these inputs raises one line naming why
    (pass the cache's reference backend to run the torch references on purpose). softcap: the model's score soft-cap
    (Gemma 2); storages read it from packed.softcap, and a storage whose kernel does not apply it says so in
    supports_triton."""
    if fp is not None and fp.slots == 0:
        fp = None
    if kernels:
        reason = K.unsupported(q) or (storage.supports_triton(q, packed) if packed is not None else None)
        if reason:
            raise KvcalError(f"{type(storage).__name__}: no Triton decode kernel for this call ({reason}); "
                             "run the torch reference on purpose with backend='reference' (--backend reference)")
        if packed is not None:
            parts = storage.attend_triton(q, packed, scale, fp)
        elif fp is not None:
            parts = K.fp_partials_triton(q, fp, scale, softcap)
        else:
            return torch.zeros_like(q)
        return K.merge_triton(parts, q)
    if packed is not None:
        parts = storage.attend_reference(q, packed, scale, fp)
    elif fp is not None:
        parts = fp_partials_reference(q, fp, scale, softcap)
    else:
        return torch.zeros_like(q)
    return merge_reference(parts, q.shape[0], q.dtype)
