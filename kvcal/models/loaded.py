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

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3")
# families that interleave sliding-window (local) and global attention layers
HYBRID_FAMILIES = ("gemma2", "gemma3_text")
# a norm follows the query and key projections: per head (after the split into heads), or over the whole projection
QK_NORM_FAMILIES = {"qwen3": "head", "gemma3_text": "head", "olmo2": "projection"}
FUSED_QKV_FAMILIES = ("phi3",)  # one qkv_proj whose rows are q, k, v in that order
LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer_types


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
    # hybrid-attention models (HYBRID_FAMILIES) only; None elsewhere, and then left out of to_dict (a model's identity)
    layer_types: tuple[str, ...] | None = None  # LOCAL or GLOBAL per layer
    sliding_window: int | None = None  # tokens a local layer attends to (the newest, itself included)
    local_rope: RopeSpec | None = None  # the local layers' RoPE where it differs from `rope` (Gemma 3)
    attn_softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)

    @property
    def hybrid(self) -> bool:
        """Whether some layers attend to a sliding window (the rest to every past token)."""
        return self.layer_types is not None and LOCAL in self.layer_types

    @property
    def qk_norm(self) -> bool:
        """Whether an RMSNorm follows the query and key projections (so keys are not linear in the layer input)."""
        return self.family in QK_NORM_FAMILIES

    @property
    def qk_norm_scope(self) -> str | None:
        """"head" (per head: Qwen3, Gemma 3), "projection" (over all heads at once: OLMo 2) or None."""
        return QK_NORM_FAMILIES.get(self.family)

    @property
    def fused_qkv(self) -> bool:
        """Whether one qkv_proj computes queries, keys and values (Phi-3)."""
        return self.family in FUSED_QKV_FAMILIES

    def layer_rope(self, layer: int) -> RopeSpec:
        """The RoPE of layer `layer` (a local layer of Gemma 3 has its own base)."""
        if self.local_rope is not None and self.layer_types[layer] == LOCAL:
            return self.local_rope
        return self.rope

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
        if family == "gemma3":
            raise KvcalError("model type 'gemma3' is Gemma 3's vision-language model: kvcal serves its text model "
                             "(model type gemma3_text, Gemma3ForCausalLM)")
        if family not in SUPPORTED_FAMILIES:
            raise KvcalError(
                f"unsupported model type '{family}'; kvcal supports {', '.join(SUPPORTED_FAMILIES)}"
            )
        window = sliding_window(config)
        max_positions = getattr(config, "max_position_embeddings", None)
        if window and family not in HYBRID_FAMILIES and max_positions and window >= max_positions:
            window = None  # a window as long as the longest sequence slides over nothing (Phi-3.5: 262144 > 131072)
        if window and family not in HYBRID_FAMILIES:
            raise KvcalError(f"sliding-window attention ({family}, window {window}) is not supported: kvcal's caches "
                             "attend to every past token")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        hybrid = {}
        if family in HYBRID_FAMILIES:
            hybrid = dict(layer_types=hybrid_layer_types(config), sliding_window=window,
                          local_rope=RopeSpec.from_config(config, head_dim, LOCAL),
                          attn_softcap=getattr(config, "attn_logit_softcapping", None) or None)
            if hybrid["local_rope"] == RopeSpec.from_config(config, head_dim, GLOBAL):
                hybrid["local_rope"] = None
        return cls(
            family=family,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            rope=RopeSpec.from_config(config, head_dim, GLOBAL if family in HYBRID_FAMILIES else None),
            **hybrid,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope"] = self.rope.to_dict()
        for name in ("layer_types", "sliding_window", "local_rope", "attn_softcap"):
            if d[name] is None:
                del d[name]  # the identity of a model without them is what it always was
        if "local_rope" in d:
            d["local_rope"] = self.local_rope.to_dict()
        if "layer_types" in d:
            d["layer_types"] = list(self.layer_types)
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


def mask_implementation(family: str) -> str:
    """The attn_implementation a model is loaded with. kvcal replaces every attention forward, so this picks only how
    transformers builds the masks it hands over: SDPA's, except where transformers refuses SDPA for the family (Gemma 2,
    whose scores are soft-capped)."""
    return "eager" if family == "gemma2" else "sdpa"


def hybrid_layer_types(config) -> tuple[str, ...]:
    """LOCAL or GLOBAL per layer: transformers 5 lists `layer_types`; older Gemma configs give a sliding-window
    pattern (Gemma 3: every `sliding_window_pattern`-th layer global; Gemma 2: even layers local)."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        unknown = set(types) - {LOCAL, GLOBAL}
        if unknown:
            raise KvcalError(f"unsupported attention layer types {sorted(unknown)} (kvcal knows {LOCAL} and {GLOBAL})")
        return tuple(types[:layers])
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", None)
    if pattern:
        return tuple(GLOBAL if (i + 1) % pattern == 0 else LOCAL for i in range(layers))
    return tuple(LOCAL if i % 2 == 0 else GLOBAL for i in range(layers))


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
        return attention_modules(self.model)[i].o_proj.weight.device

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
