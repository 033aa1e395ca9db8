"""The artifact: one safetensors file per calibration result.

Tensors are named `layers.{i}.{k|v|x}.{name}`. The safetensors metadata holds one JSON document under
the key "kvcal" (the header): schema version, method, full config, model identity, calibration
provenance, kvcal version, bits per element, and a content hash of the tensors. Files are written to
a temporary name and renamed, so a failed run never leaves a half-written artifact. Loading checks
the schema, the hash and (with `check_model`) that the artifact fits the model, naming the field
that does not.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvcal.errors import KvcalError
from kvcal.version import __version__

SCHEMA_VERSION = 1
HEADER_KEY = "kvcal"
TENSOR_NAME = re.compile(r"^layers\.(\d+)\.(k|v|x)\.[A-Za-z0-9_]+$")
# Fields of the model identity that must match for an artifact to apply to a model.
MODEL_FIELDS = ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "rope", "name", "source")


@dataclass
class Artifact:
    header: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.header["method"]

    @property
    def config(self) -> dict:
        return self.header["config"]

    def layer(self, i: int, kind: str) -> dict[str, torch.Tensor]:
        """Tensors of one layer and kind ('k', 'v' or 'x'), keyed by their short name."""
        prefix = f"layers.{i}.{kind}."
        return {name[len(prefix) :]: t for name, t in self.tensors.items() if name.startswith(prefix)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def tensor_hash(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def check_tensor_names(tensors: dict[str, torch.Tensor], num_layers: int) -> None:
    for name in tensors:
        match = TENSOR_NAME.match(name)
        if not match:
            raise ValueError(f"tensor name '{name}' does not follow layers.{{i}}.{{k|v|x}}.{{name}}")
        if int(match.group(1)) >= num_layers:
            raise ValueError(f"tensor '{name}' names a layer beyond the model's {num_layers}")


def software_versions() -> dict:
    """Versions of what a result depends on through float rounding (recorded, never compared)."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def provenance(device) -> dict:
    """Where an artifact was made: the device and the software versions, which may differ between two machines (kvcal
    compare skips them). Nothing that changes from one run to the next on the same machine (no wall time, timestamp,
    host name or process id; the log and the eval records carry times), so the same calibration on the same machine
    writes the same bytes."""
    return {"device": str(device), "software": software_versions()}


def make_header(method, loaded, calibration: dict | None, bits, info: dict | None = None) -> dict:
    """The header without its tensor hash, which `save_artifact` adds. `tensor_kinds` says what each tensor is
    (how kvcal compare compares it: kvcal/compare.py)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "method": method.name,
        "config": method.config(),
        "model": loaded.identity,
        "calibration": calibration,
        "kvcal_version": __version__,
        "bits_per_element": round(bits.bits_per_element, 6),
        "bits": bits.to_dict(),
        "info": info or {},
        "tensor_kinds": dict(getattr(method, "tensor_kinds", {}) or {}),
        "provenance": provenance(getattr(loaded, "device", "cpu")),
    }


def new_file_mode(replacing: str | Path | None = None) -> int:
    """The mode for a file written atomically: the mode of the file it replaces, else what a plain open() would give
    a new file under the current umask (read from /proc where it can be, since setting it to read it is racy)."""
    if replacing is not None and os.path.exists(replacing):
        return os.stat(replacing).st_mode & 0o777
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0)
        os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | Path, write) -> Path:
    """Write a file through `write(temporary path)` in the same folder, then rename it over `path`: an interrupted
    command never leaves one half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, new_file_mode(path))  # mkstemp's 0600 would survive the rename
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def finite_or_null(value):
    """NaN and infinities as null: strict JSON has no spelling for them (a diverged perplexity is recorded as null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_json(path: str | Path, record: dict) -> Path:
    """A JSON record, written atomically (write_atomic), keys sorted, NaN and infinities as null."""
    text = json.dumps(finite_or_null(record), indent=2, sort_keys=True, allow_nan=False) + "\n"
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def save_artifact(path: str | Path, artifact: Artifact) -> Path:
    """Write atomically (write_atomic)."""
    path = Path(path)
    check_tensor_names(artifact.tensors, artifact.header["model"]["num_layers"])
    tensors = {name: t.detach().contiguous().cpu() for name, t in artifact.tensors.items()}
    header = dict(artifact.header, tensor_hash=tensor_hash(tensors))
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata={HEADER_KEY: json.dumps(header, sort_keys=True)}))
    artifact.header = header
    return path


def load_artifact(path: str | Path) -> Artifact:
    path = Path(path)
    if path.is_dir():
        raise KvcalError(f"artifact {path} is a folder, not a .safetensors file")
    if not path.is_file():
        raise KvcalError(f"artifact {path} not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:
        raise KvcalError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    if HEADER_KEY not in metadata:
        raise KvcalError(f"{path} is not a kvcal artifact (its metadata has no '{HEADER_KEY}' header)")
    try:
        header = json.loads(metadata[HEADER_KEY])
    except json.JSONDecodeError:
        raise KvcalError(f"{path} has a corrupt kvcal header (not JSON)") from None
    if not isinstance(header, dict):
        raise KvcalError(f"{path} has a malformed kvcal header (a JSON {type(header).__name__}, not an object)")
    version = header.get("schema_version")
    if version != SCHEMA_VERSION:
        raise KvcalError(
            f"{path} has artifact schema version {version}; this kvcal reads version {SCHEMA_VERSION}: "
            "re-run kvcal calibrate"
        )
    for key in ("method", "config", "model", "tensor_hash"):
        if key not in header:
            raise KvcalError(f"{path} has an incomplete kvcal header (no '{key}')")
    problem = _header_problem(header)
    if problem:
        raise KvcalError(f"{path} has a malformed kvcal header ({problem})")
    if tensor_hash(tensors) != header["tensor_hash"]:
        raise KvcalError(f"{path} is corrupt: its tensors do not match the content hash in its header")
    try:
        check_tensor_names(tensors, header["model"]["num_layers"])
    except ValueError as exc:
        raise KvcalError(f"{path}: {exc}") from None
    return Artifact(header, tensors)


def _header_problem(header: dict) -> str | None:
    """What is wrong with the structure of a header (the content hash covers the tensors only, so a hand-edited header
    must be checked field by field before anything reads it), or None."""
    kinds = {"method": str, "config": dict, "model": dict, "bits": dict, "bits_per_element": (int, float),
             "info": dict, "tensor_kinds": dict}
    for key, kind in kinds.items():
        if key in header and not isinstance(header[key], kind):
            return f"'{key}' is a {type(header[key]).__name__}"
    if not all(isinstance(v, str) for v in header.get("tensor_kinds", {}).values()):
        return "tensor_kinds has a kind that is not a string"
    model = header["model"]
    for key in MODEL_FIELDS:
        if key not in model:
            return f"model.{key} missing"
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size"):
        if not isinstance(model[key], int) or isinstance(model[key], bool) or model[key] <= 0:
            return f"model.{key} is not a positive integer"
    rope = model["rope"]
    if not isinstance(rope, dict) or not isinstance(rope.get("rope_type"), str) \
            or not isinstance(rope.get("theta"), (int, float)):
        return "model.rope is not a RoPE description"
    if not isinstance(model["family"], str) or not isinstance(model["name"], str):
        return "model.family or model.name is not a string"
    if "bits" in header and not isinstance(header["bits"].get("parts", {}), dict):
        return "bits.parts is not an object"
    return None


def check_model(artifact: Artifact, loaded, path: str | Path = "artifact", identity: bool = True) -> None:
    """Refuse an artifact made for another model, naming the first field that differs. With
    identity=False (a model kvcal did not load) only the shapes and RoPE are compared."""
    expected = artifact.header["model"]
    actual = loaded.identity
    gguf = same_gguf(expected.get("source"), actual.get("source"))
    for key in MODEL_FIELDS if identity else MODEL_FIELDS[:-2]:
        if key in ("name", "source") and gguf:
            continue
        if key == "source" and _located_the_same(expected.get(key), actual.get(key)):
            continue
        if expected.get(key) != actual.get(key):
            raise KvcalError(
                f"{path} was calibrated for a model with {key}={_short(expected.get(key))}, "
                f"but {loaded.name} has {key}={_short(actual.get(key))}"
            )


def same_gguf(a, b) -> bool:
    """Whether two source records name the same GGUF content (its sha256), whatever the file was called, where it was,
    or whether it came as a package alias or as its conversion's folder: the same weights."""
    return isinstance(a, dict) and isinstance(b, dict) and bool(a.get("gguf_sha256")) \
        and a.get("gguf_sha256") == b.get("gguf_sha256")


def _located_the_same(a, b) -> bool:
    """Two source records that differ only in `path` (where a local model was found, which says nothing about its
    weights: a folder moved or copied is the same model)."""
    return isinstance(a, dict) and isinstance(b, dict) and \
        {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
