"""The contract every registered method keeps, run over the registry (a method added later is covered without editing
this file): on tiny models of each family, calibrate (methods that learn) -> artifact round trip -> the simulated
perplexity equals the decode-mode perplexity through the packed cache (torch references, float64) -> a batch of
left-padded rows equals each row alone -> bad input gives one-line errors. Its Triton kernels against their torch
references (the interpreter) are in tests/test_kernels.py, driven by the same registry (kernel_cases.run_cache_checks).

A method's `test_config` (a class attribute) holds small settings for tiny models (budgets, group sizes that fit 2 KV
heads of 16 channels); its defaults are kept otherwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvcal.accounting import cache_footprint
from kvcal.artifact import load_artifact
from kvcal.compare import Tolerance, compare_artifacts
from kvcal.errors import KvcalError
from kvcal.eval.ppl import decoded_nll, simulated_nll
from kvcal.methods.registry import all_methods, build_method, storages_for_artifact
from kvcal.models import load_model
from kvcal.models.adapter import cache_kwargs, forward_with_cache
from kvcal.runtime.cache import KvcalCache

METHODS = sorted(all_methods())
FAMILIES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-olmo2",
            "tiny-phi3"]


def _method(name: str):
    cls = all_methods()[name]
    return build_method(name, dict(cls.test_config))



@pytest.fixture(scope="module")
def artifacts(text_file):
    """(method name, family) -> the artifact's path, calibrated on the float64 tiny model once per module."""
    from kvcal.calib.run import run_calibration

    made = {}

    def get(name: str, family: str):
        if (name, family) not in made:
            loaded = load_model(family, "float64")
            out = text_file.parent / f"{name}-{family}.safetensors"
            run_calibration(loaded, _method(name), out, str(text_file), nsamples=3, seqlen=64)
            made[name, family] = out
        return made[name, family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_simulation_equals_decode_through_the_packed_cache(name, family, artifacts):
    """Artifact round trip, then the gptq simulation and token-by-token decoding through the packed storage (torch
    references, float64) score the same tokens with the same NLL (on Gemma 2 with its soft-capped scores; a method
    that remaps scores itself is refused there in one line by both)."""
    loaded = load_model(family, "float64")
    try:
        path = artifacts(name, family)
    except KvcalError as err:  # a calibration that simulates its remapped scores (CalibQuant's tau search)
        assert loaded.dims.attn_softcap is not None and "remaps attention scores" in str(err)
        return
    art = load_artifact(path)
    assert art.method == name and art.config == _method(name).config()
    method, storages = storages_for_artifact(art, loaded, path)
    again = load_artifact(path)  # the file reads back the same tensors
    assert again.tensors.keys() == art.tensors.keys()
    assert all(torch.equal(again.tensors[k], t) for k, t in art.tensors.items())
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    if loaded.dims.attn_softcap is not None and storages.remaps_scores:  # Gemma 2: a remap and a soft-cap refused
        for run in (lambda: simulated_nll(loaded, storages, ids),
                    lambda: decoded_nll(loaded, storages, ids, batch_size=2, backend="packed")):
            with pytest.raises(KvcalError, match="remaps attention scores") as err:
                run()
            assert "\n" not in str(err.value)
        return
    simulated = simulated_nll(loaded, storages, ids)
    decoded = decoded_nll(loaded, storages, ids, batch_size=2, backend="packed")
    assert decoded.tokens == simulated.tokens == 2 * 47
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)
    # prefill-decode: the 20-token prompt in full precision, then written to the packed cache at once (pre-RoPE keys
    # rotated at the prefilled slots' offsets), the rest decoded into it; on three families that differ where that
    # write could (standard RoPE, q/k norms, sliding-window layers with their own RoPE), to keep the suite's time
    if family not in ("tiny-llama", "tiny-qwen3", "tiny-gemma3"):
        return
    simulated = simulated_nll(loaded, storages, ids, protocol="prefill-decode", prompt_len=20)
    decoded = decoded_nll(loaded, storages, ids, protocol="prefill-decode", prompt_len=20, batch_size=2,
                          backend="packed")
    assert decoded.tokens == simulated.tokens == 2 * 27  # targets after the first decoded token
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)


# storages the packed cache cannot window (their one-line refusals): CalibQuant remaps the scores of all of a row's
# compressed tokens together; XQuant on Gemma 3 rebuilds keys and values from the layer inputs across layers
WINDOW_REFUSED = {"calibquant", "xquant"}


@pytest.mark.parametrize("name", METHODS)
def test_compressed_sliding_windows_decode_as_they_simulate(name, artifacts):
    """--compress-local on tiny-gemma3 (two local layers with an 8-token window, then a global one), strict (no
    full-precision window, so the local layers attend to compressed tokens): the simulation and decoding through the
    packed cache (torch references, float64), whose local layers mask what left the window and drop it in whole
    units, give the same NLL over 48 tokens, six windows' worth, and the flag moves it; a storage that cannot hold a
    bounded window is refused in one line."""
    loaded = load_model("tiny-gemma3", "float64")
    path = artifacts(name, "tiny-gemma3")
    _, storages = storages_for_artifact(load_artifact(path), loaded, path, fp_window=0)
    storages.compress_local = True
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    protocol = "tail" if storages.bulk_only else "gptq"
    kwargs = dict(prompt_len=40, prefix_len=storages.policy.sink) if protocol == "tail" else {}
    if name in WINDOW_REFUSED:
        with pytest.raises(KvcalError, match="--compress-local") as err:
            decoded_nll(loaded, storages, ids, protocol, batch_size=2, backend="packed", **kwargs)
        assert "\n" not in str(err.value)
        return
    simulated = simulated_nll(loaded, storages, ids, protocol, **kwargs)
    decoded = decoded_nll(loaded, storages, ids, protocol, batch_size=2, backend="packed", **kwargs)
    assert decoded.tokens == simulated.tokens > 0
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)
    if not storages.lossless and name != "evict":  # the flag moves the NLL (eviction keeps more than the window)
        storages.compress_local = False
        assert abs(simulated_nll(loaded, storages, ids, protocol, **kwargs).nll - simulated.nll) > 1e-6


@pytest.mark.parametrize("name", ["rtn", "kivi", "kvquant", "commvq"])
def test_a_left_padded_batch_equals_each_row_alone_in_compressed_windows(name, artifacts):
    """--compress-local with rows of different lengths (the second left-padded by 6): each row's window starts
    elsewhere in its packed slots (Packed.first), and generate() gives that row what it gives alone (float64, torch
    references; strict, so the windows hold compressed tokens)."""
    loaded = load_model("tiny-gemma3", "float64")
    path = artifacts(name, "tiny-gemma3")
    _, codec = storages_for_artifact(load_artifact(path), loaded, path, fp_window=0)
    codec.compress_local = True
    prompt = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :6] = 0
    kwargs = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=258)
    layers = loaded.dims.num_layers
    both_cache = KvcalCache(codec, layers, "packed")
    both = loaded.model.generate(prompt, attention_mask=mask, **cache_kwargs(loaded.model, both_cache), **kwargs)
    for row, start in ((0, 0), (1, 6)):  # the first row's window starts past its first slot, the second's at it
        alone = loaded.model.generate(prompt[row:row + 1, start:],
                                      **cache_kwargs(loaded.model, KvcalCache(codec, layers, "packed")), **kwargs)
        assert torch.equal(both.sequences[row, 15:], alone.sequences[0, 15 - start:])
        for a, b in zip(both.logits, alone.logits):
            torch.testing.assert_close(a[row], b[0], rtol=0, atol=1e-9)
    local = both_cache.layers[0]
    assert local.window == loaded.dims.sliding_window and local.first[0] != local.first[1]
    # bounded: 34 tokens in the first row, of which a window and less than a drop unit more (and the 6 tokens by which
    # the rows differ) stay packed
    assert local.shift > 0 and max(local.compressed) <= local.window + local.drop_unit - 1 + 6


ABLATIONS = [(name, label) for name in METHODS for label in all_methods()[name].test_ablations]


@pytest.mark.parametrize("name,label", ABLATIONS)
def test_every_ablation_decodes_as_it_simulates(name, label, text_file):
    """Each ablation a method declares (`test_ablations`) runs through the same storage path as the method: its
    storages, the simulation through their reconstruction, decoding through the cache (torch references, float64,
    tiny Llama) with the same NLL."""
    from kvcal.calib.run import run_calibration

    cls = all_methods()[name]
    loaded = load_model("tiny-llama", "float64")
    method = build_method(name, {**cls.test_config, **cls.test_ablations[label]})
    out = text_file.parent / f"{name}-ablation-{label}.safetensors"
    run_calibration(loaded, method, out, str(text_file), nsamples=3, seqlen=64)
    _, storages = storages_for_artifact(load_artifact(out), loaded, out)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    protocol = "tail" if storages.bulk_only else "gptq"
    kwargs = dict(prompt_len=40, prefix_len=storages.policy.sink) if protocol == "tail" else {}
    simulated = simulated_nll(loaded, storages, ids, protocol, **kwargs)
    decoded = decoded_nll(loaded, storages, ids, protocol, batch_size=2, backend="reference", **kwargs)
    assert decoded.tokens == simulated.tokens > 0
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)


@pytest.mark.parametrize("name", METHODS)
def test_a_left_padded_batch_equals_each_row_alone(name, artifacts):
    """generate() over a batch whose second row is left-padded gives that row what it gives alone (float64)."""
    loaded = load_model("tiny-llama", "float64")
    _, codec = storages_for_artifact(load_artifact(artifacts(name, "tiny-llama")), loaded)
    backend = "packed"
    prompt = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :6] = 0
    kwargs = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=258)
    layers = loaded.dims.num_layers
    both = loaded.model.generate(prompt, attention_mask=mask, **cache_kwargs(
        loaded.model, KvcalCache(codec, layers, backend)), **kwargs)
    alone = loaded.model.generate(prompt[1:, 6:], **cache_kwargs(loaded.model, KvcalCache(codec, layers, backend)),
                                  **kwargs)
    assert torch.equal(both.sequences[1, 15:], alone.sequences[0, 9:])
    for a, b in zip(both.logits, alone.logits):
        torch.testing.assert_close(a[1], b[0], rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", METHODS)
def test_bad_input_is_one_line(name, artifacts):
    """An artifact made for another model, an unknown config key and a value of the wrong type: each a KvcalError of
    one line that names what is wrong."""
    cls = all_methods()[name]
    with pytest.raises(KvcalError, match="unknown config key 'no_such_key'") as err:
        build_method(name, {"no_such_key": 1})
    assert "\n" not in str(err.value)
    # a field the test config leaves at its default if there is one, else one it sets (kivi, evict set them all);
    # only a method with no config at all (fp16) has nothing to get wrong
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.name in cls.test_config)
    assert fields or name == "fp16"
    if fields:
        with pytest.raises(KvcalError, match=f"config key '{fields[0].name}'") as err:
            build_method(name, {**cls.test_config, fields[0].name: [1, 2]})
        assert "\n" not in str(err.value)
    other = load_model("tiny-qwen3", "float64")
    with pytest.raises(KvcalError, match="was calibrated for a model with") as err:
        storages_for_artifact(load_artifact(artifacts(name, "tiny-llama")), other, "a.safetensors")
    assert "\n" not in str(err.value)


GOLDEN = Path(__file__).parent / "golden"
# what two calibrations of the same artifact may differ by on two CPUs (float64 tiny models: BLAS kernels round
# differently); diagnostics are listed, never a difference
GOLDEN_TOLERANCE = Tolerance(rtol=1e-6, atol=1e-9)
# CommVQ's key EM assigns each vector to its nearest codeword: near ties flip with that rounding, and the flipped
# assignments move the codebooks and the value coder trained after them further (measured: 5.8e-5 in a codebook,
# 2e-4 of its largest entry, and 8e-7 in the coder's weights, the same code on an AVX-512 CPU against the golden's)
GOLDEN_KIND_TOLERANCE = {"commvq": {"codebook": Tolerance(rtol=1e-2, atol=1e-3),  # largest |entry|: 0.29
                                    "weights": Tolerance(rtol=1e-4, atol=1e-7)}}


@pytest.mark.parametrize("name", METHODS)
def test_calibration_reproduces_the_golden_artifact(name, artifacts):
    """Each method's calibration on the tiny Llama (float64, fixed text and seed) against its committed golden artifact
    (tests/golden), compared by tensor kind, as a user's CI compares theirs: a change that moves what a method learns
    shows here. If the change is meant, regenerate: python tests/golden/regenerate.py"""
    golden = GOLDEN / f"{name}-tiny-llama.safetensors"
    assert golden.is_file(), f"no golden artifact for {name}: python tests/golden/regenerate.py {name}"
    result = compare_artifacts(load_artifact(artifacts(name, "tiny-llama")), load_artifact(golden),
                               GOLDEN_KIND_TOLERANCE.get(name, {}), GOLDEN_TOLERANCE)
    assert not result.failures, result.summary() + "; " + "; ".join(f"{d.where}: {d.what}" for d in result.failures)


def _held_bytes(cache, dims) -> float:
    """Bytes the cache holds for its tokens, as bits per element counts them: each packed buffer in proportion to the
    slots that hold tokens, and every full-precision token (sinks, window, unfinished blocks) as fp16 K and V."""
    fp16_token = 2 * 2 * dims.num_kv_heads * dims.head_dim  # K and V of one token and layer, in fp16
    total = 0.0
    for layer in cache.layers:
        if not getattr(layer, "buffers", None):
            total += fp16_token * layer.kept  # a lossless layer (a sliding-window one keeps its newest tokens)
            continue
        capacity, compressed = layer.batch * layer.capacity, sum(layer.compressed)
        packed = sum(t.numel() * t.element_size() for t in layer.buffers.values())
        total += packed * compressed / capacity + fp16_token * int(layer.fp_valid.sum())
    return total


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("fp_window", [0, 8])
@pytest.mark.parametrize("name", METHODS)
def test_the_bytes_the_cache_holds_equal_the_footprint(name, fp_window, family, artifacts):
    """Bits per element count everything the cache holds: after prefills of several lengths (past and between blocks)
    and decode steps, under strict (--fp-window 0) and a window, the packed buffers' bytes for the compressed tokens
    plus every full-precision token in fp16 equal the method's footprint formula at that length (on tiny-gemma3 the
    global layer's, plus the local layers' windows)."""
    loaded = load_model(family, "float64")
    path = artifacts(name, family)
    art = load_artifact(path)
    try:
        method, codec = storages_for_artifact(art, loaded, path, fp_window=fp_window)
    except KvcalError:  # a method whose format cannot keep this allowance refuses it (tested where it is defined)
        pytest.skip(f"{name} refuses --fp-window {fp_window}")
    if not codec.lossless and codec[0] is None:
        pytest.skip(f"{name}'s test setting has no packed storage")
    if codec.bulk_only:
        pytest.skip(f"{name}'s test setting compresses prompts in bulk only")
    if not codec.lossless and not codec[0].holds_format:
        pytest.skip(f"{name} on {family} keeps its reconstruction, not its format")
    assert_cache_bytes_equal_footprint(loaded, method, codec)


def assert_cache_bytes_equal_footprint(loaded, method, codec) -> None:
    """After prefills of 20, 37 and 48 tokens and 0, 5 and 11 decode steps, `_held_bytes` of the packed cache equals
    the method's footprint at that length."""
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(5))
    for prefill, steps in ((20, 0), (37, 5), (48, 11)):
        cache = KvcalCache(codec, loaded.dims.num_layers, "packed")
        with torch.inference_mode():
            forward_with_cache(loaded.model, ids[:, :prefill], cache)
            for t in range(prefill, prefill + steps):
                forward_with_cache(loaded.model, ids[:, t : t + 1], cache)
        tokens = prefill + steps
        expected = sum(cache_footprint(method, loaded.dims, tokens).values())
        assert _held_bytes(cache, loaded.dims) == pytest.approx(expected, rel=1e-9), tokens
