"""Host time of an eager decode step and of each runtime launch (docs/runtime.md, generation).

Where the host time of an eager decode step goes (GPU): cProfile over eager steps of `kvcal bench generate`'s
model and cache, and the per-call host cost of each runtime launch alone (no synchronization between calls, so
the timing is what the CPU spends issuing the call while the GPU keeps up).

    python benchmarks/host_overhead.py [RECIPE ...]      (default rtn-int4; CONTEXT, BATCH, STEPS from the env)
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcal.models import load_model  # noqa: E402
from kvcal.models.adapter import AttentionInputs, forward_with_cache  # noqa: E402
from kvcal.quant.rope import rope_cos_sin  # noqa: E402
from kvcal.recipes import resolve  # noqa: E402
from kvcal.runtime.bench_generate import eager_decode_seconds  # noqa: E402
from kvcal.runtime.cache import KvcalCache  # noqa: E402


def per_call_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / calls


def _per_call_costs(layer, loaded, batch: int) -> None:
    """Host microseconds per call of the pieces of one packed layer's decode step."""
    if not hasattr(layer, "packed"):
        return
    hkv, d = loaded.dims.num_kv_heads, loaded.dims.head_dim
    q = torch.randn(batch, loaded.dims.num_heads, d, device="cuda", dtype=loaded.dtype)
    attend_us = per_call_us(lambda: layer._decode(q, 0.088))
    print(f"decode attention (storage kernel + merge): {attend_us:.1f} us/call host")
    x = torch.randn(batch, hkv, d, device="cuda", dtype=loaded.dtype)
    hidden = torch.randn(batch, 1, loaded.dims.hidden_size, device="cuda", dtype=loaded.dtype)  # X of one token
    rows = layer._index(range(batch))
    slots = layer.lengths.clone().long()
    # one write signature: keys and values [M, H, D], or X [M, 1, hidden] and None for storages of source "x"
    keys, values = (hidden, None) if layer.storage.source == "x" else (x, x)
    write_us = per_call_us(lambda: layer.storage.write(layer.packed(), keys, values, rows, slots, True))
    print(f"storage write (one token per row): {write_us:.1f} us/call host")
    print(f"lengths += 1: {per_call_us(lambda: slots.add_(1)):.1f} us/call host")
    # the whole one-token step of the layer (RoPE, quantize + pack, attention; each call appends a token), with its
    # kernels launched from Python and replayed from the layer's StepGraph (KvcalCache's default on CUDA)
    positions = torch.full((batch, 1), layer.length, device="cuda")
    cos, sin = rope_cos_sin(loaded.dims.rope.inv_freq("cuda"), positions, loaded.dtype)
    inp = AttentionInputs(layer_idx=0, module=None, q=q[:, :, None], k_pre=x[:, :, None], v=x[:, :, None].clone(),
                          x=hidden, positions=positions, cos=cos, sin=sin, mask=None, cache=None, scale=0.088)
    pool = layer.graph_pool
    for name, graphs in (("launched", None), ("step graph", pool)):
        layer.graph_pool = graphs
        print(f"layer step, {name}: {per_call_us(lambda: layer.attend(inp)):.1f} us/call host")
    layer.graph_pool = pool


def main():
    recipes = sys.argv[1:] or ["rtn-int4"]
    context, batch = int(os.environ.get("CONTEXT", 32768)), int(os.environ.get("BATCH", 1))
    steps = int(os.environ.get("STEPS", 10))
    loaded = load_model("random-llama-3.1-8b", "bfloat16", "cuda")
    ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")  # the profiled steps' input
    for name in recipes:
        method, _, _ = resolve(None, name, None)
        storages = method.build_storages(method.synthetic_tensors(loaded.dims), loaded.dims)
        cache = KvcalCache(storages, loaded.dims.num_layers)
        # headroom: the per-call timings below append a token per call
        cache.fill_synthetic(batch, context, loaded.dims, loaded.dtype, loaded.device, headroom=steps + 1024)
        seconds = eager_decode_seconds(loaded, cache, batch, steps, torch.Generator(device="cuda").manual_seed(0))
        print(f"== {name}: {seconds / steps * 1000:.1f} ms/step eager (batch {batch}, context {context})")
        with torch.inference_mode():
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(steps):
                forward_with_cache(loaded.model, ids, cache)
            torch.cuda.synchronize()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
            _per_call_costs(cache.layers[0], loaded, batch)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
