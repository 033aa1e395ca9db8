"""CalibQuant's kernel test cases, run by tests/kernel_cases.py from the registry: under the Triton interpreter at small
shapes (ATTENTION) and on a GPU at Llama-3.1-8B shapes (GPU_ATTENTION), each kernel against its torch reference.
A case is (name, bits, query dtype, storage and cache kwargs, kernel kwargs, step kwargs)."""

from __future__ import annotations

import torch

from kvcal.methods.calibquant.storage import CalibQuantStorage


def random_storage(bits: int, heads: int, dim: int, *, group: int | None = None, sink: int = 0, remap: bool = True,
                   seed: int = 0, device="cpu"):
    """One range group over the row (group None) or groups of `group` tokens; post-scaling (0.5, 0.3) at 1 bit,
    none above; the logit remap with tau (0.5, 3) on 64 layers, or none (remap=False)."""
    c = (0.5, 0.3) if bits == 1 else (1.0, 1.0)
    taus = (torch.full((64,), 0.5), torch.full((64,), 3.0)) if remap else None
    return CalibQuantStorage(bits, group or 0, sink, *c, taus)


def gpu_block(storage_kw: dict) -> int:
    """Rows of whole range groups at the GPU shapes."""
    return storage_kw.get("group") or 1


# further settings of the cache checks (tests/kernel_cases.cache_codecs): the paper's regime, the prompt after 4 sinks
# compressed in bulk, tau (0, 3)
CACHE_CONFIGS = [("calibquant_bulk", {"bits": 1, "sink": 4, "tau1": 0.0, "tau2": 3.0})]

ATTENTION = [
    # CalibQuant: post-scaled codes, the two-pass score remap (bulk: one range group per row; groups of 16 tokens)
    ("calibquant1_bulk_bf16", 1, torch.bfloat16, {}, {}, {}),
    ("calibquant2_g16_fp16", 2, torch.float16, {"group": 16}, {}, {"lengths": [32, 0, 64]}),
    # the full-precision part by the generic kernel in a launch of its own (the default from 64 (row, KV head) pairs)
    ("calibquant1_fp_kernel_bf16", 1, torch.bfloat16, {}, {"fp_kernel": True}, {}),
    ("calibquant4_noremap_fp16", 4, torch.float16, {"remap": False}, {}, {}),
    ("calibquant8_d128_fp32", 8, torch.float32, {}, {}, {"d": 128}),
    ("calibquant1_fp64", 1, torch.float64, {}, {}, {}),
]

GPU_ATTENTION = [
    # CalibQuant: 1 bit, one range group per row (the paper's bulk regime) and groups of 128 tokens; 4 bits, no remap
    ("calibquant1_bulk_bf16", 1, torch.bfloat16, {}, {}, {}),
    ("calibquant1_bulk_fp16", 1, torch.float16, {}, {}, {}),
    ("calibquant2_g128_bf16", 2, torch.bfloat16, {"group": 128}, {}, {}),
    ("calibquant4_noremap_bf16", 4, torch.bfloat16, {"remap": False}, {}, {}),
    ("calibquant1_bulk_fp32", 1, torch.float32, {}, {}, {}),
    # the shift-and-convert unpacking (mma=False) and 64-token tiles on 4 warps (wgmma-sized) of the mma path
    ("calibquant1_shifts_bf16", 1, torch.bfloat16, {}, {"mma": False}, {}),
    ("calibquant1_tiles64_bf16", 1, torch.bfloat16, {}, {"block_t": 64, "num_warps": 4}, {}),
    ("calibquant1_fp_kernel_2warps_fp16", 1, torch.float16, {}, {"fp_kernel": True, "num_warps": 2},
     {}),
    ("calibquant2_g128_tiles64_fp16", 2, torch.float16, {"group": 128},
     {"block_t": 64, "num_warps": 4}, {})
]
