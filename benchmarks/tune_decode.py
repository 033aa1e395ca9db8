"""Time launch variants of the decode-attention kernels against bf16 SDPA at one shape (GPU).

The default shape is 32K context x batch 8, Llama-3.1-8B attention; options (block_t, num_warps, num_stages,
num_splits, programs_per_sm, max_registers, ...) go to `kvcal.runtime.bench.time_storage`. Without --variants every
method runs at its defaults; a set name below reproduces a record that docs/runtime.md quotes:

    python benchmarks/tune_decode.py --variants frag-occupancy --repeat 3 --out results/bench/tune-frag-occupancy-h100.json
    python benchmarks/tune_decode.py --variants '[["int", 4, {"num_stages": 3}]]' --out /tmp/tune.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcal.bench import storage_for  # noqa: E402
from kvcal.runtime.bench import copy_bandwidth, time_sdpa, time_storage  # noqa: E402

RECIPES = {"int": "rtn-int{bits}", "kivi": "kivi-{bits}bit", "nuq": "kvquant-nuq{bits}-1pct"}  # the variants' names
# Every method at its launch defaults (no --variants).
DEFAULT_VARIANTS = [
    ("int", 4, {}), ("int", 3, {}), ("int", 2, {}), ("kivi", 4, {}), ("kivi", 3, {}), ("kivi", 2, {}),
    ("nuq", 4, {}), ("nuq", 3, {}), ("nuq", 2, {}),
]
VARIANT_SETS = {
    # Fragment kernel: one program per SM more than FRAG_OCCUPANCY holds. The register file is split among the SM's
    # four schedulers (16K registers each), so the extra program runs as a second wave
    # (results/bench/tune-frag-occupancy-h100.json, --repeat 3).
    "frag-occupancy": [
        ("int", 4, {}), ("int", 4, {"programs_per_sm": 13}), ("int", 2, {}), ("int", 2, {"programs_per_sm": 17}),
    ],
    # Fragment kernel: register caps that would fit 4 more programs per SM (128 registers at int4, 96 at int2);
    # they spill (results/bench/tune-frag-register-caps-h100.json, --repeat 3).
    "frag-register-caps": [
        ("int", 4, {}), ("int", 4, {"max_registers": 128, "programs_per_sm": 16}), ("int", 2, {}),
        ("int", 2, {"max_registers": 96, "programs_per_sm": 20}),
    ],
}


def sm_clock() -> str:
    """The SM clock and active clock-event reasons as nvidia-smi reports them (latency-bound kernels follow
    the SM clock, SDPA does not), or '?' without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks_event_reasons.active", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variants", default=None, help="JSON list of [method, bits, options], or a set name")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeat", type=int, default=1,
                    help="time the whole list (and SDPA) this many times, interleaved; report the median per variant")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--flush", default="write", choices=("write", "read"),
                    help="L2 flush before each call: zero 256 MB (do_bench's, leaves the L2 dirty) or read it")
    args = ap.parse_args(argv)
    if args.variants in VARIANT_SETS:
        variants = VARIANT_SETS[args.variants]
    else:
        variants = json.loads(args.variants) if args.variants else DEFAULT_VARIANTS
    dev = torch.device("cuda")
    name = torch.cuda.get_device_properties(dev).name
    copy = copy_bandwidth(dev)
    sdpa_runs, runs = [], [[] for _ in variants]
    for rep in range(args.repeat):
        sdpa_us, sdpa_bytes, backend = time_sdpa(args.batch, 32, 8, 128, args.context, graph=not args.eager,
                                                 flush=args.flush)
        sdpa_runs.append(sdpa_us)
        print(f"{name} (pass {rep + 1}/{args.repeat}): copy {copy:.0f} GB/s; sdpa ({backend}) {sdpa_us:.1f} us "
              f"{sdpa_bytes / sdpa_us / 1e3:.0f} GB/s; SM clock {sm_clock()}", flush=True)
        for i, (method, bits, opts) in enumerate(variants):
            t0 = time.time()
            try:
                storage, inv_freq = storage_for(RECIPES[method].format(bits=bits))
                us, nbytes = time_storage(storage, args.batch, 32, 8, 128, args.context, graph=not args.eager,
                                          flush=args.flush, inv_freq=inv_freq, **opts)
            except Exception as e:  # keep going: one failing variant must not lose the others
                print(f"{method}{bits} {opts}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            runs[i].append((us, nbytes))
            print(f"{method}{bits:<2d} {json.dumps(opts):45s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                  f"{100 * nbytes / us / 1e3 / copy:5.1f}% copy  x{sdpa_us / us:5.2f}  ({time.time() - t0:.0f} s, "
                  f"SM clock {sm_clock()})", flush=True)
    sdpa_us = statistics.median(sdpa_runs)
    rows = [dict(method="sdpa", bits=16, options={"backend": backend}, us=sdpa_us, bytes=sdpa_bytes, runs=sdpa_runs)]
    for (method, bits, opts), r in zip(variants, runs):
        if r:
            rows.append(dict(method=method, bits=bits, options=opts, us=statistics.median(u for u, _ in r),
                             bytes=r[0][1], runs=[u for u, _ in r]))
    for r in rows:
        r["gbps"] = r["bytes"] / r["us"] / 1e3
        r["pct_copy"] = 100 * r["gbps"] / copy
        r["speedup"] = sdpa_us / r["us"]
    res = dict(device=name, context=args.context, batch=args.batch, copy_gbps=copy, torch=torch.__version__,
               timing="eager calls" if args.eager else "CUDA graph replays", flush=args.flush, repeat=args.repeat, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\nmedians over {args.repeat} pass(es)\n| method | options | us | GB/s | % copy | x SDPA |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']}{r['bits']} | {json.dumps(r['options'])} | {r['us']:.1f} | {r['gbps']:.0f} | "
              f"{r['pct_copy']:.0f} | {r['speedup']:.2f} |")


if __name__ == "__main__":
    main()
