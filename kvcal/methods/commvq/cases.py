"""CommVQ's kernel test cases, run by tests/kernel_cases.py from the registry: under the Triton interpreter at small
shapes (ATTENTION) and on a GPU at Llama-3.1-8B shapes (GPU_ATTENTION), each kernel against its torch reference.
A case is (name, bits, query dtype, storage and cache kwargs, kernel kwargs, step kwargs)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcal.methods.commvq.method import CommVQ


def random_storage(bits: int, heads: int, dim: int, *, stages: int = 3, codes: int = 8, group_pairs: int = 0,
                   seed: int = 0, device="cpu"):
    """Random codebooks (N(0, 0.3) per coordinate) and a random value encoder (torch's init): `codes` codewords per
    pair and stage (8: not a power of two's worth of fields), `stages` stages, groups of `group_pairs` pairs (0: one
    KV head). Keys before RoPE."""
    dims = SimpleNamespace(num_layers=1, num_heads=4 * heads, num_kv_heads=heads, head_dim=dim,
                           kv_channels=heads * dim)
    method = CommVQ(bits=bits, key_codes=codes, key_stages=stages, key_group_pairs=group_pairs)
    return method.build_storages(method.synthetic_tensors(dims, seed), dims)[0]


ATTENTION = [
    # CommVQ: keys from code indices (codewords gathered per stage, one rotation per token), values by probability
    # mass per code bit and one codebook product per chunk of codes; 8 codes of 3-bit fields, or 12 codes (4-bit
    # fields), groups of 8 pairs (4 groups per KV head), one 32-word value row at d 128
    ("commvq2_bf16", 2, torch.bfloat16, {}, {}, {}),
    ("commvq1_c12_g8_fp16", 1, torch.float16, {"codes": 12, "group_pairs": 8, "stages": 2}, {}, {}),
    ("commvq1_d128_bf16", 1, torch.bfloat16, {"stages": 2}, {}, {"d": 128}),
    ("commvq2_fp32_gather_bf16", 2, torch.bfloat16, {}, {"fp16_codewords": False}, {}),
    # the key pass's epilogue as tl.dot (score_dot: "mma" tf32x3 on the tensor cores, "fma" Triton's FMA dot; the
    # group padded to 16 query heads, or to score_dot_n; exact float32 dots under the interpreter)
    ("commvq2_score_mma_bf16", 2, torch.bfloat16, {}, {"score_dot": "mma"}, {}),
    ("commvq1_c12_g8_score_fma_fp16", 1, torch.float16, {"codes": 12, "group_pairs": 8, "stages": 2},
     {"score_dot": "fma"}, {}),
    ("commvq2_score_mma_fp32", 2, torch.float32, {}, {"score_dot": "mma"}, {}),
    ("commvq2_score_fma_n4_bf16", 2, torch.bfloat16, {}, {"score_dot": "fma", "score_dot_n": 4}, {}),
    ("commvq2_fp32", 2, torch.float32, {}, {}, {}),
    ("commvq1_g8_fp64", 1, torch.float64, {"group_pairs": 8}, {}, {}),
    ("commvq1_c12_g8_fp64", 1, torch.float64, {"codes": 12, "group_pairs": 8}, {}, {}),
    # Gemma 2's score soft-cap (cap 2: the scores reach the tanh's curved part), in the key pass and the fp part
    ("commvq2_softcap_bf16", 2, torch.bfloat16, {}, {}, {"softcap": 2.0}),
    ("commvq1_g8_softcap_fp64", 1, torch.float64, {"group_pairs": 8}, {}, {"softcap": 2.0}),
]

GPU_ATTENTION = [
    # CommVQ at the paper's Llama-3.1-8B settings: 64 codes, one group per KV head, 11 / 21 stages (1 / 2 bits)
    ("commvq1_bf16", 1, torch.bfloat16, {"codes": 64, "stages": 11}, {}, {}),
    ("commvq2_bf16", 2, torch.bfloat16, {"codes": 64, "stages": 21}, {}, {}),
    ("commvq1_fp16", 1, torch.float16, {"codes": 64, "stages": 11}, {}, {}),
    ("commvq2_fp32", 2, torch.float32, {"codes": 64, "stages": 21}, {}, {}),
    # the key pass's epilogue as a tensor-core dot (tf32x3) and as Triton's FMA dot
    ("commvq1_score_mma_bf16", 1, torch.bfloat16, {"codes": 64, "stages": 11}, {"score_dot": "mma"}, {}),
    ("commvq2_score_fma_bf16", 2, torch.bfloat16, {"codes": 64, "stages": 21}, {"score_dot": "fma"}, {}),
    ("commvq1_score_mma_n4_bf16", 1, torch.bfloat16, {"codes": 64, "stages": 11},
     {"score_dot": "mma", "score_dot_n": 4}, {}),
    ("commvq1_softcap_bf16", 1, torch.bfloat16, {"codes": 64, "stages": 11}, {}, {"softcap": 2.0}),  # Gemma 2's cap
]
