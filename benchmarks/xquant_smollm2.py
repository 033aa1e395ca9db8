"""XQuant's perplexity runs on smollm2-135m (docs/xquant.md).

The XQuant digest's §8.2 perplexity runs on smollm2-135m (WikiText-2 test, gptq protocol), with one model load:
fp16; KIVI* at 4/3/2 bits with and without the first 3 layers at 4 bits; XQuant-X at 8/4/3/2 (and 3/2 with the
first 3 layers at 4); XQuant-SVD at 4/3/2 and with the fp16 outlier channel at 3/2; XQuant-CL on X and on the SVD
latents at 4/3/2 (base = layer 2, layers 0-2 at 4 bits); the 2-bit CL-SVD ablations (per-channel deltas, latent base,
open loop, layers 0-1 at 2 bits); one per-token group size check (192 channels). Every row's record carries the `kvcal eval ppl` command
that reproduces it alone (the artifacts are the data-free calibrations this script writes first).

    python benchmarks/xquant_smollm2.py --device cuda --nsamples 16 --json results/xquant/ppl-smollm2-16x2048.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from pathlib import Path

from kvcal.artifact import load_artifact
from kvcal.calib.run import run_calibration
from kvcal.data import load_eval_windows
from kvcal.eval.run import ppl_record
from kvcal.methods import build_method
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model
from kvcal.recipes import resolve

# (row name, recipe, --set overrides); recipes needing factors are evaluated through their calibrated artifact
ROWS = [("fp16", "fp16", [])]
for b in (4, 3, 2):
    ROWS += [(f"kivi*-{b}", "xquant-kivistar-2bit", [f"bits={b}"])]
for b in (3, 2):
    ROWS += [(f"kivi*-{b}-hp3", "xquant-kivistar-2bit-hp3", [f"bits={b}"])]
for b in (8, 4, 3, 2):
    ROWS += [(f"x-{b}", "xquant-x-2bit", [f"bits={b}"])]
for b in (3, 2):
    ROWS += [(f"x-{b}-hp3", "xquant-x-2bit", [f"bits={b}", "hp_layers=3"])]
for b in (4, 3, 2):
    ROWS += [(f"svd-{b}", "xquant-svd-2bit", [f"bits={b}"])]
for b in (3, 2):
    ROWS += [(f"svd-{b}-outlier", "xquant-svd-2bit", [f"bits={b}", "outlier_channel=true"])]
for b in (4, 3, 2):
    ROWS += [(f"cl-x-{b}", "xquant-cl-x-2bit", [f"bits={b}"]), (f"cl-svd-{b}", "xquant-cl-svd-2bit", [f"bits={b}"])]
ROWS += [
    ("cl-svd-2-delta-per-channel", "xquant-cl-svd-2bit", ["delta_axis=channel"]),
    ("cl-svd-2-open-loop", "xquant-cl-svd-2bit", ["closed_loop=false"]),
    ("cl-svd-2-latent-base", "ablations/xquant-cl-svd-latent-base", []),
    ("cl-svd-2-no-hp", "xquant-cl-svd-2bit", ["hp_layers=0"]),  # layers 0-1 at 2 bits (the base stays at 4)
    ("cl-x-2-no-hp", "xquant-cl-x-2bit", ["hp_layers=0"]),
    ("svd-2-g192", "xquant-svd-2bit", ["group_channels=192"]),
]


def recipe_path(name: str) -> str:
    return str(Path(__file__).resolve().parent.parent / "recipes" / f"{name}.yaml")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--artifact-dir", default="artifacts")
    ap.add_argument("--only", nargs="*", help="row names to run (default: all)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    data_dir = os.environ.get("KVCAL_DATA_DIR")
    loaded = load_model("smollm2-135m", a.dtype, a.device)
    text, windows = load_eval_windows(loaded.tokenizer, "wikitext2", data_dir, a.seqlen, a.nsamples)
    common = f"--model smollm2-135m --dtype {a.dtype} --device {a.device} --nsamples {a.nsamples} --seqlen {a.seqlen}"
    artifacts: dict[str, str] = {}
    records = []
    for row, recipe, sets in ROWS:
        if a.only and row not in a.only:
            continue
        start = time.time()
        if recipe == "fp16":
            method, artifact, cli = build_method("fp16"), None, f"kvcal eval ppl --method fp16 {common}"
            storages = method.build_storages({}, loaded.dims)
        else:
            method, _, _ = resolve(None, recipe_path(recipe), sets)
            artifact = None
            sets_cli = " ".join(f"--set {s}" for s in sets)
            if method.needs_artifact():
                if recipe not in artifacts:  # data-free calibration, once per recipe
                    out = Path(a.artifact_dir) / f"{Path(recipe).name}-smollm2.safetensors"
                    base, _, _ = resolve(None, recipe_path(recipe), None)
                    run_calibration(loaded, base, out)
                    artifacts[recipe] = str(out)
                path = artifacts[recipe]
                art = load_artifact(path)
                method, storages = storages_for_artifact(art, loaded, path, sets)
                artifact = {"path": path, "tensor_hash": art.header["tensor_hash"]}
                cli = (f"kvcal calibrate --recipe {recipe} --model smollm2-135m --out {path} && "
                       f"kvcal eval ppl --artifact {path} {sets_cli} {common}")
            else:
                storages = method.build_storages({}, loaded.dims)
                cli = f"kvcal eval ppl --recipe {recipe} {sets_cli} {common}"
        record = ppl_record(loaded, method, storages, row, artifact, text, windows, a.dtype)
        record["command"] = " ".join(cli.split())
        record["seconds"] = round(time.time() - start, 1)
        records.append(record)
        print(f"{row:28s} ppl {record['ppl']:9.3f}  bits/element {record['bits_per_element']:.3f}  "
              f"({record['seconds']} s)", flush=True)
    out = {"command": "python benchmarks/xquant_smollm2.py " + shlex.join(
        ["--device", a.device, "--dtype", a.dtype, "--seqlen", str(a.seqlen), "--nsamples", str(a.nsamples),
         "--json", a.json]), "records": records}
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
