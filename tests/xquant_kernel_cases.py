"""XQuant's decode kernels against their torch reference (XQuantStorage.attend_reference), on packed latents written
by the storage's own torch reference from random attention inputs: run under TRITON_INTERPRET=1 on the CPU by
tests/test_xquant.py (small shapes, a subprocess: the interpreter is chosen when kernels are decorated) and natively
on the GPU at Llama-3.1-8B shapes (marked gpu)."""

from __future__ import annotations

import torch

from kvcal.quant.rope import RopeSpec
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import FullPrecision, merge_reference
from kvcal.runtime.storage import Packed, SharedState

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}

# (name, variant, bits, dtype, options): options hidden, hkv, d, hq, lengths, tcap, nfp, outlier, bias, group_tokens,
# group_channels, num_splits (fused path), chunk_tokens (gemm path)
CASES = [
    ("svd2_fp16", "svd", 2, torch.float16, {}),
    ("svd3_outlier_bias_bf16", "svd", 3, torch.bfloat16, {"outlier": True, "bias": True}),
    ("svd4_splits5_fp32", "svd", 4, torch.float32, {"num_splits": 5, "outlier": True}),
    ("svd8_no_fp_fp16", "svd", 8, torch.float16, {"nfp": 0}),
    ("svd2_outlier_bias_fp64", "svd", 2, torch.float64, {"outlier": True, "bias": True}),
    ("svd16_raw_fp32", "svd", 16, torch.float32, {}),
    ("x2_bias_fp16", "x", 2, torch.float16, {"bias": True, "hq": 8}),
    ("x3_fp64", "x", 3, torch.float64, {}),
    # the gemm path in chunks of 16 slots (several splits, an empty row in some), and smollm2's 192-wide latents
    ("svd2_chunks16_outlier_bias_bf16", "svd", 2, torch.bfloat16, {"chunk_tokens": 16, "outlier": True, "bias": True}),
    ("svd2_width192_fp64", "svd", 2, torch.float64, {"hkv": 3, "d": 64, "hq": 9, "hidden": 128,
                                                     "group_channels": 64, "chunk_tokens": 32}),
]
PATHS = ("gemm", "fused")  # attend_triton's paths; a case's name gets "_fused" on the fused one


def _inputs(gen, n, hidden, device):
    x = torch.randn(n, 1, hidden, generator=gen, device=device)
    x[..., : hidden // 16] *= 4.0  # a few large channels, as post-norm X has
    return x


def make_case(variant, bits, dtype, *, hidden=96, hkv=2, d=32, hq=None, lengths=(40, 0, 72), tcap=None, nfp=19,
              outlier=False, bias=False, group_tokens=8, group_channels=16, seed=0, device="cpu", **_):
    """(storage, packed, q, fp): a storage with random factors (svd) or weights (x), `lengths[b]` tokens of random
    attention inputs in row b written by its torch reference, a query and a full-precision part."""
    from kvcal.methods.xquant.calibrate import thin_svd
    from kvcal.methods.xquant.storage import XQuantStorage
    from kvcal.models.adapter import KVProjection

    gen = torch.Generator(device="cpu").manual_seed(seed)
    d_kv = hkv * d
    w_k, w_v = torch.randn(d_kv, hidden, generator=gen) / hidden**0.5, torch.randn(d_kv, hidden, generator=gen) / hidden**0.5
    factors = {}
    if variant == "svd":
        for side, w in (("k", w_k), ("v", w_v)):
            u, r, _, _ = thin_svd(w.T)
            factors[f"{side}.U"], factors[f"{side}.R"] = u, r
    storage = XQuantStorage(variant, bits, group_tokens, group_channels, 0, factors, outlier, hidden)
    b_k = torch.randn(d_kv, generator=gen) if bias else None
    b_v = torch.randn(d_kv, generator=gen) if bias else None
    storage.bind(KVProjection(w_k.to(device), None if b_k is None else b_k.to(device), w_v.to(device),
                              None if b_v is None else b_v.to(device), False))
    storage.to(device)
    tcap = tcap or max(lengths)
    batch = len(lengths)
    buffers = {name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
               for name, spec in storage.buffers(batch, tcap, hkv, d).items()}
    inv_freq = RopeSpec(head_dim=d, theta=500000.0, rope_type="llama3", factor=8.0).inv_freq(device)
    cos, sin = SharedState().rope_tables(inv_freq, tcap + 8)
    packed = Packed(buffers, torch.tensor(lengths, dtype=torch.int32, device=device), hkv, d, tcap, 3, cos, sin,
                    inv_freq)  # slot 0 at position 3 (as after 3 sinks)
    for b, n in enumerate(lengths):
        if n:
            storage.write_reference(packed, _inputs(gen, n, hidden, "cpu").to(device), None,
                                    torch.full((n,), b, dtype=torch.int64, device=device),
                                    torch.arange(n, device=device))
    hq = hq or 2 * hkv
    q = torch.randn(batch, hq, d, generator=gen).to(device=device, dtype=dtype)
    fp = None
    if nfp:
        fp = FullPrecision(torch.randn(batch, hkv, nfp, d, generator=gen).to(device=device, dtype=dtype),
                           torch.randn(batch, hkv, nfp, d, generator=gen).to(device=device, dtype=dtype),
                           torch.rand(batch, nfp, generator=gen).to(device) > 0.3)
    return storage, packed, q, fp


def run_case(case, device="cpu", path="gemm", **shape) -> float:
    """Largest relative error per (row, query head) of the kernel's output against the reference's (attend_triton's
    `path`; num_splits is the fused path's knob, chunk_tokens the gemm path's)."""
    name, variant, bits, dtype, options = case
    options = {**options, **shape}
    storage, packed, q, fp = make_case(variant, bits, dtype, device=device, **options)
    scale = q.shape[-1] ** -0.5
    assert storage.supports_triton(q, packed) is None, storage.supports_triton(q, packed)
    ref = merge_reference(storage.attend_reference(q, packed, scale, fp), q.shape[0], q.dtype)
    knob = "chunk_tokens" if path == "gemm" else "num_splits"
    knobs = {knob: options[knob]} if knob in options else {}
    out = K.merge_triton(storage.attend_triton(q, packed, scale, fp, path=path, **knobs), q)
    if not torch.isfinite(out.float()).all():
        return float("nan")
    out, ref = out.double(), ref.double()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


def main():  # pragma: no cover - run in a subprocess by tests/test_xquant.py
    import json
    import time

    t0 = time.time()
    out = {case[0] + ("" if path == "gemm" else "_fused"): run_case(case, path=path) for path in PATHS
           for case in CASES}
    out["seconds"] = time.time() - t0
    print("XQUANT_KERNELS " + json.dumps(out))


if __name__ == "__main__":
    main()
