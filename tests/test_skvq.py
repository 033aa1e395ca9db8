"""SKVQ: channel layout, clipped group quantization (ternary, fp8), clip search, window emulation,
bits accounting, config errors, and calibrate + eval end to end on smollm2-135m.

Expected numbers come from hand computations written out in each test, not from the code under test.
"""

from types import SimpleNamespace

import pytest
import torch

from kvcal.accounting import bits_per_element
from kvcal.artifact import load_artifact
from kvcal.calib.capture import capture
from kvcal.errors import KvcalError
from kvcal.eval.ppl import sequence_nll, simulated_nll
from kvcal.methods import build_method
from kvcal.methods.skvq.calibrate import CLIP_GRID, AttentionOutputError, channel_layout, search_clips
from kvcal.methods.skvq.method import SKVQ
from kvcal.methods.skvq.storage import ChannelQuantizer, GroupLayout, clipped_group_params, fake_quant_clipped
from kvcal.models.adapter import forward_with_cache
from kvcal.quant.rope import RopeSpec
from kvcal.recipes import load_recipe
from kvcal.runtime.cache import KvcalCache


def random_layout(channels: int, offsets: list[int], seed: int) -> GroupLayout:
    perm = torch.randperm(channels, generator=torch.Generator().manual_seed(seed))
    return GroupLayout(perm, torch.tensor(offsets))


# -- layout: permutation and groups --------------------------------------------------------------------


def test_reorder_then_restore_is_the_identity():
    layout = random_layout(32, [0, 5, 17, 32], seed=1)
    x = torch.randn(2, 7, 32)
    permuted = layout.reorder(x)
    assert torch.equal(permuted[..., 3], x[..., int(layout.perm[3])])  # position p holds channel perm[p]
    assert torch.equal(layout.restore(permuted), x)
    assert torch.equal(layout.reorder(layout.restore(x)), x)
    assert layout.sizes == [5, 12, 15]
    assert layout.group_of_position.tolist() == [0] * 5 + [1] * 12 + [2] * 15


def test_groups_are_quantized_over_their_original_channels():
    """Quantizing in permuted order and restoring equals quantizing each group's channels where they are:
    the reference gathers channels by hand and applies the 2-bit min/max formula directly."""
    layout = random_layout(12, [0, 3, 12], seed=2)
    x = torch.randn(2, 1, 3, 4, generator=torch.Generator().manual_seed(0)).transpose(1, 2)  # [B, H, T, D]
    quantizer = ChannelQuantizer(layout, torch.ones(2), bits=2, param_dtype="fp16")
    got = quantizer(x).transpose(1, 2).reshape(2, 12)
    flat = x.transpose(1, 2).reshape(2, 12)
    for b in range(2):
        for g in range(2):
            channels = layout.perm[layout.offsets[g] : layout.offsets[g + 1]]
            values = flat[b, channels]
            lo = values.min().half().float()
            scale = ((values.max() - values.min()) / 3).half().float()
            expected = torch.clamp(torch.round((values - lo) / scale), 0, 3) * scale + lo
            torch.testing.assert_close(got[b, channels], expected, rtol=0, atol=1e-6)


def test_kmeans_groups_channels_of_similar_range():
    """Channels of three range classes (+-0.1, +-1, +-10), interleaved, become exactly three groups,
    ordered by range and with channels ascending inside each group; the layout is deterministic."""
    dims = SimpleNamespace(kv_channels=32)
    half_range = torch.tensor([0.1, 1.0, 10.0])[torch.arange(32) % 3]
    rows = torch.stack([-half_range, half_range, 0.5 * half_range])  # 3 tokens: the min, the max, a middle
    method = SKVQ(group_size=10)  # 32 // 10 = 3 clusters

    def layout_of(rows):
        return channel_layout(rows, dims.kv_channels, method.group_size, method.num_groups(dims), method.reorder,
                              method.seed)

    layout = layout_of(rows)
    expected = [[c for c in range(32) if c % 3 == cls] for cls in (0, 1, 2)]
    assert layout.sizes == [len(e) for e in expected]
    assert layout.perm.tolist() == sum(expected, [])
    assert torch.equal(layout_of(rows).perm, layout.perm)


# -- quantization numerics -----------------------------------------------------------------------------


def test_ternary_quantization_by_hand():
    """1.5 bits = 3 levels (q_max = 2), scale = alpha (max - min) / 2, zero = alpha min, ties to even."""
    layout = GroupLayout.contiguous(4, 4)
    x = torch.tensor([[-1.0, -0.4, 0.2, 1.0],  # alpha 1: scale 1, (x+1)/1 = 0, .6, 1.2, 2 -> 0, 1, 1, 2
                      [-1.0, -0.5, 0.5, 1.0]])  # (x+1)/1 = 0, .5, 1.5, 2 -> half to even: 0, 0, 2, 2
    got = fake_quant_clipped(x, layout, torch.ones(1), levels=3, param_dtype="fp16")
    assert got.tolist() == [[-1.0, 0.0, 0.0, 1.0], [-1.0, -1.0, 1.0, 1.0]]
    # alpha 0.5: range [-0.5, 0.5], scale 0.5: (x+.5)/.5 = -1, -.2, 1.4, 3 -> clamp/round 0, 0, 1, 2
    got = fake_quant_clipped(x[:1], layout, torch.full((1,), 0.5), levels=3, param_dtype="fp16")
    assert got.tolist() == [[-0.5, -0.5, 0.0, 0.5]]
    # the method maps 1.5 bits to those 3 levels
    quantizer = ChannelQuantizer(layout, torch.ones(1), bits=1.5, param_dtype="fp16")
    assert quantizer(x[:1].reshape(1, 1, 1, 4)).flatten().tolist() == [-1.0, 0.0, 0.0, 1.0]


def test_contiguous_unclipped_groups_equal_the_project_quantizer():
    """Without reorder and clip, SKVQ's variable-group path is plain per-token group quantization: it must
    equal kvcal.quant.uniform.fake_quant_groups (the rtn baseline's quantizer) on the same groups."""
    from kvcal.quant.uniform import fake_quant_groups

    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(3))
    layout = GroupLayout.contiguous(48, 16)
    for bits in (2, 3, 4):
        got = fake_quant_clipped(x, layout, torch.ones(3), levels=1 << bits, param_dtype="fp16")
        torch.testing.assert_close(got, fake_quant_groups(x, bits, -1, 16), rtol=0, atol=0)


def test_fp8_params_are_clamped_and_stored_as_e4m3():
    layout = GroupLayout.contiguous(8, 4)
    x = torch.tensor([[-1000.0, 3.0, 5.0, 900.0, 0.3, 0.3, 0.3, 0.3]])  # beyond e4m3's 448; a flat group
    scale, zero = clipped_group_params(x, layout, torch.ones(2), levels=4, param_dtype="fp8")
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
    # -1000 is clamped to -448 (exact in e4m3); (900 + 1000) / 3 = 633 is clamped to 448.
    assert zero.tolist() == [[-448.0, 0.3125]]  # 0.3 rounds to e4m3 0.3125 (step 1/32 in [0.25, 0.5))
    assert scale.tolist() == [[448.0, 2.0**-9]]  # a flat group gets the smallest e4m3 scale, not 0
    for t in (scale, zero):
        assert torch.equal(t.to(torch.float8_e4m3fn).float(), t)
    # codes are computed against the stored params: 0.3 - 0.3125 < 0 clamps to code 0 -> 0.3125
    out = fake_quant_clipped(x, layout, torch.ones(2), levels=4, param_dtype="fp8")
    assert out[0, 4:].tolist() == [0.3125] * 4


# -- clip search ---------------------------------------------------------------------------------------


def value_error(alpha: float, middle: float, count: int) -> float:
    """Squared 2-bit error of the row [-1, 1, middle x count] with clip alpha, by hand: the levels are
    zero + code * scale with zero = -alpha and scale = 2 alpha / 3, both rounded to fp16 as stored; -1
    and 1 land on codes 0 and 3, `middle` on its nearest level (code 2 for alpha in [0.8, 1])."""
    zero, scale = float(torch.tensor(-alpha).half()), float(torch.tensor(2 * alpha / 3).half())
    return (zero + 1) ** 2 + (zero + 3 * scale - 1) ** 2 + count * (zero + 2 * scale - middle) ** 2


def clip_case(v_row: torch.Tensor, tokens: int = 24):
    """One head whose every token has the value row `v_row`, query 0 (uniform attention, whatever the
    keys) and o_proj the identity: the attention output is exactly the reconstruction of `v_row`."""
    channels = v_row.numel()
    dims = SimpleNamespace(num_heads=1, num_kv_heads=1, head_dim=channels, kv_channels=channels)
    rows = {"q": torch.zeros(tokens, channels), "k": torch.randn(tokens, channels), "v": v_row.expand(tokens, -1)}
    module = torch.nn.Module()
    module.o_proj = torch.nn.Linear(channels, channels, bias=False)
    torch.nn.init.eye_(module.o_proj.weight)
    module.scaling = channels**-0.5
    return AttentionOutputError(rows, torch.arange(tokens), module, dims, RopeSpec(channels, 1e4).inv_freq(),
                                sink=0, windows=1, queries=8)


def test_clip_search_picks_the_hand_computed_ratio():
    """Value row [-1, 1, 0.318 x 126], 2-bit. In exact arithmetic the error is
        f(alpha) = 126 (alpha/3 - 0.318)^2 + 2 (1 - alpha)^2,
    minimised at alpha = (4 + 84 * 0.318) / 32 = 0.9598: on the grid 0.96 with f = 0.00370, against
    0.00538 at 0.97 and 0.00522 at 0.95 (more than 20% apart also with fp16-rounded parameters).
    The keys change nothing (q = 0), so the key search ties everywhere and keeps alpha_K = 1."""
    objective = clip_case(torch.tensor([-1.0, 1.0] + [0.318] * 126))
    layout = GroupLayout.contiguous(128, 128)
    k_quant = ChannelQuantizer(layout, torch.ones(1), 2, "fp16")
    v_quant = ChannelQuantizer(layout, torch.ones(1), 2, "fp16")
    curves = search_clips(objective, k_quant, v_quant, "layer", SKVQ.clip_min)
    assert k_quant.alpha.tolist() == [1.0]
    assert v_quant.alpha.item() == pytest.approx(0.96)
    # (a check of the derivation above, not of kvcal: the exact-arithmetic optimum on the grid is 0.96)
    exact = [(126 * (a / 3 - 0.318) ** 2 + 2 * (1 - a) ** 2) / 128 for a in CLIP_GRID]
    assert min(range(21), key=exact.__getitem__) == CLIP_GRID.index(0.96)
    # the objective is the mean squared error over the 128 output channels
    assert curves["v"] == pytest.approx([value_error(a, 0.318, 126) / 128 for a in CLIP_GRID], rel=1e-4)
    # a grid that stops at 0.97 keeps its lowest value, the closest it has to 0.96
    v_quant.alpha = torch.ones(1)
    curves = search_clips(objective, k_quant, v_quant, "layer", 0.97)
    assert len(curves["v"]) == 4 and v_quant.alpha.item() == pytest.approx(0.97)


def test_group_clip_search_tunes_groups_separately():
    """Two groups of 128: group 0 is the case above (best 0.96); group 1 holds only -1 and 1, which any
    alpha < 1 only moves, so per-group search gives (0.96, 1.0) where per-layer search gives one ratio."""
    objective = clip_case(torch.tensor([-1.0, 1.0] + [0.318] * 126 + [-1.0, 1.0] * 64))
    layout = GroupLayout.contiguous(256, 128)
    quantizers = [ChannelQuantizer(layout, torch.ones(2), 2, "fp16") for _ in "kv"]
    search_clips(objective, *quantizers, "layer", SKVQ.clip_min)
    # per layer: one ratio for both groups, the grid's minimum of the summed errors, by hand: group 1's 64 pairs
    # (-1, 1) lose (zero + 1)^2 + (zero + 3 scale - 1)^2 each; the sum is lowest at 1.0 (0.0284, next 0.0308)
    def pairs_error(alpha):
        zero, scale = float(torch.tensor(-alpha).half()), float(torch.tensor(2 * alpha / 3).half())
        return 64 * ((zero + 1) ** 2 + (zero + 3 * scale - 1) ** 2)

    best = min(CLIP_GRID, key=lambda a: value_error(a, 0.318, 126) + pairs_error(a))
    assert best == 1.0 and quantizers[1].alpha.tolist() == pytest.approx([best, best])
    quantizers = [ChannelQuantizer(layout, torch.ones(2), 2, "fp16") for _ in "kv"]
    search_clips(objective, *quantizers, "group", SKVQ.clip_min)
    assert quantizers[1].alpha.tolist() == pytest.approx([0.96, 1.0])


# -- window emulation ----------------------------------------------------------------------------------


def hand_made_tensors(dims, seed: int = 0) -> dict[str, torch.Tensor]:
    """A valid SKVQ artifact without calibration: random permutations, uneven groups, mixed clips."""
    channels = dims.kv_channels
    tensors = {}
    for i in range(dims.num_layers):
        for j, kind in enumerate("kv"):
            perm = torch.randperm(channels, generator=torch.Generator().manual_seed(seed + 2 * i + j))
            tensors[f"layers.{i}.{kind}.perm"] = perm.to(torch.int32)
            tensors[f"layers.{i}.{kind}.group_offsets"] = torch.tensor([0, 5, 17, channels], dtype=torch.int32)
            tensors[f"layers.{i}.{kind}.clip"] = torch.tensor([0.9, 0.95, 1.0])
    return tensors


def decode_nll(loaded, codec, ids) -> float:
    """Token-by-token decoding through the runtime cache (sinks, window flushed one token per step), each flushed
    token reconstructed through the storage (the packed cache itself is checked by the contract and kernel tests)."""
    cache = KvcalCache(codec, loaded.dims.num_layers, backend="reference")
    with torch.inference_mode():
        logits = [forward_with_cache(loaded.model, ids[:, t : t + 1], cache).logits
                  for t in range(ids.shape[1])]
    return sequence_nll(torch.cat(logits, 1), ids, 1).item()


def test_window_emulation_equals_token_by_token_decoding(tiny):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    method = SKVQ(k_bits=2, v_bits=1.5, group_size=10, window=6, sink=3)
    codec = method.build_storages(hand_made_tensors(tiny.dims), tiny.dims)
    simulated = simulated_nll(tiny, codec, ids).nll
    assert simulated == pytest.approx(decode_nll(tiny, codec, ids), rel=2e-6)
    # teeth: quantization moves the NLL far beyond the tolerance, and so does a wrong window
    lossless = simulated_nll(tiny, build_method("fp16").build_storages({}, tiny.dims), ids).nll
    assert abs(simulated - lossless) > 100 * 2e-6 * lossless
    no_window = SKVQ(k_bits=2, v_bits=1.5, group_size=10, window=0, sink=3)
    wrong = simulated_nll(tiny, no_window.build_storages(hand_made_tensors(tiny.dims), tiny.dims), ids).nll
    assert abs(wrong - simulated) > 100 * 2e-6 * simulated


@pytest.mark.parametrize("k_bits,v_bits,param_dtype,ternary", [
    (2, 2, "fp16", "base3"), (4, 1.5, "fp8", "base3"), (2, 1.5, "fp16", "2bit"), (1.5, 1, "fp8", "2bit"),
])
def test_packed_storage_round_trip_equals_the_fake_quantizer(tiny, k_bits, v_bits, param_dtype, ternary):
    """What the packed cache holds (codes in channel order, per-token group parameters gathered per channel,
    base-3 or slot ternary codes) decodes to exactly the fake quantization the calibration scored: the storage
    written by its torch reference and read back equals ChannelQuantizer bit for bit."""
    method = SKVQ(k_bits=k_bits, v_bits=v_bits, group_size=10, window=0, sink=0, param_dtype=param_dtype,
                  ternary_storage=ternary)
    codec = method.build_storages(hand_made_tensors(tiny.dims, seed=3), tiny.dims)
    heads, dim = tiny.dims.num_kv_heads, tiny.dims.head_dim
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, heads, 9, dim, generator=gen) * torch.linspace(0.2, 4.0, dim)
    v = torch.randn(2, heads, 9, dim, generator=gen)
    for layer in range(tiny.dims.num_layers):
        storage = codec[layer]
        got_k, got_v = codec[layer].reconstruct(k, v)
        assert torch.equal(got_k, storage.sides["k"](k))
        assert torch.equal(got_v, storage.sides["v"](v))
        assert not torch.equal(got_k, k)  # teeth: the round trip is lossy


# -- calibration on a tiny model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_store(tiny):
    windows = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    store = capture(tiny, windows, SKVQ.captures)
    yield store
    store.close()


def test_calibrate_writes_layouts_and_searched_clips(tiny, tiny_store):
    method = SKVQ(group_size=6, window=8, sink=2, clip="layer", clip_queries=16)
    tensors, info = method.calibrate(tiny, tiny_store)
    channels, groups = tiny.dims.kv_channels, tiny.dims.kv_channels // 6
    for i in range(tiny.dims.num_layers):
        for kind in "kv":
            p = f"layers.{i}.{kind}."
            assert tensors[p + "perm"].dtype == torch.int32
            assert sorted(tensors[p + "perm"].tolist()) == list(range(channels))
            offsets = tensors[p + "group_offsets"]
            assert offsets.dtype == torch.int32 and offsets.numel() == groups + 1
            assert offsets[0] == 0 and offsets[-1] == channels and (offsets.diff() > 0).all()
            # the layout is the one of this layer's and kind's captured rows, the sink positions left out (K and V
            # of a layer, and the layers, differ on this store, so a swapped or misread input changes it)
            rows = tiny_store.layer(i)[kind][tiny_store.token_positions >= 2]
            layout = channel_layout(rows, channels, 6, groups, True, method.seed)
            assert tensors[p + "perm"].tolist() == layout.perm.tolist()
            assert tensors[p + "group_offsets"].tolist() == layout.offsets.tolist()
            # per-layer mode: one ratio for all groups, the first minimum of the stored curve
            curve = tensors[p + "clip_loss"]
            best = CLIP_GRID[int(torch.argmin(curve))]
            assert tensors[p + "clip"].tolist() == pytest.approx([best] * groups)
    assert info["clip_search"]["queries_per_window"] == 16 and info["clip_search"]["windows"] == 2
    perms = [tensors[f"layers.{i}.{kind}.perm"].tolist() for i in range(tiny.dims.num_layers) for kind in "kv"]
    assert len({tuple(perm) for perm in perms}) == len(perms)  # what makes the layout check above discriminate
    again, _ = method.calibrate(tiny, tiny_store)  # seeded: bit-identical
    assert all(torch.equal(again[name], t) for name, t in tensors.items())


def test_calibrate_ablation_settings(tiny, tiny_store):
    """No reorder = identity permutation and consecutive groups; global clip = the one ratio everywhere."""
    tensors, info = SKVQ(group_size=8, reorder=False, clip="global", clip_value=0.93).calibrate(tiny, tiny_store)
    channels = tiny.dims.kv_channels
    assert tensors["layers.1.v.perm"].tolist() == list(range(channels))
    assert tensors["layers.1.v.group_offsets"].tolist() == list(range(0, channels + 1, 8))
    assert tensors["layers.0.k.clip"].tolist() == pytest.approx([0.93] * (channels // 8))
    assert "layers.0.k.clip_loss" not in tensors and "clip_search" not in info
    tensors, _ = SKVQ(group_size=8, clip="none").calibrate(tiny, tiny_store)
    assert tensors["layers.0.v.clip"].tolist() == [1.0] * (channels // 8)
    # queries are captured only for the clip search
    assert SKVQ(clip="none").capture_needs() == {"k", "v"} == SKVQ(clip="global").capture_needs()
    assert SKVQ(clip="group").capture_needs() == {"k", "v", "q"}


# -- bits per element ----------------------------------------------------------------------------------

SMOLLM2_DIMS = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, kv_channels=192)


def test_bits_per_element_by_hand():
    # K2V2, 6 groups of 32 on average, fp16 scale + zero, W=128, S=5, at 4096 tokens: 3963 tokens are
    # quantized at 2 bits + 6 * 2 * 16 / 192 = 1 bit of parameters; 133 stay fp16.
    method = build_method("skvq", {"group_size": 32})
    assert bits_per_element(method, SMOLLM2_DIMS).bits_per_element == pytest.approx((3963 * 3 + 133 * 16) / 4096)
    # K2V1.5 base-3 (ceil(192 / 5) = 39 bytes = 1.625 bits/elem), fp8 params over 3 groups (0.25 bits),
    # window 0, 5 sinks: 4091 quantized tokens.
    method = build_method("skvq", {"v_bits": 1.5, "group_size": 64, "window": 0, "param_dtype": "fp8"})
    quantized = (2 + 1.625) / 2 + 0.25
    assert bits_per_element(method, SMOLLM2_DIMS).bits_per_element == pytest.approx(
        (4091 * quantized + 5 * 16) / 4096)
    # the [code]'s 2-bit slots for ternary codes cost the same as 2-bit codes
    slots = build_method("skvq", {"v_bits": 1.5, "ternary_storage": "2bit", "group_size": 32})
    assert bits_per_element(slots, SMOLLM2_DIMS).bits_per_element == pytest.approx((3963 * 3 + 133 * 16) / 4096)


# -- configuration errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("config,message", [
    ({"k_bits": 5}, "k_bits must be one of 1.5, 2, 3, 4, 8"),
    ({"v_bits": 1}, "v_bits must be one of"),
    ({"clip": "channel"}, "clip must be one of none, global, layer, group"),
    ({"param_dtype": "bf16"}, "param_dtype must be one of fp16, fp8"),
    ({"clip_value": 1.2}, "clip_value must be in (0, 1]"),
    ({"group_size": 0}, "group_size must be positive"),
    ({"window": -1}, "window must be >= 0"),
    ({"k_bits": "two"}, "expects float"),
])
def test_bad_config_is_one_line_error(config, message):
    with pytest.raises(KvcalError) as err:
        build_method("skvq", config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_group_size_must_fit_the_model():
    with pytest.raises(KvcalError, match="group_size 256 is larger than the 192 K/V channels"):
        build_method("skvq", {"group_size": 256}).check_model(SMOLLM2_DIMS)
    with pytest.raises(KvcalError, match="without reorder needs group_size to divide the 192"):
        build_method("skvq", {"group_size": 128, "reorder": False}).check_model(SMOLLM2_DIMS)
    build_method("skvq", {"group_size": 128}).check_model(SMOLLM2_DIMS)  # reordered: 1 group of 192


def test_broken_artifact_tensors_are_refused(tiny):
    tensors = hand_made_tensors(tiny.dims)
    method = SKVQ(group_size=10)
    del tensors["layers.1.v.clip"]
    with pytest.raises(KvcalError, match="lacks layers.1.v.clip"):
        method.build_storages(tensors, tiny.dims)
    tensors = hand_made_tensors(tiny.dims)
    tensors["layers.0.k.perm"][0] = tensors["layers.0.k.perm"][1]
    with pytest.raises(KvcalError, match="not a permutation"):
        method.build_storages(tensors, tiny.dims)
    tensors = hand_made_tensors(tiny.dims)
    tensors["layers.1.k.clip"] = tensors["layers.1.k.clip"][:-1]
    with pytest.raises(KvcalError, match=r"layers.1.k.clip has shape \[\d+\], expected"):
        method.build_storages(tensors, tiny.dims)
    for bad in (0.0, float("nan")):
        tensors = hand_made_tensors(tiny.dims)
        tensors["layers.0.v.clip"][1] = bad
        with pytest.raises(KvcalError, match="layers.0.v.clip holds a ratio that is not a positive number"):
            method.build_storages(tensors, tiny.dims)


def test_recipes_resolve_and_g128_is_one_group_on_smollm2():
    for name in ("skvq-k2v2-g128-w128", "skvq-k2v1.5-g128-w128", "skvq-k4v4-g128-w128", "skvq-k2v2-g32-w128",
                 "skvq-k2v1.5-g32-w128", "skvq-k4v4-g32-w128", "skvq-k2v2-g64-w128", "skvq-ppl-k2v2-g64-w0-s5"):
        recipe = load_recipe(name)
        method = build_method(recipe.method, recipe.config)
        method.check_model(SMOLLM2_DIMS)
        expected_groups = 192 // int(name.split("-g")[1].split("-")[0])
        assert method.num_groups(SMOLLM2_DIMS) == expected_groups
    assert build_method("skvq", load_recipe("skvq-k2v2-g128-w128").config).num_groups(SMOLLM2_DIMS) == 1
    ppl = build_method("skvq", load_recipe("skvq-ppl-k2v2-g64-w0-s5").config)
    assert (ppl.window, ppl.sink, ppl.group_size, ppl.param_dtype) == (0, 5, 64, "fp8")


# -- end to end on the real model ----------------------------------------------------------------------


@pytest.mark.slow
def test_calibrate_and_eval_smollm2(smollm2, wikitext_dir, tmp_path):
    """Calibrate on 2 windows, evaluate on 2 windows: SKVQ K2V2 lands between fp16 and RTN int2."""
    from kvcal.calib.run import run_calibration
    from kvcal.data import eval_windows, load_text, tokenize
    from kvcal.methods.registry import storages_for_artifact

    seqlen = 256
    method = build_method("skvq", {"group_size": 32, "window": 32, "sink": 5, "clip_windows": 2, "clip_queries": 64})
    out = tmp_path / "skvq.safetensors"
    run_calibration(smollm2, method, out, "wikitext2", nsamples=2, seqlen=seqlen, seed=0, data_dir=wikitext_dir)
    artifact = load_artifact(out)
    assert len(artifact.tensors) == 30 * 2 * 4  # perm, group_offsets, clip, clip_loss per layer and kind
    assert artifact.layer(29, "k")["group_offsets"].numel() == 192 // 32 + 1
    _, codec = storages_for_artifact(artifact, smollm2, out)

    windows = eval_windows(tokenize(smollm2.tokenizer, load_text("wikitext2", "eval", wikitext_dir).text), seqlen, 2)
    skvq = simulated_nll(smollm2, codec, windows).ppl
    fp16 = simulated_nll(smollm2, build_method("fp16").build_storages({}, smollm2.dims), windows).ppl
    rtn2 = simulated_nll(smollm2, build_method("rtn", {"bits": 2}).build_storages({}, smollm2.dims), windows).ppl
    assert fp16 < skvq < rtn2
    assert skvq < 2 * fp16  # measured about 1.2x (256-token windows, W=32); RTN int2 is far worse
