"""Baselines every comparison includes: fp16 (no compression), RTN int-N, KIVI-N. Nothing to learn."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.accounting import fp16_token_bytes, kv_elements
from kvcal.errors import KvcalError
from kvcal.methods.base import Codec, FlushPolicy, Method
from kvcal.methods.registry import register
from kvcal.quant.uniform import fake_quant_groups
from kvcal.runtime.formats import KeyFormat, ValueFormat

PARAM_BYTES = 2  # fp16 scale and fp16 zero (the group minimum) per quantization group


def _check_bits(bits: int, allowed=(2, 3, 4, 8)) -> None:
    if bits not in allowed:
        raise KvcalError(f"bits must be one of {', '.join(map(str, allowed))}, got {bits}")


@register
@dataclass
class FP16(Method):
    name = "fp16"
    summary = "no compression (reference)"

    def tag(self) -> str:
        return "fp16"

    def build_codec(self, tensors, dims) -> Codec:
        codec = Codec()
        codec.lossless = True
        return codec

    def footprint(self, dims, tokens: int) -> dict[str, float]:
        return {"fp16": fp16_token_bytes(dims, tokens)}


class RTNCodec(Codec):
    """Per-token asymmetric min/max over groups of channels of the flattened [Hkv*D] token vector."""

    def __init__(self, bits: int, group: int):
        self.bits, self.group = bits, group

    def _quant(self, x: torch.Tensor) -> torch.Tensor:
        b, h, t, d = x.shape
        flat = x.transpose(1, 2).reshape(b, t, h * d)
        out = fake_quant_groups(flat, self.bits, -1, self.group)
        return out.reshape(b, t, h, d).transpose(1, 2)

    def quantize_keys(self, layer, k):
        return self._quant(k)

    def quantize_values(self, layer, v):
        return self._quant(v)

    def runtime_formats(self, layer):
        return KeyFormat("affine_channels", self.bits, group=self.group), ValueFormat(
            "affine_channels", self.bits, group=self.group)


@register
@dataclass
class RTN(Method):
    """Round-to-nearest int-N per token (keys after RoPE), one fp16 scale and zero per group."""

    name = "rtn"
    summary = "asymmetric min/max int-N per token, keys post-RoPE"
    bits: int = 4
    group_size: int | None = None  # channels per group; None = one group per head (head_dim)

    def validate(self):
        _check_bits(self.bits)
        if self.group_size is not None and self.group_size <= 0:
            raise KvcalError(f"group_size must be positive, got {self.group_size}")

    def group(self, dims) -> int:
        return self.group_size or dims.head_dim

    def check_model(self, dims):
        if dims.kv_channels % self.group(dims):
            raise KvcalError(
                f"rtn group_size {self.group(dims)} does not divide the {dims.kv_channels} K/V channels per token"
            )

    def tag(self) -> str:
        return f"int{self.bits}" + (f"-g{self.group_size}" if self.group_size else "")

    def build_codec(self, tensors, dims) -> Codec:
        self.check_model(dims)
        return RTNCodec(self.bits, self.group(dims))

    def footprint(self, dims, tokens):
        elements = kv_elements(dims, tokens)
        return {
            "codes": elements * self.bits / 8,
            "scales_zeros": elements / self.group(dims) * 2 * PARAM_BYTES,
        }


class KIVICodec(Codec):
    def __init__(self, bits: int, group: int, residual: int):
        self.bits, self.group = bits, group
        # Keys are quantized per channel over blocks of `group` tokens, so tokens leave the fp16
        # residual one whole block at a time, and only while `residual` newer tokens remain.
        self.policy = FlushPolicy(sink=0, residual=residual, block=group)

    def quantize_keys(self, layer, k):
        return fake_quant_groups(k, self.bits, dim=2, group=self.group)  # per channel, token groups

    def quantize_values(self, layer, v):
        return fake_quant_groups(v, self.bits, dim=3, group=self.group)  # per token, channel groups

    def runtime_formats(self, layer):
        return KeyFormat("affine_tokens", self.bits, block=self.group), ValueFormat(
            "affine_channels", self.bits, group=self.group)


@register
@dataclass
class KIVI(Method):
    """KIVI: keys per channel in groups of G tokens, values per token in groups of G channels, and
    an fp16 residual of the R most recent tokens, flushed one group of G at a time."""

    name = "kivi"
    summary = "per-channel keys, per-token values, fp16 residual window"
    bits: int = 2
    group_size: int = 32
    residual: int = 128

    def validate(self):
        _check_bits(self.bits)
        if self.group_size <= 0 or self.residual < 0:
            raise KvcalError("kivi needs group_size > 0 and residual >= 0")

    def check_model(self, dims):
        if dims.head_dim % self.group_size:
            raise KvcalError(f"kivi group_size {self.group_size} does not divide head_dim {dims.head_dim}")

    def tag(self) -> str:
        return f"{self.bits}bit-g{self.group_size}-r{self.residual}"

    def build_codec(self, tensors, dims) -> Codec:
        self.check_model(dims)
        return KIVICodec(self.bits, self.group_size, self.residual)

    def footprint(self, dims, tokens):
        policy = FlushPolicy(residual=self.residual, block=self.group_size)
        quantized = policy.compressed_count(tokens)
        elements = kv_elements(dims, quantized)
        return {
            "codes": elements * self.bits / 8,
            # keys: one (scale, zero) per channel per G tokens; values: per token per G channels
            "scales_zeros": elements / self.group_size * 2 * PARAM_BYTES,
            "fp16_residual": fp16_token_bytes(dims, tokens - quantized),
        }
