"""KIVI's kernel test cases, run by tests/kernel_cases.py from the registry: under the Triton interpreter at small
shapes (ATTENTION) and on a GPU at Llama-3.1-8B shapes (GPU_ATTENTION), each kernel against its torch reference.
A case is (name, bits, query dtype, storage and cache kwargs, kernel kwargs, step kwargs)."""

from __future__ import annotations

import torch

from kvcal.methods.kivi.method import KIVI
from kvcal.methods.kivi.storage import KiviStorage


def random_storage(bits: int, heads: int, dim: int, *, key_block: int = 32, seed: int = 0, device="cpu"):
    """Keys per channel in blocks of `key_block` tokens, values per token in groups of key_block channels."""
    return KiviStorage(bits, key_block, 0)


def gpu_block(storage_kw: dict) -> int:
    """Rows of whole key blocks at the GPU shapes."""
    return storage_kw.get("key_block", 32)


# further settings of the cache checks (tests/kernel_cases.cache_codecs), beside the method's test_config
CACHE_CONFIGS = [("kivi_1bit", {**KIVI.test_config, "bits": 1})]

ATTENTION = [
    ("kivi4_b16_bf16", 4, torch.bfloat16, {"key_block": 16}, {}, {"lengths": [32, 0, 64]}),
    ("kivi2_b16_softcap_fp16", 2, torch.float16, {"key_block": 16}, {}, {"lengths": [32, 0, 64], "softcap": 2.0}),
    ("kivi3_block_t64_fp16", 3, torch.float16, {}, {"block_t": 64}, {"lengths": [32, 0, 64]}),  # 32-token tiles
    # blocks of 8 tokens (not a multiple of 16): the generic key path
    ("kivi2_b8_generic_bf16", 2, torch.bfloat16, {"key_block": 8}, {}, {"lengths": [24, 0, 72]}),
    ("kivi4_b32_generic_keys_fp16", 4, torch.float16, {}, {"generic_keys": True}, {"lengths": [32, 0, 64]}),
    ("kivi4_d128_bf16", 4, torch.bfloat16, {"key_block": 16}, {}, {"d": 128, "lengths": [32, 0, 64]}),
    # 1 bit (two levels per group): the tile path (blocks of 16 and 32 tokens) and the generic key path (blocks of 8)
    ("kivi1_b16_bf16", 1, torch.bfloat16, {"key_block": 16}, {}, {"lengths": [32, 0, 64]}),
    ("kivi1_b32_fp16", 1, torch.float16, {}, {}, {"lengths": [32, 0, 64]}),
    ("kivi1_b8_generic_fp64", 1, torch.float64, {"key_block": 8}, {}, {"lengths": [24, 0, 72]}),
    ("kivi4_b16_fp32", 4, torch.float32, {"key_block": 16}, {}, {"lengths": [32, 0, 64]}),
    ("kivi4_b16_fp64", 4, torch.float64, {"key_block": 16}, {}, {"lengths": [32, 0, 64]}),
]

GPU_ATTENTION = [
    (f"kivi{bits}_{str(dtype)[6:]}", bits, dtype, {}, {}, {})
    for bits in (4, 3, 2) for dtype in ((torch.bfloat16, torch.float16) if bits == 4 else (torch.bfloat16,))
] + [(f"kivi4_{str(dtype)[6:]}", 4, dtype, {}, {}, {}) for dtype in (torch.float32, torch.float64)] + [
    ("kivi1_fp16", 1, torch.float16, {}, {}, {}),
    ("kivi2_block64_fp16", 2, torch.float16, {"key_block": 64}, {}, {}),  # tiles inside a block
    # asks for 64-token tiles on 4 warps (Triton 3.6 lowers them to a wrong wgmma): runs 32-token tiles
    ("kivi4_4warps_bf16", 4, torch.bfloat16, {"key_block": 64}, {"block_t": 64, "num_warps": 4}, {}),
]
