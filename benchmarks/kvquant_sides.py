"""KVQuant and KIVI with only the keys or only the values compressed (docs/results.md).

Which side costs KVQuant its perplexity on smollm2: the gptq simulation with only the keys or only the
values compressed (the other side in full precision), for KVQuant-N-1% and KIVI-N at equal bits (G64 R0).

    python benchmarks/kvquant_sides.py --nsamples 4 --json results/kvquant/sides-4x2048.json
(needs the kvquant artifacts from benchmarks/kvquant_smollm2.sh and KVCAL_DATA_DIR)
"""

from __future__ import annotations

import argparse
import json
import os

from kvcal.artifact import load_artifact
from kvcal.data import load_eval_windows
from kvcal.eval.ppl import simulated_nll
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model
from kvcal.recipes import resolve
from kvcal.runtime.storage import Storage, Storages


class OneSideLayer(Storage):
    """One layer of `base`'s storages that keeps only the keys' ("k") or only the values' ("v") reconstruction, or
    neither ("none"): the other side stays in full precision (each side's round trip is independent of the other's)."""

    def __init__(self, base, side: str):
        self.base, self.side = base, side
        self.policy, self.keys_pre_rope = base.policy, base.keys_pre_rope

    def reconstruct(self, k, v):
        if self.side == "none":
            return k, v
        k_hat, v_hat = self.base.reconstruct(k, v)
        return (k_hat, v) if self.side == "k" else (k, v_hat)


def one_side(storages, side: str) -> Storages:
    """Storages that compress only the keys ("k"), only the values ("v") or nothing ("none")."""
    return Storages(OneSideLayer(s, side) for s in storages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nsamples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--artifact-dir", default="artifacts/smollm2-135m")
    ap.add_argument("--artifacts", nargs="*", default=["kvquant-nuq4-1pct", "kvquant-nuq3-1pct"])
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    loaded = load_model("smollm2-135m", "float32", a.device)
    text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), a.seqlen, a.nsamples)
    storages = {}
    for name in a.artifacts:
        path = os.path.join(a.artifact_dir, f"{name}.safetensors")
        storages[name] = storages_for_artifact(load_artifact(path), loaded, path)[1]
    for recipe in ("kivi-4bit-g64-r0", "kivi-3bit-g64-r0"):
        method, _, _ = resolve(None, recipe, None)
        storages[recipe] = method.build_storages({}, loaded.dims)
    ppl = {"fp16": simulated_nll(loaded, one_side(storages["kivi-4bit-g64-r0"], "none"), windows).ppl}
    for name, setting in storages.items():
        for side in ("k", "v"):
            ppl[f"{name}, {side} only"] = simulated_nll(loaded, one_side(setting, side), windows).ppl
            print(f"{name:20s} {side} only: {ppl[f'{name}, {side} only']:.4f}", flush=True)
    with open(a.json, "w") as f:
        json.dump({"model": loaded.identity, "dataset": text.provenance, "seqlen": a.seqlen,
                   "nsamples": int(windows.shape[0]), "dtype": "float32", "device": a.device, "ppl": ppl}, f, indent=1)


if __name__ == "__main__":
    main()
