"""Checkpoints of a calibration that trains, so that an interrupted run resumes (`kvcal calibrate --resume`).

They live in a folder beside the output artifact (`<artifact>.partial/`): `run.json` names the run (a hash of the
model, its dtype and device type, the method's full config, the calibration windows and the kvcal version) and each
entry is one safetensors file, written to a temporary name and renamed (a Ctrl-C never leaves one half-written):
a finished layer of a stage (`keys.3`: its tensors and its diagnostics as JSON), or the training state of a stage in
progress (`values.3.state`: parameters, optimizer moments, generator states and the step). A method reaches them as
`store.checkpoints` (kvcal/calib/capture.CaptureStore; `Checkpoints.off()` where nothing is kept).

A resumed run computes the same artifact, bit for bit, as an uninterrupted one on the same machine: every random
draw of a method comes from generators whose states are checkpointed with the step, and a finished layer is read
back as it was written (tests/test_resume.py interrupts runs at several points). The folder is removed once the
artifact is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvcal.artifact import write_atomic, write_json
from kvcal.errors import KvcalError
from kvcal.progress import seconds_from_env

CHECKPOINT_SECONDS = 60.0  # a stage in progress saves its training state at most this often (KVCAL_CHECKPOINT_SECONDS)
SUFFIX = ".partial"


def checkpoint_folder(out: str | Path) -> Path:
    """Where the checkpoints of the calibration writing `out` live."""
    out = Path(out)
    return out.with_name(out.name + SUFFIX)


def checkpoint_seconds() -> float:
    return seconds_from_env("KVCAL_CHECKPOINT_SECONDS", CHECKPOINT_SECONDS)


def stale(folder: Path) -> KvcalError:
    """The error for a run without --resume that finds checkpoints: their progress is never dropped silently."""
    return KvcalError(f"{folder} holds checkpoints of an interrupted calibration: pass --resume to continue it, or "
                      "remove the folder to start over")


def run_key(parts: dict, windows: torch.Tensor) -> str:
    """The identity of a calibration run: what its result depends on."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    digest.update(windows.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:32]


class Checkpoints:
    """One run's checkpoint folder (module docstring). `folder` None: nothing is kept (every load misses, saves are
    dropped). Threads may load and save different entries at once (a model split over GPUs fits on each)."""

    def __init__(self, folder: Path | None, key: str = "", every_seconds: float = CHECKPOINT_SECONDS):
        self.folder, self.key, self.every = folder, key, every_seconds
        self.last = time.monotonic()
        self.saved = 0  # entries written by this process
        self.resumed = 0  # entries read back
        self._counting = threading.Lock()  # the counters above, shared by the threads

    @classmethod
    def off(cls) -> Checkpoints:
        return cls(None)

    @classmethod
    def open(cls, folder: Path, key: str, resume: bool, description: dict) -> Checkpoints:
        """The checkpoints of run `key` in `folder`: with `resume`, those an earlier run of the same key left (a
        KvcalError if they belong to another run); without, a fresh folder (a KvcalError if one is there: its
        progress is never dropped silently)."""
        folder = Path(folder)
        if folder.exists():
            if not resume:
                raise stale(folder)
            cls.check_key(folder, key)
        else:
            folder.mkdir(parents=True)
            write_json(folder / "run.json", {"key": key, **description})
        return cls(folder, key, checkpoint_seconds())

    @staticmethod
    def check_key(folder: Path, key: str) -> None:
        """A KvcalError if the checkpoints in `folder` (if any) belong to another run than `key`."""
        if not Path(folder).exists():
            return
        try:
            saved = json.loads((Path(folder) / "run.json").read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            saved = None
        if saved != key:
            raise KvcalError(f"{folder} holds checkpoints of another calibration (model, config, data or kvcal "
                             "version differ): remove the folder, or run without --resume elsewhere")

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def load(self, name: str) -> tuple[dict[str, torch.Tensor], object] | None:
        """(tensors, meta) of entry `name`, or None if it was never saved."""
        if self.folder is None or not self._path(name).is_file():
            return None
        path = self._path(name)
        tensors = load_file(path)
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "null"))
        with self._counting:
            self.resumed += 1
        return tensors, meta

    def save(self, name: str, tensors: dict[str, torch.Tensor], meta=None) -> None:
        """Write entry `name` (tensors moved to the CPU; meta: anything JSON takes, NaN included)."""
        if self.folder is None:
            return
        cpu = {n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()}
        write_atomic(self._path(name), lambda tmp: save_file(cpu, tmp, metadata={"meta": json.dumps(meta)}))
        with self._counting:
            self.last = time.monotonic()
            self.saved += 1

    def drop(self, name: str) -> None:
        if self.folder is not None:
            self._path(name).unlink(missing_ok=True)

    def due(self) -> bool:
        """Whether a stage in progress should save its state now (every_seconds since the last save)."""
        return self.folder is not None and time.monotonic() - self.last >= self.every

    def layer(self, stage: str, index: int, fit):
        """Layer `index` of `stage`: read back if a run saved it, else `fit()` -> (tensors, meta), saved. Either way
        the tensors come back on the CPU and meta as JSON reads it (lists for tuples), so a resumed run's artifact
        and header are those of an uninterrupted one."""
        saved = self.load(f"{stage}.{index}")
        if saved is not None:
            return saved
        return self.keep(f"{stage}.{index}", *fit())

    def keep(self, name: str, tensors: dict[str, torch.Tensor], meta=None):
        """Save entry `name` and return it as `load` would read it back: tensors on the CPU, meta through JSON."""
        self.save(name, tensors, meta)
        return {n: t.detach().cpu() for n, t in tensors.items()}, json.loads(json.dumps(meta))

    def remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
