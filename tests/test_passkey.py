"""`kvcal eval passkey`: prompt construction, the answer check, the record, the CLI's errors and plot (tiny model);
retrieval on smollm2-135m (slow)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.eval.passkey import FILLER, NEEDLE, QUESTION, build_prompt, passkey, run_passkey
from kvcal.methods import build_method


def kvcal(*args):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "kvcal.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("length", [300, 351, 1000])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_prompt_length_and_depth(tiny, length, depth):
    tok = tiny.tokenizer
    key = passkey(random.Random(f"{length}-{depth}"))
    p = build_prompt(tok, length, depth, key)
    assert len(p["ids"]) == length
    text = tok.decode(p["ids"], skip_special_tokens=True)
    assert NEEDLE.format(key=key) in text and text.endswith(QUESTION)
    # the needle sits within one filler sentence of depth% of the filler (measured in characters of the text)
    needle_at = text.index(NEEDLE.format(key=key))
    before = text[:needle_at]
    first_filler = before.find(FILLER[0]) if FILLER[0] in before else needle_at
    filler_chars = len(text) - len(NEEDLE.format(key=key)) - len(QUESTION) - first_filler
    longest = max(len(s) for s in FILLER)
    assert abs((needle_at - first_filler) - depth / 100 * filler_chars) <= longest
    assert tok.decode(p["ids"][p["needle_start"]:], skip_special_tokens=True).startswith(NEEDLE.format(key=key))


def test_prompt_too_short(tiny):
    with pytest.raises(KvcalError, match="cannot hold"):
        build_prompt(tiny.tokenizer, 50, 50, "12345")


def test_answer_check_and_cells(tiny, monkeypatch):
    """A trial is correct exactly when the key appears in the decoded text (decode) or every answer token is the
    argmax (simulate): the decoders are replaced by ones that answer right on even trials."""
    import kvcal.eval.passkey as pk

    calls = {"n": 0}

    def fake_decode(loaded, codec, ids, max_new_tokens, backend="packed"):
        calls["n"] += 1
        key = tiny.tokenizer.decode(ids, skip_special_tokens=True).split("The pass key is ")[1][:5]
        text = f" {key}." if calls["n"] % 2 else " 00000."
        return tiny.tokenizer(text, add_special_tokens=False).input_ids

    def fake_simulate(loaded, codec, ids, answer):
        calls["n"] += 1
        return list(answer) if calls["n"] % 2 else list(answer[:-1]) + [answer[-1] ^ 1]

    codec = build_method("fp16").build_storages({}, tiny.dims)
    for mode, fake in (("decode", fake_decode), ("simulate", fake_simulate)):
        monkeypatch.setattr(pk, f"{mode}_trial", fake)
        calls["n"] = 0
        cells = run_passkey(tiny, codec, [300, 360], [0, 100], 3, mode=mode)
        assert [(c["length"], c["depth"]) for c in cells] == [(300, 0), (300, 100), (360, 0), (360, 100)]
        flags = [r["correct"] for c in cells for r in c["results"]]
        assert flags == [i % 2 == 0 for i in range(12)]
        assert [c["correct"] for c in cells] == [2, 1, 2, 1]
        assert cells[0]["accuracy"] == pytest.approx(2 / 3)


def test_simulate_matches_decode_tiny(tiny):
    """The simulation's teacher-forced argmax equals greedy decoding's first tokens through the cache (fp16 and a
    lossy baseline), on the random tiny model."""
    from kvcal.eval.passkey import decode_trial, simulate_trial

    p = build_prompt(tiny.tokenizer, 300, 50, "48213")
    for name, config in (("fp16", {}), ("kivi", {"bits": 2, "group_size": 4, "residual": 8})):
        method = build_method(name, config)
        codec = method.build_storages({}, tiny.dims)
        greedy = decode_trial(tiny, codec, p["ids"], 3)
        forced = simulate_trial(tiny, codec, p["ids"], greedy[:2])
        assert forced == greedy[:2]
        # a wrong answer forced in is not what comes out: the first prediction is the prompt's own, and for fp16 every
        # position is the plain model's argmax after prompt + that wrong answer
        vocab = tiny.model.config.vocab_size
        wrong = [(t + 1) % vocab for t in greedy[:2]]
        forced = simulate_trial(tiny, codec, p["ids"], wrong)
        assert forced[0] == greedy[0] != wrong[0]
        if name == "fp16":
            with torch.inference_mode():
                logits = tiny.model(torch.tensor([p["ids"] + wrong]), use_cache=False).logits[0]
            assert forced == logits[len(p["ids"]) - 1 : -1].argmax(-1).tolist()


def test_cli_record_table_and_plot(tmp_path):
    out = tmp_path / "pk.json"
    result = kvcal("eval", "passkey", "--model", "tiny-llama", "--lengths", "300", "--lengths", "360",
                     "--depths", "0", "--depths", "100", "--trials", "2", "--max-new-tokens", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "0%" in result.stdout and "100%" in result.stdout and "360" in result.stdout
    record = json.loads(out.read_text())
    assert record["kind"] == "passkey" and record["method"] == "fp16" and record["mode"] == "decode"
    assert record["lengths"] == [300, 360] and record["depths"] == [0, 100] and record["trials"] == 2
    assert len(record["cells"]) == 4 and all(len(c["results"]) == 2 for c in record["cells"])
    assert "eval passkey" in record["command"] and "torch" in record["software"]
    assert record["model"]["name"] == "tiny-llama"
    pytest.importorskip("matplotlib")
    png = tmp_path / "pk.png"
    result = kvcal("report", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--lengths", "100000"], "max_position_embeddings"),
    (["--lengths", "20"], "cannot hold"),
    (["--depths", "120"], "--depths"),
    (["--lengths", "300"], "--lengths: each length once (the grid's rows), got [300, 300]"),  # 300 given twice
    (["--depths", "50", "--depths", "50"], "--depths: each depth once"),
    (["--trials", "0"], "--trials"),
    (["--mode", "nope"], "unknown mode"),
    (["--method", "kvquant"], "needs an artifact"),
    (["--recipe", "evict-1bit", "--fp-window", "512"], "keeps"),
])
def test_cli_bad_input(tmp_path, args, message):
    out = tmp_path / "pk.json"
    result = kvcal("eval", "passkey", "--model", "tiny-llama", "--lengths", "300", "--trials", "1",
                     *args, "--json", str(out))
    assert result.returncode == 2, result.stderr
    message_line = result.stderr.strip()
    assert message in message_line and "Traceback" not in message_line and "\n" not in message_line, message_line
    assert not out.exists()


def test_generated_tokens_past_the_context_are_refused_by_their_flag(tmp_path):
    """Without --lengths the default lengths are cut to the context less the generated tokens: when those leave no
    prompt, the error names --max-new-tokens, not a length the user did not give."""
    result = kvcal("eval", "passkey", "--model", "tiny-llama", "--trials", "1", "--max-new-tokens", "100000")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: --max-new-tokens 100000 leaves no prompt within tiny-llama's "
                                            "context")


def test_cli_records_the_full_precision_allowance(tmp_path):
    """--fp-window sets the method's own window for passkey too, and the record says which allowance ran."""
    out = tmp_path / "pk.json"
    result = kvcal("eval", "passkey", "--model", "tiny-llama", "--lengths", "300", "--depths", "50", "--trials", "1",
                   "--max-new-tokens", "2", "--recipe", "rtn-int2", "--fp-window", "16", "--json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["fp_window"] == 16 and record["fp_window_named"] and record["config"]["fp_window"] == 16
    assert record["setting"].endswith("-fp16")


@pytest.mark.slow
def test_smollm2_fp16_retrieves_at_1k(smollm2):
    from kvcal.eval.passkey import run_passkey as run

    codec = build_method("fp16").build_storages({}, smollm2.dims)
    decoded = run(smollm2, codec, [1024], [50], 1, mode="decode")  # through kvcal's cache, greedy
    simulated = run(smollm2, codec, [1024], [0, 100], 1, mode="simulate")  # one teacher-forced forward per trial
    assert [c["accuracy"] for c in decoded + simulated] == [1.0, 1.0, 1.0]
