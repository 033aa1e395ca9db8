"""XQuant's diagnostics on a real model (docs/xquant.md).

The XQuant digest's §8.2 diagnostics on a real model (claims C2, C4, C5): how much post-norm X changes from one
layer to the next against pre-RoPE K and V (Fig. 3), the range of X deltas against X, the channel-0 outlier of the
latent X U_k against X U_v (App. B), and the data-free prediction of the Key outlier channel from the SVD (Table B.2).

    python benchmarks/xquant_diagnostics.py --json results/xquant/diagnostics-smollm2-4x2048.json
(KVCAL_DATA_DIR: the WikiText-2 folder; evaluation windows of the test split)
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvcal.calib.capture import capture
from kvcal.data import load_eval_windows
from kvcal.methods.xquant.calibrate import thin_svd
from kvcal.models import load_model
from kvcal.models.adapter import kv_projection_weights

TOP_K = (1, 2, 4, 8)


def relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||a|| over all tokens."""
    return float((a - b).norm() / a.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--nsamples", type=int, default=2)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    loaded = load_model(a.model, "float32", a.device)
    dims = loaded.dims
    text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), a.seqlen,
                                      a.nsamples)
    store = capture(loaded, windows, {"x", "k", "v"})
    weights = kv_projection_weights(loaded.model, loaded.dims)
    layers, previous = [], None
    hits = {k: 0 for k in TOP_K}
    head_hits = {k: 0 for k in TOP_K}
    for i in range(dims.num_layers):
        rows = store.layer(i)  # x [N, hidden], k (pre-RoPE) and v [N, d_kv]
        x, k, v = rows["x"], rows["k"], rows["v"]
        u_k, r_k, _, _ = thin_svd(weights[i][0].T.float().cpu())
        u_v, _, _, _ = thin_svd(weights[i][1].T.float().cpu())
        z_k, z_v = x @ u_k, x @ u_v
        row = {
            "layer": i,
            # App. B: mean |latent channel 0| over the mean |other channels|
            "zk_channel0_ratio": float(z_k[:, 0].abs().mean() / z_k[:, 1:].abs().mean()),
            "zv_channel0_ratio": float(z_v[:, 0].abs().mean() / z_v[:, 1:].abs().mean()),
        }
        if previous is not None:
            px, pk, pv = previous
            delta = x - px
            row.update({
                "x_delta": relative_change(x, px),  # Fig. 3: ||X_i - X_{i-1}|| / ||X_i||
                "k_delta": relative_change(k, pk),
                "v_delta": relative_change(v, pv),
                # "much smaller range": mean per-token (max - min) of the delta against X's
                "x_delta_range_ratio": float((delta.amax(1) - delta.amin(1)).mean() / (x.amax(1) - x.amin(1)).mean()),
            })
        # Table B.2: the Key channel with the largest mean magnitude, predicted as the top-k of |R_k[0, :]|
        truth = int(k.abs().mean(0).argmax())
        ranked = r_k[0].abs().argsort(descending=True)
        row["k_outlier_channel"] = truth
        row["k_outlier_rank_predicted"] = int((ranked == truth).nonzero()[0, 0])
        for top in TOP_K:
            hits[top] += truth in ranked[:top].tolist()
        head_ranks = []
        for h in range(dims.num_kv_heads):  # the same per KV head: its channels only
            cols = slice(h * dims.head_dim, (h + 1) * dims.head_dim)
            head_truth = int(k[:, cols].abs().mean(0).argmax())
            head_ranked = r_k[0, cols].abs().argsort(descending=True)
            head_ranks.append(int((head_ranked == head_truth).nonzero()[0, 0]))
            for top in TOP_K:
                head_hits[top] += head_truth in head_ranked[:top].tolist()
        row["k_outlier_rank_predicted_per_head"] = head_ranks
        layers.append(row)
        previous = (x, k, v)
    store.close()
    deltas = layers[1:]
    summary = {
        "mean_x_delta": sum(r["x_delta"] for r in deltas) / len(deltas),
        "mean_k_delta": sum(r["k_delta"] for r in deltas) / len(deltas),
        "mean_v_delta": sum(r["v_delta"] for r in deltas) / len(deltas),
        "mean_x_delta_range_ratio": sum(r["x_delta_range_ratio"] for r in deltas) / len(deltas),
        "median_zk_channel0_ratio": sorted(r["zk_channel0_ratio"] for r in layers)[len(layers) // 2],
        "median_zv_channel0_ratio": sorted(r["zv_channel0_ratio"] for r in layers)[len(layers) // 2],
        "k_outlier_prediction_accuracy": {f"top{k}": hits[k] / dims.num_layers for k in TOP_K},
        "k_outlier_prediction_accuracy_per_head": {f"top{k}": head_hits[k] / (dims.num_layers * dims.num_kv_heads)
                                                   for k in TOP_K},
    }
    record = {"model": loaded.identity, "dataset": text.provenance, "seqlen": a.seqlen,
              "nsamples": int(windows.shape[0]), "command": "python benchmarks/xquant_diagnostics.py " +
              f"--model {a.model} --seqlen {a.seqlen} --nsamples {a.nsamples} --json {a.json}",
              "summary": summary, "layers": layers}
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
