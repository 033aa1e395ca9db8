"""How a method's codec is stored by the packed runtime: one key format and one value format per layer.

A codec that can run on the packed runtime implements `runtime_formats(layer) -> (KeyFormat,
ValueFormat)`; the kinds are the quantize/attention formats of kvcal/runtime/quantize.py. A new method
adds its kinds there (reference + kernel) and returns them here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeyFormat:
    kind: str  # affine_channels | affine_tokens | lut_static
    bits: int
    group: int = 0  # affine_channels: channels per (scale, zero)
    block: int = 1  # affine_tokens: tokens per (scale, zero) per channel
    lo: torch.Tensor | None = None  # lut_static: calibrated per-channel range [C]
    hi: torch.Tensor | None = None
    encode: torch.Tensor | None = None  # lut: sorted levels used to pick codes
    decode: torch.Tensor | None = None  # lut: levels read back (Q-Norm corrected)
    capacity: int = 0  # lut_static: outlier slots per token (over all heads)


@dataclass(frozen=True)
class ValueFormat:
    kind: str  # affine_channels | lut_dynamic
    bits: int
    group: int = 0
    encode: torch.Tensor | None = None
    decode: torch.Tensor | None = None
    per_side: int = 0  # lut_dynamic: outliers per side per vector
    per_head: bool = False  # lut_dynamic: one vector per (token, head) instead of per token over all heads
