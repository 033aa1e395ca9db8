"""The fp16 cache's static decode step (runtime.cache.LosslessLayer._attend_static: SDPA over the whole
preallocated buffer with the empty slots masked, so that a CUDA graph replays it at every length) against flash
SDPA over the filled slots alone (what an eager step runs; no graph can replay it at changing lengths) and the
generic full-precision split-K kernel (runtime.kernels.fp_partials_triton + merge_triton) on the same buffer.
One decode step of one layer, CUDA graph replays, L2 flushed.

    python benchmarks/lossless_step.py --json lossless-step.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcal.models.attention import decode_attention_masked
from kvcal.runtime import kernels as K
from kvcal.runtime.bench import time_device
from kvcal.runtime.partials import FullPrecision

SHAPES = {  # name: (batch, query heads, KV heads, head_dim, filled tokens)
    "smollm2-135m 4K x 1": (1, 9, 3, 64, 4096),
    "Llama-3.1-8B 4K x 1": (1, 32, 8, 128, 4096),
    "Llama-3.1-8B 32K x 1": (1, 32, 8, 128, 32768),
    "Llama-3.1-8B 32K x 8": (8, 32, 8, 128, 32768),
}


def measure(name: str, b: int, hq: int, hkv: int, d: int, n: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    cap = n + 64  # the buffer's spare slots, as reserve_static leaves them
    k = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    valid = torch.arange(cap, device="cuda") < n
    scale = d**-0.5
    fp = FullPrecision(k, v, valid[None].expand(b, cap).contiguous())

    def masked():
        return decode_attention_masked(q, k, v, valid, scale)

    def flash():
        return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale, enable_gqa=True)

    def kernel():
        return K.merge_triton(K.fp_partials_triton(q[:, :, 0], fp, scale), q[:, :, 0])

    ref = flash()[:, :, 0].float()
    row = {"shape": name, "batch": b, "hq": hq, "hkv": hkv, "head_dim": d, "tokens": n}
    for label, fn in (("masked_sdpa_static", masked), ("flash_sdpa_filled", flash), ("fp_kernel", kernel)):
        out = fn()
        out = out[:, :, 0] if out.dim() == 4 else out
        row[label + "_us"] = time_device(fn) * 1e3
        row[label + "_max_err"] = float((out.float() - ref).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        row = measure(name, *shape)
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
