"""A model's attention dims and context length without loading its weights, and the context check of commands that
cut windows.

`model_dims(name)` reads what the shapes come from and nothing else: the config in code (tiny and random models), a
GGUF header (smollm2-135m, a local .gguf file) or a local folder's config.json (`check_local_config`, which
load_model runs on a folder before loading it). It serves what needs only the shapes
(`kvcal recipes`: bits per element); loading a model gives the same ModelDims (tests/test_recipes.py).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from kvcal.errors import KvcalError, first_line
from kvcal.models.gguf import GGUF_FAMILIES, check_gguf_servable, inspect_gguf, package_parts
from kvcal.models.loaded import ModelDims, check_servable, quiet_transformers
from kvcal.models.registry import ALIASES
from kvcal.models.tiny import llama31_8b_config, tiny_config
from kvcal.quant.rope import RopeSpec


class DimsNeedTheModel(KvcalError):
    """model_dims cannot read these shapes without loading the model (its config on the Hub, a GGUF in parts): a
    command that only plans before loading (kvcal search) plans after the load instead."""


def model_dims(name: str) -> ModelDims:
    """The ModelDims of a model alias, a local single-file .gguf or a local Hugging Face folder, from its config alone
    (a GGUF header gives the rope theta but not a rope scaling: the shapes are what this is for). A model whose config
    needs the Hub or a model in several GGUF parts is refused in one line."""
    spec = ALIASES.get(name)
    if spec is not None and spec.kind == "tiny":
        return ModelDims.from_config(tiny_config(spec.source))
    if spec is not None and spec.kind == "random":
        return ModelDims.from_config(llama31_8b_config())
    if spec is not None and spec.kind == "gguf":
        parts, _ = package_parts(spec)
        if len(parts) > 1:
            raise DimsNeedTheModel(f"{name} is one GGUF file in {len(parts)} parts, whose dims are not read "
                                   "without joining them: use --model smollm2-135m, a tiny model or a local model "
                                   "folder")
        return gguf_dims(parts[0])
    if spec is not None:
        raise DimsNeedTheModel(f"{name}'s config comes from the Hub ({spec.source}): give its local folder instead")
    path = Path(name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_dims(path)
    if path.is_dir():
        return ModelDims.from_config(check_local_config(path))
    raise KvcalError(f"unknown model '{name}': use one of {', '.join(ALIASES)}, a local .gguf file or a local Hugging "
                     "Face model directory")


def check_local_config(folder: Path):
    """The config of a local model folder, refused in one line when it is missing, unreadable or describes a model kvcal
    cannot serve; and its weight files, refused when there are none."""
    if not (folder / "config.json").is_file():
        raise KvcalError(f"{folder} is not a Hugging Face model directory (no config.json)")
    quiet_transformers()
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


def gguf_dims(path: Path) -> ModelDims:
    """ModelDims from a GGUF header (the tensors are not read). A Gemma 3 header lacks the layer pattern and the local
    layers' RoPE base: they are transformers' Gemma3TextConfig defaults, as the conversion of the file takes them."""
    info = inspect_gguf(path)
    check_gguf_servable(info, path)
    if info.architecture == "gemma3":
        from transformers import Gemma3TextConfig

        return ModelDims.from_config(Gemma3TextConfig(
            num_hidden_layers=int(info.get("block_count")), num_attention_heads=int(info.get("attention.head_count")),
            num_key_value_heads=int(info.get("attention.head_count_kv")), hidden_size=int(info.get("embedding_length")),
            head_dim=int(info.get("attention.key_length")), sliding_window=int(info.get("attention.sliding_window")),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default",
                                                "rope_theta": float(info.get("rope.freq_base", 1000000.0))}}))
    heads, hidden = int(info.get("attention.head_count")), int(info.get("embedding_length"))
    head_dim = int(info.get("attention.key_length") or hidden // heads)
    return ModelDims(family=GGUF_FAMILIES[info.architecture], num_layers=int(info.get("block_count")), num_heads=heads,
                     num_kv_heads=int(info.get("attention.head_count_kv") or heads), head_dim=head_dim,
                     hidden_size=hidden, rope=RopeSpec(head_dim, float(info.get("rope.freq_base", 10000.0))))


def context_length(config) -> int | None:
    """The longest sequence the model's positions were made for (max_position_embeddings), None when unknown."""
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if limit else None


def check_context(loaded, tokens: int, flag: str) -> None:
    """One-line refusal of windows longer than the model's context: positions past it are untrained, and on a CPU
    their attention runs for minutes per window."""
    limit = context_length(loaded.model.config)
    if limit is not None and tokens > limit:
        raise KvcalError(f"{flag} {tokens} exceeds {loaded.name}'s context of {limit} tokens "
                         f"(max_position_embeddings): use {flag} {limit} or less")
