"""`kvcal calibrate` end to end: data -> capture -> method.calibrate -> artifact on disk."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvcal import __version__
from kvcal.accounting import bits_per_element
from kvcal.artifact import Artifact, make_header, save_artifact
from kvcal.calib.capture import CaptureStore, capture
from kvcal.calib.checkpoint import Checkpoints, checkpoint_folder, run_key, stale
from kvcal.data import calibration_windows, load_text, tokenize
from kvcal.eval.ppl import TailObjective
from kvcal.models.dims import check_context
from kvcal.progress import progress_bar, stderr_console


def capture_key(loaded, windows) -> str:
    digest = hashlib.sha256(json.dumps([loaded.identity, str(loaded.dtype), loaded.device.type], sort_keys=True).encode())
    digest.update(windows.numpy().tobytes())
    return digest.hexdigest()[:24]


def cached_capture(loaded, windows, needs: set[str], budget_bytes, batch_size, cache_dir: Path | None) -> CaptureStore:
    """Capture, or reuse a capture saved under `cache_dir` for the same model, dtype and windows that
    holds at least what `needs` asks for (a new capture then takes the union, to serve both)."""
    if cache_dir is None:
        with progress_bar(f"capturing {', '.join(sorted(needs))}", windows.shape[0]) as advance:
            return capture(loaded, windows, needs, budget_bytes, batch_size, advance)
    cache_dir = Path(cache_dir)
    folder = cache_dir / capture_key(loaded, windows)
    cached = set()
    if (folder / "needs.json").is_file():
        cached, problem = CaptureStore.saved_needs(folder, loaded.dims.num_layers)
        if problem is not None:  # a capture left broken (a full disk, a hand edit): capture again and replace it
            Console(stderr=True).print(f"[yellow]capture cache {folder} is unreadable ({escape(problem)}): capturing "
                                       "again[/yellow]", highlight=False)
    if needs <= cached:
        return CaptureStore.load(folder, loaded.dims.num_layers)
    needs = needs | cached
    with progress_bar(f"capturing {', '.join(sorted(needs))}", windows.shape[0]) as advance:
        store = capture(loaded, windows, needs, budget_bytes, batch_size, advance)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".capture-", dir=cache_dir))
    try:
        store.save(staging)
        (staging / "needs.json").write_text(json.dumps(sorted(needs)))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return store


def check_calibration(methods, nsamples: int, seqlen: int) -> None:
    """What each method that learns says about the calibration windows (CommVQ: a holdout that leaves no training
    window), before any model loads."""
    for method in methods:
        if method.learns:
            method.check_calibration(nsamples, seqlen)


def announce_replacements(paths) -> None:
    """One line on stderr per artifact that exists and will be replaced, before the calibration starts (an existing
    artifact is replaced, never silently: docs/conventions.md)."""
    for path in paths:
        if Path(path).exists():
            stderr_console.print(f"note: {path} exists and will be replaced when this calibration finishes (--out or "
                                 "--out-dir to keep it)", markup=False, highlight=False, soft_wrap=True)


def check_checkpoints(paths, resume: bool) -> None:
    """Without --resume, a one-line error if an interrupted calibration left checkpoints for one of these artifacts
    (before the capture; its progress is never dropped silently). With it, a note for each that has none."""
    for path in paths:
        folder = checkpoint_folder(path)
        if folder.exists() and not resume:
            raise stale(folder)
        if resume and not folder.exists():
            stderr_console.print(f"note: nothing to resume for {path} (no {folder}): calibrating from the start",
                                 markup=False, highlight=False, soft_wrap=True)


def run_calibrations(loaded, jobs: list[tuple[object, str | Path]], dataset: str = "wikitext2", nsamples: int = 16,
                     seqlen: int = 2048, seed: int = 0, data_dir: str | None = None, budget_bytes: int = 4 << 30,
                     batch_size: int = 1, capture_cache: Path | None = None, on_done=None,
                     resume: bool = False) -> list[Artifact]:
    """Calibrate several (method, out path) jobs on the same windows: one capture serves them all
    (it holds the union of what they need), and each artifact is written as soon as it is ready. A method that
    trains checkpoints beside its artifact (kvcal/calib/checkpoint.py); `resume` continues from what an interrupted
    run of the same calibration left there."""
    # model-dependent defaults resolved, so each artifact's config states the numbers it was calibrated with
    jobs = [(method.for_model(loaded.dims), out) for method, out in jobs]
    for method, _ in jobs:
        method.check_model(loaded.dims)
    learners = [method for method, _ in jobs if method.learns]
    check_calibration(learners, nsamples, seqlen)
    announce_replacements(out for _, out in jobs)
    check_checkpoints([out for method, out in jobs if method.learns], resume)
    store, calibration = None, None
    if learners:
        check_context(loaded, seqlen, "--seqlen")
        text = load_text(dataset, "calib", data_dir)
        windows = calibration_windows(tokenize(loaded.tokenizer, text.text), nsamples, seqlen, seed)
        calibration = {
            **text.provenance,
            "nsamples": nsamples,
            "seqlen": seqlen,
            "seed": seed,
            "tokens": int(windows.numel()),
            "tokenizer": type(loaded.tokenizer).__name__,
            "dtype": str(loaded.dtype).removeprefix("torch."),
        }
        if resume:  # checkpoints of another calibration are refused before the capture, not after it
            for method, out in jobs:
                if method.learns:
                    Checkpoints.check_key(checkpoint_folder(out), checkpoint_key(loaded, method, calibration, windows))
        needs = set().union(*(method.capture_needs() for method in learners))
        # a method that only runs the model on the windows (CalibQuant's tau search) needs no capture
        store = (cached_capture(loaded, windows, needs, budget_bytes, batch_size, capture_cache) if needs
                 else CaptureStore(loaded.dims.num_layers))
        store.windows = windows
        store.objective = TailObjective(loaded)
    artifacts = []
    try:
        for method, out in jobs:
            if method.learns:
                store.checkpoints = open_checkpoints(loaded, method, out, calibration, store.windows, resume)
                try:
                    tensors, info = method.calibrate(loaded, store)
                except BaseException:
                    keep_or_remove(store.checkpoints, out)
                    raise
            else:
                tensors, info = method.calibrate(loaded, None)
            bits = bits_per_element(method, loaded.dims)
            # no wall time in the header (the same inputs give the same bytes): `kvcal calibrate` prints it
            header = make_header(method, loaded, calibration if method.learns else None, bits, info)
            artifact = Artifact(header, tensors)
            save_artifact(out, artifact)
            if store is not None:
                store.checkpoints.remove()
                store.checkpoints = Checkpoints.off()
            artifacts.append(artifact)
            if on_done is not None:
                on_done(method, out, artifact)
    finally:
        if store is not None:
            store.close()
    return artifacts


def checkpoint_key(loaded, method, calibration: dict, windows) -> str:
    """What the checkpoints of calibrating `method` are keyed by: what the artifact depends on (the model, its dtype
    and device type, the method's config, the calibration data and windows, the kvcal version)."""
    parts = {"model": loaded.identity, "dtype": str(loaded.dtype), "device": loaded.device.type,
             "method": method.name, "config": method.config(), "calibration": calibration, "kvcal": __version__}
    return run_key(parts, windows)


def open_checkpoints(loaded, method, out, calibration: dict, windows, resume: bool) -> Checkpoints:
    """The checkpoints of calibrating `method` into `out` (checkpoint_key's)."""
    return Checkpoints.open(checkpoint_folder(out), checkpoint_key(loaded, method, calibration, windows), resume,
                            {"artifact": str(out), "method": method.name})


def keep_or_remove(checkpoints: Checkpoints, out) -> None:
    """After a calibration stopped (Ctrl-C, an error): say where its checkpoints are and how to continue, or remove
    the folder if nothing was saved in it yet."""
    if checkpoints.saved + checkpoints.resumed == 0:
        checkpoints.remove()
        return
    stderr_console.print(f"note: checkpoints of {out} kept in {checkpoints.folder}: the same command with --resume "
                         "continues from them", markup=False, highlight=False, soft_wrap=True)


def run_calibration(loaded, method, out: str | Path, *args, **kwargs) -> Artifact:
    """Calibrate one method (see run_calibrations for the arguments)."""
    return run_calibrations(loaded, [(method, out)], *args, **kwargs)[0]
