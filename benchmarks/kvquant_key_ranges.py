"""Why KVQuant's keys lose to KIVI's on smollm2: key-range variants (docs/results.md).

Why KVQuant's keys lose to KIVI's on smollm2 (CPU, gptq simulation, keys or values only): the
artifact's calibrated per-channel ranges vs each window's own percentiles (the paper's R9 oracle), a uniform
table on the same ranges, the nuq table on per-64-token min/max ranges, KIVI G64
values per token vs per head
with the artifact's table. Directions only (2 windows).

    python benchmarks/kvquant_key_ranges.py 2 4 > results/kvquant/key-ranges-cpu-2x2048-nuq4.log
    python benchmarks/kvquant_key_ranges.py 2 3 > results/kvquant/key-ranges-cpu-2x2048-nuq3.log
(arguments: windows, bits
needs the kvquant artifacts from benchmarks/kvquant_smollm2.sh and KVCAL_DATA_DIR)
"""

import os
import sys

import torch

from kvcal.artifact import load_artifact
from kvcal.data import load_eval_windows
from kvcal.eval.ppl import simulated_nll
from kvcal.methods.kvquant.calibrate import to_rows
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model
from kvcal.quant.nonuniform import (
    dequantize_lut_dynamic,
    dequantize_lut_static,
    quantile,
    quantize_lut_dynamic,
    quantize_lut_static,
    range_params,
)
from kvcal.recipes import resolve
from kvcal.runtime.storage import Storage, Storages


def from_rows(rows, heads):
    b, t, c = rows.shape
    return rows.reshape(b, t, heads, c // heads).transpose(1, 2)


def quantize_static(rows, lo, hi, encode, decode, sparse):
    """Per-channel nuq of token rows [B, T, C] with exact outliers (sparse) or clamped (the packed quantizers)."""
    x = rows.reshape(-1, 1, rows.shape[-1])
    bits = (encode.numel() - 1).bit_length()
    codes, idx, val = quantize_lut_static(x, lo, hi, encode, decode, bits, x.shape[-1] if sparse else 0, torch.float64)
    zero, scale = range_params(lo, hi)
    return dequantize_lut_static(codes, zero, scale, decode, bits, x.shape[-1], idx, val).reshape(rows.shape)


def quantize_dynamic(rows, encode, decode, per_side):
    x = rows.reshape(-1, 1, rows.shape[-1])
    bits = (encode.numel() - 1).bit_length()
    out = quantize_lut_dynamic(x, encode, decode, bits, per_side, residual_dtype=torch.float64)
    return dequantize_lut_dynamic(*out[:3], decode, bits, x.shape[-1], *out[3:]).reshape(rows.shape)

torch.set_num_threads(2)
ns = int(sys.argv[1]) if len(sys.argv) > 1 else 2
bits = sys.argv[2] if len(sys.argv) > 2 else "4"
loaded = load_model("smollm2-135m", "float32", "cpu")
text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), 2048, ns)
path = f"artifacts/smollm2-135m/kvquant-nuq{bits}-1pct.safetensors"
storages = storages_for_artifact(load_artifact(path), loaded, path)[1]
kivi = resolve(None, f"kivi-{bits}bit-g64-r0", None)[0].build_storages({}, loaded.dims)
H = loaded.dims.num_kv_heads


class Variant(Storage):
    """One layer of a variant: keys through fk(layer, k), values through fv(layer, v) (each left as is when None),
    in the key space and under the flush policy of `base` (that layer's storage of the artifact, or of KIVI)."""

    def __init__(s, layer, fk, fv, base):
        s.layer, s.fk, s.fv = layer, fk, fv
        s.policy, s.keys_pre_rope = base.policy, base.keys_pre_rope

    def reconstruct(s, k, v):
        return (s.fk(s.layer, k) if s.fk else k), (s.fv(s.layer, v) if s.fv else v)


def V(fk=None, fv=None, base=None):
    base = base or storages
    return Storages(Variant(i, fk, fv, b) for i, b in enumerate(base))


def oracle_keys(layer, k):
    t = storages[layer].tables
    rows = to_rows(k)[0]
    lo = quantile(rows[1:], 0.005, 0)
    hi = quantile(rows[1:], 0.995, 0)
    return from_rows(quantize_static(rows[None], lo, hi, t["k_encode"], t["k_decode"], True), H)


def group_keys(layer, k, g=64):
    t = storages[layer].tables
    rows = to_rows(k)[0]
    T = rows.shape[0]
    out = rows.clone()
    for s in range(0, T, g):
        blk = rows[s : s + g]
        lo, hi = blk.amin(0), blk.amax(0)
        out[s : s + g] = quantize_static(blk[None], lo, hi, t["k_encode"], t["k_decode"], False)[0]
    return from_rows(out[None], H)


def int_keys(layer, k):
    t = storages[layer].tables
    rows = to_rows(k)
    lv = torch.linspace(-1, 1, 2 ** int(bits))
    return from_rows(quantize_static(rows, t["k_lo"], t["k_hi"], lv, lv, True), H)


def perhead_values(layer, v):
    t = storages[layer].tables
    b, h, T, d = v.shape
    x = v.transpose(1, 2).reshape(b, T * h, d)
    out = quantize_dynamic(x, t["v_encode"], t["v_decode"], 1)
    return out.reshape(b, T, h, d).transpose(1, 2)


variants = {
    "fp": V(),
    "k nuq-1% (artifact)": V(fk=lambda i, k: storages[i].reconstruct(k, k)[0]),
    "k kivi g64": V(fk=lambda i, k: kivi[i].reconstruct(k, k)[0], base=kivi),
    "k oracle per-window ranges": V(fk=oracle_keys),
    "k int-1% calibrated ranges": V(fk=int_keys),
    "k nuq table, per-64-token minmax": V(fk=group_keys),
    "v nuq-1% (artifact)": V(fv=lambda i, v: storages[i].reconstruct(v, v)[1]),
    "v kivi g64": V(fv=lambda i, v: kivi[i].reconstruct(v, v)[1], base=kivi),
    "v nuq per-head 1/side": V(fv=perhead_values),
}
res = {}
for name, c in variants.items():
    p = simulated_nll(loaded, c, windows).ppl
    res[name] = p
    print(f"{name:40s} {p:.4f}", flush=True)
