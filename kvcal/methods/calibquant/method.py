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
  the whole block) the codec compresses whatever block it is given as one group; the simulation runs it under the
  tail protocol only (Codec.bulk_only refuses the gptq one), and the cache runs the paper's regime
  (FlushPolicy.bulk: the prompt after `sink` tokens compressed once, generated tokens kept in full precision; the
  decode-mode tail protocol). `group_tokens` G > 0 takes the ranges over aligned groups of G tokens after `sink`
  full-precision tokens instead (a deviation that gives a token-by-token flush rule: the gptq protocol).
- Ablations (§8.2): `v_ranges` token (KIVI-style per-token V, min/max over the head's channels) or global (one range
  per head over the block), `calibration` false, `k_range_scale`/`v_range_scale` 1.0 (pure paper), a fixed tau.

Packed runtime (§5; `CalibQuantStorage`, kernels in kvcal/methods/calibquant/kernels.py): codes packed at their width
(int32 words of kvcal/quant/packing.py), float32 step and minimum per (row, KV head, range group, channel) for K and
V; decode attention post-scaled and remapped in two passes (pass 1 the score min/max per query head, pass 2 the
remapped split-K partials and the full-precision part). With group_tokens 0 the cache runs the paper's regime
(FlushPolicy.bulk): prefill in full precision, the prompt's tokens after `sink` compressed once as one range group,
every generated token kept in full precision. The v_ranges ablations have no packed storage (the simulation runs
them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcal.accounting import fp16_token_bytes
from kvcal.errors import KvcalError
from kvcal.methods.base import Codec, FlushPolicy, Method
from kvcal.methods.registry import register
from kvcal.quant.packing import pack_codes, unpack_codes, words_per_vector
from kvcal.runtime.storage import BufferSpec, Storage

SUPPORTED_BITS = (1, 2, 4, 8)  # [P]
V_RANGES = ("channel", "token", "global")
CODE_RANGE_SCALE = {"k": 0.5, "v": 0.3}  # [C] at 1 bit; 1.0 at other widths
STAT_BYTES = 4  # fp32 step and minimum per range (§7.14)
SCORE_EPS = 1e-8  # [C] in g's denominator
STEP_FLOOR = 1e-6  # §7.9


def parse_grid(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise KvcalError(f"calibquant tau_grid must be comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 or v != v for v in values):
        raise KvcalError(f"calibquant tau_grid must hold numbers >= 0, got {text!r}")
    return values


# ---- numerics (also the reference of a future packed runtime) -----------------------------------------------------
def ranges(x: torch.Tensor, axis: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., T, D] one group of tokens -> (alpha', beta') broadcastable to x: min/max over the tokens per channel
    ("channel", [P] Eq. 5), over the channels per token ("token", KIVI's V) or over both ("global"), times `scale`
    (toward 0, [C] §7.5)."""
    dims = {"channel": (-2,), "token": (-1,), "global": (-2, -1)}[axis]
    return x.amin(dim=dims, keepdim=True) * scale, x.amax(dim=dims, keepdim=True) * scale


def quantize(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, bits: int):
    """-> (codes (float, integers in [0, 2^b - 1]), step, minimum) of x in [alpha, beta] ([P] Eq. 3; degenerate ranges
    get the step floor of §7.9). Step and minimum are rounded to float32, what the packed cache stores (§7.14), and
    the codes come from the rounded values (in x's precision): for float32 and narrower inputs nothing changes, and a
    float64 simulation reconstructs exactly what the packed cache holds."""
    levels = 2**bits - 1
    step = (beta - alpha) / levels
    floor = STEP_FLOOR * torch.maximum(torch.maximum(alpha.abs(), beta.abs()), torch.ones_like(alpha))
    step = torch.maximum(step, floor).to(torch.float32).to(x.dtype)
    minimum = alpha.to(torch.float32).to(x.dtype)
    codes = torch.round(torch.clamp((x - minimum) / step, 0, levels))  # torch.round: half to even [C] §7.12
    return codes, step, minimum


def fake_quantize(x: torch.Tensor, bits: int, axis: str, scale: float) -> torch.Tensor:
    """Quantize and dequantize one group x [..., T, D] ([P] Eq. 4) in at least float32."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    alpha, beta = ranges(x32, axis, scale)
    codes, step, minimum = quantize(x32, alpha, beta, bits)
    return codes * step + minimum


def post_scaled_scores(q: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """[P] Eq. 6: q [..., Tq, D], codes [..., n, D], per-channel step/minimum [..., 1, D] -> the scores
    q . k_hat * scale [..., Tq, n] without building k_hat: (q * s) codes^T + q . alpha."""
    return ((q * step) @ codes.transpose(-1, -2) + (q * minimum).sum(-1, keepdim=True)) * scale


def post_scaled_output(w: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """§2.4: weights w [..., Tq, n] over the block, codes [..., n, D], per-channel step/minimum [..., 1, D] ->
    w V_hat [..., Tq, D] = (w codes) * s + (sum w) alpha."""
    return (w @ codes) * step + w.sum(-1, keepdim=True) * minimum


def remap(scores: torch.Tensor, compressed: torch.Tensor, tau1: torch.Tensor, tau2: torch.Tensor):
    """[P] Eq. 7 with [C]'s epsilon and §7.10's slope clamp. scores [B, H, Tq, Tk], compressed bool broadcastable,
    tau1/tau2 broadcastable to [B, H, Tq, 1]. -> (remapped scores, rows with compressed keys, rows whose slope was
    clamped at 0). gamma and delta are per query row over its compressed keys (§7.2)."""
    compressed = compressed.expand_as(scores)
    has = compressed.any(-1, keepdim=True)
    inf = torch.tensor(float("inf"), dtype=scores.dtype, device=scores.device)
    gamma = torch.where(compressed, scores, inf).amin(-1, keepdim=True)
    delta = torch.where(compressed, scores, -inf).amax(-1, keepdim=True)
    gamma, delta = torch.where(has, gamma, 0), torch.where(has, delta, 0)
    slope = (delta - gamma + tau1 - tau2) / (delta - gamma + SCORE_EPS)
    clamped = (slope < 0) & has
    g = slope.clamp_min(0) * (scores - gamma) + gamma - tau1
    return torch.where(compressed, g, scores), int(has.sum()), int(clamped.sum())


# ---- packed storage ---------------------------------------------------------------------------------------------
class CalibQuantStorage(Storage):
    """Key and value codes packed at their width, [B, Hkv, T, W] int32 (kvcal/quant/packing.py), with a float32 step
    and minimum per (row, KV head, range group, channel) for K and for V, [B, Hkv, NG, D]: one range group over a
    row's whole compressed span in the bulk regime (group_tokens 0: the paper's; NG = 1), else groups of G tokens
    (NG = T / G). Keys after RoPE. Decode attention is post-scaled (the codes are never dequantized) and remaps the
    compressed tokens' scores per query head (tau of this layer) before the softmax they share with the
    full-precision part; `counts` [2] (device, int64) adds up the query rows remapped and those whose slope was
    clamped at 0 (§7.10). Kernels: kvcal/methods/calibquant/kernels.py."""

    def __init__(self, bits: int, group: int, sink: int, k_scale: float, v_scale: float,
                 taus: tuple[torch.Tensor, torch.Tensor] | None, fp_window: int = 0):
        self.bits, self.group = bits, group
        self.k_scale, self.v_scale = k_scale, v_scale
        self.policy = (FlushPolicy(sink=sink, residual=fp_window, block=group) if group
                       else FlushPolicy(sink=sink, residual=fp_window, bulk=True))
        self.taus = None if taus is None else tuple(t.to(torch.float32).contiguous() for t in taus)
        self.counts = torch.zeros(2, dtype=torch.int64)

    @property
    def remaps(self) -> bool:
        return self.taus is not None

    def to(self, device):
        if self.counts.device != torch.device(device):
            self.counts = self.counts.to(device)
            if self.taus is not None:
                self.taus = tuple(t.to(device) for t in self.taus)
        return self

    def buffers(self, batch, capacity, heads, dim):
        codes = BufferSpec((batch, heads, capacity, words_per_vector(dim, self.bits)), torch.int32, 2)
        stats = BufferSpec((batch, heads, capacity // self.group if self.group else 1, dim), torch.float32, 2)
        return {"k_codes": codes, "v_codes": codes, "k_step": stats, "k_min": stats, "v_step": stats,
                "v_min": stats}

    def bytes_per_token(self, heads: int, dim: int) -> float:
        """Codes, plus the ranges shared by a group's tokens (none per token in the bulk regime: one range per
        row's span)."""
        codes = 2 * heads * words_per_vector(dim, self.bits) * 4
        return codes + (4 * heads * dim * STAT_BYTES / self.group if self.group else 0.0)

    def _run(self, rows: torch.Tensor) -> int:
        """Tokens per run of one row's consecutive slots in a write: a group, or (bulk) a row's whole span."""
        if self.group:
            return self.group
        count = rows.shape[0]
        runs = int((rows[1:] != rows[:-1]).sum()) + 1 if count else 1
        if count % runs:
            raise KvcalError("calibquant bulk write: the rows' spans differ in length in one write")
        return count // runs

    def write_reference(self, packed, keys, values, rows, slots):
        run = self._run(rows)
        count, heads, dim = keys.shape
        first = slice(None, None, run)
        block_rows = rows[first]
        groups = slots[first] // self.group if self.group else torch.zeros_like(slots[first])
        for x, scale, name in ((keys, self.k_scale, "k"), (values, self.v_scale, "v")):
            x32 = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(count // run, run, heads, dim)
            alpha, beta = ranges(x32.transpose(1, 2), "channel", scale)  # [R, H, 1, D]
            codes, step, minimum = quantize(x32.transpose(1, 2), alpha, beta, self.bits)
            packed[f"{name}_step"][block_rows, :, groups] = step[:, :, 0].to(torch.float32)
            packed[f"{name}_min"][block_rows, :, groups] = minimum[:, :, 0].to(torch.float32)
            packed[f"{name}_codes"][rows, :, slots] = pack_codes(codes.transpose(1, 2).reshape(count, heads, dim),
                                                                 self.bits)

    def write_triton(self, packed, keys, values, rows, slots):
        from kvcal.methods.calibquant.method import kernels as calibquant_kernels

        calibquant_kernels.write_triton(packed, keys, values, rows, slots, self.bits, self.group, self._run(rows),
                                        self.k_scale, self.v_scale)

    def _stats(self, packed, row: int, n: int, dtype):
        groups = (torch.arange(n, device=packed.lengths.device) // self.group if self.group
                  else torch.zeros(n, dtype=torch.int64, device=packed.lengths.device))
        return [packed[name][row][:, groups].to(dtype) for name in ("k_step", "k_min", "v_step", "v_min")]

    def _codes(self, packed, name: str, row: int, n: int, dtype):
        return unpack_codes(packed[name][row, :, :n], self.bits, packed.dim).to(dtype)

    def read(self, packed, row, dtype=torch.float32, rotate=True):
        n = int(packed.lengths[row])
        compute = torch.promote_types(dtype, torch.float32)
        k_step, k_min, v_step, v_min = self._stats(packed, row, n, compute)
        k = self._codes(packed, "k_codes", row, n, compute) * k_step + k_min
        v = self._codes(packed, "v_codes", row, n, compute) * v_step + v_min
        return k.to(dtype), v.to(dtype)

    def attend_reference(self, q, packed, scale, fp):
        """Post-scaled scores per range group ([P] Eq. 6), the remap over the row's compressed tokens (Eq. 7, the
        simulation's `remap`), softmax partials with post-scaled values; then the full-precision part's."""
        from kvcal.runtime.decode import LOG2E, Partials, with_fp_reference

        batch, hq, dim = q.shape
        heads = packed.heads
        group = hq // heads
        parts = Partials.empty(batch * heads, 1, group, dim, q.dtype, q.device)
        compute = parts.m.dtype
        parts.m.fill_(-math.inf)
        parts.l.zero_()
        parts.acc.zero_()
        rows = clamps = 0
        for b in range(batch):
            n = int(packed.lengths[b])
            if n == 0:
                continue
            qg = q[b].to(compute).reshape(heads, group, dim)
            kc, vc = (self._codes(packed, name, b, n, compute) for name in ("k_codes", "v_codes"))
            spans = range(0, n, self.group) if self.group else [0]
            stats = [(packed["k_step"][b, :, j // self.group if self.group else 0, None].to(compute),
                      packed["k_min"][b, :, j // self.group if self.group else 0, None].to(compute),
                      packed["v_step"][b, :, j // self.group if self.group else 0, None].to(compute),
                      packed["v_min"][b, :, j // self.group if self.group else 0, None].to(compute),
                      slice(j, min(n, j + self.group) if self.group else n)) for j in spans]
            x = torch.cat([post_scaled_scores(qg, kc[:, t], ks, km, scale) for ks, km, _, _, t in stats], -1)
            if self.remaps:
                tau1, tau2 = (t[:hq].to(q.device, compute).reshape(heads, group)[None, :, :, None] for t in self.taus)
                scores, r, c = remap(x[None], torch.ones((), dtype=torch.bool, device=q.device), tau1, tau2)
                x, rows, clamps = scores[0], rows + r, clamps + c
            s = x * LOG2E
            m = s.amax(-1)
            p = torch.exp2(s - m[..., None])  # [H, G, n]
            at = slice(b * heads, (b + 1) * heads)
            parts.m[at, 0] = m
            parts.l[at, 0] = p.sum(-1)
            parts.acc[at, 0] = sum(post_scaled_output(p[:, :, t], vc[:, t], vs, vm) for _, _, vs, vm, t in stats)
        if self.remaps:
            self.counts += torch.tensor([rows, clamps], dtype=torch.int64, device=self.counts.device)
        return with_fp_reference(parts, q, fp, scale)

    def supports_triton(self, q, packed):
        from kvcal.methods.calibquant.method import kernels as calibquant_kernels

        return calibquant_kernels.unsupported(q, packed, self.bits, self.group)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        from kvcal.methods.calibquant.method import kernels as calibquant_kernels

        tau1, tau2 = self.taus if self.remaps else (None, None)
        return calibquant_kernels.attend_triton(q, packed, scale, fp, self.bits, self.group, self.remaps, tau1, tau2,
                                                self.counts, **knobs)

    def fill_synthetic(self, packed, generator):
        """Random codes, steps in [0.01, 0.05) and minima in [-0.05, -0.01) (a step times the largest code then spans
        both signs, as real ranges do)."""
        for name, t in packed.buffers.items():
            if name.endswith("_codes"):
                t.random_(generator=generator)
            elif name.endswith("_step"):
                t.uniform_(0.01, 0.05, generator=generator)
            else:
                t.uniform_(-0.05, -0.01, generator=generator)


# ---- codec ------------------------------------------------------------------------------------------------------
BULK_ONLY = ("calibquant group_tokens=0 takes its ranges over the whole compressed block (the paper): evaluate it with "
             "--protocol tail (simulate, or decode through the cache), or set group_tokens (e.g. --set "
             "group_tokens=128) for the gptq/prefill-decode simulations")


class CalibQuantCodec(Codec):
    """Reconstructs K (after RoPE) and V of each group of tokens; remaps the compressed keys' scores."""

    def __init__(self, method: CalibQuant, taus: list[tuple[torch.Tensor, torch.Tensor]] | None):
        self.method = method
        self.bits = method.bits
        self.group = method.group_tokens
        self.k_scale, self.v_scale = method.range_scales()
        # group_tokens 0 (the paper's regime): the prompt's tokens after the sinks are compressed once, as one range
        # group, after the prefill; later tokens stay full precision (FlushPolicy.bulk)
        self.policy = (FlushPolicy(sink=method.sink, residual=method.fp_window, block=self.group) if self.group
                       else FlushPolicy(sink=method.sink, residual=method.fp_window, bulk=True))
        self.remaps_scores = method.remap_on()
        self.taus = taus  # per layer (tau1 [Hq], tau2 [Hq])
        if self.group == 0:
            self.bulk_only = BULK_ONLY
        self.rows = 0  # query rows remapped (the simulation; the packed cache counts in its storages)
        self.slope_clamps = 0  # of them, rows whose slope was clamped at 0 (§7.10)
        self._storages: dict[int, CalibQuantStorage] = {}

    def storage(self, layer: int):
        if self.method.v_ranges != "channel":
            return None
        if layer not in self._storages:
            taus = self.taus[layer] if self.remaps_scores else None
            self._storages[layer] = CalibQuantStorage(self.bits, self.group, self.method.sink, self.k_scale,
                                                      self.v_scale, taus, self.method.fp_window)
        return self._storages[layer]

    def storage_refusal(self) -> str:
        return (f"calibquant v_ranges={self.method.v_ranges} (an ablation) has no packed storage: the packed cache "
                "keeps channel-wise V ranges only (use --mode simulate)")

    def cache_counts(self) -> tuple[int, int]:
        """(query rows remapped, rows whose slope was clamped at 0) by the packed storages' attention."""
        totals = [0, 0]
        for storage in self._storages.values():
            totals = [a + int(b) for a, b in zip(totals, storage.counts.tolist())]
        return totals[0], totals[1]

    def reconstruct(self, layer, k, v):
        b, h, t, d = k.shape
        group = self.group or t
        if t % group:
            raise KvcalError(f"calibquant: {t} tokens are not a whole number of {group}-token groups")

        def per_group(x, axis, scale):
            y = fake_quantize(x.reshape(b, h, t // group, group, d), self.bits, axis, scale)
            return y.reshape(b, h, t, d).to(x.dtype)

        return per_group(k, "channel", self.k_scale), per_group(v, self.method.v_ranges, self.v_scale)

    def remap_scores(self, layer, scores, compressed):
        if not self.remaps_scores:
            return scores
        tau1, tau2 = (t.to(scores.device, scores.dtype)[None, :, None, None] for t in self.taus[layer])
        out, rows, clamps = remap(scores, compressed, tau1, tau2)
        self.rows += rows
        self.slope_clamps += clamps
        return out


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
            if self.tau1 < 0 or self.tau2 < 0:
                raise KvcalError(f"calibquant tau1 and tau2 must be >= 0, got {self.tau1}, {self.tau2}")
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

    # ---- codec ----------------------------------------------------------------------------------------------------
    def codec_with_tau(self, dims, tau1: float, tau2: float) -> CalibQuantCodec:
        one = (torch.full((dims.num_heads,), float(tau1)), torch.full((dims.num_heads,), float(tau2)))
        return CalibQuantCodec(self, [one] * dims.num_layers)

    def build_codec(self, tensors, dims) -> Codec:
        self.check_model(dims)
        if not self.remap_on():
            return CalibQuantCodec(self, None)
        if self.tau1 is not None and not tensors:
            return self.codec_with_tau(dims, self.tau1, self.tau2)
        names = [(f"layers.{i}.k.tau1", f"layers.{i}.k.tau2") for i in range(dims.num_layers)]
        missing = [n for pair in names for n in pair if n not in tensors]
        if missing:
            raise KvcalError(f"calibquant needs its calibrated tau ({missing[0]} is missing): run `kvcal calibrate "
                             "--method calibquant` and pass the artifact with --artifact, or set tau1 and tau2")
        taus = [(tensors[a].to(torch.float32), tensors[b].to(torch.float32)) for a, b in names]
        if any(t.shape != (dims.num_heads,) for pair in taus for t in pair):
            raise KvcalError(f"calibquant tau tensors must have one value per query head ({dims.num_heads})")
        return CalibQuantCodec(self, taus)

    # ---- calibration: the tau grid search ---------------------------------------------------------------------
    def layout(self, seqlen: int) -> tuple[int, int]:
        """The tail protocol's (prefix, block) on calibration windows of `seqlen` (its defaults; the block rounded
        down to whole groups)."""
        from kvcal.eval.simulate import tail_layout

        prefix, block = tail_layout(seqlen)
        if self.group_tokens:
            block -= block % self.group_tokens
            if block == 0:
                raise KvcalError(f"calibquant: calibration windows of {seqlen} tokens hold no {self.group_tokens}-token "
                                 "group in the tail protocol's block: use a longer --seqlen")
        return prefix, block

    def tail_nll(self, loaded, codec, windows, prefix: int, block: int) -> float:
        """Mean NLL per scored target of the windows under the tail protocol."""
        from kvcal.eval.ppl import simulated_nll

        total = simulated_nll(loaded, codec, windows, "tail", prefix + block, prefix_len=prefix)
        return total.nll / total.tokens

    def calibrate(self, loaded, store):
        from kvcal.methods.fp16.method import LosslessCodec
        from kvcal.progress import progress_bar

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
            codec = self.codec_with_tau(dims, self.tau1, self.tau2)
            info["tau"] = {"tau1": self.tau1, "tau2": self.tau2, "source": "config (no search)"}
        else:
            windows = getattr(store, "windows", None)
            if windows is None:
                raise KvcalError("calibquant's tau search needs calibration windows (kvcal calibrate passes them)")
            prefix, block = self.layout(windows.shape[1])
            grid = parse_grid(self.tau_grid)
            table = torch.zeros(len(grid), len(grid), dtype=torch.float64)
            clamped = torch.zeros_like(table)
            with progress_bar(f"calibquant tau grid ({len(grid)}x{len(grid)})", len(grid) ** 2 + 2) as advance:
                for i, t1 in enumerate(grid):
                    for j, t2 in enumerate(grid):
                        codec = self.codec_with_tau(dims, t1, t2)
                        table[i, j] = self.tail_nll(loaded, codec, windows, prefix, block)
                        clamped[i, j] = codec.slope_clamps / max(codec.rows, 1)
                        advance(1)
                uncalibrated = self.tail_nll(loaded, CalibQuantCodec(_without_remap(self), None), windows, prefix,
                                             block)
                advance(1)
                exact = self.tail_nll(loaded, LosslessCodec(), windows, prefix, block)
                advance(1)
            i, j = choose_tau(table, grid)
            codec = self.codec_with_tau(dims, grid[i], grid[j])
            info["tau"] = {"tau1": grid[i], "tau2": grid[j], "source": "grid search"}
            info["tau_search"] = {
                "objective": "mean NLL per scored target, tail protocol, calibration windows",
                "tau1_values": grid, "tau2_values": grid,
                "table": [[round(float(x), 6) for x in row] for row in table],  # rows tau1, columns tau2
                "slope_clamped_fraction": [[round(float(x), 6) for x in row] for row in clamped],
                "uncalibrated_nll": round(uncalibrated, 6), "fp16_nll": round(exact, 6),
                "window_layout": {"prefix": prefix, "block": block, "tail": int(windows.shape[1]) - prefix - block},
                "windows": int(windows.shape[0]),
                "tie_break": "smaller tau2 - tau1, then smaller tau1",
            }
        tensors = {}
        for layer, (tau1, tau2) in enumerate(codec.taus):
            tensors[f"layers.{layer}.k.tau1"] = tau1.clone()
            tensors[f"layers.{layer}.k.tau2"] = tau2.clone()
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


def _without_remap(method: CalibQuant) -> CalibQuant:
    import dataclasses

    return dataclasses.replace(method, calibration=False, tau1=None, tau2=None)


def choose_tau(table: torch.Tensor, grid: list[float]) -> tuple[int, int]:
    """(i, j) of the smallest objective; ties toward smaller tau2 - tau1 (§7.1), then smaller tau1."""
    cells = [(float(table[i, j]), grid[j] - grid[i], grid[i], i, j) for i in range(len(grid)) for j in range(len(grid))]
    best = min(cells)
    return best[3], best[4]
