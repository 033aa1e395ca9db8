"""The simulation's perplexity spread under 1e-7 key noise (docs/runtime.md, parity tables).

How much does the gptq simulation's perplexity move when the keys change by float rounding alone?

Quantization is discontinuous: a relative change of 1e-7 in one key (what a different GEMM shape or a
token-by-token forward gives) flips a code now and then, and through 30 layers the flips compound.
Decode-mode perplexity (token by token through the cache) differs from the simulation by exactly such
rounding, so this spread is the floor under any decode-vs-simulate parity check on the same tokens.

Each row: the simulated PPL with the keys multiplied by (1 + eps * N(0, 1)) before quantization.

    python benchmarks/simulation_noise.py --recipe rtn-int4 --recipe kivi-4bit --seqlen 512 --nsamples 2
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcal.artifact import load_artifact  # noqa: E402
from kvcal.data import load_eval_windows  # noqa: E402
from kvcal.eval.ppl import simulated_nll  # noqa: E402
from kvcal.methods.registry import storages_for_artifact  # noqa: E402
from kvcal.models import load_model  # noqa: E402
from kvcal.recipes import resolve  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipe", action="append", default=None)
    parser.add_argument("--artifact", action="append", default=[], help="a calibrated artifact (e.g. KVQuant)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE override for the "
                        "artifacts' settings (e.g. exact_outliers=false: the runtime's stored outliers)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--nsamples", type=int, default=2)
    parser.add_argument("--eps", type=float, action="append", default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    loaded = load_model(args.model, args.dtype, args.device)
    _, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), args.seqlen,
                                   args.nsamples)
    records = []
    targets = [(r, resolve(None, r, None)[0].build_storages({}, loaded.dims)) for r in args.recipe or []]
    for path in args.artifact:
        targets.append((os.path.basename(path).removesuffix(".safetensors"),
                        storages_for_artifact(load_artifact(path), loaded, path, args.sets)[1]))
    if not targets:
        targets = [(r, resolve(None, r, None)[0].build_storages({}, loaded.dims)) for r in ("rtn-int4", "kivi-4bit")]
    for recipe, storages in targets:
        reconstructs = [storage.reconstruct for storage in storages]
        ppls = {}
        for eps in [0.0] + (args.eps or [1e-7, 1e-6]):
            for seed in range(args.seeds if eps else 1):
                generator = torch.Generator().manual_seed(seed)

                def perturbed(k, v, reconstruct, eps=eps, generator=generator):
                    noise = torch.randn(k.shape, generator=generator).to(k.device, k.dtype)
                    return reconstruct(k * (1 + eps * noise), v)

                for storage, reconstruct in zip(storages, reconstructs):  # each layer's keys, before quantization
                    storage.reconstruct = functools.partial(perturbed, reconstruct=reconstruct) if eps else reconstruct
                total = simulated_nll(loaded, storages, windows)
                ppls[f"eps={eps:g} seed={seed}"] = math.exp(total.nll / total.tokens)
        base = ppls["eps=0 seed=0"]
        spread = max(abs(p - base) / base for p in ppls.values())
        print(f"{recipe}: unperturbed {base:.4f}; largest relative change {100 * spread:.2f}% over "
              + ", ".join(f"{k}: {v:.4f}" for k, v in ppls.items() if k != "eps=0 seed=0"))
        records.append({"recipe": recipe, "ppl": ppls, "max_relative_change": spread})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": str(loaded.device), "device_name": torch.cuda.get_device_name()
                       if loaded.device.type == "cuda" else "cpu", "dtype": args.dtype, "seqlen": args.seqlen,
                       "nsamples": args.nsamples, "sets": args.sets,
                       "command": "python " + " ".join(sys.argv), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
