"""KVQuant decode time with float32 atomics against deterministic mode (docs/runtime.md).

GPU: decode time of KVQuant caches (random nuq4 / nuq2 with outliers, Llama-3.1-8B attention shapes, bf16, 32K
context, batch 8 and 1) with the value pass's float32 atomics (the default) and in torch's deterministic mode (int64
fixed-point sums), each twice, alternating, with SDPA for scale.

    python benchmarks/deterministic_decode_time.py results/bench/decode-kvquant-deterministic-h100.json
"""
import json
import sys

import torch

from kvcal.bench import storage_for
from kvcal.determinism import deterministic_algorithms
from kvcal.runtime.bench import time_sdpa, time_storage

rows = []
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for batch in (8, 1):
    sdpa = time_sdpa(batch, 32, 8, 128, 32768)[0]
    print(f"sdpa 32K x {batch}: {sdpa:.1f} us", flush=True)
    rows.append({"kernel": "sdpa", "batch": batch, "us": sdpa})
    for bits in (4, 2):
        storage, inv_freq = storage_for(f"kvquant-nuq{bits}-1pct")
        for det in (False, True, False, True):
            with deterministic_algorithms(det):
                us = time_storage(storage, batch, 32, 8, 128, 32768, inv_freq=inv_freq)[0]
            print(f"nuq{bits} 32K x {batch} deterministic={det}: {us:.1f} us ({sdpa / us:.2f}x SDPA)", flush=True)
            rows.append({"kernel": f"nuq{bits}", "batch": batch, "deterministic": det, "us": us})
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "context": 32768,
           "timing": "kvcal.runtime.bench.time_storage (CUDA graph, do_bench write flush, median)", "rows": rows},
          open(sys.argv[1], "w"), indent=1)
