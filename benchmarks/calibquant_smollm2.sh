#!/usr/bin/env bash
# CalibQuant on smollm2-135m, CPU, float32 (digest papers/calibquant.md §8, at a small budget): tau calibration on 4
# random 2048-token windows of the WikiText-2 calibration split (seed 0), then perplexity under the tail protocol on
# the first 4 test windows of 2048 (prefix 32, block 1536, tail 480: 479 scored targets per window).
# Run from the repository root: bash benchmarks/calibquant_smollm2.sh
source "$(dirname "$0")/calibquant_env.sh"

stage=${1:-all}
if [[ $stage == all || $stage == calib ]]; then
  $KVCAL calibrate $CAL --recipe calibquant-1bit --out $ART/calibquant-1bit.safetensors
  $KVCAL calibrate $CAL --recipe calibquant-2bit --out $ART/calibquant-2bit.safetensors
  for a in $ART/calibquant-1bit $ART/calibquant-2bit; do $KVCAL inspect $a.safetensors > $a.inspect.txt; done
fi
if [[ $stage == all || $stage == eval ]]; then
  $KVCAL eval ppl --method fp16 $EVAL --json $OUT/ppl-tail-fp16-4x2048.json
  $KVCAL eval ppl --artifact $ART/calibquant-1bit.safetensors $EVAL --json $OUT/ppl-tail-calibquant-1bit-4x2048.json
  $KVCAL eval ppl --artifact $ART/calibquant-2bit.safetensors $EVAL --json $OUT/ppl-tail-calibquant-2bit-4x2048.json
  $KVCAL eval ppl --recipe kivi-2bit $EVAL --json $OUT/ppl-tail-kivi-2bit-4x2048.json
fi
if [[ $stage == all || $stage == ablations ]]; then
  for r in calibquant-4bit calibquant-8bit ablations/calibquant-1bit-nocalib ablations/calibquant-1bit-tau0-3 \
           ablations/calibquant-2bit-nocalib; do
    $KVCAL eval ppl --recipe $r $EVAL --json $OUT/ppl-tail-$(basename $r)-4x2048.json
  done
fi
