"""SKVQ decode-kernel launch sweep at 32K x 8 (docs/runtime.md).

SKVQ's decode kernel at 32K x 8 (Llama-3.1-8B shapes, bf16, random layouts): tiles and warps per program, against
SDPA in the same process (chose skvq_kernels.DEFAULTS).

    python benchmarks/skvq_launch_sweep.py > results/bench/skvq-launch-sweep-h100.log
"""

from kvcal.bench import storage_for
from kvcal.runtime.bench import time_sdpa, time_storage

print("sdpa", round(time_sdpa(8, 32, 8, 128, 32768)[0], 1))
for recipe in ("skvq-k2v2-g128-w128", "skvq-k2v1.5-g128-w128"):
    storage, inv = storage_for(recipe)
    for bt, warps in ((32, 4), (16, 4), (64, 4), (32, 8), (64, 8), (16, 2)):
        us = time_storage(storage, 8, 32, 8, 128, 32768, inv_freq=inv, block_t=bt, num_warps=warps)[0]
        print(recipe, bt, warps, round(us, 1), flush=True)
