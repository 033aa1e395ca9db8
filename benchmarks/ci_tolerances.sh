#!/usr/bin/env bash
# Calibrate docs/ci.md's recipes on this machine, for the cross-machine tolerances.
# Calibrate the same recipes on this machine (CPU or GPU): the artifacts that docs/ci.md's recommended tolerances
# compare across machines. Usage: benchmarks/ci_tolerances.sh OUT_DIR DEVICE (cpu or cuda); KVCAL_DATA_DIR set.
set -euo pipefail
out="$1"; device="$2"
mkdir -p "$out"
for recipe in kvquant-nuq4-1pct skvq-k2v2-g32-w128 xquant-svd-2bit calibquant-1bit; do
  ${KVCAL:-kvcal} calibrate --recipe "$recipe" --model smollm2-135m --dtype float32 --device "$device" --seed 0 \
    --nsamples 4 --seqlen 1024 --out "$out/$recipe.safetensors" 2>&1 | tail -1
done
