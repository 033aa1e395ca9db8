#!/usr/bin/env bash
# CalibQuant 1-bit ablations on smollm2-135m (digest §8.2; same budget and windows as calibquant_smollm2.sh): the
# ablations that search tau (c = (1, 1), global V, per-token V) are calibrated as calibquant_smollm2.sh does; then
# their tail-protocol perplexities, and a diagnostic run with tau fixed at (100, 100): slope 1, every block score
# lowered by 100, so the block gets ~0 attention weight (the block evicted; not a paper setting).
# Run from the repository root after calibquant_smollm2.sh: bash benchmarks/calibquant_smollm2_ablations.sh
# (not all stages have records: the vglobal and vtoken searches were not run to the end;
# calibquant_smollm2_g32_diagnostics.sh has a fixed-tau vtoken row instead)
source "$(dirname "$0")/calibquant_env.sh"

stage=${1:-all}
if [[ $stage == all || $stage == evict ]]; then
  $KVCAL eval ppl --method calibquant --set bits=1 --set tau1=100 --set tau2=100 $EVAL \
    --json $OUT/ppl-tail-calibquant-1bit-tau100-100-block-evicted-4x2048.json
fi
for r in calibquant-1bit-c1 calibquant-1bit-vglobal calibquant-1bit-vtoken; do
  if [[ $stage == all || $stage == $r ]]; then
    $KVCAL calibrate $CAL --recipe ablations/$r --out $ART/$r.safetensors
    $KVCAL inspect $ART/$r.safetensors > $ART/$r.inspect.txt
    $KVCAL eval ppl --artifact $ART/$r.safetensors $EVAL --json $OUT/ppl-tail-$r-4x2048.json
  fi
done
