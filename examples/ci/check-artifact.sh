#!/usr/bin/env bash
# Regression check of a calibration artifact (docs/ci.md): calibrate with a fixed seed, compare with the committed
# golden artifact by tensor kind, evaluate a few windows, gate the perplexity and bits per element on a baseline record.
# Every step runs; the script exits 1 if any check failed (each failure is one line in the log), 2 on bad input.
#
# Settings (environment):
#   RECIPE          recipe name or YAML path                     (required)
#   MODEL           model alias or local HF folder               (required)
#   GOLDEN          committed golden artifact                    (required)
#   BASELINE        committed eval record of the golden artifact (required)
#   MAX_INCREASE    perplexity increase allowed, percent          (default 1)
#   COMPARE_TOL     kvcal compare tolerances, e.g. "--tol weights=1e-3,1e-5 --rtol 1e-4" (default: exact)
#   CALIB_ARGS      more kvcal calibrate arguments (data, windows) (default: none)
#   EVAL_ARGS       kvcal eval ppl arguments: the baseline's data, protocol, seqlen, windows (default: none)
#   ARTIFACT        check this artifact instead of calibrating one (an artifact another job produced)
#   WORK            folder for the new artifact and record        (default: a temporary folder)
set -uo pipefail
: "${RECIPE:?set RECIPE}" "${MODEL:?set MODEL}" "${GOLDEN:?set GOLDEN}" "${BASELINE:?set BASELINE}"
MAX_INCREASE="${MAX_INCREASE:-1}"
WORK="${WORK:-$(mktemp -d)}"
KVCAL="${KVCAL:-kvcal}"
failed=0

if [ -z "${ARTIFACT:-}" ]; then
  ARTIFACT="$WORK/artifact.safetensors"
  # shellcheck disable=SC2086
  $KVCAL calibrate --recipe "$RECIPE" --model "$MODEL" --seed 0 ${CALIB_ARGS:-} --out "$ARTIFACT" || exit 2
fi

# shellcheck disable=SC2086
$KVCAL compare "$ARTIFACT" "$GOLDEN" ${COMPARE_TOL:-}
status=$?
[ $status -eq 1 ] && failed=1
[ $status -gt 1 ] && exit 2

# shellcheck disable=SC2086
$KVCAL eval ppl --artifact "$ARTIFACT" --model "$MODEL" ${EVAL_ARGS:-} --json "$WORK/eval.json" > /dev/null || exit 2
$KVCAL gate "$WORK/eval.json" --baseline "$BASELINE" --max-increase "$MAX_INCREASE"
status=$?
[ $status -eq 1 ] && failed=1
[ $status -gt 1 ] && exit 2
exit $failed
