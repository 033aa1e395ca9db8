"""Where CommVQ's decode time goes on a GPU (docs/commvq.md, "Measured on the H100"): one decode step per layer at
Llama-3.1-8B shapes (bf16, 128-token window, as `kvcal bench decode`), the full kernels beside timing-only variants
of the same kernels (attend_triton's `probe`: constant key codes, no key gathers, no value mass, no key pass) and
knob settings, bf16 SDPA in the same process; then each compiled kernel's shared memory, registers and spills.

    PYTHONPATH=. python benchmarks/commvq_breakdown.py [--recipes commvq-1bit] [--contexts 32768] [--batches 1 8]
        [--configs '[["fused", {"key_path": "fused"}], ["two-pass", {}]]']
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal.runtime import bench

CONFIGS = [
    ["fused", {"key_path": "fused", "fp16_codewords": False}],
    ["fused, const codes", {"key_path": "fused", "fp16_codewords": False, "probe": "const_codes"}],
    ["fused, no key gathers", {"key_path": "fused", "fp16_codewords": False, "probe": "no_gathers"}],
    ["fused, no value mass", {"key_path": "fused", "fp16_codewords": False, "probe": "no_value_mass"}],
    ["two-pass", {}],
    ["two-pass, fp32 codewords", {"fp16_codewords": False}],
    ["two-pass, const codes", {"probe": "const_codes"}],
    ["two-pass, no key gathers", {"probe": "no_gathers"}],
    ["two-pass, no value mass", {"probe": "no_value_mass"}],
    ["two-pass, no key pass", {"probe": "no_key_pass"}],
]


def compiled_kernels() -> list[dict]:
    """Shared memory, registers and spills of every compiled CommVQ decode kernel (Triton's per-device caches)."""
    from kvcal.methods import commvq_kernels as C

    out = []
    for fn in (C._scores_mass_kernel, C._key_scores_kernel, C._value_mass_kernel, C._codebook_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():
                meta = kernel.metadata
                out.append({"kernel": fn.__name__, "shared": meta.shared, "num_warps": meta.num_warps,
                            "n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["commvq-1bit"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--configs", default=None, help="JSON list of [name, attend_triton knobs]")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = json.loads(args.configs) if args.configs else CONFIGS
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    for tokens in args.contexts:
        for batch in args.batches:
            us, _, backend = bench.time_sdpa(batch, 32, 8, 128, tokens, rep=args.rep)
            out["rows"].append({"context": tokens, "batch": batch, "case": f"sdpa bf16 ({backend})", "us": round(us, 1)})
            print(f"{tokens}x{batch} sdpa bf16: {us:.1f} us", flush=True)
            for recipe in args.recipes:
                storage, inv_freq = bench.storage_for(recipe)
                for name, knobs in configs:
                    try:
                        us, _ = bench.time_storage(storage, batch, 32, 8, 128, tokens, inv_freq=inv_freq, rep=args.rep,
                                                   **knobs)
                    except Exception as exc:  # a knob setting that does not compile or fit: say so, go on
                        print(f"{tokens}x{batch} {recipe} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    out["rows"].append({"context": tokens, "batch": batch, "recipe": recipe, "case": name,
                                        "knobs": knobs, "us": round(us, 1)})
                    print(f"{tokens}x{batch} {recipe} {name}: {us:.1f} us", flush=True)
                    torch.cuda.empty_cache()
    out["kernels"] = compiled_kernels()
    for k in out["kernels"]:
        print("KERNEL", json.dumps(k))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
