"""XQuant's storages (the method: kvcal/methods/xquant/method.py): the simulation's rematerialization of K and V
from fake-quantized X or SVD latents of it (XQuantMath, which every storage answers `rematerialize` with), the packed
cache's latents of one layer (XQuantStorage, Triton kernels in kvcal/methods/xquant/kernels.py), the cross-layer
chain of XQuant-CL (XQuantChainStorage, torch only) and the ablations' reconstructions (XQuantReconstruction). "rec §7.N" cites the digest's section 7 choices (papers/xquant.md)."""

from __future__ import annotations

import dataclasses

import torch

from kvcal.errors import KvcalError
from kvcal.methods.base import FlushPolicy, Method
from kvcal.methods.kivi.storage import KiviStorage
from kvcal.methods.xquant import kernels as xquant_kernels
from kvcal.quant.packing import words_per_vector
from kvcal.quant.uniform import (
    dequantize_per_channel,
    dequantize_per_token,
    fake_quant_groups,
    quantize_per_token_into,
)
from kvcal.quant.uniform_kernels import quantize_per_token_into_triton
from kvcal.runtime.storage import BufferSpec, ReconstructionStorage, Storage, Storages

PLAIN, BASE, DELTA = "plain", "base", "delta"  # a layer's role in XQuant.layer_plan


def _quantize(t: torch.Tensor, bits: int, axis: int, group: int) -> torch.Tensor:
    """Fake quantization of t (float) in groups of `group` consecutive elements along `axis`; 16 bits: fp16."""
    if bits == 16:
        return t.to(torch.float16).to(t.dtype)
    return fake_quant_groups(t, bits, axis, group).to(t.dtype)


# ---- packed storage ------------------------------------------------------------------------------------------------

RAW_DTYPE = torch.float16  # what bits=16 stores (fp16, as the simulation's _quantize; tests set float64: identity)
STORAGE_BITS = (2, 3, 4, 8, 16)


class Rematerialized:
    """The simulation's view of an XQuant storage: its layer's rematerialization (XQuantMath)."""

    math: XQuantMath | None = None
    layer: int = 0

    def rematerialize(self, x, proj, state):
        return self.math.rematerialize(self.layer, x, proj, state)


class XQuantStorage(Rematerialized, Storage):
    """One layer's cached X or latents of it, keys and values rematerialized at attention time (source "x").

    - "svd": Z_k = X U_k in KIVI's per-channel key format (blocks of `group_tokens` tokens) and Z_v = X U_v in its
      per-token value format (groups of `group_channels`), one "head" as wide as all KV heads (KiviStorage with
      heads = 1, dim = d_kv); latent channel 0 of Z_k also in fp16 when `outlier` (App. B). K = Z_k R_k (+ b_k),
      V = Z_v R_v (+ b_v).
    - "x": X itself per token (KIVI's value format, width = hidden); K = X W_k^T (+ b_k), V = X W_v^T (+ b_v), the
      weights taken from the layer at bind().
    bits 16 keeps the latents in RAW_DTYPE. Keys are rebuilt before RoPE and rotated at their positions. Kernels:
    kvcal/methods/xquant/kernels.py (keys rebuilt per token tile and KV-head block on tensor cores, RoPE and scores
    in registers; values summed in latent space for every query head, then one product with R_v per KV head)."""

    keys_pre_rope = True
    source = "x"

    def __init__(self, variant: str, bits: int, group_tokens: int, group_channels: int, residual: int,
                 factors: dict[str, torch.Tensor] | None = None, outlier: bool = False, hidden: int = 0):
        if variant not in ("svd", "x") or bits not in STORAGE_BITS:
            raise KvcalError(f"xquant packed storage holds variants svd and x at {STORAGE_BITS} bits, got "
                             f"{variant} at {bits}")
        self.variant, self.bits, self.outlier, self.hidden = variant, bits, outlier, hidden
        self.group_tokens, self.group_channels = group_tokens, group_channels
        self.policy = FlushPolicy(residual=residual, block=group_tokens)
        self.kivi = KiviStorage(bits, group_tokens, residual, group_channels) if bits != 16 else None
        factors = factors or {}
        # float32 factors: U [hidden, r] (svd), R_k / R_v [r, d_kv]; bias [d_kv] or None
        self.u_k, self.u_v = factors.get("k.U"), factors.get("v.U")
        self.r_k, self.r_v = factors.get("k.R"), factors.get("v.R")
        self.b_k = self.b_v = None
        self._cast: dict = {}

    @property
    def width(self) -> int:
        """Channels of the cached latent (d_kv for svd, hidden for x)."""
        return self.r_k.shape[0] if self.r_k is not None else self.hidden

    def bind(self, projection) -> None:
        if projection.k_norm:
            raise KvcalError("xquant packed storage cannot rebuild keys through a k_norm (Qwen3, Gemma 3, OLMo 2); use "
                             "--mode simulate")
        # kept in the model's dtype (float32 copies of float64 weights would move a float64 run by ~1e-9)
        if self.variant == "x":  # K = X W_k^T: the latent is X, R its projection
            self.r_k, self.r_v = projection.w_k.T.contiguous(), projection.w_v.T.contiguous()
        self.b_k, self.b_v = projection.b_k, projection.b_v
        self._cast.clear()

    def to(self, device):
        for name in ("u_k", "u_v", "r_k", "r_v", "b_k", "b_v"):
            t = getattr(self, name)
            if t is not None and t.device != torch.device(device):
                setattr(self, name, t.to(device))
        self._cast.clear()
        return self

    def factor(self, name: str, dtype) -> torch.Tensor | None:
        """A factor (u_k, u_v, r_k, r_v, b_k, b_v) in `dtype`, converted once."""
        t = getattr(self, name)
        if t is None or (t.dtype == dtype and t.is_contiguous()):
            return t
        key = (name, dtype, t.device)
        if key not in self._cast:
            self._cast[key] = t.to(dtype).contiguous()
        return self._cast[key]

    def check(self, heads: int, dim: int) -> None:
        if self.bits != 16 and self.width % self.group_channels:
            raise KvcalError(f"xquant group_channels {self.group_channels} does not divide the cached width "
                             f"{self.width}")

    # ---- buffers ------------------------------------------------------------------------------------------------
    def bytes_per_token(self, heads: int, dim: int) -> float:
        tokens = 8 * self.group_tokens  # whole key blocks (the base class's 64 slots may hold none)
        return sum(spec.nbytes() for spec in self.buffers(1, tokens, heads, dim).values()) / tokens

    def buffers(self, batch, capacity, heads, dim):
        width = self.width
        if self.bits == 16:
            raw = BufferSpec((batch, 1, capacity, width), RAW_DTYPE, 2)
            specs = {"v_raw": raw} if self.variant == "x" else {"k_raw": raw, "v_raw": raw}
        else:
            specs = self.kivi.buffers(batch, capacity, 1, width)
            if self.variant == "x":  # one per-token tensor serves keys and values
                specs = {name: spec for name, spec in specs.items() if name.startswith("v_")}
        if self.outlier:
            specs["k_outlier"] = BufferSpec((batch, 1, capacity), torch.float16, 2)
        return specs

    # ---- write --------------------------------------------------------------------------------------------------
    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, 1, hidden] -> (Z_k, Z_v) [M, 1, width] in x's dtype promoted to float32 at least (for x: X twice)."""
        compute = torch.promote_types(x.dtype, torch.float32)
        x = x.to(compute)
        if self.variant == "x":
            return x, x
        return x @ self.factor("u_k", compute), x @ self.factor("u_v", compute)

    def _write(self, packed, x, rows, slots, quantize_into, kivi_write):
        z_k, z_v = self.latents(x)
        if self.bits == 16:
            if self.variant == "svd":
                packed["k_raw"][rows, :, slots] = z_k.to(RAW_DTYPE)
            packed["v_raw"][rows, :, slots] = z_v.to(RAW_DTYPE)
        elif self.variant == "x":
            quantize_into(z_v, self.bits, self.group_channels, packed["v_codes"], packed["v_scale"],
                          packed["v_zero"], rows, slots)
        else:  # KIVI's format with one "head" as wide as the latent
            kivi_write(dataclasses.replace(packed, heads=1, dim=self.width), z_k, z_v, rows, slots)
        if self.outlier:
            packed["k_outlier"][rows, :, slots] = z_k[:, :, 0].to(torch.float16)

    def write_reference(self, packed, x, values, rows, slots):
        """x [M, 1, hidden], the layer's attention inputs (`values` is None: source "x"), into slots[m] of rows[m]."""
        self._write(packed, x, rows, slots, quantize_per_token_into,
                    None if self.kivi is None else self.kivi.write_reference)

    def write_triton(self, packed, x, values, rows, slots):
        split = self.head_split()
        if split is None:
            self._write(packed, x, rows, slots, quantize_per_token_into_triton,
                        None if self.kivi is None else self.kivi.write_triton)
            return
        # a width the quantize kernels cannot take in one piece (smollm2's 192): `heads` pieces of `per` channels,
        # each the kernels' size, over views of the same buffers (the same bits: see head_split)
        heads, per = split
        view = dataclasses.replace(packed, heads=heads, dim=per,
                                   buffers={n: _heads_view(t, heads) for n, t in packed.buffers.items()
                                            if n != "k_outlier"})
        z_k, z_v = self.latents(x)
        m = z_v.shape[0]
        if self.variant == "x":
            quantize_per_token_into_triton(z_v.view(m, heads, per), self.bits, self.group_channels, view["v_codes"],
                                           view["v_scale"], view["v_zero"], rows, slots)
        else:
            self.kivi.write_triton(view, z_k.view(m, heads, per), z_v.view(m, heads, per), rows, slots)
        if self.outlier:
            packed["k_outlier"][rows, :, slots] = z_k[:, :, 0].to(torch.float16)

    def head_split(self) -> tuple[int, int] | None:
        """(pieces, channels each) when the Triton quantize kernels cannot take the latent's width in one piece (not
        a power of two) but can take it as width / group_channels pieces of group_channels (a power of two >= 32):
        at 2, 4 and 8 bits a piece's codes fill whole words in stream order, and per-channel ranges and per-token
        groups of group_channels do not cross pieces, so the pieces' codes and ranges are the whole width's, bit for
        bit. None: the width goes in one piece (or no kernel takes it: the quantize kernel says so)."""
        width, per = self.width, self.group_channels
        if self.bits == 16 or not width & (width - 1):
            return None
        if self.bits in (2, 4, 8) and per >= 32 and not per & (per - 1) and not width % per:
            return width // per, per
        return None

    # ---- read ---------------------------------------------------------------------------------------------------
    def latent_rows(self, packed, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized latents (Z_k, Z_v) [T, width] float32 (float64 for float64 raw latents) of row `row` (the
        same tensor twice for x)."""
        t, width = packed.length(row), self.width
        if self.bits == 16:
            # in their own dtype, at least float32 (RAW_DTYPE float64: the identity)
            z_v = packed["v_raw"][row, 0, :t]
            z_v = z_v.to(torch.promote_types(z_v.dtype, torch.float32))
            z_k = z_v if self.variant == "x" else packed["k_raw"][row, 0, :t].to(z_v.dtype)
        else:
            z_v = dequantize_per_token(packed["v_codes"][row, 0, :t], packed["v_scale"][row, 0, :t],
                                       packed["v_zero"][row, 0, :t], self.bits, width)
            if self.variant == "x":
                z_k = z_v
            else:
                blocks = torch.arange(t, device=packed.lengths.device) // self.group_tokens
                z_k = dequantize_per_channel(packed["k_codes"][row, 0, :t], packed["k_scale"][row, 0][blocks],
                                             packed["k_zero"][row, 0][blocks], self.bits, width)
        if self.outlier:
            z_k = z_k.clone()
            z_k[:, 0] = packed["k_outlier"][row, 0, :t].float()
        return z_k, z_v

    def read(self, packed, row: int, dtype=torch.float32, rotate: bool = True):
        z_k, z_v = self.latent_rows(packed, row)
        k = z_k.to(dtype) @ self.factor("r_k", dtype)
        v = z_v.to(dtype) @ self.factor("r_v", dtype)
        if self.b_k is not None:
            k = k + self.factor("b_k", dtype)
        if self.b_v is not None:
            v = v + self.factor("b_v", dtype)
        heads, dim = packed.heads, packed.dim
        k = k.view(-1, heads, dim).transpose(0, 1)
        v = v.view(-1, heads, dim).transpose(0, 1)
        return (packed.rotate_keys(k, dtype) if rotate else k), v

    # ---- attend -------------------------------------------------------------------------------------------------
    def supports_triton(self, q, packed):
        return xquant_kernels.unsupported(self, q, packed)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        return xquant_kernels.attend_triton(self, q, packed, scale, fp, **knobs)

    def fill_synthetic(self, packed, generator):
        """Random codes, small positive scales and zeros, latents of about unit size (speed benchmarks); variant x
        unbound (no model: `kvcal bench decode`) gets random weights of the layer's shapes."""
        if self.r_k is None:
            shape = (self.hidden, packed.heads * packed.dim)
            self.r_k, self.r_v = (torch.randn(shape, generator=generator, device=generator.device) / self.hidden**0.5
                                  for _ in range(2))
            self._cast.clear()
        super().fill_synthetic(packed, generator)
        for name in ("k_raw", "v_raw", "k_outlier"):
            if name in packed.buffers:
                packed[name].normal_(generator=generator)


def _heads_view(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A buffer [B, 1, T, C] seen as [B, heads, T, C / heads] (the same memory: piece h is columns [h C / heads,
    (h + 1) C / heads) of every slot)."""
    b, _, n, c = t.shape
    return t.as_strided((b, heads, n, c // heads), (t.stride(0), c // heads, t.stride(2), 1), t.storage_offset())


class XQuantChain:
    """What XQuant-CL's layers share in one cache (SharedState.state(XQuantChain)): each cross-layer layer's storage
    and packed buffers, per row the last reconstruction read (layer, tokens, dtype, X^ of that layer), and the decode
    kernels' X^ of the last layer run."""

    def __init__(self):
        self.layers: dict[int, tuple] = {}
        self.last: dict[int, tuple] = {}
        self.step: dict[int, torch.Tensor] = {}  # the decode kernels' X^ of the layer that ran last (attend_triton)


class XQuantChainStorage(Rematerialized, Storage):
    """One cross-layer (XQuant-CL) layer: the base layer's X (or its latent X U_kv) per token at hp bits, or a delta
    layer's closed-loop delta Q((X_i - X^_{i-1}) U_kv) (svd) or Q(X_i - X^_{i-1}) (x) per token, in KIVI's per-token
    format (bits 16: RAW_DTYPE). The reconstruction X^_i = X^_b + sum_j DQ(Z_j) U_j^T at given tokens walks the layers
    from the base up through the cache's SharedState (each layer registers its packed buffers there when it writes or
    reads); a delta is taken against the reconstruction of the previous layer at the same tokens, which that layer
    wrote earlier in the same forward pass. K = X^_i W_k^T + b_k, V = X^_i W_v^T + b_v with the layer's own weights.

    Decode on CUDA (attend_triton): the layer's term DQ(Z_i) U_i^T of every slot of every row in one dense product,
    added to the previous layer's X^ of this step (kept in the chain: the layers of a step run in order; the base
    starts it), then XQuant's decode kernels on X^_i as an unquantized variant-x latent with R = W^T (keys rebuilt
    on tensor cores, RoPE in registers). X^ is [B, capacity, hidden] in float32 (float64 for float64 queries): the
    method's own cost, a hidden-wide rematerialization per layer and step. Writes run the torch reference (the delta
    of the new tokens against the previous layer's reconstruction)."""

    keys_pre_rope = True
    source = "x"
    graph_refusal = ("xquant cross-layer layers hand X^ from one layer's decode step to the next, which per-layer "
                     "CUDA graphs do not capture")

    def __init__(self, layer: int, base: int, bits: int, group_tokens: int, group_channels: int, residual: int,
                 hidden: int, u: torch.Tensor | None = None):
        if bits not in STORAGE_BITS:
            raise KvcalError(f"xquant packed storage holds {STORAGE_BITS} bits, got {bits}")
        self.layer, self.base, self.bits = layer, base, bits
        self.group_tokens, self.group_channels, self.hidden = group_tokens, group_channels, hidden
        self.policy = FlushPolicy(residual=residual, block=group_tokens)
        self.u = u  # [hidden, width] float32 (None: X or its delta itself)
        self.w_k = self.w_v = self.b_k = self.b_v = None
        self._x: XQuantStorage | None = None  # the decode kernels' view of X^ (bind)
        self._cast: dict = {}

    @property
    def width(self) -> int:
        return self.hidden if self.u is None else self.u.shape[1]

    def bind(self, projection) -> None:
        if projection.k_norm:
            raise KvcalError("xquant packed storage cannot rebuild keys through a k_norm (Qwen3, Gemma 3, OLMo 2); use "
                             "--mode simulate")
        self.w_k, self.w_v, self.b_k, self.b_v = projection.w_k, projection.w_v, projection.b_k, projection.b_v
        self._cast.clear()
        # the decode kernels' view of X^_i: an unquantized variant-x latent (width hidden, R = W^T)
        self._x = XQuantStorage("x", 16, self.group_tokens, self.group_channels, 0, {}, False, self.hidden)
        self._x.bind(projection)

    def to(self, device):
        if self.u is not None and self.u.device != torch.device(device):
            self.u = self.u.to(device)
        self._cast.clear()
        if self._x is not None:
            self._x.to(device)
        return self

    def _u(self, dtype) -> torch.Tensor:
        key = (dtype, self.u.device)
        if key not in self._cast:
            self._cast[key] = self.u.to(dtype)
        return self._cast[key]

    def check(self, heads: int, dim: int) -> None:
        if self.bits != 16 and self.width % self.group_channels:
            raise KvcalError(f"xquant group_channels {self.group_channels} does not divide the cached width "
                             f"{self.width}")

    def bytes_per_token(self, heads: int, dim: int) -> float:
        return sum(spec.nbytes() for spec in self.buffers(1, self.group_tokens, heads, dim).values()) / self.group_tokens

    def buffers(self, batch, capacity, heads, dim):
        width = self.width
        if self.bits == 16:
            return {"v_raw": BufferSpec((batch, 1, capacity, width), RAW_DTYPE, 2)}
        codes = BufferSpec((batch, 1, capacity, words_per_vector(width, self.bits)), torch.int32, 2)
        params = BufferSpec((batch, 1, capacity, width // self.group_channels), torch.float16, 2)
        return {"v_codes": codes, "v_scale": params, "v_zero": params}

    # ---- the chain ------------------------------------------------------------------------------------------------
    def _register(self, packed) -> dict:
        if packed.shared is None:
            raise KvcalError("xquant cross-layer storage needs the cache's shared state (a KvcalCache)")
        chain = packed.shared.state(XQuantChain)
        chain.layers[self.layer] = (self, packed)
        return chain.layers

    def _entries(self, packed, rows, slots, dtype) -> torch.Tensor:
        """This layer's reconstructed term at the tokens (rows[m], slots[m]): DQ(Z) U^T, [M, hidden] in dtype."""
        if self.bits == 16:
            z = packed["v_raw"][rows, 0, slots]
            z = z.to(torch.promote_types(z.dtype, torch.float32))
        else:
            z = dequantize_per_token(packed["v_codes"][rows, 0, slots], packed["v_scale"][rows, 0, slots],
                                     packed["v_zero"][rows, 0, slots], self.bits, self.width)
        z = z.to(dtype)
        return z if self.u is None else z @ self._u(dtype).T

    def chain_sum(self, chain: dict, upto: int, rows, slots, dtype) -> torch.Tensor:
        """X^_upto at the tokens (rows[m], slots[m]): the base's term plus every delta up to layer `upto`, summed in
        layer order (the simulation's order)."""
        acc = None
        for j in range(self.base, upto + 1):
            if j not in chain:
                raise RuntimeError(f"xquant layer {self.layer}: cross-layer layer {j} has not stored these tokens")
            storage, packed = chain[j]
            at = packed.lengths.device  # layer j's device (a split model's layers differ), then this one's
            term = storage._entries(packed, rows.to(at), slots.to(at), dtype).to(rows.device)
            acc = term if acc is None else acc + term
        return acc

    def slot_terms(self, packed, dtype) -> torch.Tensor:
        """This layer's term DQ(Z) U^T at every slot of every row, [B, capacity, hidden] in dtype (slots past a row's
        length hold whatever the buffers hold)."""
        if self.bits == 16:
            z = packed["v_raw"][:, 0].to(dtype)
        else:
            codes, scale, zero = packed["v_codes"][:, 0], packed["v_scale"][:, 0], packed["v_zero"][:, 0]
            batch, cap = codes.shape[:2]
            z = dequantize_per_token(codes.reshape(batch * cap, -1), scale.reshape(batch * cap, -1),
                                     zero.reshape(batch * cap, -1), self.bits, self.width).view(batch, cap, -1)
            z = z.to(dtype)
        return z if self.u is None else z @ self._u(dtype).T

    # ---- write ------------------------------------------------------------------------------------------------------
    def write_triton(self, packed, x, values, rows, slots):
        """The torch write (write_reference): a decode step writes one token a row, whose closed-loop delta needs the
        previous layer's reconstruction at that token."""
        self.write_reference(packed, x, values, rows, slots)

    def write_reference(self, packed, x, values, rows, slots):
        chain = self._register(packed)
        compute = torch.promote_types(x.dtype, torch.float32)
        x = x[:, 0].to(compute)
        if self.layer > self.base:  # closed loop: against the previous layer's reconstruction of these tokens
            x = x - self.chain_sum(chain, self.layer - 1, rows, slots, compute)
        z = x if self.u is None else x @ self._u(compute)
        if self.bits == 16:
            packed["v_raw"][rows, :, slots] = z[:, None].to(RAW_DTYPE)
        else:
            quantize_per_token_into(z[:, None], self.bits, self.group_channels, packed["v_codes"],
                                    packed["v_scale"], packed["v_zero"], rows, slots)

    # ---- read -------------------------------------------------------------------------------------------------------
    def read(self, packed, row: int, dtype=torch.float32, rotate: bool = True):
        chain = self._register(packed)
        t = packed.length(row)
        device = packed.lengths.device
        # the previous layer's reconstruction of this row, when it read the same tokens (slots below a row's length
        # never change, so the entry stays valid across steps until the row flushes): one term to add, not a walk
        # from the base (O(layers) per step instead of O(layers^2))
        last = packed.shared.state(XQuantChain).last
        found = last.get(row)
        if self.layer > self.base and found is not None and found[:3] == (self.layer - 1, t, dtype):
            rows = torch.full((t,), row, dtype=torch.int64, device=device)
            acc = found[3].to(device) + self._entries(packed, rows, torch.arange(t, device=device), dtype)
        else:
            rows = torch.full((t,), row, dtype=torch.int64, device=device)
            acc = self.chain_sum(chain, self.layer, rows, torch.arange(t, device=device), dtype)
        last[row] = (self.layer, t, dtype, acc)
        k = acc @ self.w_k.to(dtype).T
        v = acc @ self.w_v.to(dtype).T
        if self.b_k is not None:
            k, v = k + self.b_k.to(dtype), v + self.b_v.to(dtype)
        heads, dim = packed.heads, packed.dim
        k = k.view(-1, heads, dim).transpose(0, 1)
        v = v.view(-1, heads, dim).transpose(0, 1)
        return (packed.rotate_keys(k, dtype) if rotate else k), v

    # ---- attend (CUDA) ----------------------------------------------------------------------------------------------
    def _chain_x(self, packed, dtype) -> torch.Tensor:
        """X^ of this layer at every slot: the previous layer's of this step plus this layer's term (the base: its
        term; a layer whose predecessor has not run this step: the walk from the base)."""
        chain = self._register(packed)
        steps = packed.shared.state(XQuantChain).step
        prev = steps.get(self.layer - 1) if self.layer > self.base else None
        term = self.slot_terms(packed, dtype)
        if self.layer == self.base:
            acc = term
        elif prev is not None and prev.shape == term.shape and prev.dtype == dtype:
            acc = prev.to(term.device) + term  # a model split over devices: the previous layer's X^ moves
        else:
            acc = term
            for j in range(self.layer - 1, self.base - 1, -1):
                storage, below = chain[j]
                acc = acc + storage.slot_terms(below, dtype).to(acc.device)
        steps.clear()
        if self.layer < max(chain):  # the last cross-layer layer's X^ is never read: not kept between steps
            steps[self.layer] = acc
        return acc

    def fill_synthetic(self, packed, generator):
        """Random codes, scales and zeros (Storage's); unbound (a benchmark without the model's prefill) it gets random
        weights of the layer's shapes, as variant x does."""
        if self._x is None:
            from kvcal.models.adapter import KVProjection

            shape = (packed.heads * packed.dim, self.hidden)
            w_k, w_v = (torch.randn(shape, generator=generator, device=generator.device) / self.hidden**0.5
                        for _ in range(2))
            self.bind(KVProjection(w_k, None, w_v, None, False))
        super().fill_synthetic(packed, generator)

    def supports_triton(self, q, packed):
        if self._x is None:
            return "xquant cross-layer storage not bound to its layer's weights"
        return xquant_kernels.unsupported(self._x, q, dataclasses.replace(packed, buffers={}))

    def attend_triton(self, q, packed, scale, fp, **knobs):
        x_hat = self._chain_x(packed, torch.float64 if q.dtype == torch.float64 else torch.float32)
        view = dataclasses.replace(packed, buffers={"v_raw": x_hat[:, None]})
        return xquant_kernels.attend_triton(self._x, q, view, scale, fp, **knobs)



class XQuantMath:
    """The model's XQuant setting, factors and layer plan: the simulation's rematerialization of each layer's K and V
    from fake-quantized X or SVD latents of it, which every XQuant storage of that layer answers with
    (`rematerialize`), and the storages themselves (`storages`)."""

    def __init__(self, method: Method, tensors: dict[str, torch.Tensor], dims):
        self.method = method
        self.policy = FlushPolicy(residual=method.residual, block=method.group_tokens)
        self.plan = method.layer_plan(dims.num_layers)
        self.factors = {name: t.to(torch.float32) for name, t in tensors.items() if t.is_floating_point()}
        self.family, self.hidden = dims.family, dims.hidden_size
        self.qk_norm = getattr(dims, "qk_norm", dims.family == "qwen3")

    def ablation(self) -> str | None:
        """Why this setting has no packed storage (an ablation kept as its reconstruction), or None."""
        m = self.method
        if m.cross_layer and m.delta_axis != "token":
            return "xquant cross-layer deltas per channel (an ablation)"
        if m.cross_layer and not m.closed_loop:
            return "xquant open-loop cross-layer deltas (an ablation)"
        if m.variant == "kv":
            return "xquant variant kv (the KIVI* baseline; kvcal's kivi method has a packed storage)"
        if self.qk_norm:
            return (f"xquant on {self.family} (the packed storage cannot rebuild keys through its k_norm: "
                    "Qwen3, Gemma 3, OLMo 2)")
        return None

    def storages(self, num_layers: int) -> Storages:
        why = self.ablation()
        if why:
            return Storages(XQuantReconstruction(self, layer, why) for layer in range(num_layers))
        return Storages(self._storage(layer) for layer in range(num_layers))

    def _storage(self, layer: int) -> Storage:
        m = self.method
        role, bits = self.plan[layer]
        if role != PLAIN:
            latent = m.variant == "svd" and (role == DELTA or m.base_repr == "latent")
            u = None
            if latent:
                key = f"layers.{layer}.x.U"
                if key not in self.factors:
                    raise KvcalError(f"xquant artifact has no tensor {key}: recalibrate (kvcal calibrate --method "
                                     "xquant)")
                u = self.factors[key].float()
            storage = XQuantChainStorage(layer, m.base_layer, bits, m.group_tokens, m.group_channels, m.residual,
                                         self.hidden, u)
        else:
            factors = {}
            if m.variant == "svd":
                for name in ("k.U", "k.R", "v.U", "v.R"):
                    key = f"layers.{layer}.{name}"
                    if key not in self.factors:
                        raise KvcalError(f"xquant artifact has no tensor {key}: recalibrate (kvcal calibrate "
                                         "--method xquant)")
                    factors[name] = self.factors[key].float()
            storage = XQuantStorage(m.variant, bits, m.group_tokens, m.group_channels, m.residual, factors,
                                    m.outlier_channel, self.hidden)
        storage.math, storage.layer = self, layer
        return storage

    def _factor(self, layer: int, name: str, like: torch.Tensor) -> torch.Tensor:
        key = f"layers.{layer}.{name}"
        if key not in self.factors:
            raise KvcalError(f"xquant artifact has no tensor {key}: recalibrate (kvcal calibrate --method xquant)")
        t = self.factors[key]
        if t.device != like.device or t.dtype != like.dtype:
            t = self.factors[key] = t.to(device=like.device, dtype=like.dtype)
        return t

    def _per_token(self, t: torch.Tensor, bits: int) -> torch.Tensor:  # t [B, T, C]
        return _quantize(t, bits, -1, self.method.group_channels)

    def _per_channel(self, t: torch.Tensor, bits: int) -> torch.Tensor:  # t [B, T, C]: groups along the tokens
        return _quantize(t, bits, 1, self.method.group_tokens)

    def _plain(self, layer: int, x: torch.Tensor, bits: int, proj):
        m = self.method
        if m.variant == "kv":  # KIVI*: K per channel (before RoPE), V per token, from the exact projections
            k, v = proj.project(x)
            b, h, t, d = k.shape
            flat = [y.transpose(1, 2).reshape(b, t, h * d).to(x.dtype) for y in (k, v)]
            k_hat, v_hat = self._per_channel(flat[0], bits), self._per_token(flat[1], bits)
            return tuple(y.reshape(b, t, h, d).transpose(1, 2) for y in (k_hat, v_hat))
        if m.variant == "x":
            return proj.project(self._per_token(x, bits))
        z_k_hat, z_v_hat = self.latents(layer, x, bits)
        # K = Z_k R_k, V = Z_v R_v (the packed storage computes the same products)
        return proj.finish(z_k_hat @ self._factor(layer, "k.R", x), z_v_hat @ self._factor(layer, "v.R", x))

    def latents(self, layer: int, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The svd variant's reconstructed latents Z_k = X U_k (per channel) and Z_v = X U_v (per token)."""
        u_k, u_v = self._factor(layer, "k.U", x), self._factor(layer, "v.U", x)
        z_k = x @ u_k
        z_k_hat = self._per_channel(z_k, bits)
        if self.method.outlier_channel:  # App. B: latent channel 0 of X U_k (the largest singular value) in fp16
            z_k_hat[..., :1] = _quantize(z_k[..., :1], 16, 1, 1)
        return z_k_hat, self._per_token(x @ u_v, bits)

    def _seed(self, layer: int, x: torch.Tensor, bits: int) -> torch.Tensor:
        """The base layer's reconstruction: X at hp bits per token (rec §7.4 full_x), or its latent."""
        if self.method.variant == "svd" and self.method.base_repr == "latent":
            u = self._factor(layer, "x.U", x)
            return self._per_token(x @ u, bits) @ u.T
        return self._per_token(x, bits)

    def _delta(self, layer: int, delta: torch.Tensor, bits: int) -> torch.Tensor:
        quantize = self._per_token if self.method.delta_axis == "token" else self._per_channel
        if self.method.variant == "x":
            return quantize(delta, bits)
        u = self._factor(layer, "x.U", delta)  # [d, 2 d_kv]: only the part W_kv sees is kept
        return quantize(delta @ u, bits) @ u.T

    def rematerialize(self, layer, x, proj, state):
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        role, bits = self.plan[layer]
        if role == PLAIN:
            return self._plain(layer, x, bits, proj)
        if role == BASE:
            acc = self._seed(layer, x, bits)
        else:
            if state.get("layer") != layer - 1 or state["acc"].shape != x.shape:
                raise RuntimeError(f"xquant layer {layer}: the cross-layer state does not come from layer {layer - 1} "
                                   "of the same tokens (layers must see every span in order)")
            # the previous layer may sit on another device (a split model): its state comes to this one's
            reference = (state["acc"] if self.method.closed_loop else state["exact"]).to(x.device)
            acc = state["acc"].to(x.device) + self._delta(layer, x - reference, bits)
        state.update(layer=layer, acc=acc, exact=x)
        return proj.project(acc)


class XQuantReconstruction(Rematerialized, ReconstructionStorage):
    """An XQuant ablation the packed storages do not hold (the KIVI* baseline, open-loop or per-channel deltas, Qwen3):
    each span's rematerialized keys and values kept as they are."""

    keys_pre_rope = True
    source = "x"

    def __init__(self, math: XQuantMath, layer: int, why: str):
        super().__init__()
        self.math, self.layer, self.policy = math, layer, math.policy
        self.refusal = f"{why} kept as its reconstruction (torch only)"
