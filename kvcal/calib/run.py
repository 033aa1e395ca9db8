"""`kvcal calibrate` end to end: data -> capture -> method.calibrate -> artifact on disk."""

from __future__ import annotations

from pathlib import Path

from kvcal.accounting import bits_per_element
from kvcal.artifact import Artifact, make_header, save_artifact
from kvcal.calib.capture import capture
from kvcal.data import calibration_windows, load_text, tokenize
from kvcal.progress import progress_bar


def default_artifact_path(model_name: str, method_name: str, tag: str) -> Path:
    return Path("artifacts") / model_name / f"{method_name}-{tag}.safetensors"


def run_calibration(loaded, method, out: str | Path, dataset: str = "wikitext2", nsamples: int = 16,
                    seqlen: int = 2048, seed: int = 0, data_dir: str | None = None,
                    budget_bytes: int = 4 << 30, batch_size: int = 1) -> Artifact:
    method.check_model(loaded.dims)
    tensors, calibration, info = {}, None, {}
    if method.learns:
        text = load_text(dataset, "calib", data_dir)
        ids = tokenize(loaded.tokenizer, text.text)
        windows = calibration_windows(ids, nsamples, seqlen, seed)
        needs = method.capture_needs()
        with progress_bar(f"capturing {', '.join(sorted(needs))}", windows.shape[0]) as advance:
            store = capture(loaded, windows, needs, budget_bytes, batch_size, advance)
        with store:
            tensors, info = method.calibrate(loaded, store)
        calibration = {
            **text.provenance,
            "nsamples": nsamples,
            "seqlen": seqlen,
            "seed": seed,
            "tokens": int(windows.numel()),
            "tokenizer": type(loaded.tokenizer).__name__,
            "dtype": str(loaded.dtype).removeprefix("torch."),
        }
    bits = bits_per_element(method, loaded.dims)
    artifact = Artifact(make_header(method, loaded, calibration, bits, info), tensors)
    save_artifact(out, artifact)
    return artifact
