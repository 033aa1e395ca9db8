"""End to end on the real smollm2-135m: calibrate a baseline, evaluate it from its artifact."""

import json
import math

import pytest
import torch

from tests.test_cli import kvcal

pytestmark = pytest.mark.slow


def test_fp16_matches_stock_transformers(smollm2, wikitext_dir):
    """Our adapter + protocol against an independent computation with the stock model."""
    from transformers import AutoModelForCausalLM

    from kvcal.data import eval_windows, load_text, tokenize
    from kvcal.eval.ppl import simulated_nll
    from kvcal.methods import build_method
    from kvcal.models.gguf import converted_smollm2_dir

    windows = eval_windows(tokenize(smollm2.tokenizer, load_text("wikitext2", "eval", wikitext_dir).text), 512, 2)
    ours = simulated_nll(smollm2, build_method("fp16").build_codec({}, smollm2.dims), windows)
    stock = AutoModelForCausalLM.from_pretrained(str(converted_smollm2_dir()[0]), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        losses = [stock(w[None], labels=w[None]).loss.item() * 511 for w in windows]
    assert ours.tokens == 2 * 511
    assert ours.ppl == pytest.approx(math.exp(sum(losses) / (2 * 511)), rel=1e-5)


def test_calibrate_baseline_then_eval_two_windows(tmp_path, wikitext_dir, smollm2):
    out = tmp_path / "kivi.safetensors"
    cal = kvcal("calibrate", "--method", "kivi", "--model", "smollm2-135m", "--out", out)
    assert cal.returncode == 0, cal.stderr
    result = tmp_path / "r.json"
    ev = kvcal("eval", "ppl", "--artifact", out, "--data-dir", wikitext_dir, "--seqlen", 512, "--nsamples", 2,
               "--json", result)
    assert ev.returncode == 0, ev.stderr
    kivi = json.loads(result.read_text())
    fp16 = kvcal("eval", "ppl", "--method", "fp16", "--data-dir", wikitext_dir, "--seqlen", 512, "--nsamples", 2,
                 "--json", tmp_path / "fp16.json")
    assert fp16.returncode == 0, fp16.stderr
    base = json.loads((tmp_path / "fp16.json").read_text())
    assert kivi["model"]["name"] == "smollm2-135m" and kivi["tokens"] == 2 * 511
    # 2-bit KIVI costs perplexity, but stays in a sane range; 16 -> ~3.4 bits per element
    assert base["ppl"] < kivi["ppl"] < 2 * base["ppl"]
    assert base["bits_per_element"] == 16 and 3 < kivi["bits_per_element"] < 4
