"""KVQuant's kernel test cases, run by tests/kernel_cases.py from the registry: under the Triton interpreter at small
shapes (ATTENTION) and on a GPU at Llama-3.1-8B shapes (GPU_ATTENTION), each kernel against its torch reference.
A case is (name, bits, query dtype, storage and cache kwargs, kernel kwargs, step kwargs)."""

from __future__ import annotations

import torch

from kvcal.methods.kvquant.method import KVQuant
from kvcal.methods.kvquant.storage import KVQuantStorage

NUQ = {"kcap": 3, "per_side": 6, "sink": 7}  # the GPU cases' outlier slots and sinks


def random_storage(bits: int, heads: int, dim: int, *, kcap: int = 0, per_side: int = 0, value_per_head: bool = False,
                   sink: int = 0, seed: int = 0, device="cpu"):
    """Pre-RoPE nuq keys with `kcap` outlier slots per token and head and per-channel 1%/99% ranges of random keys
    with a few large channels; nuq values with `per_side` outliers per side, per token or per token and head;
    random sorted datatypes; `sink` tokens before the packed ones."""
    gen = torch.Generator(device=device).manual_seed(seed + 100)
    levels = 1 << bits
    enc = torch.sort(torch.rand(levels, generator=gen, device=device) * 2 - 1).values
    enc[0], enc[-1] = -1.0, 1.0
    venc = torch.sort(torch.rand(levels, generator=gen, device=device) * 2 - 1).values
    sample = torch.randn(256, heads, dim, generator=gen, device=device)
    sample[..., : dim // 16] *= 4.0
    sample = sample.reshape(256, heads * dim)
    tables = {"k_lo": sample.quantile(0.01, dim=0), "k_hi": sample.quantile(0.99, dim=0), "k_encode": enc,
              "k_decode": enc + 0.01, "v_encode": venc, "v_decode": venc.clone()}
    return KVQuantStorage(bits, tables, kcap, per_side, value_per_head, sink)


# further settings of the cache checks (tests/kernel_cases.cache_codecs), beside the method's test_config
CACHE_CONFIGS = [("kvquant_vhead", {**KVQuant.test_config, "value_scope": "head"})]  # values per token and head

ATTENTION = [
    ("nuq4_len1_full_outliers_fp16", 4, torch.float16, {"kcap": 3, "per_side": 2}, {},
     {"lengths": [1, 80, 33]}),
    ("nuq4_prerope_outliers_bf16", 4, torch.bfloat16, {"kcap": 3, "per_side": 2, "sink": 3}, {}, {}),
    ("nuq3_prerope_table_fp16", 3, torch.float16, {"kcap": 9, "per_side": 1}, {"rope_mode": "table"}, {}),
    ("nuq2_bf16", 2, torch.bfloat16, {"kcap": 1, "per_side": 1}, {}, {}),
    # Gemma 2's score soft-cap: the value pass reads the capped scores (bf16), the outliers inside (float64)
    ("nuq4_outliers_softcap_bf16", 4, torch.bfloat16, {"kcap": 3, "per_side": 2}, {}, {"softcap": 2.0}),
    ("nuq4_outliers_softcap_fp64", 4, torch.float64, {"kcap": 3, "per_side": 2}, {}, {"softcap": 2.0}),
    # 12 value-outlier slots per token
    ("nuq2_value_slots12_fp16", 2, torch.float16, {"kcap": 3, "per_side": 6}, {}, {}),
    ("nuq4_vhead_fp16", 4, torch.float16, {"kcap": 2, "per_side": 1, "value_per_head": True}, {}, {}),
    # key outliers only (the value pass does not run), and tiles loaded in their own iteration (lut_ahead off)
    ("nuq3_key_outliers_fp16", 3, torch.float16, {"kcap": 3, "sink": 2}, {}, {}),
    ("nuq4_not_ahead_outliers_bf16", 4, torch.bfloat16, {"kcap": 3, "per_side": 2}, {"lut_ahead": False},
     {}),
    # the float32 path, which the lookup-table path replaced for fp16/bf16 (still used for float32 and float64,
    # rope_mode="table" and codes of more than 4 bits)
    ("nuq4_float32_path_fp16", 4, torch.float16, {"kcap": 3, "per_side": 2}, {"lut_mma": False}, {}),
    ("nuq4_d128_fp16", 4, torch.float16, {"kcap": 3, "per_side": 2}, {}, {"d": 128}),
    # more partials than the merge takes per step (REDUCE_CHUNK, 256 by default, set to 32 here): two steps, with
    # the value pass's sums
    ("nuq4_splits40_outliers_fp16", 4, torch.float16, {"kcap": 3, "per_side": 2}, {"num_splits": 40},
     {"reduce_chunk": 32}),
    # torch's deterministic mode: the value pass sums in int64 fixed point
    ("nuq4_deterministic_outliers_fp16", 4, torch.float16, {"kcap": 3, "per_side": 2, "sink": 3}, {},
     {"deterministic": True}),
    ("nuq2_vhead_deterministic_bf16", 2, torch.bfloat16, {"kcap": 2, "per_side": 1,
                                                                      "value_per_head": True}, {},
     {"deterministic": True}),
    ("nuq4_outliers_fp32", 4, torch.float32, {"kcap": 3, "per_side": 2, "sink": 3}, {}, {}),
    ("nuq4_outliers_fp64", 4, torch.float64, {"kcap": 3, "per_side": 2, "sink": 3}, {}, {}),
    ("nuq3_vhead_fp64", 3, torch.float64, {"kcap": 2, "per_side": 1, "value_per_head": True}, {}, {}),
]

GPU_ATTENTION = [("kvquant4_softcap_bf16", 4, torch.bfloat16, NUQ, {}, {"softcap": 2.0})] + [  # capped
    (f"kvquant{bits}_{str(dtype)[6:]}", bits, dtype, NUQ, {}, {})
    for bits in (4, 3, 2) for dtype in ((torch.bfloat16, torch.float16) if bits == 4 else (torch.bfloat16,))
] + [(f"kvquant4_{str(dtype)[6:]}", 4, dtype, NUQ, {}, {}) for dtype in (torch.float32, torch.float64)] + [
    ("nuq4_vhead_bfloat16", 4, torch.bfloat16, {"kcap": 3, "per_side": 1, "value_per_head": True}, {}, {}),
    # the lookup-table path without outliers (a per-lane table load once read as one lane's entry there: a wrong
    # lookup table), and the float32 path it replaced
    ("nuq4_no_outliers_bf16", 4, torch.bfloat16, {"sink": 7}, {}, {}),
    ("nuq2_no_outliers_fp16", 2, torch.float16, {}, {}, {}),
    ("nuq3_key_outliers_bf16", 3, torch.bfloat16, {"kcap": 3, "sink": 7}, {}, {}),
    ("nuq4_not_ahead_outliers_fp16", 4, torch.float16, NUQ, {"lut_ahead": False}, {}),
    ("nuq4_float32_path_bf16", 4, torch.bfloat16, NUQ, {"lut_mma": False}, {}),
    # torch's deterministic mode: the value pass sums in int64 fixed point
    ("nuq4_deterministic_bf16", 4, torch.bfloat16, NUQ, {}, {"deterministic": True}),
    ("nuq2_deterministic_fp16", 2, torch.float16, NUQ, {}, {"deterministic": True}),
    ("nuq4_wgmma_bf16", 4, torch.bfloat16, {"kcap": 3, "per_side": 2}, {"block_t": 64, "num_warps": 4},
     {}),
]
