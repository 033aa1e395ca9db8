import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# fixed calibration text of the tiny models (a new test must not change what the contract's artifacts calibrate on)
CALIBRATION_TEXT = " ".join(f"key{(i * 7919) % 251} value {(i * 104729) % 97}." for i in range(3000))


# Triton-interpreter case runs: minutes of subprocess each, started as soon as collection shows a test that reads them
# (pytest_collection_finish), so they run beside the rest of the suite; the fixture interpreter_checks waits for one
INTERPRETER_RUNS = {"tests.kernel_cases": ("tests/test_kernels.py", "KERNEL_CHECKS "),
                    "tests.xquant_kernel_cases": ("tests/test_xquant.py", "XQUANT_KERNELS ")}
INTERPRETER_TIMEOUT = 1500  # seconds per run, counted from its start
_runs: dict = {}


def _start_interpreter_run(module: str) -> None:
    import subprocess
    import sys
    import tempfile
    import time

    if module in _runs:
        return
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KVCAL_DISABLE_TRITON", None)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: a full pipe would stall the run
    proc = subprocess.Popen([sys.executable, "-m", module], cwd=REPO, env=env, stdout=out, stderr=err, text=True)
    _runs[module] = (proc, out, err, time.monotonic())


def pytest_collection_finish(session):
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return
    readers = {Path(str(item.path)).resolve() for item in session.items
               if "interpreter_checks" in getattr(item, "fixturenames", ())}
    for module, (test_file, _) in INTERPRETER_RUNS.items():
        if (REPO / test_file).resolve() in readers:
            _start_interpreter_run(module)


def pytest_sessionfinish(session, exitstatus):
    for proc, *_ in _runs.values():
        if proc.poll() is None:
            proc.kill()


def _interpreter_checks(module: str) -> dict:
    """The JSON that `python -m <module>` prints under TRITON_INTERPRET=1 (started early by collection, or now)."""
    import json
    import subprocess
    import time

    _start_interpreter_run(module)
    proc, out, err, started = _runs[module]
    try:
        proc.wait(timeout=max(1.0, INTERPRETER_TIMEOUT - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{module} under the Triton interpreter ran past {INTERPRETER_TIMEOUT} s") from None
    out.seek(0)
    err.seek(0)
    prefix = INTERPRETER_RUNS[module][1]
    lines = [x for x in out.read().splitlines() if x.startswith(prefix)]
    assert proc.returncode == 0 and lines, err.read()[-4000:]
    return json.loads(lines[-1][len(prefix):])


@pytest.fixture(scope="session")
def interpreter_checks():
    """interpreter_checks(module) -> the results of a Triton-interpreter case run (INTERPRETER_RUNS)."""
    return _interpreter_checks


@pytest.fixture(scope="session")
def wikitext_dir() -> str:
    """The slice of WikiText-2 the repository carries (tests/data/wikitext2, with its license note): the tests read
    the same text on every machine, with or without the full data beside the checkout."""
    return str(REPO / "tests" / "data" / "wikitext2")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """CALIBRATION_TEXT in a file (a text-file dataset: calibration and evaluation windows from the same text)."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(CALIBRATION_TEXT)
    return path


@pytest.fixture(scope="module")
def tiny():
    """The random tiny Llama (no download); one per test module, as the tests may install handlers on it."""
    from kvcal.models import load_model

    return load_model("tiny-llama")


@pytest.fixture(scope="session")
def smollm2():
    from kvcal.models import load_model

    return load_model("smollm2-135m", "float32", "cpu")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(min(4, os.cpu_count() or 1))


def package_model_marks(alias: str) -> list:
    """pytestmark of an opt-in end-to-end test on a model that packages ship (`make setup` leaves them out,
    `make test-models` installs them): slow, models, and skipped with the missing packages named."""
    import importlib.util

    from kvcal.models.registry import ALIASES

    modules = [item.split(":", 1)[0] for item in ALIASES[alias].source.split("+")]
    missing = sorted(m.replace("_", "-") for m in modules if importlib.util.find_spec(m) is None)
    return [pytest.mark.slow, pytest.mark.models,
            pytest.mark.skipif(bool(missing), reason=f"{alias}'s packages are not installed ({', '.join(missing)}): "
                               "`make test-models` installs them and runs this test")]

