"""Key outliers per token and KV head under a KVQuant artifact (docs/runtime.md).

How many key outliers a token has under a KVQuant artifact's calibrated per-channel ranges, on
evaluation windows (all layers), per token and per (token, KV head): what the packed runtime's fixed
capacity (slots per token and KV head) must hold.

    python benchmarks/kvquant_outlier_counts.py --json results/kvquant/key-outlier-counts-2x512.json
(needs the kvquant artifacts from benchmarks/kvquant_smollm2.sh and KVCAL_DATA_DIR)
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from kvcal.artifact import load_artifact
from kvcal.data import load_eval_windows
from kvcal.eval.ppl import simulated_nll
from kvcal.methods.kvquant.calibrate import to_rows
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--nsamples", type=int, default=2)
    ap.add_argument("--artifacts", nargs="*", default=["kvquant-nuq4-1pct", "kvquant-nuq2-1pct"])
    ap.add_argument("--artifact-dir", default="artifacts/smollm2-135m")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    loaded = load_model("smollm2-135m", "float32", "cpu")
    text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), a.seqlen, a.nsamples)
    result = {"model": loaded.identity, "seqlen": a.seqlen, "nsamples": int(windows.shape[0]), "artifacts": {}}
    for name in a.artifacts:
        path = os.path.join(a.artifact_dir, f"{name}.safetensors")
        method, storages = storages_for_artifact(load_artifact(path), loaded, path)
        counts, head_counts = [], []

        def counting(k, v, storage, reconstruct, counts=counts, head_counts=head_counts,
                     heads=loaded.dims.num_kv_heads):
            t = storage.tables
            rows = to_rows(k)
            outlier = (rows > t["k_hi"]) | (rows < t["k_lo"])
            counts.append(outlier.sum(-1).flatten())
            head_counts.append(outlier.unflatten(-1, (heads, -1)).sum(-1).flatten())
            return reconstruct(k, v)

        for storage in storages:  # each layer's reconstruction counts its keys' outliers first
            storage.reconstruct = functools.partial(counting, storage=storage, reconstruct=storage.reconstruct)
        simulated_nll(loaded, storages, windows)
        c = torch.cat(counts).float()
        ch = torch.cat(head_counts).float()
        capacity = storages[0].capacity
        stats = {"channels": loaded.dims.kv_channels, "nominal": method.outliers * loaded.dims.kv_channels,
                 "mean": c.mean().item(), "max": c.max().item(),
                 "quantiles": {str(q): float(torch.quantile(c, q)) for q in (0.5, 0.9, 0.99, 0.999)},
                 "over_16": (c > 16).float().mean().item(), "token_layers": int(c.numel()),
                 "per_head": {"channels": loaded.dims.head_dim, "mean": ch.mean().item(), "max": ch.max().item(),
                              "quantiles": {str(q): float(torch.quantile(ch, q)) for q in (0.5, 0.9, 0.99, 0.999)},
                              "default_capacity": capacity,
                              "over_default_capacity": (ch > capacity).float().mean().item(),
                              "token_head_layers": int(ch.numel())}}
        result["artifacts"][name] = stats
        print(name, json.dumps(stats), flush=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
