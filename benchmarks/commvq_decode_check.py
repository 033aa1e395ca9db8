"""CommVQ's decode kernels on a GPU at Llama-3.1-8B shapes: the attention kernel against the storage's torch reference
(rows of a few thousand tokens: the reference's gather is [Hq, P, R, T]), the key encoder's codes against the
reference encoder's, and the time of one decode step per layer (the storage's kernels and the merge, a 128-token
bf16 window) beside bf16 SDPA, in one run.

    python benchmarks/commvq_decode_check.py [--contexts 32768] [--batches 1 8] [--knobs '{"num_splits": 64}']
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal.runtime import bench
from kvcal.runtime import kernels as K
from kvcal.runtime.decode import merge_reference
from tests.kernel_cases import build_step, rel_err


def check(recipe: str, dtype=torch.bfloat16) -> dict:
    storage, inv_freq = bench.storage_for(recipe)
    lengths = [3001, 1, 2048]
    packed = bench.random_packed(storage, len(lengths), 8, 128, max(lengths), inv_freq=inv_freq)
    packed.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
    q, fp = build_step(len(lengths), 32, 8, 128, 128, dtype, device="cuda")
    ref = merge_reference(storage.attend_reference(q, packed, 128**-0.5, fp), len(lengths), q.dtype)
    out = K.merge_triton(storage.attend_triton(q, packed, 128**-0.5, fp), q)
    # the key encoder: codes of random keys against the reference encoder's (float32: near-ties may differ)
    from kvcal.methods.commvq import encode_keys, unpack_stream
    from kvcal.methods.commvq_kernels import encode_keys_triton

    t = storage.tables(torch.float32)
    keys = torch.randn(4096, 1024, device="cuda")
    codes_ref, norms_ref = encode_keys(keys, t["theta"], storage.channels)
    words, norms = encode_keys_triton(keys, t["theta"], storage.channels, storage.index_bits, storage=storage)
    codes = unpack_stream(words, storage.index_bits, codes_ref[0].numel()).view(codes_ref.shape)
    same = float((codes == codes_ref.long()).all(-1).all(-1).all(-1).float().mean())
    return {"attend_rel_err": rel_err(out, ref, per_head=True), "key_codes_same_tokens": same,
            "norms_equal": bool(torch.equal(norms, norms_ref))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["commvq-1bit", "commvq-2bit"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--knobs", default="{}")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    knobs = json.loads(args.knobs)
    out = {"device": torch.cuda.get_device_name()}
    for recipe in args.recipes:
        if not args.no_check:
            out[f"check {recipe}"] = check(recipe)
            print(recipe, out[f"check {recipe}"], flush=True)
    for tokens in args.contexts:
        for batch in args.batches:
            us, nbytes, backend = bench.time_sdpa(batch, 32, 8, 128, tokens)
            out[f"sdpa {tokens}x{batch}"] = {"us": round(us, 1), "backend": backend}
            print(f"sdpa {tokens}x{batch}: {us:.1f} us ({backend})", flush=True)
            for recipe in args.recipes:
                storage, inv_freq = bench.storage_for(recipe)
                us, nbytes = bench.time_storage(storage, batch, 32, 8, 128, tokens, inv_freq=inv_freq, **knobs)
                out[f"{recipe} {tokens}x{batch}"] = {"us": round(us, 1), "bytes": nbytes}
                print(f"{recipe} {tokens}x{batch}: {us:.1f} us, {nbytes / 1e6:.1f} MB", flush=True)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
