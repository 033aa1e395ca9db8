import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# fixed calibration text of the tiny models (a new test must not change what the contract's artifacts calibrate on)
CALIBRATION_TEXT = " ".join(f"key{(i * 7919) % 251} value {(i * 104729) % 97}." for i in range(3000))


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

