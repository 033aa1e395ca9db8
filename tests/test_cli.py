"""The command line: bad input gives one line on stderr, a non-zero exit, and no partial file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def kvcal(*args, cwd=None):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "kvcal.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def assert_one_line_error(result, needle):
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "Traceback" not in message and "\n" not in message, message
    assert message.startswith("error:") and needle in message, message


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "kivi.safetensors"
    result = kvcal("calibrate", "--method", "kivi", "--set", "bits=2", "--set", "group_size=4", "--set", "residual=8",
                   "--model", "tiny-llama", "--out", path)
    assert result.returncode == 0, result.stderr
    return path


def test_unknown_method(tmp_path):
    assert_one_line_error(kvcal("calibrate", "--method", "nope", "--model", "tiny-llama"), "unknown method 'nope'")


def test_bench_decode_bad_flush():
    # checked before the CUDA check, so CPU CI sees the message
    assert_one_line_error(kvcal("bench", "decode", "--flush", "dirty"), "--flush must be one of write, read")


def test_unknown_model(tmp_path):
    assert_one_line_error(kvcal("eval", "ppl", "--model", "gpt-9", "--method", "fp16"), "unknown model 'gpt-9'")


def test_missing_data(tmp_path):
    result = kvcal("eval", "ppl", "--model", "tiny-llama", "--method", "fp16", "--data-dir", tmp_path)
    assert_one_line_error(result, "wiki.test.raw")


def test_unknown_set_key_leaves_no_file(tmp_path):
    out = tmp_path / "x.safetensors"
    result = kvcal("calibrate", "--method", "kivi", "--set", "bitz=2", "--model", "tiny-llama", "--out", out)
    assert_one_line_error(result, "unknown config key 'bitz' for method kivi")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_set_value(tmp_path):
    result = kvcal("calibrate", "--method", "kivi", "--set", "bits=two", "--model", "tiny-llama", "--out", tmp_path / "x")
    assert_one_line_error(result, "expects int")


def test_incompatible_artifact(tiny_artifact, tmp_path):
    result = kvcal("eval", "ppl", "--model", "tiny-qwen3", "--artifact", tiny_artifact, "--dataset", __file__)
    assert_one_line_error(result, "calibrated for a model with family=llama")


def test_learning_method_needs_an_artifact():
    pytest.importorskip("kvcal.methods.kvquant")
    assert_one_line_error(kvcal("eval", "ppl", "--model", "tiny-llama", "--method", "kvquant"), "kvcal calibrate")


def test_eval_inspect_and_compare(tiny_artifact, tmp_path):
    record = tmp_path / "r.json"
    text = tmp_path / "text.txt"
    text.write_text(Path(__file__).read_text() * 4)
    result = kvcal("eval", "ppl", "--artifact", tiny_artifact, "--dataset", text, "--seqlen", 64, "--nsamples", 3,
                   "--json", record)
    assert result.returncode == 0, result.stderr
    data = json.loads(record.read_text())
    assert data["method"] == "kivi" and data["model"]["name"] == "tiny-llama" and data["nsamples"] == 3
    assert data["tokens"] == 3 * 63 and data["ppl"] > 1 and data["artifact"]["tensor_hash"]
    assert data["bits_per_element"] == pytest.approx(data["bits"]["bits_per_element"])
    # the same method run without a file gives the same number
    direct = kvcal("eval", "ppl", "--model", "tiny-llama", "--method", "kivi", "--set", "group_size=4", "--set",
                   "residual=8", "--dataset", text, "--seqlen", 64, "--nsamples", 3, "--json", tmp_path / "d.json")
    assert direct.returncode == 0, direct.stderr
    assert json.loads((tmp_path / "d.json").read_text())["ppl"] == pytest.approx(data["ppl"], rel=1e-9)

    inspected = kvcal("inspect", tiny_artifact)
    assert inspected.returncode == 0 and "bits/element" in inspected.stdout and "kivi" in inspected.stdout

    assert kvcal("compare", tiny_artifact, tiny_artifact).returncode == 0
    other = tmp_path / "kivi3.safetensors"
    made = kvcal("calibrate", "--method", "kivi", "--set", "bits=3", "--set", "group_size=4", "--set", "residual=8",
                 "--model", "tiny-llama", "--out", other)
    assert made.returncode == 0, made.stderr
    diff = kvcal("compare", tiny_artifact, other)
    assert diff.returncode == 1 and "config.bits" in diff.stdout
