#!/usr/bin/env bash
# fp16 and each method's main recipe on one model, at a given budget: the records of docs/models.md.
#   bash benchmarks/models_table.sh MODEL [NSAMPLES] [SEQLEN] [DEVICE] [DTYPE]
# Calibration and evaluation use the same NSAMPLES x SEQLEN (WikiText-2: calibration windows of the train split, seed 0;
# the first NSAMPLES test windows). Records: results/MODEL/ppl-PROTOCOL-SETTING-NxL.json (DEVICE/DTYPE in the name
# unless cpu/float32). Artifacts: artifacts/MODEL-NxL/. COMMVQ=1 adds commvq-2bit (slow on a CPU).
set -euo pipefail
MODEL=${1:?model alias, .gguf file or HF folder}
N=${2:-4}
L=${3:-1024}
DEVICE=${4:-cpu}
DTYPE=${5:-float32}
export KVCAL_DATA_DIR=${KVCAL_DATA_DIR:-../shared/data/wikitext2}
KVCAL=${KVCAL:-python -m kvcal.cli}
NAME=$(basename "$MODEL" .gguf)
TAG=${N}x${L}
[ "$DEVICE" = cpu ] && [ "$DTYPE" = float32 ] || TAG=$DEVICE-$DTYPE-$TAG
OUT=results/$NAME
ART=artifacts/$NAME-${N}x${L}
mkdir -p "$OUT"
COMMON=(--model "$MODEL" --nsamples "$N" --seqlen "$L" --device "$DEVICE" --dtype "$DTYPE")
CALIBRATED=(kvquant-nuq4-1pct skvq-k2v2-g32-w128 xquant-svd-2bit)
[ "${COMMVQ:-0}" = 1 ] && CALIBRATED+=(commvq-2bit)

# the gptq-protocol table first (one capture for every calibrated recipe), CalibQuant's tail-protocol rows last
recipes=()
for r in "${CALIBRATED[@]}"; do recipes+=(--recipe "$r"); done
$KVCAL calibrate "${recipes[@]}" "${COMMON[@]}" --out-dir "$ART"

$KVCAL eval ppl --method fp16 "${COMMON[@]}" --json "$OUT/ppl-gptq-fp16-$TAG.json"
for r in kivi-2bit rtn-int4; do
  $KVCAL eval ppl --recipe "$r" "${COMMON[@]}" --json "$OUT/ppl-gptq-$r-$TAG.json"
done
for r in "${CALIBRATED[@]}"; do
  $KVCAL eval ppl --artifact "$ART/$r.safetensors" "${COMMON[@]}" --json "$OUT/ppl-gptq-$r-$TAG.json"
done
# CalibQuant under the tail protocol (its paper's setting), with fp16 and KIVI-2 under the same protocol beside it
$KVCAL eval ppl --method fp16 --protocol tail "${COMMON[@]}" --json "$OUT/ppl-tail-fp16-$TAG.json"
$KVCAL eval ppl --recipe kivi-2bit --protocol tail "${COMMON[@]}" --json "$OUT/ppl-tail-kivi-2bit-$TAG.json"
$KVCAL calibrate --recipe calibquant-2bit "${COMMON[@]}" --out-dir "$ART"
$KVCAL eval ppl --artifact "$ART/calibquant-2bit.safetensors" --protocol tail "${COMMON[@]}" \
  --json "$OUT/ppl-tail-calibquant-2bit-$TAG.json"
