"""CalibQuant (Han et al. 2025, "CalibQuant: 1-Bit KV Cache Quantization for Multimodal LLMs"): plain min/max
uniform quantization of a block of tokens at b in {8, 4, 2, 1} bits with channel-wise ranges for both K (after RoPE)
and V, computed per sequence over the block itself, and a calibrated affine remap of the block's pre-softmax scores.
Digest: papers/calibquant.md. Sources cited in comments: [P] the paper, [C] the authors' code, [D] the digest's
recommendation where both are silent (its §7 item N as "§7.N").

- Quantizer (§2.1, §2.2): per (sequence, layer, KV head, channel) alpha = min and beta = max over the block's tokens,
  shrunk toward 0 by c (alpha' = c alpha, beta' = c beta; c_K = 0.5, c_V = 0.3 at 1 bit [C], 1.0 otherwise; §7.4,
  §7.5), step s = (beta' - alpha') / (2^b - 1), codes round(clamp((x - alpha') / s, 0, 2^b - 1)) with torch.round
  (half to even, §7.12), reconstruction codes * s + alpha'. Degenerate channels (beta' = alpha'): the step is clamped
  to 1e-6 max(|alpha'|, |beta'|, 1) (§7.9), so they reconstruct to alpha' exactly instead of NaN.
- Post-scaling (§2.4, Eq. 6): q . k_hat = (q * s) . codes + q . alpha and w V_hat = (w codes) * s + (sum w) alpha: the
  packed runtime's form (`post_scaled_scores`, `post_scaled_output`), equal to explicit dequantization (tested).
- Remap (§2.5, Eq. 7-8): per (sequence, query head, query row) gamma, delta = min, max of the scores (q k_hat / sqrt d)
  over the compressed keys it sees [C, §7.2]; g(x) = slope (x - gamma) + gamma - tau1 with slope
  (delta - gamma + tau1 - tau2) / (delta - gamma + 1e-8) [C: the 1e-8], clamped at 0 (§7.10: a negative slope would
  reverse the ranking; `slope_clamps` counts how often). On for b <= 2 [C], a flag (§7.3). tau = (tau1, tau2) is one
  global pair [P] chosen by grid search over {0,1,2,3}^2 [P] minimizing the mean NLL of held-out calibration windows
  under the tail protocol (§7.1), ties toward smaller tau2 - tau1 (§7.1) then smaller tau1; the whole table goes in
  the artifact's info (`kvcal inspect` prints it). The artifact's tau tensors are [H_q] per layer (digest §4: the
  shape allows a per-layer/head extension; the search fills one value).
- Which tokens: the paper compresses the visual block of a prompt once after prefill and keeps the rest in full
  precision. kvcal's `tail` protocol is that regime (§7.7): with `group_tokens` 0 (the default, [P]: one group over
  the whole block) a storage compresses whatever block it is given as one group; the simulation runs it under the
  tail protocol only (Storage.bulk_only refuses the gptq one), and the cache runs the paper's regime
  (FlushPolicy.bulk: the prompt after `sink` tokens compressed once, generated tokens kept in full precision; the
  decode-mode tail protocol). `group_tokens` G > 0 takes the ranges over aligned groups of G tokens after `sink`
  full-precision tokens instead (a deviation that gives a token-by-token flush rule: the gptq protocol).
- Ablations (§8.2): `v_ranges` token (KIVI-style per-token V, min/max over the head's channels) or global (one range
  per head over the block), `calibration` false, `k_range_scale`/`v_range_scale` 1.0 (pure paper), a fixed tau.

Files: method.py (this: the config, its checks and footprint), calibrate.py (the tau grid search), storage.py (the
storages and the numerics: ranges, quantize, post-scaling, remap), kernels.py (the packed storage's
Triton kernels).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvcal.accounting import fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import FlushPolicy, Method, Storages
from kvcal.methods.calibquant.calibrate import choose_tau, layout, search_tau
from kvcal.methods.calibquant.storage import (
    BULK_ONLY,
    STAT_BYTES,
    CalibQuantReconstruction,
    CalibQuantStorage,
)
from kvcal.methods.registry import register
from kvcal.quant.packing import words_per_vector

SUPPORTED_BITS = (1, 2, 4, 8)  # [P]
V_RANGES = ("channel", "token", "global")
CODE_RANGE_SCALE = {"k": 0.5, "v": 0.3}  # [C] at 1 bit; 1.0 at other widths


def parse_grid(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise KvcalError(f"calibquant tau_grid must be comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise KvcalError(f"calibquant tau_grid must hold finite numbers >= 0, got {text!r}")
    return values


@register
@dataclass
class CalibQuant(Method):
    """CalibQuant: channel-wise min/max quantization of K (after RoPE) and V over a block of tokens, 1 to 8 bits,
    and a calibrated affine remap (tau1, tau2) of the block's pre-softmax scores."""

    name = "calibquant"
    summary = "channel-wise K/V min/max over a block, 1-8 bits; calibrated logit remap"
    learns = True  # the tau grid search runs the model on calibration windows
    captures = ()  # it needs the windows only (CaptureStore.windows), no activations
    # tiny models: 16-token groups after 2 sinks (the gptq protocol runs it; the decode kernel's tiles of >= 16 tokens
    # lie inside one group), a 2x2 tau grid (4 forwards per window)
    test_config = {"bits": 1, "group_tokens": 16, "sink": 2, "tau_grid": "0,3"}
    test_ablations = {"token-v-ranges": {"v_ranges": "token"}, "global-v-ranges": {"v_ranges": "global"},
                      "no-remap": {"calibration": False}, "bulk": {"group_tokens": 0}}
    tensor_kinds = {"k.tau1": "range", "k.tau2": "range"}  # the searched remap per query head
    runtime_fields = ("fp_window",)
    fp_window_field = "fp_window"

    bits: int = 1  # 8, 4, 2, 1 [P]
    group_tokens: int = 0  # 0: one range over the whole compressed block [P] (tail protocol); G: groups of G tokens
    sink: int = 32  # group_tokens > 0: full-precision first tokens (the tail protocol uses its own prefix)
    # newest tokens kept in full precision: with group_tokens G, besides the unfinished group; in the bulk regime,
    # the newest of the prompt when it is compressed (the comparison's full-precision allowance)
    fp_window: int = 0
    k_range_scale: float | None = None  # c_K; None: 0.5 at 1 bit [C], 1.0 otherwise
    v_range_scale: float | None = None  # c_V; None: 0.3 at 1 bit [C], 1.0 otherwise
    v_ranges: str = "channel"  # channel [P]; token (KIVI-style) and global: ablations
    calibration: bool | None = None  # the score remap; None: on for bits <= 2 [C] (§7.3)
    tau1: float | None = None  # both set: a fixed tau, no search (the code's (0, 3) [C])
    tau2: float | None = None
    tau_grid: str = "0,1,2,3"  # the values of tau1 and of tau2 searched [P]

    def validate(self):
        if self.bits not in SUPPORTED_BITS:
            raise KvcalError(f"calibquant bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        if self.group_tokens < 0 or self.sink < 0 or self.fp_window < 0:
            raise KvcalError(f"calibquant group_tokens, sink and fp_window must be >= 0, got {self.group_tokens}, "
                             f"{self.sink}, {self.fp_window}")
        if self.v_ranges not in V_RANGES:
            raise KvcalError(f"calibquant v_ranges must be one of {', '.join(V_RANGES)}, got {self.v_ranges!r}")
        for key in ("k_range_scale", "v_range_scale"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise KvcalError(f"calibquant {key} must be in (0, 1], got {value}")
        if (self.tau1 is None) != (self.tau2 is None):
            raise KvcalError("calibquant takes both tau1 and tau2 (a fixed tau) or neither (the grid search)")
        if self.tau1 is not None:
            if not all(math.isfinite(t) and t >= 0 for t in (self.tau1, self.tau2)):
                raise KvcalError(f"calibquant tau1 and tau2 must be finite numbers >= 0, got {self.tau1}, {self.tau2}")
            if not self.remap_on():
                raise KvcalError("calibquant tau1/tau2 apply only with the score remap (calibration on)")
        parse_grid(self.tau_grid)

    def check_protocol(self, protocol: str) -> None:
        if self.group_tokens == 0 and protocol != "tail":
            raise KvcalError(BULK_ONLY)

    def remap_on(self) -> bool:
        return self.bits <= 2 if self.calibration is None else self.calibration

    def range_scales(self) -> tuple[float, float]:
        default = {k: (c if self.bits == 1 else 1.0) for k, c in CODE_RANGE_SCALE.items()}
        return (default["k"] if self.k_range_scale is None else self.k_range_scale,
                default["v"] if self.v_range_scale is None else self.v_range_scale)

    def searches(self) -> bool:
        return self.remap_on() and self.tau1 is None

    def needs_artifact(self) -> bool:
        return self.searches()

    def capture_needs(self) -> set[str]:
        return set()

    def tag(self) -> str:
        parts = [f"{self.bits}bit"]
        if self.group_tokens:
            parts.append(f"g{self.group_tokens}")
        if self.v_ranges != "channel":
            parts.append(f"v{self.v_ranges}")
        if not self.remap_on():
            parts.append("nocalib")
        elif self.tau1 is not None:
            parts.append(f"tau{self.tau1:g}-{self.tau2:g}")
        if self.k_range_scale is not None or self.v_range_scale is not None:
            parts.append("c{:g}-{:g}".format(*self.range_scales()))
        return "-".join(parts)

    # ---- storages -------------------------------------------------------------------------------------------------
    def storages_with_taus(self, dims, taus: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Storages:
        """One storage per layer with that layer's (tau1, tau2) [Hq] (None: no remap): the packed storage, or the
        reconstruction of a v_ranges ablation."""
        k_scale, v_scale = self.range_scales()
        args = (self.bits, self.group_tokens, self.sink, k_scale, v_scale)
        layers = taus if taus is not None else [None] * dims.num_layers
        if self.v_ranges != "channel":
            return Storages(CalibQuantReconstruction(*args, t, self.fp_window, self.v_ranges) for t in layers)
        return Storages(CalibQuantStorage(*args, t, self.fp_window) for t in layers)

    def storages_with_tau(self, dims, tau1: float, tau2: float) -> Storages:
        one = (torch.full((dims.num_heads,), float(tau1)), torch.full((dims.num_heads,), float(tau2)))
        return self.storages_with_taus(dims, [one] * dims.num_layers)

    def build_storages(self, tensors, dims) -> Storages:
        self.check_model(dims)
        if not self.remap_on():
            return self.storages_with_taus(dims, None)
        if self.tau1 is not None and not tensors:
            return self.storages_with_tau(dims, self.tau1, self.tau2)
        names = [(f"layers.{i}.k.tau1", f"layers.{i}.k.tau2") for i in range(dims.num_layers)]
        missing = [n for pair in names for n in pair if n not in tensors]
        if missing:
            raise KvcalError(f"calibquant needs its calibrated tau ({missing[0]} is missing): run `kvcal calibrate "
                             "--method calibquant` and pass the artifact with --artifact, or set tau1 and tau2")
        taus = [(tensors[a].to(torch.float32), tensors[b].to(torch.float32)) for a, b in names]
        if any(t.shape != (dims.num_heads,) for pair in taus for t in pair):
            raise KvcalError(f"calibquant tau tensors must have one value per query head ({dims.num_heads})")
        return self.storages_with_taus(dims, taus)

    # ---- calibration: the tau grid search (calibrate.py) ---------------------------------------------------------
    def calibrate(self, loaded, store):
        dims = loaded.dims
        self.check_model(dims)
        c_k, c_v = self.range_scales()
        defaults = self.k_range_scale is None and self.v_range_scale is None
        info = {"range_scale": {"k": c_k, "v": c_v, "source": "default (the authors' code: 0.5 / 0.3 at 1 bit, 1.0 "
                                "otherwise)" if defaults else "config"},
                "remap": self.remap_on()}
        if not self.remap_on():
            return {}, info
        if not self.searches():
            chosen = (self.tau1, self.tau2)
            info["tau"] = {"tau1": self.tau1, "tau2": self.tau2, "source": "config (no search)"}
        else:
            windows, objective = getattr(store, "windows", None), getattr(store, "objective", None)
            if windows is None or objective is None:
                raise KvcalError("calibquant's tau search needs calibration windows and their objective (kvcal "
                                 "calibrate passes them)")
            prefix, block = layout(objective, windows.shape[1], self.group_tokens)
            grid = parse_grid(self.tau_grid)
            plain = dataclasses.replace(self, calibration=False, tau1=None, tau2=None)
            search = search_tau(objective, windows, grid, prefix, block,
                                lambda t1, t2: self.storages_with_tau(dims, t1, t2),
                                plain.storages_with_taus(dims, None))
            i, j = choose_tau(search["table"], grid)
            chosen = (grid[i], grid[j])
            info["tau"] = {"tau1": grid[i], "tau2": grid[j], "source": "grid search"}
            info["tau_search"] = {
                "objective": "mean NLL per scored target, tail protocol, calibration windows",
                "tau1_values": grid, "tau2_values": grid,
                "table": [[round(float(x), 6) for x in row] for row in search["table"]],  # rows tau1, columns tau2
                "slope_clamped_fraction": [[round(float(x), 6) for x in row] for row in search["clamped"]],
                "uncalibrated_nll": round(search["uncalibrated_nll"], 6), "fp16_nll": round(search["fp16_nll"], 6),
                "window_layout": {"prefix": prefix, "block": block, "tail": int(windows.shape[1]) - prefix - block},
                "windows": int(windows.shape[0]),
                "tie_break": "smaller tau2 - tau1, then smaller tau1",
            }
        tensors = {}
        for layer in range(dims.num_layers):  # one value per query head (the shape allows a per-head search)
            tensors[f"layers.{layer}.k.tau1"] = torch.full((dims.num_heads,), float(chosen[0]))
            tensors[f"layers.{layer}.k.tau2"] = torch.full((dims.num_heads,), float(chosen[1]))
        return tensors, info

    def synthetic_tensors(self, dims, seed: int = 0) -> dict[str, torch.Tensor]:
        """The authors' tau (0, 3) [C] for every layer and query head (speed benchmarks at shapes no artifact exists
        for: the kernels' work does not depend on tau)."""
        if not self.searches():
            return {}
        tensors = {}
        for layer in range(dims.num_layers):
            tensors[f"layers.{layer}.k.tau1"] = torch.zeros(dims.num_heads)
            tensors[f"layers.{layer}.k.tau2"] = torch.full((dims.num_heads,), 3.0)
        return tensors

    # ---- memory ---------------------------------------------------------------------------------------------------
    def footprint(self, dims, tokens):
        """Codes at `bits`, fp32 (step, minimum) per range and group (§7.14), fp16 sinks. group_tokens 0: the tokens
        after the sinks form one block (the paper's regime, at the reference length)."""
        policy = (FlushPolicy(sink=self.sink, residual=self.fp_window, block=self.group_tokens) if self.group_tokens
                  else FlushPolicy(sink=self.sink, residual=self.fp_window, bulk=True))
        n = policy.compressed_count(tokens)
        groups = (n // self.group_tokens if self.group_tokens else (1 if n else 0))
        heads, d = dims.num_layers * dims.num_kv_heads, dims.head_dim
        stats = {"channel": groups * d, "token": n, "global": groups}
        ranges_count = heads * (groups * d + stats[self.v_ranges])
        return {
            "codes": 2 * n * heads * words_per_vector(d, self.bits) * 4,  # packed in int32 words
            "step_minimum": ranges_count * 2 * STAT_BYTES,
            "fp16_full_precision": fp16_token_bytes(dims, tokens - n),
        }
