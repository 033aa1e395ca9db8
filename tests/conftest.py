import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def wikitext_dir() -> str:
    """The slice of WikiText-2 the repository carries (tests/data/wikitext2, with its license note): the tests read
    the same text on every machine, with or without the full data beside the checkout."""
    return str(REPO / "tests" / "data" / "wikitext2")


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
