"""Result records (JSON from `kvcal eval ppl`) to markdown tables."""

from __future__ import annotations


def markdown_table(records: list[dict], commands: bool = False) -> str:
    reference = next((r for r in records if r["method"] == "fp16"), None)
    header = ["setting", "method", "PPL", "vs fp16", "bits/elem", "protocol", "windows", "device"]
    if commands:
        header.append("command")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        delta = "" if reference is None else f"{100 * (r['ppl'] / reference['ppl'] - 1):+.1f}%"
        mode = r.get("mode", "simulate")
        row = [r["setting"], r["method"], f"{r['ppl']:.3f}", delta, f"{r['bits_per_element']:.2f}",
               r["protocol"] + ("" if mode in ("simulate", "simulated") else f" ({mode})"),
               str(r["nsamples"]), r.get("device", "?")]
        if commands:
            row.append(f"`{r.get('command', '')}`")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
