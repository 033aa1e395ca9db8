"""KVQuant perplexity at several key-outlier capacities (docs/runtime.md, capacity table).

What the packed runtime's fixed key-outlier capacity costs KVQuant: perplexity of the simulation of
what the runtime stores (`exact_outliers=false`: fp16 residuals, at most `key_outlier_capacity` key
outliers per token and KV head, the largest kept) at several capacities, against the paper's exact outliers, with
the memory each capacity costs. Decode equals this simulation (float64 check in the README), so this
is the runtime's perplexity without running it token by token.

    python benchmarks/kvquant_capacity.py --device cuda --nsamples 16 --json results/kvquant/capacity-16x2048.json
(needs the kvquant artifacts from benchmarks/kvquant_smollm2.sh and KVCAL_DATA_DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvcal import software_versions
from kvcal.artifact import load_artifact
from kvcal.data import load_eval_windows
from kvcal.eval.ppl import simulated_nll
from kvcal.methods.kvquant.method import OUTLIER_ENTRY_BYTES
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model

ARTIFACTS = ("kvquant-nuq4-1pct", "kvquant-nuq3-1pct", "kvquant-nuq2-1pct")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--capacities", type=int, nargs="*", default=[1, 2, 4, 8, 64],
                    help="key outlier slots per token and KV head")
    ap.add_argument("--artifacts", nargs="*", default=list(ARTIFACTS))
    ap.add_argument("--artifact-dir", default="artifacts/smollm2-135m")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    loaded = load_model("smollm2-135m", a.dtype, a.device)
    text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), a.seqlen, a.nsamples)
    channels = loaded.dims.kv_channels
    result = {"model": loaded.identity, "device": torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu",
              "software": software_versions(), "dtype": a.dtype, "seqlen": a.seqlen, "nsamples": int(windows.shape[0]),
              "dataset": text.provenance, "kv_channels": channels,
              "slot_bits_per_element": OUTLIER_ENTRY_BYTES * 8 / (2 * channels), "kv_heads": loaded.dims.num_kv_heads,
              "capacity_unit": "slots per token and KV head", "artifacts": {}}
    for name in a.artifacts:
        path = os.path.join(a.artifact_dir, f"{name}.safetensors")
        art = load_artifact(path)
        t = time.time()
        method, exact_storages = storages_for_artifact(art, loaded, path)
        exact = simulated_nll(loaded, exact_storages, windows, batch_size=a.batch_size).ppl
        rows = {"exact_outliers": exact, "default_capacity": method.key_capacity(loaded.dims.head_dim),
                "capacities": {}}
        for capacity in a.capacities:
            sets = ["exact_outliers=false", f"key_outlier_capacity={capacity}"]
            storages = storages_for_artifact(art, loaded, path, sets)[1]
            ppl = simulated_nll(loaded, storages, windows, batch_size=a.batch_size).ppl
            rows["capacities"][str(capacity)] = {"ppl": ppl, "vs_exact": ppl / exact - 1,
                                                 "key_slot_bits_per_element": min(capacity, loaded.dims.head_dim)
                                                 * loaded.dims.num_kv_heads * result["slot_bits_per_element"]}
            print(f"{name} capacity {capacity:3d}: {ppl:.4f} ({100 * (ppl / exact - 1):+.2f}% vs exact {exact:.4f})",
                  flush=True)
        rows["seconds"] = time.time() - t
        result["artifacts"][name] = rows
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
