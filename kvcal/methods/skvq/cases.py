"""SKVQ's kernel test cases, run by tests/kernel_cases.py from the registry: under the Triton interpreter at small
shapes (ATTENTION) and on a GPU at Llama-3.1-8B shapes (GPU_ATTENTION), each kernel against its torch reference.
A case is (name, bits, query dtype, storage and cache kwargs, kernel kwargs, step kwargs)."""

from __future__ import annotations

import torch

from kvcal.methods.skvq.storage import ChannelQuantizer, GroupLayout, SKVQStorage


def random_storage(bits: float, heads: int, dim: int, *, v_bits: float = 2.0, groups: int = 5, param_dtype: str = "fp16",
                   ternary_storage: str = "base3", sink: int = 0, seed: int = 0, device="cpu"):
    """Random k-means-like layouts: a random permutation of the heads x dim channels cut into `groups` groups of
    uneven sizes (across heads), random clip ratios in [0.8, 1]; `bits` for keys, `v_bits` for values."""
    gen = torch.Generator().manual_seed(seed + 7)
    channels = heads * dim
    sides = []
    for side_bits in (bits, v_bits):
        cuts = torch.sort(torch.randperm(channels - 1, generator=gen)[: groups - 1] + 1).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([channels])])
        layout = GroupLayout(torch.randperm(channels, generator=gen), offsets)
        alpha = 0.8 + 0.2 * torch.rand(groups, generator=gen)
        sides.append(ChannelQuantizer(layout, alpha, side_bits, param_dtype))
    return SKVQStorage(sides[0], sides[1], sink, 0, ternary_storage)


ATTENTION = [
    # SKVQ: groups across heads, keys before RoPE; ternary values in base-3 bytes or 2-bit slots; fp8 parameters
    ("skvq_k2v2_bf16", 2, torch.bfloat16, {"sink": 3}, {}, {}),
    ("skvq_k2v2_softcap_bf16", 2, torch.bfloat16, {"sink": 3}, {}, {"softcap": 2.0}),
    ("skvq_k2v1.5_base3_fp16", 2, torch.float16, {"v_bits": 1.5}, {}, {}),
    ("skvq_k1.5v1.5_slots_bf16", 1.5, torch.bfloat16, {"v_bits": 1.5, "ternary_storage": "2bit"}, {}, {}),
    ("skvq_k4v3_fp8_fp16", 4, torch.float16, {"v_bits": 3.0, "param_dtype": "fp8", "groups": 3}, {}, {}),
    ("skvq_k8v4_d128_bf16", 8, torch.bfloat16, {"v_bits": 4.0, "groups": 9}, {}, {"d": 128}),
    ("skvq_k2v2_fp32", 2, torch.float32, {"sink": 2}, {}, {}),
    ("skvq_k2v1.5_fp64", 2, torch.float64, {"v_bits": 1.5}, {}, {}),
    ("skvq_k2v2_one_group_bf16", 2, torch.bfloat16, {"groups": 1}, {}, {}),  # a group wider than the layer's heads
]

GPU_ATTENTION = [
    # SKVQ: 8 groups across the 1024 channels (g128), ternary values in base-3 bytes, fp8 parameters
    ("skvq_k2v2_bf16", 2, torch.bfloat16, {"sink": 5, "groups": 8}, {}, {}),
    ("skvq_k2v1.5_fp16", 2, torch.float16, {"v_bits": 1.5, "groups": 8}, {}, {}),
    ("skvq_k4v4_fp8_bf16", 4, torch.bfloat16, {"v_bits": 4.0, "param_dtype": "fp8", "groups": 16}, {}, {}),
    ("skvq_k2v2_fp32", 2, torch.float32, {"groups": 8}, {}, {}),
    # one group over all channels (smollm2's 192 channels at g128): the parameters broadcast, no gather
    ("skvq_k2v2_one_group_bf16", 2, torch.bfloat16, {"groups": 1}, {}, {}),
]
