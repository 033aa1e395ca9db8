"""Decode-mode perplexity against the simulation for every packed storage (docs/runtime.md, parity tables).

Decode-mode perplexity (token by token through the packed cache) against the gptq simulation, for
every method the packed runtime runs (issue 5): smollm2-135m, WikiText-2 test. One model load for all
rows, one JSON out. On CPU the torch references run; on CUDA the Triton kernels.

KVQuant's simulation reads outliers back exactly by default (the paper's PPL, digest #7); the runtime
stores them as fp16 residuals, at most key_outlier_capacity key outliers per token. The rows compare
decode against the simulation of that storage (`--set exact_outliers=false`, same capacity) and also
record the exact-outlier simulation (their gap is the storage's cost). Each KVQuant artifact runs twice:
with the runtime's default key outlier capacity (2 slots per token and KV head on smollm2) and with a capacity no
token reaches (64).

    python benchmarks/decode_parity.py --device cuda --dtype float16 --seqlen 512 --nsamples 2 \\
        --json results/runtime/parity-cuda-float16-2x512.json
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
from kvcal.determinism import deterministic_algorithms
from kvcal.eval.ppl import decoded_nll, simulated_nll
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model
from kvcal.recipes import resolve

RECIPES = ("rtn-int4", "rtn-int2", "kivi-4bit", "kivi-2bit")
KVQUANT = ("kvquant-nuq4-1pct", "kvquant-nuq3-1pct", "kvquant-nuq2-1pct")


def targets(loaded, recipes, kvquant, artifact_dir, big_capacity=64, default_capacity=True, calibrated=()):
    """Rows (name, storages to simulate, storages to decode, storages of the exact-outlier simulation or None)."""
    for name in calibrated:  # any other method's artifact: its own storages both ways
        path = os.path.join(artifact_dir, f"{name}.safetensors")
        storages = storages_for_artifact(load_artifact(path), loaded, path)[1]
        yield name, storages, storages, None
    for name in recipes:
        method, _, _ = resolve(None, name, None)
        storages = method.build_storages({}, loaded.dims)
        yield name, storages, storages, None
    for name in kvquant:
        path = os.path.join(artifact_dir, f"{name}.safetensors")
        art = load_artifact(path)
        exact = storages_for_artifact(art, loaded, path)[1]
        if default_capacity:
            stored = storages_for_artifact(art, loaded, path, ["exact_outliers=false"])[1]
            yield name, stored, exact, exact
        if big_capacity:
            capacity = f"key_outlier_capacity={big_capacity}"
            stored = storages_for_artifact(art, loaded, path, ["exact_outliers=false", capacity])[1]
            big = storages_for_artifact(art, loaded, path, [capacity])[1]
            yield f"{name} ({capacity})", stored, big, exact


def patch_rmsnorm(model):
    """Every *RMSNorm module computes in its input's dtype (the same formula as transformers' Llama RMSNorm,
    without the float32 round trip)."""
    def forward(self, x):
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
        return self.weight.to(x.dtype) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    patched = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = forward.__get__(module)
            patched += 1
    assert patched, "no RMSNorm module found"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--nsamples", type=int, default=2)
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--kvquant", nargs="*", default=list(KVQUANT))
    ap.add_argument("--calibrated", nargs="*", default=[], help="other artifacts of --artifact-dir (by recipe name), "
                    "each simulated and decoded with its own storages")
    ap.add_argument("--backend", default="packed", help="decode backend: packed (Triton kernels on CUDA) or reference "
                    "(the storages' torch references on any device: float64 on a GPU)")
    ap.add_argument("--artifact-dir", default="artifacts/smollm2-135m")
    ap.add_argument("--big-capacity", type=int, default=64, help="KVQuant decode rows with this key outlier "
                    "capacity too (0: none)")
    ap.add_argument("--no-default-capacity", action="store_true", help="KVQuant: decode only with --big-capacity")
    ap.add_argument("--rmsnorm-in-dtype", action="store_true", help="diagnostic: RMSNorm computes in the model's "
                    "dtype (transformers' Llama RMSNorm computes in float32, whose row reduction order on CUDA may "
                    "depend on the number of rows: one decoded token vs a whole window)")
    ap.add_argument("--deterministic", action="store_true", help="torch's deterministic mode (kvcal.determinism): "
                    "KVQuant's fp16/bf16 GPU decode sums its value outliers in int64 fixed point, the same bits "
                    "every run")
    ap.add_argument("--no-step-graphs", action="store_true", help="decode with every packed layer's kernels "
                    "launched from Python (KvcalCache(step_graphs=False)) instead of each layer's step replayed "
                    "from a CUDA graph: the same logits, more host time")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    with deterministic_algorithms(a.deterministic):
        run(a)


def run(a):
    loaded = load_model("smollm2-135m", a.dtype, a.device)
    if a.rmsnorm_in_dtype:
        patch_rmsnorm(loaded.model)
    text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), a.seqlen, a.nsamples)
    rows = []
    exact = {}
    for name, sim_storages, dec_storages, exact_storages in targets(loaded, a.recipes, a.kvquant, a.artifact_dir,
                                                                    a.big_capacity, not a.no_default_capacity,
                                                                    a.calibrated):
        base = name.split(" ")[0]  # the capacity rows share their artifact's exact-outlier simulation
        row = {"codec": name}
        t = time.time()
        sim = simulated_nll(loaded, sim_storages, windows, batch_size=a.nsamples).ppl
        row["simulate_s"] = time.time() - t
        if exact_storages is not None:
            if base not in exact:
                exact[base] = simulated_nll(loaded, exact_storages, windows, batch_size=a.nsamples).ppl
            row["simulate_exact_outliers"] = exact[base]
        t = time.time()
        dec = decoded_nll(loaded, dec_storages, windows, batch_size=a.nsamples, backend=a.backend,
                          step_graphs=not a.no_step_graphs).ppl
        row.update(simulate=sim, decode=dec, difference=abs(dec - sim) / sim, decode_s=time.time() - t)
        rows.append(row)
        print(f"{name:45s} simulate {row['simulate']:.4f} decode {dec:.4f} diff {100 * row['difference']:.3f}% "
              f"({row['decode_s']:.0f}s)", flush=True)
        result = {"model": loaded.identity, "device": str(loaded.device), "device_name": torch.cuda.get_device_name()
                  if loaded.device.type == "cuda" else "cpu", "software": software_versions(), "dtype": a.dtype,
                  "seqlen": a.seqlen, "nsamples": a.nsamples, "tokens": int(windows.shape[0] * (windows.shape[1] - 1)),
                  "dataset": text.provenance, "rmsnorm_in_dtype": a.rmsnorm_in_dtype,
                  "deterministic": a.deterministic, "step_graphs": not a.no_step_graphs, "backend": a.backend,
                  "rows": rows}
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:  # after every row: long runs keep what they finished
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
