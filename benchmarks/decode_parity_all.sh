#!/usr/bin/env bash
# Decode mode against the simulation for every method on smollm2-135m at 2 x 512 WikiText-2 test tokens
# (docs/runtime.md, "Every method at 2 x 512"). Calibrates what it needs at a parity budget (4 x 2048 calibration
# tokens; CommVQ 300 value steps on 8 x 1024: parity checks the runtime, not the codec's quality), then one
# benchmarks/decode_parity.py process per codec and variant, JOBS at a time. CalibQuant (bulk compression: the tail
# protocol only) through `kvcal eval ppl --protocol tail --prefix-len 32`.
#   DEVICE=cuda VARIANTS="float32:packed float64:packed:rmsnorm" bash benchmarks/decode_parity_all.sh OUT [DATA_DIR]
#   DEVICE=cpu VARIANTS="float64:reference" bash benchmarks/decode_parity_all.sh OUT [DATA_DIR]
# A variant is DTYPE:BACKEND[:rmsnorm] (rmsnorm: RMSNorm computes in the model's dtype, decode_parity.py
# --rmsnorm-in-dtype). SKIP: codecs left out (e.g. those without a Triton kernel at smollm2's shapes).
# CALIBRATE=0: use ART's artifacts as they are (a run beside another that calibrates them).
set -uo pipefail
OUT=${1:?output folder}
DATA=${2:-${KVCAL_DATA_DIR:-tests/data/wikitext2}}
DEVICE=${DEVICE:-cuda}
VARIANTS=${VARIANTS:-float32:packed}
JOBS=${JOBS:-8}
SKIP=" ${SKIP:-} "
export KVCAL_DATA_DIR=$DATA PYTHONUNBUFFERED=1
ART=${ART:-artifacts/smollm2-135m-parity}
mkdir -p "$OUT" "$ART"
K="python -m kvcal.cli"
G=(--device "$DEVICE" --dtype float32)

# CALIBRATE=0: another run calibrates; a skipped codec needs no artifact
have() { [ "${CALIBRATE:-1}" = 0 ] || [ -f "$ART/$1.safetensors" ] || [[ $SKIP == *" $1 "* ]]; }
for bits in 1 2; do
  have commvq-${bits}bit || $K calibrate --recipe commvq-${bits}bit --set value_steps=300 --nsamples 8 --seqlen 1024 \
    "${G[@]}" --out "$ART/commvq-${bits}bit.safetensors" > "$OUT/calibrate-commvq-${bits}bit.log" 2>&1 &
done
RECIPES=()
for r in kvquant-nuq4-1pct kvquant-nuq2-1pct skvq-k2v2-g32-w128 xquant-svd-2bit xquant-cl-svd-2bit calibquant-1bit; do
  have $r || RECIPES+=(--recipe $r)
done
if [ ${#RECIPES[@]} -gt 0 ]; then
  $K calibrate "${RECIPES[@]}" --nsamples 4 --seqlen 2048 "${G[@]}" --out-dir "$ART" > "$OUT/calibrate.log" 2>&1 \
    || { tail -n 3 "$OUT/calibrate.log"; exit 1; }
fi
wait

P=(python benchmarks/decode_parity.py --device "$DEVICE" --seqlen 512 --nsamples 2 --big-capacity 0
   --artifact-dir "$ART")
CODECS=("--kvquant --recipes rtn-int4" "--kvquant --recipes rtn-int2" "--kvquant --recipes kivi-4bit"
        "--kvquant --recipes kivi-2bit"
        "--recipes --kvquant kvquant-nuq4-1pct" "--recipes --kvquant kvquant-nuq2-1pct")
for c in skvq-k2v2-g32-w128 xquant-svd-2bit xquant-cl-svd-2bit commvq-1bit commvq-2bit; do
  CODECS+=("--recipes --kvquant --calibrated $c")
done
for v in $VARIANTS; do
  IFS=: read -r dtype backend rms <<< "$v"
  tag=$dtype-$backend${rms:+-rmsnorm64}
  mkdir -p "$OUT/$tag"
  for c in "${CODECS[@]}"; do
    name=${c##* }
    [[ $SKIP == *" $name "* ]] && continue
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
    "${P[@]}" --dtype "$dtype" --backend "$backend" ${rms:+--rmsnorm-in-dtype} $c \
      --json "$OUT/$tag/$name.json" > "$OUT/$tag-$name.log" 2>&1 &
  done
  [[ $SKIP == *" calibquant-1bit "* ]] && continue
  for mode in simulate decode; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
    $K eval ppl --artifact "$ART/calibquant-1bit.safetensors" --protocol tail --prefix-len 32 --seqlen 512 \
      --nsamples 2 --device "$DEVICE" --dtype "$dtype" --mode $mode $([ $mode = decode ] && echo --backend "$backend") \
      --json "$OUT/$tag/calibquant-1bit-$mode.json" > "$OUT/$tag-calibquant-1bit-$mode.log" 2>&1 &
  done
done
wait
echo ALLDONE > "$OUT/done"
