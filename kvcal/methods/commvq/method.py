"""CommVQ: Commutative Vector Quantization for KV cache compression (Li et al., ICML 2025, arXiv 2506.18879).

What calibration learns, per layer (digest: ../shared/papers/commvq.md, cited as §N; official code [C]):
- Keys: each token's pre-RoPE key over all KV heads of the layer is divided by its L2 norm kappa (stored per
  token in fp16) [C]; the unit vector is cut into the model's RoPE pairs (rotate_half: channel i of a head
  pairs with i + head_dim/2, §8 item 1) and groups of g pairs (default one head, §2); R residual stages, each
  a codebook of N' codewords [[x, y], [-y, x]] per pair that commutes with RoPE (§3.3), fitted by soft EM with
  the official temperature schedule scaled to the model (§3.5, §8 items 8-9). A token stores R codes (a, b)
  per group, 2 log2(N') bits each.
- Values: the learned additive code [C] (§3.2): x = v / scale (frozen per-channel mean |v|), rho0 = |x|,
  LayerNorm -> Linear -> GELU -> Linear -> n_e groups of 4 logits, one category per group mapped to 2 code
  bits (0 -> 10, 1 -> 01, 2 -> 11, 3 -> 00), decode u = s C_V, v_hat = scale * rho * u with the per-token ratio
  rho = (rho0 + eps) / (|u| + eps) stored in fp16 (§8 item 3). Trained per layer on the captured values with
  straight-through Gumbel (tau 1), AdamW as the official code, and the official loss
  1/2 MSE(v_hat, v) + MSE of the attention output after o_proj (§8 item 4); argmax encoding at inference
  (§8 item 5; the released code samples).

CommVQ reconstructs every token (the strict all-quantized setting, §9 (a)) unless `fp_window` keeps the
most recent tokens in full precision.

The folder: method.py (this file) the config, its checks, derived settings and footprint; calibrate.py the fits
(key EM, value encoder training); storage.py the codebooks and storages with their torch numerics (encode/decode,
`fused_key_scores` Eq. 19 and `fused_value_attention` Eq. 22, the attention over codes without reconstructing keys or
values); packing.py the bit streams; kernels.py the Triton kernels.

Where the paper and the official code disagree we follow the digest's recommendation; each such place says
which one it follows ([P] paper, [C] code, [D] digest).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvcal.accounting import FP16_BYTES, fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import FlushPolicy, Method, Storages
from kvcal.methods.commvq.calibrate import (
    KeyFit,
    ValueFit,
    calibrate_layers,
    generator,
    held_out_windows,
)
from kvcal.methods.commvq.storage import (
    VALUE_PARAMS,
    CommVQReconstruction,
    CommVQStorage,
    CommVQTables,
    pair_channels,
)
from kvcal.methods.registry import register

QUANTIZE = ("kv", "k", "v")
VALUE_LOSSES = ("attention", "mse")
VALUE_PRECISIONS = ("float32", "bfloat16", "tf32")
FP_FLUSH = ("sliding", "block")
ROPE_PAIRINGS = ("rotate_half",)
NORM_BYTES = FP16_BYTES  # kappa (keys) and rho (values): one fp16 per token, layer and tensor
REFERENCE_SLICE_NORM = math.sqrt(1 / 8)  # RMS group-slice norm of the official setting: 8 heads of unit keys


@register
@dataclass
class CommVQ(Method):
    """RoPE-commutative residual key codebooks (soft EM) and a learned additive value code."""

    name = "commvq"
    summary = "RoPE-commutative key codebooks (EM) + learned additive value code, ~1-2 bits"
    learns = True
    calibrates_on_gpu = True  # key EM and value encoders: minutes on a GPU, hours on a CPU (docs/commvq.md)
    captures = ("k", "v", "q")
    runtime_fields = ("quantize", "fp_window", "fp_flush")
    fp_window_field = "fp_window"
    test_config = {"bits": 2, "key_codes": 8, "key_stages": 3, "key_em_steps": 3, "key_train_vectors": 256,
                   "value_steps": 8, "value_batch_tokens": 64, "value_attn_tokens": 32, "value_warmup": 2,
                   "fp_window": 4}
    test_ablations = {"keys-only": {"quantize": "k"}, "values-only": {"quantize": "v"}}
    # kvcal compare: key codewords up to their order per (group, stage), the pair layout exactly, the value encoder
    # and codebook as trained weights (the value codebook's rows are tied to code bits: no permutation)
    tensor_kinds = {"k.theta": "codebook:2", "k.pair_channels": "index", "k.stage_mse": "diagnostic",
                    "v.channel_scale": "range"} | {f"v.{name}": "weights" for name in (
                        "codebook", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "ln_weight", "ln_bias")}

    bits: int = 2  # 1 or 2 (the paper's CommVQ-1 / CommVQ-2); also 3, 4
    # keys [P]: N' codewords per pair and stage, g pairs sharing one code (0: one KV head, D/2 pairs: the
    # paper's g = 64 on Llama-3.1-8B, the digest's 32 on smollm2), R residual stages (0: round(bits g / log2 N'):
    # 11 / 21 on Llama-3.1-8B as the paper, 5 / 11 on smollm2 as the digest §9; the 5 stages of 1 bit are the
    # first 5 of the 11 of 2 bits, stages being greedy and seeded per (layer, group, stage))
    key_codes: int = 64
    key_group_pairs: int = 0
    key_stages: int = 0
    rope_pairing: str = "rotate_half"  # recorded for the runtime: pair p of a head is (p, p + D/2)
    # key EM budget: digest §9 minimal is 16384 vectors and <= 25 steps per stage; the default is smaller so that
    # smollm2 calibrates in minutes
    key_train_vectors: int = 4096
    key_em_steps: int = 12
    key_temperature: float = 0.0  # T at step 0 of stage 0; 0: the official 1e-3 x sqrt(8 / groups) (§8 item 8)
    key_em_tol: float = 1e-3  # relative plateau that ends the soft phase
    # values [C]: hidden 0 = min(4096, 4 n_e); loss "attention" (1/2 MSE + attention output after o_proj) or mse
    value_hidden: int = 0
    value_loss: str = "attention"
    # value budget: digest §9 says 1500-3000 steps (1 bit) and 3000-5000 (2 bits) of 512-1024 tokens; the
    # default is smaller so that smollm2 calibrates in minutes
    value_steps: int = 500
    value_batch_tokens: int = 512
    value_attn_tokens: int = 512  # attention-loss query blocks (digest §9: 256-512-token windows)
    value_lr: float = 1e-3  # [C] AdamW lr 1e-3, wd 0.1, betas (0.9, 0.95), clip 1.0, warmup + cosine
    value_weight_decay: float = 0.1
    value_warmup: int = 100
    # the value step's forward in float32 (as the paper's code), under bf16 autocast, or in float32 with a GPU's
    # matrix products as TF32 (docs/commvq.md measures what each changes)
    value_precision: str = "float32"
    # on a GPU, replay each value-training step from one CUDA graph (float32 or tf32; docs/commvq.md)
    value_graphs: bool = False
    gumbel_tau: float = 1.0
    holdout: float = 0.1  # fraction of calibration windows held out for the reported MSE
    seed: int = 0
    # runtime: what is compressed (kv, or k / v alone for the ablation rows), and the full-precision window
    # (0: the strict all-quantized setting of §9 (a); 128: the runtime's window, §3.7). sliding keeps the
    # `fp_window` most recent tokens (FlushPolicy(0, W, 1)); block flushes W tokens at a time when the window
    # is full, as the official runtime (the window holds 1..W tokens: FlushPolicy(0, 1, W))
    quantize: str = "kv"
    fp_window: int = 0
    fp_flush: str = "sliding"

    def validate(self):
        if self.bits not in (1, 2, 3, 4):
            raise KvcalError(f"commvq bits must be 1, 2, 3 or 4, got {self.bits}")
        if not 2 <= self.key_codes <= 256:
            raise KvcalError(f"commvq key_codes must be in [2, 256] (codewords per pair and stage), got {self.key_codes}")
        for key in ("key_group_pairs", "key_stages", "value_hidden", "fp_window", "value_warmup"):
            if getattr(self, key) < 0:
                raise KvcalError(f"commvq {key} must be >= 0, got {getattr(self, key)}")
        for key in ("key_train_vectors", "key_em_steps", "value_steps", "value_batch_tokens", "value_attn_tokens"):
            if getattr(self, key) <= 0:
                raise KvcalError(f"commvq {key} must be positive, got {getattr(self, key)}")
        for key in ("key_temperature", "key_em_tol", "value_lr", "value_weight_decay", "gumbel_tau"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise KvcalError(f"commvq {key} must be a finite number >= 0, got {value}")
        for key in ("value_lr", "gumbel_tau"):
            if getattr(self, key) == 0:
                raise KvcalError(f"commvq {key} must be positive, got 0")
        if not 0 <= self.holdout < 1:
            raise KvcalError(f"commvq holdout is a fraction in [0, 1), got {self.holdout}")
        for key, value, allowed in (("quantize", self.quantize, QUANTIZE), ("value_loss", self.value_loss, VALUE_LOSSES),
                                    ("value_precision", self.value_precision, VALUE_PRECISIONS),
                                    ("fp_flush", self.fp_flush, FP_FLUSH),
                                    ("rope_pairing", self.rope_pairing, ROPE_PAIRINGS)):
            if value not in allowed:
                raise KvcalError(f"commvq {key} must be one of {', '.join(allowed)}, got '{value}'")
        if self.value_graphs and self.value_precision == "bfloat16":
            raise KvcalError("commvq value_graphs runs float32 or tf32 steps, not value_precision=bfloat16 (autocast)")
        if self.fp_flush == "block" and self.fp_window == 0:
            raise KvcalError("commvq fp_flush=block needs fp_window > 0 (the block size)")

    # -- derived settings ---------------------------------------------------------------------------------
    def group_pairs(self, dims) -> int:
        return self.key_group_pairs or dims.head_dim // 2

    def num_groups(self, dims) -> int:
        return dims.num_kv_heads * (dims.head_dim // 2) // self.group_pairs(dims)

    @property
    def index_bits(self) -> int:
        return math.ceil(math.log2(self.key_codes))

    def stages(self, dims) -> int:
        if self.key_stages:
            return self.key_stages
        return max(1, int(self.bits * self.group_pairs(dims) / math.log2(self.key_codes) + 0.5))

    def value_groups(self, dims) -> int:
        return dims.kv_channels * self.bits // 2  # n_e [C]: 4-way groups of 2 code bits

    def hidden(self, dims) -> int:
        return self.value_hidden or min(4096, 4 * self.value_groups(dims))

    def with_fp_window(self, window: int) -> Method:
        """The allowance's rule is the newest `window` tokens at every step: the sliding window (fp_flush=block,
        the official runtime's, holds 1..W tokens and needs W > 0)."""
        if window < 0:
            return super().with_fp_window(window)
        method = dataclasses.replace(self, fp_window=window, fp_flush="sliding")
        method.validate()
        return method

    def policy(self) -> FlushPolicy:
        if self.fp_flush == "block":
            return FlushPolicy(sink=0, residual=1, block=self.fp_window)
        return FlushPolicy(sink=0, residual=self.fp_window, block=1)

    def code_bits(self, dims) -> dict[str, float]:
        """The paper's Avg.bit (codes only, Eq. 10 and 21): keys R log2(N') / g, values N_c / d."""
        keys = self.stages(dims) * 2 * self.index_bits * self.num_groups(dims) / dims.kv_channels
        return {"keys": keys, "values": float(self.bits), "average": (keys + self.bits) / 2}

    def check_model(self, dims):
        if dims.head_dim % 2:
            raise KvcalError(f"commvq needs an even head_dim (RoPE pairs), got {dims.head_dim}")
        half = dims.head_dim // 2
        if half % self.group_pairs(dims):
            raise KvcalError(f"commvq key_group_pairs {self.group_pairs(dims)} must divide the {half} RoPE pairs of a "
                             f"head (head_dim {dims.head_dim})")

    def check_calibration(self, nsamples: int, seqlen: int) -> None:
        held_out_windows(nsamples, self.holdout, self.seed)  # a holdout that leaves no training window

    def capture_needs(self) -> set[str]:
        # queries serve only the attention-output loss of the value encoder
        return {"k", "v"} | ({"q"} if self.value_loss == "attention" else set())

    def tag(self) -> str:
        name = f"{self.bits}bit"
        named = {"bits", *self.runtime_fields}
        for f in self.__dataclass_fields__.values():
            value = getattr(self, f.name)
            if f.name not in named and value != f.default:
                name += f"-{f.name}{str(value).lower()}"
        if self.quantize != "kv":
            name += f"-{self.quantize}only"
        if self.fp_window:
            name += f"-w{self.fp_window}" + ("block" if self.fp_flush == "block" else "")
        return name

    # -- calibration (calibrate.py) --------------------------------------------------------------------------
    def temperature(self, dims) -> float:
        """T at the first step of stage 0: the official 1e-3 for 8 groups of unit 1024-d keys (RMS group-slice norm
        sqrt(1/8) = 0.354), times the RMS slice norm of this layout over it: sqrt(1/G) / sqrt(1/8) (§8 item 8)."""
        return self.key_temperature or 1e-3 * math.sqrt(1 / self.num_groups(dims)) / REFERENCE_SLICE_NORM

    def stage_temperatures(self, dims) -> list[float]:
        """The official per-stage scale: stage r runs at T_scale = 10^-ceil(r / 4) (/10 after stages 0, 4, 8, ...)."""
        t = self.temperature(dims)
        return [t * 10.0 ** -math.ceil(r / 4) for r in range(self.stages(dims))]

    def key_fit(self, dims) -> KeyFit:
        """The key codebooks' settings on a model of these shapes."""
        return KeyFit(bits=self.bits, codes=self.key_codes, stages=self.stages(dims), groups=self.num_groups(dims),
                      group_pairs=self.group_pairs(dims), train_vectors=self.key_train_vectors,
                      em_steps=self.key_em_steps, em_tol=self.key_em_tol,
                      temperatures=tuple(self.stage_temperatures(dims)))

    def value_fit(self, dims) -> ValueFit:
        """The value coder's settings on a model of these shapes."""
        return ValueFit(bits=self.bits, groups=self.value_groups(dims), hidden=self.hidden(dims), loss=self.value_loss,
                        steps=self.value_steps, batch_tokens=self.value_batch_tokens,
                        attn_tokens=self.value_attn_tokens, lr=self.value_lr, weight_decay=self.value_weight_decay,
                        warmup=self.value_warmup, gumbel_tau=self.gumbel_tau, precision=self.value_precision,
                        graphs=self.value_graphs)

    def calibrate(self, loaded, store):
        dims = loaded.dims
        self.check_model(dims)
        tensors, fitted = calibrate_layers(loaded, store, self.key_fit(dims), self.value_fit(dims), self.holdout,
                                           self.seed)
        info = {
            "paper_bits": {k: round(v, 6) for k, v in self.code_bits(dims).items()},
            "key_stages": self.stages(dims),
            "key_groups": self.num_groups(dims),
            "key_group_pairs": self.group_pairs(dims),
            "key_temperature": self.temperature(dims),
            "rope_pairing": self.rope_pairing,
            **fitted,  # windows, key_* and value_* diagnostics per layer
            "value_loss": self.value_loss,
            "value_hidden": self.hidden(dims),
            "value_params_per_layer": sum(int(t.numel()) for n, t in tensors.items() if n.startswith("layers.0.v.")),
        }
        return tensors, info

    # -- runtime ------------------------------------------------------------------------------------------
    def synthetic_tensors(self, dims, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random tensors of an artifact's shapes (speed and memory benchmarks: `kvcal bench decode --recipe
        commvq-1bit`): codebooks N(0, 0.3) per coordinate, the encoder as torch initialises it, a positive channel
        scale. One layer's tensors serve every layer (the same objects: a 2-bit encoder at Llama-3.1-8B shapes is 80 MB
        a layer)."""
        self.check_model(dims)
        gen = generator(seed, "synthetic")
        groups, stages, g = self.num_groups(dims), self.stages(dims), self.group_pairs(dims)
        channels, n_e, hidden = dims.kv_channels, self.value_groups(dims), self.hidden(dims)

        def uniform(shape, fan_in):
            return (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)

        layer = {"k.theta": torch.randn(groups, stages, self.key_codes, g, 2, generator=gen) * 0.3,
                 "k.pair_channels": pair_channels(dims.num_kv_heads, dims.head_dim, g).to(torch.int32),
                 "v.codebook": torch.randn(2 * n_e, channels, generator=gen),
                 "v.channel_scale": torch.rand(channels, generator=gen) + 0.5,
                 "v.ln_weight": torch.ones(channels), "v.ln_bias": torch.zeros(channels),
                 "v.fc1_weight": uniform((hidden, channels), channels), "v.fc1_bias": uniform((hidden,), channels),
                 "v.fc2_weight": uniform((4 * n_e, hidden), hidden), "v.fc2_bias": uniform((4 * n_e,), hidden)}
        return {f"layers.{i}.{name}": t for i in range(dims.num_layers) for name, t in layer.items()}

    def build_storages(self, tensors, dims) -> Storages:
        self.check_model(dims)
        groups, stages, g = self.num_groups(dims), self.stages(dims), self.group_pairs(dims)
        n_e, hidden, channels = self.value_groups(dims), self.hidden(dims), dims.kv_channels
        expected_channels = pair_channels(dims.num_kv_heads, dims.head_dim, g)
        shapes = {"k.theta": (groups, stages, self.key_codes, g, 2), "k.pair_channels": (groups, g, 2),
                  "v.codebook": (2 * n_e, channels), "v.channel_scale": (channels,), "v.ln_weight": (channels,),
                  "v.ln_bias": (channels,), "v.fc1_weight": (hidden, channels), "v.fc1_bias": (hidden,),
                  "v.fc2_weight": (4 * n_e, hidden), "v.fc2_bias": (4 * n_e,)}
        keys, values = [], []
        for i in range(dims.num_layers):
            layer = {}
            for short, shape in shapes.items():
                name = f"layers.{i}.{short}"
                if name not in tensors:
                    raise KvcalError(f"commvq artifact lacks {name}: re-run kvcal calibrate")
                t = tensors[name]
                if tuple(t.shape) != shape:
                    raise KvcalError(f"commvq tensor {name} has shape {list(t.shape)}, expected {list(shape)} "
                                     f"(bits {self.bits}, {groups} groups x {stages} stages of {self.key_codes} codes)")
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise KvcalError(f"commvq tensor {name} holds non-finite values")
                layer[short] = t
            if not torch.equal(layer["k.pair_channels"].long(), expected_channels):
                raise KvcalError(f"layers.{i}.k.pair_channels is not the rotate_half pairing this kvcal implements")
            keys.append({"theta": layer["k.theta"].float(), "pair_channels": layer["k.pair_channels"].long()})
            values.append({n: layer[f"v.{n}"].float() for n in VALUE_PARAMS})
        book = CommVQTables(self, keys, values, dims)
        # the K-only and V-only ablations keep the other side in full precision: the packed storage holds both
        layer = CommVQStorage if self.keys_quantized and self.values_quantized else CommVQReconstruction
        return Storages(layer(book, i) for i in range(dims.num_layers))

    def footprint(self, dims, tokens):
        """Bytes of the cache as the storage holds them: each token's codes (keys 2 ceil(log2 N') bits per group and
        stage, values N_c bits) in whole int32 words, one fp16 norm per token for K and for V, fp16 for the window and
        for what is not quantized."""
        compressed = self.policy().compressed_count(tokens)
        rows = compressed * dims.num_layers
        channels = dims.kv_channels
        parts = {}
        if self.keys_quantized:
            key_bits = self.num_groups(dims) * self.stages(dims) * 2 * self.index_bits
            parts["key_codes"] = rows * 4 * ((key_bits + 31) // 32)
            parts["key_norms"] = rows * NORM_BYTES
        if self.values_quantized:
            parts["value_codes"] = rows * 4 * ((channels * self.bits + 31) // 32)
            parts["value_norms"] = rows * NORM_BYTES
        parts["fp16_window"] = fp16_token_bytes(dims, tokens - compressed)
        if self.quantize != "kv":
            parts["fp16_unquantized"] = rows * channels * FP16_BYTES
        return parts

    @property
    def keys_quantized(self) -> bool:
        return "k" in self.quantize

    @property
    def values_quantized(self) -> bool:
        return "v" in self.quantize
