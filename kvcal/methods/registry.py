"""Method registry: name -> Method dataclass."""

from __future__ import annotations

import importlib
import math
import pkgutil
from pathlib import Path

import yaml

from kvcal.accounting import bits_per_element
from kvcal.artifact import check_model
from kvcal.errors import KvcalError, first_line
from kvcal.models import ModelDims
from kvcal.quant.rope import RopeSpec

METHODS: dict[str, type] = {}


def register(cls):
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name} registered twice")
    METHODS[cls.name] = cls
    return cls


def method_class(name: str):
    _load_all()
    if name not in METHODS:
        raise KvcalError(f"unknown method '{name}' (known: {', '.join(sorted(METHODS))})")
    return METHODS[name]


def build_method(name: str, config: dict | None = None):
    return method_class(name).from_config(config or {})


def all_methods() -> dict[str, type]:
    _load_all()
    return dict(METHODS)


def _load_all() -> None:
    """Import every module of the kvcal.methods package once: a method registers itself with @register in its own
    file, so adding one edits no shared list (and this module, which each method imports, imports none of them)."""
    global _LOADED
    if _LOADED:
        return
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        importlib.import_module(f"{__package__}.{info.name}")
    _LOADED = True


_LOADED = False


def parse_sets(items: list[str] | None) -> dict:
    """--set key=value strings -> {key: value}, each value read as YAML (a number, a bool, a list; else the string)."""
    overrides = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise KvcalError(f"--set expects key=value, got '{item}'")
        try:
            overrides[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            overrides[key.strip()] = raw
    return overrides


def runtime_overrides(method_name: str, sets: list[str] | dict | None) -> dict:
    """--set on an artifact (key=value strings, or a dict): only the method's runtime fields may change
    (the rest was calibrated)."""
    overrides = dict(sets) if isinstance(sets, dict) else parse_sets(sets)
    allowed = method_class(method_name).runtime_fields
    for key in overrides:
        if key not in allowed:
            hint = f"runtime settings of {method_name}: {', '.join(allowed)}" if allowed else f"{method_name} has none"
            raise KvcalError(f"--set {key} cannot change a calibrated artifact ({hint}); recalibrate instead")
    return overrides


def check_artifact(artifact, path="artifact") -> None:
    """What eval and generate would refuse, checked from the artifact alone (no model): the method and its config
    build, the tensors fit them on the header's model shapes, and the header's bits per element is what the config
    gives (a header edited by hand fails here)."""
    m = artifact.header["model"]
    try:
        dims = ModelDims(family=m["family"], num_layers=m["num_layers"], num_heads=m["num_heads"],
                         num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"], hidden_size=m["hidden_size"],
                         rope=RopeSpec(**m["rope"]))
    except (KeyError, TypeError) as exc:
        raise KvcalError(f"{path}: the header's model is incomplete ({first_line(str(exc))})") from None
    method = build_method(artifact.method, artifact.config)
    method.check_model(dims)
    try:
        method.build_storages(artifact.tensors, dims)
    except KvcalError as exc:
        raise KvcalError(f"{path}: {exc}") from None
    except Exception as exc:  # a shape or key the config does not expect
        raise KvcalError(f"{path}: its tensors do not fit method {artifact.method} with its config "
                         f"({type(exc).__name__}: {first_line(str(exc))})") from None
    stated, derived = artifact.header.get("bits_per_element"), bits_per_element(method, dims).bits_per_element
    # the header holds 6 decimals (artifact.py): a setting below 0.5 bits is off by up to 5e-7 = more than 1e-6 of it
    if stated is None or not math.isclose(stated, derived, rel_tol=1e-6, abs_tol=1e-6):
        raise KvcalError(f"{path}: the header says {stated} bits per element but its config gives {derived:.6g} "
                         "(an edited header?)")


def artifact_method(artifact, sets: list[str] | None = None, fp_window: int | None = None):
    """The method setting an artifact describes, with `sets` overriding its runtime fields (e.g. kvquant's
    key_outlier_capacity) and the full-precision allowance `fp_window` (--fp-window) where one is named."""
    method = build_method(artifact.method, {**artifact.config, **runtime_overrides(artifact.method, sets)})
    return method if fp_window is None else method.with_fp_window(fp_window)


def storages_for_artifact(artifact, loaded, path="artifact", sets: list[str] | None = None,
                          fp_window: int | None = None):
    """(method, its Storages) an artifact describes, after checking it was made for this model (artifact_method's
    settings)."""
    check_model(artifact, loaded, path)
    method = artifact_method(artifact, sets, fp_window)
    return method, method.build_storages(artifact.tensors, loaded.dims)
