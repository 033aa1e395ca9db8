#!/usr/bin/env bash
# The equal-footing records of smollm2-135m (docs/results.md "Equal footing") on one GPU, in the background:
# calibrate every calibrated setting (one capture of 16 x 2048 WikiText-2 calibration tokens; CommVQ from its recipes'
# own calibration, 64 x 1024, each in its own process beside the others), then benchmarks/equal_footing.py for
# every setting under --fp-window 0 and 128 (gptq; tail for CalibQuant and the baselines beside it). Decode against
# simulation: benchmarks/decode_parity_all.sh.
#   bash benchmarks/equal_footing_gpu.sh OUT_DIR [DATA_DIR]
# Writes OUT_DIR/{records/, *.log}; artifacts under artifacts/smollm2-135m/.
set -uo pipefail
OUT=${1:?output folder}
DATA=${2:-${KVCAL_DATA_DIR:-tests/data/wikitext2}}
export KVCAL_DATA_DIR=$DATA PYTHONUNBUFFERED=1
ART=artifacts/smollm2-135m
mkdir -p "$OUT/records" "$ART"
K="python -m kvcal.cli"
G=(--device cuda --dtype float32)

$K calibrate --recipe commvq-1bit "${G[@]}" --out "$ART/commvq-1bit.safetensors" > "$OUT/calibrate-commvq-1bit.log" 2>&1 &
C1=$!
$K calibrate --recipe commvq-2bit "${G[@]}" --out "$ART/commvq-2bit.safetensors" > "$OUT/calibrate-commvq-2bit.log" 2>&1 &
C2=$!
$K calibrate --recipe kvquant-nuq4-1pct --recipe kvquant-nuq2-1pct --recipe skvq-k4v4-g32-w128 \
  --recipe skvq-k2v2-g32-w128 --recipe xquant-svd-4bit-r128 --recipe xquant-svd-2bit --recipe xquant-cl-svd-2bit \
  --recipe calibquant-2bit --recipe calibquant-1bit --nsamples 16 --seqlen 2048 "${G[@]}" --out-dir "$ART" \
  > "$OUT/calibrate.log" 2>&1
EF=(python benchmarks/equal_footing.py --model smollm2-135m --nsamples 16 --seqlen 2048 --device cuda
    --artifacts "$ART" --out "$OUT/records")
"${EF[@]}" > "$OUT/equal-footing.log" 2>&1 &
E1=$!
wait $C1 $C2
"${EF[@]}" --only commvq-1bit commvq-2bit > "$OUT/equal-footing-commvq.log" 2>&1 &
E2=$!
wait $E1 $E2
echo ALLDONE > "$OUT/done"
