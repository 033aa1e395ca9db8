#!/usr/bin/env bash
# KVQuant on smollm2-135m: the headline table and ablations of docs/results.md.
# KVQuant reproduction on smollm2-135m (issue 3): the headline table and the ablations R1, R3, R3b,
# R4, R5, R7, R8 of ../shared/papers/kvquant.md section 9.2. Every row is one recipe; one model load and
# one activation capture serve all of them (`--recipe` repeated), which computes exactly what one
# `kvcal calibrate --recipe NAME` per row would.
# Calibration: WikiText-2 (16 windows x 2048, seed 0); evaluation: WikiText-2 test, seqlen 2048,
# 16 windows, protocol gptq, float32. Results: results/kvquant/<artifact>.json.
set -euo pipefail
: "${KVCAL_DATA_DIR:?point KVCAL_DATA_DIR at the WikiText-2 folder}"
cd "$(dirname "$0")/.."
command -v kvcal > /dev/null || kvcal() { python3 -m kvcal.cli "$@"; }
OUT=${OUT_DIR:-results/kvquant}
ART=artifacts/smollm2-135m

HEADLINE="kvquant-nuq4-1pct kvquant-nuq3-1pct kvquant-nuq2-1pct kvquant-nuq4 kvquant-nuq3 kvquant-nuq2
  kvquant-nuq4-1pct-vhead kvquant-nuq3-1pct-vhead kvquant-nuq2-1pct-vhead"
ABLATIONS=$(cd recipes && ls ablations/kvquant-*.yaml | sed 's/\.yaml$//')

recipes=(); artifacts=()
for r in $HEADLINE $ABLATIONS; do
  recipes+=(--recipe "$r")
  artifacts+=(--artifact "$ART/$(basename "$r").safetensors")
done
kvcal calibrate "${recipes[@]}" --model smollm2-135m --out-dir "$ART" ${CAPTURE_CACHE:+--capture-cache "$CAPTURE_CACHE"}
kvcal eval ppl "${artifacts[@]}" --nsamples 16 --json-dir "$OUT"
