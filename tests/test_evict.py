"""evict, StreamingLLM's rule (Xiao et al. 2023): the first S tokens and the newest W stay, every other token is
dropped. The simulation and decoding against attention with an explicit StreamingLLM mask written out here, a dropped
token's zero influence, bits per element by hand, and the full-precision allowance it accepts (up to its window).
tests/test_contract.py runs it with every registered method (simulation = decode on four families, a left-padded
batch, bad input, its golden artifact, the bytes the cache holds = the footprint)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcal.accounting import bits_per_element
from kvcal.errors import KvcalError
from kvcal.eval.ppl import decoded_nll, first_target, sequence_nll, simulated_nll
from kvcal.eval.simulate import SimulatedAttention
from kvcal.methods.registry import build_method
from kvcal.models import load_model
from kvcal.models.adapter import forward_with_cache
from kvcal.recipes import load_recipe
from kvcal.runtime.cache import KvcalCache
from tests.test_cli import assert_one_line_error, kvcal

SINK, WINDOW = 2, 8


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", "float64")


def _evict(sink=SINK, window=WINDOW):
    return build_method("evict", {"sink": sink, "window": window})


class StreamingMask:
    """Independent reference: plain softmax attention (float64) under a StreamingLLM mask built entry by entry. Query i
    (its own token already cached) sees key j <= i when j is a sink (j < S) or among the newest W (j >= i + 1 - W); the
    queries of a full-precision prompt of P tokens (prefill-decode) see every earlier key."""

    def __init__(self, sink: int, window: int, prompt: int = 0):
        self.sink, self.window, self.prompt = sink, window, prompt

    def attend(self, inp):
        q, k = inp.rotated()
        length = q.shape[2]
        keep = torch.zeros(length, length, dtype=torch.bool)
        for i in range(length):
            for j in range(i + 1):
                keep[i, j] = i < self.prompt or j < self.sink or j >= i + 1 - self.window
        groups = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * inp.scale
        weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
        return weights @ inp.v.repeat_interleave(groups, 1)


@pytest.mark.parametrize("protocol,prompt", [("gptq", 0), ("prefill-decode", 20)])
def test_simulation_and_decoding_equal_an_explicit_streaming_mask(tiny, protocol, prompt):
    """float64: the simulation, the cache (torch references, through both backends) score the NLL
    of attention under the explicit mask; with 48-token windows, S 2 and W 8, tokens are dropped (fp16 differs)."""
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), tiny.adapter.use(StreamingMask(SINK, WINDOW, prompt)):
        logits = tiny.model(ids, use_cache=False).logits
    expected = sequence_nll(logits, ids, first_target(protocol, prompt)).item()
    codec = _evict().build_storages({}, tiny.dims)
    simulated = simulated_nll(tiny, codec, ids, protocol, prompt)
    assert simulated.nll == pytest.approx(expected, rel=1e-9)
    for backend in ("packed", "reference"):
        decoded = decoded_nll(tiny, codec, ids, protocol, prompt, batch_size=2, backend=backend)
        assert decoded.tokens == simulated.tokens
        assert decoded.nll == pytest.approx(expected, rel=1e-9), backend
    fp16 = simulated_nll(tiny, build_method("fp16").build_storages({}, tiny.dims), ids, protocol, prompt)
    assert abs(fp16.nll - expected) > 1e-3


def _one_layer_model():
    from kvcal.models import as_loaded
    from kvcal.models.tiny import build_random_model, tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers = 1
    return as_loaded(build_random_model(config, torch.float64, "cpu"))


def _logits(loaded, codec, ids, decode: bool) -> torch.Tensor:
    with torch.inference_mode():
        if not decode:
            with loaded.adapter.use(SimulatedAttention(codec)):
                return loaded.model(ids, use_cache=False).logits
        cache = KvcalCache(codec, loaded.dims.num_layers, "packed")
        return torch.cat([forward_with_cache(loaded.model, ids[:, t : t + 1], cache).logits
                          for t in range(ids.shape[1])], 1)


@pytest.mark.parametrize("decode", [False, True], ids=["simulation", "decode"])
def test_a_dropped_token_has_no_influence(decode):
    """One layer, so position i's logits depend on the keys and values its attention weighs and on its own token only.
    Changing token 6 (its key and value) leaves the logits of every query that dropped it (i >= 6 + W) exactly as they
    were, and moves those of the queries that keep it in their window (6 <= i < 6 + W); changing a sink (token 1)
    moves every later position."""
    loaded = _one_layer_model()
    codec = _evict().build_storages({}, loaded.dims)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(4))
    base = _logits(loaded, codec, ids, decode)
    for token, dropped_from in ((6, 6 + WINDOW), (1, None)):
        changed = ids.clone()
        changed[0, token] = (ids[0, token] + 101) % 256
        out = _logits(loaded, codec, changed, decode)
        for i in range(token, ids.shape[1]):
            same = torch.equal(out[0, i], base[0, i])
            assert same == (dropped_from is not None and i >= dropped_from), (token, i)


def test_bits_per_element_by_hand(tiny):
    """The fp16 K and V of the min(T, S + W) tokens kept, all layers: tiny Llama (2 layers, 2 KV heads of 16 channels)
    at S 2, W 8: 5 tokens = 5 x 2 x 2 bytes x 2 x 2 x 16 = 1280 bytes, 48 tokens = 10 kept = 2560 bytes; 10 x 16 bits
    / 4096 tokens = 0.0390625 bits per element. The recipes at 4096 tokens, whatever the model: 256, 512 and 1024
    tokens kept in 16 bits = 1, 2 and 4 bits per element."""
    method = _evict()
    assert method.footprint(tiny.dims, 5) == {"fp16_kept": 1280.0}
    assert method.footprint(tiny.dims, 48) == {"fp16_kept": 2560.0}
    assert bits_per_element(method, tiny.dims).bits_per_element == 0.0390625
    smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    llama8b = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
    for name, window, bits in (("evict-1bit", 252, 1.0), ("evict-2bit", 508, 2.0), ("evict-4bit", 1020, 4.0)):
        recipe = load_recipe(name)
        assert recipe.method == "evict" and recipe.config == {"sink": 4, "window": window}
        method = build_method(recipe.method, recipe.config)
        for dims in (smollm2, llama8b):
            assert bits_per_element(method, dims).bits_per_element == bits


def test_the_header_of_a_setting_below_half_a_bit_checks():
    """The artifact header holds bits per element to 6 decimals: the tiny setting's 0.0390625 is written 0.039062 and
    still matches its config; an edited header does not."""
    from pathlib import Path

    from kvcal.artifact import load_artifact
    from kvcal.methods.registry import check_artifact

    art = load_artifact(Path(__file__).parent / "golden" / "evict-tiny-llama.safetensors")
    assert art.header["bits_per_element"] == 0.039062
    check_artifact(art)
    art.header["bits_per_element"] = 0.04
    with pytest.raises(KvcalError, match="the header says 0.04 bits per element but its config gives 0.0390625"):
        check_artifact(art)


def test_full_precision_allowance_up_to_its_window():
    """Its window is its budget, not an allowance (own_fp_window 0): an allowance up to the window is already kept
    (the setting itself comes back), a larger one is refused in one line, also by the CLI before any model loads."""
    method = _evict()
    assert method.own_fp_window() == 0
    assert method.with_fp_window(0) is method and method.with_fp_window(WINDOW) is method
    with pytest.raises(KvcalError, match="evict keeps its newest 8 tokens .*--fp-window 9 asks for more") as err:
        method.with_fp_window(WINDOW + 1)
    assert "\n" not in str(err.value)
    with pytest.raises(KvcalError, match="--fp-window must be >= 0"):
        method.with_fp_window(-1)
    result = kvcal("eval", "ppl", "--method", "evict", "--set", "window=8", "--fp-window", 9, "--model",
                   "no-such-model")
    assert_one_line_error(result, "--fp-window 9 asks for more")


@pytest.mark.parametrize("config,message", [({"window": 0}, "evict window must be >= 1"),
                                            ({"sink": -1}, "evict sink must be >= 0")])
def test_impossible_settings_are_one_line(config, message):
    with pytest.raises(KvcalError, match=message) as err:
        build_method("evict", config)
    assert "\n" not in str(err.value)


def test_dropped_tokens_add_an_empty_split():
    """The storage's attention is the full-precision part's partials: what the generic reference makes of its
    (empty) dequantized rows, a split with m = -inf, l = 0, acc = 0, merges to exactly the same output."""
    from kvcal.runtime.decode import FullPrecision, fp_partials_reference, merge_reference
    from kvcal.runtime.storage import Packed, Storage

    storage = _evict().build_storages({}, type("D", (), {"num_layers": 1})())[0]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, generator=gen, dtype=torch.float64)
    fp = FullPrecision(torch.randn(2, 2, 10, 16, generator=gen, dtype=torch.float64),
                       torch.randn(2, 2, 10, 16, generator=gen, dtype=torch.float64), torch.rand(2, 10, generator=gen) > 0.3)
    specs = storage.buffers(2, 24, 2, 16)
    assert {name: (spec.shape, spec.nbytes()) for name, spec in specs.items()} == {"dropped": ((2, 24, 0), 0)}
    packed = Packed({name: torch.zeros(spec.shape, dtype=spec.dtype) for name, spec in specs.items()},
                    torch.tensor([17, 0], dtype=torch.int32), 2, 16, 24)
    ours = merge_reference(storage.attend_reference(q, packed, 0.25, fp), 2, q.dtype)
    generic = Storage.attend_reference(storage, q, packed, 0.25, fp)
    assert generic.splits == 2 and torch.isinf(generic.m[:, 0]).all() and not generic.l[:, 0].any()
    assert torch.equal(ours, merge_reference(generic, 2, q.dtype))
    assert torch.equal(ours, merge_reference(fp_partials_reference(q, fp, 0.25), 2, q.dtype))
