"""The gptq simulation equals token-by-token decoding through a cache that applies the same quantizer."""

import dataclasses

import pytest
import torch

from kvcal.eval.ppl import first_target, sequence_nll, simulated_nll
from kvcal.methods import build_method
from kvcal.methods.base import FlushPolicy
from kvcal.models.adapter import forward_with_cache
from kvcal.runtime.cache import KvcalCache


def decode_nll(loaded, codec, ids, protocol, prompt_len):
    """Feed tokens one at a time (after a full-precision prefill for prefill-decode) through KvcalCache."""
    cache = KvcalCache(codec, loaded.dims.num_layers)
    logits = []
    with torch.inference_mode():
        start = prompt_len if protocol == "prefill-decode" else 0
        if start:
            logits.append(forward_with_cache(loaded.model, ids[:, :start], cache).logits)
        for t in range(start, ids.shape[1]):
            logits.append(forward_with_cache(loaded.model, ids[:, t : t + 1], cache).logits)
    return sequence_nll(torch.cat(logits, 1), ids, first_target(protocol, prompt_len)).item()


CASES = [
    ("rtn", {"bits": 2}),
    ("kivi", {"bits": 2, "group_size": 4, "residual": 8}),
    ("kivi", {"bits": 3, "group_size": 8, "residual": 0}),
]


@pytest.mark.parametrize("protocol,prompt_len", [("gptq", 0), ("prefill-decode", 19)])
@pytest.mark.parametrize("name,config", CASES)
def test_simulation_equals_token_by_token(tiny, name, config, protocol, prompt_len):
    ids = torch.randint(0, 256, (2, 45), generator=torch.Generator().manual_seed(0))
    codec = build_method(name, config).build_storages({}, tiny.dims)
    simulated = simulated_nll(tiny, codec, ids, protocol, prompt_len).nll
    decoded = decode_nll(tiny, codec, ids, protocol, prompt_len)
    assert simulated == pytest.approx(decoded, rel=2e-6)
    # the comparison has teeth: quantization moves the NLL 100x more than the tolerance
    lossless = simulated_nll(tiny, build_method("fp16").build_storages({}, tiny.dims), ids, protocol, prompt_len).nll
    assert abs(simulated - lossless) > 100 * 2e-6 * abs(lossless)


def test_a_wrong_window_is_detected(tiny):
    """Negative control: simulating KIVI as if it had no fp16 residual disagrees with real decoding."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    codec = build_method("kivi", {"bits": 2, "group_size": 4, "residual": 8}).build_storages({}, tiny.dims)
    decoded = decode_nll(tiny, codec, ids, "gptq", 0)
    wrong = build_method("kivi", {"bits": 2, "group_size": 4, "residual": 8}).build_storages({}, tiny.dims)
    wrong[0].policy = dataclasses.replace(codec.policy, residual=0)  # one object serves every layer
    assert simulated_nll(tiny, wrong, ids).nll != pytest.approx(decoded, rel=1e-4)


def test_sinks_window_policy_matches_decoding(tiny):
    """Sinks + sliding window (SKVQ/KVQuant-style policies) through the same two paths."""
    from kvcal.methods.base import Storages
    from kvcal.methods.rtn.storage import RtnStorage

    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    windowed = RtnStorage(2, tiny.dims.head_dim)
    windowed.policy = FlushPolicy(sink=3, residual=5, block=1)  # the storage declares it; cache and simulation follow
    codec = Storages([windowed] * tiny.dims.num_layers)
    simulated = simulated_nll(tiny, codec, ids).nll
    assert simulated == pytest.approx(decode_nll(tiny, codec, ids, "gptq", 0), rel=2e-6)
    # the policy is honoured: plain RTN (every token quantized) lands 100x the tolerance away from it
    plain = simulated_nll(tiny, Storages([RtnStorage(2, tiny.dims.head_dim)] * tiny.dims.num_layers), ids).nll
    assert abs(simulated - plain) > 100 * 2e-6 * abs(plain)


def test_fp16_simulation_is_the_plain_model(tiny):
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        logits = tiny.model(ids).logits
    reference = sequence_nll(logits, ids, 1).item()
    codec = build_method("fp16").build_storages({}, tiny.dims)
    assert simulated_nll(tiny, codec, ids).nll == pytest.approx(reference, rel=1e-6)
