"""The quality gate of a user's CI: an eval record against a baseline record.

`kvcal gate NEW.json --baseline BASE.json --max-increase PCT [--max-bits-increase B]` passes (exit 0) when the new
perplexity is at most PCT percent above the baseline's and the bits per element grew by at most B (default 0); it
fails (exit 1) with one line naming the metric, the baseline, the new value and the limit (both on stdout). Two
records are only comparable when they measured the same thing: the same model, dataset (and its hash), protocol (and
its prompt length), mode, sequence length, number of windows and dtype, and, unless one of them is fp16 (the reference
of every allowance), the same full-precision window; otherwise the gate refuses (exit 2, one error line on stderr)
naming the field that differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcal.errors import KvcalError
from kvcal.eval.report import fp_window_of, read_record

PASS, FAIL, MISMATCH = 0, 1, 2


def _ppl(record: dict) -> float:
    """A record's perplexity; null (how kvcal writes a non-finite one to JSON) reads as nan."""
    value = record.get("ppl")
    return math.nan if value is None else float(value)


# (field shown in the message, how it is read from a record)
MATCH_FIELDS = (
    ("model", lambda r: (r.get("model") or {}).get("name")),  # read_record reads a name alone as {"name": ...}
    ("dataset", lambda r: (r.get("dataset") or {}).get("dataset")),
    ("dataset split", lambda r: (r.get("dataset") or {}).get("split")),
    ("dataset sha256", lambda r: (r.get("dataset") or {}).get("sha256")),
    ("protocol", lambda r: r.get("protocol")),
    ("prompt_len", lambda r: r.get("prompt_len")),
    ("mode", lambda r: r.get("mode")),
    ("seqlen", lambda r: r.get("seqlen")),
    ("windows", lambda r: r.get("nsamples")),
    ("dtype", lambda r: r.get("dtype")),
)


@dataclass
class Verdict:
    code: int  # PASS, FAIL or MISMATCH
    message: str


def gate(new: dict, baseline: dict, max_increase: float, max_bits_increase: float = 0.0) -> Verdict:
    if not (max_increase >= 0 and math.isfinite(max_increase)):
        raise KvcalError(f"--max-increase must be a finite percentage >= 0, got {max_increase}")
    if not (max_bits_increase >= 0 and math.isfinite(max_bits_increase)):
        raise KvcalError(f"--max-bits-increase must be a finite number >= 0, got {max_bits_increase}")
    for name, read in MATCH_FIELDS:
        if read(new) != read(baseline):
            return Verdict(MISMATCH, f"not comparable: {name} is {read(new)} here but {read(baseline)} in the "
                                     "baseline")
    if "fp16" not in (new.get("method"), baseline.get("method")) and fp_window_of(new) != fp_window_of(baseline):
        return Verdict(MISMATCH, f"not comparable: full-precision window is {fp_window_of(new)} here but "
                                 f"{fp_window_of(baseline)} in the baseline")
    ppl, base = _ppl(new), _ppl(baseline)
    if not math.isfinite(base) or base <= 0:  # a diverged baseline (kvcal writes it as null): no limit to hold to
        why = "a diverged run" if not math.isfinite(base) else "not a perplexity"
        return Verdict(MISMATCH, f"not comparable: the baseline's perplexity is {base} ({why}); gate against "
                                 "a baseline that measured a finite one")
    limit = base * (1 + max_increase / 100)
    if not math.isfinite(ppl) or ppl > limit:
        return Verdict(FAIL, f"gate: perplexity regressed: {ppl:.4f} > {limit:.4f} (baseline {base:.4f} "
                             f"+{max_increase:g}%)")
    bits, base_bits = float(new["bits_per_element"]), float(baseline["bits_per_element"])
    if bits > base_bits + max_bits_increase + 1e-9:
        return Verdict(FAIL, f"gate: bits per element grew: {bits:.4f} > {base_bits + max_bits_increase:.4f} "
                             f"(baseline {base_bits:.4f} +{max_bits_increase:g})")
    return Verdict(PASS, f"gate: passed: perplexity {ppl:.4f} vs baseline {base:.4f} ({100 * (ppl / base - 1):+.2f}%, "
                         f"limit +{max_increase:g}%); bits per element {bits:.4f} vs {base_bits:.4f}")


def gate_files(new_path, baseline_path, max_increase: float, max_bits_increase: float = 0.0) -> Verdict:
    return gate(_read(new_path, "record"), _read(baseline_path, "--baseline"), max_increase, max_bits_increase)


def _read(path, what: str) -> dict:
    """An eval record, or a one-line error of the gate's own that says which of the two files is wrong."""
    try:
        return read_record(path)
    except KvcalError as exc:
        raise KvcalError(f"{what} {str(exc).removeprefix('report: ')}") from None
