"""Result records (JSON from `kvcal eval ppl`) to markdown tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvcal.errors import KvcalError

RECORD_FIELDS = {"setting": str, "method": str, "ppl": (int, float), "bits_per_element": (int, float),
                 "protocol": str, "nsamples": int}


def read_record(path) -> dict:
    """One `kvcal eval ppl` JSON record, or a one-line error saying why the file is not one."""
    path = Path(path)
    if not path.is_file():
        raise KvcalError(f"report: {path} is not a file")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise KvcalError(f"report: {path} is not JSON ({type(exc).__name__})") from None
    if not isinstance(record, dict):
        raise KvcalError(f"report: {path} is not a kvcal eval record (a JSON {type(record).__name__})")
    for key, kind in RECORD_FIELDS.items():
        if key == "ppl" and record.get(key, 0) is None:  # a diverged run, written as null
            record[key] = float("nan")
            continue
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise KvcalError(f"report: {path} is not a kvcal eval record ('{key}' missing or of the wrong type)")
    return record


def _relative(value: float, reference: dict | None) -> str:
    if reference is None or not (reference["ppl"] > 0 and math.isfinite(reference["ppl"])):
        return ""
    return f"{100 * (value / reference['ppl'] - 1):+.1f}%"


def comparison_key(record: dict) -> tuple:
    """What two records must share for one's perplexity to be compared with the other's: the model, the dataset and
    split, the protocol (and its prompt length), the window length and the number of windows."""
    dataset = record.get("dataset") or {}
    return (json.dumps(record.get("model", {}).get("name")), dataset.get("dataset"), dataset.get("split"),
            record.get("protocol"), record.get("prompt_len"), record.get("seqlen"), record.get("nsamples"))


def markdown_table(records: list[dict], commands: bool = False) -> str:
    """One row per record; "vs fp16" against the fp16 record of the same model, dataset, protocol, seqlen and
    windows among `records` (blank when there is none)."""
    references = {}
    for r in records:
        if r["method"] == "fp16":
            references.setdefault(comparison_key(r), r)
    header = ["setting", "method", "PPL", "vs fp16", "bits/elem", "protocol", "windows", "device"]
    if commands:
        header.append("command")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        delta = _relative(r["ppl"], references.get(comparison_key(r)))
        mode = r.get("mode", "simulate")
        row = [r["setting"], r["method"], f"{r['ppl']:.3f}", delta, f"{r['bits_per_element']:.2f}",
               r["protocol"] + ("" if mode in ("simulate", "simulated") else f" ({mode})"),
               str(r["nsamples"]), r.get("device", "?")]
        if commands:
            row.append(f"`{r.get('command', '')}`")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
