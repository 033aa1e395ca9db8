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

The codec reconstructs every token (the strict all-quantized setting, §9 (a)) unless `fp_window` keeps the
most recent tokens in full precision. Its encode/decode functions are the storage numerics a packed runtime
reuses; `fused_key_scores` (Eq. 19) and `fused_value_attention` (Eq. 22) are the torch references of the
attention over codes, without reconstructing keys or values.

Where the paper and the official code disagree we follow the digest's recommendation; each such place says
which one it follows ([P] paper, [C] code, [D] digest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcal.accounting import FP16_BYTES, fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import Codec, FlushPolicy, Method
from kvcal.methods.registry import register
from kvcal.models.devmap import device_scope
from kvcal.quant import vq
from kvcal.quant.rope import apply_rope, rope_cos_sin
from kvcal.runtime.storage import BufferSpec, Packed, Storage

QUANTIZE = ("kv", "k", "v")
VALUE_LOSSES = ("attention", "mse")
FP_FLUSH = ("sliding", "block")
ROPE_PAIRINGS = ("rotate_half",)
VALUE_EPS = 1e-6  # [C] eps of the value scale and norms
LN_EPS = 1e-5  # torch LayerNorm default, as the official encoder
NORM_BYTES = FP16_BYTES  # kappa (keys) and rho (values): one fp16 per token, layer and tensor
FP16_MAX = 65504.0
REFERENCE_SLICE_NORM = math.sqrt(1 / 8)  # RMS group-slice norm of the official setting: 8 heads of unit keys
# category -> its two code bits [C]: 0 -> 10, 1 -> 01, 2 -> 11, 3 -> 00
CATEGORY_BITS = ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (0.0, 0.0))
VALUE_PARAMS = ("codebook", "channel_scale", "ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight",
                "fc2_bias")
HELD_OUT_VALUE_TOKENS = 32768  # tokens of the held-out windows used for value diagnostics (a cap)
ATTENTION_CACHE_BYTES = 1 << 30  # attention weights of the value loss's blocks kept per layer (CPU)
ATTENTION_CACHE_BYTES_GPU = 8 << 30  # on a GPU: all blocks of 64 x 1024 tokens at Llama-3.1-8B shapes (~4 GB)


def derived_seed(*parts) -> int:
    """A stable seed for a (seed, layer, group, stage, ...) tuple: no global RNG, the same on every machine."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*parts))


# -- layouts ---------------------------------------------------------------------------------------------


def pair_channels(num_kv_heads: int, head_dim: int, group_pairs: int) -> torch.Tensor:
    """[G, g, 2] int64: the channels (head * head_dim + d) of the x and y coordinates of pair j of group G.
    rotate_half pairing: pair p of head h is (h*D + p, h*D + p + D/2); groups take g consecutive pairs of the
    flattened (head, pair) order, so with g = D/2 a group is one KV head."""
    half = head_dim // 2
    flat = torch.arange(num_kv_heads * half)
    head, p = flat // half, flat % half
    x = head * head_dim + p
    return torch.stack((x, x + half), dim=-1).view(-1, group_pairs, 2)


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H*D]."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def from_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, c = rows.shape
    return rows.reshape(b, t, heads, c // heads).transpose(1, 2)


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 math, float64 when the inputs are float64 (exactness checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- keys -----------------------------------------------------------------------------------------------


def encode_keys(rows: torch.Tensor, theta: torch.Tensor, channels: torch.Tensor):
    """Pre-RoPE key rows [..., C] -> (codes [..., G, R, 2] int16, kappa [...] fp16). The direction is encoded by
    greedy residual search (§3.3 key encoder: no learned encoder for keys)."""
    x = rows.to(theta.dtype)
    norms = x.norm(dim=-1)
    unit = x / norms.clamp_min(torch.finfo(x.dtype).tiny)[..., None]
    pairs = unit[..., channels]  # [..., G, g, 2]
    codes = vq.encode_residual(pairs.reshape(-1, *pairs.shape[-3:]), theta)
    return codes.to(torch.int16).reshape(*rows.shape[:-1], *codes.shape[1:]), norms.clamp(max=FP16_MAX).half()


def decode_keys(codes: torch.Tensor, norms: torch.Tensor, theta: torch.Tensor, channels: torch.Tensor,
                num_channels: int) -> torch.Tensor:
    """(codes [..., G, R, 2], kappa [...]) -> pre-RoPE key rows [..., C] in theta's dtype."""
    pairs = vq.decode_residual(theta, codes)  # [..., G, g, 2]
    rows = torch.zeros(*codes.shape[:-3], num_channels, dtype=theta.dtype, device=theta.device)
    rows[..., channels.reshape(-1)] = pairs.reshape(*pairs.shape[:-3], -1)
    return rows * norms.to(theta.dtype)[..., None]


def fused_key_scores(q_rot: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor, positions: torch.Tensor,
                     theta: torch.Tensor, inv_freq: torch.Tensor, num_kv_heads: int, scale: float,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 19, the commutative key score, in the HF rotate_half convention (digest §3.4), keys never rebuilt.

    q_rot [B, Hq, Tq, D] post-RoPE queries; codes [B, T, G, R, 2] and kappa [B, T] of the cached keys at
    integer `positions` [T] (or [B, T]); theta [G, R, N, g, 2] with the standard layout (`pair_channels`).
    Per query head, pair p and codeword l: d = qx x_l + qy y_l and c = qy x_l - qx y_l (one table per query);
    per token A_p = sum_r d[a_r] + c[b_r], B_p = sum_r c[a_r] - d[b_r]; the score is
    kappa * scale * sum_p (cos(i theta_p) A_p + sin(i theta_p) B_p). Returns [B, Hq, Tq, T]. cos, sin [T, P] (or
    [B, T, P]): the tables of those angles where the caller has them (the model's own float32 RoPE tables: a packed
    cache must rotate exactly as the model does); otherwise computed from positions and inv_freq."""
    dtype = math_dtype(q_rot.dtype)
    b, hq, tq, d = q_rot.shape
    half, rep = d // 2, hq // num_kv_heads
    groups, stages, n, g = theta.shape[:4]
    th = theta.to(dtype).permute(0, 3, 1, 2, 4).reshape(num_kv_heads, half, stages, n, 2)  # [Hkv, P, R, N, 2]
    th = th.repeat_interleave(rep, dim=0)  # query head h reads KV head h // rep
    q = q_rot.to(dtype)
    qx, qy = q[..., :half, None, None], q[..., half:, None, None]  # [B, Hq, Tq, P, 1, 1]
    x, y = th[:, None, ..., 0], th[:, None, ..., 1]  # [Hq, 1, P, R, N]
    table_d = qx * x + qy * y  # [B, Hq, Tq, P, R, N]
    table_c = qy * x - qx * y
    t = codes.shape[1]
    # codes of pair p of KV head k: group (k * P + p) // g -> [B, T, Hkv, P, R, 2]
    group_of_pair = torch.arange(num_kv_heads * half, device=codes.device) // g
    per_pair = codes.long()[:, :, group_of_pair].view(b, t, num_kv_heads, half, stages, 2)
    per_pair = per_pair.repeat_interleave(rep, dim=2).permute(0, 2, 3, 4, 1, 5)  # [B, Hq, P, R, T, 2]

    def gather(table, which):  # table[b, h, tq, p, r, code of token i] -> [B, Hq, Tq, P, R, T]
        index = per_pair[:, :, None, ..., which].expand(b, hq, tq, half, stages, t)
        return table.gather(-1, index)

    big_a = (gather(table_d, 0) + gather(table_c, 1)).sum(4)  # [B, Hq, Tq, P, T]
    big_b = (gather(table_c, 0) - gather(table_d, 1)).sum(4)
    if cos is None:
        angles = positions.to(dtype)[..., None] * inv_freq.to(q.device, dtype)  # [T, P] or [B, T, P]
        cos, sin = angles.cos(), angles.sin()
    cos, sin = cos.to(dtype).expand(b, t, half), sin.to(dtype).expand(b, t, half)
    cos, sin = cos.transpose(1, 2)[:, None, None], sin.transpose(1, 2)[:, None, None]
    scores = (cos * big_a + sin * big_b).sum(3)  # [B, Hq, Tq, T]
    return scores * norms.to(dtype)[:, None, None, :] * scale


# -- values ---------------------------------------------------------------------------------------------


def value_logits(params: dict[str, torch.Tensor], unit: torch.Tensor, groups: int) -> torch.Tensor:
    """The lightweight encoder [C]: LayerNorm -> Linear -> GELU -> Linear -> [..., n_e, 4] logits."""
    h = F.layer_norm(unit, (unit.shape[-1],), params["ln_weight"], params["ln_bias"], eps=LN_EPS)
    h = F.gelu(F.linear(h, params["fc1_weight"], params["fc1_bias"]))
    return F.linear(h, params["fc2_weight"], params["fc2_bias"]).unflatten(-1, (groups, 4))


def category_bits(onehot: torch.Tensor) -> torch.Tensor:
    """One-hot categories [..., n_e, 4] -> code bits [..., 2 n_e] (bit 2k, 2k+1 select rows 2k, 2k+1)."""
    table = torch.tensor(CATEGORY_BITS, dtype=onehot.dtype, device=onehot.device)
    return (onehot @ table).flatten(-2)


def index_bits(category: torch.Tensor, dtype) -> torch.Tensor:
    """Categories [..., n_e] in 0..3 -> code bits [..., 2 n_e], CATEGORY_BITS without a one-hot or a table: elementwise
    device ops only (a CUDA graph captures them: F.one_hot synchronises the host and a table built from a Python list
    is a host-to-device copy)."""
    bit0 = 1 - (category & 1)  # 0 -> 1, 1 -> 0, 2 -> 1, 3 -> 0
    bit1 = ((category + 1) >> 1) & 1  # 0 -> 0, 1 -> 1, 2 -> 1, 3 -> 0
    return torch.stack((bit0, bit1), dim=-1).flatten(-2).to(dtype)


def normalize_values(rows: torch.Tensor, scale: torch.Tensor):
    """(unit x [..., C], rho0 [...]) with x = v / scale, rho0 = |x| [C]."""
    x = rows / scale
    rho0 = x.norm(dim=-1)
    return x / (rho0[..., None] + VALUE_EPS), rho0


def encode_values(rows: torch.Tensor, params: dict[str, torch.Tensor]):
    """Value rows [..., C] -> (code bits [..., N_c] uint8, rho [...] fp16). argmax of the logits (§8 item 5)."""
    p = params
    x = rows.to(p["codebook"].dtype)
    unit, rho0 = normalize_values(x, p["channel_scale"])
    logits = value_logits(p, unit, p["codebook"].shape[0] // 2)
    bits = index_bits(logits.argmax(-1), x.dtype)
    u = bits @ p["codebook"]
    # [C] "cache_postscale": the ratio that restores the token's norm, stored instead of rho0
    rho = (rho0 + VALUE_EPS) / (u.norm(dim=-1) + VALUE_EPS)
    return bits.to(torch.uint8), rho.clamp(max=FP16_MAX).half()


def decode_values(bits: torch.Tensor, rho: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """(bits [..., N_c], rho [...]) -> value rows [..., C]: scale * rho * (s C_V)."""
    codebook = params["codebook"]
    u = bits.to(codebook.dtype) @ codebook
    return params["channel_scale"] * rho.to(codebook.dtype)[..., None] * u


def fused_value_attention(probs: torch.Tensor, bits: torch.Tensor, rho: torch.Tensor, codebook: torch.Tensor,
                          channel_scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Eq. 22: o_h = scale_h * ((sum_i p_hi rho_i s_i) C_V[:, head slice]) [C, digest §3.6; the scale applied
    to the output channels after C_V, not to the code axis as the released kernel does, §8 item 14].
    probs [B, Hq, Tq, T], bits [B, T, N_c], rho [B, T] -> [B, Hq, Tq, D]. Accumulates in float32 (float64 for
    float64 inputs)."""
    dtype = math_dtype(probs.dtype)
    b, hq, tq, _ = probs.shape
    n_c, channels = codebook.shape
    d = channels // num_kv_heads
    mass = (probs.to(dtype) * rho.to(dtype)[:, None, None, :]) @ bits.to(dtype)[:, None]  # [B, Hq, Tq, N_c]
    mass = mass.view(b, num_kv_heads, hq // num_kv_heads, tq, n_c)
    per_head = codebook.to(dtype).view(n_c, num_kv_heads, d).transpose(0, 1)  # [Hkv, N_c, D]
    out = torch.einsum("bkrtn,knd->bkrtd", mass, per_head)
    out = out * channel_scale.to(dtype).view(num_kv_heads, d)[None, :, None, None, :]
    return out.reshape(b, hq, tq, d)


# -- codec ----------------------------------------------------------------------------------------------


class CommVQCodec(Codec):
    keys_pre_rope = True  # [P] Eq. 12 and [C]: pre-RoPE keys; the commutative codebooks need it

    def __init__(self, method: CommVQ, keys: list[dict], values: list[dict], dims):
        self.method = method
        self.dims = dims
        self.keys, self.values = keys, values
        self.policy = method.policy()
        self.quantize_k = method.keys_quantized
        self.quantize_v = method.values_quantized
        self._device = None
        self._storages: dict[int, CommVQStorage] = {}

    def _on(self, device):
        if self._device != device:
            self.keys = [{n: t.to(device) for n, t in layer.items()} for layer in self.keys]
            self.values = [{n: t.to(device) for n, t in layer.items()} for layer in self.values]
            self._device = device

    def _key_tables(self, layer: int, device, dtype):
        self._on(device)
        t = self.keys[layer]
        return t["theta"].to(dtype), t["pair_channels"].long()

    def _value_params(self, layer: int, device, dtype) -> dict[str, torch.Tensor]:
        self._on(device)
        return {n: t.to(dtype) for n, t in self.values[layer].items()}

    # storage numerics (what a packed runtime stores and reads back)
    def encode_keys(self, layer: int, k_pre: torch.Tensor):
        """k_pre [B, Hkv, T, D] -> (codes [B, T, G, R, 2] int16, kappa [B, T] fp16)."""
        theta, channels = self._key_tables(layer, k_pre.device, math_dtype(k_pre.dtype))
        return encode_keys(to_rows(k_pre), theta, channels)

    def decode_keys(self, layer: int, codes: torch.Tensor, norms: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """-> pre-RoPE keys [B, Hkv, T, D]."""
        theta, channels = self._key_tables(layer, codes.device, math_dtype(dtype))
        rows = decode_keys(codes, norms, theta, channels, self.dims.kv_channels)
        return from_rows(rows, self.dims.num_kv_heads)

    def encode_values(self, layer: int, v: torch.Tensor):
        """v [B, Hkv, T, D] -> (bits [B, T, N_c] uint8, rho [B, T] fp16)."""
        return encode_values(to_rows(v), self._value_params(layer, v.device, math_dtype(v.dtype)))

    def decode_values(self, layer: int, bits: torch.Tensor, rho: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """-> values [B, Hkv, T, D]."""
        rows = decode_values(bits, rho, self._value_params(layer, bits.device, math_dtype(dtype)))
        return from_rows(rows, self.dims.num_kv_heads)

    def storage(self, layer: int):
        """The packed storage of a layer (codes and norms), for the strict setting and windows; the K-only and V-only
        ablations keep the other side in full precision, which only the simulation and the reference cache hold."""
        if not (self.quantize_k and self.quantize_v):
            return None
        if layer not in self._storages:
            self._storages[layer] = CommVQStorage(self, layer)
        return self._storages[layer]

    def storage_refusal(self) -> str:
        return (f"commvq quantize={self.method.quantize} (an ablation) has no packed storage: use --backend dequantized "
                "(the reference cache) or the simulation")

    def reconstruct(self, layer, k, v):
        """The simulation's view (and the dequantized reference cache's): encode, then decode, the same functions a
        packed storage would store and read."""
        return self.quantize_keys(layer, k), self.quantize_values(layer, v)

    def quantize_keys(self, layer, k):
        if not self.quantize_k:
            return k
        codes, norms = self.encode_keys(layer, k)
        return self.decode_keys(layer, codes, norms, k.dtype).to(k.dtype)

    def quantize_values(self, layer, v):
        if not self.quantize_v:
            return v
        bits, rho = self.encode_values(layer, v)
        return self.decode_values(layer, bits, rho, v.dtype).to(v.dtype)

    # references of the attention over codes
    def key_scores(self, layer: int, q_rot, codes, norms, positions, inv_freq, scale) -> torch.Tensor:
        theta, _ = self._key_tables(layer, q_rot.device, math_dtype(q_rot.dtype))
        return fused_key_scores(q_rot, codes, norms, positions, theta, inv_freq, self.dims.num_kv_heads, scale)

    def value_attention(self, layer: int, probs, bits, rho) -> torch.Tensor:
        p = self._value_params(layer, probs.device, math_dtype(probs.dtype))
        return fused_value_attention(probs, bits, rho, p["codebook"], p["channel_scale"], self.dims.num_kv_heads)


# -- packed storage --------------------------------------------------------------------------------------


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., K] in [0, 2^bits) -> int32 words [..., ceil(K bits / 32)]: one little-endian bit stream, code k at
    stream bits [k bits, k bits + bits) (a code may straddle two words). The plain stream of quant/packing.py for
    every width (no 3-bit plane order: the key codes of a token are gathered one field at a time, never as a run)."""
    k = codes.shape[-1]
    nwords = (k * bits + 31) // 32
    start = torch.arange(k, device=codes.device) * bits
    word, shift = start // 32, start % 32
    c = codes.to(torch.int64)
    out = torch.zeros(*codes.shape[:-1], nwords + 1, dtype=torch.int64, device=codes.device)
    out.scatter_add_(-1, word.expand_as(c), (c << shift) & 0xFFFFFFFF)  # disjoint bits: add == or
    out.scatter_add_(-1, (word + 1).expand_as(c), torch.where(shift + bits > 32, c >> (32 - shift), 0))
    out = out[..., :nwords]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def unpack_stream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of pack_stream: int32 words [..., W] -> codes [..., count] as int64."""
    start = torch.arange(count, device=words.device) * bits
    word, shift = start // 32, start % 32
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=-1)
    lo = w.index_select(-1, word) >> shift
    hi = w.index_select(-1, word + 1) << (32 - shift)
    return (lo | hi) & ((1 << bits) - 1)


REFERENCE_TOKEN_CHUNK = 2048  # tokens per block of the torch reference's key scores (its gather is [Hq, P, R, T])


class CommVQStorage(Storage):
    """One layer's CommVQ tokens, keys before RoPE (the commutative codebooks need them; slot i of a row sits at
    position pos_offset + i). Buffers, token axis 1:

    - k_codes [B, T, WK] int32: the G x R x 2 key code indices (group, stage, a/b in that order) of a token, each at
      its real width ceil(log2 N') bits, as one bit stream (`pack_stream`; WK = ceil(2 G R log2 N' / 32): 33 words
      at 1 bit on Llama-3.1-8B, 63 at 2 bits);
    - k_norm [B, T] fp16: kappa, the key's L2 norm over all KV heads;
    - v_codes [B, T, WV] int32: the N_c value code bits (bit n of the token at bit n % 32 of word n // 32: the 1-bit
      layout of quant/packing.py), WV = ceil(N_c / 32);
    - v_rho [B, T] fp16: the value's norm ratio rho.

    Per-layer constants (on the storage): theta and the pair channels (reference encoders), the value encoder and
    codebook, and for the kernels theta re-laid out per KV head [Hkv, R, N, P, 2] (the codeword of pair p of head h
    whatever group holds it) and the codebook [N_c, C]. write_* encode with the codec's functions; attend_reference
    is the fused references (Eq. 19 scores from a table of q against the codebooks, Eq. 22 values by probability mass
    per code), never a rebuilt key or value."""

    keys_pre_rope = True

    def __init__(self, codec: CommVQCodec, layer: int):
        self.codec, self.layer, self.dims = codec, layer, codec.dims
        self.policy = codec.policy
        method = codec.method
        self.index_bits = method.index_bits
        self.codes = method.key_codes
        keys = codec.keys[layer]
        self.theta, self.channels = keys["theta"], keys["pair_channels"].long()
        self.groups, self.stages, _, self.group_pairs = self.theta.shape[:4]
        self.values = codec.values[layer]
        self.num_value_bits = self.values["codebook"].shape[0]
        self._by_dtype: dict = {}

    # ---- constants ------------------------------------------------------------------------------------------------
    def to(self, device) -> CommVQStorage:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current device: no move, no new constants
            device = torch.device("cuda", torch.cuda.current_device())
        if self.theta.device != device:
            self.theta, self.channels = self.theta.to(device), self.channels.to(device)
            self.values = {n: t.to(device) for n, t in self.values.items()}
            self._by_dtype = {}
        return self

    def constants(self, dtype) -> dict[str, torch.Tensor]:
        """The constants in a compute dtype (float32, or float64 for float64 inputs), made once per dtype: theta and
        the value parameters (encoders, references), theta_heads [Hkv, R, N, P, 2] and the codebook (kernels)."""
        dtype = math_dtype(dtype)
        if dtype not in self._by_dtype:
            dims = self.dims
            half = dims.head_dim // 2
            theta = self.theta.to(dtype)
            # pair p of KV head h is flattened pair h P + p: group (h P + p) // g, place (h P + p) % g
            flat = torch.arange(dims.num_kv_heads * half, device=theta.device)
            per_pair = theta[flat // self.group_pairs, :, :, flat % self.group_pairs]  # [Hkv P, R, N, 2]
            heads = per_pair.view(dims.num_kv_heads, half, self.stages, self.codes, 2).permute(0, 2, 3, 1, 4)
            self._by_dtype[dtype] = {"theta": theta, "theta_heads": heads.contiguous(),
                                     "values": {n: t.to(dtype) for n, t in self.values.items()}}
        return self._by_dtype[dtype]

    @property
    def tables(self) -> dict[str, torch.Tensor]:
        """What a decode step reads besides the cache (runtime.bench.packed_bytes counts it): the codewords per KV head
        and the value codebook and scale, float32."""
        t = self.constants(torch.float32)
        return {"theta_heads": t["theta_heads"], "codebook": t["values"]["codebook"],
                "channel_scale": t["values"]["channel_scale"]}

    def check(self, heads: int, dim: int) -> None:
        if heads != self.dims.num_kv_heads or dim != self.dims.head_dim:
            raise KvcalError(f"commvq storage of {self.dims.num_kv_heads} KV heads of {self.dims.head_dim} channels "
                             f"cannot hold {heads} x {dim}")

    def buffers(self, batch, capacity, heads, dim):
        key_words = (2 * self.groups * self.stages * self.index_bits + 31) // 32
        value_words = (self.num_value_bits + 31) // 32
        return {"k_codes": BufferSpec((batch, capacity, key_words), torch.int32, 1),
                "k_norm": BufferSpec((batch, capacity), torch.float16, 1),
                "v_codes": BufferSpec((batch, capacity, value_words), torch.int32, 1),
                "v_rho": BufferSpec((batch, capacity), torch.float16, 1)}

    # ---- write ----------------------------------------------------------------------------------------------------
    def _encode(self, keys, values):
        """keys (pre-RoPE) and values [M, H, D] -> (key words, kappa, value words, rho) of the M tokens."""
        m = keys.shape[0]
        t = self.constants(keys.dtype)
        codes, norms = encode_keys(keys.reshape(m, -1), t["theta"], self.channels)
        bits, rho = encode_values(values.reshape(m, -1), t["values"])
        return pack_stream(codes.reshape(m, -1), self.index_bits), norms, pack_stream(bits, 1), rho

    def _store(self, packed, rows, slots, key_words, norms, value_words, rho):
        packed["k_codes"][rows, slots] = key_words
        packed["k_norm"][rows, slots] = norms
        packed["v_codes"][rows, slots] = value_words
        packed["v_rho"][rows, slots] = rho

    def write_reference(self, packed, keys, values, rows, slots):
        self._store(packed, rows, slots, *self._encode(keys, values))

    def write_triton(self, packed, keys, values, rows, slots):
        """Keys by the Triton nearest-code kernel (commvq_kernels.encode_keys_triton: the fast distance decomposition,
        one program per block of 16 tokens and group over its stages); values by the encoder MLP as torch GEMMs on the GPU (a
        LayerNorm and two Linear layers of C x hidden weights per token: cuBLAS is the right tool for them), the
        argmax, the bits and rho as the reference computes them."""
        from kvcal.methods.commvq.method import kernels as commvq_kernels

        m = keys.shape[0]
        t = self.constants(keys.dtype)
        key_words, norms = commvq_kernels.encode_keys_triton(keys.reshape(m, -1), t["theta"], self.channels,
                                                             self.index_bits, storage=self)
        bits, rho = encode_values(values.reshape(m, -1), t["values"])
        self._store(packed, rows, slots, key_words, norms, pack_stream(bits, 1), rho)

    # ---- read -----------------------------------------------------------------------------------------------------
    def codes_of(self, packed: Packed, row: int, start: int = 0, end: int | None = None):
        """(key codes [T, G, R, 2], kappa [T], value bits [T, N_c], rho [T]) of slots [start, end) of row `row`."""
        end = int(packed.lengths[row]) if end is None else end
        codes = unpack_stream(packed["k_codes"][row, start:end], self.index_bits, 2 * self.groups * self.stages)
        bits = unpack_stream(packed["v_codes"][row, start:end], 1, self.num_value_bits)
        return (codes.view(-1, self.groups, self.stages, 2), packed["k_norm"][row, start:end], bits,
                packed["v_rho"][row, start:end])

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        dims = self.dims
        compute = math_dtype(dtype)
        t = self.constants(compute)
        codes, norms, bits, rho = self.codes_of(packed, row)
        k = decode_keys(codes, norms, t["theta"], self.channels, dims.kv_channels)
        v = decode_values(bits, rho, t["values"])
        n = codes.shape[0]
        k = k.view(n, dims.num_kv_heads, dims.head_dim).transpose(0, 1)
        v = v.view(n, dims.num_kv_heads, dims.head_dim).transpose(0, 1).to(dtype)
        return (packed.rotate_keys(k, dtype) if rotate else k.to(dtype)), v

    # ---- attend ---------------------------------------------------------------------------------------------------
    def attend_reference(self, q, packed, scale, fp):
        """The fused references on the codes: Eq. 19 scores (fused_key_scores, with the model's RoPE tables), softmax
        partials in the log2 domain, Eq. 22 values (fused_value_attention with the unnormalized probabilities)."""
        from kvcal.runtime.decode import LOG2E, Partials, with_fp_reference

        dims = self.dims
        batch, hq, d = q.shape
        hkv, half = dims.num_kv_heads, d // 2
        group = hq // hkv
        parts = Partials.empty(batch * hkv, 1, group, d, q.dtype, q.device)
        compute = parts.m.dtype
        parts.m.fill_(-math.inf)
        parts.l.zero_()
        parts.acc.zero_()
        t = self.constants(compute)
        for b in range(batch):
            n = int(packed.lengths[b])
            if n == 0:
                continue
            qb = q[b].to(compute)[None, :, None, :]  # [1, Hq, 1, D]
            scores = []
            for s0 in range(0, n, REFERENCE_TOKEN_CHUNK):
                s1 = min(n, s0 + REFERENCE_TOKEN_CHUNK)
                codes, norms, _, _ = self.codes_of(packed, b, s0, s1)
                pos = torch.arange(packed.pos_offset + s0, packed.pos_offset + s1, device=q.device)
                cos, sin = packed.rope_cos[pos, :half], packed.rope_sin[pos, :half]
                scores.append(fused_key_scores(qb, codes[None], norms[None], pos, t["theta"], packed.inv_freq, hkv,
                                               scale, cos=cos, sin=sin))
            s = torch.cat(scores, -1) * LOG2E  # [1, Hq, 1, T]
            m = s.amax(-1, keepdim=True)
            p = torch.exp2(s - m)
            _, _, bits, rho = self.codes_of(packed, b)
            acc = fused_value_attention(p, bits[None], rho[None], t["values"]["codebook"],
                                        t["values"]["channel_scale"], hkv)  # [1, Hq, 1, D]
            at = slice(b * hkv, (b + 1) * hkv)
            parts.m[at, 0] = m.view(hkv, group)
            parts.l[at, 0] = p.sum(-1).view(hkv, group)
            parts.acc[at, 0] = acc.view(hkv, group, d)
        return with_fp_reference(parts, q, fp, scale)

    def supports_triton(self, q, packed):
        from kvcal.methods.commvq.method import kernels as commvq_kernels

        return commvq_kernels.unsupported(q, packed, self)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        from kvcal.methods.commvq.method import kernels as commvq_kernels

        return commvq_kernels.attend_triton(q, packed, scale, fp, self, **knobs)

    # ---- benchmarks -----------------------------------------------------------------------------------------------
    def fill_synthetic(self, packed, generator):
        """Valid random indices (each key code below N', packed as write packs them), random value bits, key norms of
        8 to 16 (real keys over all KV heads are of that order) and norm ratios of 0.5 to 2."""
        batch, cap = packed["k_norm"].shape
        dev = packed["k_norm"].device
        count = 2 * self.groups * self.stages
        for b in range(batch):  # one row at a time: the int64 codes of a 32K x 336 row are 90 MB
            codes = torch.randint(0, self.codes, (cap, count), generator=generator, device=dev)
            packed["k_codes"][b] = pack_stream(codes, self.index_bits)
        packed["v_codes"].random_(generator=generator)
        packed["k_norm"].uniform_(8.0, 16.0, generator=generator)
        packed["v_rho"].uniform_(0.5, 2.0, generator=generator)


# -- the method -----------------------------------------------------------------------------------------


@register
@dataclass
class CommVQ(Method):
    """RoPE-commutative residual key codebooks (soft EM) and a learned additive value code."""

    name = "commvq"
    summary = "RoPE-commutative key codebooks (EM) + learned additive value code, ~1-2 bits"
    learns = True
    captures = ("k", "v", "q")
    runtime_fields = ("quantize", "fp_window", "fp_flush")
    fp_window_field = "fp_window"
    test_config = {"bits": 2, "key_codes": 8, "key_stages": 3, "key_em_steps": 3, "key_train_vectors": 256,
                   "value_steps": 8, "value_batch_tokens": 64, "value_attn_tokens": 32, "value_warmup": 2,
                   "fp_window": 4}
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
    # key EM budget: digest §9 minimal is 16384 vectors and <= 25 steps per stage (about 1.5 h on smollm2, one
    # core); the default is smaller so that smollm2 calibrates in minutes
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
                                    ("fp_flush", self.fp_flush, FP_FLUSH),
                                    ("rope_pairing", self.rope_pairing, ROPE_PAIRINGS)):
            if value not in allowed:
                raise KvcalError(f"commvq {key} must be one of {', '.join(allowed)}, got '{value}'")
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

    # -- calibration --------------------------------------------------------------------------------------
    def calibrate(self, loaded, store):
        from kvcal.models.adapter import attention_modules
        from kvcal.progress import progress_bar

        dims = loaded.dims
        self.check_model(dims)
        positions = store.token_positions
        windows = window_bounds(positions)
        held = held_out_windows(len(windows), self.holdout, self.seed)
        train_rows, held_rows = rows_of(windows, held, False), rows_of(windows, held, True)
        if train_rows.numel() == 0:
            raise KvcalError("commvq: no calibration tokens left for training after the held-out windows")
        groups, stages = self.num_groups(dims), self.stages(dims)
        modules = attention_modules(loaded.model) if self.value_loss == "attention" else None
        tensors, keys_info, values_info = {}, [], []
        with progress_bar(f"commvq: key codebooks (EM, {groups} groups x {stages} stages)",
                          dims.num_layers * groups * stages) as advance:
            for i in range(dims.num_layers):
                k = store.layer(i)["k"]
                device = loaded.layer_device(i)  # each layer's fit runs where that layer is
                with device_scope(device):
                    theta, info = self._fit_keys(k, train_rows, held_rows, i, dims, device, advance)
                tensors[f"layers.{i}.k.theta"] = theta.cpu()
                tensors[f"layers.{i}.k.pair_channels"] = pair_channels(
                    dims.num_kv_heads, dims.head_dim, self.group_pairs(dims)).to(torch.int32)
                tensors[f"layers.{i}.k.stage_mse"] = torch.tensor(info.pop("stage_mse_groups"), dtype=torch.float32)
                keys_info.append(info)
        with progress_bar(f"commvq: value encoders ({self.value_steps} steps per layer)",
                          dims.num_layers * self.value_steps) as advance:
            for i in range(dims.num_layers):
                data = store.layer(i)
                module = modules[i] if modules is not None else None
                device = loaded.layer_device(i)
                with device_scope(device):
                    params, info = self._fit_values(data, positions, windows, held, module, loaded, i, device,
                                                    advance)
                for name, t in params.items():
                    tensors[f"layers.{i}.v.{name}"] = t.detach().cpu()
                values_info.append(info)
        code_bits = self.code_bits(dims)
        info = {
            "paper_bits": {k: round(v, 6) for k, v in code_bits.items()},
            "key_stages": stages,
            "key_groups": groups,
            "key_group_pairs": self.group_pairs(dims),
            "key_temperature": self.temperature(dims),
            "rope_pairing": self.rope_pairing,
            "windows": {"train": len(windows) - len(held), "held_out": len(held)},
            "key_stage_mse": [layer["stage_mse"] for layer in keys_info],  # held-out, per layer and stage
            "key_scalar_mse": [layer["scalar_mse"] for layer in keys_info],
            "key_em_steps": [layer["em_steps"] for layer in keys_info],
            "key_hard_steps": [layer["hard_steps"] for layer in keys_info],
            "key_max_weight": [layer["max_weight"] for layer in keys_info],
            "key_vectors": keys_info[0]["vectors"] if keys_info else None,
            "value_mse": [layer["mse"] for layer in values_info],  # held-out
            "value_scalar_mse": [layer["scalar_mse"] for layer in values_info],  # per token, groups of 32 channels
            "value_scalar_mse_token": [layer["scalar_mse_token"] for layer in values_info],  # one group per token
            "value_train_loss": [layer["train_loss"] for layer in values_info],
            "value_attn_mse": [layer.get("attn_mse") for layer in values_info],  # held-out o_proj output error
            "value_attn_scalar_mse": [layer.get("attn_scalar_mse") for layer in values_info],
            "value_live_groups": [layer["live_groups"] for layer in values_info],
            "value_used_rows": [layer["used_rows"] for layer in values_info],
            "value_loss": self.value_loss,
            "value_hidden": self.hidden(dims),
            "value_params_per_layer": sum(int(t.numel()) for n, t in tensors.items() if n.startswith("layers.0.v.")),
        }
        return tensors, info

    def temperature(self, dims) -> float:
        """T at the first step of stage 0: the official 1e-3 for 8 groups of unit 1024-d keys (RMS group-slice norm
        sqrt(1/8) = 0.354), times the RMS slice norm of this layout over it: sqrt(1/G) / sqrt(1/8) (§8 item 8)."""
        return self.key_temperature or 1e-3 * math.sqrt(1 / self.num_groups(dims)) / REFERENCE_SLICE_NORM

    def stage_temperatures(self, dims) -> list[float]:
        """The official per-stage scale: stage r runs at T_scale = 10^-ceil(r / 4) (/10 after stages 0, 4, 8, ...)."""
        t = self.temperature(dims)
        return [t * 10.0 ** -math.ceil(r / 4) for r in range(self.stages(dims))]

    def _fit_keys(self, k: torch.Tensor, train_rows, held_rows, layer: int, dims, device, advance):
        """Codebooks of one layer: theta [G, R, N, g, 2] and diagnostics."""
        n_train = min(self.key_train_vectors, train_rows.numel())
        pick = train_rows[torch.randperm(train_rows.numel(), generator=generator(self.seed, layer, "keys"))[:n_train]]
        # held-out vectors: 10% of the total (1/9 of the training count), from the held-out windows [D §8 item 10]
        n_held = min(held_rows.numel(), math.ceil(n_train / 9))
        held_pick = held_rows[torch.randperm(held_rows.numel(), generator=generator(self.seed, layer, "held"))[:n_held]]
        channels = pair_channels(dims.num_kv_heads, dims.head_dim, self.group_pairs(dims))

        def prepare(rows):
            x = k[rows].to(device, torch.float32)
            norms = x.norm(dim=-1)
            unit = x / norms.clamp_min(torch.finfo(x.dtype).tiny)[:, None]
            return unit[:, channels.to(device)], norms.square()  # [M, G, g, 2], kappa^2

        train, train_w = prepare(pick)
        held, held_w = prepare(held_pick)
        # all groups of the layer in one batched EM (vq.fit_residual_groups): each group's own seed and stopping
        theta, fits, stage_mse = vq.fit_residual_groups(
            train.transpose(0, 1).contiguous(), train_w, held.transpose(0, 1).contiguous(), held_w, self.key_codes,
            self.stages(dims), self.key_em_steps, self.stage_temperatures(dims),
            lambda grp, r: generator(self.seed, layer, grp, r), self.key_em_tol,
            init_temperature=self.stage_temperatures(dims)[0] / 1e-3, on_stage=advance)
        steps = [[f.steps for f in group] for group in fits]
        hard_steps = [[f.hard_steps for f in group] for group in fits]
        max_weight = [[round(f.max_weight, 4) for f in group] for group in fits]
        groups = len(stage_mse)
        per_stage = [sum(m[r] for m in stage_mse) / groups for r in range(len(stage_mse[0]))]
        return theta, {
            "stage_mse_groups": stage_mse,
            "stage_mse": [round(m, 8) if math.isfinite(m) else None for m in per_stage],  # None: nothing held out
            "scalar_mse": round(key_scalar_mse(k[held_rows[: 32 * (held_rows.numel() // 32)]].to(device), self.bits,
                                               dims), 8) if held_rows.numel() >= 32 else None,
            "em_steps": steps,
            "hard_steps": hard_steps,
            "max_weight": max_weight,
            "vectors": {"train": int(n_train), "held_out": int(n_held)},
        }

    def _fit_values(self, data, positions, windows, held, module, loaded, layer, device, advance):
        dims = loaded.dims
        v = data["v"].to(device, torch.float32)
        train_windows = [w for j, w in enumerate(windows) if j not in held]
        train_rows = torch.cat([torch.arange(s, e) for s, e in train_windows]).to(device)
        params = init_value_params(v[train_rows], self.value_groups(dims), self.hidden(dims),
                                   generator(self.seed, layer, "value-init"), device)
        attention = None
        if self.value_loss == "attention":
            attention = AttentionOutputLoss(data, train_windows, module, loaded, self.value_attn_tokens, device)
        losses = train_value_coder(params, v, train_rows, attention, self, generator(self.seed, layer, "value-train"),
                                   advance)
        held_rows = torch.cat([torch.arange(s, e) for j, (s, e) in enumerate(windows) if j in held]
                              or [train_rows.cpu()])[:HELD_OUT_VALUE_TOKENS].to(device)
        with torch.no_grad():
            x = v[held_rows]
            bits, rho = encode_values(x, params)
            mse = float((decode_values(bits, rho, params) - x).square().mean())
            categories = bits.view(-1, bits.shape[-1] // 2, 2)
            code = categories[..., 0] * 2 + categories[..., 1]  # 10 -> 2, 01 -> 1, 11 -> 3, 00 -> 0
            used = F.one_hot(code.long(), 4).amax(0)  # [n_e, 4] categories seen per group
            live = float((used.sum(-1) >= 3).float().mean())
            used_rows = float((bits.amax(0) > 0).float().mean())
            info = {"mse": round(mse, 8), "scalar_mse": round(value_scalar_mse(x, self.bits), 8),
                    "scalar_mse_token": round(value_scalar_mse(x, self.bits, x.shape[-1]), 8),
                    "train_loss": round(losses, 8), "live_groups": round(live, 4), "used_rows": round(used_rows, 4)}
            if attention is not None and held:
                info.update(self._held_out_attention(data, windows, held, module, loaded, params, device))
        return params, info

    def _held_out_attention(self, data, windows, held, module, loaded, params, device) -> dict:
        """Attention-output error after o_proj on the held-out windows (values quantized block by block, at most 8
        blocks), for the learned code and for the per-token group-32 scalar quantizer at the same code bits."""
        from kvcal.quant.uniform import fake_quant_groups

        held_windows = [w for j, w in enumerate(windows) if j in held]
        probe = AttentionOutputLoss(data, held_windows, module, loaded, self.value_attn_tokens, device, cache_bytes=0)
        ours, scalar = [], []
        for index in range(min(8, len(probe.blocks))):
            x = data["v"][probe.rows(index)].to(device, torch.float32)
            probs = probe.probabilities(index)
            ours.append(float(probe.loss(probs, decode_values(*encode_values(x, params), params) - x)))
            group = 32 if x.shape[-1] % 32 == 0 else x.shape[-1]
            scalar.append(float(probe.loss(probs, fake_quant_groups(x, self.bits, -1, group) - x)))
        return {"attn_mse": round(sum(ours) / len(ours), 8), "attn_scalar_mse": round(sum(scalar) / len(scalar), 8)}

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

    def build_codec(self, tensors, dims) -> Codec:
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
        return CommVQCodec(self, keys, values, dims)

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


# -- calibration helpers ---------------------------------------------------------------------------------


def window_bounds(positions: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) rows of each calibration window (a window starts where the position is 0)."""
    starts = torch.nonzero(positions == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise KvcalError("commvq: the captured tokens do not start a window at position 0")
    ends = starts[1:] + [positions.numel()]
    return list(zip(starts, ends))


def held_out_windows(count: int, fraction: float, seed: int) -> set[int]:
    """The held-out windows: round(fraction x count), at least 1 when fraction > 0, chosen by the seed."""
    if fraction <= 0:
        return set()
    n = max(1, int(fraction * count + 0.5))
    if n >= count:
        raise KvcalError(f"commvq holdout={fraction:g} leaves no training window of the {count} calibration windows "
                         "(use more --nsamples or holdout=0)")
    return set(torch.randperm(count, generator=generator(seed, "holdout"))[:n].tolist())


def rows_of(windows, held: set[int], want_held: bool) -> torch.Tensor:
    parts = [torch.arange(s, e) for j, (s, e) in enumerate(windows) if (j in held) == want_held]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def key_scalar_mse(k: torch.Tensor, bits: int, dims, group: int = 32) -> float:
    """The KIVI-style reference at the same code bits: keys per channel over groups of `group` consecutive
    tokens, asymmetric min/max, fp16 scale and zero (digest §9's quality gate)."""
    from kvcal.quant.uniform import fake_quant_groups

    x = k.to(torch.float32)
    return float((fake_quant_groups(x.T.contiguous(), bits, -1, group).T - x).square().mean())


def value_scalar_mse(v: torch.Tensor, bits: int, group: int = 32) -> float:
    """KIVI-style values at the same code bits: per token, groups of `group` channels (Table 11's baseline)."""
    from kvcal.quant.uniform import fake_quant_groups

    group = group if v.shape[-1] % group == 0 else v.shape[-1]
    return float((fake_quant_groups(v, bits, -1, group) - v).square().mean())


def init_value_params(v: torch.Tensor, groups: int, hidden: int, gen: torch.Generator, device) -> dict:
    """Encoder parameters: torch's nn.Linear / nn.LayerNorm initialisation from a seeded generator, the codebook
    N(0, 1) as the official `torch.randn`, the frozen scale = mean |v| per channel [C] (training/make_scale.py;
    plus eps, the same in encode and decode where the code divides by scale + 1e-6 and multiplies by scale)."""
    channels = v.shape[-1]

    def uniform(shape, fan_in):
        bound = 1 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound

    params = {
        "codebook": torch.randn(2 * groups, channels, generator=gen),
        "ln_weight": torch.ones(channels),
        "ln_bias": torch.zeros(channels),
        "fc1_weight": uniform((hidden, channels), channels),
        "fc1_bias": uniform((hidden,), channels),
        "fc2_weight": uniform((4 * groups, hidden), hidden),
        "fc2_bias": uniform((4 * groups,), hidden),
    }
    params = {n: t.to(device).requires_grad_(True) for n, t in params.items()}
    params["channel_scale"] = v.abs().mean(0).detach() + VALUE_EPS
    return params


def gumbel_hard(logits: torch.Tensor, tau: float, gen: torch.Generator) -> torch.Tensor:
    """gumbel_softmax(hard=True) [C] with a seeded generator: one-hot forward, softmax gradient. The noise is
    drawn on the generator's device (a GPU generator on a GPU: no host-side draw and copy per step)."""
    u = torch.rand(logits.shape, generator=gen, device=gen.device).to(logits.device).clamp_(1e-10, 1 - 1e-7)
    soft = torch.softmax((logits - torch.log(-torch.log(u))) / tau, dim=-1)
    # one_hot(argmax) written as a scatter: F.one_hot validates its indices, a host sync on a GPU
    hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
    return hard - soft.detach() + soft


def training_bits(onehot: torch.Tensor) -> torch.Tensor:
    """category_bits for training: bits (y0 + y2, y1 + y2) of the map 0 -> 10, 1 -> 01, 2 -> 11, 3 -> 00 [C], as
    sums instead of a product with the map's table (no table copied to the device every step)."""
    y = onehot.unbind(-1)
    return torch.stack((y[0] + y[2], y[1] + y[2]), dim=-1).flatten(-2)


def reconstruct_training(params, x: torch.Tensor, tau: float, gen: torch.Generator) -> torch.Tensor:
    """Training-time decode of value rows x [M, C] through straight-through Gumbel codes [C]."""
    unit, rho0 = normalize_values(x, params["channel_scale"])
    logits = value_logits(params, unit, params["codebook"].shape[0] // 2)
    u = training_bits(gumbel_hard(logits, tau, gen)) @ params["codebook"]
    return params["channel_scale"] * ((rho0 + VALUE_EPS) / (u.norm(dim=-1) + VALUE_EPS))[:, None] * u


class AttentionOutputLoss:
    """The official value loss's second term on one layer [C]: MSE of o_proj(attention) with quantized values
    against the full-precision one, queries and keys unquantized. Blocks of `block` query tokens of a window;
    the block's queries attend causally to all keys of the window up to the block's end, with the values of
    the block quantized and those before it exact (the official code quantizes every value of a sequence;
    blocks keep the cost bounded on a CPU, digest §9). The difference of outputs is linear in v_hat - v:
    o_proj(P_block (v_hat - v)_block), bias cancelled."""

    def __init__(self, data, windows, module, loaded, block: int, device, cache_bytes: int | None = None):
        dims = loaded.dims
        on_gpu = torch.device(device).type == "cuda"
        # on a GPU the layer's queries and keys move once (in their captured dtype), not one block per step
        self.q, self.k = (data["q"].to(device), data["k"].to(device)) if on_gpu else (data["q"], data["k"])
        if cache_bytes is None:
            cache_bytes = ATTENTION_CACHE_BYTES_GPU if on_gpu else ATTENTION_CACHE_BYTES
        self.dims, self.device = dims, device
        self.inv_freq = loaded.adapter.inv_freq_on(torch.device(device))
        self.scale = float(module.scaling)
        self.weight = module.o_proj.weight.detach().to(device, torch.float32)
        self.blocks = [(s, b, min(b + block, e - s)) for s, e in windows for b in range(0, e - s, block)]
        # the weights of a block never change: kept once computed, up to a memory budget
        self.cache: dict[int, torch.Tensor] = {}
        self.cache_budget, self.cached_bytes = cache_bytes, 0

    def rows(self, index: int) -> torch.Tensor:
        return torch.arange(*self.span(index))

    def span(self, index: int) -> tuple[int, int]:
        """[first, end) rows of the block (consecutive)."""
        start, b0, b1 = self.blocks[index]
        return start + b0, start + b1

    def probabilities(self, index: int) -> torch.Tensor:
        """Attention weights [Hkv, rep * L, L] of the block's queries over the block's keys (full softmax)."""
        if index in self.cache:
            return self.cache[index]
        probs = self._probabilities(index)
        nbytes = probs.numel() * probs.element_size()
        if self.cached_bytes + nbytes <= self.cache_budget:
            self.cache[index] = probs
            self.cached_bytes += nbytes
        return probs

    def _probabilities(self, index: int) -> torch.Tensor:
        dims = self.dims
        start, b0, b1 = self.blocks[index]
        d, hkv = dims.head_dim, dims.num_kv_heads
        q = self.q[start + b0 : start + b1].to(self.device, torch.float32).view(1, b1 - b0, dims.num_heads, d)
        k = self.k[start : start + b1].to(self.device, torch.float32).view(1, b1, hkv, d)
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(b1, device=self.device)[None], torch.float32)
        q = apply_rope(q.transpose(1, 2), cos[:, b0:], sin[:, b0:])[0]  # [Hq, L, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)[0]  # [Hkv, b1, D]
        q = q.reshape(hkv, -1, d)  # [Hkv, rep * L, D]: query head j reads KV head j // rep
        scores = q @ k.transpose(1, 2) * self.scale
        query_pos = torch.arange(b0, b1, device=self.device).repeat(dims.num_heads // hkv)
        blocked = torch.arange(b1, device=self.device)[None, :] > query_pos[:, None]
        return torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)[..., b0:]

    def loss(self, probs: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
        """diff [L, C] = v_hat - v of the block -> mean squared o_proj output difference."""
        dims = self.dims
        length = diff.shape[0]
        per_head = diff.view(length, dims.num_kv_heads, dims.head_dim).transpose(0, 1)  # [Hkv, L, D]
        out = (probs @ per_head).view(dims.num_heads, length, dims.head_dim)
        return F.linear(out.transpose(0, 1).reshape(length, -1), self.weight).square().mean()


def learning_rate(method: CommVQ, step: int) -> float:
    """Linear warmup then cosine to 0 ([C] WarmupCosineLR of the 1-bit script; the warmup is capped at a fifth of
    a short budget so that it ends)."""
    warmup = min(method.value_warmup, method.value_steps // 5)
    if step < warmup:
        return method.value_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, method.value_steps - warmup)
    return method.value_lr * 0.5 * (1 + math.cos(math.pi * progress))


def train_value_coder(params, v, train_rows, attention, method: CommVQ, gen, advance) -> float:
    """AdamW on the encoder and codebook of one layer [C]: lr 1e-3, weight decay 0.1 on weights and codebook
    (none on biases and LayerNorm, as the HF Trainer groups them), betas (0.9, 0.95), grad-norm clip 1.0.
    Returns the mean training loss of the last tenth of the steps.

    On a GPU: the Gumbel noise comes from a GPU generator seeded from `gen` (deterministic per seed; the batch
    picks stay on `gen`), AdamW is the fused kernel, and nothing syncs the host inside the loop (the tail loss
    is summed on the device). On the CPU everything draws from `gen`, as before."""
    trainable = [t for n, t in params.items() if n != "channel_scale"]
    decay = [params[n] for n in ("codebook", "fc1_weight", "fc2_weight")]
    no_decay = [params[n] for n in ("ln_weight", "ln_bias", "fc1_bias", "fc2_bias")]
    on_gpu = v.device.type == "cuda"
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": method.value_weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=method.value_lr,
                                  betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if on_gpu else {}))
    noise = gen
    if on_gpu:
        noise = torch.Generator(device=v.device).manual_seed(derived_seed(gen.initial_seed(), "gumbel"))
    tail, tail_start = torch.zeros((), device=v.device), method.value_steps - max(1, method.value_steps // 10)
    per_step = max(1, method.value_batch_tokens // method.value_attn_tokens)
    with torch.enable_grad():
        for step in range(method.value_steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(method, step)
            if attention is not None:
                picks = torch.randint(len(attention.blocks), (per_step,), generator=gen).tolist()
                loss = 0.0
                for index in picks:
                    lo, hi = attention.span(index)
                    x = v[lo:hi]
                    v_hat = reconstruct_training(params, x, method.gumbel_tau, noise)
                    with torch.no_grad():
                        probs = attention.probabilities(index)
                    loss = loss + (0.5 * F.mse_loss(v_hat, x) + attention.loss(probs, v_hat - x)) / len(picks)
            else:
                pick = torch.randint(train_rows.numel(), (method.value_batch_tokens,), generator=gen)
                x = v[train_rows[pick.to(train_rows.device)]]
                loss = F.mse_loss(reconstruct_training(params, x, method.gumbel_tau, noise), x)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            if step >= tail_start:
                tail += loss.detach()
            advance()
    for t in trainable:
        t.requires_grad_(False)
    return float(tail) / (method.value_steps - tail_start)
