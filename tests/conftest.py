import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def wikitext_dir() -> str:
    """The offline WikiText-2 folder: $KVCAL_DATA_DIR, else the workplace's ../shared/data/wikitext2."""
    for candidate in (os.environ.get("KVCAL_DATA_DIR"), REPO.parent / "shared" / "data" / "wikitext2"):
        if candidate and (Path(candidate) / "wiki.test.raw").is_file():
            return str(candidate)
    pytest.skip("no offline WikiText-2 (set KVCAL_DATA_DIR)")


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
