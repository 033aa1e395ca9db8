"""Model loading and the attention adapter. `load_model(name)` is the only way kvcal gets a model; `as_loaded(model)`
wraps a transformers model a program loaded itself. ModelDims and LoadedModel are defined in kvcal/models/loaded.py
(re-exported here)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvcal.errors import KvcalError, first_line
from kvcal.models.adapter import install_adapter
from kvcal.models.devmap import (
    build_split,
    check_device_map,
    check_placement,
    dispatch,
    infer_map,
    loading_kwargs,
    normalize,
    placement_summary,
)
from kvcal.models.dims import check_local_config
from kvcal.models.gguf import (
    cache_root,
    check_gguf_servable,
    converted_folder_source,
    find_converted,
    inspect_gguf,
    local_gguf_source,
    package_gguf_source,
    package_parts,
)
from kvcal.models.loaded import (
    SUPPORTED_FAMILIES,
    LoadedModel,
    ModelDims,
    check_servable,
    head_dim_unsupported,
    mask_implementation,
    quiet_transformers,
    sliding_window,
)
from kvcal.models.registry import ALIASES, ModelSpec
from kvcal.models.tiny import build_random_model, byte_tokenizer, llama31_8b_config, tiny_config
from kvcal.progress import stderr_console

__all__ = ["DTYPES", "SUPPORTED_FAMILIES", "LoadedModel", "ModelDims", "Placement", "artifact_model", "as_loaded",
           "check_model_args", "check_servable", "describe_models", "dims_json", "head_dim_unsupported",
           "hub_reachable", "load_model", "resolve_device", "resolve_dtype", "sliding_window"]

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # for exactness checks (decode vs simulation without rounding noise)
}


def resolve_device(device: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise KvcalError(f"unknown device '{device}' (cpu, cuda, cuda:N or auto)")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KvcalError("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise KvcalError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def check_model_args(name: str, dtype: str, device: str) -> tuple[torch.dtype, str]:
    """The checks of load_model that need no loading (the CLI runs them before anything slow): the dtype, the device
    and the model's name. Returns the torch dtype and the resolved device."""
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    if name in ALIASES:
        if ALIASES[name].kind == "gguf":  # the packages that ship the file, before the data is read
            package_parts(ALIASES[name])
        return torch_dtype, device
    path = Path(name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        check_gguf_servable(inspect_gguf(path), path)  # the header only: well under a second
    elif path.is_dir():
        check_local_config(path)
    elif path.is_file():
        raise KvcalError(f"model file {name} is not a .gguf file (a local model is a .gguf file or a Hugging Face "
                         "model directory)")
    elif "/" in name or os.sep in name or name.startswith(("~", ".")) or path.suffix.lower() == ".gguf":
        raise KvcalError(f"model path {name} does not exist (--model takes a name from `kvcal models`, a local .gguf "
                         "file or a local Hugging Face model directory)")
    else:
        known = ", ".join(ALIASES)
        raise KvcalError(f"unknown model '{name}': use one of {known}, a local .gguf file or a local Hugging Face "
                         "model directory")
    return torch_dtype, device


def load_model(name: str, dtype: str = "float32", device: str = "cpu", adapt: bool = True, device_map=None,
               max_memory: dict | None = None) -> LoadedModel:
    """Load a model by alias or local directory and install kvcal's attention adapter on it. device_map: None (all on
    `device`), 'auto' / 'balanced' / 'sequential' (accelerate spreads the layers over the GPUs, each capped by
    max_memory {gpu index: size}) or an explicit {block name: device} map (kvcal.models.devmap)."""
    torch_dtype, device = check_model_args(name, dtype, device)
    if isinstance(device_map, str):
        check_device_map(device_map)
    place = Placement(device, device_map, max_memory)
    spec = ALIASES.get(name)
    quiet_transformers()
    if spec is None and Path(name).is_file():
        folder, source = local_gguf_source(Path(name))
        loaded = _load_converted(Path(name).stem, folder, torch_dtype, place, source)
    elif spec is None:
        converted = converted_folder_source(Path(name))  # a GGUF's conversion: the GGUF's identity
        if converted is not None:
            loaded = _load_converted(converted[0], Path(name), torch_dtype, place, converted[1])
        else:
            loaded = _load_local(name, torch_dtype, place)
    elif spec.kind == "tiny":
        loaded = _load_tiny(spec, torch_dtype, place)
    elif spec.kind == "random":
        loaded = _load_random(spec, torch_dtype, place)
    elif spec.kind == "gguf":
        folder, source = package_gguf_source(spec)
        loaded = _load_converted(spec.alias, folder, torch_dtype, place, source)
    else:
        loaded = _load_hub(spec, torch_dtype, place)
    if adapt:
        install_adapter(loaded)
    if device_map is not None:  # where each layer went: the one thing a user cannot see otherwise
        stderr_console.print(f"{loaded.name}: {placement_summary(loaded)}", markup=False, highlight=False)
    return loaded



def as_loaded(model) -> LoadedModel:
    """A LoadedModel for a model kvcal loaded, or for any supported transformers model (adapter installed)."""
    if isinstance(model, LoadedModel):
        return model
    existing = getattr(model, "_kvcal_loaded", None)
    if existing is not None:
        return existing
    dims = ModelDims.from_config(model.config)
    name = getattr(model.config, "_name_or_path", None) or type(model).__name__
    loaded = LoadedModel(name, model, None, dims, {"unverified": True})
    install_adapter(loaded)
    model._kvcal_loaded = loaded
    return loaded

@dataclass(frozen=True)
class Placement:
    """Where a model goes: one device, or a device map (with per-GPU caps)."""

    device: str
    device_map: object = None  # None, 'auto' / 'balanced' / 'sequential', or {block name: device}
    max_memory: dict | None = None


def _load_tiny(spec: ModelSpec, dtype, place: Placement) -> LoadedModel:
    config = tiny_config(spec.source)
    dims = ModelDims.from_config(config)
    masks = mask_implementation(dims.family)
    if place.device_map is None:
        model = build_random_model(config, dtype, place.device, seed=0, attn_implementation=masks)
    else:  # the same weights as on the map's first device alone, then moved block by block
        skeleton = build_random_model(config, dtype, "meta", seed=0, attn_implementation=masks)
        placement = infer_map(skeleton, place.device_map, place.max_memory, dtype)
        first = normalize(next(iter(placement.values())))
        model = dispatch(build_random_model(config, dtype, str(first), seed=0, attn_implementation=masks), placement)
    return LoadedModel(spec.alias, model, byte_tokenizer(), dims, {"random_seed": 0})


def _load_random(spec: ModelSpec, dtype, place: Placement) -> LoadedModel:
    config = llama31_8b_config()
    dims = ModelDims.from_config(config)
    source = {"random_seed": 0, "shapes": spec.source}
    if place.device_map is None:
        model = build_random_model(config, dtype, place.device, seed=0)
    else:  # never whole on one device: each module drawn on its own, seeded by its name (other weights)
        model = build_split(config, dtype, place.device_map, place.max_memory, seed=0)
        source["init"] = "per-module"
    return LoadedModel(spec.alias, model, byte_tokenizer(), dims, source)


def _load_converted(name: str, folder: Path, dtype, place: Placement, source: dict) -> LoadedModel:
    try:
        return _load_pretrained(name, str(folder), dtype, place, source)
    except (OSError, ValueError, SafetensorError) as exc:  # a cache folder left broken (by hand, a full disk)
        raise KvcalError(f"the converted {name} in {folder} does not load ({type(exc).__name__}): delete that "
                         "folder and kvcal converts the GGUF again") from exc


def _load_pretrained(name: str, path: str, dtype, place: Placement, source: dict,
                     local_only: bool = False) -> LoadedModel:
    config = AutoConfig.from_pretrained(path, local_files_only=local_only)
    dims = ModelDims.from_config(config)  # fail fast, before loading weights, on unsupported families
    check_servable(dims)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=mask_implementation(dims.family),
                                                 local_files_only=local_only,
                                                 **loading_kwargs(place.device_map, place.max_memory, config, dtype))
    if place.device_map is None:
        model = model.to(place.device)
    else:
        check_placement(getattr(model, "hf_device_map", None) or {"": place.device})
    model = model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    return LoadedModel(name, model, tokenizer, dims, source)


def _load_local(path: str, dtype, place: Placement) -> LoadedModel:
    folder = Path(path)
    check_local_config(folder)
    # Identity of a local directory: its config plus the names and sizes of its weight files (cheap,
    # and independent of the dtype it is loaded in).
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weight in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{weight.name}:{weight.stat().st_size}".encode())
    source = {"path": str(folder.resolve()), "files_sha256": digest.hexdigest()[:16]}
    try:
        return _load_pretrained(folder.name, str(folder), dtype, place, source)
    except (OSError, ValueError, SafetensorError) as exc:  # bad config.json, no weights, no tokenizer, truncated
        # files: transformers' own words, first line
        raise KvcalError(f"could not load the model in {path} ({type(exc).__name__}: {first_line(str(exc), 200)})") \
            from exc


def artifact_model(model: dict, artifact_path="artifact") -> str:
    """The --model that loads the model an artifact's header records (`model`: the header's identity), for a command
    given --artifact alone: an alias by its name; a local GGUF file by its sha256, in kvcal's conversion cache first,
    then at the path it was calibrated from; a local Hugging Face folder at its path. One line ending in
    'pass --model ...' where none of them is there any more."""
    name, source = model.get("name"), model.get("source") or {}
    if name in ALIASES or not isinstance(source, dict):
        return name
    path = source.get("path")
    sha = source.get("gguf_sha256")
    if sha:
        folder = find_converted(sha)
        if folder is not None:
            return str(folder)
        if path and Path(path).is_file():
            return path  # hashed when it loads: another file at that path is refused by check_model
        where = f"nor at {path}" if path else "and the artifact records no path"
        raise KvcalError(f"{artifact_path} was calibrated on {source.get('gguf_file') or name} (sha256 {sha[:16]}...), "
                         f"which is neither in kvcal's conversion cache ({cache_root() / 'models'}) {where}: pass "
                         "--model FILE.gguf")
    if path and Path(path).is_dir():
        return path
    if path:
        raise KvcalError(f"{artifact_path} was calibrated on the model folder {path}, which is not there any more: pass "
                         "--model DIR")
    if name and Path(name).exists():  # a model a program loaded by a relative path (kvcal.load_cache)
        return name
    raise KvcalError(f"{artifact_path} was calibrated on '{name}', which is not a model kvcal knows by name and the "
                     "artifact records no path: pass --model FILE or DIR")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub's endpoint opens within `timeout` seconds. Without one, huggingface_hub
    retries each request with back-off (about 25 s before a Hub alias failed offline). Behind a proxy (HTTPS_PROXY /
    ALL_PROXY) a direct connection says nothing, so the Hub counts as reachable."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    try:  # huggingface_hub comes with transformers; a release without the constant falls back to the public endpoint
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
    except (ImportError, AttributeError, ValueError):
        endpoint = urlparse("https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _load_hub(spec: ModelSpec, dtype, place: Placement) -> LoadedModel:
    # offline (HF_HUB_OFFLINE set, or no connection): the local Hugging Face cache only, at once
    offline_mode = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    local_only = offline_mode or not hub_reachable()
    try:
        config = AutoConfig.from_pretrained(spec.source, local_files_only=local_only)
    except Exception as exc:  # offline, gated, or not found: one line that says what to do
        if local_only:
            why = ("HF_HUB_OFFLINE is set" if offline_mode else "no connection to the Hub") + " and not in the local cache"
        else:
            why = type(exc).__name__
        raise KvcalError(
            f"could not fetch {spec.source} from the Hugging Face Hub ({why}); "
            "go online and log in (`hf auth login`), or pass a local model directory to --model"
        ) from None
    source = {"hub_id": spec.source, "revision": getattr(config, "_commit_hash", None) or "unknown"}
    if local_only and source["revision"] == "unknown":
        source["revision"] = "offline-cache"
    return _load_pretrained(spec.alias, spec.source, dtype, place, source, local_only)


def describe_models() -> list[dict]:
    return [
        {"name": s.alias, "kind": s.kind, "source": s.source, "description": s.description}
        for s in ALIASES.values()
    ]


def dims_json(dims: ModelDims) -> str:
    return json.dumps(dims.to_dict(), sort_keys=True)
