"""Comparing two artifacts the way a CI gate needs: by what each tensor is.

An artifact's header says what kind each of its tensors is (`tensor_kinds`: short name -> kind, declared by the
method, kvcal/methods/base.py `Method.tensor_kinds`). A kind says how two versions of a tensor are compared:

- `codebook:AXIS` -- codewords that codes index, along AXIS: compared up to the permutation that pairs each codeword
  of A with its nearest codeword of B (when that pairing is a permutation; else as stored).
- `datatype` -- the levels of non-uniform datatypes (last axis): compared as sorted sets.
- `svd_left` / `svd_right` -- singular vectors as columns / rows: compared up to the sign of each vector.
- `index` -- integer indices (permutations, channel lists, group offsets): exactly.
- `range`, `spectrum`, `weights`, `tensor` -- plain elementwise comparison.
- `diagnostic` -- statistics kept for reporting (held-out MSE, search losses), not read by the codec: differences
  are listed but never make the artifacts differ. The header's `info` (calibration diagnostics) likewise.

Tolerances are per kind (`--tol KIND=RTOL,ATOL`; `--rtol/--atol` for every kind not named). Header fields must
match exactly (method, config, model identity, calibration data and settings, bits), except those that may differ
between two runs of the same calibration: provenance (device, software versions), the content hash, kvcal's
version, the tokenizer's class name, where a local model was found (`model.source.path`: its hash or files are
compared), and the folder of a local calibration text whose content hash matches.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcal.artifact import Artifact, _short, flatten
from kvcal.errors import KvcalError
from kvcal.methods.registry import all_methods

KINDS = {
    "tensor": "a learned tensor of no declared kind",
    "codebook": "codewords indexed by codes: up to a permutation of the codewords",
    "datatype": "levels of a non-uniform datatype: as sorted sets",
    "svd_left": "singular vectors as columns: up to each column's sign",
    "svd_right": "singular vectors as rows: up to each row's sign",
    "spectrum": "singular values",
    "range": "calibrated ranges, clips and scalars",
    "index": "integer indices: exactly",
    "weights": "weights trained by gradient descent",
    "diagnostic": "statistics for reporting only: listed, never a difference",
}
# header fields two runs of the same calibration may differ in (prefixes of the flattened header)
MAY_DIFFER = ("tensor_hash", "kvcal_version", "provenance.", "calibration.tokenizer", "model.source.path")
NOTE_ONLY = ("info.",)


@dataclass(frozen=True)
class Tolerance:
    rtol: float = 0.0
    atol: float = 0.0

    def __str__(self) -> str:
        return f"rtol={self.rtol:g} atol={self.atol:g}"


@dataclass
class Difference:
    where: str  # "header" or a tensor name
    kind: str  # tensor kind, "header" or "info"
    what: str
    relative: float = 0.0  # max |A - B| / max |B| (tensors), for the summary
    fails: bool = True  # False: a diagnostic (listed, not a difference)


@dataclass
class Comparison:
    differences: list[Difference] = field(default_factory=list)
    tensors: int = 0

    @property
    def failures(self) -> list[Difference]:
        return [d for d in self.differences if d.fails]

    @property
    def notes(self) -> list[Difference]:
        return [d for d in self.differences if not d.fails]

    def summary(self) -> str:
        bad = self.failures
        tensors = [d for d in bad if d.kind not in ("header", "info")]
        header = len(bad) - len(tensors)
        if not bad:
            text = f"equal: {self.tensors} tensors and the header within tolerance"
        else:
            text = f"differ: {len(tensors)} of {self.tensors} tensors beyond tolerance, {header} header field(s)"
        worst = max((d for d in self.differences if d.kind not in ("header", "info")), key=lambda d: d.relative,
                    default=None)
        if worst is not None:
            text += f"; largest relative difference {worst.relative:.3g} in {worst.where} ({worst.kind})"
        if self.notes:
            text += f"; {len(self.notes)} diagnostic(s) differ (not counted)"
        return text


def parse_kind(spec: str) -> tuple[str, int | None]:
    """'codebook:2' -> ('codebook', 2); 'range' -> ('range', None)."""
    name, _, axis = spec.partition(":")
    if name not in KINDS:
        raise KvcalError(f"unknown tensor kind '{name}' (known: {', '.join(KINDS)})")
    if axis and not axis.lstrip("-").isdigit():
        raise KvcalError(f"tensor kind '{spec}': the axis after ':' must be an integer")
    return name, int(axis) if axis else None


def parse_tolerances(specs: list[str]) -> dict[str, Tolerance]:
    """['codebook=1e-3,1e-5', ...] -> {kind: Tolerance}, or a one-line error."""
    out = {}
    for spec in specs:
        kind, eq, values = spec.partition("=")
        parts = values.split(",")
        if not eq or kind not in KINDS or len(parts) != 2:
            raise KvcalError(f"--tol takes KIND=RTOL,ATOL with KIND one of {', '.join(KINDS)}, got {spec!r}")
        try:
            rtol, atol = float(parts[0]), float(parts[1])
        except ValueError:
            raise KvcalError(f"--tol {spec!r}: RTOL and ATOL must be numbers") from None
        if not (rtol >= 0 and atol >= 0 and math.isfinite(rtol) and math.isfinite(atol)):
            raise KvcalError(f"--tol {spec!r}: RTOL and ATOL must be finite numbers >= 0")
        out[kind] = Tolerance(rtol, atol)
    return out


def kinds_of(artifact: Artifact) -> dict[str, str]:
    """Short tensor name ('k.theta') -> kind spec: the header's, else the registered method's declaration."""
    kinds = artifact.header.get("tensor_kinds")
    if isinstance(kinds, dict):
        return kinds
    cls = all_methods().get(artifact.method)
    return dict(getattr(cls, "tensor_kinds", {}) or {})


def short_name(name: str) -> str:
    parts = name.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "layers" else name


def _nearest_permutation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a, b [M, N, C] -> b's codeword order [M, N] pairing each of a's codewords with its nearest of b's, when that is a
    permutation in every batch; else None."""
    order = torch.cdist(a, b).argmin(dim=-1)  # [M, N]
    if not bool((order.sort(dim=-1).values == torch.arange(a.shape[1])).all()):
        return None
    return order


def canonical(a: torch.Tensor, b: torch.Tensor, kind: str, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b (float64) brought to the form in which `kind` compares them."""
    if kind == "datatype":
        return a.sort(dim=-1).values, b.sort(dim=-1).values  # each table's levels (the last axis) as a set
    if kind in ("svd_left", "svd_right") and a.dim() >= 2:
        vec = -2 if kind == "svd_left" else -1  # the axis along which one singular vector runs
        sign = torch.sign((a * b).sum(dim=vec, keepdim=True))
        return a, b * torch.where(sign == 0, torch.ones_like(sign), sign)
    if kind == "codebook" and axis is not None and a.dim() > 0:
        axis = axis % a.dim()
        n, width = a.shape[axis], math.prod(a.shape[axis + 1:])
        flat_a, flat_b = a.reshape(-1, n, width), b.reshape(-1, n, width)
        order = _nearest_permutation(flat_a, flat_b)
        if order is not None:
            flat_b = torch.gather(flat_b, 1, order[..., None].expand_as(flat_b))
        return flat_a.reshape(a.shape), flat_b.reshape(b.shape)
    return a, b


def compare_tensor(name: str, ta: torch.Tensor, tb: torch.Tensor, spec: str, tol: Tolerance) -> Difference | None:
    kind, axis = parse_kind(spec)
    fails = kind != "diagnostic"
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        return Difference(name, kind, f"{ta.dtype}{list(ta.shape)} != {tb.dtype}{list(tb.shape)}", math.inf, fails)
    if not ta.is_floating_point() or kind == "index":
        if torch.equal(ta, tb):
            return None
        count = int((ta != tb).sum())
        return Difference(name, kind, f"{count} of {ta.numel()} entries differ", 1.0, fails)
    a, b = canonical(ta.double(), tb.double(), kind, axis)
    if torch.allclose(a, b, rtol=tol.rtol, atol=tol.atol, equal_nan=True):
        return None
    diff = (a - b).abs().nan_to_num(nan=math.inf)
    scale = float(b.abs().nan_to_num(nan=0.0).max()) if b.numel() else 0.0
    relative = float(diff.max()) / scale if scale > 0 else math.inf
    beyond = int((diff > tol.atol + tol.rtol * b.abs()).sum())
    return Difference(name, kind, f"max |A-B| = {float(diff.max()):.3g}, {relative:.3g} of max |B| ({beyond} of "
                                  f"{ta.numel()} beyond {tol})", relative, fails)


def _numbers(value) -> list[float] | None:
    """A number or a (nested) list of numbers, flattened; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, list):
        out = []
        for item in value:
            inner = _numbers(item)
            if inner is None:
                return None
            out.extend(inner)
        return out
    return None


def _config_default(artifact: Artifact, key: str):
    """What a config key absent from an artifact stands for: the registered method's default for it (an artifact
    written before the key existed calibrated with that behaviour), else "<absent>"."""
    cls = all_methods().get(artifact.method)
    name = key.removeprefix("config.")
    if cls is not None and key.startswith("config.") and "." not in name and dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name == name and f.default is not dataclasses.MISSING:
                return f.default
    return "<absent>"


def _header_differences(a: Artifact, b: Artifact, diagnostic: Tolerance) -> list[Difference]:
    out = []
    ha, hb = flatten(a.header), flatten(b.header)
    for key in sorted(set(ha) | set(hb)):
        if key.startswith(MAY_DIFFER) or key == "tensor_kinds" or key.startswith("tensor_kinds."):
            continue
        va = ha[key] if key in ha else _config_default(a, key)
        vb = hb[key] if key in hb else _config_default(b, key)
        if va == vb:
            continue
        if key == "calibration.dataset" and ha.get("calibration.sha256") == hb.get("calibration.sha256") and \
                Path(str(va)).name == Path(str(vb)).name:
            continue  # the same local text file (its content hash) in another folder
        note = key.startswith(NOTE_ONLY)
        na, nb = _numbers(va), _numbers(vb)
        if note and na is not None and nb is not None and len(na) == len(nb):
            if all(abs(x - y) <= diagnostic.atol + diagnostic.rtol * abs(y) for x, y in zip(na, nb)):
                continue
        out.append(Difference("header", "info" if note else "header", f"{key}: {_short(va)} != {_short(vb)}",
                              fails=not note))
    return out


def compare_artifacts(a: Artifact, b: Artifact, tolerances: dict[str, Tolerance] | None = None,
                      default: Tolerance = Tolerance()) -> Comparison:
    """Every difference between A and B beyond the tolerances of each tensor's kind (B is the reference)."""
    tolerances = tolerances or {}
    kinds = {**kinds_of(b), **kinds_of(a)}
    result = Comparison(_header_differences(a, b, tolerances.get("diagnostic", default)))
    for name in sorted(set(a.tensors) | set(b.tensors)):
        ta, tb = a.tensors.get(name), b.tensors.get(name)
        spec = kinds.get(short_name(name), "tensor")
        result.tensors += 1
        if ta is None or tb is None:
            result.differences.append(Difference(name, parse_kind(spec)[0], "only in " + ("B" if ta is None else "A"),
                                                 math.inf))
            continue
        kind = parse_kind(spec)[0]
        diff = compare_tensor(name, ta, tb, spec, tolerances.get(kind, default))
        if diff is not None:
            result.differences.append(diff)
    return result
