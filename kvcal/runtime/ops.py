"""Dispatch between the Triton kernels (CUDA tensors) and their torch references (everything else).

The cache calls these; tests call the `_ref` / `_triton` implementations directly (the Triton ones
also run on CPU under TRITON_INTERPRET=1, slowly).
"""

from __future__ import annotations

import os

import torch

from kvcal.runtime import attention, quantize, ring


def use_triton(t: torch.Tensor) -> bool:
    if os.environ.get("KVCAL_DISABLE_TRITON") == "1":
        return False
    return t.is_cuda and _triton_available()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _pick(module, name: str, t: torch.Tensor):
    fast = getattr(module, f"{name}_triton", None)
    return fast if fast is not None and use_triton(t) else getattr(module, name)


def quantize_affine_channels(x, bits, group):
    return _pick(quantize, "quantize_affine_channels", x)(x, bits, group)


def quantize_affine_tokens(x, bits):
    return _pick(quantize, "quantize_affine_tokens", x)(x, bits)


def quantize_affine_token_blocks(x, bits, block):
    return _pick(quantize, "quantize_affine_token_blocks", x)(x, bits, block)


def quantize_lut_static(x, lo, hi, encode, decode, bits, capacity):
    return _pick(quantize, "quantize_lut_static", x)(x, lo, hi, encode, decode, bits, capacity)


def quantize_lut_dynamic(x, encode, decode, bits, per_side, per_head=False):
    return _pick(quantize, "quantize_lut_dynamic", x)(x, encode, decode, bits, per_side, per_head)


def quantize_affine_channels_into(x, bits, group, codes, scale, zero, rows, slots):
    _pick(quantize, "quantize_affine_channels_into", x)(x, bits, group, codes, scale, zero, rows, slots)


def quantize_lut_static_into(x, lo, hi, encode, decode, bits, capacity, codes, out_idx, out_val, rows, slots):
    _pick(quantize, "quantize_lut_static_into", x)(x, lo, hi, encode, decode, bits, capacity, codes, out_idx, out_val,
                                                   rows, slots)


def quantize_lut_dynamic_into(x, encode, decode, bits, per_side, per_head, codes, scale, zero, out_idx, out_val, rows,
                              slots):
    _pick(quantize, "quantize_lut_dynamic_into", x)(x, encode, decode, bits, per_side, per_head, codes, scale, zero,
                                                    out_idx, out_val, rows, slots)


def ring_step(k, v, *buffers, **settings):
    _pick(ring, "ring_step", k)(k, v, *buffers, **settings)


def decode_attention(q, kv, fp_k, fp_v, fp_valid, scale):
    impl = getattr(attention, "decode_attention_triton", None)
    if impl is not None and use_triton(q):
        return impl(q, kv, fp_k, fp_v, fp_valid, scale)
    return attention.decode_attention_ref(q, kv, fp_k, fp_v, fp_valid, scale)
