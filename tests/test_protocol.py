"""The full-precision allowance (`--fp-window W`): every method keeps the same newest W tokens in fp16, under gptq,
prefill-decode and tail; the simulation still equals decoding through the packed cache; what a setting cannot honour
is refused in one line before any model loads; records say which allowance ran and how many keys each query saw in
full precision."""

from __future__ import annotations

import json

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.eval.ppl import decoded_nll, fp_keys_per_query, simulated_nll
from kvcal.methods.registry import build_method
from kvcal.models import load_model
from tests.test_calibquant import StepByStep, step_by_step_nll
from tests.test_cli import assert_one_line_error, kvcal


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", "float64")


@pytest.mark.parametrize("name,config", [("rtn", {"bits": 2}), ("kvquant", None), ("kivi", {"group_size": 8}),
                                         ("commvq", None)])
def test_a_named_window_replaces_the_methods_own(name, config):
    """--fp-window sets each method's own window field (KIVI's residual, ...), whatever the setting said."""
    from kvcal.methods.registry import all_methods

    cls = all_methods()[name]
    method = build_method(name, config if config is not None else dict(cls.test_config))
    for window in (0, 8, 128):
        windowed = method.with_fp_window(window)
        assert getattr(windowed, cls.fp_window_field) == window and windowed.own_fp_window() == window
    assert build_method("fp16").with_fp_window(128).name == "fp16"
    with pytest.raises(KvcalError, match="--fp-window must be >= 0") as err:
        method.with_fp_window(-1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["rtn", "kivi"])
def test_simulation_equals_decode_under_a_window(tiny, name):
    """A window the method did not have before (rtn) and one that replaces its own (kivi): gptq simulation = decoding
    through the packed cache (torch references, float64), and the window moves the NLL."""
    method = build_method(name, {"bits": 2} if name == "rtn" else {"bits": 2, "group_size": 8})
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    nll = {}
    for window in (0, 8):
        codec = method.with_fp_window(window).build_storages({}, tiny.dims)
        simulated = simulated_nll(tiny, codec, ids)
        decoded = decoded_nll(tiny, codec, ids, batch_size=2, backend="packed")
        assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)
        nll[window] = simulated.nll
    assert abs(nll[0] - nll[8]) > 1e-6


def test_fp_keys_per_query_by_hand(tiny):
    """rtn with the newest 8 tokens in fp16, 48-token windows (gptq): query i sees min(i + 1, 8) keys in fp16, so the
    mean over the 47 scored queries is (1 + ... + 8 + 39 x 8) / 47. KIVI strict with 8-token blocks keeps its
    unfinished block: (i + 1) mod 8. Tail with prefix 4, block 32, window 8: query i sees i + 1 - 24."""
    rtn = build_method("rtn", {"bits": 2, "fp_window": 8}).build_storages({}, tiny.dims)
    assert fp_keys_per_query(rtn, 48) == pytest.approx((36 + 39 * 8) / 47)
    kivi = build_method("kivi", {"bits": 2, "group_size": 8, "residual": 0}).build_storages({}, tiny.dims)
    assert fp_keys_per_query(kivi, 48) == pytest.approx(sum((i + 1) % 8 for i in range(47)) / 47)
    assert fp_keys_per_query(rtn, 48, "tail", 36, 4, 8) == pytest.approx(sum(i + 1 - 24 for i in range(36, 47)) / 11)
    fp16 = build_method("fp16").build_storages({}, tiny.dims)
    assert fp_keys_per_query(fp16, 48) == pytest.approx(sum(range(1, 48)) / 47)


@pytest.mark.parametrize("setting", ["kivi", "calibquant-remap"])
def test_tail_window_equals_an_independent_reference(tiny, setting):
    """Under tail, --fp-window W keeps the newest W prefill tokens out of the block: an exact prefill of [0, E), the
    block [S, E - W) replaced by its reconstruction (the remap on that span only), then the tail token by token."""
    prefix, block, length, window = 3, 32, 44, 8
    if setting == "kivi":
        method, tau = build_method("kivi", {"bits": 2, "group_size": 8, "residual": 0}), None
    else:
        method, tau = build_method("calibquant", {"bits": 2, "tau1": 0.5, "tau2": 2.0}), (0.5, 2.0)
    codec = method.with_fp_window(window).build_storages({}, tiny.dims)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(7))
    end = prefix + block
    expected = step_by_step_nll(tiny, StepByStep(codec, prefix, end - window, tau), ids, end)
    got = simulated_nll(tiny, codec, ids, "tail", end, prefix_len=prefix, fp_window=window)
    assert got.tokens == length - end - 1
    assert got.nll == pytest.approx(expected, rel=1e-9)
    whole = simulated_nll(tiny, codec, ids, "tail", end, prefix_len=prefix)
    assert abs(got.nll - whole.nll) > 1e-6


def test_tail_window_decodes_as_it_simulates(tiny):
    """CalibQuant's bulk regime with a window: the cache compresses the prompt but its newest W tokens, and decoding
    the tail through it scores what the tail simulation scores."""
    prefix, block, length, window = 4, 32, 48, 8
    method = build_method("calibquant", {"bits": 2, "tau1": 0.5, "tau2": 2.0, "sink": prefix})
    codec = method.with_fp_window(window).build_storages({}, tiny.dims)
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(4))
    end = prefix + block
    simulated = simulated_nll(tiny, codec, ids, "tail", end, prefix_len=prefix, fp_window=window)
    decoded = decoded_nll(tiny, codec, ids, "tail", end, batch_size=2, prefix_len=prefix, fp_window=window)
    assert decoded.tokens == simulated.tokens == 2 * (length - end - 1)
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)
    with pytest.raises(KvcalError, match="pass --fp-window 8") as err:
        decoded_nll(tiny, codec, ids, "tail", end, prefix_len=prefix, fp_window=0)
    assert "\n" not in str(err.value)


def test_cli_records_the_allowance_and_refuses_what_a_setting_cannot_honour(tmp_path, wikitext_dir):
    base = ("eval", "ppl", "--model", "tiny-llama", "--seqlen", 64, "--nsamples", 2, "--data-dir", wikitext_dir)
    out = tmp_path / "r.json"
    result = kvcal(*base, "--recipe", "kivi-2bit", "--set", "group_size=8", "--fp-window", 0, "--json", out)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["fp_window"] == 0 and record["fp_window_named"] and record["config"]["residual"] == 0
    assert record["setting"].endswith("-fp0")
    assert record["fp_keys_per_query"] == pytest.approx(sum((i + 1) % 8 for i in range(63)) / 63, abs=1e-3)
    # refused before the model loads: a bulk-only setting outside tail, a negative window, a window the tail's block
    # cannot hold
    for args, needle in (
        (("--method", "calibquant", "--set", "tau1=0", "--set", "tau2=3", "--fp-window", 0),
         "evaluate it with --protocol tail"),
        (("--method", "rtn", "--fp-window", -1), "--fp-window must be >= 0"),
        (("--method", "rtn", "--protocol", "tail", "--block-len", 16, "--fp-window", 16), "keeps the whole tail"),
    ):
        assert_one_line_error(kvcal(*base, "--model", "no-such-model", *args), needle)


def test_every_shipped_recipe_takes_both_allowances():
    """Every shipped recipe runs under --fp-window 0 and 128 (its own window replaced: the record's config shows it),
    under gptq unless its method compresses prompts in bulk only (CalibQuant's regime), which runs under tail."""
    from kvcal.recipes import recipe_names, resolve

    names = recipe_names()
    assert {"evict-1bit", "kivi-1bit", "rtn-int1", "commvq-2bit", "calibquant-1bit"} <= set(names)
    for name in names:
        method, _, _ = resolve(None, name, None)
        for window in (0, 128):
            windowed = method.with_fp_window(window)
            if method.fp_window_field:
                assert windowed.own_fp_window() == window, name
            try:
                windowed.check_protocol("gptq")
            except KvcalError as err:
                assert method.name == "calibquant" and "--protocol tail" in str(err), name
                windowed.check_protocol("tail")
