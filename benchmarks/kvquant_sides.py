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


class OneSide:
    """A codec that compresses only the keys ("k"), only the values ("v") or nothing ("none")."""

    def __init__(self, codec, side: str):
        self.codec, self.side = codec, side
        self.policy, self.keys_pre_rope, self.lossless = codec.policy, codec.keys_pre_rope, False

    def quantize_keys(self, layer, k):
        return self.codec.quantize_keys(layer, k) if self.side == "k" else k

    def quantize_values(self, layer, v):
        return self.codec.quantize_values(layer, v) if self.side == "v" else v


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
    codecs = {}
    for name in a.artifacts:
        path = os.path.join(a.artifact_dir, f"{name}.safetensors")
        codecs[name] = storages_for_artifact(load_artifact(path), loaded, path)[1]
    for recipe in ("kivi-4bit-g64-r0", "kivi-3bit-g64-r0"):
        method, _, _ = resolve(None, recipe, None)
        codecs[recipe] = method.build_storages({}, loaded.dims)
    ppl = {"fp16": simulated_nll(loaded, OneSide(codecs["kivi-4bit-g64-r0"], "none"), windows).ppl}
    for name, codec in codecs.items():
        for side in ("k", "v"):
            ppl[f"{name}, {side} only"] = simulated_nll(loaded, OneSide(codec, side), windows).ppl
            print(f"{name:20s} {side} only: {ppl[f'{name}, {side} only']:.4f}", flush=True)
    with open(a.json, "w") as f:
        json.dump({"model": loaded.identity, "dataset": text.provenance, "seqlen": a.seqlen,
                   "nsamples": int(windows.shape[0]), "dtype": "float32", "device": a.device, "ppl": ppl}, f, indent=1)


if __name__ == "__main__":
    main()
