"""Profile decode steps of `kvcal bench generate` (random Llama-3.1-8B, long synthetic context) with the
torch profiler: where the time of one step goes, host and device.

    python benchmarks/profile_generate.py [RECIPE ...]      (GPU; default fp16 rtn-int4)
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcal.models import load_model  # noqa: E402
from kvcal.models.adapter import forward_with_cache  # noqa: E402
from kvcal.recipes import resolve  # noqa: E402
from kvcal.runtime.cache import KvcalCache  # noqa: E402


def main():
    recipes = sys.argv[1:] or ["fp16", "rtn-int4"]
    context, batch = int(os.environ.get("CONTEXT", 32768)), int(os.environ.get("BATCH", 1))
    loaded = load_model("random-llama-3.1-8b", "bfloat16", "cuda")
    ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    for name in recipes:
        method, _, _ = resolve(None, name, None)
        cache = KvcalCache(method.build_codec({}, loaded.dims), loaded.dims.num_layers)
        cache.fill_synthetic(batch, context, loaded.dims, loaded.dtype, loaded.device, headroom=32)
        with torch.inference_mode():
            for _ in range(3):
                forward_with_cache(loaded.model, ids, cache)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                forward_with_cache(loaded.model, ids, cache)
            torch.cuda.synchronize()
            print(f"== {name}: {(time.perf_counter() - start) / 5 * 1000:.1f} ms/step (batch {batch}, context {context})")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    forward_with_cache(loaded.model, ids, cache)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
