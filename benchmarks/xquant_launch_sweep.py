"""XQuant-SVD-2's decode attention (kvcal/methods/xquant/kernels.py) under launch variants at Llama-3.1-8B attention
shapes (synthetic latents and factors, bf16 queries, 128-token window): each variant checked once against the torch
reference (relative error per row and query head, as tests/kernel_cases.rel_err) and timed as `kvcal bench decode`
times (CUDA graph replays, L2 flushed), beside bf16 SDPA and the naive step (dequantize everything, SDPA).

    python benchmarks/xquant_launch_sweep.py --json xquant-launch-sweep.json
    python benchmarks/xquant_launch_sweep.py --variants '[{"path": "gemm", "chunk_tokens": 4096}]' --json out.json
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
from kvcal.runtime.bench import bench_inputs, time_naive, time_sdpa, time_storage  # noqa: E402
from kvcal.runtime.decode import merge_reference  # noqa: E402

VARIANTS = [{"path": "gemm"}, {"path": "gemm", "chunk_tokens": 2048}, {"path": "gemm", "chunk_tokens": 8192},
            {"path": "gemm", "chunk_tokens": 32768}]  # attend_triton's knobs
SHAPES = [(32768, 8), (32768, 1)]  # (context, batch)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative error over (row, query head)."""
    num = (out.float() - ref.float()).norm(dim=-1)
    den = ref.float().norm(dim=-1).clamp_min(1e-12)
    return float((num / den).max())


def check(storage, inv_freq, options, tokens=4096, batch=2) -> float:
    packed, q, fp = bench_inputs(storage, batch, 32, 8, 128, tokens, 128, torch.bfloat16, "cuda", inv_freq)
    ref = merge_reference(storage.attend_reference(q, packed, 128**-0.5, fp), batch, q.dtype)
    out = K.merge_triton(storage.attend_triton(q, packed, 128**-0.5, fp, **options), q)
    return rel_err(out, ref)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="xquant-svd-2bit")
    parser.add_argument("--variants", help="JSON list of knob dicts (default: VARIANTS)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    storage, inv_freq = storage_for(args.recipe)
    rows = []
    for tokens, batch in SHAPES:
        sdpa_us, _, backend = time_sdpa(batch, 32, 8, 128, tokens)
        naive_us, graphed = time_naive(storage, batch, 32, 8, 128, tokens, inv_freq=inv_freq)
        print(f"ctx {tokens} batch {batch}: sdpa {sdpa_us:.1f} us, naive {naive_us:.1f} us", flush=True)
        for options in variants:
            t0 = time.time()
            row = {"context": tokens, "batch": batch, "options": options, "sdpa_us": sdpa_us, "naive_us": naive_us,
                   "naive_graph": graphed}
            try:
                if tokens == SHAPES[0][0] and batch == SHAPES[0][1]:
                    row["rel_err_4k_x2"] = check(storage, inv_freq, options)
                us, nbytes = time_storage(storage, batch, 32, 8, 128, tokens, inv_freq=inv_freq, **options)
                row.update(us=us, x_sdpa=sdpa_us / us, x_naive=naive_us / us)
            except Exception as exc:  # noqa: BLE001 - recorded; the next variant runs
                row["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            rows.append(row)
            print(json.dumps(row), f"({time.time() - t0:.1f} s)", flush=True)
            torch.cuda.empty_cache()
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "recipe": args.recipe, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
