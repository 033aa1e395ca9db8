"""Long runs: windows beyond the model's context are refused at once, an interrupt takes effect within seconds, and
calibration settings that cannot work are refused before any model loads."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.test_cli import assert_one_line_error, kvcal

DATA = str(REPO / "tests" / "data" / "wikitext2")


def test_a_window_beyond_the_context_is_refused(tmp_path):
    # tiny-llama's max_position_embeddings is 4096
    assert_one_line_error(kvcal("eval", "ppl", "--model", "tiny-llama", "--method", "fp16", "--data-dir", DATA,
                                "--seqlen", 4097), "--seqlen 4097 exceeds tiny-llama's context of 4096 tokens")
    out = tmp_path / "a.safetensors"
    assert_one_line_error(kvcal("calibrate", "--method", "kvquant", "--model", "tiny-llama", "--data-dir", DATA,
                                "--seqlen", 5000, "--out", out), "--seqlen 5000 exceeds tiny-llama's context of 4096")
    assert not out.exists()
    ok = kvcal("eval", "ppl", "--model", "tiny-llama", "--method", "fp16", "--data-dir", DATA, "--seqlen", 4096,
               "--nsamples", 1)
    assert ok.returncode == 0, ok.stderr


def test_an_interrupt_between_decode_steps_ends_the_run_at_once():
    """SIGINT once evaluation has started (its first progress line is on stderr, a pipe): exit 130 within seconds,
    not at the end of the window."""
    env = dict(os.environ, COLUMNS="200", KVCAL_PROGRESS_SECONDS="0.5")
    proc = subprocess.Popen([sys.executable, "-m", "kvcal.cli", "eval", "ppl", "--model", "tiny-llama", "--method",
                             "rtn", "--mode", "decode", "--data-dir", DATA, "--seqlen", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            # a test run started in the background of a shell inherits SIGINT ignored: restore it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stderr.readline()
    assert first.startswith("ppl rtn-int4 (gptq, decode; tokens): "), first
    assert " after " in first and "s left)" in first, first
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 130, rest
    assert time.monotonic() - sent < 10
    assert rest.strip().splitlines()[-1].startswith("interrupted: nothing written"), rest


def test_commvq_holdout_without_a_training_window_is_refused_before_the_model_loads(monkeypatch, capsys):
    import kvcal.cli as cli
    import kvcal.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(kvcal.models, "load_model", no_load)
    monkeypatch.setattr(sys, "argv", ["kvcal", "calibrate", "--recipe", "commvq-2bit", "--nsamples", "1"])
    monkeypatch.delenv("KVCAL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: commvq holdout=0.1 leaves no training window of the 1 calibration "
                                               "windows (use more --nsamples or holdout=0)")
    monkeypatch.setattr(sys, "argv", ["kvcal", "calibrate", "--recipe", "commvq-2bit", "--nsamples", "1", "--set",
                                      "holdout=0", "--model", "nope"])
    with pytest.raises(SystemExit):  # holdout=0 passes this check and fails at the next one, the model's name
        cli.main()
    assert "unknown model 'nope'" in capsys.readouterr().err
