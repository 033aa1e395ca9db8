#!/usr/bin/env bash
# Tail-protocol rows on smollm2-135m (same windows as calibquant_smollm2.sh), not paper settings: CalibQuant-2 with
# ranges over groups of 32 tokens (KIVI-2's key granularity) with the authors' tau (0, 3) and without the remap, to
# separate the range granularity from the remap in the comparison with KIVI-2; per-token V at 1 bit; the attention
# diagnostics.
# Run from the repository root: bash benchmarks/calibquant_smollm2_g32_diagnostics.sh
source "$(dirname "$0")/calibquant_env.sh"
$KVCAL eval ppl --method calibquant --set bits=2 --set group_tokens=32 --set tau1=0 --set tau2=3 $EVAL \
  --json $OUT/ppl-tail-calibquant-2bit-g32-tau0-3-4x2048.json
$KVCAL eval ppl --method calibquant --set bits=2 --set group_tokens=32 --set calibration=false $EVAL \
  --json $OUT/ppl-tail-calibquant-2bit-g32-nocalib-4x2048.json
# Per-token V ranges (KIVI-style values, digest §8.2) at 1 bit with tau fixed at the 1-bit search's (3, 3)
# instead of its own search (the CPU budget ran out for a third search)
$KVCAL eval ppl --method calibquant --set bits=1 --set v_ranges=token --set tau1=3 --set tau2=3 $EVAL \
  --json $OUT/ppl-tail-calibquant-1bit-vtoken-tau3-3-4x2048.json
# Per-layer attention-probability errors of the tail queries, Quant vs Quant-C (the paper's Fig. 2 analog), 2 windows
for b in 1 2; do
  python benchmarks/calibquant_diagnostics.py --artifact artifacts/smollm2-135m/calibquant-${b}bit.safetensors \
    --nsamples 2 --json $OUT/diagnostics-calibquant-${b}bit-2x2048.json
done
