"""Recipes (one YAML per method setting) and `--set key=value` overrides.

    method: kivi          # registered method name
    config: {bits: 2, group_size: 32, residual: 128}
    calibration: {dataset: wikitext2, nsamples: 16, seqlen: 2048, seed: 0}   # optional

The recipe's file name (without .yaml) is its tag in default artifact names. `--recipe NAME` looks for
NAME as a path, then for recipes/NAME.yaml in the current directory, then among the recipes that ship inside the
package (kvcal/recipes: in a checkout, a link to the top-level recipes/ folder; in an installed kvcal, a copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvcal.errors import KvcalError
from kvcal.methods.registry import build_method

CALIBRATION_DEFAULTS = {"dataset": "wikitext2", "nsamples": 16, "seqlen": 2048, "seed": 0}
RECIPE_KEYS = {"method", "config", "calibration", "description"}


@dataclass
class Recipe:
    method: str
    config: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    name: str | None = None


def recipe_dirs() -> list[Path]:
    return [Path.cwd() / "recipes", Path(__file__).parent / "recipes"]


def find_recipe(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    for folder in recipe_dirs():
        candidate = folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
        if candidate.is_file():
            return candidate
    known = sorted({p.stem for folder in recipe_dirs() if folder.is_dir() for p in folder.glob("*.yaml")})
    raise KvcalError(f"recipe '{name}' not found (known: {', '.join(known) or 'none'})")


def load_recipe(name: str) -> Recipe:
    path = find_recipe(name)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise KvcalError(f"recipe {path} is not valid YAML ({exc.__class__.__name__})") from None
    except UnicodeDecodeError:
        raise KvcalError(f"recipe {path} is not UTF-8 text") from None
    if not isinstance(data, dict) or "method" not in data:
        raise KvcalError(f"recipe {path} must be a mapping with at least a 'method' key")
    unknown = set(data) - RECIPE_KEYS
    if unknown:
        raise KvcalError(f"recipe {path} has unknown keys {sorted(unknown)} (allowed: {sorted(RECIPE_KEYS)})")
    if not isinstance(data["method"], str):
        raise KvcalError(f"recipe {path}: 'method' must be a method name, got {data['method']!r}")
    for key in ("config", "calibration"):
        if not isinstance(data.get(key) or {}, dict):
            raise KvcalError(f"recipe {path}: '{key}' must be a mapping (key: value lines), got {data[key]!r}")
    calibration = data.get("calibration") or {}
    bad = set(calibration) - set(CALIBRATION_DEFAULTS)
    if bad:
        raise KvcalError(f"recipe {path}: unknown calibration keys {sorted(bad)}")
    for key, value in calibration.items():
        kind = str if key == "dataset" else int
        if not isinstance(value, kind) or isinstance(value, bool):
            raise KvcalError(f"recipe {path}: calibration.{key} must be {'a string' if kind is str else 'an integer'}, "
                             f"got {value!r}")
    return Recipe(data["method"], data.get("config") or {}, calibration, path.stem)


def parse_sets(items: list[str] | None) -> dict:
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


def resolve(method: str | None, recipe: str | None, sets: list[str] | None):
    """(Method instance, artifact tag, calibration defaults) from --method/--recipe and --set."""
    if bool(method) == bool(recipe):
        raise KvcalError("give exactly one of --method NAME or --recipe FILE")
    if recipe:
        r = load_recipe(recipe)
    else:
        r = Recipe(method)
    instance = build_method(r.method, {**r.config, **parse_sets(sets)})
    if r.name and not sets:
        prefix = f"{instance.name}-"
        tag = r.name[len(prefix) :] if r.name.startswith(prefix) else r.name
    else:
        tag = instance.tag()
    return instance, tag, {**CALIBRATION_DEFAULTS, **r.calibration}
