"""What `kvcal bench decode` and the tuning scripts time: recipes and artifacts resolved to their storages at given
shapes (the timing itself, method-free, is kvcal/runtime/bench.py)."""

from __future__ import annotations

from types import SimpleNamespace

from kvcal.artifact import check_model, load_artifact
from kvcal.methods.registry import build_method, runtime_overrides
from kvcal.models import ModelDims
from kvcal.models.tiny import llama31_8b_config
from kvcal.recipes import resolve


def bench_cases(recipes, artifacts, dims, sets: list[str] | None = None) -> list[tuple[str, object, object]]:
    """(name, method, storages) for each recipe and artifact, at the shapes `dims` (a ModelDims). A recipe of a method
    that learns gets random tensors of the right shapes (Method.synthetic_tensors: speed does not depend on them); an
    artifact must have been calibrated for these shapes. `sets`: --set overrides (runtime fields on artifacts)."""
    cases = []
    for recipe in recipes:
        method, _, _ = resolve(None, recipe, sets)
        method.check_model(dims)
        cases.append((recipe, method, method.build_storages(method.synthetic_tensors(dims), dims)))
    for path in artifacts:
        art = load_artifact(path)
        check_model(art, SimpleNamespace(name="these shapes", identity=dims.to_dict()), path, identity=False)
        method = build_method(art.method, {**art.config, **runtime_overrides(art.method, sets)})
        cases.append((str(path).rsplit("/", 1)[-1].removesuffix(".safetensors"), method,
                      method.build_storages(art.tensors, dims)))
    return cases


def storage_for(recipe: str, dims=None):
    """(layer 0's storage, RoPE inv_freq) of a recipe at Llama-3.1-8B shapes by default (tuning scripts; a method
    that learns gets random tables)."""
    dims = dims or ModelDims.from_config(llama31_8b_config())
    (_, _, storages), = bench_cases([recipe], [], dims)
    return storages[0], dims.rope.inv_freq("cuda")
