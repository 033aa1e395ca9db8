"""What every method is: a config dataclass with the paper's defaults, `calibrate()`, and its storages.

- `Method` (one dataclass per method, registered by name): validates its config, says what calibration
  needs captured, turns captured activations into learned tensors, counts its cache bytes, and builds one
  `Storage` per layer from an artifact's tensors (`build_storages`).
- `Storage` (kvcal/runtime/storage.py): the only per-layer interface: the packed buffers, write, attend, read, and
  the simulation's reconstruction (by default a round trip through that storage).

A method lives in its own folder, `kvcal/methods/<name>/`: method.py (the config), calibrate.py, storage.py (its
storages, with their torch references), kernels.py (its Triton kernels), cases.py (its kernel test cases).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcal.errors import KvcalError
from kvcal.runtime.storage import FlushPolicy, Storage, Storages

__all__ = ["FlushPolicy", "Method", "Storage", "Storages", "check_bits"]


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
    if str in options and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `--set tau_grid=2`: YAML reads a number where the field holds text
    names = "/".join(getattr(o, "__name__", str(o)) for o in options)
    raise KvcalError(f"config key '{key}' of method {method} expects {names}, got {value!r}")


@dataclass
class Method:
    """Base of the per-method config dataclasses. Subclasses set `name` and declare fields."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    learns: ClassVar[bool] = False  # needs calibration data
    # its calibration trains long enough to want a GPU (`kvcal search` leaves it out on a CPU unless named)
    calibrates_on_gpu: ClassVar[bool] = False
    captures: ClassVar[tuple[str, ...]] = ()  # what calibration needs: "k", "v", "q", "x", "fisher"
    # fields that only change how the runtime stores the codec (not what calibration learned): these may
    # be overridden on an existing artifact with --set
    runtime_fields: ClassVar[tuple[str, ...]] = ()
    # small settings for tiny test models (2 KV heads of 16 channels, a few calibration windows): the contract test
    # (tests/test_contract.py) runs every registered method with them
    test_config: ClassVar[dict] = {}
    # every ablation and variant the method offers whose storage differs from test_config's, as label -> config keys
    # over test_config: the contract test decodes each through its storages as it simulates them
    test_ablations: ClassVar[dict[str, dict]] = {}
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

    def build_storages(self, tensors: dict[str, torch.Tensor], dims) -> Storages:
        """One Storage per decoder layer of a model of these dims, from an artifact's tensors (none for a method that
        learns nothing)."""
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
