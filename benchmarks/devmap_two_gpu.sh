#!/usr/bin/env bash
# KVQuant on a model split over two GPUs (--device-map, docs/runtime.md "Several GPUs"): Llama-3.1-8B shapes with
# random weights in bf16 (15 GiB), forced across GPUs 0 and 1 by a per-GPU cap on the weights; calibrate
# kvquant-nuq4-1pct on it, then generate with that artifact through the packed cache (each layer's storage, kernels
# and step graph on its own GPU), and an fp16 cache for comparison. Prints and records, per command, the wall time,
# what ran where, and torch.cuda.max_memory_allocated per GPU (what the command itself reports).
#
#   bash benchmarks/devmap_two_gpu.sh OUT_DIR        (from the checkout, kvcal installed, two CUDA GPUs)
#
# Writes OUT_DIR/devmap_two_gpu.json, the logs of each command and the artifact. Environment knobs:
#   KVCAL_MAX_MEMORY (default 0=10GiB,1=10GiB: the weights cannot fit GPU 0 alone), KVCAL_DATA_DIR (wikitext2;
#   default .carry/data, else the slice in tests/data/wikitext2), NSAMPLES (16), SEQLEN (2048), NEW_TOKENS (256).
# Llama-3.1-70B shapes (140 GB in bf16) would leave two 80 GB GPUs about 10 GB for activations and the capture's
# Fisher pass; this run forces the 8B shapes across both instead.
set -euo pipefail

OUT=${1:?usage: bash benchmarks/devmap_two_gpu.sh OUT_DIR}
mkdir -p "$OUT"
MODEL=random-llama-3.1-8b
CAP=${KVCAL_MAX_MEMORY:-0=10GiB,1=10GiB}
NSAMPLES=${NSAMPLES:-16}
SEQLEN=${SEQLEN:-2048}
NEW_TOKENS=${NEW_TOKENS:-256}
PROMPT="The compressed cache holds packed codes"
if [ -n "${KVCAL_DATA_DIR:-}" ]; then DATA=$KVCAL_DATA_DIR
elif [ -f .carry/data/wiki.valid.tokens ]; then DATA=.carry/data
else DATA=tests/data/wikitext2
fi
ART="$OUT/kvquant-nuq4-1pct.safetensors"
PY=${PYTHON:-python}

nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.csv" || true
cat "$OUT/gpus.csv" || true

step() {  # step NAME COMMAND...: run it, log stdout+stderr to OUT/NAME.log, record wall seconds and exit code
  local name=$1; shift
  echo "+ $*" | tee "$OUT/$name.log"
  local start end rc
  start=$(date +%s.%N)
  set +e
  "$@" 2>&1 | tee -a "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  end=$(date +%s.%N)
  local wall
  wall=$(awk "BEGIN {printf \"%.2f\", $end - $start}")
  printf '%s\t%s\t%s\n' "$name" "$wall" "$rc" >> "$OUT/steps.tsv"
  echo "[$name: exit $rc, $wall s wall]"
  [ "$rc" -eq 0 ] || FAILED=1
}

: > "$OUT/steps.tsv"
FAILED=0
step calibrate "$PY" -m kvcal.cli calibrate --recipe kvquant-nuq4-1pct --model "$MODEL" --dtype bfloat16 \
  --device-map auto --max-memory "$CAP" --data-dir "$DATA" --nsamples "$NSAMPLES" --seqlen "$SEQLEN" --out "$ART"
step generate-kvquant "$PY" -m kvcal.cli generate --artifact "$ART" --dtype bfloat16 --device-map auto \
  --max-memory "$CAP" --max-new-tokens "$NEW_TOKENS" --prompt "$PROMPT"
step generate-fp16 "$PY" -m kvcal.cli generate --method fp16 --model "$MODEL" --dtype bfloat16 --device-map auto \
  --max-memory "$CAP" --max-new-tokens "$NEW_TOKENS" --prompt "$PROMPT"

"$PY" - "$OUT" "$CAP" "$DATA" <<'EOF'
import json, re, sys
from pathlib import Path

import torch

import kvcal
from kvcal import software_versions

out, cap, data = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, wall, rc = line.split("\t")
    log = (out / f"{name}.log").read_text()
    peak = re.search(r"peak GPU memory ([\d.]+(?: \+ [\d.]+)*) GiB(?: \(([^)]*)\))?", log)
    record = {"command": log.splitlines()[0][2:], "wall_seconds": float(wall), "exit_code": int(rc),
              "placement": next((l.split(": ", 1)[1] for l in log.splitlines() if ": layers " in l), None),
              "peak_gib_per_gpu": dict(zip((peak.group(2) or "cuda:0").split(", "),
                                           map(float, peak.group(1).split(" + ")))) if peak else None}
    wrote = re.search(r"wrote (\S+)\s+\((.*)\)", log)
    if wrote:
        record["calibration"] = wrote.group(2)
    summary = [l for l in log.splitlines() if "decode:" in l]
    if summary:
        record["summary"] = summary[-1].strip()
        speed = re.search(r"decode: (\d+) steps? in ([\d.]+) s \(([\d.]+) tokens/s, (\S+)\)", summary[-1])
        if speed:
            record["decode"] = {"steps": int(speed.group(1)), "seconds": float(speed.group(2)),
                                "tokens_per_second": float(speed.group(3)), "mode": speed.group(4)}
    steps[name] = record
result = {"what": "kvquant-nuq4-1pct calibrated and generated with on random-llama-3.1-8b (bf16) split over two GPUs "
                  "by --device-map auto --max-memory " + cap,
          "gpus": (out / "gpus.csv").read_text() if (out / "gpus.csv").exists() else None,
          "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
          "data_dir": data, "kvcal_version": kvcal.__version__, "software": software_versions(), "steps": steps}
(out / "devmap_two_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
EOF
exit "$FAILED"
