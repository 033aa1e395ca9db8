"""Resumable calibration (kvcal/calib/checkpoint.py): a run interrupted after any checkpoint and resumed writes the
same artifact, byte for byte, as an uninterrupted run; stale or foreign checkpoints are one-line errors."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kvcal.calib import checkpoint as ckpt
from kvcal.calib.run import run_calibration
from kvcal.cli import app
from kvcal.errors import KvcalError
from kvcal.methods.registry import all_methods, build_method
from kvcal.models import load_model

TRAINERS = ["commvq", "kvquant", "skvq"]  # the methods that checkpoint as they train



@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny-llama", "float32")


def _method(name: str):
    return build_method(name, dict(all_methods()[name].test_config))


def _calibrate(loaded, name, out, text_file, resume=False):
    return run_calibration(loaded, _method(name), out, str(text_file), nsamples=3, seqlen=64, resume=resume)


class Interrupt:
    """Ctrl-C right after the n-th checkpoint written from now on (counted over every save)."""

    def __init__(self, monkeypatch, after: int):
        self.left = after
        save = ckpt.Checkpoints.save

        def interrupting(inner, *args, **kwargs):
            save(inner, *args, **kwargs)
            self.left -= 1
            if self.left == 0:
                raise KeyboardInterrupt

        monkeypatch.setattr(ckpt.Checkpoints, "save", interrupting)


@pytest.fixture(scope="module")
def uninterrupted(loaded, text_file, tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole")
    made = {}
    for name in TRAINERS:
        out = folder / f"{name}.safetensors"
        _calibrate(loaded, name, out, text_file)
        made[name] = out.read_bytes()
    return made


def _saves(loaded, name, text_file, tmp_path, monkeypatch) -> int:
    """How many checkpoints an uninterrupted run writes."""
    count = [0]
    save = ckpt.Checkpoints.save

    def counting(inner, *args, **kwargs):
        count[0] += 1
        save(inner, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(ckpt.Checkpoints, "save", counting)
        _calibrate(loaded, name, tmp_path / "count.safetensors", text_file)
    return count[0]


@pytest.mark.parametrize("name", TRAINERS)
def test_an_interrupted_run_resumes_to_the_same_bytes(name, loaded, text_file, uninterrupted, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CHECKPOINT_SECONDS", "0")  # the value training saves after every step
    total = _saves(loaded, name, text_file, tmp_path, monkeypatch)
    assert total >= 2
    # interrupted after the first checkpoint, in the middle, and after the last but one
    for after in sorted({1, total // 2, total - 1}):
        out = tmp_path / f"{name}-{after}.safetensors"
        with monkeypatch.context() as m:
            Interrupt(m, after)
            with pytest.raises(KeyboardInterrupt):
                _calibrate(loaded, name, out, text_file)
        assert not out.exists() and ckpt.checkpoint_folder(out).is_dir()
        with pytest.raises(KvcalError, match="--resume"):  # never started over silently
            _calibrate(loaded, name, out, text_file)
        _calibrate(loaded, name, out, text_file, resume=True)
        assert out.read_bytes() == uninterrupted[name], f"{name}: resumed after checkpoint {after} of {total}"
        assert not ckpt.checkpoint_folder(out).exists()


def test_commvq_resumes_twice_mid_training(loaded, text_file, uninterrupted, tmp_path, monkeypatch):
    """Interrupted in the value training (both layers train together), resumed, and interrupted again there."""
    monkeypatch.setenv("KVCAL_CHECKPOINT_SECONDS", "0")
    out = tmp_path / "commvq.safetensors"
    for after in (4, 3):  # 2 key layers, then a state after each value step: steps 2 and 5
        with monkeypatch.context() as m:
            Interrupt(m, after)
            with pytest.raises(KeyboardInterrupt):
                _calibrate(loaded, "commvq", out, text_file, resume=after == 3)
        states = sorted(p.name for p in ckpt.checkpoint_folder(out).glob("values.*.state.safetensors"))
        assert states == ["values.0-1.state.safetensors"]  # the training in progress
    _calibrate(loaded, "commvq", out, text_file, resume=True)
    assert out.read_bytes() == uninterrupted["commvq"]


def test_checkpoints_of_another_run_are_refused(loaded, text_file, tmp_path, monkeypatch):
    out = tmp_path / "kvquant.safetensors"
    with monkeypatch.context() as m:
        Interrupt(m, 1)
        with pytest.raises(KeyboardInterrupt):
            _calibrate(loaded, "kvquant", out, text_file)
    other = build_method("kvquant", {**all_methods()["kvquant"].test_config, "bits": 4})

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before the checkpoints were checked")

    monkeypatch.setattr("kvcal.calib.run.cached_capture", no_capture)  # refused before the capture, not after it
    with pytest.raises(KvcalError, match="another calibration"):
        run_calibration(loaded, other, out, str(text_file), nsamples=3, seqlen=64, resume=True)


def test_a_run_stopped_before_any_checkpoint_leaves_nothing(loaded, text_file, tmp_path, monkeypatch):
    out = tmp_path / "skvq.safetensors"

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvcal.methods.skvq.calibrate.channel_layout", stop)
    with pytest.raises(KeyboardInterrupt):
        _calibrate(loaded, "skvq", out, text_file)
    assert not ckpt.checkpoint_folder(out).exists()


def test_cli_refuses_stale_checkpoints_before_loading(tmp_path):
    out = tmp_path / "a.safetensors"
    ckpt.checkpoint_folder(out).mkdir()
    result = CliRunner().invoke(app, ["calibrate", "--recipe", "commvq-1bit", "--model", "smollm2-135m", "--out",
                                      str(out)])
    assert result.exit_code != 0
    assert "holds checkpoints of an interrupted calibration: pass --resume" in str(result.exception) + result.output


def test_bad_checkpoint_seconds_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCAL_CHECKPOINT_SECONDS", "soon")
    with pytest.raises(KvcalError, match="KVCAL_CHECKPOINT_SECONDS"):
        ckpt.Checkpoints.open(tmp_path / "x.partial", "key", False, {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_commvq_resumes_step_graphs_to_the_same_bytes(text_file, tmp_path, monkeypatch):
    """value_graphs on CUDA: a run interrupted in the middle of the replayed steps and resumed (warm-up steps again,
    then a new graph) writes what the uninterrupted run writes, byte for byte."""
    monkeypatch.setenv("KVCAL_CHECKPOINT_SECONDS", "0")
    loaded = load_model("tiny-llama", "float32", "cuda")
    method = build_method("commvq", {**all_methods()["commvq"].test_config, "value_steps": 16, "value_graphs": True})

    def calibrate(out, resume=False):
        return run_calibration(loaded, method, out, str(text_file), nsamples=3, seqlen=64, resume=resume)

    whole = tmp_path / "whole.safetensors"
    calibrate(whole)
    out = tmp_path / "resumed.safetensors"
    with monkeypatch.context() as m:
        Interrupt(m, 2 + 10)  # 2 key layers, then a state after each value step: stopped after step 10
        with pytest.raises(KeyboardInterrupt):
            calibrate(out)
    calibrate(out, resume=True)
    assert out.read_bytes() == whole.read_bytes()


def test_sigterm_keeps_the_checkpoints_as_ctrl_c_does(tmp_path):
    """SIGTERM (a scheduler, `kill`), to a calibration started with SIGINT ignored as a shell's background job is:
    exit 143 with one line, the value training's state kept beside the artifact, and the note on --resume."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "commvq.safetensors"
    env = dict(os.environ, COLUMNS="200", KVCAL_CHECKPOINT_SECONDS="0")
    proc = subprocess.Popen([sys.executable, "-m", "kvcal.cli", "calibrate", "--method", "commvq", "--model",
                             "tiny-llama", "--dataset", "shakespeare", "--nsamples", "3", "--seqlen", "64", "--set",
                             "value_steps=1000000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    folder = ckpt.checkpoint_folder(out)
    deadline = time.monotonic() + 180
    while not list(folder.glob("values.*.state.safetensors")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("terminated (SIGTERM): nothing written"), stderr
    assert any("the same command with --resume continues from them" in line for line in lines), stderr
    assert not out.exists() and list(folder.glob("values.*.state.safetensors"))
