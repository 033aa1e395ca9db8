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


def test_bench_generate_bad_mode():
    # checked before the CUDA check, so CPU CI sees the message
    assert_one_line_error(kvcal("bench", "generate", "--mode", "lazy"), "unknown mode 'lazy' (eager, eager-launch, graph)")


def test_unknown_model(tmp_path):
    assert_one_line_error(kvcal("eval", "ppl", "--model", "gpt-9", "--method", "fp16"), "unknown model 'gpt-9'")


def test_a_model_path_says_what_is_wrong_with_the_path(tmp_path):
    """A path is not an unknown name: a missing file and a file that is not a .gguf each say so."""
    from kvcal.errors import KvcalError
    from kvcal.models import check_model_args

    with pytest.raises(KvcalError, match=f"^model path {tmp_path / 'm.gguf'} does not exist"):
        check_model_args(str(tmp_path / "m.gguf"), "float32", "cpu")
    (tmp_path / "m.safetensors").write_bytes(b"x")
    with pytest.raises(KvcalError, match="is not a .gguf file"):
        check_model_args(str(tmp_path / "m.safetensors"), "float32", "cpu")


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
    assert data["deterministic"] is True  # eval ppl runs in torch's deterministic mode unless told otherwise
    import torch
    import transformers

    # the versions a number's last digits depend on travel with it
    assert data["software"]["torch"] == torch.__version__
    assert data["software"]["transformers"] == transformers.__version__
    # the same method run without a file gives the same number
    direct = kvcal("eval", "ppl", "--model", "tiny-llama", "--method", "kivi", "--set", "group_size=4", "--set",
                   "residual=8", "--dataset", text, "--seqlen", 64, "--nsamples", 3, "--json", tmp_path / "d.json",
                   "--no-deterministic")
    assert direct.returncode == 0, direct.stderr
    direct_record = json.loads((tmp_path / "d.json").read_text())
    assert direct_record["ppl"] == pytest.approx(data["ppl"], rel=1e-9) and direct_record["deterministic"] is False

    inspected = kvcal("inspect", tiny_artifact)
    assert inspected.returncode == 0 and "bits/element" in inspected.stdout and "kivi" in inspected.stdout

    assert kvcal("compare", tiny_artifact, tiny_artifact).returncode == 0
    other = tmp_path / "kivi3.safetensors"
    made = kvcal("calibrate", "--method", "kivi", "--set", "bits=3", "--set", "group_size=4", "--set", "residual=8",
                 "--model", "tiny-llama", "--out", other)
    assert made.returncode == 0, made.stderr
    diff = kvcal("compare", tiny_artifact, other)
    assert diff.returncode == 1 and "config.bits" in diff.stdout


def _malformed_header(artifact, tmp_path, name, edit):
    """A copy of `artifact` whose header was edited by hand (the content hash covers the tensors only)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(artifact), framework="pt") as f:
        header, tensors = json.loads(f.metadata()["kvcal"]), {k: f.get_tensor(k) for k in f.keys()}
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path), metadata={"kvcal": json.dumps(edit(header))})
    return path


BAD_INPUT = {  # argv (TMP: the test's folder, ART: a header-edited artifact) -> what the one line must say
    "device": (["eval", "ppl", "--method", "fp16", "--model", "tiny-llama", "--device", "gpu"], "unknown device 'gpu'"),
    "batch": (["eval", "ppl", "--method", "fp16", "--model", "tiny-llama", "--batch-size", "0"],
              "--batch-size must be positive"),
    "tolerance": (["compare", "ART", "ART", "--rtol", "-1"], "--rtol must be a finite number >= 0"),
    "header": (["inspect", "ART"], "malformed kvcal header (model.rope is not a RoPE description)"),
    "json_into_a_folder": (["eval", "ppl", "--method", "fp16", "--model", "tiny-llama", "--json", "TMP"],
                           "is a folder; expected a file path"),
    "report": (["report", "TMP/r.json"], "is not a kvcal eval record ('setting' missing"),
    "report_without_manifest": (["report", "--docs"], "pass --manifest FILE"),
    "empty_prompt": (["generate", "--prompt", "", "--model", "tiny-llama", "--method", "fp16"], "--prompt is empty"),
    "generate_past_the_context": (["generate", "--prompt", "hi", "--model", "tiny-llama", "--method", "fp16",
                                   "--max-new-tokens", "4200"], "--max-new-tokens 4200 exceed tiny-llama's context of "
                                                                "4096 tokens: use --max-new-tokens 4094 or less"),
    "out_and_out_dir": (["calibrate", "--method", "rtn", "--model", "tiny-llama", "--out", "TMP/a.safetensors",
                         "--out-dir", "TMP/d"], "give --out (the artifact's path) or --out-dir"),
    "eval_nsamples_without_eval": (["calibrate", "--method", "rtn", "--model", "tiny-llama", "--out",
                                    "TMP/a.safetensors", "--eval-nsamples", "5"], "--eval-nsamples needs --eval"),
    "eval_of_a_bulk_only_setting": (["calibrate", "--recipe", "calibquant-1bit", "--model", "tiny-llama", "--eval",
                                     "--out", "TMP/c.safetensors"],
                                    "--eval runs the gptq protocol: calibquant group_tokens=0 takes its ranges"),
    "two_recipes_one_name": (["calibrate", "--model", "tiny-llama", "--recipe", "kivi-2bit", "--recipe", "kivi-2bit",
                              "--out-dir", "TMP/d"], "would both write kivi-2bit.safetensors"),
    "fp_window_twice": (["eval", "ppl", "--method", "rtn", "--model", "tiny-llama", "--set", "fp_window=5",
                         "--fp-window", "10"], "give the full-precision allowance once"),
    "json_dir_records_of_one_name": (["eval", "ppl", "--artifact", "ART", "--artifact", "ART", "--json-dir",
                                      "TMP/j"], "their --json-dir records would overwrite each other"),
    "backend_without_decode": (["eval", "ppl", "--method", "rtn", "--model", "tiny-llama", "--backend", "reference"],
                               "--backend applies to --mode decode only"),
    "bench_recipe": (["bench", "decode", "--recipe", "foo"], "recipe 'foo' not found"),  # before the CUDA check
    # click's own usage errors (typer draws them as a multi-line box in standalone mode)
    "unknown_option": (["calibrate", "--method", "rtn", "--bogus", "1"], "No such option: --bogus"),
    "not_an_integer": (["eval", "ppl", "--nsamples", "abc"], "Invalid value for '--nsamples'"),
    "unknown_command": (["frobnicate"], "No such command 'frobnicate'"),
    "missing_argument": (["compare", "ART"], "Missing argument"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_before_any_work(case, tiny_artifact, tmp_path):
    argv, needle = BAD_INPUT[case]
    art = _malformed_header(tiny_artifact, tmp_path, "rope", lambda h: {**h, "model": {**h["model"], "rope": None}})
    (tmp_path / "r.json").write_text("{}")
    before = sorted(tmp_path.iterdir())
    argv = [str(art) if a == "ART" else a.replace("TMP", str(tmp_path)) for a in argv]
    assert_one_line_error(kvcal(*argv), needle)
    assert sorted(tmp_path.iterdir()) == before  # nothing written, no temporary file left


def test_json_writer_leaves_no_temporary_file_and_the_umask_mode(tmp_path):
    from kvcal.cli import write_json_atomic

    mask = os.umask(0o022)  # a umask under which mkstemp's 0600 and the expected 0644 differ
    try:
        _check_json_writer(tmp_path, write_json_atomic)
    finally:
        os.umask(mask)


def _check_json_writer(tmp_path, write_json_atomic):
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "r.json", {"bad": object()})
    assert list(tmp_path.iterdir()) == []
    write_json_atomic(tmp_path / "r.json", {"ppl": float("nan"), "x": [1.5, float("inf")]})
    assert json.loads((tmp_path / "r.json").read_text()) == {"ppl": None, "x": [1.5, None]}  # strict JSON
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644
    (tmp_path / "r.json").chmod(0o640)  # rewriting a record keeps the mode its owner gave it
    write_json_atomic(tmp_path / "r.json", {"ppl": 1.0})
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o640


def test_unexpected_errors_are_one_line_with_exit_3(monkeypatch, capsys):
    import kvcal.cli as cli

    def boom(**kwargs):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(cli, "app", boom)
    monkeypatch.delenv("KVCAL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("internal error: RuntimeError: first line") and "\n" not in err and "KVCAL_DEBUG" in err
    monkeypatch.setenv("KVCAL_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main()


@pytest.mark.parametrize("argv,flag", [
    (["calibrate", "--method", "rtn", "--model", "tiny-llama", "--out", "/proc/kvcal-nope/x.safetensors"], "--out"),
    (["eval", "ppl", "--method", "rtn", "--model", "tiny-llama", "--json", "/proc/kvcal-nope/r.json"], "--json"),
])
def test_an_unwritable_output_fails_first_naming_its_flag(argv, flag):
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc (a folder where no file can be created, even by root)")
    assert_one_line_error(kvcal(*argv), f"cannot write {flag} /proc/kvcal-nope/")


@pytest.mark.parametrize("edit,needle", [
    (lambda h: {**h, "config": {**h["config"], "bits": 4}}, "bits per element but its config gives"),
    (lambda h: {**h, "method": "kvquant"}, "unknown config key 'group_size' for method kvquant"),
])
def test_inspect_refuses_an_edited_header(edit, needle, tiny_artifact, tmp_path):
    art = _malformed_header(tiny_artifact, tmp_path, "edited", edit)
    assert_one_line_error(kvcal("inspect", art), needle)


def test_version_and_an_artifact_with_nothing_learned(tmp_path):
    from kvcal import __version__

    result = kvcal("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"kvcal {__version__}"
    result = kvcal("calibrate", "--method", "rtn", "--model", "tiny-llama", "--out", tmp_path / "rtn.safetensors")
    assert result.returncode == 0, result.stderr
    assert "no learned tensors: the artifact records the config" in result.stdout


def test_interrupt_says_nothing_was_written(tmp_path):
    """SIGINT while the model loads or calibration captures: exit 130, one line, no artifact. The signal comes after 12
    s, when Python has long finished importing kvcal (a signal during the imports would be Python's, not kvcal's),
    while smollm2-135m's 64 windows of Fisher capture still have far longer to run on any CPU."""
    import signal
    import time

    env = dict(os.environ, COLUMNS="200")
    out = tmp_path / "a.safetensors"
    proc = subprocess.Popen([sys.executable, "-m", "kvcal.cli", "calibrate", "--method", "kvquant", "--model",
                             "smollm2-135m", "--dataset", "shakespeare", "--nsamples", "64", "--seqlen", "512",
                             "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            # a test run started in the background of a shell inherits SIGINT ignored: restore it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(12)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted: nothing written"), stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_missing_data_fails_at_once_with_one_line(tmp_path):
    """No data folder and no Hub: the clear line comes from the data check that runs before the model loads (no
    retries of `datasets`); a wrong --data-dir the same."""
    env = {k: v for k, v in os.environ.items() if k != "KVCAL_DATA_DIR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "empty"), COLUMNS="200")
    result = subprocess.run([sys.executable, "-m", "kvcal.cli", "calibrate", "--method", "kvquant", "--model",
                             "tiny-llama", "--out", str(tmp_path / "a.safetensors")], capture_output=True, text=True,
                            env=env, timeout=120)
    assert_one_line_error(result, "wikitext2 is not available offline (the Hub is unreachable")
    assert_one_line_error(kvcal("eval", "ppl", "--method", "rtn", "--model", "tiny-llama", "--data-dir", tmp_path),
                          f"wikitext2 eval data not found in {tmp_path}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_calibrate_eval_writes_records_that_report_compares(tmp_path):
    result = kvcal("calibrate", "--method", "kvquant", "--model", "tiny-llama", "--dataset", "shakespeare",
                   "--nsamples", "2", "--seqlen", "64", "--eval", "--eval-nsamples", "2", "--eval-json-dir",
                   tmp_path / "rec", "--out", tmp_path / "kvq.safetensors")
    assert result.returncode == 0, result.stderr
    fp16, kvq = (json.loads((tmp_path / "rec" / f"{n}.json").read_text()) for n in ("fp16", "kvq"))
    assert (fp16["method"], kvq["method"], kvq["nsamples"], kvq["seqlen"]) == ("fp16", "kvquant", 2, 64)
    printed = [line for line in result.stdout.splitlines() if line.startswith("│ kvquant")][0]
    assert f"{kvq['ppl']:.4f}" in printed  # the record holds what the table printed
    report = kvcal("report", tmp_path / "rec" / "fp16.json", tmp_path / "rec" / "kvq.json").stdout
    assert f"{100 * (kvq['ppl'] / fp16['ppl'] - 1):+.1f}%" in report


def test_a_runtime_set_on_an_artifact_names_its_setting(tmp_path):
    """`--set` on an artifact's runtime field changes what is measured, so the record's setting says it (as a --set
    on a recipe names the artifact): two such records never share a name in --json-dir."""
    art = tmp_path / "rtn.safetensors"
    assert kvcal("calibrate", "--method", "rtn", "--model", "tiny-llama", "--out", art).returncode == 0
    data = Path(__file__).parent / "data" / "wikitext2"
    for sets, name in (([], "rtn"), (["--set", "fp_window=8"], "rtn-fp_window8")):
        result = kvcal("eval", "ppl", "--artifact", art, *sets, "--data-dir", data, "--nsamples", "1", "--seqlen",
                       "64", "--json-dir", tmp_path / "j")
        assert result.returncode == 0, result.stderr
        assert json.loads((tmp_path / "j" / f"{name}.json").read_text())["setting"] == name


def test_fewer_windows_than_asked_are_said(tmp_path):
    """--nsamples above what the evaluation text holds evaluates what it holds, says so on stderr, and the record
    and table count the windows that ran."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["alpha beta gamma delta river stone light sound"] * 50))
    result = kvcal("eval", "ppl", "--model", "tiny-llama", "--method", "fp16", "--dataset", text, "--nsamples", "100",
                   "--seqlen", "64", "--json", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    held = json.loads((tmp_path / "r.json").read_text())["nsamples"]
    assert 0 < held < 100
    assert (f"note: {text}'s evaluation text holds {held} windows of 64 tokens, fewer than the 100 asked: "
            f"evaluating those {held}") in result.stderr


def test_a_decode_tail_every_setting_cannot_run_is_refused_before_any_is_evaluated(tmp_path):
    """The tail protocol in decode mode needs storages that compress the prompt in bulk: with a bulk CalibQuant
    artifact first and an RTN one after it, the refusal names RTN's storages before CalibQuant is evaluated."""
    data = Path(__file__).parent / "data" / "wikitext2"
    cq, rtn = tmp_path / "cq.safetensors", tmp_path / "rtn.safetensors"
    assert kvcal("calibrate", "--recipe", "calibquant-1bit", "--model", "tiny-llama", "--data-dir", data,
                 "--nsamples", "2", "--seqlen", "64", "--out", cq).returncode == 0
    assert kvcal("calibrate", "--method", "rtn", "--model", "tiny-llama", "--out", rtn).returncode == 0
    result = kvcal("eval", "ppl", "--artifact", cq, "--artifact", rtn, "--data-dir", data, "--protocol", "tail",
                   "--mode", "decode", "--seqlen", "128", "--prefix-len", "32", "--block-len", "64", "--nsamples", "1")
    assert_one_line_error(result, "the tail protocol runs in decode mode only for storages that compress the prompt")
    assert "ppl cq" not in result.stdout + result.stderr
