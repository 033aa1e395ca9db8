"""Model loading and the attention adapter. `load_model(name)` is the only way kvcal gets a model."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from kvcal.errors import KvcalError, first_line
from kvcal.models.devmap import check_device_map
from kvcal.models.registry import ALIASES, ModelSpec
from kvcal.quant.rope import RopeSpec

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # for exactness checks (decode vs simulation without rounding noise)
}


@dataclass(frozen=True)
class ModelDims:
    """Everything about a model's attention that kvcal needs, derived from its config."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rope: RopeSpec

    @property
    def kv_channels(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config) -> ModelDims:
        family = getattr(config, "model_type", "?")
        if getattr(config, "kv_lora_rank", None) is not None:
            raise KvcalError(f"model type '{family}' uses multi-head latent attention (MLA), which kvcal does not "
                             "support")
        if family not in SUPPORTED_FAMILIES:
            raise KvcalError(
                f"unsupported model type '{family}'; kvcal supports {', '.join(SUPPORTED_FAMILIES)}"
            )
        window = sliding_window(config)
        if window:
            raise KvcalError(f"sliding-window attention ({family}, window {window}) is not supported: kvcal's caches "
                             "attend to every past token")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            family=family,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            rope=RopeSpec.from_config(config, head_dim),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope"] = self.rope.to_dict()
        return d


def sliding_window(config) -> int | None:
    """The attention window of a config whose attention slides (in any layer), else None. Qwen2/Qwen3 configs carry a
    `sliding_window` that only applies with use_sliding_window; transformers 5 also lists `layer_types`."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if hasattr(config, "use_sliding_window"):
        return window if config.use_sliding_window else None
    return window


def head_dim_unsupported(head_dim: int) -> str | None:
    """Why kvcal cannot serve heads of head_dim channels (the decode kernels' rule), None when it can."""
    from kvcal.quant.tiles import head_dim_unsupported as kernel_rule

    why = kernel_rule(head_dim)
    return None if why is None else f"kvcal's decode kernels do not support {why}"


def check_servable(dims: ModelDims) -> None:
    """What a real model must also satisfy (the tiny test models, head_dim 16, run the torch paths only)."""
    why = head_dim_unsupported(dims.head_dim)
    if why:
        raise KvcalError(why)


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    dims: ModelDims
    source: dict = field(default_factory=dict)  # where the weights came from: revision or file hash
    adapter: object = None  # kvcal.models.adapter.Adapter, set by load_model

    @property
    def identity(self) -> dict:
        """What an artifact records about the model it was calibrated on (dtype-independent)."""
        return {"name": self.name, "source": self.source, **self.dims.to_dict()}

    @property
    def device(self) -> torch.device:
        """Where the model takes its input ids (its embeddings; the only device of a model on one device)."""
        return self.model.get_input_embeddings().weight.device

    def layer_device(self, i: int) -> torch.device:
        """The device of decoder layer i: where its attention weights are (its captures, codec tensors, cache storage
        and step graphs live there)."""
        from kvcal.models.adapter import attention_modules

        return attention_modules(self.model)[i].q_proj.weight.device

    @property
    def devices(self) -> list[torch.device]:
        """Every device the model's parameters are on, in order of first use."""
        seen = {}
        for p in self.model.parameters():
            seen.setdefault(str(p.device), p.device)
        return list(seen.values())

    @property
    def device_label(self) -> str:
        """What records state as the device: 'cuda:0', or 'cuda:0+cuda:1' for a model split over two."""
        return "+".join(str(d) for d in self.devices)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


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
            from kvcal.models.gguf import package_parts

            package_parts(ALIASES[name])
        return torch_dtype, device
    path = Path(name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from kvcal.models.gguf import check_gguf_servable, inspect_gguf

        check_gguf_servable(inspect_gguf(path), path)  # the header only: well under a second
    elif path.is_dir():
        _check_local_config(path)
    else:
        known = ", ".join(ALIASES)
        raise KvcalError(f"unknown model '{name}': use one of {known}, a local .gguf file or a local Hugging Face "
                         "model directory")
    return torch_dtype, device


def _check_local_config(folder: Path):
    """The config of a local model folder, refused in one line when it is missing, unreadable or describes a model kvcal
    cannot serve; and its weight files, refused when there are none."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise KvcalError(f"{folder} is not a Hugging Face model directory (no config.json)")
    _quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvcalError(f"{folder}/config.json does not load ({type(exc).__name__}: {first_line(str(exc), 160)})") \
            from None
    try:
        check_servable(ModelDims.from_config(config))
    except (AttributeError, TypeError) as exc:
        raise KvcalError(f"{folder}/config.json lacks what kvcal needs ({first_line(str(exc), 160)})") from None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise KvcalError(f"{folder} has no weights (no *.safetensors or *.bin file)")
    return config


def load_model(name: str, dtype: str = "float32", device: str = "cpu", adapt: bool = True, device_map=None,
               max_memory: dict | None = None) -> LoadedModel:
    """Load a model by alias or local directory and install kvcal's attention adapter on it. device_map: None (all on
    `device`), 'auto' / 'balanced' / 'sequential' (accelerate spreads the layers over the GPUs, each capped by
    max_memory {gpu index: size}) or an explicit {block name: device} map (kvcal.models.devmap)."""
    from kvcal.models.adapter import install_adapter

    torch_dtype, device = check_model_args(name, dtype, device)
    if isinstance(device_map, str):
        check_device_map(device_map)
    place = Placement(device, device_map, max_memory)
    spec = ALIASES.get(name)
    _quiet_transformers()
    if spec is None and Path(name).is_file():
        from kvcal.models.gguf import local_gguf_source

        folder, source = local_gguf_source(Path(name))
        loaded = _load_converted(Path(name).stem, folder, torch_dtype, place, source)
    elif spec is None:
        from kvcal.models.gguf import converted_folder_source

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
        from kvcal.models.gguf import package_gguf_source

        folder, source = package_gguf_source(spec)
        loaded = _load_converted(spec.alias, folder, torch_dtype, place, source)
    else:
        loaded = _load_hub(spec, torch_dtype, place)
    if adapt:
        install_adapter(loaded)
    if device_map is not None:  # where each layer went: the one thing a user cannot see otherwise
        from kvcal.models.devmap import placement_summary
        from kvcal.progress import stderr_console

        stderr_console.print(f"{loaded.name}: {placement_summary(loaded)}", markup=False, highlight=False)
    return loaded


@dataclass(frozen=True)
class Placement:
    """Where a model goes: one device, or a device map (with per-GPU caps)."""

    device: str
    device_map: object = None  # None, 'auto' / 'balanced' / 'sequential', or {block name: device}
    max_memory: dict | None = None


def _quiet_transformers() -> None:
    # kvcal draws its own progress bars; transformers' per-tensor bars and warnings are noise here.
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _load_tiny(spec: ModelSpec, dtype, place: Placement) -> LoadedModel:
    from kvcal.models.devmap import dispatch, infer_map, normalize
    from kvcal.models.tiny import build_random_model, byte_tokenizer, tiny_config

    config = tiny_config(spec.source)
    dims = ModelDims.from_config(config)
    if place.device_map is None:
        model = build_random_model(config, dtype, place.device, seed=0)
    else:  # the same weights as on the map's first device alone, then moved block by block
        skeleton = build_random_model(config, dtype, "meta", seed=0)
        placement = infer_map(skeleton, place.device_map, place.max_memory, dtype)
        first = normalize(next(iter(placement.values())))
        model = dispatch(build_random_model(config, dtype, str(first), seed=0), placement)
    return LoadedModel(spec.alias, model, byte_tokenizer(), dims, {"random_seed": 0})


def _load_random(spec: ModelSpec, dtype, place: Placement) -> LoadedModel:
    from kvcal.models.devmap import build_split
    from kvcal.models.tiny import build_random_model, byte_tokenizer, llama31_8b_config

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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvcal.models.devmap import check_placement, loading_kwargs

    config = AutoConfig.from_pretrained(path, local_files_only=local_only)
    dims = ModelDims.from_config(config)  # fail fast, before loading weights, on unsupported families
    check_servable(dims)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=local_only,
                                                 **loading_kwargs(place.device_map, place.max_memory))
    if place.device_map is None:
        model = model.to(place.device)
    else:
        check_placement(getattr(model, "hf_device_map", None) or {"": place.device})
    model = model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    return LoadedModel(name, model, tokenizer, dims, source)


def _load_local(path: str, dtype, place: Placement) -> LoadedModel:
    folder = Path(path)
    _check_local_config(folder)
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
        from kvcal.models.gguf import cache_root, find_converted

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
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    try:
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
    from transformers import AutoConfig

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
