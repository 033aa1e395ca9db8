"""CalibQuant: the quantizer on a hand-computed case, post-scaling against explicit dequantization, the score remap by
hand, the two guards, the tau search's argmin, the tail protocol (fp16 = the plain model's NLL of the tail; a
compressing codec = an independent token-by-token decode), config errors, and calibrate + eval on smollm2-135m.

Expected numbers come from hand computations written out in each test, not from the code under test.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.eval.ppl import sequence_nll, simulated_nll
from kvcal.methods import build_method
from kvcal.methods.calibquant import storage as cq
from kvcal.methods.calibquant.calibrate import choose_tau
from kvcal.models.attention import NEG


def codec(dims, **config):
    return build_method("calibquant", config).build_storages({}, dims)


# -- the quantizer ------------------------------------------------------------------------------------------------


def test_quantizer_by_hand():
    """K [1 seq, 1 head, 4 tokens, 2 channels], channel-wise over the 4 tokens."""
    k = torch.tensor([[0.0, -2.0], [1.0, -1.0], [2.0, 0.0], [3.0, 5.0]], dtype=torch.float64)[None, None]
    dims = type("D", (), {"num_layers": 1, "num_heads": 1})
    # 2 bits, c = 1: channel 0 in [0, 3], step 1: exact. channel 1 in [-2, 5], step 7/3: (x + 2) / (7/3) =
    # 0, 3/7, 6/7, 3 -> codes 0, 0, 1, 3 -> -2, -2, -2 + 7/3, 5
    # (the step is stored as float32, §7.14: 7/3 rounded to float32, s below)
    c2 = codec(dims, bits=2, calibration=False)
    k_hat, v_hat = c2[0].reconstruct(k, k)
    s = float(torch.tensor(7 / 3, dtype=torch.float32))
    expected = torch.tensor([[0.0, -2.0], [1.0, -2.0], [2.0, -2 + s], [3.0, -2 + 3 * s]], dtype=torch.float64)
    torch.testing.assert_close(k_hat[0, 0], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(v_hat, k_hat, rtol=0, atol=0)  # v channel-wise too (c = 1 for both at 2 bits)
    # 1 bit with the code's shrink c_K = 0.5 [C]: channel 0 range [0, 1.5], step 1.5: x / 1.5 = 0, .67, 1.33, 2 ->
    # codes 0, 1, 1, 1 -> 0, 1.5, 1.5, 1.5; channel 1 [-1, 2.5], step 3.5: (x + 1) / 3.5 = -1/3.5, 0, 1/3.5, 6/3.5 ->
    # clamp/round 0, 0, 0, 1 -> -1, -1, -1, 2.5. c_V = 0.3: channel 1 [-0.6, 1.5], step 2.1: (x + .6) / 2.1 =
    # <0, <0, .29, 2.67 -> 0, 0, 0, 1 -> -0.6, -0.6, -0.6, 1.5; channel 0 [0, 0.9]: x / 0.9 -> 0, 1, 1, 1
    c1 = codec(dims, bits=1, calibration=False)
    k_hat, v_hat = c1[0].reconstruct(k, k)
    torch.testing.assert_close(k_hat[0, 0], torch.tensor([[0.0, -1.0], [1.5, -1.0], [1.5, -1.0], [1.5, 2.5]],
                                                         dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(v_hat[0, 0], torch.tensor([[0.0, -0.6], [0.9, -0.6], [0.9, -0.6], [0.9, 1.5]],
                                                         dtype=torch.float64), rtol=0, atol=2e-7)  # float32 ranges
    # ties round half to even [C] §7.12: channel [0, 1, 2] at 1 bit, c = 1: 1 / 2 = 0.5 -> code 0
    x = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)[None, None, :, None]
    rec, _ = codec(dims, bits=1, calibration=False, k_range_scale=1.0)[0].reconstruct(x, x)
    assert rec.flatten().tolist() == [0.0, 0.0, 2.0]


def test_value_range_ablations_and_groups():
    dims = type("D", (), {"num_layers": 1, "num_heads": 1})
    # 3 tokens x 3 channels, 1 bit, c = 1: each value goes to the nearer end of its range (0.5 of the step rounds
    # half to even, to the lower end), so per-token, per-channel and global ranges give three different answers
    v = torch.tensor([[0.0, 4.0, 1.0], [1.0, 2.0, 3.0], [2.0, 0.0, 4.0]], dtype=torch.float64)[None, None]
    # per token (KIVI-style): [0, 4], [1, 3], [0, 4]
    _, rec = codec(dims, bits=1, calibration=False, v_ranges="token", v_range_scale=1.0)[0].reconstruct(v, v)
    assert rec[0, 0].tolist() == [[0.0, 4.0, 0.0], [1.0, 1.0, 3.0], [0.0, 0.0, 4.0]]
    # per channel: [0, 2], [0, 4], [1, 4] (3 is 2/3 of the way up: to 4)
    _, rec = codec(dims, bits=1, calibration=False, v_ranges="channel", v_range_scale=1.0)[0].reconstruct(v, v)
    assert rec[0, 0].tolist() == [[0.0, 4.0, 1.0], [0.0, 0.0, 4.0], [2.0, 0.0, 4.0]]
    # global: one range [0, 4] over the block
    _, rec = codec(dims, bits=1, calibration=False, v_ranges="global", v_range_scale=1.0)[0].reconstruct(v, v)
    assert rec[0, 0].tolist() == [[0.0, 4.0, 0.0], [0.0, 0.0, 4.0], [0.0, 0.0, 4.0]]
    # key groups along the tokens: with groups of 2 tokens every channel's range in each group is its two values
    # (exact); one group of 4: channel 0 in [0, 3], channel 1 in [0, 6]
    k = torch.tensor([[0.0, 4.0], [1.0, 2.0], [3.0, 0.0], [2.0, 6.0]], dtype=torch.float64)[None, None]
    rec, _ = codec(dims, bits=1, calibration=False, group_tokens=2, k_range_scale=1.0)[0].reconstruct(k, k)
    assert rec[0, 0].tolist() == k[0, 0].tolist()
    rec, _ = codec(dims, bits=1, calibration=False, group_tokens=4, k_range_scale=1.0)[0].reconstruct(k, k)
    assert rec[0, 0].tolist() == [[0.0, 6.0], [0.0, 0.0], [3.0, 0.0], [3.0, 6.0]]


def test_degenerate_channel_guard():
    """§7.9: a constant channel (beta' = alpha') reconstructs to itself, not NaN; the step floor is
    1e-6 max(|alpha'|, |beta'|, 1)."""
    x = torch.tensor([[3.0, 0.0], [3.0, 0.0], [3.0, 0.0]], dtype=torch.float64)[None, None]
    alpha, beta = cq.ranges(x, "channel", 1.0)
    codes, step, minimum = cq.quantize(x, alpha, beta, 1)
    assert step.flatten().tolist() == pytest.approx([3e-6, 1e-6], rel=1e-12)
    assert codes.abs().sum() == 0
    assert torch.equal(cq.fake_quantize(x, 1, "channel", 1.0), x)
    # shrunk by 0.5, the channel of 3s lies above beta' = 1.5: code 1, reconstructed as alpha' + the floor step
    rec = cq.fake_quantize(x, 1, "channel", 0.5)
    assert rec[0, 0, :, 0].tolist() == pytest.approx([1.5 + 1.5e-6] * 3, rel=1e-12)
    assert rec[0, 0, :, 1].tolist() == [0.0] * 3


# -- post-scaling ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_post_scaling_equals_explicit_dequantization(bits):
    g = torch.Generator().manual_seed(bits)
    k = torch.randn(2, 3, 50, 16, dtype=torch.float64, generator=g) * torch.linspace(0.2, 4, 16, dtype=torch.float64)
    v = torch.randn(2, 3, 50, 16, dtype=torch.float64, generator=g)
    q = torch.randn(2, 3, 4, 16, dtype=torch.float64, generator=g)
    scale = 16**-0.5
    (ka, kb), (va, vb) = cq.ranges(k, "channel", 0.5), cq.ranges(v, "channel", 0.3)
    k_codes, k_step, k_min = cq.quantize(k, ka, kb, bits)
    v_codes, v_step, v_min = cq.quantize(v, va, vb, bits)
    assert k_codes.min() >= 0 and k_codes.max() <= 2**bits - 1 and torch.equal(k_codes, k_codes.round())
    k_deq, v_deq = k_codes * k_step + k_min, v_codes * v_step + v_min
    explicit = q @ k_deq.transpose(-1, -2) * scale
    post = cq.post_scaled_scores(q, k_codes, k_step, k_min, scale)
    assert (post - explicit).abs().max() < 1e-12
    w = torch.softmax(explicit, -1)[..., :50] * 0.7  # weights over the block need not sum to 1
    assert (cq.post_scaled_output(w, v_codes, v_step, v_min) - w @ v_deq).abs().max() < 1e-12


# -- the remap ------------------------------------------------------------------------------------------------------


def test_remap_by_hand():
    """Scores 1, 3, 5 on compressed keys and 10 on a full-precision one, tau = (0, 3): gamma 1, delta 5, slope
    (4 + 0 - 3) / 4 = 1/4: g = 1, 1.5, 2; the full-precision score stays 10. tau = (1, 1): slope 1, shifted by -1."""
    scores = torch.tensor([1.0, 3.0, 5.0, 10.0], dtype=torch.float64)[None, None, None]
    compressed = torch.tensor([True, True, True, False])[None, None, None]
    out, rows, clamps = cq.remap(scores, compressed, torch.tensor(0.0), torch.tensor(3.0))
    assert out.flatten().tolist() == pytest.approx([1.0, 1.5, 2.0, 10.0], abs=1e-8)
    assert (rows, clamps) == (1, 0)
    out, _, _ = cq.remap(scores, compressed, torch.tensor(1.0), torch.tensor(1.0))
    assert out.flatten().tolist() == pytest.approx([0.0, 2.0, 4.0, 10.0], abs=1e-8)
    # the image of [gamma, delta] is [gamma - tau1, delta - tau2]
    out, _, _ = cq.remap(scores, compressed, torch.tensor(0.5), torch.tensor(2.0))
    assert out[..., 0].item() == pytest.approx(0.5) and out[..., 2].item() == pytest.approx(3.0)


def test_slope_guard():
    """§7.10: delta - gamma = 1 < tau2 - tau1 = 3 would give slope -2 (the ranking reversed): clamped to 0, every
    compressed score becomes gamma - tau1, and the row is counted. A row with no compressed key is left alone."""
    scores = torch.tensor([[1.0, 2.0, 7.0], [4.0, 6.0, 9.0]], dtype=torch.float64)[None, None]
    compressed = torch.tensor([[True, True, False], [False, False, False]])[None, None]
    out, rows, clamps = cq.remap(scores, compressed, torch.tensor(0.0), torch.tensor(3.0))
    assert out[0, 0].tolist() == [[1.0, 1.0, 7.0], [4.0, 6.0, 9.0]]
    assert (rows, clamps) == (1, 1)


def test_the_remap_runs_in_the_simulation_and_the_cache(tiny):
    """The storages count remapped rows in the gptq simulation; the remap moves the NLL (the contract test's simulate
    == decode through the cache then has teeth for the remap)."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    on = codec(tiny.dims, bits=1, group_tokens=8, sink=2, tau1=0.0, tau2=3.0)
    off = codec(tiny.dims, bits=1, group_tokens=8, sink=2, calibration=False)
    with_remap, without = simulated_nll(tiny, on, ids).nll, simulated_nll(tiny, off, ids).nll
    assert cq.remap_counts(on)[0] > 0 and abs(with_remap - without) > 1e-3


# -- the tau search -------------------------------------------------------------------------------------------------


def test_choose_tau_argmin_and_ties():
    grid = [0.0, 1.0, 2.0]
    table = torch.tensor([[3.0, 2.0, 5.0], [4.0, 2.5, 6.0], [1.5, 7.0, 8.0]])
    assert choose_tau(table, grid) == (2, 0)
    tied = torch.tensor([[2.0, 2.0, 3.0], [2.0, 3.0, 3.0], [3.0, 3.0, 3.0]])
    # (0, 0), (0, 1), (1, 0) tie: tau2 - tau1 = 0, 1, -1 -> (1, 0)
    assert choose_tau(tied, grid) == (1, 0)


def test_tau_search_picks_the_argmin_of_its_table(tmp_path):
    """Calibrate on a tiny model: the stored tau is the argmin of the stored table, and the table's entry there equals
    the tail-protocol NLL recomputed on the same windows."""
    from kvcal.artifact import load_artifact
    from kvcal.calib.run import run_calibration
    from kvcal.data import calibration_windows, tokenize
    from kvcal.models import load_model

    loaded = load_model("tiny-llama", "float64")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{(i * 31) % 97} v{(i * 17) % 13}." for i in range(2000)))
    method = build_method("calibquant", {"bits": 1, "tau_grid": "0,1,3"})
    out = tmp_path / "cq.safetensors"
    run_calibration(loaded, method, out, str(text), nsamples=2, seqlen=64)
    art = load_artifact(out)
    search = art.header["info"]["tau_search"]
    table = torch.tensor(search["table"])
    assert table.shape == (3, 3) and search["window_layout"] == {"prefix": 1, "block": 48, "tail": 15}
    i, j = divmod(int(table.argmin()), 3)
    tau = art.header["info"]["tau"]
    assert (tau["tau1"], tau["tau2"]) == (search["tau1_values"][i], search["tau2_values"][j])
    assert torch.equal(art.tensors["layers.1.k.tau1"], torch.full((loaded.dims.num_heads,), tau["tau1"]))
    assert torch.equal(art.tensors["layers.0.k.tau2"], torch.full((loaded.dims.num_heads,), tau["tau2"]))
    windows = calibration_windows(tokenize(loaded.tokenizer, text.read_text()), 2, 64, 0)
    again = simulated_nll(loaded, build_method("calibquant", {"bits": 1}).build_storages(art.tensors, loaded.dims),
                          windows, "tail", 49, prefix_len=1)
    assert again.nll / again.tokens == pytest.approx(table[i, j].item(), abs=1e-6)
    # a random tiny model: quantization need not cost NLL, but the references are on the same windows
    assert math.isfinite(search["fp16_nll"]) and math.isfinite(search["uncalibrated_nll"])
    assert search["uncalibrated_nll"] != pytest.approx(search["table"][i][j], abs=1e-6)


# -- the tail protocol ---------------------------------------------------------------------------------------------


def test_tail_protocol_fp16_is_the_plain_nll_of_the_tail(tiny):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        logits = tiny.model(ids).logits
    reference = sequence_nll(logits, ids, 31).item()  # prefix 6 + block 24: targets 31 .. 39
    got = simulated_nll(tiny, build_method("fp16").build_storages({}, tiny.dims), ids, "tail", 30, prefix_len=6)
    assert got.tokens == 2 * 9
    assert got.nll == pytest.approx(reference, rel=1e-6)


class StepByStep:
    """An independent tail-protocol reference: exact prefill of [0, E) with its own K/V store, the block [S, E)
    replaced by the codec's reconstruction, then one query at a time with explicit scores, the remap of Eq. 7 written
    out here (slope clamped at 0)."""

    def __init__(self, codec, start, end, tau=None):
        self.codec, self.start, self.end, self.tau = codec, start, end, tau
        self.k, self.v = {}, {}

    def attend(self, inp):
        q, k = inp.rotated()
        layer, v = inp.layer_idx, inp.v
        groups = q.shape[1] // k.shape[1]
        if layer not in self.k:
            t = q.shape[2]
            scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * inp.scale
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), NEG)
            out = torch.softmax(scores, -1) @ v.repeat_interleave(groups, 1)
            k_hat, v_hat = self.codec[layer].reconstruct(k[:, :, self.start:self.end], v[:, :, self.start:self.end])
            self.k[layer], self.v[layer] = k.clone(), v.clone()
            self.k[layer][:, :, self.start:self.end], self.v[layer][:, :, self.start:self.end] = k_hat, v_hat
            return out
        self.k[layer] = torch.cat([self.k[layer], k], 2)
        self.v[layer] = torch.cat([self.v[layer], v], 2)
        scores = q @ self.k[layer].repeat_interleave(groups, 1).transpose(-1, -2) * inp.scale
        if self.tau is not None:
            tau1, tau2 = self.tau
            block = scores[..., self.start:self.end]
            gamma, delta = block.amin(-1, keepdim=True), block.amax(-1, keepdim=True)
            slope = ((delta - gamma + tau1 - tau2) / (delta - gamma + 1e-8)).clamp_min(0)
            scores = scores.clone()
            scores[..., self.start:self.end] = slope * (block - gamma) + gamma - tau1
        return torch.softmax(scores, -1) @ self.v[layer].repeat_interleave(groups, 1)


def step_by_step_nll(loaded, reference: StepByStep, ids, end: int) -> float:
    """NLL of the tail [end + 1, T) through `reference`: an exact prefill of [0, end), then one token at a time."""
    logits = []
    with torch.inference_mode(), loaded.adapter.use(reference):
        logits.append(loaded.model(ids[:, :end], use_cache=False).logits)
        for t in range(end, ids.shape[1]):
            logits.append(loaded.model(ids[:, t:t + 1], position_ids=torch.tensor([[t]]), use_cache=False).logits)
    return sequence_nll(torch.cat(logits, 1), ids, end + 1).item()


@pytest.mark.parametrize("setting", ["calibquant-remap", "calibquant-1bit", "kivi"])
def test_tail_protocol_equals_an_independent_token_by_token_decode(setting):
    from kvcal.models import load_model

    loaded = load_model("tiny-llama", "float64")
    prefix, block, length = 3, 24, 36
    if setting == "kivi":
        method, tau = build_method("kivi", {"bits": 2, "group_size": 8, "residual": 8}), None
    elif setting == "calibquant-1bit":
        method, tau = build_method("calibquant", {"bits": 1, "calibration": False}), None
    else:
        method, tau = build_method("calibquant", {"bits": 2, "tau1": 0.5, "tau2": 2.0}), (0.5, 2.0)
    codec_ = method.build_storages({}, loaded.dims)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(7))
    end = prefix + block
    expected = step_by_step_nll(loaded, StepByStep(codec_, prefix, end, tau), ids, end)
    got = simulated_nll(loaded, codec_, ids, "tail", end, prefix_len=prefix)
    assert got.tokens == length - end - 1
    assert got.nll == pytest.approx(expected, rel=1e-9)
    exact = simulated_nll(loaded, build_method("fp16").build_storages({}, loaded.dims), ids, "tail", end,
                          prefix_len=prefix)
    assert abs(got.nll - exact.nll) > 1e-4  # the block was compressed


def _every_method():
    from kvcal.methods.registry import all_methods

    return sorted(all_methods())


@pytest.mark.parametrize("name", _every_method())
def test_tail_protocol_runs_every_method(name):
    """The tail protocol is generic: every registered method (its test_config; calibrated on the tiny model where it
    learns) scores the tail's targets, and every compressing one moves the NLL away from fp16's."""
    from kvcal.calib.capture import capture
    from kvcal.methods.registry import all_methods
    from kvcal.models import load_model

    loaded = load_model("tiny-llama", "float64")
    method = build_method(name, dict(all_methods()[name].test_config))
    tensors = {}
    if method.learns or method.needs_artifact():
        calibration = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
        with capture(loaded, calibration, method.capture_needs()) as store:
            tensors = method.calibrate(loaded, store)[0]
    codec_ = method.build_storages(tensors, loaded.dims)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(9))
    got = simulated_nll(loaded, codec_, ids, "tail", 52, prefix_len=4)
    exact = simulated_nll(loaded, build_method("fp16").build_storages({}, loaded.dims), ids, "tail", 52, prefix_len=4)
    assert got.tokens == 2 * 11 and math.isfinite(got.nll)
    assert codec_.lossless or abs(got.nll - exact.nll) > 1e-6


# -- errors --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config,needle", [
    ({"bits": 3}, "bits must be one of 1, 2, 4, 8"),
    ({"v_ranges": "rows"}, "v_ranges must be one of"),
    ({"tau1": 1.0}, "both tau1 and tau2"),
    ({"bits": 4, "tau1": 0.0, "tau2": 3.0}, "apply only with the score remap"),
    ({"tau_grid": "0,x"}, "tau_grid must be comma-separated numbers"),
    ({"tau_grid": "-1,2"}, "tau_grid must hold finite numbers >= 0"),
    ({"tau_grid": "0,inf"}, "tau_grid must hold finite numbers >= 0"),
    ({"tau1": float("nan"), "tau2": 0.0}, "tau1 and tau2 must be finite numbers >= 0"),
    ({"tau1": 1.0, "tau2": float("inf")}, "tau1 and tau2 must be finite numbers >= 0"),
    ({"k_range_scale": 1.5}, "k_range_scale must be in (0, 1]"),
    ({"group_tokens": -1}, "must be >= 0"),
])
def test_bad_config_is_one_line(config, needle):
    with pytest.raises(KvcalError) as err:
        build_method("calibquant", config)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_one_value_tau_grid_may_be_written_as_a_number():
    """`--set tau_grid=2` (YAML reads a number) is the text "2", not a type error; a list is still refused."""
    from kvcal.methods.registry import parse_sets

    assert build_method("calibquant", parse_sets(["tau_grid=2"])).tau_grid == "2"
    with pytest.raises(KvcalError, match="tau_grid' of method calibquant expects str"):
        build_method("calibquant", parse_sets(["tau_grid=[1, 2]"]))


def test_whole_block_codec_refuses_token_by_token_protocols(tiny):
    """group_tokens 0 has no token-by-token rule: the gptq simulation refuses it in one line; the cache takes it (the
    bulk regime), and the decode-mode tail protocol refuses codecs without one, or with other sinks than the prefix."""
    from kvcal.eval.ppl import decoded_nll
    from kvcal.runtime.cache import KvcalCache

    c = codec(tiny.dims, bits=1, calibration=False)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with pytest.raises(KvcalError, match="evaluate it with --protocol tail") as err:
        simulated_nll(tiny, c, ids)
    assert "\n" not in str(err.value)
    assert KvcalCache(c, 2, "reference").storages is c and KvcalCache(c, 2).storages is c
    kivi = build_method("kivi", {"group_size": 8}).build_storages({}, tiny.dims)
    for other, needle in ((kivi, "compress the prompt in bulk"), (c, "differs from the storages' 32")):
        with pytest.raises(KvcalError, match=needle) as err:
            decoded_nll(tiny, other, ids, "tail", 14, prefix_len=2)
        assert "\n" not in str(err.value)
    with pytest.raises(KvcalError, match="needs its calibrated tau"):
        codec(tiny.dims, bits=1)
    with pytest.raises(KvcalError, match="not a multiple of the method's 8-token blocks"):
        simulated_nll(tiny, build_method("kivi", {"group_size": 8}).build_storages({}, tiny.dims), ids, "tail", 14,
                      prefix_len=2)


def test_tail_protocol_cli_errors(wikitext_dir):
    from tests.test_cli import assert_one_line_error, kvcal

    base = ("eval", "ppl", "--method", "fp16", "--model", "tiny-llama", "--seqlen", 64, "--data-dir", wikitext_dir)
    kivi = ("eval", "ppl", "--method", "kivi", "--set", "group_size=8", "--model", "tiny-llama", "--seqlen", 64,
            "--data-dir", wikitext_dir)
    assert_one_line_error(kvcal(*kivi, "--protocol", "tail", "--mode", "decode"), "use --mode simulate")
    assert_one_line_error(kvcal(*base, "--prefix-len", 4), "apply to --protocol tail only")
    assert_one_line_error(kvcal(*base, "--protocol", "tail", "--block-len", 70), "the tail protocol needs")


def test_bits_per_element_by_hand():
    """smollm2 shapes (30 layers, 3 KV heads, d 64), 4096 tokens, 1 bit, group_tokens 0, sink 32: 4064 tokens coded at
    1 bit, one fp32 (step, min) pair per channel for K and V per head and layer, 32 tokens fp16."""
    from kvcal.accounting import bits_per_element
    from kvcal.models import ModelDims
    from kvcal.quant.rope import RopeSpec

    dims = ModelDims(family="llama", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                     rope=RopeSpec(head_dim=64, theta=1e5))
    elements = 2 * 4096 * 30 * 3 * 64
    codes = 2 * 4064 * 30 * 3 * 64 * 1
    stats = 30 * 3 * 2 * 64 * 2 * 32
    fp = 2 * 32 * 30 * 3 * 64 * 16
    got = bits_per_element(build_method("calibquant", {"bits": 1}), dims)
    assert got.bits_per_element == pytest.approx((codes + stats + fp) / elements)


# -- end to end ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_calibrate_then_eval_tail_on_smollm2(tmp_path, wikitext_dir, smollm2):
    from tests.test_cli import kvcal

    out = tmp_path / "cq.safetensors"
    cal = kvcal("calibrate", "--method", "calibquant", "--set", "tau_grid=0,3", "--model", "smollm2-135m",
                "--data-dir", wikitext_dir, "--nsamples", 1, "--seqlen", 256, "--out", out)
    assert cal.returncode == 0, cal.stderr
    shown = kvcal("inspect", out, "--all")
    assert shown.returncode == 0 and "tau_search" in shown.stdout
    records = {}
    for name, args in (("cq", ("--artifact", out)), ("fp16", ("--method", "fp16"))):
        result = tmp_path / f"{name}.json"
        ev = kvcal("eval", "ppl", *args, "--data-dir", wikitext_dir, "--seqlen", 256, "--nsamples", 1,
                   "--protocol", "tail", "--json", result)
        assert ev.returncode == 0, ev.stderr
        records[name] = json.loads(result.read_text())
    cq_, fp = records["cq"], records["fp16"]
    # seqlen 256: prefix 4, block 192, tail 60: 59 targets
    assert cq_["protocol"] == "tail" and cq_["tail_layout"] == {"prefix": 4, "block": 192, "tail": 60,
                                                                "scored_targets_per_window": 59}
    assert cq_["tokens"] == fp["tokens"] == 59
    assert fp["ppl"] < cq_["ppl"] < 50 * fp["ppl"] and math.isfinite(cq_["ppl"])


# -- the packed storage and the cache's bulk regime ---------------------------------------------------------------


def _storage_with(bits, group, tokens, taus=None, dtype=torch.float64, lengths=None, heads=2, dim=64, seed=0):
    """A CalibQuantStorage holding `tokens` random tokens per row (written by its torch reference)."""
    from kvcal.runtime.storage import Packed

    gen = torch.Generator().manual_seed(seed)
    storage = cq.CalibQuantStorage(bits, group, 0, 0.5 if bits == 1 else 1.0, 0.3 if bits == 1 else 1.0, taus)
    lengths = lengths or [tokens]
    cap = max(lengths)
    buffers = {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in storage.buffers(len(lengths), cap, heads, dim).items()}
    packed = Packed(buffers, torch.tensor(lengths, dtype=torch.int32), heads, dim, cap)
    written = []
    for b, n in enumerate(lengths):
        k = (torch.randn(n, heads, dim, generator=gen) * 2).to(dtype)
        v = torch.randn(n, heads, dim, generator=gen).to(dtype)
        storage.write_reference(packed, k, v, torch.full((n,), b), torch.arange(n))
        written.append((k, v))
    return storage, packed, written


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_round_trip_at_each_width(bits):
    """Codes packed at their width (32 / b per int32 word) come back unchanged, and the storage's buffers hold D b / 32
    words per token and head."""
    from kvcal.quant.packing import pack_codes, unpack_codes

    codes = torch.randint(0, 2**bits, (5, 3, 64), generator=torch.Generator().manual_seed(bits))
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.shape[-1] == 64 * bits // 32
    assert torch.equal(unpack_codes(words, bits, 64), codes)
    storage, packed, _ = _storage_with(bits, 0, 7)
    assert packed["k_codes"].shape == (1, 2, 7, 64 * bits // 32)
    assert storage.bytes_per_token(2, 64) == 2 * 2 * 64 * bits / 8  # the bulk regime: ranges are per row, not token


@pytest.mark.parametrize("group", [0, 16])
def test_storage_reads_what_the_simulation_reconstructs(group):
    """The packed codes and float32 ranges read back to exactly the simulation's reconstruction (one range group over
    the row, or groups of 16 tokens)."""
    storage, packed, written = _storage_with(1, group, 48)
    k, v = storage.read(packed, 0, torch.float64)
    n, grp = 48, group or 48
    for got, x, axis_scale in ((k, written[0][0], 0.5), (v, written[0][1], 0.3)):
        x = x.transpose(0, 1).reshape(2, n // grp, grp, 64)
        torch.testing.assert_close(got, cq.fake_quantize(x, 1, "channel", axis_scale).reshape(2, n, 64), rtol=0,
                                   atol=0)


@pytest.mark.parametrize("bits,group", [(1, 0), (2, 16), (4, 0)])
def test_post_scaled_attention_equals_explicit_dequantization(bits, group):
    """The storage's attention (post-scaled: never dequantized, plus the remap) equals softmax over the explicitly
    dequantized keys (read) with the simulation's remap, and the full-precision part in the same softmax."""
    from kvcal.models.attention import remapped_attention
    from kvcal.runtime.decode import FullPrecision, merge_reference

    gen = torch.Generator().manual_seed(5)
    taus = (torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5, 0.0, 3.0, 1.5]), torch.tensor([3.0, 3.0, 0.0, 1.0, 2.0, 0.0, 3.0,
                                                                                   0.5]))
    storage, packed, _ = _storage_with(bits, group, 0, taus, lengths=[32, 48])
    q = torch.randn(2, 8, 64, generator=gen, dtype=torch.float64)
    fp = FullPrecision(torch.randn(2, 2, 5, 64, generator=gen, dtype=torch.float64),
                       torch.randn(2, 2, 5, 64, generator=gen, dtype=torch.float64),
                       torch.tensor([[True] * 5, [True, False, True, True, False]]))
    out = merge_reference(storage.attend_reference(q, packed, 0.125, fp), 2, q.dtype)
    for b in range(2):
        k, v = storage.read(packed, b, torch.float64)
        keys = torch.cat([k, fp.k[b][:, fp.valid[b]]], 1)[None]
        values = torch.cat([v, fp.v[b][:, fp.valid[b]]], 1)[None]
        compressed = torch.arange(keys.shape[2]) < k.shape[1]

        def remap(scores, c):
            return cq.remap(scores, c, taus[0][None, :, None, None].double(), taus[1][None, :, None, None].double())[0]

        bias = torch.zeros(keys.shape[2], dtype=torch.float64)
        expected = remapped_attention(q[b][None, :, None], keys, values, bias, compressed, 0.125, remap)[0, :, 0]
        torch.testing.assert_close(out[b], expected, rtol=1e-10, atol=1e-12)
    assert storage.counts.tolist()[0] == 16  # 2 rows x 8 query heads remapped


def test_remap_by_hand_through_the_storage():
    """One KV head, one query head, head_dim 2, 1 bit, codes set by hand: key codes (1, 0), (0, 1), (1, 1) with step
    (2, 4) and minimum (-1, -1) are the keys (1, -1), (-1, 3), (1, 3); q = (1, 1), scale 1: scores 0, 2, 4. tau
    (1, 3): gamma 0, delta 4, slope (4 + 1 - 3) / (4 + 1e-8) ~ 0.5, g = slope x - 1 ~ -1, 0, 1. Values: codes (0, 1), (1, 0),
    (1, 1), step (2, 2), minimum (0, -1): v = (0, 1), (2, -1), (2, 1). Output = sum softmax(-1, 0, 1)_j v_j."""
    from kvcal.runtime.decode import merge_reference
    from kvcal.runtime.storage import Packed

    storage = cq.CalibQuantStorage(1, 0, 0, 1.0, 1.0, (torch.tensor([1.0]), torch.tensor([3.0])))
    buffers = {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in storage.buffers(1, 3, 1, 2).items()}
    buffers["k_codes"][0, 0, :, 0] = torch.tensor([0b01, 0b10, 0b11], dtype=torch.int32)  # code d at bit d
    buffers["v_codes"][0, 0, :, 0] = torch.tensor([0b10, 0b01, 0b11], dtype=torch.int32)
    buffers["k_step"][0, 0, 0] = torch.tensor([2.0, 4.0])
    buffers["k_min"][0, 0, 0] = torch.tensor([-1.0, -1.0])
    buffers["v_step"][0, 0, 0] = torch.tensor([2.0, 2.0])
    buffers["v_min"][0, 0, 0] = torch.tensor([0.0, -1.0])
    packed = Packed(buffers, torch.tensor([3], dtype=torch.int32), 1, 2, 3)
    out = merge_reference(storage.attend_reference(torch.tensor([[[1.0, 1.0]]], dtype=torch.float64), packed, 1.0,
                                                   None), 1, torch.float64)
    slope = 2 / (4 + 1e-8)  # [C]'s epsilon in the denominator
    e = [math.exp(-1), math.exp(2 * slope - 1), math.exp(4 * slope - 1)]
    expected = [(e[1] * 2 + e[2] * 2) / sum(e), (e[0] - e[1] + e[2]) / sum(e)]
    assert out[0, 0].tolist() == pytest.approx(expected, rel=1e-12)
    assert storage.counts.tolist() == [1, 0]
    # tau (0, 3): slope (4 - 3) / 4 > 0; tau (0, 5): slope (4 - 5) / 4 < 0 -> clamped: every score gamma - 0 = 0
    storage = cq.CalibQuantStorage(1, 0, 0, 1.0, 1.0, (torch.tensor([0.0]), torch.tensor([5.0])))
    out = merge_reference(storage.attend_reference(torch.tensor([[[1.0, 1.0]]], dtype=torch.float64), packed, 1.0,
                                                   None), 1, torch.float64)
    assert out[0, 0].tolist() == pytest.approx([4 / 3, 1 / 3], rel=1e-12)  # the plain mean of the three values
    assert storage.counts.tolist() == [1, 1]


@pytest.mark.parametrize("config", [{"bits": 1, "tau1": 0.5, "tau2": 2.0}, {"bits": 2, "calibration": False}])
def test_decode_mode_tail_protocol_equals_the_simulation(config):
    """The cache's bulk regime: prefill S + P tokens in full precision, [S, S + P) compressed once (the packed
    storage's torch references, through both backends), the tail decoded token by token: the same NLL as the tail
    simulation (float64), padded batch rows included."""
    from kvcal.eval.ppl import decoded_nll
    from kvcal.models import load_model

    tiny = load_model("tiny-llama", "float64")
    c = build_method("calibquant", {**config, "sink": 3}).build_storages({}, tiny.dims)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(7))
    simulated = simulated_nll(tiny, c, ids, "tail", 27, prefix_len=3)
    exact = simulated_nll(tiny, build_method("fp16").build_storages({}, tiny.dims), ids, "tail", 27, prefix_len=3)
    assert abs(simulated.nll - exact.nll) > 1e-3  # the block was compressed
    for backend in ("packed", "reference"):
        decoded = decoded_nll(tiny, c, ids, "tail", 27, batch_size=2, backend=backend, prefix_len=3)
        assert decoded.tokens == simulated.tokens == 2 * 12
        assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)
    rows, _ = cq.cache_counts(c)
    # layers x Hq x steps x rows, once per backend (both run the storages' attention)
    assert rows == (2 * 4 * 12 * 2 * 2 if config.get("tau1") is not None else 0)


def test_generated_tokens_stay_in_full_precision():
    """generate() through the bulk cache: the left-padded prompt's tokens after each row's sinks are packed once; the
    generated tokens join the full-precision part (which grows past its first allocation), the packed part never
    changes, and the padded row gets what it gets alone."""
    from kvcal.models import load_model
    from kvcal.models.adapter import cache_kwargs
    from kvcal.runtime.cache import KvcalCache

    tiny = load_model("tiny-llama", "float64")
    c = build_method("calibquant", {"bits": 1, "sink": 2, "tau1": 0.0, "tau2": 3.0}).build_storages({}, tiny.dims)
    prompt = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :6] = 0
    kwargs = dict(max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=258)
    cache = KvcalCache(c, tiny.dims.num_layers)
    both = tiny.model.generate(prompt, attention_mask=mask, **cache_kwargs(tiny.model, cache), **kwargs)
    layer = cache.layers[0]
    assert layer.compressed == [13, 7] and layer.lengths.tolist() == [13, 7]  # prompt after 2 sinks, per row
    generated = len(both.logits) - 1  # the last token is not fed back
    assert layer.ring_count == [generated, generated] and layer.ring_capacity >= generated > 16
    assert int(layer.fp_valid.sum()) == 2 * (2 + generated)
    alone_cache = KvcalCache(c, tiny.dims.num_layers)
    alone = tiny.model.generate(prompt[1:, 6:], **cache_kwargs(tiny.model, alone_cache), **kwargs)
    assert torch.equal(both.sequences[1, 15:], alone.sequences[0, 9:])
    for a, b in zip(both.logits, alone.logits):
        torch.testing.assert_close(a[1], b[0], rtol=0, atol=1e-9)


def test_kernels_match_the_references_under_the_interpreter():
    """The write kernel leaves the buffers as the torch reference does, bit for bit (fp16, bf16, fp32 inputs; 1 to 8
    bits; one range group over the run or groups of 16; a constant channel), and the decode kernels (pass 1 and 2)
    give the reference's output and slope counts (ATTENTION_CASES' calibquant rows run in tests/test_kernels.py)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KVCAL_DISABLE_TRITON", None)
    proc = subprocess.run([sys.executable, "-c", "from tests.test_calibquant import _interpreted_checks as c; "
                           "print('CHECKS', c())"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("CHECKS ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    result = eval(line[0][len("CHECKS "):])  # noqa: S307 - our own repr of a dict of numbers
    bad = {k: v for k, v in result.items() if v is not True}
    assert len(result) == 3 * 4 * 2 + 3 and not bad, bad


def _interpreted_checks() -> dict:
    from kvcal.runtime import kernels as K
    from kvcal.runtime.decode import merge_reference
    from kvcal.runtime.storage import Packed
    from tests.kernel_cases import build_step, rel_err

    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for bits in (1, 2, 4, 8):
            for group in (0, 16):
                storage = cq.CalibQuantStorage(bits, group, 0, 0.5, 0.3, None)
                n = 48 if group else 37
                k = (torch.randn(n, 2, 64, generator=gen) * 2).to(dtype)
                v = torch.randn(n, 2, 64, generator=gen).to(dtype)
                k[:, 0, 3] = 1.5  # a constant channel: the step floor
                rows, slots = torch.full((n,), 1), torch.arange(n) + (16 if group else 0)  # groups 1 to 3
                made = []
                for write in (storage.write_reference, storage.write_triton):
                    buffers = {name: torch.full(s.shape, 7, dtype=s.dtype)
                               for name, s in storage.buffers(2, 96, 2, 64).items()}
                    write(Packed(buffers, torch.zeros(2, dtype=torch.int32), 2, 64, 96), k, v, rows, slots)
                    made.append(buffers)
                out[f"write_{str(dtype)[6:]}_{bits}_g{group}"] = all(torch.equal(made[0][x], made[1][x])
                                                                    for x in made[0])
    taus = (torch.tensor([0.0, 3.0, 1.0, 0.5, 2.0, 0.0, 3.0, 1.0]), torch.tensor([3.0, 0.0, 3.0, 2.5, 2.0, 0.0, 1.0,
                                                                                   3.0]))
    for name, bits, group, dtype, tol in (("b1_bulk_one_token_row_bf16", 1, 0, torch.bfloat16, 1e-2),
                                          ("b2_g16_fp16", 2, 16, torch.float16, 2e-3),
                                          ("b8_bulk_one_token_row_fp32", 8, 0, torch.float32, 1e-5)):
        lengths = [32, 0, 64] if group else [37, 1, 70]
        storage, packed, _ = _storage_with(bits, group, 0, taus, torch.float32, lengths, seed=3)
        q, fp = build_step(3, 8, 2, 64, 19, dtype)
        ref = merge_reference(storage.attend_reference(q, packed, 0.125, fp), 3, q.dtype)
        counted = storage.counts.clone()
        storage.counts.zero_()
        got = K.merge_triton(storage.attend_triton(q, packed, 0.125, fp, num_splits=2, block_t=16), q)
        out[name] = bool(rel_err(got, ref, per_head=True) <= tol and torch.equal(storage.counts, counted)
                         and (counted[1] > 0) == (1 in lengths))  # a one-token row clamps where tau2 > tau1
    return out
