"""KVQuant: quantizers against hand-computed cases, calibration against independent references,
artifact round trip, bit accounting, and an end-to-end run on smollm2-135m."""

import json

import pytest
import torch
from sklearn.cluster import KMeans

from kvcal.accounting import bits_per_element
from kvcal.artifact import load_artifact
from kvcal.calib.capture import capture
from kvcal.calib.run import run_calibration
from kvcal.methods import build_method
from kvcal.methods.kvquant.storage import per_side_outliers
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model
from tests.test_cli import kvcal

LEVELS = torch.tensor([-1.0, -0.5, 0.25, 1.0])  # a 2-bit non-uniform table


def quantize_static(rows, lo, hi, encode, decode, sparse: bool):
    """KVQuant's per-channel quantization of token rows [B, T, C] through the packed quantizers (what the storage
    and the simulation share), outliers exact (the paper's simulation) or clamped."""
    from kvcal.quant.nonuniform import dequantize_lut_static, quantize_lut_static, range_params

    x = rows.reshape(-1, 1, rows.shape[-1])
    codes, idx, val = quantize_lut_static(x, lo, hi, encode, decode, 2, x.shape[-1] if sparse else 0, torch.float64)
    zero, scale = range_params(lo, hi)
    return dequantize_lut_static(codes, zero, scale, decode, 2, x.shape[-1], idx, val).reshape(rows.shape)


def quantize_dynamic(rows, encode, decode, per_side: int):
    """Per-token quantization of rows [B, T, C] (the dense range without each row's per_side largest and smallest
    elements, kept exact)."""
    from kvcal.quant.nonuniform import dequantize_lut_dynamic, quantize_lut_dynamic

    x = rows.reshape(-1, 1, rows.shape[-1])
    out = quantize_lut_dynamic(x, encode, decode, 2, per_side, residual_dtype=torch.float64)
    return dequantize_lut_dynamic(*out[:3], decode, 2, x.shape[-1], *out[3:]).reshape(rows.shape)


def test_static_per_channel_hand_computed():
    rows = torch.tensor([[[0.0, 3.0], [-2.0, 5.0], [0.6, 0.9]]])  # [B=1, T=3, C=2]
    lo, hi = torch.tensor([-1.0, 1.0]), torch.tensor([1.0, 4.0])
    # channel 0: zero 0, scale 1; channel 1: zero 2.5, scale 1.5
    # (0, 3) -> normalized (0, 1/3) -> levels (0.25, 0.25) -> (0.25, 2.875)
    # (-2, 5) -> outside the range: dense-and-sparse keeps them exact; without sparse they clamp
    # (0.6, 0.9): 0.6 is nearer 0.25 than 1.0 (midpoint 0.625) -> 0.25; 0.9 < lo = 1 is an outlier
    sparse = quantize_static(rows, lo, hi, LEVELS, LEVELS, sparse=True)
    torch.testing.assert_close(sparse, torch.tensor([[[0.25, 2.875], [-2.0, 5.0], [0.25, 0.9]]]))
    dense = quantize_static(rows, lo, hi, LEVELS, LEVELS, sparse=False)
    torch.testing.assert_close(dense[0, 1], torch.tensor([-1.0, 4.0]))
    torch.testing.assert_close(dense[0, 2], torch.tensor([0.25, 1.0]))
    # the decode table (Q-Norm) is read back at the encode table's nearest index
    shifted = quantize_static(rows, lo, hi, LEVELS, LEVELS + 0.1, sparse=True)
    torch.testing.assert_close(shifted[0, 0], torch.tensor([0.35, 3.025]))


def test_dynamic_per_token_hand_computed():
    rows = torch.tensor([[[0.0, 1.0, 2.0, 3.0, 100.0, -50.0]]])
    # one outlier per side (100, -50) stays exact; dense range [0, 3]: zero 1.5, scale 1.5
    # normalized (-1, -1/3, 1/3, 1) -> levels (-1, -0.5, 0.25, 1) -> (0, 0.75, 1.875, 3)
    out = quantize_dynamic(rows, LEVELS, LEVELS, per_side=1)
    torch.testing.assert_close(out, torch.tensor([[[0.0, 0.75, 1.875, 3.0, 100.0, -50.0]]]))
    no_sparse = quantize_dynamic(rows, LEVELS, LEVELS, per_side=0)
    assert no_sparse[0, 0, 4] == 100.0 and no_sparse[0, 0, 5] == -50.0  # extremes are levels +-1


def test_outlier_count_rule():
    assert per_side_outliers(0.01, 192) == 1  # SmolLM2: 1 + 1 of 192 (1.04%)
    assert per_side_outliers(0.01, 4096) == 21  # the official code's 21 per side for C = 4096
    assert per_side_outliers(0.0, 4096) == 0


def test_bits_per_element_hand_computed():
    from kvcal.models import ModelDims
    from kvcal.quant.rope import RopeSpec

    dims = ModelDims("llama", 30, 9, 3, 64, 576, RopeSpec(64, 1e5))
    report = bits_per_element(build_method("kvquant", {"bits": 3}), dims)
    # as the packed cache holds them, per stored token and tensor of C=192: 3-bit codes (64 x 3 = 192 bits: 6 whole
    # words per head); V scale+zero 32 bits (/2 over K and V); outliers in fixed slots of 32 bits (fp16 value, int16
    # index): K ceil(2 x 1% x 64) = 2 slots per head = 6 per token, V 1 + 1 per token; no pointers; the sink token (1
    # of 4096) in fp16 instead of codes.
    stored = 4095 / 4096
    expected = stored * (3 + 32 / 192 / 2 + (6 + 2) * 32 / 192 / 2) + 16 / 4096
    assert report.bits_per_element == pytest.approx(expected, rel=1e-6)
    # values per (token, head): 3 scale+zero pairs per token, and 1 + 1 outliers per head of 64 (6 per token)
    report = bits_per_element(build_method("kvquant", {"bits": 3, "value_scope": "head"}), dims)
    expected = stored * (3 + 3 * 32 / 192 / 2 + (6 + 6) * 32 / 192 / 2) + 16 / 4096
    assert report.bits_per_element == pytest.approx(expected, rel=1e-6)


def tiny_windows():
    return torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tiny_store():
    loaded = load_model("tiny-llama")
    store = capture(loaded, tiny_windows(), {"k", "v", "fisher"})
    yield loaded, store
    store.close()


def test_keys_ranges_are_percentiles_without_sinks(tiny_store):
    loaded, store = tiny_store
    method = build_method("kvquant", {"bits": 3, "outliers": 0.1, "sink": 2})
    tensors, info = method.calibrate(loaded, store)
    k = store.layer(1)["k"][store.token_positions >= 2].double().numpy()
    import numpy as np

    torch.testing.assert_close(tensors["layers.1.k.hi"].double(), torch.from_numpy(np.percentile(k, 95, axis=0)))
    torch.testing.assert_close(tensors["layers.1.k.lo"].double(), torch.from_numpy(np.percentile(k, 5, axis=0)))
    assert 0.05 < info["key_outlier_rate"][1] < 0.15


def reference_value_problem(store, layer=0, sink=1, head_dim=None, side="v"):
    """Normalized non-sink values (or, with side="k", keys normalized per token: the per_token ablation) of one
    layer and the three candidate k-means weights, recomputed independently of kvcal (float64 numpy); with
    head_dim, each head's part of a token is its own vector."""
    import numpy as np

    data = store.layer(layer)
    keep = store.token_positions >= sink
    v, f = data[side][keep].double(), data[f"fisher_{side}"][keep].double()
    if head_dim:
        v, f = v.reshape(-1, head_dim), f.reshape(-1, head_dim)
    lo, hi = v.min(1, keepdim=True).values, v.max(1, keepdim=True).values
    scale = (hi - lo) / 2
    xn = ((v - (hi + lo) / 2) / scale).flatten().numpy()
    weights = {"fisher_scale": (f * scale**2).flatten().numpy(), "fisher": f.flatten().numpy(), "none": np.ones(xn.size)}
    return xn, weights


def weighted_cost(xn, w, levels):
    import numpy as np

    levels = np.sort(np.asarray(levels, dtype=np.float64))
    nearest = levels[np.abs(xn[:, None] - levels[None]).argmin(1)]
    return float((w * (xn - nearest) ** 2).sum())


def test_value_datatype_solves_the_weighted_kmeans_problem(tiny_store):
    """For each weighting, the value table is as good a solution of sum w (x - Q(x))^2 over the
    normalized non-sink values as sklearn's weighted KMeans (the objective is flat near its optimum,
    so we compare costs, not centroids), and weighting matters in the expected direction."""
    loaded, store = tiny_store
    xn, weights = reference_value_problem(store)
    tables = {w: build_method("kvquant", {"bits": 2, "outliers": 0.0, "weighting": w, "qnorm": False})
              .calibrate(loaded, store)[0]["layers.0.v.encode"].double().numpy() for w in weights}
    for name, w in weights.items():
        sk = KMeans(4, n_init=10, random_state=0).fit(xn[:, None], sample_weight=w)
        assert weighted_cost(xn, w, tables[name]) <= weighted_cost(xn, w, sk.cluster_centers_[:, 0]) * 1.001
    # the unweighted table is clearly better for the unweighted objective than the Fisher one
    assert weighted_cost(xn, weights["none"], tables["none"]) < 0.995 * weighted_cost(xn, weights["none"], tables["fisher"])


def test_value_kmeans_weights_are_fisher_times_the_squared_token_scale(tiny_store, monkeypatch):
    """The weights the value k-means receives are F * s^2 with s each token's own half-range (recomputed in numpy by
    reference_value_problem): on the tiny store the F and F * s^2 tables nearly coincide, so only the weights
    themselves tell a value path that drops (or takes the keys') scale."""
    import numpy as np

    from kvcal.methods.kvquant import calibrate as kvq

    loaded, store = tiny_store
    xn, weights = reference_value_problem(store)
    fed = []

    def recording(values, w, bits, **options):
        fed.append((values.double().flatten().numpy(), None if w is None else w.double().flatten().numpy()))
        return datatype_tables(values, w, bits, **options)

    datatype_tables = kvq.datatype_tables
    monkeypatch.setattr(kvq, "datatype_tables", recording)
    build_method("kvquant", {"bits": 2, "outliers": 0.0, "qnorm": False}).calibrate(loaded, store)
    value_calls = [w for values, w in fed if values.size == xn.size and np.allclose(np.sort(values), np.sort(xn),
                                                                                    atol=1e-5)]
    assert len(value_calls) == 1
    assert np.allclose(np.sort(value_calls[0]), np.sort(weights["fisher_scale"]), rtol=1e-4, atol=0)
    assert not np.allclose(np.sort(weights["fisher"]), np.sort(weights["fisher_scale"]), rtol=0.1, atol=0)


def test_per_head_value_datatype_solves_the_per_head_problem(tiny_store):
    """value_scope=head normalizes each (token, head) vector by its own range: its table solves that
    problem as well as sklearn does, and clearly better than the per-token table does."""
    loaded, store = tiny_store
    xn, weights = reference_value_problem(store, head_dim=loaded.dims.head_dim)
    w = weights["fisher_scale"]
    config = {"bits": 2, "outliers": 0.0, "qnorm": False}
    per_head = build_method("kvquant", {**config, "value_scope": "head"}).calibrate(loaded, store)[0]
    per_token = build_method("kvquant", config).calibrate(loaded, store)[0]
    sk = KMeans(4, n_init=10, random_state=0).fit(xn[:, None], sample_weight=w)
    table = per_head["layers.0.v.encode"].double().numpy()
    assert weighted_cost(xn, w, table) <= weighted_cost(xn, w, sk.cluster_centers_[:, 0]) * 1.001
    assert weighted_cost(xn, w, table) < 0.99 * weighted_cost(xn, w, per_token["layers.0.v.encode"].double().numpy())


def test_per_token_key_ablation_normalizes_each_token(tiny_store):
    """key_granularity=per_token (digest R1's first row): no calibrated key ranges are stored, the key table solves
    the weighted k-means problem of keys normalized by each token's own min/max (rebuilt here in numpy) as well
    as sklearn does and clearly better than the per-channel table does, and the codec quantizes a key row onto
    that table between the row's own extremes."""
    loaded, store = tiny_store
    config = {"bits": 2, "outliers": 0.0, "qnorm": False}
    per_token = build_method("kvquant", {**config, "key_granularity": "per_token"}).calibrate(loaded, store)[0]
    per_channel = build_method("kvquant", config).calibrate(loaded, store)[0]
    assert "layers.0.k.lo" not in per_token and "layers.0.k.lo" in per_channel
    xn, weights = reference_value_problem(store, side="k")
    w = weights["fisher_scale"]
    table = per_token["layers.0.k.encode"].double().numpy()
    sk = KMeans(4, n_init=10, random_state=0).fit(xn[:, None], sample_weight=w)
    assert weighted_cost(xn, w, table) <= weighted_cost(xn, w, sk.cluster_centers_[:, 0]) * 1.001
    assert weighted_cost(xn, w, table) < 0.99 * weighted_cost(xn, w, per_channel["layers.0.k.encode"].double().numpy())

    codec = build_method("kvquant", {**config, "key_granularity": "per_token"}).build_storages(per_token, loaded.dims)
    k = torch.randn(1, loaded.dims.num_kv_heads, 5, loaded.dims.head_dim, generator=torch.Generator().manual_seed(1))
    rows = k.transpose(1, 2).flatten(2)  # [1, T, C]: one vector per token over all KV heads
    lo, hi = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
    levels = per_token["layers.0.k.decode"].float()
    expected_levels = (hi + lo) / 2 + (hi - lo) / 2 * levels  # the table mapped onto each token's range
    got = codec[0].reconstruct(k, k)[0].transpose(1, 2).flatten(2)
    distance = (got[..., None] - expected_levels[:, :, None, :]).abs().amin(-1)
    # every key lands on its own token's levels (to the fp16 rounding of the stored scale and zero; levels are
    # a third of the range apart at 2 bits, so another token's range would miss by far more)
    assert distance.max() < 1e-3 * (hi - lo).min()


@pytest.mark.parametrize("outliers", [0.0, 0.1])
def test_key_datatype_solves_the_weighted_kmeans_problem(tiny_store, outliers):
    """The key table solves sum w (x - Q(x))^2 over the normalized non-sink pre-RoPE keys inside their per-channel
    ranges, w = F s^2 with s the channel's half range (digest #1), as well as sklearn's weighted KMeans does; the
    problem is rebuilt here with numpy (min/max or 5/95 percentiles per channel, |x| <= 1), not with kvcal's code.
    Checked by mutation: a weight of F alone fails both cases, an inside mask of |x| <= 2 the 5/95 one."""
    import numpy as np

    loaded, store = tiny_store
    keep = (store.token_positions >= 1).numpy()
    data = store.layer(0)
    k, f = data["k"].double().numpy()[keep], data["fisher_k"].double().numpy()[keep]
    if outliers:
        lo, hi = np.percentile(k, 100 * outliers / 2, axis=0), np.percentile(k, 100 - 100 * outliers / 2, axis=0)
    else:
        lo, hi = k.min(0), k.max(0)
    scale = (hi - lo) / 2
    xn = (k - (hi + lo) / 2) / scale
    inside = np.abs(xn) <= 1
    w = (f * scale**2)[inside]
    xn = xn[inside]
    table = (build_method("kvquant", {"bits": 2, "outliers": outliers, "qnorm": False}).calibrate(loaded, store)[0]
             ["layers.0.k.encode"].double().numpy())
    sk = KMeans(4, n_init=10, random_state=0).fit(xn[:, None], sample_weight=w)
    cost = weighted_cost(xn, w, table)
    assert cost <= weighted_cost(xn, w, sk.cluster_centers_[:, 0]) * 1.001
    # the Fisher-only table solves a different problem: clearly worse on this one
    fisher_only = (build_method("kvquant", {"bits": 2, "outliers": outliers, "qnorm": False, "weighting": "fisher"})
                   .calibrate(loaded, store)[0]["layers.0.k.encode"].double().numpy())
    assert cost < weighted_cost(xn, w, fisher_only)


def test_post_rope_ablation_rotates_keys_as_the_model_does(tiny_store):
    """The pre_rope=false ablation (digest R3) calibrates on rotate_rows of the captured pre-RoPE keys: those must be
    the keys the model itself attends with, post-RoPE at each token's position (here from the model's own cos/sin,
    through a forward pass of window 0)."""
    from kvcal.methods.kvquant.calibrate import rotate_rows, to_rows
    from kvcal.models.adapter import StandardAttention

    loaded, store = tiny_store

    class KeepRotated(StandardAttention):
        def attend(self, inp):
            if inp.layer_idx == 1:
                self.k = inp.rotated()[1].detach()
            return super().attend(inp)

    handler = KeepRotated()
    with loaded.adapter.use(handler), torch.no_grad():
        loaded.model(tiny_windows()[:1], use_cache=False)
    rows = slice(0, 48)  # window 0
    got = rotate_rows(store.layer(1)["k"][rows], store.token_positions[rows], loaded.adapter.inv_freq, loaded.dims)
    want = to_rows(handler.k)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - store.layer(1)["k"][rows]).abs().max() > 1e-2  # the rotation did something


def test_int_datatype_ablation_is_uniform(tiny_store):
    """datatype=int (digest R4's first row): both tables are the 2^bits uniform levels on [-1, 1], whatever the
    weighting, and without Q-Norm decode equals encode."""
    loaded, store = tiny_store
    tensors = build_method("kvquant", {"bits": 3, "datatype": "int", "qnorm": False}).calibrate(loaded, store)[0]
    levels = torch.linspace(-1, 1, 8, dtype=torch.float64)
    for side in ("k", "v"):
        torch.testing.assert_close(tensors[f"layers.0.{side}.encode"].double(), levels)
        torch.testing.assert_close(tensors[f"layers.0.{side}.decode"].double(), levels)


def test_fisher_weighting_changes_the_datatype(tiny_store):
    loaded, store = tiny_store
    tables = {w: build_method("kvquant", {"bits": 2, "weighting": w}).calibrate(loaded, store)[0]["layers.0.k.encode"]
              for w in ("fisher_scale", "none")}
    assert (tables["fisher_scale"] - tables["none"]).abs().max() > 1e-3


def test_qnorm_restores_mean_and_std(tiny_store):
    loaded, store = tiny_store
    method = build_method("kvquant", {"bits": 2, "qnorm": True, "outliers": 0.0, "sink": 0})
    tensors, _ = method.calibrate(loaded, store)
    v = store.layer(1)["v"]
    lo, hi = v.min(1, keepdim=True).values, v.max(1, keepdim=True).values
    xn = ((v - (hi + lo) / 2) / ((hi - lo) / 2)).flatten()
    enc, dec = tensors["layers.1.v.encode"], tensors["layers.1.v.decode"]
    idx = torch.searchsorted((enc[1:] + enc[:-1]) / 2, xn.clamp(-1, 1))
    assert dec[idx].mean().item() == pytest.approx(xn.mean().item(), abs=1e-4)
    assert dec[idx].std().item() == pytest.approx(xn.std().item(), rel=1e-4)
    assert not torch.equal(enc, dec)


def test_artifact_round_trip_gives_the_same_codec(tmp_path):
    loaded = load_model("tiny-qwen2")
    text = tmp_path / "t.txt"
    text.write_text(open(__file__).read() * 3)
    method = build_method("kvquant", {"bits": 3})
    art = run_calibration(loaded, method, tmp_path / "a.safetensors", str(text), nsamples=3, seqlen=64)
    again = load_artifact(tmp_path / "a.safetensors")
    assert again.header["calibration"]["nsamples"] == 3 and again.header["method"] == "kvquant"
    _, codec = storages_for_artifact(again, loaded)
    direct = method.build_storages(art.tensors, loaded.dims)
    k = torch.randn(2, loaded.dims.num_kv_heads, 9, loaded.dims.head_dim)
    torch.testing.assert_close(codec[1].reconstruct(k, k), direct[1].reconstruct(k, k), rtol=0, atol=0)
    torch.testing.assert_close(codec[0].reconstruct(k, k), direct[0].reconstruct(k, k), rtol=0, atol=0)
    assert not torch.equal(codec[1].reconstruct(k, k)[0], k)
    # deterministic: calibrating again gives a bit-identical file
    run_calibration(loaded, method, tmp_path / "b.safetensors", str(text), nsamples=3, seqlen=64)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.slow
def test_end_to_end_smollm2(tmp_path, wikitext_dir, smollm2):
    """Calibrate nuq2-1% on 2 windows, evaluate 2 windows: it beats RTN int2 by a wide margin."""
    out = tmp_path / "kvq.safetensors"
    cal = kvcal("calibrate", "--method", "kvquant", "--set", "bits=2", "--model", "smollm2-135m", "--data-dir",
                wikitext_dir, "--nsamples", 2, "--seqlen", 512, "--out", out)
    assert cal.returncode == 0, cal.stderr
    records = {}
    for name, args in {"kvquant": ["--artifact", out], "rtn": ["--method", "rtn", "--set", "bits=2"]}.items():
        ev = kvcal("eval", "ppl", *args, "--data-dir", wikitext_dir, "--seqlen", 512, "--nsamples", 2, "--json",
                   tmp_path / f"{name}.json")
        assert ev.returncode == 0, ev.stderr
        records[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert records["kvquant"]["ppl"] < records["rtn"]["ppl"]
    assert 2.7 < records["kvquant"]["bits_per_element"] < 2.8  # 2.753: the outlier slots as the cache holds them
    header = load_artifact(out).header
    assert header["calibration"]["tokens"] == 1024 and len(header["info"]["fisher_err_k"]) == 30


def test_bad_tables_and_sinks_are_one_line_errors(tiny_store):
    """A table of the wrong shape (a hand-edited artifact whose hash was recomputed) is refused when the codec is built,
    not met as an IndexError in the lookup; a sink that covers every calibration token is refused too."""
    from kvcal.errors import KvcalError

    loaded, store = tiny_store
    method = build_method("kvquant", {"bits": 2})
    tensors = dict(method.calibrate(loaded, store)[0])
    method.build_storages(tensors, loaded.dims)  # the real tables pass
    tensors["layers.1.v.decode"] = torch.zeros(3, 3)
    with pytest.raises(KvcalError, match=r"layers.1.v.decode has shape \[3, 3\], expected \[4\]"):
        method.build_storages(tensors, loaded.dims)
    with pytest.raises(KvcalError, match="sink=48 leaves 0 calibration tokens in total"):
        build_method("kvquant", {"bits": 2, "sink": 48}).calibrate(loaded, store)
