"""Rotary position embeddings, rotate-half convention (HF Llama family), computed from the model config.

kvcal applies RoPE itself so that codecs can see keys before rotation (KVQuant, SKVQ and CommVQ store
pre-RoPE keys and rotate at attention time). The frequencies follow transformers' definitions for the
rope types we support; anything else is refused with a clear message rather than silently mis-rotated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from kvcal.errors import KvcalError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    head_dim: int
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config, head_dim: int, layer_type: str | None = None) -> RopeSpec:
        """The RoPE of a config; `layer_type` ("full_attention" or "sliding_attention") picks that kind of layer's
        where the config keeps one per kind (Gemma 3: transformers 5 nests them in `rope_parameters`, 4.x gives the
        local layers' base as `rope_local_base_freq`)."""
        # transformers 5 keeps everything in `rope_parameters`; 4.x used `rope_theta` + `rope_scaling`.
        params = dict(getattr(config, "rope_parameters", None) or {})
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
        elif params and all(isinstance(v, dict) for v in params.values()):
            raise KvcalError(f"rope parameters per layer kind ({', '.join(params)}) for a model kvcal reads one of")
        if not params:
            params = dict(getattr(config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
            local_base = getattr(config, "rope_local_base_freq", None)
            if layer_type == "sliding_attention" and local_base:
                params = {"rope_theta": local_base}  # 4.x Gemma 3: the local layers take no scaling
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise KvcalError(
                f"unsupported rope type '{rope_type}' (kvcal supports {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
            raise KvcalError("partial rotary embeddings are not supported")
        return cls(
            head_dim=head_dim,
            theta=float(params["rope_theta"]),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def inv_freq(self, device=None) -> torch.Tensor:
        """Inverse frequencies, float32, shape [head_dim // 2]."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self)
        return inv_freq.to(device)


def _llama3_inv_freq(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    # Llama 3.1 frequency-dependent interpolation: long wavelengths are divided by `factor`, short ones
    # kept, and the band in between blended smoothly.
    old_context = spec.original_max_position_embeddings
    low_freq_wavelen = old_context / spec.low_freq_factor
    high_freq_wavelen = old_context / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_context / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin tables for integer positions [B, T]: each [B, T, head_dim], cast to `dtype`.

    Computed in float32 (an outer product), then duplicated over the two halves as rotate-half expects.
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the tables [B, T, D] (broadcast over heads)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse rotation: rotation matrices are orthogonal, so rotate by -angle."""
    return x * cos[:, None] - rotate_half(x) * sin[:, None]
