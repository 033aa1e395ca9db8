"""RTN's kernel test cases, run by tests/kernel_cases.py from the registry: under the Triton interpreter at small
shapes (ATTENTION) and on a GPU at Llama-3.1-8B shapes (GPU_ATTENTION), each kernel against its torch reference.
A case is (name, bits, query dtype, storage and cache kwargs, kernel kwargs, step kwargs)."""

from __future__ import annotations

import torch

from kvcal.methods.rtn.kernels import _frag_applies
from kvcal.methods.rtn.storage import RtnStorage


def random_storage(bits: int, heads: int, dim: int, *, group: int | None = None, seed: int = 0, device="cpu"):
    """Per-token groups of `group` channels (default: the whole head); RTN learns nothing, so nothing is random."""
    return RtnStorage(bits, group or dim)


def small_kernel_kwargs(kernel_kw: dict) -> dict:
    """The interpreter's defaults minus block_t for the fragment kernel (a tile-kernel knob)."""
    return {k: v for k, v in kernel_kw.items() if not (k == "block_t" and kernel_kw.get("frag"))}


def check_case(name: str, storage, q, packed, bits: int, kernel_kw: dict) -> None:
    """An explicit frag case must reach the fragment kernel, not the tile one."""
    if kernel_kw.get("frag"):
        group = q.shape[1] // packed.heads
        assert _frag_applies(q, packed, bits, group), f"{name}: the fragment kernel does not take this cache"


# further settings of the cache checks (tests/kernel_cases.cache_codecs), beside the method's test_config
CACHE_CONFIGS = [("rtn_1bit", {"bits": 1, "group_size": 32})]  # two levels per group of 32 channels

ATTENTION = [
    ("int4_bf16", 4, torch.bfloat16, {}, {}, {}),
    # Gemma 2's score soft-cap (here 2: scores of a few units are bent), applied by the tile kernel
    ("int4_softcap_bf16", 4, torch.bfloat16, {}, {}, {"softcap": 2.0}),
    ("int2_softcap_fp64", 2, torch.float64, {}, {}, {"softcap": 2.0}),
    # the register-fragment kernel (one scale per token and head), asked for explicitly (its default needs 64 (row,
    # KV head) pairs): head_dim 64 and 128, GQA groups of 4 and 3, with the full-precision part
    ("int4_frag_bf16", 4, torch.bfloat16, {}, {"frag": True}, {}),
    # 45 full-precision tokens: three programs of the fp launch (FP_CHUNK 16 tokens each), the last partial
    ("int2_frag_d128_fp16", 2, torch.float16, {}, {"frag": True}, {"d": 128, "nfp": 45}),
    ("int4_frag_d128_g3_fp16", 4, torch.float16, {}, {"frag": True}, {"d": 128, "hq": 6}),
    # buffers of whole 32-token tiles (the kernel then clamps tiles, not rows), one row filling them: its last tile
    # is read from the clamped tile start (where the look-ahead past the end is clamped too; an out-of-bounds read
    # would only show as a fault on a GPU). Per-token scales are then loaded without masks: the rows past a length
    # hold inf and nan here, which must not reach the output (0 x inf); rows of whole tiles only (64) and one token
    ("int4_frag_whole_tiles_bf16", 4, torch.bfloat16, {"poison": True}, {"frag": True},
     {"tcap": 96, "lengths": [96, 0, 70]}),
    ("int2_frag_whole_tiles_d128_fp16", 2, torch.float16, {"poison": True}, {"frag": True},
     {"d": 128, "tcap": 96, "lengths": [33, 1, 64]}),
    # the same with scale rows off the 8-byte alignment: the scales come as one 2-byte load per token (SCALE_WORDS 0)
    ("int4_frag_whole_tiles_misaligned_scales_fp16", 4, torch.float16,
     {"poison": True, "misaligned_scales": True}, {"frag": True}, {"tcap": 96, "lengths": [96, 0, 70]}),
    # a row of one token (one tile, nearly all masked) and a row filling the whole buffer (tcap 80: its last tile
    # runs past the buffer's end and must be masked, not read)
    ("int4_len1_full_bf16", 4, torch.bfloat16, {}, {}, {"lengths": [1, 80, 33]}),
    ("int3_g32_fp16", 3, torch.float16, {"group": 32}, {}, {}),
    ("int2_bf16", 2, torch.bfloat16, {}, {}, {}),
    # head_dim 128 on the small shapes: the code-word order of packing.unpack_mma (chosen against shared-memory
    # bank conflicts) only differs from the natural order there (at 64 the natural order is already conflict-free)
    ("int4_d128_bf16", 4, torch.bfloat16, {}, {}, {"d": 128}),
    ("int2_d128_fp16", 2, torch.float16, {}, {}, {"d": 128}),
    ("int4_mha_fp16", 4, torch.float16, {}, {}, {"hq": 2}),
    ("int4_g8_bf16", 4, torch.bfloat16, {}, {}, {"hq": 16}),
    ("int4_no_fp_part_bf16", 4, torch.bfloat16, {}, {}, {"nfp": 0}),
    ("int4_many_splits_bf16", 4, torch.bfloat16, {}, {"num_splits": 9, "block_t": 16}, {}),
    # 1 bit (two levels per group, its min and max): per head and in groups of 32 channels, every query dtype
    ("int1_bf16", 1, torch.bfloat16, {}, {}, {}),
    ("int1_g32_fp16", 1, torch.float16, {"group": 32}, {}, {}),
    ("int1_g32_d128_fp32", 1, torch.float32, {"group": 32}, {}, {"d": 128}),
    ("int3_fp32", 3, torch.float32, {}, {}, {}),
    ("int3_fp64", 3, torch.float64, {}, {}, {}),
]

GPU_ATTENTION = [("rtn4_softcap_bf16", 4, torch.bfloat16, {}, {}, {"softcap": 2.0})] + [  # Gemma 2's cap
    (f"rtn{bits}_{str(dtype)[6:]}", bits, dtype, {}, {}, {})
    for bits in (4, 3, 2) for dtype in ((torch.bfloat16, torch.float16) if bits == 4 else (torch.bfloat16,))
] + [(f"rtn4_{str(dtype)[6:]}", 4, dtype, {}, {}, {}) for dtype in (torch.float32, torch.float64)] + [
    # the fragment kernel (the default from 64 (row, KV head) pairs; these 4 x 8 are asked for explicitly)
    ("int4_frag_bf16", 4, torch.bfloat16, {}, {"frag": True}, {}),
    ("int4_frag_fp16", 4, torch.float16, {}, {"frag": True}, {}),
    ("int2_frag_bf16", 2, torch.bfloat16, {}, {"frag": True}, {}),
    ("int2_frag_fp16", 2, torch.float16, {}, {"frag": True}, {}),
    # rows past each length hold inf / nan scales and random codes: unmasked scale loads must not let them through
    ("int4_frag_poisoned_bf16", 4, torch.bfloat16, {"poison": True}, {"frag": True}, {}),
    ("int2_frag_poisoned_fp16", 2, torch.float16, {"poison": True}, {"frag": True}, {}),
    # 1 bit in groups of 32 channels
    ("int1_g32_bf16", 1, torch.bfloat16, {"group": 32}, {}, {}),
    # the int and nuq paths do take wgmma tiles when asked (64 tokens, 4 warps)
    ("int4_wgmma_bf16", 4, torch.bfloat16, {}, {"block_t": 64, "num_warps": 4}, {}),
]
