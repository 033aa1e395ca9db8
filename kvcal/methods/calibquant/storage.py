"""CalibQuant's storages (the method: kvcal/methods/calibquant/method.py), and the numerics both use:
channel-wise min/max ranges shrunk by c, uniform codes with float32 step and minimum, post-scaled scores and
outputs ([P] Eq. 6), the score remap ([P] Eq. 7). Sources as in method.py: [P] the paper, [C] the authors' code, [D]
the digest (papers/calibquant.md), its §7 item N as "§7.N".

Packed runtime (§5; `CalibQuantStorage`, kernels in kvcal/methods/calibquant/kernels.py): codes packed at their width
(int32 words of kvcal/quant/packing.py), float32 step and minimum per (row, KV head, range group, channel) for K and
V; decode attention post-scaled and remapped in two passes (pass 1 the score min/max per query head, pass 2 the
remapped split-K partials and the full-precision part). With group_tokens 0 the cache runs the paper's regime
(FlushPolicy.bulk): prefill in full precision, the prompt's tokens after `sink` compressed once as one range group,
every generated token kept in full precision. The v_ranges ablations keep their reconstruction
(`CalibQuantReconstruction`, torch only).
"""

from __future__ import annotations

import math

import torch

from kvcal.errors import KvcalError
from kvcal.methods.base import FlushPolicy
from kvcal.methods.calibquant import kernels as calibquant_kernels
from kvcal.quant.packing import pack_codes, unpack_codes, words_per_vector
from kvcal.runtime.decode import LOG2E, SOFTCAP_REFUSAL, Partials, with_fp_reference
from kvcal.runtime.storage import BufferSpec, ReconstructionStorage, Storage

STAT_BYTES = 4  # fp32 step and minimum per range (§7.14)
SCORE_EPS = 1e-8  # [C] in g's denominator
STEP_FLOOR = 1e-6  # §7.9
BULK_ONLY = ("calibquant group_tokens=0 takes its ranges over the whole compressed block (the paper): evaluate it with "
             "--protocol tail (simulate, or decode through the cache), or set group_tokens (e.g. --set "
             "group_tokens=128) for the gptq/prefill-decode simulations")


# ---- numerics (the simulation's, and the packed storage's torch reference) -------------------------------------------
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


# ---- what every CalibQuant storage shares: its settings, the simulation's reconstruction and the remap ------------
class CalibQuantMath:
    """Range groups of `group` tokens (0: one group over the whole span, the bulk regime), per-channel K ranges and
    `v_ranges` V ranges shrunk by k_scale / v_scale, and the score remap with this layer's taus (tau1, tau2 [Hq];
    None: no remap). `sim_rows` / `sim_clamps` count the simulation's remapped query rows and clamped slopes."""

    def setup(self, bits, group, sink, k_scale, v_scale, taus, fp_window, v_ranges="channel"):
        self.bits, self.group, self.v_ranges = bits, group, v_ranges
        self.k_scale, self.v_scale = k_scale, v_scale
        # group_tokens 0 (the paper's regime): the prompt's tokens after the sinks are compressed once, as one range
        # group, after the prefill; later tokens stay full precision (FlushPolicy.bulk)
        self.policy = (FlushPolicy(sink=sink, residual=fp_window, block=group) if group
                       else FlushPolicy(sink=sink, residual=fp_window, bulk=True))
        self.bulk_only = "" if group else BULK_ONLY
        self.taus = None if taus is None else tuple(t.to(torch.float32).contiguous() for t in taus)
        self.remaps_scores = self.taus is not None
        self.counts = torch.zeros(2, dtype=torch.int64)
        self.sim_rows = self.sim_clamps = 0

    def reconstruct(self, k, v):
        b, h, t, d = k.shape
        group = self.group or t
        if t % group:
            raise KvcalError(f"calibquant: {t} tokens are not a whole number of {group}-token groups")

        def per_group(x, axis, scale):
            y = fake_quantize(x.reshape(b, h, t // group, group, d), self.bits, axis, scale)
            return y.reshape(b, h, t, d).to(x.dtype)

        return per_group(k, "channel", self.k_scale), per_group(v, self.v_ranges, self.v_scale)

    def remap_scores(self, scores, compressed):
        if self.taus is None:
            return scores
        tau1, tau2 = (t.to(scores.device, scores.dtype)[None, :, None, None] for t in self.taus)
        out, rows, clamps = remap(scores, compressed, tau1, tau2)
        self.sim_rows += rows
        self.sim_clamps += clamps
        return out


# ---- packed storage ---------------------------------------------------------------------------------------------
class CalibQuantStorage(CalibQuantMath, Storage):
    """Key and value codes packed at their width, [B, Hkv, T, W] int32 (kvcal/quant/packing.py), with a float32 step
    and minimum per (row, KV head, range group, channel) for K and for V, [B, Hkv, NG, D]: one range group over a
    row's whole compressed span in the bulk regime (group_tokens 0: the paper's; NG = 1), else groups of G tokens
    (NG = T / G). Keys after RoPE. Decode attention is post-scaled (the codes are never dequantized) and remaps the
    compressed tokens' scores per query head (tau of this layer) before the softmax they share with the
    full-precision part; `counts` [2] (device, int64) adds up the query rows remapped and those whose slope was
    clamped at 0 (§7.10). Kernels: kvcal/methods/calibquant/kernels.py."""

    # its references and kernels read a row's ranges and remap from slot 0 on (Packed.first is not taken)
    window_refusal = ("remaps and scales the scores of a row's compressed tokens from its first slot on; the packed "
                      "cache does not window it (the simulation does)")

    def __init__(self, bits: int, group: int, sink: int, k_scale: float, v_scale: float,
                 taus: tuple[torch.Tensor, torch.Tensor] | None, fp_window: int = 0):
        self.setup(bits, group, sink, k_scale, v_scale, taus, fp_window)

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
        calibquant_kernels.write_triton(packed, keys, values, rows, slots, self.bits, self.group, self._run(rows),
                                        self.k_scale, self.v_scale)

    def _stats(self, packed, row: int, n: int, dtype):
        groups = (torch.arange(n, device=packed.lengths.device) // self.group if self.group
                  else torch.zeros(n, dtype=torch.int64, device=packed.lengths.device))
        return [packed[name][row][:, groups].to(dtype) for name in ("k_step", "k_min", "v_step", "v_min")]

    def _codes(self, packed, name: str, row: int, n: int, dtype):
        return unpack_codes(packed[name][row, :, :n], self.bits, packed.dim).to(dtype)

    def read(self, packed, row, dtype=torch.float32, rotate=True):
        n = packed.length(row)
        compute = torch.promote_types(dtype, torch.float32)
        k_step, k_min, v_step, v_min = self._stats(packed, row, n, compute)
        k = self._codes(packed, "k_codes", row, n, compute) * k_step + k_min
        v = self._codes(packed, "v_codes", row, n, compute) * v_step + v_min
        return k.to(dtype), v.to(dtype)

    def attend_reference(self, q, packed, scale, fp):
        """Post-scaled scores per range group ([P] Eq. 6), the remap over the row's compressed tokens (Eq. 7, the
        simulation's `remap`), softmax partials with post-scaled values; then the full-precision part's."""
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
            if self.remaps_scores:
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
        if self.remaps_scores:
            self.counts += torch.tensor([rows, clamps], dtype=torch.int64, device=self.counts.device)
        return with_fp_reference(parts, q, fp, scale)

    def supports_triton(self, q, packed):
        if packed.softcap is not None:
            return SOFTCAP_REFUSAL
        return calibquant_kernels.unsupported(q, packed, self.bits, self.group)

    def attend_triton(self, q, packed, scale, fp, **knobs):
        tau1, tau2 = self.taus if self.remaps_scores else (None, None)
        return calibquant_kernels.attend_triton(q, packed, scale, fp, self.bits, self.group, self.remaps_scores, tau1, tau2,
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


# ---- ablation ---------------------------------------------------------------------------------------------------
class CalibQuantReconstruction(CalibQuantMath, ReconstructionStorage):
    """A v_ranges ablation (token-wise or global V ranges), which the packed storage does not hold: its
    reconstruction kept as is, the remap applied to its scores."""

    refusal = ("a calibquant v_ranges ablation (the packed storage keeps channel-wise V ranges only) kept as its "
               "reconstruction (torch only)")

    def __init__(self, bits: int, group: int, sink: int, k_scale: float, v_scale: float,
                 taus: tuple[torch.Tensor, torch.Tensor] | None, fp_window: int, v_ranges: str):
        ReconstructionStorage.__init__(self)
        self.setup(bits, group, sink, k_scale, v_scale, taus, fp_window, v_ranges)


def remap_counts(storages) -> tuple[int, int]:
    """(query rows remapped, rows whose slope was clamped at 0) by the simulation's remaps of these storages."""
    return sum(s.sim_rows for s in set(storages)), sum(s.sim_clamps for s in set(storages))


def cache_counts(storages) -> tuple[int, int]:
    """(query rows remapped, rows whose slope was clamped at 0) by the packed storages' attention."""
    totals = [0, 0]
    for storage in set(storages):
        totals = [a + int(b) for a, b in zip(totals, storage.counts.tolist())]
    return totals[0], totals[1]
