"""kvcal compare by tensor kind, and the CI quality gate (kvcal gate) on eval records."""

import json

import pytest
import torch

from kvcal.accounting import bits_per_element
from kvcal.artifact import Artifact, make_header
from kvcal.compare import Tolerance, compare_artifacts, compare_tensor, parse_tolerances
from kvcal.errors import KvcalError
from kvcal.eval.gate import FAIL, MISMATCH, PASS, gate
from kvcal.methods import build_method
from tests.test_cli import assert_one_line_error, kvcal


def artifact(tiny, tensors, kinds, **header):
    method = build_method("kivi", {"bits": 2, "group_size": 4, "residual": 8})
    head = make_header(method, tiny, None, bits_per_element(method, tiny.dims))
    head.update(tensor_kinds=kinds, **header)
    return Artifact(head, tensors)


def test_codebook_is_compared_up_to_a_permutation_of_its_codewords():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(2, 3, 8, 4, 2, generator=gen)  # [groups, stages, codewords, pairs, 2]: codewords on axis 2
    perm = torch.randperm(8, generator=gen)
    shuffled = theta[:, :, perm] + 1e-7
    assert compare_tensor("t", shuffled, theta, "codebook:2", Tolerance(atol=1e-6)) is None
    # as a plain tensor the same pair differs, and so does a codebook whose codeword moved
    assert compare_tensor("t", shuffled, theta, "weights", Tolerance(atol=1e-6)) is not None
    moved = shuffled.clone()
    moved[0, 0, 0] += 0.5
    diff = compare_tensor("t", moved, theta, "codebook:2", Tolerance(atol=1e-6))
    assert diff is not None and "1 of" not in diff.what and diff.relative == pytest.approx(
        0.5 / theta.abs().max().item(), rel=1e-6)


def test_svd_factors_are_compared_up_to_sign_and_datatypes_as_sets():
    u = torch.linalg.qr(torch.randn(6, 3, dtype=torch.float64)).Q
    flipped = u * torch.tensor([1.0, -1.0, -1.0])  # columns' signs
    assert compare_tensor("u", flipped, u, "svd_left", Tolerance()) is None
    assert compare_tensor("r", flipped.T.contiguous(), u.T.contiguous(), "svd_right", Tolerance()) is None
    assert compare_tensor("u", flipped, u, "svd_right", Tolerance()) is not None  # rows are not the vectors here
    levels = torch.tensor([-1.0, -0.25, 0.5, 1.0])
    assert compare_tensor("d", levels.flip(0), levels, "datatype", Tolerance()) is None
    assert compare_tensor("d", levels.flip(0), levels, "range", Tolerance()) is not None
    assert compare_tensor("i", torch.tensor([0, 2, 1]), torch.tensor([0, 1, 2]), "index", Tolerance(1.0, 1.0)) \
        .what == "2 of 3 entries differ"


def test_header_provenance_may_differ_diagnostics_never_fail(tiny):
    base = {"layers.0.k.lo": torch.zeros(4), "layers.0.k.stage_mse": torch.tensor([0.5, 0.25])}
    kinds = {"k.lo": "range", "k.stage_mse": "diagnostic"}
    a = artifact(tiny, base, kinds, provenance={"device": "cpu"}, info={"held_out_mse": [0.5, 0.25]})
    b = artifact(tiny, {**base, "layers.0.k.stage_mse": torch.tensor([0.5, 0.3])}, kinds,
                 provenance={"device": "cuda:0"}, info={"held_out_mse": [0.5, 0.3]})
    result = compare_artifacts(a, b)
    assert result.failures == [] and {d.kind for d in result.notes} == {"diagnostic", "info"}
    assert result.summary() == ("equal: 2 tensors and the header within tolerance; largest relative difference "
                                "0.1 in layers.0.k.stage_mse (diagnostic); 2 diagnostic(s) differ (not counted)")
    # a diagnostic tolerance silences them; a config change always fails
    assert compare_artifacts(a, b, {"diagnostic": Tolerance(0.2, 0.0)}).differences == []
    c = artifact(tiny, base, kinds)
    c.header["config"] = dict(c.header["config"], group_size=8)
    assert [d.what.split(":")[0] for d in compare_artifacts(c, a).failures] == ["config.group_size"]


def test_tolerance_parsing_errors():
    assert parse_tolerances(["codebook=1e-3,0"]) == {"codebook": Tolerance(1e-3, 0.0)}
    for bad in ("codebook", "nope=1,1", "range=1", "range=a,b", "range=-1,0"):
        with pytest.raises(KvcalError):
            parse_tolerances([bad])


RECORD = {"setting": "2bit", "method": "kivi", "ppl": 25.0, "bits_per_element": 3.4, "protocol": "gptq",
          "nsamples": 4, "seqlen": 256, "mode": "simulate", "prompt_len": 0, "model": {"name": "tiny-llama"},
          "dtype": "float32", "fp_window": 0,
          "dataset": {"dataset": "wikitext2", "split": "wiki.test.raw", "sha256": "ab"}}


def test_gate_pass_fail_and_mismatch():
    assert gate(dict(RECORD, ppl=25.2), RECORD, 1.0).code == PASS
    verdict = gate(dict(RECORD, ppl=25.3), RECORD, 1.0)
    assert verdict.code == FAIL and verdict.message == "gate: perplexity regressed: 25.3000 > 25.2500 (baseline " \
                                                       "25.0000 +1%)"
    assert gate(dict(RECORD, bits_per_element=3.5), RECORD, 1.0).code == FAIL
    assert gate(dict(RECORD, bits_per_element=3.5), RECORD, 1.0, max_bits_increase=0.1).code == PASS
    assert gate(dict(RECORD, ppl=float("nan")), RECORD, 1.0).code == FAIL
    assert gate(dict(RECORD, ppl=None), RECORD, 1.0).code == FAIL  # a diverged run, as kvcal writes it to JSON
    diverged = gate(RECORD, dict(RECORD, ppl=None), 1.0)  # nothing passes against a diverged baseline
    assert diverged.code == MISMATCH and "baseline's perplexity is nan" in diverged.message
    mismatch = gate(dict(RECORD, protocol="prefill"), RECORD, 1.0)
    assert mismatch.code == MISMATCH and mismatch.message == ("not comparable: protocol is prefill here but gptq in the "
                                                              "baseline")
    with pytest.raises(KvcalError):
        gate(RECORD, RECORD, -1.0)


@pytest.mark.parametrize("field, change, here, there", [
    ("model", {"model": {"name": "tiny-qwen2"}}, "tiny-qwen2", "tiny-llama"),
    ("dataset", {"dataset": dict(RECORD["dataset"], dataset="shakespeare")}, "shakespeare", "wikitext2"),
    ("dataset split", {"dataset": dict(RECORD["dataset"], split="wiki.valid.tokens")}, "wiki.valid.tokens",
     "wiki.test.raw"),
    ("dataset sha256", {"dataset": dict(RECORD["dataset"], sha256="cd")}, "cd", "ab"),
    ("protocol", {"protocol": "tail"}, "tail", "gptq"),
    ("prompt_len", {"prompt_len": 64}, "64", "0"),
    ("mode", {"mode": "decode"}, "decode", "simulate"),
    ("seqlen", {"seqlen": 512}, "512", "256"),
    ("windows", {"nsamples": 8}, "8", "4"),
    ("dtype", {"dtype": "bfloat16"}, "bfloat16", "float32"),
    ("full-precision window", {"fp_window": 128}, "128", "0"),
])
def test_gate_refuses_records_that_measured_something_else(field, change, here, there):
    """Each field that makes two records comparable, written out here rather than read from the gate's own list:
    a record that differs in any one of them is refused, by that field's name, even at a better perplexity."""
    verdict = gate(dict(RECORD, ppl=20.0, **change), RECORD, 1.0)
    assert verdict.code == MISMATCH and verdict.message == (
        f"not comparable: {field} is {here} here but {there} in the baseline")


def test_a_fp16_record_gates_every_full_precision_window():
    """fp16 is the reference of every allowance: a record with a window gates against it; a baseline of perplexity 0
    is refused, not divided by."""
    fp16 = dict(RECORD, method="fp16", setting="fp16", ppl=24.0, bits_per_element=16.0, fp_window=None)
    assert gate(dict(RECORD, fp_window=128), fp16, 10.0).code == PASS
    zero = gate(RECORD, dict(RECORD, ppl=0.0), 1.0)
    assert zero.code == MISMATCH and "baseline's perplexity is 0.0 (not a perplexity)" in zero.message


def test_gate_command_exit_codes(tmp_path):
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(RECORD))
    new.write_text(json.dumps(dict(RECORD, ppl=30.0)))
    ok = kvcal("gate", base, "--baseline", base, "--max-increase", 0)
    assert ok.returncode == 0 and ok.stdout.startswith("gate: passed")
    bad = kvcal("gate", new, "--baseline", base, "--max-increase", 5)
    assert bad.returncode == 1 and bad.stdout.strip().splitlines() == [
        "gate: perplexity regressed: 30.0000 > 26.2500 (baseline 25.0000 +5%)"]
    new.write_text(json.dumps(dict(RECORD, seqlen=512)))
    other = kvcal("gate", new, "--baseline", base, "--max-increase", 5)
    # records that measured different things: an error (docs/conventions.md), one line on stderr, nothing on stdout
    assert_one_line_error(other, "not comparable: seqlen is 512 here but 256 in the baseline")
    assert other.stdout == ""
    missing = kvcal("gate", tmp_path / "none.json", "--baseline", base, "--max-increase", 5)
    assert_one_line_error(missing, f"error: record {tmp_path / 'none.json'} is not a file")
    (tmp_path / "text.json").write_text("not json")
    bad = kvcal("gate", base, "--baseline", tmp_path / "text.json", "--max-increase", 5)
    assert_one_line_error(bad, f"error: --baseline {tmp_path / 'text.json'} is not JSON")
    assert "report:" not in missing.stderr + bad.stderr and missing.stdout == bad.stdout == ""
