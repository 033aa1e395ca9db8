"""Recipes (one YAML per method setting) and `--set key=value` overrides.

    method: kivi          # registered method name
    config: {bits: 2, group_size: 32, residual: 128}
    calibration: {dataset: wikitext2, nsamples: 16, seqlen: 2048, seed: 0}   # optional

The recipe's file name (without .yaml) is its tag in default artifact names. `--recipe NAME` looks for
NAME as a path, then for recipes/NAME.yaml in the current directory, then among the recipes that ship inside the
package (kvcal/recipes: in a checkout, a link to the top-level recipes/ folder; in an installed kvcal, a copy).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvcal.accounting import REFERENCE_TOKENS, bits_per_element
from kvcal.errors import KvcalError
from kvcal.methods.registry import build_method, parse_sets

CALIBRATION_DEFAULTS = {"dataset": "wikitext2", "nsamples": 16, "seqlen": 2048, "seed": 0}
RECIPE_KEYS = {"method", "config", "calibration", "description"}


@dataclass
class Recipe:
    method: str
    config: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    name: str | None = None
    description: str = ""


def recipe_dirs() -> list[Path]:
    return [Path.cwd() / "recipes", Path(__file__).parent / "recipes"]


def recipe_names() -> list[str]:
    """Every recipe `--recipe NAME` finds, by the name it is found under (subfolders such as `ablations/` prefix it),
    each once: where the current directory's recipes/ and the shipped ones share a name, the first wins, as in
    find_recipe."""
    names = set()
    for folder in recipe_dirs():
        if folder.is_dir():
            names.update(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))
    return sorted(names, key=lambda n: (n.count("/"), n))


def describe_recipes(dims, tokens: int = REFERENCE_TOKENS) -> list[dict]:
    """One row per recipe: name, method, bits per element on a model of `dims` at `tokens` tokens (None where the
    setting does not fit the model or the recipe does not load, `problem` saying why, `broken` when the recipe itself is
    at fault) and its description."""
    rows = []
    for name in recipe_names():
        row = {"name": name, "method": "-", "bits_per_element": None, "description": "", "problem": None,
               "broken": False}
        try:
            recipe = load_recipe(name)
            row["method"] = recipe.method
            row["description"] = recipe.description
            method = build_method(recipe.method, recipe.config)
        except KvcalError as exc:  # the recipe itself: unreadable, or a config its method refuses
            row["problem"], row["broken"] = str(exc), True
            rows.append(row)
            continue
        try:
            method.check_model(dims)
            row["bits_per_element"] = bits_per_element(method, dims, tokens).bits_per_element
        except KvcalError as exc:
            row["problem"] = str(exc)
        rows.append(row)
    return rows


def find_recipe(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    for folder in recipe_dirs():
        candidate = folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
        if candidate.is_file():
            return candidate
    known = sorted({p.stem for folder in recipe_dirs() if folder.is_dir() for p in folder.glob("*.yaml")})
    raise KvcalError(f"recipe '{name}' not found (`kvcal recipes` lists them; known: {', '.join(known) or 'none'})")


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
    description = data.get("description") or ""
    if not isinstance(description, str):
        raise KvcalError(f"recipe {path}: 'description' must be one line of text, got {description!r}")
    return Recipe(data["method"], data.get("config") or {}, calibration, path.stem, " ".join(description.split()))


def resolve(method: str | None, recipe: str | None, sets: list[str] | None):
    """(Method instance, artifact tag, calibration defaults) from --method/--recipe and --set.

    The tag names the setting (artifact files, eval records): a recipe's own name, or the method's tag for --method.
    A --set that changes the config adds each changed key and its value to it (`xquant-svd-2bit` with --set
    group_channels=32: `svd-2bit-group_channels32`), so a changed setting never takes the name of another; for
    --method only the keys the method's tag does not already show are added."""
    if bool(method) == bool(recipe):
        raise KvcalError("give exactly one of --method NAME or --recipe FILE")
    if recipe:
        r = load_recipe(recipe)
    else:
        r = Recipe(method)
    overrides = parse_sets(sets)
    instance = build_method(r.method, {**r.config, **overrides})
    changed = changed_keys(build_method(r.method, r.config), instance) if overrides else []
    if r.name:
        prefix = f"{instance.name}-"
        tag = r.name[len(prefix) :] if r.name.startswith(prefix) else r.name
    else:
        tag = instance.tag()
        changed = [key for key in changed if _tag_without(instance, key) == tag]  # what the tag does not show
    return instance, tag + changed_suffix(instance, changed), {**CALIBRATION_DEFAULTS, **r.calibration}


def changed_suffix(instance, keys: list[str]) -> str:
    """What a setting's name gains for the config keys changed from its recipe or artifact: `-KEYVALUE` each."""
    return "".join(f"-{key}{_name_value(getattr(instance, key))}" for key in keys)


def changed_keys(base, instance) -> list[str]:
    """The config keys whose value differs between two settings of one method, in the config's order."""
    before, after = base.config(), instance.config()
    return [key for key in after if after[key] != before.get(key)]


def _tag_without(instance, key: str) -> str:
    """The method's tag of `instance` with `key` back at its default (where that setting is valid)."""
    default = next(f.default for f in dataclasses.fields(instance) if f.name == key)
    try:
        return dataclasses.replace(instance, **{key: default}).tag()
    except (KvcalError, TypeError, ValueError):
        return ""


def _name_value(value) -> str:
    """A config value as it reads in a file name: 0.5, true, none; other characters than letters, digits, '.', '+'
    and '-' become '_'."""
    text = f"{value:g}" if isinstance(value, float) else str(value).lower()
    return re.sub(r"[^A-Za-z0-9.+-]", "_", text)
