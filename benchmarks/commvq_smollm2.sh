#!/usr/bin/env bash
# CommVQ on smollm2-135m (CPU, float32): the measurements of docs/commvq.md.
# Calibration: the recipes' budget (digest §9 minimal), 64 WikiText-2 windows x 1024 tokens, seed 0 (the
# offline data folder has no train split: kvcal takes wiki.valid.tokens); one capture (k, v, q: 7.5 GB) serves
# both artifacts through the capture cache. Evaluation: WikiText-2 test, gptq protocol, seqlen 2048.
# Usage: bash benchmarks/commvq_smollm2.sh [calibrate|eval|ablations|mse]   (no argument: all; existing files are kept)
# The machine is shared: one thread per process, nice 10; the two calibrations may run side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA=(--data-dir "${KVCAL_DATA_DIR:-../shared/data/wikitext2}")
OUT=results/commvq
ART=artifacts
CAPTURE_CACHE=${CAPTURE_CACHE:-/tmp/kvcal-capture-cache}
RUN=(nice -n 10 kvcal)

calibrate() {
  for bits in 2 1; do
    [ -f "$ART/commvq-${bits}bit-smollm2.safetensors" ] && { echo "skip calibrate $bits"; continue; }
    "${RUN[@]}" calibrate --recipe "commvq-${bits}bit" --model smollm2-135m "${DATA[@]}" \
      --capture-cache "$CAPTURE_CACHE" --out "$ART/commvq-${bits}bit-smollm2.safetensors"
  done
}

ppl() {  # NAME NSAMPLES ARTIFACT-BITS [--set ...]
  local name=$1 n=$2 bits=$3; shift 3
  [ -f "$OUT/$name.json" ] && { echo "skip $name"; return; }
  "${RUN[@]}" eval ppl --artifact "$ART/commvq-${bits}bit-smollm2.safetensors" "${DATA[@]}" --nsamples "$n" \
    --seqlen 2048 "$@" --json "$OUT/$name.json"
}

evaluate() {  # the headline rows: strict all-quantized cache, 16 windows of 2048
  ppl ppl-commvq-2bit-smollm2-16x2048 16 2
  ppl ppl-commvq-1bit-smollm2-16x2048 16 1
}

ablations() {  # window-128 and K-only / V-only rows on the first 4 windows, with fp16 on the same windows
  [ -f "$OUT/ppl-fp16-smollm2-4x2048.json" ] || "${RUN[@]}" eval ppl --method fp16 --model smollm2-135m \
    "${DATA[@]}" --nsamples 4 --seqlen 2048 --json "$OUT/ppl-fp16-smollm2-4x2048.json"
  for bits in 2 1; do
    ppl "ppl-commvq-${bits}bit-smollm2-4x2048" 4 "$bits"
    ppl "ppl-commvq-${bits}bit-w128-smollm2-4x2048" 4 "$bits" --set fp_window=128
    ppl "ppl-commvq-${bits}bit-konly-smollm2-4x2048" 4 "$bits" --set quantize=k
    ppl "ppl-commvq-${bits}bit-vonly-smollm2-4x2048" 4 "$bits" --set quantize=v
  done
}

mse() {
  for bits in 1 2; do
    [ -f "$ART/commvq-${bits}bit-smollm2.safetensors" ] || continue
    python benchmarks/commvq_mse_table.py "$ART/commvq-${bits}bit-smollm2.safetensors" \
      --json "$OUT/mse-commvq-${bits}bit-smollm2.json"
  done
}

case "${1:-all}" in
  calibrate) calibrate ;;
  eval) evaluate ;;
  ablations) ablations ;;
  mse) mse ;;
  all) calibrate; mse; evaluate; ablations ;;
  *) echo "usage: $0 [calibrate|eval|ablations|mse]" >&2; exit 2 ;;
esac
