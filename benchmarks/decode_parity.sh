#!/usr/bin/env bash
# Decode-mode perplexity (token by token through the packed cache) against the gptq simulation, for the
# methods the runtime runs (issue 5). smollm2-135m, WikiText-2 test, 2 windows of 512 tokens.
# On CPU this exercises the torch references; on CUDA the Triton kernels.
# Usage: benchmarks/decode_parity.sh [cpu|cuda] [dtype]   (needs the kvquant artifacts: benchmarks/kvquant_smollm2.sh)
set -euo pipefail
: "${KVCAL_DATA_DIR:?point KVCAL_DATA_DIR at the WikiText-2 folder}"
cd "$(dirname "$0")/.."
command -v kvcal > /dev/null || kvcal() { python3 -m kvcal.cli "$@"; }
DEVICE=${1:-cpu}
DTYPE=${2:-float32}
OUT=${OUT_DIR:-results/runtime/parity-$DEVICE-$DTYPE}
ART=artifacts/smollm2-135m
COMMON=(--seqlen 512 --nsamples 2 --batch-size 2 --device "$DEVICE" --dtype "$DTYPE")
for mode in simulate decode; do
  kvcal eval ppl --recipe rtn-int4 "${COMMON[@]}" --mode "$mode" --json "$OUT/rtn-int4-$mode.json"
  kvcal eval ppl --recipe rtn-int2 "${COMMON[@]}" --mode "$mode" --json "$OUT/rtn-int2-$mode.json"
  kvcal eval ppl --recipe kivi-4bit "${COMMON[@]}" --mode "$mode" --json "$OUT/kivi-4bit-$mode.json"
  kvcal eval ppl --recipe kivi-2bit "${COMMON[@]}" --mode "$mode" --json "$OUT/kivi-2bit-$mode.json"
  kvcal eval ppl --artifact "$ART/kvquant-nuq4-1pct.safetensors" --artifact "$ART/kvquant-nuq3-1pct.safetensors" \
    --artifact "$ART/kvquant-nuq2-1pct.safetensors" "${COMMON[@]}" --mode "$mode" --json-dir "$OUT/$mode"
done
