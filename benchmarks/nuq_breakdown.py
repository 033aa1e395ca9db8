"""Where the nuq (KVQuant) decode kernel spends its time: the same random cache with and without its
sparse outliers, at Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128), bf16 queries.

    python benchmarks/nuq_breakdown.py --context 32768 --batch 8 --json results/bench/nuq-breakdown.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from kvcal.runtime.bench import random_packed, time_kvcal, time_sdpa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--options", default="{}", help="decode-kernel options as JSON, e.g. '{\"lut_mma\": false}'")
    a = ap.parse_args()
    options = json.loads(a.options)
    hq, hkv, dim = 32, 8, 128
    kv = random_packed("nuq", a.bits, a.batch, hkv, dim, a.context - 128, device="cuda")
    variants = {
        "nuq: key + value outliers": kv,
        "nuq: value outliers only": dataclasses.replace(kv, k_out_idx=None, k_out_val=None),
        "nuq: key outliers only": dataclasses.replace(kv, v_out_idx=None, v_out_val=None),
        "nuq: no outliers": dataclasses.replace(kv, k_out_idx=None, k_out_val=None, v_out_idx=None, v_out_val=None),
        "nuq, values per head (value_scope=head)": random_packed("nuq", a.bits, a.batch, hkv, dim, a.context - 128,
                                                                   device="cuda", value_per_head=True),
        "int (affine, same bits)": random_packed("int", a.bits, a.batch, hkv, dim, a.context - 128, device="cuda"),
    }
    rows = {name: time_kvcal(None, a.bits, a.batch, hq, hkv, dim, a.context, kv=v, **(options if name[:3] == "nuq" else {}))[0]
            for name, v in variants.items()}
    rows["sdpa bf16"] = time_sdpa(a.batch, hq, hkv, dim, a.context)[0]
    result = {"device": torch.cuda.get_device_name(), "context": a.context, "batch": a.batch, "bits": a.bits,
              "options": options, "us": rows}
    for name, us in rows.items():
        print(f"{name:32s} {us:9.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
