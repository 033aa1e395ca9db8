"""Write the golden artifacts of tests/test_contract.py (every registered method, or those named), calibrated exactly
as the contract test calibrates: the tiny Llama in float64, its fixed text, 3 windows of 64 tokens.

    python tests/golden/regenerate.py [METHOD...]

Run it when a change is meant to move what a method learns, and commit the new files with that change."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvcal.calib.run import run_calibration  # noqa: E402
from kvcal.models import load_model  # noqa: E402
from tests.test_contract import GOLDEN, METHODS, TEXT, _method  # noqa: E402


def main(names: list[str]) -> None:
    loaded = load_model("tiny-llama", "float64")
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text(TEXT)
        for name in names or METHODS:
            out = GOLDEN / f"{name}-tiny-llama.safetensors"
            run_calibration(loaded, _method(name), out, str(text), nsamples=3, seqlen=64)
            print(f"{out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
