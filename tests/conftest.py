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
