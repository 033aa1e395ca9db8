"""SKVQ: Sliding-window Key and Value Cache Quantization (Duanmu et al. 2024, arXiv 2405.06219).

What calibration learns, per layer and separately for K and V (digest: papers/skvq.md):
- a channel permutation and variable-size groups: k-means over each channel's (min, max) on the
  calibration tokens puts channels with similar ranges in one quantization group (§2.1);
- clip ratios alpha: at runtime each group's min and max are multiplied by alpha before the scale and
  zero point are computed; alpha is searched on a grid to minimise the MSE of the attention output
  after o_proj on calibration data (§2.2).

What the cache stores per token: the [Hkv*D] channel vector of each token (keys before RoPE), read in
permuted order and quantized group by group (asymmetric, per token, clipped min/max, scale and zero in
fp16 or fp8 e4m3, 1.5 bits = ternary), except the first `sink` tokens and the `window` most recent
ones, which stay fp16; tokens leave the window one at a time (FlushPolicy(sink, window, 1)).

Where the paper and the official code disagree we follow the digest's recommendations (section 7,
cited as rec #N below); every such place says which source it follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.accounting import fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import FlushPolicy, Method, Storages
from kvcal.methods.registry import register
from kvcal.methods.skvq.calibrate import (
    fit_layouts_and_clips,
)
from kvcal.methods.skvq.storage import (
    PARAM_BYTES,
    PARAM_DTYPES,
    ChannelQuantizer,
    GroupLayout,
    SKVQStorage,
    code_bytes_per_token,
)
from kvcal.progress import stderr_console

SUPPORTED_BITS = (1.5, 2.0, 3.0, 4.0, 8.0)
CLIP_MODES = ("none", "global", "layer", "group")
TERNARY_STORAGE = ("base3", "2bit")


@register
@dataclass
class SKVQ(Method):
    """SKVQ: k-means channel groups (reorder), clipped per-token group quantization, fp16 window + sinks.

    Defaults are the paper's main setting (K2V2, average group 128, W = 128, 5 sinks). The ablation rows
    of the paper are configs: reorder=false (contiguous groups), clip=none, window=0, sink=0.
    """

    name = "skvq"
    summary = "k-means channel reorder, clipped per-token group quant, fp16 window + sinks"
    # the window never enters calibration (the clip search quantizes every non-sink token): a runtime setting
    runtime_fields = ("window",)
    fp_window_field = "window"
    learns = True
    captures = ("k", "v", "q")  # pre-RoPE K and V (stats, search), pre-RoPE Q (clip search objective)
    test_config = {"k_bits": 2.0, "v_bits": 1.5, "group_size": 8, "window": 8, "sink": 2, "clip_queries": 16}
    tensor_kinds = {f"{side}.{name}": kind for side in "kv" for name, kind in (
        ("clip", "range"), ("clip_loss", "diagnostic"), ("group_offsets", "index"), ("perm", "index"))}

    k_bits: float = 2.0  # 1.5 (ternary), 2, 3, 4 or 8
    v_bits: float = 2.0
    group_size: int = 128  # nominal: C // group_size groups per layer; sizes vary when reordered
    window: int = 128  # most recent tokens kept fp16
    sink: int = 5  # first tokens kept fp16 (the paper's only enabled filter rule)
    reorder: bool = True  # false: consecutive channels form the groups (ablation)
    clip: str = "layer"  # none | global (clip_value everywhere, the [code]) | layer (alpha_K, alpha_V) | group
    clip_value: float = 0.96  # clip=global: the [code]'s PPL-script value (0.92 for LongBench)
    clip_min: float = 0.8  # clip=layer|group: the searched grid is 1.00, 0.99, ..., clip_min
    param_dtype: str = "fp16"  # scale and zero storage: fp16 or fp8 (e4m3)
    ternary_storage: str = "base3"  # 1.5-bit codes: base3 (5 per byte, 1.6 bits) or 2bit ([code] slots)
    clip_windows: int = 2  # clip search: calibration windows used
    clip_queries: int = 256  # clip search: query positions per window
    seed: int = 0  # k-means seed

    def validate(self):
        for key in ("k_bits", "v_bits"):
            if getattr(self, key) not in SUPPORTED_BITS:
                raise KvcalError(f"skvq {key} must be one of {', '.join(f'{b:g}' for b in SUPPORTED_BITS)}, "
                                 f"got {getattr(self, key):g}")
        _choice("clip", self.clip, CLIP_MODES)
        _choice("param_dtype", self.param_dtype, tuple(PARAM_DTYPES))
        _choice("ternary_storage", self.ternary_storage, TERNARY_STORAGE)
        for key in ("group_size", "clip_windows", "clip_queries"):
            if getattr(self, key) <= 0:
                raise KvcalError(f"skvq {key} must be positive, got {getattr(self, key)}")
        for key in ("window", "sink"):
            if getattr(self, key) < 0:
                raise KvcalError(f"skvq {key} must be >= 0, got {getattr(self, key)}")
        for key in ("clip_value", "clip_min"):
            if not 0 < getattr(self, key) <= 1:
                raise KvcalError(f"skvq {key} must be in (0, 1], got {getattr(self, key)}")

    def capture_needs(self) -> set[str]:
        # Queries serve only the clip search's attention-output objective.
        return {"k", "v"} | ({"q"} if self.clip in ("layer", "group") else set())

    def check_model(self, dims):
        channels = dims.kv_channels
        if self.group_size > channels:
            raise KvcalError(f"skvq group_size {self.group_size} is larger than the {channels} K/V channels "
                             f"per token ({dims.num_kv_heads} KV heads x head_dim {dims.head_dim})")
        if not self.reorder and channels % self.group_size:
            raise KvcalError(f"skvq without reorder needs group_size to divide the {channels} K/V channels, "
                             f"got {self.group_size}")

    def spans_heads(self, dims) -> str | None:
        """A warning when the average group is wider than a head: the paper's group sizes (128) assume thousands of
        channels per layer, and on a small model one group spans several heads (smollm2-135m, 3 KV heads x 64
        channels: g128 is a single group per token, and perplexity about 1000)."""
        if self.group_size <= dims.head_dim:
            return None
        groups = self.num_groups(dims)
        return (f"skvq group_size {self.group_size} is wider than head_dim {dims.head_dim}: {groups} group"
                f"{'s' if groups > 1 else ''} over the {dims.kv_channels} channels of a layer, each spanning heads "
                "(the paper's g128 assumes thousands of channels; use group_size <= head_dim on this model)")

    def num_groups(self, dims) -> int:
        # [code]: n_clusters = C // G, so G is only the *average* group size (C / n_groups).
        return dims.kv_channels // self.group_size

    def tag(self) -> str:
        clip = f"clip{self.clip_value:g}" if self.clip == "global" else f"clip-{self.clip}"
        parts = [f"k{self.k_bits:g}v{self.v_bits:g}", f"g{self.group_size}", f"w{self.window}", f"s{self.sink}",
                 "reorder" if self.reorder else "noreorder", clip, self.param_dtype]
        return "-".join(parts)

    # -- calibration --
    def calibrate(self, loaded, store):
        dims = loaded.dims
        self.check_model(dims)
        spans = self.spans_heads(dims)
        if spans:
            stderr_console.print(f"warning: {spans}", markup=False, highlight=False, soft_wrap=True)
        return fit_layouts_and_clips(loaded, store, k_bits=self.k_bits, v_bits=self.v_bits, group_size=self.group_size,
                                     num_groups=self.num_groups(dims), reorder=self.reorder, clip=self.clip,
                                     clip_value=self.clip_value, clip_min=self.clip_min, param_dtype=self.param_dtype,
                                     sink=self.sink, clip_windows=self.clip_windows, clip_queries=self.clip_queries,
                                     seed=self.seed, warning=spans)

    # -- runtime --
    def build_storages(self, tensors, dims) -> Storages:
        self.check_model(dims)
        quantizers: dict[str, list[ChannelQuantizer]] = {"k": [], "v": []}
        for i in range(dims.num_layers):
            for kind, bits in (("k", self.k_bits), ("v", self.v_bits)):
                prefix = f"layers.{i}.{kind}."
                missing = [n for n in ("perm", "group_offsets", "clip") if prefix + n not in tensors]
                if missing:
                    raise KvcalError(f"skvq artifact lacks {prefix}{missing[0]}: re-run kvcal calibrate --method skvq")
                layout = GroupLayout(tensors[prefix + "perm"], tensors[prefix + "group_offsets"], prefix.rstrip("."))
                if layout.channels != dims.kv_channels:
                    raise KvcalError(f"{prefix}perm has {layout.channels} channels, the model has {dims.kv_channels}")
                alpha = tensors[prefix + "clip"]
                if alpha.dim() != 1 or alpha.numel() != layout.num_groups:
                    raise KvcalError(f"{prefix}clip has shape {list(alpha.shape)}, expected [{layout.num_groups}] "
                                     "(one ratio per group)")
                if not (torch.isfinite(alpha) & (alpha > 0)).all():  # a ratio of 0 makes every scale 0
                    raise KvcalError(f"{prefix}clip holds a ratio that is not a positive number: "
                                     f"{alpha.flatten().tolist()[:8]}")
                quantizers[kind].append(ChannelQuantizer(layout, alpha, bits, self.param_dtype))
        return Storages(SKVQStorage(k, v, self.sink, self.window, self.ternary_storage)
                        for k, v in zip(quantizers["k"], quantizers["v"]))

    def synthetic_tensors(self, dims, seed: int = 0):
        """A random channel permutation cut into C // group_size groups of equal size, clip ratios 0.96 (speed
        benchmarks at shapes no artifact exists for; the kernel's work does not depend on them)."""
        gen = torch.Generator().manual_seed(seed)
        channels, groups = dims.kv_channels, self.num_groups(dims)
        offsets = torch.linspace(0, channels, groups + 1).round().to(torch.int32)
        tensors = {}
        for i in range(dims.num_layers):
            for kind in "kv":
                prefix = f"layers.{i}.{kind}."
                tensors[prefix + "perm"] = torch.randperm(channels, generator=gen).to(torch.int32)
                tensors[prefix + "group_offsets"] = offsets.clone()
                tensors[prefix + "clip"] = torch.full((groups,), 0.96)
        return tensors

    def footprint(self, dims, tokens):
        quantized = FlushPolicy(sink=self.sink, residual=self.window).compressed_count(tokens)
        rows = dims.num_layers * quantized  # quantized token rows per tensor kind, all layers
        code_bytes = sum(code_bytes_per_token(dims.num_kv_heads, dims.head_dim, bits, self.ternary_storage)
                         for bits in (self.k_bits, self.v_bits))
        params_per_row = self.num_groups(dims) * 2 * PARAM_BYTES[self.param_dtype]  # scale + zero per group
        return {
            "codes": rows * code_bytes,
            "scales_zeros": rows * 2 * params_per_row,  # K and V
            "fp16_window_sink": fp16_token_bytes(dims, tokens - quantized),
        }


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise KvcalError(f"skvq {key} must be one of {', '.join(allowed)}, got {value!r}")
