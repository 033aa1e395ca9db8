"""The baselines at 1 bit (rtn-1, kivi-1): what tests/test_contract.py checks of every method at its test setting, at
1 bit: the gptq simulation equals decoding through the packed cache, under strict and with a window, and the bytes the
cache holds equal the footprint; the recipes' bits per element by hand. The quantizers against hand-computed 1-bit
cases are in tests/test_quant_uniform.py, the kernels against their references at 1 bit in tests/test_kernels.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcal.accounting import bits_per_element
from kvcal.eval.ppl import decoded_nll, simulated_nll
from kvcal.methods.registry import build_method
from kvcal.models import load_model
from kvcal.recipes import load_recipe

SETTINGS = {"rtn": {"bits": 1, "group_size": 8}, "kivi": {"bits": 1, "group_size": 8, "residual": 8}}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", "float64")


@pytest.mark.parametrize("fp_window", [0, 8])
@pytest.mark.parametrize("name", ["rtn", "kivi"])
def test_simulation_equals_decode_at_one_bit(tiny, name, fp_window):
    """float64, torch references: the simulation and token-by-token decoding through the packed cache score the same
    NLL at 1 bit, which is not the 2-bit NLL (the setting ran at 1 bit)."""
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    method = build_method(name, SETTINGS[name]).with_fp_window(fp_window)
    codec = method.build_storages({}, tiny.dims)
    simulated = simulated_nll(tiny, codec, ids)
    decoded = decoded_nll(tiny, codec, ids, batch_size=2, backend="packed")
    assert decoded.tokens == simulated.tokens == 2 * 47
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)
    two_bits = build_method(name, {**SETTINGS[name], "bits": 2}).with_fp_window(fp_window).build_storages({}, tiny.dims)
    assert abs(simulated_nll(tiny, two_bits, ids).nll - simulated.nll) > 1e-3


@pytest.mark.parametrize("name", ["rtn", "kivi"])
def test_the_bytes_a_one_bit_cache_holds_equal_the_footprint(tiny, name):
    """After prefills and decode steps of several lengths, the packed buffers' bytes for the compressed tokens (in
    proportion to the slots they fill) plus every full-precision token in fp16 equal the footprint."""
    method = build_method(name, SETTINGS[name])
    codec = method.build_storages({}, tiny.dims)
    from tests.test_contract import assert_cache_bytes_equal_footprint

    assert_cache_bytes_equal_footprint(tiny, method, codec)


def test_one_bit_recipes_by_hand():
    """At 4096 tokens on smollm2-135m (30 layers, 3 KV heads of 64 channels). rtn-int1: 1-bit codes (two int32 words
    per 64 channels) and an fp16 scale and zero per 32 channels: 1 + 32 / 32 = 2 bits. kivi-1bit: 4096 - 128 = 3968
    tokens quantized (whole blocks of 32), each with 1 bit of codes and 1 bit of scales and zeros (keys per channel per
    32 tokens, values per token per 32 channels), and 128 fp16 tokens: (3968 x 2 + 128 x 16) / 4096 = 2.4375."""
    dims = SimpleNamespace(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, kv_channels=192)
    for name, config, bits in (("rtn-int1", {"bits": 1, "group_size": 32}, 2.0),
                               ("kivi-1bit", {"bits": 1, "group_size": 32, "residual": 128}, 2.4375)):
        recipe = load_recipe(name)
        assert recipe.config == config
        method = build_method(recipe.method, recipe.config)
        method.check_model(dims)
        assert bits_per_element(method, dims).bits_per_element == bits
