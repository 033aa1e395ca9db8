"""The uniform quantizer and the baselines' grouping, against hand-computed cases and explicit loops."""

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.methods import build_method
from kvcal.quant.uniform import dequantize_per_token, fake_quant_groups, fake_quant_minmax, quantize_per_token


def test_minmax_2bit_hand_computed():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 10.0]])
    # min 0, max 10, 4 levels: scale 10/3 rounded to fp16 (ulp 2**-9 in [2, 4)) = 1707 * 2**-9
    # = 3.333984375; codes round(x / s)
    # = [0, 0 (0.30), 1 (0.60), 1 (0.90), 3] -> [0, 0, s, s, 3s]
    s = 3.333984375
    expected = torch.tensor([[0.0, 0.0, s, s, 3 * s]])
    assert torch.equal(fake_quant_minmax(x, 2, dim=-1), expected)


def test_minmax_1bit_hand_computed():
    # min -2, max 4, 2 levels: scale 6 (exact in fp16); (x + 2) / 6 = [0, 0.42, 0.5, 0.58, 0.83, 1] -> codes
    # [0, 0, 0 (half to even), 1, 1, 1]: every value becomes the group's min or its max
    x = torch.tensor([[-2.0, 0.5, 1.0, 1.5, 3.0, 4.0]])
    assert fake_quant_minmax(x, 1, dim=-1).tolist() == [[-2.0, -2.0, -2.0, 4.0, 4.0, 4.0]]


def test_packed_1bit_per_token_hand_computed():
    """One token of 32 channels x_d = d, 1 bit: one int32 word whose bit d is channel d's code. One group (min 0, max
    31, scale 31): codes round(d / 31) are 1 from d = 16, word 0xFFFF0000. Two groups of 16 (scale 15): codes 1 from
    d = 8 in each, word 0xFF00FF00; values [0 x 8, 15 x 8, 16 x 8, 31 x 8]."""
    x = torch.arange(32, dtype=torch.float32).reshape(1, 1, 32)
    codes, scale, zero = quantize_per_token(x, 1, 32)
    assert codes.tolist() == [[[0xFFFF0000 - 2**32]]] and scale.tolist() == [[[31.0]]] and zero.tolist() == [[[0.0]]]
    assert dequantize_per_token(codes, scale, zero, 1, 32).tolist() == [[[0.0] * 16 + [31.0] * 16]]
    codes, scale, zero = quantize_per_token(x, 1, 16)
    assert codes.tolist() == [[[0xFF00FF00 - 2**32]]] and scale.tolist() == [[[15.0, 15.0]]]
    assert zero.tolist() == [[[0.0, 16.0]]]
    assert dequantize_per_token(codes, scale, zero, 1, 32).tolist() == [[[0.0] * 8 + [15.0] * 8 + [16.0] * 8
                                                                          + [31.0] * 8]]


def test_minmax_keeps_extremes_and_constant_groups():
    x = torch.tensor([[-1.5, 0.25, 2.0], [4.0, 4.0, 4.0]])
    out = fake_quant_minmax(x, 4, dim=-1)
    assert out[0, 0] == -1.5 and abs(out[0, 2] - 2.0) < 1e-3  # min exact, max within fp16 rounding of scale
    assert torch.equal(out[1], x[1])  # zero range: code 0, value = min, no NaN


def test_round_half_to_even():
    # scale exactly 1 (min 0, max 3, 2 bits): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    x = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.0]])
    assert fake_quant_minmax(x, 2, dim=-1).tolist() == [[0.0, 0.0, 2.0, 2.0, 3.0]]


def loop_minmax(x, bits):
    lo, hi = x.min(), x.max()
    scale = ((hi - lo) / (2**bits - 1)).half().float()
    lo = lo.half().float()
    if scale == 0:
        return torch.full_like(x, lo)
    return torch.clamp(torch.round((x - lo) / scale), 0, 2**bits - 1) * scale + lo


@pytest.mark.parametrize("dim", [1, 2, -1])
def test_groups_along_any_axis_match_a_loop(dim):
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(dim % 4))
    out = fake_quant_groups(x, 3, dim=dim, group=4)  # 4 values at 3 bits: the middle two are rounded
    moved_x, moved_out = x.movedim(dim, -1), out.movedim(dim, -1)  # the grouped axis last, for the loop
    for index in torch.cartesian_prod(*[torch.arange(n) for n in moved_x.shape[:-1]]).tolist():
        for g in range(moved_x.shape[-1] // 4):
            seg = moved_x[tuple(index)][4 * g : 4 * g + 4]
            torch.testing.assert_close(moved_out[tuple(index)][4 * g : 4 * g + 4], loop_minmax(seg, 3))
    assert not torch.allclose(out, x, atol=1e-3)  # what the comparison holds is not the identity


def test_kivi_keys_per_channel_values_per_token():
    dims = type("D", (), {"head_dim": 8, "kv_channels": 16, "num_layers": 1})()
    codec = build_method("kivi", {"bits": 2, "group_size": 4, "residual": 0}).build_storages({}, dims)
    k = torch.randn(1, 2, 8, 8)
    kq, vq = codec[0].reconstruct(k, k)
    torch.testing.assert_close(kq[0, 1, 4:8, 5], loop_minmax(k[0, 1, 4:8, 5], 2))  # channel 5, tokens 4..7
    torch.testing.assert_close(vq[0, 1, 6, 4:8], loop_minmax(k[0, 1, 6, 4:8], 2))  # token 6, channels 4..7


def test_rtn_groups_of_channels_of_one_head():
    dims = type("D", (), {"head_dim": 4, "kv_channels": 8, "num_layers": 1})()
    k = torch.randn(1, 2, 3, 4)
    grouped = build_method("rtn", {"bits": 2, "group_size": 2}).build_storages({}, dims)[0].reconstruct(k, k)[0]
    torch.testing.assert_close(grouped[0, 1, 1, 2:4], loop_minmax(k[0, 1, 1, 2:4], 2))  # head 1, token 1, group 1
    per_head = build_method("rtn", {"bits": 2}).build_storages({}, dims)[0].reconstruct(k, k)[0]
    torch.testing.assert_close(per_head[0, 1, 2], loop_minmax(k[0, 1, 2], 2))


def test_one_bit_baselines_match_a_loop():
    """rtn and kivi at 1 bit: every group is reconstructed to its min or its max, as the loop computes."""
    dims = type("D", (), {"head_dim": 8, "kv_channels": 16, "num_layers": 1})()
    k = torch.randn(1, 2, 8, 8)
    rtn = build_method("rtn", {"bits": 1, "group_size": 4}).build_storages({}, dims)[0].reconstruct(k, k)[0]
    torch.testing.assert_close(rtn[0, 1, 3, 4:8], loop_minmax(k[0, 1, 3, 4:8], 1))  # head 1, token 3, group 1
    kivi = build_method("kivi", {"bits": 1, "group_size": 4, "residual": 0}).build_storages({}, dims)
    kq, vq = kivi[0].reconstruct(k, k)
    torch.testing.assert_close(kq[0, 0, 4:8, 2], loop_minmax(k[0, 0, 4:8, 2], 1))  # channel 2, tokens 4..7
    torch.testing.assert_close(vq[0, 1, 5, 0:4], loop_minmax(k[0, 1, 5, 0:4], 1))  # token 5, channels 0..3
    assert all(group.unique().numel() <= 2 for group in rtn.reshape(-1, 4))  # two levels per group


@pytest.mark.parametrize("name", ["rtn", "kivi"])
def test_bits_outside_the_packed_widths_are_one_line(name):
    with pytest.raises(KvcalError, match="bits must be one of 1, 2, 3, 4, 8, got 5") as err:
        build_method(name, {"bits": 5})
    assert "\n" not in str(err.value)
