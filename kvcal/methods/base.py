"""What every method is: a config dataclass with the paper's defaults, `calibrate()`, and a codec.

- `Method` (one dataclass per method, registered by name): validates its config, says what calibration
  needs captured, turns captured activations into learned tensors, counts its cache bytes, and builds
  its `Codec` from an artifact's tensors.
- `Codec`: what the method does to the cache: its flush policy, its packed `Storage` per layer (the runtime
  protocol, kvcal/runtime/storage.py), and the simulation's reconstruction (by default through that storage).

A method lives in its own files: `kvcal/methods/<name>.py` (config, calibration, codec, storage) and
`kvcal/methods/<name>_kernels.py` (its Triton kernels, beside the storage's torch references).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcal.errors import KvcalError
from kvcal.runtime.storage import FlushPolicy, Storage

__all__ = ["Codec", "FlushPolicy", "Method", "Storage", "check_bits", "round_trip"]


class Codec:
    """What a method applies to one model's cache, built from an artifact's tensors (or from nothing).

    - `policy`, `keys_pre_rope`: which tokens stay in full precision as decoding proceeds (sinks, recent window,
      unflushed residual groups), and whether compressed keys live before RoPE.
    - `storage(layer)`: the packed runtime's storage of that layer (kvcal.runtime.storage.Storage), or None for a
      method with no packed runtime (the simulation and the dequantized reference cache still run).
    - `reconstruct(layer, k, v)`: the gptq simulation's view of a block of tokens: what dequantization gives back.
      By default a round trip through the storage's own torch quantizer (write, then read): one numerics path for the
      simulation and the packed cache. Methods whose published math the storage cannot hold exactly override it.
    - `source`: what the cache compresses of each token: "kv" (its keys and values: `reconstruct`) or "x" (the
      layer's attention input, from which the codec rebuilds keys and values: `rematerialize`).
    - `remap_scores(layer, scores, compressed)`: what the method does to the pre-softmax scores (q.k * scale) of the
      keys attention sees compressed, before the softmax that they share with the full-precision keys: the identity
      unless `remaps_scores` (a logit remap is not a K-hat and a V-hat). The simulation and the dequantized
      reference cache then compute attention with explicit scores and call it; the packed storages do it in
      `attend`.
    - `bulk_only`: non-empty for a codec that compresses a span of tokens only as a whole (its statistics span the
      block it is given), so it has no token-by-token flush rule: it runs under the `tail` protocol only; the string
      says why, as the one-line refusal of the other protocols and of the cache.
    """

    policy: FlushPolicy = FlushPolicy()
    keys_pre_rope: bool = False  # compress keys before RoPE and rotate after reconstruction
    lossless: bool = False  # nothing is compressed (fp16 baseline)
    source: str = "kv"
    remaps_scores: bool = False  # remap_scores is not the identity
    bulk_only: str = ""

    def storage(self, layer: int) -> Storage | None:
        return None

    def storage_refusal(self) -> str:
        """Why `storage` is None (the packed cache's one-line error)."""
        return f"{type(self).__name__} has no packed runtime"

    def reconstruct(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (in the key space: before RoPE for keys_pre_rope) and v [B, Hkv, T, D], T a multiple of policy.block ->
        the reconstructed k and v, same shapes and dtypes."""
        storage = self.storage(layer)
        if storage is None:
            raise KvcalError(self.storage_refusal())
        return round_trip(storage, k, v)

    def remap_scores(self, layer: int, scores: torch.Tensor, compressed: torch.Tensor) -> torch.Tensor:
        """scores [B, Hq, Tq, Tk] (float, after the 1/sqrt(d) scale, before the mask), compressed bool broadcastable
        to them: True where the query sees that key compressed (and the mask allows it) -> the scores the softmax
        takes (entries where compressed is False must come back unchanged). Default: the identity."""
        return scores

    def rematerialize(self, layer: int, x: torch.Tensor, proj, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """For source "x" codecs: x [B, T, hidden], the attention inputs of a span of tokens compressed together (T
        a multiple of policy.block) -> the keys (before RoPE) and values [B, Hkv, T, D] that attention sees of them.
        `proj` is the layer's AttentionInputs: `proj.project(xk, xv)` its own K and V projections of attention inputs,
        `proj.finish(k_lin, v_lin)` the same from bias-free linear outputs. `state` is one dict per batch row passed
        to every layer in order for the same span (a method working across layers keeps what it needs there)."""
        raise NotImplementedError(f"{type(self).__name__} compresses keys and values, not X")


def round_trip(storage: Storage, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v [B, H, T, D] into fresh buffers of `storage` through its torch reference, read them back (keys in
    the storage's key space, not rotated)."""
    from kvcal.runtime.storage import Packed

    batch, heads, length, dim = k.shape
    storage.check(heads, dim)
    storage = storage.to(k.device)
    buffers = {name: torch.zeros(spec.shape, dtype=spec.dtype, device=k.device)
               for name, spec in storage.buffers(batch, length, heads, dim).items()}
    lengths = torch.full((batch,), length, dtype=torch.int32, device=k.device)
    packed = Packed(buffers, lengths, heads, dim, length)
    rows = torch.arange(batch, device=k.device).repeat_interleave(length)
    slots = torch.arange(length, device=k.device).repeat(batch)
    storage.write_reference(packed, k.transpose(1, 2).reshape(-1, heads, dim),
                            v.transpose(1, 2).reshape(-1, heads, dim), rows, slots)
    compute = torch.promote_types(k.dtype, torch.float32)
    read = [storage.read(packed, b, compute, rotate=False) for b in range(batch)]
    return (torch.stack([r[0] for r in read]).to(k.dtype), torch.stack([r[1] for r in read]).to(v.dtype))


def check_bits(bits: int, allowed=(1, 2, 3, 4, 8)) -> None:
    """The widths of the uniform min/max codes (kvcal/quant/uniform.py; 1 bit: two levels, the group's min and max)
    that the packing and the decode kernels take."""
    if bits not in allowed:
        raise KvcalError(f"bits must be one of {', '.join(map(str, allowed))}, got {bits}")


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
    # small settings for tiny test models (2 KV heads of 16 channels, a few calibration windows): the contract test
    # (tests/test_contract.py) runs every registered method with them
    test_config: ClassVar[dict] = {}
    # what each learned tensor is (short name "k.theta" -> kind, kvcal/compare.py KINDS): written into the artifact's
    # header, so `kvcal compare` compares codebooks up to permutation, SVD factors up to sign, datatypes as sets
    tensor_kinds: ClassVar[dict[str, str]] = {}
    # the config field holding the method's own window of newest tokens kept in full precision (KIVI's residual,
    # SKVQ's window, ...): the full-precision allowance of a comparison (`--fp-window W`, docs/conventions.md) sets
    # it. It must be a runtime field (calibration never depends on it). None: the method has no such window.
    fp_window_field: ClassVar[str | None] = None

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

    def own_fp_window(self) -> int:
        """The newest tokens this setting keeps in full precision besides what its format itself stores (its own
        window; 0 for a method without one)."""
        return int(getattr(self, self.fp_window_field)) if self.fp_window_field else 0

    def with_fp_window(self, window: int) -> Method:
        """This setting under the full-precision allowance `window` (`--fp-window`): the newest `window` tokens stay
        in fp16 whatever the method's own default. A one-line KvcalError where the method cannot honour it."""
        if window < 0:
            raise KvcalError(f"--fp-window must be >= 0, got {window}")
        if self.fp_window_field is None:
            raise KvcalError(f"{self.name} has no full-precision window: it cannot keep the newest {window} tokens in "
                             "fp16")
        method = dataclasses.replace(self, **{self.fp_window_field: window})
        method.validate()
        return method

    def check_protocol(self, protocol: str) -> None:
        """Raise KvcalError if this setting cannot run under the perplexity protocol `protocol` (gptq,
        prefill-decode, tail), before any model loads."""

    def needs_artifact(self) -> bool:
        """Whether the codec needs an artifact's tensors (learned from data, or derived from the weights alone)."""
        return self.learns

    def capture_needs(self) -> set[str]:
        """What calibration must capture for this setting (defaults to the class's `captures`)."""
        return set(self.captures)

    def check_model(self, dims) -> None:
        """Raise KvcalError if this config cannot run on a model with these dims."""

    def check_calibration(self, nsamples: int, seqlen: int) -> None:
        """Raise KvcalError if calibrating on `nsamples` windows of `seqlen` tokens cannot work (checked before any
        model loads)."""

    def for_model(self, dims) -> Method:
        """This setting with its model-dependent defaults resolved for a model of these dims (what an artifact and a
        record state); the setting itself for a method that has none."""
        return self

    def tag(self) -> str:
        """Short name of the setting, used in default artifact file names."""
        return "-".join(f"{k}{v}" for k, v in self.config().items()) or "default"

    def calibrate(self, loaded, store) -> tuple[dict[str, torch.Tensor], dict]:
        """Learn tensors from captured activations (a CaptureStore; None for methods that do not learn from data, which
        may still derive tensors from the model's weights). Returns the artifact's tensors (named
        layers.{i}.{k|v|x}.{name}) and a JSON-able dict of calibration diagnostics."""
        return {}, {}

    def build_codec(self, tensors: dict[str, torch.Tensor], dims) -> Codec:
        raise NotImplementedError

    def synthetic_tensors(self, dims, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random learned tensors of the shapes an artifact holds, for speed and memory benchmarks at shapes no
        artifact exists for (speed does not depend on the values). Methods that learn nothing need none."""
        if self.learns:
            raise KvcalError(f"{self.name} has no synthetic tensors: benchmark a calibrated artifact (--artifact)")
        return {}

    def footprint(self, dims, tokens: int) -> dict[str, float]:
        """Bytes of the compressed cache holding `tokens` tokens (batch 1, all layers), by category."""
        raise NotImplementedError
