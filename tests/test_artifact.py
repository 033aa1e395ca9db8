"""Artifact write/read, validation errors, and compare."""

import json

import pytest
import torch
from safetensors.torch import save_file

from kvcal.accounting import bits_per_element
from kvcal.artifact import (
    HEADER_KEY,
    Artifact,
    check_model,
    load_artifact,
    make_header,
    save_artifact,
)
from kvcal.compare import Tolerance, compare_artifacts
from kvcal.errors import KvcalError
from kvcal.methods import build_method
from kvcal.models import load_model


def make(tiny, tensors=None, bits=2):
    method = build_method("kivi", {"bits": bits, "group_size": 4, "residual": 8})
    header = make_header(method, tiny, None, bits_per_element(method, tiny.dims))
    return Artifact(header, tensors if tensors is not None else {"layers.0.k.scale": torch.arange(4.0)})


def test_round_trip_and_determinism(tmp_path, tiny):
    a = save_artifact(tmp_path / "a.safetensors", make(tiny))
    b = save_artifact(tmp_path / "b.safetensors", make(tiny))
    assert a.read_bytes() == b.read_bytes()  # same inputs, bit-identical file
    loaded = load_artifact(a)
    assert loaded.method == "kivi" and loaded.config["bits"] == 2
    assert torch.equal(loaded.tensors["layers.0.k.scale"], torch.arange(4.0))
    assert loaded.layer(0, "k") == {"scale": loaded.tensors["layers.0.k.scale"]}
    assert loaded.header["model"]["num_layers"] == tiny.dims.num_layers
    check_model(loaded, tiny)  # fits the model it was made for


def test_no_partial_file_when_saving_fails(tmp_path, tiny):
    bad = make(tiny, {"layers.0.k.scale": torch.ones(2), "not a valid name": torch.ones(2)})
    with pytest.raises(ValueError):
        save_artifact(tmp_path / "x.safetensors", bad)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_and_foreign_files_are_clear_errors(tmp_path, tiny):
    path = save_artifact(tmp_path / "a.safetensors", make(tiny))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a bit of the last tensor
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(KvcalError, match="corrupt"):
        load_artifact(corrupt)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(KvcalError, match="not a readable safetensors"):
        load_artifact(garbage)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.ones(1)}, str(foreign))
    with pytest.raises(KvcalError, match="not a kvcal artifact"):
        load_artifact(foreign)
    with pytest.raises(KvcalError, match="not found"):
        load_artifact(tmp_path / "missing.safetensors")


def test_schema_version_mismatch(tmp_path, tiny):
    art = make(tiny)
    art.header["schema_version"] = 99
    path = tmp_path / "v99.safetensors"
    save_file({"layers.0.k.scale": torch.arange(4.0)}, str(path), metadata={HEADER_KEY: json.dumps(art.header)})
    with pytest.raises(KvcalError, match="schema version 99"):
        load_artifact(path)


@pytest.mark.parametrize("edit, problem", [
    ({"info": [1, 2]}, "'info' is a list"),
    ({"tensor_kinds": [1]}, "'tensor_kinds' is a list"),
    ({"tensor_kinds": {"layers.0.k.scale": 3}}, "tensor_kinds has a kind that is not a string"),
])
def test_a_hand_edited_header_is_refused_by_field(tmp_path, tiny, edit, problem):
    """The tensor hash does not cover the header: `inspect` and `compare` read info and tensor_kinds, so load_artifact
    checks their types."""
    saved = load_artifact(save_artifact(tmp_path / "a.safetensors", make(tiny)))
    path = tmp_path / "edited.safetensors"
    save_file(saved.tensors, str(path), metadata={HEADER_KEY: json.dumps({**saved.header, **edit})})
    with pytest.raises(KvcalError, match=f"malformed kvcal header \\({problem}\\)"):
        load_artifact(path)


def test_model_mismatch_names_the_field(tmp_path, tiny):
    path = save_artifact(tmp_path / "a.safetensors", make(tiny))
    other = load_model("tiny-qwen3")
    with pytest.raises(KvcalError, match="family=llama, but tiny-qwen3 has family=qwen3"):
        check_model(load_artifact(path), other, path)


def test_compare(tmp_path, tiny):
    a = load_artifact(save_artifact(tmp_path / "a.safetensors", make(tiny)))
    assert compare_artifacts(a, a).differences == []
    b = load_artifact(save_artifact(tmp_path / "b.safetensors", make(tiny, {"layers.0.k.scale": torch.arange(4.0) + 1e-4})))
    result = compare_artifacts(a, b)
    assert [d.where for d in result.failures] == ["layers.0.k.scale"]
    assert result.summary().startswith("differ: 1 of 1 tensors beyond tolerance, 0 header field(s)")
    assert compare_artifacts(a, b, default=Tolerance(atol=1e-3)).differences == []
    c = load_artifact(save_artifact(tmp_path / "c.safetensors", make(tiny, bits=3)))
    where = {d.what.split(":")[0] for d in compare_artifacts(a, c).failures}
    assert {"config.bits", "bits_per_element"} <= where
    # a config key an older artifact lacks stands for the method's default (kivi's residual, 128): equal when the
    # other artifact holds the default, a difference when it holds another value
    for residual, differs in ((128, False), (8, True)):
        new = make(tiny)
        new.header["config"]["residual"] = residual
        old = make(tiny)
        del old.header["config"]["residual"]
        found = [d.what for d in compare_artifacts(new, old).failures]
        assert bool(found) == differs and all(w.startswith("config.residual") for w in found), found


def test_calibrating_twice_gives_the_same_bytes_whatever_the_clock_host_and_folder(tmp_path, tiny, monkeypatch):
    """Two calibrations with the same inputs write the same bytes, though the second runs on a clock that says it took
    a thousand times longer, under another host name and from another working folder, with its activations captured
    through --capture-cache: nothing in the artifact depends on the run (wall times go to the log)."""
    import platform
    import socket
    import time

    from kvcal.artifact import flatten
    from kvcal.calib.run import run_calibrations

    text = tmp_path / "t.txt"
    text.write_text(open(__file__).read() * 2)
    settings = {"kvquant": {"bits": 3}, "skvq": {"k_bits": 2, "v_bits": 2, "group_size": 8, "clip": "global"},
                "xquant": {"bits": 4, "variant": "svd", "group_tokens": 8, "group_channels": 16}}

    def calibrate(folder, **kwargs):
        jobs = [(build_method(name, config), folder / f"{name}.safetensors") for name, config in settings.items()]
        run_calibrations(tiny, jobs, str(text), nsamples=2, seqlen=48, **kwargs)
        return {name: (folder / f"{name}.safetensors").read_bytes() for name in settings}

    first = calibrate(tmp_path / "a")
    real_perf, real_time = time.perf_counter, time.time
    monkeypatch.setattr(time, "perf_counter", lambda: 1000 * real_perf() + 12345.6)
    monkeypatch.setattr(time, "time", lambda: 1000 * real_time())
    monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
    monkeypatch.setattr(platform, "node", lambda: "another-host")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    second = calibrate(tmp_path / "b", capture_cache=tmp_path / "captures")
    for name in settings:
        assert first[name] == second[name], name
        header = flatten(load_artifact(tmp_path / "b" / f"{name}.safetensors").header)
        timed = [k for k in header if any(w in k.lower() for w in ("second", "time", "host", "date", "pid"))]
        assert timed == [], timed
        # the only path in the header is the calibration text's, an input (xquant learns from the weights alone)
        assert [k for k, v in header.items() if str(tmp_path) in str(v)] == (["calibration.dataset"]
                                                                             if name != "xquant" else []), name
