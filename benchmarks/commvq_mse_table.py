"""The MSE table of the CommVQ digest §9 (its Tables 9-11 and Fig. 4 at small scale) from two calibrated artifacts.

Every number is a held-out one recorded by `kvcal calibrate` in the artifact header (`info`):
- keys: MSE after each residual stage (un-normalised key units, the held-out windows' vectors), against the
  KIVI-style scalar quantizer at the same code bits (per channel over groups of 32 consecutive tokens);
- values: MSE of the learned code against per-token asymmetric quantization at the same code bits, with groups of
  32 channels (fp16 scale and zero per group: +1 bit per element) and with one group per token (+0.17 bits);
  attention-output error after o_proj (held-out blocks) for both.

    python benchmarks/commvq_mse_table.py artifacts/commvq-1bit-smollm2.safetensors \
        artifacts/commvq-2bit-smollm2.safetensors --json results/commvq/mse-commvq-1bit-smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcal.artifact import load_artifact


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summary(path: Path) -> dict:
    art = load_artifact(path)
    info, config = art.header["info"], art.header["config"]
    stages = info["key_stage_mse"]
    row = {
        "artifact": str(path),
        "tensor_hash": art.header["tensor_hash"],
        "bits": config["bits"],
        "paper_bits": info["paper_bits"],
        "bits_per_element": art.header["bits_per_element"],
        "calibration": art.header["calibration"],
        "key_stage_mse_layer0": stages[0],
        "key_stage_mse_mean": [mean([layer[r] for layer in stages]) for r in range(len(stages[0]))],
        "key_mse_layer0": stages[0][-1],
        "key_mse_mean": mean([layer[-1] for layer in stages]),
        "key_scalar_mse_layer0": info["key_scalar_mse"][0],
        "key_scalar_mse_mean": mean(info["key_scalar_mse"]),
        "value_mse_layer0": info["value_mse"][0],
        "value_mse_mean": mean(info["value_mse"]),
        "value_scalar_g32_mse_layer0": info["value_scalar_mse"][0],
        "value_scalar_g32_mse_mean": mean(info["value_scalar_mse"]),
        "value_scalar_token_mse_layer0": info.get("value_scalar_mse_token", [None])[0],
        "value_scalar_token_mse_mean": mean(info.get("value_scalar_mse_token", [])),
        "value_attn_mse_mean": mean(info.get("value_attn_mse", [])),
        "value_attn_scalar_g32_mse_mean": mean(info.get("value_attn_scalar_mse", [])),
        "value_layers_below_scalar_g32": sum(a < b for a, b in zip(info["value_mse"], info["value_scalar_mse"])),
        "value_layers_below_scalar_token": sum(a < b for a, b in zip(info["value_mse"],
                                                                      info.get("value_scalar_mse_token", []))),
        "layers": len(stages),
        "key_em_steps_mean": mean([s for layer in info["key_em_steps"] for grp in layer for s in grp]),
        "key_max_weight_mean": mean([w for layer in info["key_max_weight"] for grp in layer for w in grp]),
    }
    row["key_stage_falls_everywhere"] = all(all(b < a for a, b in zip(layer, layer[1:])) for layer in stages)
    return row


def markdown(rows: list[dict]) -> str:
    def f(x):
        return "-" if x is None else f"{x:.4g}"

    lines = ["| setting | key bits (paper) | key MSE L0 | KIVI-style key MSE L0 | key MSE mean | KIVI key mean "
             "| value MSE L0 | asym g32 L0 | asym token L0 | value MSE mean | asym g32 mean | asym token mean |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| CommVQ-{r['bits']} | {r['paper_bits']['keys']:.4g} | {f(r['key_mse_layer0'])} | "
                     f"{f(r['key_scalar_mse_layer0'])} | {f(r['key_mse_mean'])} | {f(r['key_scalar_mse_mean'])} | "
                     f"{f(r['value_mse_layer0'])} | {f(r['value_scalar_g32_mse_layer0'])} | "
                     f"{f(r['value_scalar_token_mse_layer0'])} | {f(r['value_mse_mean'])} | "
                     f"{f(r['value_scalar_g32_mse_mean'])} | {f(r['value_scalar_token_mse_mean'])} |")
    longest = max(rows, key=lambda r: len(r["key_stage_mse_mean"]))
    lines += ["", "| stages R | key bits | held-out key MSE, layer 0 | mean over layers |", "|---|---|---|---|"]
    per_stage = longest["paper_bits"]["keys"] / len(longest["key_stage_mse_mean"])
    for r, (l0, avg) in enumerate(zip(longest["key_stage_mse_layer0"], longest["key_stage_mse_mean"]), start=1):
        lines.append(f"| {r} | {r * per_stage:.4g} | {l0:.4g} | {avg:.4g} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [summary(p) for p in args.artifacts]
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "markdown": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
