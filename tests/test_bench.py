"""`kvcal bench decode`'s naive column: naive_attention (every row dequantized by the storage's torch `read`, the
window appended, SDPA or the written-out softmax for a storage that remaps scores) against the storage's torch
reference attention (partials per row, merged), in float64 on the CPU, for every method's main recipe."""

import pytest
import torch

from kvcal.bench import bench_cases
from kvcal.models import ModelDims
from kvcal.runtime.bench import naive_attention, random_packed
from kvcal.runtime.decode import FullPrecision, merge_reference

RECIPES = ["rtn-int2", "kivi-2bit", "kvquant-nuq2-1pct", "skvq-k2v2-g128-w128", "calibquant-1bit", "commvq-1bit",
           "evict-2bit", "xquant-svd-2bit"]


@pytest.fixture(scope="module")
def dims():
    from transformers import LlamaConfig

    return ModelDims.from_config(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=64, rope_theta=10000.0))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("window", [0, 8])
def test_naive_step_equals_the_storage_reference(dims, recipe, window):
    (_, _, storages), = bench_cases([recipe], [], dims)
    storage = storages[0]
    batch, tokens = 2, 128  # a multiple of every group of tokens (KIVI quantizes keys per channel in blocks)
    inv_freq = dims.rope.inv_freq("cpu")
    packed = random_packed(storage, batch, dims.num_kv_heads, dims.head_dim, tokens, device="cpu", inv_freq=inv_freq)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, dims.num_heads, dims.head_dim, dtype=torch.float64, generator=gen)
    fp = None
    if window:
        valid = torch.ones(batch, window, dtype=torch.bool)
        valid[1, :3] = False  # a shorter row's window: its first slots hold nothing
        fp = FullPrecision(torch.randn(batch, dims.num_kv_heads, window, dims.head_dim, dtype=torch.float64,
                                       generator=gen),
                           torch.randn(batch, dims.num_kv_heads, window, dims.head_dim, dtype=torch.float64,
                                       generator=gen), valid)
    scale = dims.head_dim**-0.5
    want = merge_reference(storage.attend_reference(q, packed, scale, fp), batch, torch.float64)
    got = naive_attention(storage, packed, q, fp, scale)
    assert got.shape == want.shape == (batch, dims.num_heads, dims.head_dim)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # the host-known lengths give the same step (what lets the benchmark capture it in a CUDA graph)
    packed.host_lengths = (tokens,) * batch
    torch.testing.assert_close(naive_attention(storage, packed, q, fp, scale), want, rtol=1e-9, atol=1e-9)
