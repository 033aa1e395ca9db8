"""What the rest of kvcal knows of a model, whatever loaded it: its attention shapes (`ModelDims`, from its config),
the model with its tokenizer and adapter (`LoadedModel`), and the rules a model kvcal serves must meet.

The other modules of kvcal/models import these from here, never from the package: kvcal/models/__init__.py
re-exports them and imports those modules at its top.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch
import transformers

from kvcal.errors import KvcalError
from kvcal.models.adapter import attention_modules
from kvcal.quant.rope import RopeSpec
from kvcal.quant.tiles import head_dim_unsupported as kernel_rule

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


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


def quiet_transformers() -> None:
    # kvcal draws its own progress bars; transformers' per-tensor bars and warnings are noise here.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
