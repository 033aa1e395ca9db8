"""The adapter: kvcal's own attention forward for the supported families.

This is the only module that knows transformers internals. `install_adapter` replaces the `forward`
of each attention module instance (never the class) with `kvcal_attention_forward`, which computes the
projections, hands pre-RoPE keys, values, queries and the layer input X to the active handler, and
applies RoPE itself. Handlers decide what attention sees:

- `StandardAttention` (the default): exact transformers semantics, including any HF `Cache`.
- the gptq simulation (`kvcal.eval.simulate`), calibration capture (`kvcal.calib.capture`), ...
- a kvcal runtime cache passed to the model (as `cache=` or `past_key_values=`, whichever the installed
  transformers takes) takes over attention for its layer.

transformers 5.24 renamed the cache argument of every model and attention forward from `past_key_values` to
`cache`. kvcal reads the name once per model class from the forward's signature (`cache_argument`) and passes
the cache under it (`cache_kwargs`, `forward_with_cache`); the attention forward accepts both spellings and
refuses, in one line, a call that asks for a cache (use_cache=True) but hands it under a name it does not know.
"""

from __future__ import annotations

import functools
import inspect
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers
from transformers.cache_utils import Cache

from kvcal.errors import KvcalError
from kvcal.models.attention import attention
from kvcal.models.devmap import device_scope
from kvcal.quant.rope import apply_rope, rope_cos_sin


@dataclass
class AttentionInputs:
    layer_idx: int
    module: torch.nn.Module
    q: torch.Tensor  # [B, Hq, T, D], before RoPE (after q_norm for Qwen3, Gemma 3, OLMo 2)
    k_pre: torch.Tensor  # [B, Hkv, T, D], before RoPE (after k_norm for Qwen3, Gemma 3, OLMo 2)
    v: torch.Tensor  # [B, Hkv, T, D]
    x: torch.Tensor  # [B, T, hidden], the attention input (after the input layer norm)
    positions: torch.Tensor  # [B, T] absolute positions (RoPE angles)
    cos: torch.Tensor  # [B, T, D]
    sin: torch.Tensor
    mask: torch.Tensor | None  # as transformers passed it
    cache: object | None  # the cache transformers passed (`cache` or `past_key_values`)
    scale: float
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2), None: plain

    def rotated(self) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(self.q, self.cos, self.sin), apply_rope(self.k_pre, self.cos, self.sin)

    def project(self, xk: torch.Tensor, xv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """KVProjection.project of this layer."""
        return self.kv_projection().project(xk, xv)

    def finish(self, k_lin: torch.Tensor, v_lin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KVProjection.finish of this layer."""
        return self.kv_projection().finish(k_lin, v_lin)

    def kv_projection(self) -> KVProjection:
        """This layer's K and V projections as tensors (for storages that rebuild keys and values themselves)."""
        adapter = self.module._kvcal_binding[0]
        (w_k, b_k), (w_v, b_v) = projection_weights(self.module, adapter.dims, "k", "v")
        return KVProjection(w_k, b_k, w_v, b_v, adapter.qk_norm, self.module, self.x.dtype)


@dataclass(frozen=True)
class KVProjection:
    """k = x w_k^T + b_k, v = x w_v^T + b_v (weights [Hkv * D, hidden] as transformers stores them); k_norm: a
    norm follows the key projection (per head: Qwen3, Gemma 3; over the whole projection: OLMo 2)."""

    w_k: torch.Tensor
    b_k: torch.Tensor | None
    w_v: torch.Tensor
    b_v: torch.Tensor | None
    k_norm: bool
    module: torch.nn.Module | None = None  # the attention module (project and finish run its own layers)
    dtype: torch.dtype | None = None  # the model's activations

    def project(self, xk: torch.Tensor, xv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before RoPE) and values [B, Hkv, T, D] that this layer's projections make of attention inputs
        xk (for the keys) and xv (for the values; default xk), [B, T, hidden]: exactly how k_pre and v came from x
        (bias, Qwen3's k_norm). Methods that cache X or a latent of it rebuild K and V with it."""
        adapter = self.module._kvcal_binding[0]
        xv = xk if xv is None else xv
        return project_kv(self.module, adapter, xk.to(self.dtype), xv.to(self.dtype))

    def finish(self, k_lin: torch.Tensor, v_lin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before RoPE) and values [B, Hkv, T, D] from the bias-free outputs of the K and V projections
        [B, T, Hkv * D] (x W^T, however it was computed): the bias added, the key norm applied."""
        adapter = self.module._kvcal_binding[0]
        k, v = ((lin.to(self.dtype) if b is None else lin.to(self.dtype) + b.to(self.dtype))
                for lin, b in ((k_lin, self.b_k), (v_lin, self.b_v)))
        return _heads(self.module, adapter, k, v)


class StandardAttention:
    """Plain attention with transformers' cache semantics (what the stock model computes)."""

    def attend(self, inp: AttentionInputs) -> torch.Tensor:
        q, k = inp.rotated()
        v = inp.v
        if inp.cache is not None:
            k, v = inp.cache.update(k, v, inp.layer_idx)
        return attention(q, k, v, inp.mask, inp.scale, inp.softcap)


class Adapter:
    """Per-model state of the adapter: dims, RoPE frequencies and the active handler."""

    def __init__(self, dims, device):
        self.dims = dims
        self.inv_freq = dims.rope.inv_freq(device)
        self._inv_freqs = {(self.inv_freq.device, dims.rope): self.inv_freq}
        self.qk_norm = dims.qk_norm
        self.handler = StandardAttention()

    def inv_freq_on(self, device: torch.device, layer: int | None = None) -> torch.Tensor:
        """The RoPE frequencies on `device` (a layer's device; one copy per device of a split model), of layer
        `layer` where layers differ (Gemma 3's local layers), else the model's."""
        rope = self.dims.rope if layer is None else self.dims.layer_rope(layer)
        found = self._inv_freqs.get((device, rope))
        if found is None:
            found = self._inv_freqs[(device, rope)] = rope.inv_freq(device)
        return found

    @contextmanager
    def use(self, handler):
        """Route every attention layer through `handler` inside the block."""
        previous, self.handler = self.handler, handler
        try:
            yield handler
        finally:
            self.handler = previous


def attention_modules(model) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise KvcalError(f"{type(model).__name__} has no model.layers; it is not a supported decoder")
    return [layer.self_attn for layer in layers]


def install_adapter(loaded) -> Adapter:
    """Swap the attention forward of every layer of `loaded.model` for kvcal's. Idempotent."""
    if loaded.adapter is not None:
        return loaded.adapter
    adapter = Adapter(loaded.dims, loaded.device)
    projections = ("qkv_proj",) if loaded.dims.fused_qkv else ("q_proj", "k_proj", "v_proj")
    for idx, module in enumerate(attention_modules(loaded.model)):
        for name in projections + ("o_proj",) + (("q_norm", "k_norm") if adapter.qk_norm else ()):
            if not hasattr(module, name):
                raise KvcalError(f"layer {idx} attention has no {name}; the model does not match its family")
        module._kvcal_binding = (adapter, idx)
        module.forward = types.MethodType(kvcal_attention_forward, module)
    loaded.adapter = adapter
    return adapter


def projection_weights(module, dims, *names: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight [out, in], bias or None) of one attention module's projections `names` ("q", "k", "v"), detached:
    its own q_proj / k_proj / v_proj, or their rows of a fused qkv_proj (Phi-3: q, k, v stacked in that order)."""
    if not dims.fused_qkv:
        projs = [getattr(module, f"{n}_proj") for n in names]
        return [(p.weight.detach(), None if p.bias is None else p.bias.detach()) for p in projs]
    fused = module.qkv_proj
    out = []
    for n in names:
        rows = _qkv_rows(dims, n)
        out.append((fused.weight.detach()[rows], None if fused.bias is None else fused.bias.detach()[rows]))
    return out


def _qkv_rows(dims, name: str) -> slice:
    q, kv = dims.num_heads * dims.head_dim, dims.kv_channels
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[name]


def kv_projection_weights(model, dims) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(W_k, W_v) of every layer, [out, in] as transformers stores them (detached)."""
    return [tuple(w for w, _ in projection_weights(m, dims, "k", "v")) for m in attention_modules(model)]


# The names under which transformers releases pass the cache to a model's and an attention module's forward,
# newest first (5.24 renamed past_key_values to cache; some 4.x releases used past_key_value in attention).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def cache_argument(model) -> str:
    """The keyword under which this model's forward (and generate()) takes the cache: read once per class from
    the forward's signature, not from the transformers version."""
    params = _forward_parameters(type(model))
    for name in CACHE_ARGUMENTS[:2]:
        if name in params:
            return name
    raise KvcalError(f"transformers {transformers.__version__}: {type(model).__name__}.forward takes neither "
                     "`cache` nor `past_key_values`, so kvcal cannot hand it a cache")


def cache_kwargs(model, cache) -> dict:
    """{name: cache} for `model(...)` or `model.generate(...)` with the installed transformers' spelling."""
    return {cache_argument(model): cache}


def forward_with_cache(model, input_ids: torch.Tensor, cache, **kwargs):
    """`model(input_ids, <cache argument>=cache, use_cache=True, **kwargs)`. `cache_position` is dropped where the
    forward no longer takes it (transformers >= 5.24 derives positions from position_ids)."""
    if "cache_position" in kwargs and "cache_position" not in _forward_parameters(type(model)):
        kwargs.pop("cache_position")
    return model(input_ids, **cache_kwargs(model, cache), use_cache=True, **kwargs)


def _received_cache(kwargs: dict):
    """The cache transformers handed to the attention forward, under whichever name it used. A Cache under a name
    kvcal does not know, or use_cache=True with no cache at all, is a call kvcal would silently run without its
    cache: refused in one line that names the argument and the transformers version."""
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    unknown = [name for name, value in kwargs.items() if isinstance(value, Cache) or hasattr(value, "kvcal_attend")]
    if unknown:
        raise KvcalError(f"transformers {transformers.__version__} passes the cache to attention as `{unknown[0]}`, "
                         f"which kvcal's adapter does not know (it reads {', '.join(CACHE_ARGUMENTS)}): the cache "
                         "would be bypassed; use a transformers version listed in kvcal's constraints.txt")
    if kwargs.get("use_cache"):
        raise KvcalError(f"transformers {transformers.__version__} asked kvcal's attention to use a cache "
                         f"(use_cache=True) but passed none under {', '.join(CACHE_ARGUMENTS)}: the cache would be "
                         "bypassed; use a transformers version listed in kvcal's constraints.txt")
    return None


def _linear(module, dims, name: str, x: torch.Tensor) -> torch.Tensor:
    """The output [B, T, heads * D] of projection `name` ("q", "k", "v") of attention inputs x (bias included)."""
    if not dims.fused_qkv:
        return getattr(module, f"{name}_proj")(x)
    (w, b), = projection_weights(module, dims, name)
    return torch.nn.functional.linear(x, w, b)


def _heads(module, adapter, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_pre and v [B, Hkv, T, D] of the key and value projections' outputs [B, T, Hkv * D]: the key norm applied
    where the family has one (over the whole projection before the split into heads, or per head after it)."""
    batch, length, _ = k.shape
    if adapter.dims.qk_norm_scope == "projection":
        k = module.k_norm(k)
    k = k.view(batch, length, -1, adapter.dims.head_dim)
    if adapter.dims.qk_norm_scope == "head":
        k = module.k_norm(k)
    return k.transpose(1, 2), v.view(batch, length, -1, adapter.dims.head_dim).transpose(1, 2)


def project_kv(module, adapter, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_pre and v [B, Hkv, T, D] of attention inputs xk and xv [B, T, hidden]."""
    dims = adapter.dims
    return _heads(module, adapter, _linear(module, dims, "k", xk), _linear(module, dims, "v", xv))


def _positions(position_ids, cache_position, batch: int, length: int, device) -> torch.Tensor:
    if position_ids is not None:
        return position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
    if cache_position is not None:
        return cache_position[None].expand(batch, -1)
    return torch.arange(length, device=device)[None].expand(batch, -1)


def kvcal_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings=None,
    attention_mask: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
):
    adapter, layer_idx = self._kvcal_binding
    dims = adapter.dims
    batch, length, _ = hidden_states.shape
    if dims.fused_qkv:  # one product, split as the family splits it
        qkv = self.qkv_proj(hidden_states)
        q, k_lin, v_lin = (qkv[..., _qkv_rows(dims, n)] for n in ("q", "k", "v"))
    else:
        q, k_lin, v_lin = (_linear(self, dims, n, hidden_states) for n in ("q", "k", "v"))
    if dims.qk_norm_scope == "projection":
        q = self.q_norm(q)
    q = q.view(batch, length, -1, dims.head_dim)
    if dims.qk_norm_scope == "head":
        q = self.q_norm(q)
    q = q.transpose(1, 2)
    k, v = _heads(self, adapter, k_lin, v_lin)
    cache = _received_cache(kwargs)
    positions = _positions(position_ids, cache_position, batch, length, hidden_states.device)
    cos, sin = rope_cos_sin(adapter.inv_freq_on(hidden_states.device, layer_idx), positions, q.dtype)
    inputs = AttentionInputs(
        layer_idx=layer_idx,
        module=self,
        q=q,
        k_pre=k,
        v=v,
        x=hidden_states,
        positions=positions,
        cos=cos,
        sin=sin,
        mask=attention_mask,
        cache=cache,
        scale=self.scaling,
        softcap=adapter.dims.attn_softcap,
    )
    # A kvcal runtime cache owns its layer's storage and attention, whatever handler is active.
    handler = cache if hasattr(cache, "kvcal_attend") else adapter.handler
    with device_scope(hidden_states.device):  # a layer of a split model: its kernels launch on its own GPU
        out = handler.kvcal_attend(inputs) if handler is cache else handler.attend(inputs)
    out = out.transpose(1, 2).reshape(batch, length, -1)
    return self.o_proj(out), None
