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
    v_scale: torch.Tensor | None  # affine_channels [B,Hkv,Tcap,Gv] fp16 | lut_dynamic [B,Tcap] fp16
    v_zero: torch.Tensor | None
    key_block: int = 1  # affine_tokens: tokens sharing one (scale, zero) per channel
    k_table: torch.Tensor | None = None  # lut_static decode table [2^bits] fp32
    k_out_idx: torch.Tensor | None = None  # [B, Tcap, capk] int16 channel in [0, C), -1 = empty
    k_out_val: torch.Tensor | None = None  # [B, Tcap, capk] fp16 residual
    v_table: torch.Tensor | None = None
    v_out_idx: torch.Tensor | None = None
    v_out_val: torch.Tensor | None = None
    # Pre-RoPE keys are rotated at attention time: slot i of a row sits at position pos_offset + i.
    rope_cos: torch.Tensor | None = None  # [Tmax, D] float32 (None: keys are stored post-RoPE)
    rope_sin: torch.Tensor | None = None
    pos_offset: int = 0

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    def row_keys(self, b: int) -> torch.Tensor:
        """Reconstructed post-RoPE keys of row b: [Hkv, T_b, D] float32."""
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
            k = dequantize_lut_static(codes, self.k_zero - self.k_scale, self.k_zero + self.k_scale, self.k_table,
                                      self.key_bits, d, idx, val)
        k = k.transpose(0, 1)  # [H, T, D]
        if self.rope_cos is not None:
            pos = slice(self.pos_offset, self.pos_offset + t)
            k = apply_rope(k[None], self.rope_cos[None, pos], self.rope_sin[None, pos])[0]
        return k

    def row_values(self, b: int) -> torch.Tensor:
        t, d = int(self.lengths[b]), self.head_dim
        codes = self.v_codes[b, :, :t].transpose(0, 1)
        if self.value_format == "affine_channels":
            v = dequantize_affine_channels(codes, self.v_scale[b, :, :t].transpose(0, 1),
                                           self.v_zero[b, :, :t].transpose(0, 1), self.value_bits, d)
        else:
            idx = None if self.v_out_idx is None else self.v_out_idx[b, :t]
            val = None if self.v_out_val is None else self.v_out_val[b, :t]
            v = dequantize_lut_dynamic(codes, self.v_scale[b, :t], self.v_zero[b, :t], self.v_table,
                                       self.value_bits, d, idx, val)
        return v.transpose(0, 1)


def decode_attention_ref(q, kv: PackedKV | None, fp_k, fp_v, fp_valid, scale: float) -> torch.Tensor:
    """One query token per row: q [B, Hq, D] (post-RoPE) over the packed tokens and the valid
    full-precision tokens fp_k/fp_v [B, Hkv, F, D] (fp_valid [B, F] bool). Returns [B, Hq, D] in q's dtype."""
    batch, hq, d = q.shape
    out = torch.empty(batch, hq, d, dtype=torch.float32, device=q.device)
    for b in range(batch):
        keys = [fp_k[b][:, fp_valid[b]].float()]
        values = [fp_v[b][:, fp_valid[b]].float()]
        if kv is not None and int(kv.lengths[b]) > 0:
            keys.insert(0, kv.row_keys(b))
            values.insert(0, kv.row_values(b))
        k, v = torch.cat(keys, 1), torch.cat(values, 1)  # [Hkv, T, D]
        group = hq // k.shape[0]
        qg = q[b].float().reshape(k.shape[0], group, d)
        p = torch.softmax(qg @ k.transpose(1, 2) * scale, dim=-1)
        out[b] = (p @ v).reshape(hq, d)
    return out.to(q.dtype)
