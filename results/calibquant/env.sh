# The settings the CalibQuant run scripts share (sourced by run.sh, run-ablations.sh and run-extra.sh).
set -euo pipefail
export KVCAL_DATA_DIR=${KVCAL_DATA_DIR:-../shared/data/wikitext2}
KVCAL="python -m kvcal.cli"
OUT=results/calibquant
ART=artifacts/smollm2-135m
CAL="--model smollm2-135m --nsamples 4 --seqlen 2048 --device cpu"
EVAL="--protocol tail --seqlen 2048 --nsamples 4 --device cpu"
