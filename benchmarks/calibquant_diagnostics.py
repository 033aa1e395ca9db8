"""CalibQuant's attention-error diagnostics per layer (docs/calibquant.md).

The CalibQuant digest's §8.2 run 6 diagnostics (the paper's Fig. 2 analog): per layer, how far the tail queries'
attention probabilities move from the exact ones when the block's keys are CalibQuant-quantized, without the score
remap ("Quant") and with it ("Quant-C", the artifact's tau). Every layer sees the exact model's inputs (the fp16
forward), so each layer's error is its own, not accumulated from the layers below. Errors: the mean squared error of
the probabilities over (head, tail query, key), and the mean KL(exact || quantized) per (head, tail query); also how
much probability mass the tail queries put on the block, exact and quantized.

    python benchmarks/calibquant_diagnostics.py --artifact artifacts/smollm2-135m/calibquant-1bit.safetensors \
        --nsamples 2 --json results/calibquant/diagnostics-calibquant-1bit-2x2048.json
(KVCAL_DATA_DIR: the WikiText-2 folder; evaluation windows of the test split, the tail protocol's default layout)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from kvcal.artifact import load_artifact
from kvcal.data import load_eval_windows
from kvcal.eval.simulate import tail_layout
from kvcal.methods.registry import storages_for_artifact
from kvcal.models import load_model
from kvcal.models.attention import additive_mask, attention


class AttentionError:
    """Adapter handler: exact attention, plus the per-layer errors of the tail queries' probabilities."""

    def __init__(self, storages, prefix: int, block: int, num_layers: int):
        self.storages, self.start, self.end = storages, prefix, prefix + block
        self.sums = {name: [0.0] * num_layers for name in ("mse_quant", "mse_calib", "kl_quant", "kl_calib",
                                                             "block_mass_exact", "block_mass_quant",
                                                             "block_mass_calib")}
        self.count = [0] * num_layers

    def attend(self, inp):
        q, k = inp.rotated()
        out = attention(q, k, inp.v, inp.mask, inp.scale)
        layer, start, end = inp.layer_idx, self.start, self.end
        k_hat, _ = self.storages[layer].reconstruct(k[:, :, start:end], inp.v[:, :, start:end])
        k_mix = k.clone()
        k_mix[:, :, start:end] = k_hat
        groups = q.shape[1] // k.shape[1]
        q_tail = q[:, :, end:].double()
        bias = additive_mask(None, q_tail.shape[2], k.shape[2], q.device).double()
        exact = torch.softmax(q_tail @ k.double().repeat_interleave(groups, 1).transpose(-1, -2) * inp.scale + bias, -1)
        scores = q_tail @ k_mix.double().repeat_interleave(groups, 1).transpose(-1, -2) * inp.scale
        compressed = torch.zeros(k.shape[2], dtype=torch.bool, device=q.device)
        compressed[start:end] = True
        quant = torch.softmax(scores + bias, -1)
        calib = torch.softmax(self.storages[layer].remap_scores(scores, compressed) + bias, -1)
        tiny = torch.finfo(torch.float64).tiny
        for name, p in (("quant", quant), ("calib", calib)):
            self.sums[f"mse_{name}"][layer] += float(((p - exact) ** 2).mean())
            kl = (exact * (exact.clamp_min(tiny).log() - p.clamp_min(tiny).log())).sum(-1)
            self.sums[f"kl_{name}"][layer] += float(kl.mean())
            self.sums[f"block_mass_{name}"][layer] += float(p[..., start:end].sum(-1).mean())
        self.sums["block_mass_exact"][layer] += float(exact[..., start:end].sum(-1).mean())
        self.count[layer] += 1
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--nsamples", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    art = load_artifact(args.artifact)
    loaded = load_model(art.header["model"]["name"], "float32", "cpu")
    _, storages = storages_for_artifact(art, loaded, args.artifact)
    if not storages.remaps_scores:
        raise SystemExit("the artifact's setting has no score remap: nothing to compare")
    _, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR"), args.seqlen,
                                   args.nsamples)
    prefix, block = tail_layout(args.seqlen)
    handler = AttentionError(storages, prefix, block, loaded.dims.num_layers)
    with torch.inference_mode(), loaded.adapter.use(handler):
        for window in windows:
            loaded.model(window[None], use_cache=False)
    per_layer = {name: [v / n for v, n in zip(values, handler.count)] for name, values in handler.sums.items()}
    summary = {name: sum(values) / len(values) for name, values in per_layer.items()}
    record = {"artifact": args.artifact, "config": art.config, "tau": art.header["info"].get("tau"),
              "windows": int(windows.shape[0]), "seqlen": args.seqlen,
              "layout": {"prefix": prefix, "block": block, "tail": args.seqlen - prefix - block},
              "mean_over_layers": summary, "per_layer": per_layer, "command": "python " + " ".join(sys.argv)}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
