"""The uniform quantizer and the baselines' grouping, against hand-computed cases and explicit loops."""

import torch

from kvcal.methods import build_method
from kvcal.quant.uniform import fake_quant_groups, fake_quant_minmax


def test_minmax_2bit_hand_computed():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 10.0]])
    # min 0, max 10, 4 levels: scale 10/3 rounded to fp16 (ulp 2**-9 in [2, 4)) = 1707 * 2**-9
    # = 3.333984375; codes round(x / s)
    # = [0, 0 (0.30), 1 (0.60), 1 (0.90), 3] -> [0, 0, s, s, 3s]
    s = 3.333984375
    expected = torch.tensor([[0.0, 0.0, s, s, 3 * s]])
    assert torch.equal(fake_quant_minmax(x, 2, dim=-1), expected)


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


def test_groups_along_any_axis_match_a_loop():
    x = torch.randn(2, 3, 8, 6)
    out = fake_quant_groups(x, 3, dim=2, group=4)
    for b in range(2):
        for h in range(3):
            for g in range(2):
                for d in range(6):
                    seg = x[b, h, 4 * g : 4 * g + 4, d]
                    torch.testing.assert_close(out[b, h, 4 * g : 4 * g + 4, d], loop_minmax(seg, 3))


def test_kivi_keys_per_channel_values_per_token():
    dims = type("D", (), {"head_dim": 8, "kv_channels": 16})()
    codec = build_method("kivi", {"bits": 2, "group_size": 4, "residual": 0}).build_codec({}, dims)
    k = torch.randn(1, 2, 8, 8)
    kq, vq = codec.reconstruct(0, k, k)
    torch.testing.assert_close(kq[0, 1, 4:8, 5], loop_minmax(k[0, 1, 4:8, 5], 2))  # channel 5, tokens 4..7
    torch.testing.assert_close(vq[0, 1, 6, 4:8], loop_minmax(k[0, 1, 6, 4:8], 2))  # token 6, channels 4..7


def test_rtn_groups_of_channels_of_one_head():
    dims = type("D", (), {"head_dim": 4, "kv_channels": 8})()
    k = torch.randn(1, 2, 3, 4)
    grouped = build_method("rtn", {"bits": 2, "group_size": 2}).build_codec({}, dims).reconstruct(0, k, k)[0]
    torch.testing.assert_close(grouped[0, 1, 1, 2:4], loop_minmax(k[0, 1, 1, 2:4], 2))  # head 1, token 1, group 1
    per_head = build_method("rtn", {"bits": 2}).build_codec({}, dims).reconstruct(0, k, k)[0]
    torch.testing.assert_close(per_head[0, 1, 2], loop_minmax(k[0, 1, 2], 2))
