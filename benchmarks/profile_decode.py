"""Run one decode-attention configuration a few times (for ncu / compute-sanitizer on the GPU machine).

    ncu --clock-control none --set full -k regex:_decode_kernel --launch-skip 3 --launch-count 1 \
        python benchmarks/profile_decode.py int 4 '{"block_t": 64}'
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcal.runtime.attention import decode_attention_triton  # noqa: E402
from kvcal.runtime.bench import random_packed  # noqa: E402


def main():
    codec, bits = sys.argv[1], int(sys.argv[2])
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    context, batch, window = opts.pop("context", 32768), opts.pop("batch", 8), opts.pop("window", 128)
    kv = random_packed(codec, bits, batch, 8, 128, context - window)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    fk = torch.randn(batch, 8, window, 128, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(batch, window, dtype=torch.bool, device="cuda")
    for _ in range(5):
        decode_attention_triton(q, kv, fk, fk, valid, 128**-0.5, **opts)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
