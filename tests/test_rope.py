"""Our RoPE frequencies and tables against transformers' own rotary embedding, per rope type."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvcal.errors import KvcalError
from kvcal.quant.rope import RopeSpec, apply_rope, rope_cos_sin, unapply_rope

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_cos_sin_match_transformers(kind):
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, rope_theta=5000.0,
                         rope_scaling=SCALINGS[kind], max_position_embeddings=4096)
    spec = RopeSpec.from_config(config, 64)
    assert spec.rope_type == kind
    positions = torch.tensor([[0, 1, 7, 100, 3000], [5, 6, 7, 8, 9]])
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(spec.inv_freq(), positions, torch.float32)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)


def test_rotation_is_inverted_and_norm_preserving():
    spec = RopeSpec(head_dim=16, theta=10000.0)
    positions = torch.arange(5)[None]
    cos, sin = rope_cos_sin(spec.inv_freq(), positions, torch.float64)
    x = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(unapply_rope(rotated, cos, sin), x)
    # position 0 is the identity; pairs are (j, j + d/2) as in rotate_half
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])
    angle = positions[0, 3].item() * spec.inv_freq()[2].item()
    expected = x[0, 0, 3, 2] * torch.cos(torch.tensor(angle, dtype=torch.float64)) - x[0, 0, 3, 10] * torch.sin(
        torch.tensor(angle, dtype=torch.float64))
    torch.testing.assert_close(rotated[0, 0, 3, 2], expected)


def test_unsupported_rope_type_is_refused():
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(KvcalError, match="unsupported rope type 'dynamic'"):
        RopeSpec.from_config(config, 32)
