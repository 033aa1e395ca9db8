"""Draw CommVQ's training-budget curves: perplexity against the value encoder's training tokens, one row of panels
per model (CommVQ-2, CommVQ-1), one line per equal-footing rule, from the sweep records of
`benchmarks/commvq_budget_sweep.py`; fp16 and the strongest other settings of the model's equal-footing records as
horizontal lines (KVQuant nuq2 for 2 bits, eviction at 1 bit of memory for 1 bit).

    python benchmarks/commvq_budget_plot.py --model smollm2-135m --model qwen2.5-coder-0.5b --out docs/commvq-budget.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = {"gptq-fp0": "gptq strict", "gptq-fp128": "gptq, 128 fp16", "tail-fp0": "tail strict"}
STYLES = {"gptq-fp0": "-", "gptq-fp128": "--", "tail-fp0": ":"}
# the equal-footing records drawn beside each recipe's curve: (label, record name, rule)
REFERENCES = {
    "commvq-2bit": [("KVQuant nuq2", "gptq-kvquant-nuq2-1pct-fp0.json", "gptq-fp0"),
                    ("KVQuant nuq2", "gptq-kvquant-nuq2-1pct-fp128.json", "gptq-fp128")],
    "commvq-1bit": [("evict, 1 bit", "gptq-evict-1bit-fp0.json", "gptq-fp0")],
}
SWEEPS = {"smollm2-135m": "budget-sweep-smollm2", "qwen2.5-coder-0.5b": "budget-sweep-qwen2.5-coder-0.5b"}


def value_curve(sweep: dict, recipe: str) -> list[dict]:
    """The value-budget points of `recipe` in a sweep.json (512-token steps, the recipe's key vectors, 64 WikiText-2
    windows), sorted by training tokens, each with its perplexity per rule."""
    points = [p for p in sweep["points"] if p["recipe"] == recipe and p["dataset"] == "wikitext2"
              and p["nsamples"] == 64 and "-t1-k1-" in p["point"] and all(r in p for r in RULES)]
    return sorted(({"tokens": p["value_train_tokens"], **{r: p[r]["ppl"] for r in RULES}} for p in points),
                  key=lambda p: p["tokens"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, choices=sorted(SWEEPS))
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        sys.exit("commvq_budget_plot: needs matplotlib (pip install 'kvcal[plot]')")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.model), 2, figsize=(12, 4.2 * len(args.model)), dpi=110, squeeze=False)
    for row, model in enumerate(args.model):
        sweep = json.loads((ROOT / "results/commvq" / SWEEPS[model] / "sweep.json").read_text())
        refs = ROOT / "results/equal-footing" / model
        fp16 = {r: json.loads((refs / f"{r.split('-')[0]}-fp16-{r.split('-')[1]}.json").read_text())["ppl"]
                for r in RULES}
        for col, recipe in enumerate(("commvq-2bit", "commvq-1bit")):
            ax = axes[row][col]
            curve = value_curve(sweep, recipe)
            for i, rule in enumerate(RULES):
                ax.plot([p["tokens"] for p in curve], [p[rule] for p in curve], STYLES[rule], marker="o",
                        color=f"C{i}", label=f"{recipe}, {RULES[rule]}")
                ax.axhline(fp16[rule], color=f"C{i}", lw=0.8, alpha=0.5, ls=STYLES[rule])
            for label, name, rule in REFERENCES[recipe]:
                ppl = json.loads((refs / name).read_text())["ppl"]
                ax.axhline(ppl, color="0.3", lw=1, ls=STYLES[rule], label=f"{label}, {RULES[rule]}")
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
            lowest = curve[0]["tokens"]
            ax.set_xticks([p["tokens"] for p in curve],
                          [f"x{p['tokens'] // lowest}\n{p['tokens'] / 1e6:.1f}M" for p in curve])
            ax.set_xlabel("value-encoder training tokens (multiple of the minimal budget)")
            ax.set_ylabel("perplexity (thin lines: fp16 per rule)")
            ax.set_title(f"{model}, {recipe}", fontsize=10)
            ax.grid(True, which="both", lw=0.3, alpha=0.5)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out)
    plt.close(fig)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
