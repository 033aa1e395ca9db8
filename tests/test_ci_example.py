"""The CI example of docs/ci.md (examples/ci/check-artifact.sh) run as a user's CI runs it, on the tiny Llama: it passes
on the committed golden artifact and baseline record (tests/golden/ci-kvquant*), and fails with the documented lines
when the method's config changes, when a perturbed artifact costs more perplexity than the limit, and when the
baseline record is of another protocol."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
DATA = f"--data-dir {REPO / 'tests' / 'data' / 'wikitext2'}"


def check(tmp_path, **settings) -> subprocess.CompletedProcess:
    kvcal = tmp_path / "kvcal"  # the script calls `kvcal`: this interpreter's
    kvcal.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvcal.cli "$@"\n')
    kvcal.chmod(0o755)
    env = dict(os.environ, KVCAL=str(kvcal), RECIPE=str(GOLDEN / "ci-kvquant.yaml"), MODEL="tiny-llama",
               GOLDEN=str(GOLDEN / "ci-kvquant.safetensors"), BASELINE=str(GOLDEN / "ci-kvquant-eval.json"),
               CALIB_ARGS=f"{DATA} --nsamples 4 --seqlen 128", EVAL_ARGS=f"{DATA} --nsamples 2 --seqlen 128",
               COMPARE_TOL="--rtol 1e-4 --atol 1e-6", MAX_INCREASE="1", WORK=str(tmp_path), COLUMNS="200")
    env.update({k: str(v) for k, v in settings.items()})
    return subprocess.run(["bash", str(REPO / "examples" / "ci" / "check-artifact.sh")], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tmp_path)


def lines(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith(("equal:", "differ:", "gate:"))]


@pytest.mark.slow
def test_ci_example_passes_on_the_golden_artifact_and_fails_as_documented(tmp_path):
    (tmp_path / "ok").mkdir()
    ok = check(tmp_path / "ok")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert lines(ok)[0].startswith("equal: 12 tensors and the header within tolerance")
    assert lines(ok)[1].startswith("gate: passed: perplexity 311.42")

    # (a) the method's config changed: compare names the field, and the gate sees the bits per element move
    recipe = tmp_path / "bits2.yaml"
    recipe.write_text((GOLDEN / "ci-kvquant.yaml").read_text().replace("bits: 3", "bits: 2"))
    (tmp_path / "a").mkdir()
    changed = check(tmp_path / "a", RECIPE=recipe)
    assert changed.returncode == 1
    assert lines(changed)[0].startswith("differ: ") and "config.bits: 2 != 3" in changed.stdout

    # (b) an artifact whose value and key datatypes were scaled: the perplexity regresses beyond 1%

    from kvcal.artifact import Artifact, load_artifact, save_artifact

    golden = load_artifact(GOLDEN / "ci-kvquant.safetensors")
    header = {k: v for k, v in golden.header.items() if k != "tensor_hash"}
    tensors = {k: t * 4 if k.endswith("decode") else t for k, t in golden.tensors.items()}
    perturbed = save_artifact(tmp_path / "perturbed.safetensors", Artifact(header, tensors))
    (tmp_path / "b").mkdir()
    worse = check(tmp_path / "b", ARTIFACT=perturbed)
    assert worse.returncode == 1
    assert lines(worse)[0].startswith("differ: 4 of 12 tensors beyond tolerance")
    assert lines(worse)[1].startswith("gate: perplexity regressed: 365.0") and "(baseline 311.4" in lines(worse)[1]

    # (c) a baseline record of another protocol: not comparable, exit 2
    record = json.loads((GOLDEN / "ci-kvquant-eval.json").read_text())
    other = tmp_path / "tail.json"
    other.write_text(json.dumps(dict(record, protocol="tail")))
    (tmp_path / "c").mkdir()
    refused = check(tmp_path / "c", BASELINE=other)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == ("error: not comparable: protocol is gptq here but tail in the "
                                                       "baseline")
