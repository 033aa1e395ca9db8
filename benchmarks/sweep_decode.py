"""A knob sweep of one storage's decode kernel against bf16 SDPA in the same process (Llama-3.1-8B attention shapes by
default: 32 query heads, 8 KV heads, d 128), each configuration also checked against the storage's torch reference.

    python benchmarks/sweep_decode.py --recipe calibquant-1bit --context 32768 --batch 8 --batch 1 \\
        --grid '[{}, {"block_t": 64, "num_warps": 4}]' --json results/bench/sweep.json

A grid entry is a dict of the storage's attend_triton keyword arguments; the key "kernel": "before" runs the kernel
module given by --before (an earlier version of the method's *_kernels.py, for before/after timings on one card).
Times: CUDA-graph replays, median, L2 flushed (kvcal.runtime.bench.time_device); GB/s counts the bytes a step must
read (packed buffers, the full-precision window, the query and output).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys

import torch

from kvcal.runtime import kernels as K
from kvcal.runtime.bench import packed_bytes, random_packed, storage_for, time_device, time_sdpa
from kvcal.runtime.decode import merge_reference
from kvcal.runtime.storage import FullPrecision


def rel_err(out, ref) -> float:
    """The largest ||out - ref|| / ||ref|| over the (row, head) output vectors."""
    out, ref = out.double(), ref.double()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("before_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["before_kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", action="append", required=True)
    ap.add_argument("--grid", default="[{}]", help="JSON list of knob dicts")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--flush", default="write")
    ap.add_argument("--before", default=None, help="path of an earlier *_kernels.py for grid entries 'kernel: before'")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    grid = json.loads(args.grid)
    batches = args.batch or [8]
    dtype = torch.bfloat16
    rows = []
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    for batch in batches:
        sdpa_us, sdpa_bytes, backend = time_sdpa(batch, args.hq, args.hkv, args.dim, args.context, flush=args.flush)
        print(f"batch {batch} x {args.context}: SDPA ({backend}) {sdpa_us:.1f} us, "
              f"{sdpa_bytes / sdpa_us / 1e3:.0f} GB/s", flush=True)
        rows.append({"recipe": "sdpa", "batch": batch, "context": args.context, "us": sdpa_us,
                     "gbps": sdpa_bytes / sdpa_us / 1e3})
        for recipe in args.recipe:
            storage, inv = storage_for(recipe)
            window = min(args.window, args.context)
            packed = random_packed(storage, batch, args.hkv, args.dim, args.context - window, inv_freq=inv)
            gen = torch.Generator(device="cuda").manual_seed(2)
            q = torch.randn(batch, args.hq, args.dim, device="cuda", dtype=dtype, generator=gen)
            fp = FullPrecision(
                torch.randn(batch, args.hkv, window, args.dim, device="cuda", dtype=dtype, generator=gen),
                torch.randn(batch, args.hkv, window, args.dim, device="cuda", dtype=dtype, generator=gen),
                torch.ones(batch, window, dtype=torch.bool, device="cuda"))
            scale = args.dim**-0.5
            nbytes = (packed_bytes(storage, packed) + 2 * fp.k.numel() * 2 + fp.valid.numel() + 2 * q.numel() * 2)
            ref = None
            if not args.no_check:
                ref = merge_reference(storage.attend_reference(q, packed, scale, fp), batch, q.dtype)
            module = importlib.import_module(type(storage).__module__ + "_kernels")
            for knobs in grid:
                knobs = dict(knobs)
                which = knobs.pop("kernel", "after")
                saved = None
                if which == "before":
                    if not args.before:
                        continue
                    saved = module.attend_triton
                    module.attend_triton = load_before(args.before).attend_triton

                def step(knobs=knobs, storage=storage, q=q, packed=packed, scale=scale, fp=fp):
                    return K.merge_triton(storage.attend_triton(q, packed, scale, fp, **knobs), q)

                try:
                    out = step()
                    err = rel_err(out, ref) if ref is not None else None
                    us = time_device(step, flush=args.flush) * 1e3
                except Exception as exc:  # a configuration that does not compile: report it, keep sweeping
                    print(f"  {recipe} {which} {knobs}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    rows.append({"recipe": recipe, "batch": batch, "kernel": which, "knobs": knobs,
                                 "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
                    continue
                finally:
                    if saved is not None:
                        module.attend_triton = saved
                row = {"recipe": recipe, "batch": batch, "context": args.context, "window": window, "kernel": which,
                       "knobs": knobs, "us": us, "gbps": nbytes / us / 1e3, "x_sdpa": sdpa_us / us, "rel_err": err}
                rows.append(row)
                print(f"  {recipe:>16} {which:>6} {json.dumps(knobs):<60} {us:8.1f} us {row['gbps']:6.0f} GB/s "
                      f"{row['x_sdpa']:5.2f}x SDPA  err {err if err is None else f'{err:.2e}'}", flush=True)
            del ref
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "flush": args.flush, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
