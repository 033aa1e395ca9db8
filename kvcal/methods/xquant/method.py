"""XQuant (Tomar, Hooper et al. 2025, "Breaking the Memory Wall for LLM Inference with KV Cache Rematerialization"): cache the layer's attention input X, or latents of it,
instead of K and V, and rematerialize K and V from it at every step; XQuant-CL caches closed-loop deltas of X
across layers. There is no official code: where the paper is silent we follow the digest (papers/xquant.md), cited
as "rec §7.N" for its section 7 choices.

Variants (`variant`, `cross_layer`):
- "x": the MHA recipe: cache post-norm X (the input of q/k/v_proj, the norm's gamma included: rec §7.1) per token,
  in groups of `group_channels` channels. On a GQA model X is wider than K and V together (SmolLM2: 576 vs 384).
- "svd": the GQA recipe (§2.4): cache Z_k = X U_k per channel (groups of `group_tokens` tokens) and Z_v = X U_v per
  token, where W_k = U_k R_k is the exact thin SVD of the key projection (no truncation: a change of basis), likewise
  for values; K = Z_k R_k, V = Z_v R_v. Optionally latent channel 0 of Z_k (the outlier channel, App. B) in fp16.
- "kv": the paper's KIVI* baseline with the same quantizer and groups: pre-RoPE K per channel, V per token.
- cross_layer (x or svd, §2.3, §2.5): below `base_layer` plain at `hp_bits` (rec §7.5); the base layer caches X at
  `hp_bits` per token (the accumulator's seed; rec §7.4 `full_x`, or its latent); every later layer caches the
  delta against the *reconstructed* previous layer, Q(X_i - X^_{i-1}) (closed loop: errors do not compound), or for
  svd its latent Q((X_i - X^_{i-1}) U_kv), U_kv from the SVD of [W_k | W_v], added back as Q(.) U_kv^T.
  `closed_loop=False` (the open-loop ablation) takes deltas against the exact previous X instead.

Only K and V come from the cached tensor; queries, the MLP and the residual stream stay exact (rec §7.2). Keys are
rematerialized before RoPE and rotated at their positions (rec §7.12). The quantizer is kvcal's shared asymmetric
min/max with fp16 scale and zero, round to nearest, no clipping (rec §7.8); `bits=16` stores the values in fp16
(the lossless check of the identity). Tokens leave full precision in aligned blocks of `group_tokens` (the
per-channel groups need whole blocks; the paper's residual method, §2.6), for every variant alike, so variants of
one comparison see the same full-precision tokens.

The calibration is data-free (§2.7): SVDs of the projection weights in float64, signs normalized (the largest-|.|
entry of each column of U positive), R recomputed from the stored float32 U, the reconstruction error recorded.

Files: method.py (this: the config, its checks and footprint), calibrate.py (the SVDs), storage.py (the
storages and the rematerialization), kernels.py (XQuantStorage's Triton kernels).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcal.accounting import fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import FlushPolicy, Method, Storages
from kvcal.methods.registry import register
from kvcal.methods.xquant.calibrate import svd_factors
from kvcal.methods.xquant.storage import BASE, DELTA, PLAIN, XQuantMath
from kvcal.models.adapter import kv_projection_weights
from kvcal.quant.packing import words_per_vector

VARIANTS = ("kv", "x", "svd")
BASE_REPRS = ("full_x", "latent")
DELTA_AXES = ("token", "channel")
SUPPORTED_BITS = (2, 3, 4, 8, 16)
GROUP_CHANNELS = (128, 64, 32, 16, 8)  # group_channels None: the largest of these that divides the per-token widths
PARAM_BYTES = 2  # fp16 scale and fp16 zero per group


@register
@dataclass
class XQuant(Method):
    """XQuant: cache the attention input X (or SVD latents of it) and rematerialize K and V; XQuant-CL: closed-loop
    cross-layer deltas of X above a base layer."""

    name = "xquant"
    summary = "cache X or its SVD latents, rematerialize K/V; cross-layer deltas"
    runtime_fields = ("bits", "hp_layers", "hp_bits", "outlier_channel", "group_tokens", "group_channels",
                      "delta_axis", "closed_loop", "residual")
    fp_window_field = "residual"  # the newest R tokens, plus the unfinished token block (per-channel groups)
    # tiny models (hidden 64, 2 KV heads x 16, 2 layers): the packed storage's svd latents, layer 0 at 4 bits and
    # layer 1 at 2, latent channel 0 in fp16 (tests/test_xquant.py runs the cross-layer variants and the ablations)
    test_config = {"variant": "svd", "bits": 2, "hp_layers": 1, "outlier_channel": True, "group_tokens": 8,
                   "group_channels": 16}
    test_ablations = {"x": {"variant": "x", "outlier_channel": False},
                      "kivi-star": {"variant": "kv", "outlier_channel": False},
                      "cross-layer": {"cross_layer": True, "base_layer": 0},
                      "cross-layer-open-channel": {"variant": "x", "outlier_channel": False, "cross_layer": True,
                                                   "base_layer": 0, "closed_loop": False, "delta_axis": "channel"}}
    # kvcal compare: the SVD factors up to each singular vector's sign, the predicted outlier channels exactly
    tensor_kinds = {f"{side}.{name}": kind for side in "kv" for name, kind in (
        ("U", "svd_left"), ("R", "svd_right"), ("S", "spectrum"))} | {
        "k.outlier_pred": "index", "x.U": "svd_left", "x.S": "spectrum"}  # x.*: the cross-layer variants' basis

    variant: str = "svd"  # svd (GQA latents), x (cache X: the MHA recipe), kv (the paper's KIVI* baseline)
    cross_layer: bool = False  # XQuant-CL: closed-loop deltas above base_layer (variants x and svd)
    bits: int = 4  # 2, 3, 4, 8; 16 stores fp16 (no quantization)
    hp_layers: int = 0  # the first hp_layers layers at hp_bits (the paper's Table 4 runs: 3)
    hp_bits: int = 4  # those layers' bits, and the cross-layer base's (the accumulator precision)
    base_layer: int = 2  # cross_layer: the paper's base is the third layer (§4.3)
    base_repr: str = "full_x"  # cross_layer svd: the base as full-width X (rec §7.4) or as its [W_k|W_v] latent
    outlier_channel: bool = False  # svd: latent channel 0 of X U_k kept in fp16 (App. B, Table B.1)
    group_tokens: int = 128  # per-channel groups (tokens), and the block in which tokens leave full precision
    # per-token groups (channels); None: the largest of GROUP_CHANNELS dividing the model's per-token widths (SmolLM2's
    # 576 and 192: 64, rec §7.7), resolved when the setting meets the model (for_model: artifacts record the number)
    group_channels: int | None = None
    delta_axis: str = "token"  # cross_layer deltas per token (rec §7.3) or per channel (ablation)
    closed_loop: bool = True  # deltas against the reconstructed previous layer (False: the open-loop ablation)
    residual: int = 0  # full-precision recent tokens kept besides the unfinished block (generation)

    def validate(self):
        for key, allowed in (("variant", VARIANTS), ("base_repr", BASE_REPRS), ("delta_axis", DELTA_AXES)):
            if getattr(self, key) not in allowed:
                raise KvcalError(f"xquant {key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        for key in ("bits", "hp_bits"):
            if getattr(self, key) not in SUPPORTED_BITS:
                raise KvcalError(f"xquant {key} must be one of {', '.join(map(str, SUPPORTED_BITS))}, "
                                 f"got {getattr(self, key)}")
        if self.cross_layer and self.variant == "kv":
            raise KvcalError("xquant cross_layer applies to variants x and svd (kv caches K and V, not X)")
        if self.outlier_channel and self.variant != "svd":
            raise KvcalError("xquant outlier_channel applies to variant svd (a channel of X U_k)")
        for key in ("group_tokens", "group_channels"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise KvcalError(f"xquant {key} must be positive, got {getattr(self, key)}")
        for key in ("hp_layers", "base_layer", "residual"):
            if getattr(self, key) < 0:
                raise KvcalError(f"xquant {key} must be >= 0, got {getattr(self, key)}")

    # ---- structure --------------------------------------------------------------------------------------------
    def layer_plan(self, num_layers: int) -> list[tuple[str, int]]:
        """(role, bits) per layer: plain layers, the cross-layer base, and delta layers above it."""
        plan = []
        for i in range(num_layers):
            bits = self.hp_bits if i < self.hp_layers else self.bits
            if not self.cross_layer or i < self.base_layer:
                plan.append((PLAIN, bits))
            else:
                plan.append((BASE, self.hp_bits) if i == self.base_layer else (DELTA, bits))
        return plan

    def _widths(self, dims) -> dict[str, int]:
        return {"x": dims.hidden_size, "kv": dims.kv_channels, "latent": min(dims.hidden_size, 2 * dims.kv_channels)}

    def _per_token_widths(self, dims) -> set[int]:
        """Widths quantized per token (in groups of group_channels) under this config."""
        w = self._widths(dims)
        widths = set()
        roles = {role for role, _ in self.layer_plan(dims.num_layers)}
        if PLAIN in roles:
            widths.add(w["x"] if self.variant == "x" else w["kv"])
        if BASE in roles:
            widths.add(w["latent"] if self.variant == "svd" and self.base_repr == "latent" else w["x"])
        if DELTA in roles and self.delta_axis == "token":
            widths.add(w["x"] if self.variant == "x" else w["latent"])
        return widths

    def resolved_group_channels(self, dims) -> int:
        """group_channels, or by default the largest of GROUP_CHANNELS that divides every per-token width."""
        if self.group_channels is not None:
            return self.group_channels
        widths = sorted(self._per_token_widths(dims))
        for n in GROUP_CHANNELS:
            if all(width % n == 0 for width in widths):
                return n
        raise KvcalError(f"xquant: none of group_channels {', '.join(map(str, GROUP_CHANNELS))} divides the per-token "
                         f"widths {', '.join(map(str, widths))} of this model: pass --set group_channels=N")

    def for_model(self, dims) -> XQuant:
        return self if self.group_channels is not None else dataclasses.replace(
            self, group_channels=self.resolved_group_channels(dims))

    def check_model(self, dims):
        if self.cross_layer and self.base_layer >= dims.num_layers:
            raise KvcalError(f"xquant base_layer {self.base_layer} is past the model's {dims.num_layers} layers")
        if self.hp_layers > dims.num_layers:
            raise KvcalError(f"xquant hp_layers {self.hp_layers} is more than the model's {dims.num_layers} layers")
        channels = self.resolved_group_channels(dims)
        for width in sorted(self._per_token_widths(dims)):
            if width % channels:
                raise KvcalError(f"xquant group_channels {self.group_channels} does not divide a per-token width of "
                                 f"{width} channels on this model (try a divisor such as 64)")

    def needs_artifact(self) -> bool:
        return self.variant == "svd"

    def tag(self) -> str:
        parts = [self.variant + ("-cl" if self.cross_layer else ""), f"{self.bits}bit"]
        if self.hp_layers:
            parts.append(f"hp{self.hp_layers}")
        if self.outlier_channel:
            parts.append("outlier")
        return "-".join(parts)

    # ---- calibration: the SVD factors (weights only; calibrate.py) -------------------------------------------
    def calibrate(self, loaded, store):
        self.check_model(loaded.dims)
        if self.variant != "svd":
            return {}, {}
        roles = [role for role, _ in self.layer_plan(loaded.dims.num_layers)]
        return svd_factors(kv_projection_weights(loaded.model, loaded.dims), roles, self.base_repr)

    def build_storages(self, tensors, dims) -> Storages:
        self.check_model(dims)
        factored = any(role == PLAIN or role == DELTA or self.base_repr == "latent"
                       for role, _ in self.layer_plan(dims.num_layers))  # a lone base layer caches full X
        if self.needs_artifact() and factored and not tensors:
            raise KvcalError("xquant variant svd needs the SVD factors of an artifact: run `kvcal calibrate --method "
                             "xquant` (seconds, no data) and pass it with --artifact")
        return XQuantMath(self.for_model(dims), tensors, dims).storages(dims.num_layers)

    def synthetic_tensors(self, dims, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random factors of an artifact's shapes (speed benchmarks at shapes no artifact exists for): U [hidden,
        d_kv] and R [d_kv, d_kv] per plain svd layer, U [hidden, width] per latent cross-layer layer; one draw of each
        shared by every layer (speed does not depend on the values; 32 draws at 8B shapes would take 1.3 GB)."""
        if self.variant != "svd":
            return {}
        gen = torch.Generator().manual_seed(seed)
        hidden, d_kv = dims.hidden_size, dims.kv_channels
        width = self._widths(dims)["latent"]
        u = {side: torch.randn(hidden, d_kv, generator=gen) / hidden**0.5 for side in "kv"}
        r = {side: torch.randn(d_kv, d_kv, generator=gen) / d_kv**0.5 for side in "kv"}
        u_x = torch.randn(hidden, width, generator=gen) / hidden**0.5
        tensors = {}
        for i, (role, _) in enumerate(self.layer_plan(dims.num_layers)):
            if role == PLAIN:
                for side in "kv":
                    tensors[f"layers.{i}.{side}.U"], tensors[f"layers.{i}.{side}.R"] = u[side], r[side]
            elif role == DELTA or self.base_repr == "latent":
                tensors[f"layers.{i}.x.U"] = u_x
        return tensors

    # ---- memory --------------------------------------------------------------------------------------------------
    def footprint(self, dims, tokens):
        if self.group_channels is None:
            return self.for_model(dims).footprint(dims, tokens)
        n = FlushPolicy(residual=self.residual, block=self.group_tokens).compressed_count(tokens)
        w = self._widths(dims)
        parts = {"codes": 0.0, "scales_zeros": 0.0, "fp16_outlier_channel": 0.0}

        def cost(width: int, bits: int, axis: str) -> None:
            if bits == 16:
                parts["codes"] += n * width * 2
                return
            parts["codes"] += n * words_per_vector(width, bits) * 4  # each token's codes in whole int32 words
            groups = n * width / (self.group_channels if axis == "token" else self.group_tokens)
            parts["scales_zeros"] += groups * 2 * PARAM_BYTES

        for role, bits in self.layer_plan(dims.num_layers):
            if role == BASE:
                cost(w["latent"] if self.variant == "svd" and self.base_repr == "latent" else w["x"], bits, "token")
            elif role == DELTA:
                cost(w["x"] if self.variant == "x" else w["latent"], bits, self.delta_axis)
            elif self.variant == "x":
                cost(w["x"], bits, "token")
            else:  # kv, svd: a key-side tensor per channel, a value-side tensor per token
                # the outlier channel: its fp16 value beside the codes of every channel (its own code is unused)
                cost(w["kv"], bits, "channel")
                parts["fp16_outlier_channel"] += n * (2 if self.outlier_channel else 0)
                cost(w["kv"], bits, "token")
        parts["fp16_residual"] = fp16_token_bytes(dims, tokens - n)
        return parts
