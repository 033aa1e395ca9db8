"""Reference attention math shared by the adapter, the gptq simulation and the torch runtime reference.

Everything runs through PyTorch's SDPA (in float32 on the CPU; CUDA kernels accumulate in float32) with an additive mask (GQA mapped by SDPA, no repeat
of K/V). Masked entries use float32's most negative finite number rather than -inf, so rows with no
allowed key (left padding) stay finite, as in transformers' eager path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NEG = torch.finfo(torch.float32).min
# cuDNN's SDPA builds an execution graph per new shape; decoding grows the key length every step, so
# every call would pay that setup on the host (docs/runtime.md). Flash / memory-efficient kernels have no
# per-shape setup.
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A masked decode over a preallocated buffer (static shapes, so cuDNN's per-shape setup is paid once): cuDNN
# takes the additive mask with GQA and matches flash over the valid prefix (docs/runtime.md); flash takes no mask, and
# the memory-efficient kernel no GQA with a mask (far slower with the query heads as query rows).
MASKED_DECODE_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def additive_mask(mask: torch.Tensor | None, q_len: int, k_len: int, device) -> torch.Tensor:
    """Normalize whatever transformers passed as attention mask to a float32 bias [B|1, 1, Tq, Tk].

    None means plain causal attention where the queries are the last `q_len` of `k_len` positions.
    Boolean masks mark allowed positions; float masks are already additive.
    """
    if mask is None:
        q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        allowed = torch.arange(k_len, device=device)[None, :] <= q_pos
        return torch.where(allowed, 0.0, NEG)[None, None]
    if mask.dim() == 2:  # [Tq, Tk]
        mask = mask[None, None]
    mask = mask[..., -q_len:, :k_len]
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, NEG)
    # transformers fills masked entries with the most negative number of the model dtype: keep them
    # as masked after the cast to float32.
    return torch.where(mask <= torch.finfo(mask.dtype).min / 2, NEG, mask.to(torch.float32))


def _sdpa(q, k, v, bias, scale: float, backends=CUDA_BACKENDS) -> torch.Tensor:
    # CUDA's fused kernels accumulate half-precision inputs in float32 already, so those stay as they
    # are (flash / memory-efficient backends); elsewhere compute in at least float32.
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        dtype = q.dtype
    else:
        dtype = torch.promote_types(q.dtype, torch.float32)
    causal = bias is None  # None: causal; False: nothing masked; else an additive bias
    bias = bias.to(dtype).clamp_min(torch.finfo(dtype).min) if isinstance(bias, torch.Tensor) else None
    args = (q.to(dtype), k.to(dtype), v.to(dtype))
    options = dict(attn_mask=bias, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if q.is_cuda:
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(*args, **options).to(q.dtype)
    return F.scaled_dot_product_attention(*args, **options).to(q.dtype)


def attention(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> [B, Hq, Tq, D] in q's dtype. softcap: the scores go through
    softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2), written out (SDPA has no such step)."""
    if softcap is not None:
        bias = additive_mask(mask, q.shape[2], k.shape[2], q.device)
        return capped_attention(q, k, v, bias, scale, softcap)
    if mask is None and q.shape[2] == k.shape[2]:  # plain causal: let SDPA skip the mask entirely
        return _sdpa(q, k, v, None, scale)
    if mask is None and q.shape[2] == 1:  # one new token sees every cached key: no mask at all
        return _sdpa(q, k, v, False, scale)
    return _sdpa(q, k, v, additive_mask(mask, q.shape[2], k.shape[2], q.device), scale)


def decode_attention_masked(q, k, v, valid: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """One new token per row over a preallocated cache: q [B, Hq, 1, D], k/v [B, Hkv, capacity, D], valid bool
    [capacity] (the slots that hold tokens; the same for every row). No shape depends on how many slots are
    valid, so a CUDA graph can replay it at every length."""
    bias = torch.where(valid, 0.0, NEG)[None, None, None, :]
    if softcap is not None:
        return capped_attention(q, k, v, bias, scale, softcap)
    return _sdpa(q, k, v, bias, scale, MASKED_DECODE_BACKENDS)


def capped_attention(q, k, v, bias: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """remapped_attention with the score map of a soft-capped model (Gemma 2), s -> softcap * tanh(s / softcap), on
    every key."""
    return remapped_attention(q, k, v, bias, torch.zeros((), dtype=torch.bool, device=q.device), scale,
                              lambda scores, _: softcap * torch.tanh(scores / softcap))


def mixed_attention(q, k_fp, v_fp, k_hat, v_hat, full_precision, mask, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention where query i sees key j in full precision where `full_precision[i, j]` (bool [Tq, Tk]),
    and reconstructed (k_hat, v_hat) elsewhere.

    Written as one softmax over the 2*Tk keys [k_fp; k_hat] in which, for each j, exactly one of the two
    copies is allowed: this is the same function and runs through SDPA's fused kernels.
    """
    bias = additive_mask(mask, q.shape[2], k_fp.shape[2], q.device)
    fp = full_precision[None, None]
    both = torch.cat([torch.where(fp, bias, NEG), torch.where(fp, NEG, bias)], dim=-1)
    if softcap is not None:
        return capped_attention(q, torch.cat([k_fp, k_hat], 2), torch.cat([v_fp, v_hat], 2), both, scale, softcap)
    return _sdpa(q, torch.cat([k_fp, k_hat], 2), torch.cat([v_fp, v_hat], 2), both, scale)


def remapped_attention(q, k, v, bias: torch.Tensor, compressed: torch.Tensor, scale: float, remap) -> torch.Tensor:
    """Attention with explicit scores, for storages that remap the scores of compressed keys (Storage.remap_scores).

    q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], bias an additive float mask broadcastable to [B, 1, Tq, Tk] (NEG where
    masked), compressed bool broadcastable to [B, 1, Tq, Tk]: the keys the query sees compressed. The scores
    q.k * scale of the allowed compressed keys go through `remap(scores, compressed)` ([B, Hq, Tq, Tk]); then one
    softmax over all keys (masked keys get NEG, as in SDPA) in at least float32, and the weighted sum of v."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(groups, 1)
    v = v.to(dtype).repeat_interleave(groups, 1)
    scores = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    bias = bias.to(dtype)
    allowed = bias > NEG / 2
    scores = remap(scores, compressed & allowed)
    scores = torch.where(allowed, scores + bias, torch.finfo(dtype).min)
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)
