"""Knobs of XQuant's tensor-core decode kernels (kvcal/methods/xquant/kernels.py, attend_triton) at
Llama-3.1-8B attention shapes: synthetic XQuant-SVD-2 latents and factors (the recipe's storage at those shapes,
as `kvcal bench decode` builds it: latent width 1024, 8 KV heads of 128, 32 query heads, per-channel key groups of
128 tokens), bf16 queries, a 128-token full-precision window. Each config is checked once against the torch
reference (largest relative error per row and query head and largest absolute error, at 4K x 2) and timed from a CUDA graph
(kvcal.runtime.bench.time_device, L2 flushed) at every shape; the naive step (dequantize the cache with the
storage's read, SDPA) is timed once per shape. One GPU:

    python benchmarks/xquant_kernel_tune.py --json xquant-kernel-tune.json
    python benchmarks/xquant_kernel_tune.py --configs '[{"block_t": 64, "heads_per_program": 2}]' --json out.json

Timings stop once --max-seconds have passed (the rows left are marked "skipped"), so the default grid stays within
a few minutes on one H200 (compilation included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcal.bench import storage_for  # noqa: E402
from kvcal.runtime import kernels as K  # noqa: E402
from kvcal.runtime.bench import bench_inputs, time_device, time_naive  # noqa: E402
from kvcal.runtime.decode import merge_reference  # noqa: E402

HQ, HKV, D, WINDOW = 32, 8, 128, 128
SHAPES = [(32768, 8), (32768, 1), (4096, 1)]  # (context, batch)
CONFIGS = [  # attend_triton's keywords; {} is its defaults (128-token tiles, chunks of 64, one KV head a
    # program, 8 warps; value tiles of 64 tokens x 64 channels, 4 warps). The scores kernel's configurations keep its
    # accumulators <= 64 registers a thread (benchmarks/xquant_kernel_sass.py: more spills); two of them spill on
    # purpose, as data points: 2 KV heads over 128 tokens at 16 warps (128 registers a thread) and a 128-register cap
    # (two programs per SM)
    {},
    {"num_warps": 16},
    {"block_t": 64, "num_warps": 4},
    {"heads_per_program": 2, "block_t": 64},
    {"heads_per_program": 2, "block_t": 128, "num_warps": 16},
    {"heads_per_program": 4, "block_t": 32},
    {"num_stages": 2},
    {"chunk": 32},
    {"chunk": 128},
    {"max_registers": 128},
    {"staged_latents": True},
    {"value_chunk": 32},
    {"value_chunk": 128},
    {"value_chunk": 256},
    {"staged_latents": True, "block_t": 64, "num_warps": 4},
    {"value_block_t": 128, "value_num_warps": 8},
    {"programs_per_sm": 2},
    {"programs_per_sm": 8},
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative error over (row, query head)."""
    num = (out.float() - ref.float()).norm(dim=-1)
    den = ref.float().norm(dim=-1).clamp_min(1e-12)
    return float((num / den).max())


def short(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def check(storage, inv_freq, rows) -> None:
    """Each config's error against the torch reference at 4K x 2: the largest relative error per (row, query head)
    and the largest absolute error (row["rel_err_4k_x2"], row["max_abs_err_4k_x2"], or row["error"])."""
    packed, q, fp = bench_inputs(storage, 2, HQ, HKV, D, 4096, WINDOW, torch.bfloat16, "cuda", inv_freq)
    ref = merge_reference(storage.attend_reference(q, packed, D**-0.5, fp), 2, q.dtype)
    for row in rows:
        try:
            out = K.merge_triton(storage.attend_triton(q, packed, D**-0.5, fp, **row["options"]), q)
            row["rel_err_4k_x2"] = rel_err(out, ref)
            row["max_abs_err_4k_x2"] = float((out.float() - ref.float()).abs().max())
        except Exception as exc:  # noqa: BLE001 - recorded; the next config runs
            row["error"] = short(exc)
        print(json.dumps(row), flush=True)


def time_shape(storage, inv_freq, rows, tokens, batch, key, rep, deadline) -> None:
    """Each config's time (us) of one step at `tokens` x `batch` into row[key] (or row["error " + key], or
    row["skipped " + key] past the deadline, time.time())."""
    packed, q, fp = bench_inputs(storage, batch, HQ, HKV, D, tokens, WINDOW, torch.bfloat16, "cuda", inv_freq)
    for row in rows:
        if "error" in row:
            continue
        if time.time() > deadline:
            row[f"skipped {key}"] = "time budget (--max-seconds)"
            continue
        t0 = time.time()

        def step(options=row["options"]):
            return K.merge_triton(storage.attend_triton(q, packed, D**-0.5, fp, **options), q)

        try:
            if not torch.isfinite(step().float()).all():
                raise RuntimeError("non-finite output")
            row[key] = time_device(step, warmup=10, rep=rep) * 1e3
        except Exception as exc:  # noqa: BLE001
            row[f"error {key}"] = short(exc)
        print(f"  {key} {json.dumps(row['options'])}: {row.get(key, row.get(f'error {key}'))} "
              f"({time.time() - t0:.1f} s)", flush=True)


def write_json(args, keys, naive, rows, t_start) -> dict:
    """The record (args.json); returns the fastest row per shape (None where no row has a time)."""
    import triton

    best = {k: min((r for r in rows if k in r), key=lambda r: r[k], default=None) for k in keys}
    args.json.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "recipe": args.recipe, "shapes": keys, "naive": naive, "rows": rows,
        "best": {k: (r["options"] if r else None) for k, r in best.items()}, "seconds": time.time() - t_start,
    }, indent=1))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="xquant-svd-2bit")
    parser.add_argument("--configs", help="JSON list of knob dicts (default: CONFIGS)")
    parser.add_argument("--rep", type=int, default=50, help="do_bench's rep (ms) per timing")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="no new timing after this many seconds")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    configs = json.loads(args.configs) if args.configs else CONFIGS
    storage, inv_freq = storage_for(args.recipe)
    t_start = time.time()
    deadline = t_start + args.max_seconds

    keys = [f"{tokens // 1024}K x {batch}" for tokens, batch in SHAPES]
    rows = [{"options": options} for options in configs]
    check(storage, inv_freq, rows)
    naive = {}
    for tokens, batch in SHAPES:
        key = f"{tokens // 1024}K x {batch}"
        if time.time() > deadline:
            naive[key] = {"us": None, "skipped": "time budget (--max-seconds)"}
            continue
        naive_us, graphed = time_naive(storage, batch, HQ, HKV, D, tokens, window=WINDOW, inv_freq=inv_freq,
                                       rep=args.rep)
        naive[key] = {"us": naive_us, "graph": graphed}
        print(f"{key}: naive step {naive_us:.1f} us", flush=True)
        time_shape(storage, inv_freq, rows, tokens, batch, key, args.rep, deadline)
        torch.cuda.empty_cache()
        write_json(args, keys, naive, rows, t_start)  # what is done so far, should a later shape fail
    print("\n| options | rel err (4K x 2) | max abs err | " + " | ".join(f"{k} (us)" for k in keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{row[k]:.1f}" if k in row else "-" for k in keys]
        err = f"{row['rel_err_4k_x2']:.2e}" if "rel_err_4k_x2" in row else row.get("error", "-")
        abs_err = f"{row['max_abs_err_4k_x2']:.2e}" if "max_abs_err_4k_x2" in row else "-"
        print(f"| {json.dumps(row['options'])} | {err} | {abs_err} | " + " | ".join(cells) + " |")
    print("| naive step | | | " + " | ".join(f"{naive[k]['us']:.1f}" if naive[k]["us"] else "-" for k in keys) + " |")
    best = write_json(args, keys, naive, rows, t_start)
    for k, r in best.items():
        if r is not None:
            ratio = f", naive / this = {naive[k]['us'] / r[k]:.2f}x" if naive[k]["us"] else ""
            print(f"best at {k}: {json.dumps(r['options'])} {r[k]:.1f} us{ratio}")


if __name__ == "__main__":
    main()
