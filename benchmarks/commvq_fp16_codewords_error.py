"""What CommVQ's `fp16_codewords` kernel knob costs in accuracy on a calibrated artifact (docs/commvq.md): the key
codewords rounded to fp16 against float32 ones, in the attention output of real decode steps on smollm2-135m.

    PYTHONPATH=. python benchmarks/commvq_fp16_codewords_error.py ARTIFACT PREFILL STEPS [--json OUT]

The model (CPU, float32) prefills PREFILL tokens of the first WikiText-2 test window into the artifact's packed cache
(reference backend: keys encoded with float32 codewords, as the kernels' writes do) and decodes STEPS more; at every
decode step and layer the fused reference attention (attend_reference: Eq. 19 scores from the codes, Eq. 22 values)
runs twice, with the layer's float32 codewords and with them rounded to fp16 (what the knob gathers), and the relative
error ||out_fp16 - out_fp32|| / ||out_fp32|| is kept (the decode itself goes on with float32 codewords). Needs
KVCAL_DATA_DIR or ../shared/data/wikitext2."""
import json
import os
import sys

import torch

import kvcal
from kvcal.data import load_eval_windows
from kvcal.methods.commvq import storage as C
from kvcal.models.adapter import forward_with_cache
from kvcal.runtime.decode import merge_reference

torch.manual_seed(0)
art, prefill, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
loaded = kvcal.load_model("smollm2-135m", "float32", "cpu")
_, windows = load_eval_windows(loaded.tokenizer, "wikitext2", os.environ.get("KVCAL_DATA_DIR", "../shared/data/wikitext2"), prefill + steps, 1)
errs: dict[int, list[float]] = {}
orig = C.CommVQStorage.attend_reference


def both(self, q, packed, scale, fp):
    """attend_reference as it is (returned), and again with the codewords rounded to fp16 (compared)."""
    parts = orig(self, q, packed, scale, fp)
    exact = merge_reference(parts, q.shape[0], torch.float64)
    saved = dict(self._by_dtype)
    const = self.constants(torch.float32)
    rounded = dict(const)
    rounded["theta"] = const["theta"].half().float()
    self._by_dtype[torch.float32] = rounded
    try:
        approx = merge_reference(orig(self, q, packed, scale, fp), q.shape[0], torch.float64)
    finally:
        self._by_dtype = saved
    errs.setdefault(self.layer, []).append(float((approx - exact).norm() / exact.norm()))
    return parts


C.CommVQStorage.attend_reference = both
cache = kvcal.load_cache(art, loaded, backend="reference")
ids = windows[0:1]
with torch.inference_mode():
    forward_with_cache(loaded.model, ids[:, :prefill], cache)
    for t in range(prefill, prefill + steps):
        forward_with_cache(loaded.model, ids[:, t:t + 1], cache)
per_layer = {layer: max(v) for layer, v in sorted(errs.items())}
record = {"artifact": art, "prefill": prefill, "steps": steps, "command": " ".join(sys.argv),
          "max_rel_err_per_layer": per_layer, "max": max(per_layer.values()),
          "mean": sum(sum(v) for v in errs.values()) / sum(len(v) for v in errs.values()),
          "software": kvcal.software_versions()}
print(json.dumps(record, indent=1))
if out:
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
