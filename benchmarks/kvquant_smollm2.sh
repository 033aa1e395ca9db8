#!/usr/bin/env bash
# KVQuant reproduction on smollm2-135m (issue 3): headline table and ablations R1, R3, R4, R5, R7, R8.
# Calibration: WikiText-2 (16 windows x 2048, seed 0); evaluation: WikiText-2 test, seqlen 2048,
# 16 windows, protocol gptq, float32, CPU. Results: results/kvquant/<name>.json (+ .log).
set -euo pipefail
: "${KVCAL_DATA_DIR:?point KVCAL_DATA_DIR at the WikiText-2 folder}"
cd "$(dirname "$0")/.."
OUT=results/kvquant
ART=artifacts/smollm2-135m
CACHE=${KVCAL_CAPTURE_CACHE:-$HOME/.cache/kvcal/captures}  # one capture serves every setting
mkdir -p "$OUT"

run() {  # run NAME CALIBRATE-ARGS...: calibrate then evaluate, unless the result exists
  local name=$1; shift
  [ -f "$OUT/$name.json" ] && return 0
  { echo "+ kvcal calibrate $* --out $ART/$name.safetensors"
    kvcal calibrate "$@" --capture-cache "$CACHE" --out "$ART/$name.safetensors"
    kvcal eval ppl --artifact "$ART/$name.safetensors" --nsamples 16 --json "$OUT/$name.json"
  } > "$OUT/$name.log" 2>&1
}

# Headline: KVQuant-N and KVQuant-N-1% (recipes carry the calibration settings).
for recipe in kvquant-nuq3-1pct kvquant-nuq4-1pct kvquant-nuq2-1pct kvquant-nuq4 kvquant-nuq3 kvquant-nuq2; do
  run "$recipe" --recipe "$recipe"
done

# Ablation chain at 3 bits (digest 9.2), each row adds one ingredient to the previous one.
K="--method kvquant --set bits=3"
run abl3-int-pertoken-postrope   $K --set datatype=int --set key_granularity=per_token --set pre_rope=false --set outliers=0 --set sink=0
run abl3-int-perchannel-postrope $K --set datatype=int --set pre_rope=false --set outliers=0 --set sink=0
run abl3-int-perchannel-prerope  $K --set datatype=int --set outliers=0 --set sink=0
run abl3-nuq-unweighted          $K --set weighting=none --set outliers=0 --set sink=0
run abl3-nuq-fisher              $K --set weighting=fisher --set outliers=0 --set sink=0
run abl3-nuq-fisher-scale        $K --set outliers=0 --set sink=0
run abl3-nuq-1pct                $K --set sink=0
# (+ first token in fp16 = the headline kvquant-nuq3-1pct)

# R3b: for per-token keys, post-RoPE should be at least as good as pre-RoPE.
run abl3-int-pertoken-prerope    $K --set datatype=int --set key_granularity=per_token --set outliers=0 --set sink=0
# R7 at 2 bits, where the sink should matter most (without sparse), and R8 (Q-Norm, on by default at 2 bits).
run abl2-nuq-nosink              --method kvquant --set bits=2 --set outliers=0 --set sink=0
run abl2-nuq-1pct-noqnorm        --method kvquant --set bits=2 --set qnorm=false
echo all done
