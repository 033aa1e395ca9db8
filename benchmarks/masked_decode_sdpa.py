"""Which SDPA backend attends one new token per row over a preallocated cache with the empty slots masked
(the fp16 cache's static decode step, what a CUDA graph replays), against flash over the filled part alone.
Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16, 32K filled tokens, batch 8.

    python benchmarks/masked_decode_sdpa.py > results/bench/masked-decode-sdpa-h100.txt
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

B, HQ, HKV, D, N = 8, 32, 8, 128, 32768


def timed(label: str, fn) -> None:
    try:
        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
        print(f"{label:56s} {ms * 1000:8.1f} us", flush=True)
    except RuntimeError as err:  # a backend that refuses these inputs
        print(f"{label:56s} refused: {str(err)[:100]}", flush=True)


def measure(cap: int) -> None:
    """Every backend at one buffer capacity (filled tokens + room for the decode steps)."""
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, cap, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bias = torch.where(torch.arange(cap, device="cuda") < N, 0.0, -1e30).to(torch.bfloat16)[None, None, None, :]
    rows = q.reshape(B, HKV, HQ // HKV, D)  # the query heads of a KV head as query rows (no GQA needed)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        def gqa(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

        def as_rows(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(rows, k, v, attn_mask=bias)

        timed(f"capacity {cap}: masked, enable_gqa, {backend.name}", gqa)
        timed(f"capacity {cap}: masked, heads as rows, {backend.name}", as_rows)

    def flash_prefix():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k[:, :, :N], v[:, :, :N], enable_gqa=True)

    timed(f"capacity {cap}: flash over the {N} filled tokens (reference)", flash_prefix)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for cap in (N + 24, N + 64):  # 24: the room kvcal bench generate leaves for its 16 steps
        measure(cap)


if __name__ == "__main__":
    main()
