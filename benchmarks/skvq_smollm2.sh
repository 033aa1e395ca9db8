#!/usr/bin/env bash
# Reproduces the SKVQ rows of docs/results.md: smollm2-135m, CPU, float32, WikiText-2, calibration 16 windows x 2048
# tokens seed 0, evaluation 16 windows x 2048 tokens, protocol gptq (the baselines: results/baselines/).
# Usage: bash benchmarks/skvq_smollm2.sh [ROW ...]   (no argument: every row, in order; existing JSONs are kept)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=(--data-dir "${KVCAL_DATA_DIR:-../shared/data/wikitext2}")
OUT=results/skvq
ART=artifacts/smollm2-135m/skvq-results
EVAL=(--seqlen 2048 --nsamples 16 --protocol gptq)
# Every row calibrates on the same 16 windows: one capture (k, v, q: 3.8 GB) serves them all. Without
# the cache each command captures again and writes the same artifact.
CAPTURE_CACHE=${CAPTURE_CACHE:-/tmp/kvcal-capture-cache}
mkdir -p "$ART"

calib_eval() {  # NAME CALIBRATE-ARGS...: calibrate (16 x 2048, seed 0) then evaluate the artifact
  local name=$1; shift
  [ -f "$OUT/$name.json" ] && { echo "skip $name"; return; }
  kvcal calibrate "$@" "${DATA[@]}" --nsamples 16 --seqlen 2048 --seed 0 --out "$ART/$name.safetensors" \
    --capture-cache "$CAPTURE_CACHE"
  kvcal eval ppl --artifact "$ART/$name.safetensors" "${DATA[@]}" "${EVAL[@]}" --json "$OUT/$name.json"
}

row() {
  case $1 in
    # SKVQ main rows
    k2v2-g32)       calib_eval k2v2-g32 --recipe skvq-k2v2-g32-w128 ;;
    k2v2-g32-fp8)   calib_eval k2v2-g32-fp8 --recipe skvq-k2v2-g32-w128 --set param_dtype=fp8 ;;
    k2v1.5-g32)     calib_eval k2v1.5-g32 --recipe skvq-k2v1.5-g32-w128 ;;
    k4v4-g32)       calib_eval k4v4-g32 --recipe skvq-k4v4-g32-w128 ;;
    ppl-k2v2-g64)   calib_eval ppl-k2v2-g64 --recipe skvq-ppl-k2v2-g64-w0-s5 ;;
    # ablation, K2V2 g32 fp16 parameters (the full row is k2v2-g32)
    abl-rtn)              calib_eval abl-rtn --recipe skvq-k2v2-g32-w128 --set reorder=false --set clip=none --set window=0 --set sink=0 ;;
    abl-clip)             calib_eval abl-clip --recipe skvq-k2v2-g32-w128 --set reorder=false --set window=0 --set sink=0 ;;
    abl-reorder)          calib_eval abl-reorder --recipe skvq-k2v2-g32-w128 --set clip=none --set window=0 --set sink=0 ;;
    abl-reorder-clip)     calib_eval abl-reorder-clip --recipe skvq-k2v2-g32-w128 --set window=0 --set sink=0 ;;
    abl-reorder-clip-win) calib_eval abl-reorder-clip-win --recipe skvq-k2v2-g32-w128 --set sink=0 ;;
    abl-reorder-clip-sink) calib_eval abl-reorder-clip-sink --recipe skvq-k2v2-g32-w128 --set window=0 ;;
    abl-rtn-win)          calib_eval abl-rtn-win --recipe skvq-k2v2-g32-w128 --set reorder=false --set clip=none --set sink=0 ;;
    abl-clip-global)      calib_eval abl-clip-global --recipe skvq-k2v2-g32-w128 --set clip=global ;;
    abl-clip-group)       calib_eval abl-clip-group --recipe skvq-k2v2-g32-w128 --set clip=group ;;
    abl-clip-min05)       calib_eval abl-clip-min05 --recipe skvq-k2v2-g32-w128 --set clip_min=0.5 ;;
    *) echo "unknown row $1" >&2; exit 2 ;;
  esac
}

ROWS=(k2v2-g32 abl-clip abl-rtn abl-reorder abl-reorder-clip abl-reorder-clip-win abl-reorder-clip-sink k4v4-g32
      k2v1.5-g32 k2v2-g32-fp8 abl-rtn-win ppl-k2v2-g64 abl-clip-global abl-clip-group abl-clip-min05)
for r in "${@:-${ROWS[@]}}"; do
  echo "=== $r $(date +%T)"
  row "$r"
done
