# The settings the CalibQuant run scripts share (sourced by calibquant_smollm2.sh, calibquant_smollm2_ablations.sh and
# calibquant_smollm2_g32_diagnostics.sh).
set -euo pipefail
export KVCAL_DATA_DIR=${KVCAL_DATA_DIR:-../shared/data/wikitext2}
KVCAL="python -m kvcal.cli"
OUT=results/calibquant
ART=artifacts/smollm2-135m
CAL="--model smollm2-135m --nsamples 4 --seqlen 2048 --device cpu"
EVAL="--protocol tail --seqlen 2048 --nsamples 4 --device cpu"
