"""Print PPL and bits per element of every result JSON in this folder (used to fill README.md).

bits/elem(fp8) is what the same setting costs with fp8 (e4m3) scale and zero, from kvcal's accounting.
"""

import json
import sys
from pathlib import Path

from kvcal.accounting import bits_per_element
from kvcal.methods import build_method
from kvcal.models import load_model

here = Path(__file__).parent
dims = load_model("smollm2-135m", adapt=False).dims
fp16 = json.loads((here / "fp16.json").read_text())["ppl"]
names = sys.argv[1:] or sorted(p.stem for p in here.glob("*.json"))
print("| row | PPL | x fp16 | bits/elem | bits/elem with fp8 params |")
print("|---|---|---|---|---|")
for name in names:
    path = here / f"{name}.json"
    if not path.is_file():
        print(f"| {name} | (not run) | | | |")
        continue
    r = json.loads(path.read_text())
    fp8 = ""
    if r["method"] == "skvq":
        config = {**r["config"], "param_dtype": "fp8"}
        fp8 = f"{bits_per_element(build_method('skvq', config), dims).bits_per_element:.3f}"
    print(f"| {name} | {r['ppl']:.3f} | {r['ppl'] / fp16:.3f} | {r['bits_per_element']:.3f} | {fp8} |")
