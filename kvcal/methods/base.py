"""What every method is: a config dataclass with the paper's defaults, `calibrate()`, and a codec.

- `Method` (one dataclass per method, registered by name): validates its config, says what calibration
  needs captured, turns captured activations into learned tensors, counts its cache bytes, and builds
  its `Codec` from an artifact's tensors.
- `Codec`: the torch reference of what the method stores. `quantize_keys` / `quantize_values` return
  the dequantized values a runtime would reconstruct; `policy` says which tokens stay in full
  precision as decoding proceeds (sinks, recent window, unflushed residual groups).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcal.errors import KvcalError


@dataclass(frozen=True)
class FlushPolicy:
    """Which tokens a method keeps in full precision, as a function of how many the cache holds.

    Tokens [0, sink) stay full precision forever. After them, tokens are compressed in aligned blocks
    of `block` tokens, but only once at least `residual` newer tokens exist. So with n tokens cached,
    `compressed_count(n)` tokens after the sinks are compressed and the rest are full precision.
    RTN: (0, 0, 1). KIVI: (0, R, G). SKVQ: (S, W, 1). KVQuant: (n_sink, 0, 1).
    """

    sink: int = 0
    residual: int = 0
    block: int = 1

    def compressed_count(self, n: int) -> int:
        return self.block * (max(0, n - self.sink - self.residual) // self.block)

    def compressed_span(self, n: int) -> tuple[int, int]:
        """[start, end) of the compressed tokens when the cache holds n tokens."""
        return self.sink, self.sink + self.compressed_count(n)

    def full_precision_mask(self, length: int, prompt_len: int = 0, device=None) -> torch.Tensor:
        """Bool [T, T]: entry (i, j) is True when query i sees key j in full precision.

        Query i runs with i + 1 tokens cached (gptq protocol: the token itself is already in the cache).
        Queries before `prompt_len` are the full-precision prefill of the prefill-decode protocol.
        """
        n = torch.arange(1, length + 1, device=device)
        compressed = self.block * torch.clamp(n - self.sink - self.residual, min=0).div(
            self.block, rounding_mode="floor"
        )
        j = torch.arange(length, device=device)[None, :]
        fp = (j < self.sink) | (j >= self.sink + compressed[:, None])
        if prompt_len:
            fp[:prompt_len] = True
        return fp


class Codec:
    """Fake-quantization reference of one method with its learned tensors."""

    policy: FlushPolicy = FlushPolicy()
    keys_pre_rope: bool = False  # compress keys before RoPE and rotate after reconstruction
    lossless: bool = False  # nothing is compressed (fp16 baseline)

    def quantize_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [B, Hkv, T, D] with T a multiple of policy.block -> reconstructed keys, same shape."""
        raise NotImplementedError

    def quantize_values(self, layer: int, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _coerce(value, annotation, key: str, method: str):
    """Turn a YAML/`--set` value into the field's type, or raise a one-line error."""
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if is_union else (annotation,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
    names = "/".join(getattr(o, "__name__", str(o)) for o in options)
    raise KvcalError(f"config key '{key}' of method {method} expects {names}, got {value!r}")


@dataclass
class Method:
    """Base of the per-method config dataclasses. Subclasses set `name` and declare fields."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    learns: ClassVar[bool] = False  # needs calibration data
    captures: ClassVar[tuple[str, ...]] = ()  # what calibration needs: "k", "v", "q", "x", "fisher"
    # fields that only change how the runtime stores the codec (not what calibration learned): these may
    # be overridden on an existing artifact with --set
    runtime_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def config_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_config(cls, config: dict) -> Method:
        hints = typing.get_type_hints(cls)
        known = cls.config_keys()
        values = {}
        for key, value in config.items():
            if key not in known:
                raise KvcalError(f"unknown config key '{key}' for method {cls.name} "
                                 f"({'known: ' + ', '.join(known) if known else 'it takes no config keys'})")
            values[key] = _coerce(value, hints[key], key, cls.name)
        method = cls(**values)
        method.validate()
        return method

    def config(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise KvcalError on impossible settings that do not depend on the model."""

    def capture_needs(self) -> set[str]:
        """What calibration must capture for this setting (defaults to the class's `captures`)."""
        return set(self.captures)

    def check_model(self, dims) -> None:
        """Raise KvcalError if this config cannot run on a model with these dims."""

    def tag(self) -> str:
        """Short name of the setting, used in default artifact file names."""
        return "-".join(f"{k}{v}" for k, v in self.config().items()) or "default"

    def calibrate(self, loaded, store) -> tuple[dict[str, torch.Tensor], dict]:
        """Learn tensors from captured activations (a CaptureStore). Returns the artifact's tensors
        (named layers.{i}.{k|v|x}.{name}) and a JSON-able dict of calibration diagnostics."""
        return {}, {}

    def build_codec(self, tensors: dict[str, torch.Tensor], dims) -> Codec:
        raise NotImplementedError

    def footprint(self, dims, tokens: int) -> dict[str, float]:
        """Bytes of the compressed cache holding `tokens` tokens (batch 1, all layers), by category."""
        raise NotImplementedError
