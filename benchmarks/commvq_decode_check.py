"""CommVQ's decode kernels on a GPU: correctness against the references and time per layer (docs/commvq.md).

CommVQ's decode kernels on a GPU at Llama-3.1-8B shapes: the attention kernel against the storage's torch reference
(rows of a few thousand tokens: the reference's gather is [Hq, P, R, T]), the key encoder's codes against the
reference encoder's, and the time of one decode step per layer (the storage's kernels and the merge, a 128-token
bf16 window) beside bf16 SDPA and, with --reconstruct, beside rebuilding every key and value in torch then SDPA, in
one run.

    PYTHONPATH=. python benchmarks/commvq_decode_check.py [--contexts 32768] [--batches 1 8] [--reconstruct]
        [--knobs '{"num_splits": 64}']

--knobs go to attend_triton in the correctness check too (but "probe", which is timing only).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal import bench as cases
from kvcal.runtime import bench
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import merge_reference
from tests.kernel_cases import build_step, rel_err


def check(recipe: str, dtype=torch.bfloat16, knobs: dict | None = None) -> dict:
    storage, inv_freq = cases.storage_for(recipe)
    lengths = [3001, 1, 2048]
    packed = bench.random_packed(storage, len(lengths), 8, 128, max(lengths), inv_freq=inv_freq)
    packed.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
    q, fp = build_step(len(lengths), 32, 8, 128, 128, dtype, device="cuda")
    ref = merge_reference(storage.attend_reference(q, packed, 128**-0.5, fp), len(lengths), q.dtype)
    knobs = {k: v for k, v in (knobs or {}).items() if k != "probe"}  # the knob settings timed below
    out = K.merge_triton(storage.attend_triton(q, packed, 128**-0.5, fp, **knobs), q)
    # the key encoder: codes of random keys against the reference encoder's (float32: near-ties may differ)
    from kvcal.methods.commvq.kernels import encode_keys_triton
    from kvcal.methods.commvq.packing import unpack_stream
    from kvcal.methods.commvq.storage import encode_keys

    t = storage.constants(torch.float32)
    keys = torch.randn(4096, 1024, device="cuda")
    codes_ref, norms_ref = encode_keys(keys, t["theta"], storage.channels)
    words, norms = encode_keys_triton(keys, t["theta"], storage.channels, storage.index_bits, storage=storage)
    codes = unpack_stream(words, storage.index_bits, codes_ref[0].numel()).view(codes_ref.shape)
    same = float((codes == codes_ref.long()).all(-1).all(-1).all(-1).float().mean())
    return {"attend_rel_err": rel_err(out, ref, per_head=True), "key_codes_same_tokens": same,
            "norms_equal": bool(torch.equal(norms, norms_ref))}


def reconstruct_then_sdpa(storage, packed, q: torch.Tensor):
    """The baseline that rebuilds every key and value of the packed rows in torch (codewords gathered per stage,
    summed, rotated; value bits times the codebook), then bf16 SDPA: one decode step, its [B, Hq, D] output (rows
    of equal length, one group per KV head)."""
    from kvcal.methods.commvq.packing import unpack_stream

    batch, hq, d = q.shape
    hkv, half, n = packed.heads, d // 2, int(packed.lengths.max())
    if storage.group_pairs != half:
        raise SystemExit("reconstruct_then_sdpa: one group per KV head only")
    tables = storage.constants(torch.float32)
    th, values = tables["theta_heads"], tables["values"]  # [Hkv, R, N, P, 2]
    codes = unpack_stream(packed["k_codes"][:, :n], storage.index_bits, 2 * storage.groups * storage.stages)
    codes = codes.view(batch, n, hkv, storage.stages, 2)
    heads = torch.arange(hkv, device=q.device)[None, None, :]
    pairs = torch.zeros(batch, n, hkv, half, 2, device=q.device)
    for r in range(storage.stages):
        a = th[heads, r, codes[..., r, 0]]  # [B, T, Hkv, P, 2]
        b = th[heads, r, codes[..., r, 1]]
        pairs[..., 0] += a[..., 0] - b[..., 1]
        pairs[..., 1] += a[..., 1] + b[..., 0]
    keys = torch.cat([pairs[..., 0], pairs[..., 1]], -1) * packed["k_norm"][:, :n, None, None].float()
    keys = keys.transpose(1, 2)  # [B, Hkv, T, D], before RoPE
    cos, sin = packed.rope_cos[None, None, :n], packed.rope_sin[None, None, :n]
    keys = (keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], -1) * sin).to(q.dtype)
    bits = unpack_stream(packed["v_codes"][:, :n], 1, storage.num_value_bits).to(q.dtype)
    rows = (bits @ values["codebook"].to(q.dtype)) * packed["v_rho"][:, :n, None].to(q.dtype)
    vals = (rows * values["channel_scale"].to(q.dtype)).view(batch, n, hkv, d).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, vals, enable_gqa=True)[:, :, 0]


def time_reconstruct(recipe: str, batch: int, tokens: int, dtype=torch.bfloat16) -> float:
    storage, inv_freq = cases.storage_for(recipe)
    packed = bench.random_packed(storage, batch, 8, 128, tokens, inv_freq=inv_freq)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=dtype)
    return bench.time_device(lambda: reconstruct_then_sdpa(storage, packed, q), graph=False) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["commvq-1bit", "commvq-2bit"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--knobs", default="{}")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--reconstruct", action="store_true", help="also time reconstruct-then-SDPA (torch, eager)")
    args = ap.parse_args()
    knobs = json.loads(args.knobs)
    out = {"device": torch.cuda.get_device_name()}
    for recipe in args.recipes:
        if not args.no_check:
            out[f"check {recipe}"] = check(recipe, knobs=knobs)
            print(recipe, out[f"check {recipe}"], flush=True)
    for tokens in args.contexts:
        for batch in args.batches:
            us, nbytes, backend = bench.time_sdpa(batch, 32, 8, 128, tokens)
            out[f"sdpa {tokens}x{batch}"] = {"us": round(us, 1), "backend": backend}
            print(f"sdpa {tokens}x{batch}: {us:.1f} us ({backend})", flush=True)
            for recipe in args.recipes:
                storage, inv_freq = cases.storage_for(recipe)
                us, nbytes = bench.time_storage(storage, batch, 32, 8, 128, tokens, inv_freq=inv_freq, **knobs)
                out[f"{recipe} {tokens}x{batch}"] = {"us": round(us, 1), "bytes": nbytes}
                print(f"{recipe} {tokens}x{batch}: {us:.1f} us, {nbytes / 1e6:.1f} MB", flush=True)
                if args.reconstruct:
                    us = time_reconstruct(recipe, batch, tokens)
                    out[f"{recipe} reconstruct+sdpa {tokens}x{batch}"] = {"us": round(us, 1)}
                    print(f"{recipe} reconstruct+sdpa {tokens}x{batch}: {us:.1f} us", flush=True)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
