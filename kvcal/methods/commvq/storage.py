"""CommVQ's storage numerics (torch references): the layouts, the key and value encoders and decoders, the fused
attention over codes, the codebooks (CommVQTables) and the storages. kernels.py holds their Triton versions.

- Keys: each token's pre-RoPE key over all KV heads of the layer is divided by its L2 norm kappa (stored per token in
  fp16) [C]; the unit vector is cut into the model's RoPE pairs (rotate_half: channel i of a head pairs with
  i + head_dim/2, §8 item 1) and groups of g pairs; each group stores R codes (a, b) of the residual codebooks, found
  by greedy residual search (§3.3).
- Values: x = v / scale (frozen per-channel mean |v|), rho0 = |x|, LayerNorm -> Linear -> GELU -> Linear -> n_e
  groups of 4 logits, argmax (§8 item 5), one category per group mapped to 2 code bits (0 -> 10, 1 -> 01, 2 -> 11,
  3 -> 00), decode u = s C_V, v_hat = scale * rho * u with the per-token ratio rho = (rho0 + eps) / (|u| + eps) stored
  in fp16 (§8 item 3).

CommVQTables' encode/decode functions are the storage numerics a packed runtime reuses; `fused_key_scores` (Eq. 19) and
`fused_value_attention` (Eq. 22) are the torch references of the attention over codes, without reconstructing keys or
values. Citations as in method.py (digest §N, [P] paper, [C] official code, [D] digest).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvcal.errors import KvcalError
from kvcal.methods.base import Method
from kvcal.methods.commvq import kernels
from kvcal.methods.commvq.packing import FP16_MAX, pack_stream, unpack_stream
from kvcal.quant import vq
from kvcal.runtime.decode import LOG2E, Partials, with_fp_reference
from kvcal.runtime.storage import BufferSpec, Packed, ReconstructionStorage, Storage

VALUE_EPS = 1e-6  # [C] eps of the value scale and norms
LN_EPS = 1e-5  # torch LayerNorm default, as the official encoder
# category -> its two code bits [C]: 0 -> 10, 1 -> 01, 2 -> 11, 3 -> 00
CATEGORY_BITS = ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (0.0, 0.0))
# the value parameters of a layer, as the artifact names them (layers.{i}.v.{name})
VALUE_PARAMS = ("codebook", "channel_scale", "ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight",
                "fc2_bias")


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


def decode_codewords(theta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The key codewords as keys decoded for `dtype` use them, in its compute dtype: rounded to fp16 for fp16 and
    bf16 (the decode kernels gather fp16 codewords for 16-bit queries, half the bytes; docs/commvq.md compares the
    rounding with bf16's own), exact otherwise. Encoding always searches the exact codewords."""
    if dtype in (torch.float16, torch.bfloat16):
        return theta.to(torch.float16).to(math_dtype(dtype))
    return theta.to(math_dtype(dtype))


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


# -- the model's codebooks ------------------------------------------------------------------------------


class CommVQTables:
    """Every layer's codebooks and value encoders, with the encode/decode numerics of one layer that its storages
    (packed or an ablation's reconstruction) share. Keys before RoPE ([P] Eq. 12 and [C]: the commutative codebooks
    need them)."""

    def __init__(self, method: Method, keys: list[dict], values: list[dict], dims):
        self.method = method
        self.dims = dims
        self.keys, self.values = keys, values
        self.policy = method.policy()
        self.quantize_k = method.keys_quantized
        self.quantize_v = method.values_quantized
        self._device = None

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
        rows = decode_keys(codes, norms, decode_codewords(theta, dtype), channels, self.dims.kv_channels)
        return from_rows(rows, self.dims.num_kv_heads)

    def encode_values(self, layer: int, v: torch.Tensor):
        """v [B, Hkv, T, D] -> (bits [B, T, N_c] uint8, rho [B, T] fp16)."""
        return encode_values(to_rows(v), self._value_params(layer, v.device, math_dtype(v.dtype)))

    def decode_values(self, layer: int, bits: torch.Tensor, rho: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """-> values [B, Hkv, T, D]."""
        rows = decode_values(bits, rho, self._value_params(layer, bits.device, math_dtype(dtype)))
        return from_rows(rows, self.dims.num_kv_heads)

    def reconstruct(self, layer, k, v):
        """The simulation's view: encode, then decode, the same functions a packed storage stores and reads (the K-only
        and V-only ablations leave the other side as it is)."""
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
        return fused_key_scores(q_rot, codes, norms, positions, decode_codewords(theta, q_rot.dtype), inv_freq,
                                self.dims.num_kv_heads, scale)

    def value_attention(self, layer: int, probs, bits, rho) -> torch.Tensor:
        p = self._value_params(layer, probs.device, math_dtype(probs.dtype))
        return fused_value_attention(probs, bits, rho, p["codebook"], p["channel_scale"], self.dims.num_kv_heads)


# -- packed storage --------------------------------------------------------------------------------------


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
    whatever group holds it) and the codebook [N_c, C]. write_* encode with CommVQTables' functions; attend_reference
    is the fused references (Eq. 19 scores from a table of q against the codebooks, Eq. 22 values by probability mass
    per code), never a rebuilt key or value."""

    keys_pre_rope = True

    def __init__(self, book: CommVQTables, layer: int):
        self.book, self.layer, self.dims = book, layer, book.dims
        self.policy = book.policy
        method = book.method
        self.index_bits = method.index_bits
        self.codes = method.key_codes
        keys = book.keys[layer]
        self.theta, self.channels = keys["theta"], keys["pair_channels"].long()
        self.groups, self.stages, _, self.group_pairs = self.theta.shape[:4]
        self.values = book.values[layer]
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
        """Keys by the Triton nearest-code kernel (kernels.encode_keys_triton: the fast distance decomposition,
        one program per block of 16 tokens and group over its stages); values by the encoder MLP as torch GEMMs on the GPU (a
        LayerNorm and two Linear layers of C x hidden weights per token: cuBLAS is the right tool for them), the
        argmax, the bits and rho as the reference computes them."""
        m = keys.shape[0]
        t = self.constants(keys.dtype)
        key_words, norms = kernels.encode_keys_triton(keys.reshape(m, -1), t["theta"], self.channels,
                                                      self.index_bits, storage=self)
        bits, rho = encode_values(values.reshape(m, -1), t["values"])
        self._store(packed, rows, slots, key_words, norms, pack_stream(bits, 1), rho)

    # ---- read -----------------------------------------------------------------------------------------------------
    def codes_of(self, packed: Packed, row: int, start: int = 0, end: int | None = None):
        """(key codes [T, G, R, 2], kappa [T], value bits [T, N_c], rho [T]) of slots [start, end) of row `row`."""
        end = packed.length(row) if end is None else end
        codes = unpack_stream(packed["k_codes"][row, start:end], self.index_bits, 2 * self.groups * self.stages)
        bits = unpack_stream(packed["v_codes"][row, start:end], 1, self.num_value_bits)
        return (codes.view(-1, self.groups, self.stages, 2), packed["k_norm"][row, start:end], bits,
                packed["v_rho"][row, start:end])

    def read(self, packed: Packed, row: int, dtype=torch.float32, rotate: bool = True):
        dims = self.dims
        compute = math_dtype(dtype)
        t = self.constants(compute)
        codes, norms, bits, rho = self.codes_of(packed, row)
        k = decode_keys(codes, norms, decode_codewords(t["theta"], dtype), self.channels, dims.kv_channels)
        v = decode_values(bits, rho, t["values"])
        n = codes.shape[0]
        k = k.view(n, dims.num_kv_heads, dims.head_dim).transpose(0, 1)
        v = v.view(n, dims.num_kv_heads, dims.head_dim).transpose(0, 1).to(dtype)
        return (packed.rotate_keys(k, dtype) if rotate else k.to(dtype)), v

    # ---- attend ---------------------------------------------------------------------------------------------------
    def attend_reference(self, q, packed, scale, fp):
        """The fused references on the codes: Eq. 19 scores (fused_key_scores, with the model's RoPE tables), softmax
        partials in the log2 domain, Eq. 22 values (fused_value_attention with the unnormalized probabilities)."""
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
        theta = decode_codewords(t["theta"], q.dtype)
        for b in range(batch):
            n, first = int(packed.lengths[b]), packed.first_slot(b)  # slots [first, n): a sliding window's
            if n <= first:
                continue
            qb = q[b].to(compute)[None, :, None, :]  # [1, Hq, 1, D]
            scores = []
            for s0 in range(first, n, REFERENCE_TOKEN_CHUNK):
                s1 = min(n, s0 + REFERENCE_TOKEN_CHUNK)
                codes, norms, _, _ = self.codes_of(packed, b, s0, s1)
                pos = torch.arange(packed.pos_offset + s0, packed.pos_offset + s1, device=q.device)
                cos, sin = packed.rope_cos[pos, :half], packed.rope_sin[pos, :half]
                scores.append(fused_key_scores(qb, codes[None], norms[None], pos, theta, packed.inv_freq, hkv,
                                               scale, cos=cos, sin=sin))
            s = torch.cat(scores, -1)  # [1, Hq, 1, T]
            if packed.softcap is not None:
                s = packed.softcap * torch.tanh(s / packed.softcap)
            s = s * LOG2E
            m = s.amax(-1, keepdim=True)
            p = torch.exp2(s - m)
            _, _, bits, rho = self.codes_of(packed, b, first, n)
            acc = fused_value_attention(p, bits[None], rho[None], t["values"]["codebook"],
                                        t["values"]["channel_scale"], hkv)  # [1, Hq, 1, D]
            at = slice(b * hkv, (b + 1) * hkv)
            parts.m[at, 0] = m.view(hkv, group)
            parts.l[at, 0] = p.sum(-1).view(hkv, group)
            parts.acc[at, 0] = acc.view(hkv, group, d)
        return with_fp_reference(parts, q, fp, scale, packed.softcap)

    def reconstruct(self, k, v):
        return self.book.reconstruct(self.layer, k, v)

    def supports_triton(self, q, packed):
        return kernels.unsupported(q, packed, self)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        return kernels.attend_triton(q, packed, scale, fp, self, **knobs)

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


class CommVQReconstruction(ReconstructionStorage):
    """The K-only and V-only ablations (the other side stays in full precision), which the packed storage does not
    hold: the reconstruction kept as is."""

    keys_pre_rope = True
    refusal = "a commvq K-only or V-only ablation kept as its reconstruction (torch only)"

    def __init__(self, book: CommVQTables, layer: int):
        super().__init__()
        self.book, self.layer, self.policy = book, layer, book.policy

    def reconstruct(self, k, v):
        return self.book.reconstruct(self.layer, k, v)
