#!/usr/bin/env bash
# One GPU lease's share of the paper's table: scripts/gpu_table.sh SETTING [METHODS...]
#   e.g. scripts/gpu_table.sh rmnist-shards            (all nine methods of the setting)
#        scripts/gpu_table.sh cifar10-dirichlet cafeme fedrep
# A unit is one setting × one method × the preset's 5 seeds at the full protocol (stacked seeds in one
# process, clients vmapped, rounds recorded as CUDA graphs: the defaults on a GPU).
#   1. The estimate: fedmeta bench with configs/bench_campaign.yaml (each method's unit for one timed round)
#      on this card, unless $ESTIMATE names a bench.json measured on the same kind of card before.
#   2. fedmeta table --preset paper --budget (what is left) --estimate: only the units whose estimate fits
#      are started, all at once on the card (units finished before are skipped).
#   3. $OUT/runs-SETTING.tar.gz: the small files (config, metrics, curves, summary) of the setting's finished
#      runs, laid out as results/runs/paper/. Unpack it there, commit, and `fedmeta table --preset paper
#      --no-run` puts the units into results/TABLES.md.
# Environment: BUDGET (seconds for all of it, default 500), OUT (default results/gpu), ESTIMATE, PRESET
# (default paper), ARGS (key=value for every run and bench row, e.g. to try the script on a CPU with
# ARGS="federation.rounds=2 personalization.steps=2").
# The GPU image has torch and Lightning but not OmegaConf: carry .gpu/ with .gpu/wheels (omegaconf and
# antlr4-python3-runtime wheels) and .gpu/data (the data set files the setting needs).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
if [ $# -lt 1 ]; then
  echo "usage: scripts/gpu_table.sh SETTING [METHODS...]  (e.g. rmnist-shards; BUDGET=seconds OUT=folder)" >&2
  exit 2
fi
SETTING=$1; shift
METHODS=("$@")
BUDGET=${BUDGET:-500}
PRESET=${PRESET:-paper}
OUT=${OUT:-results/gpu}
read -r -a EXTRA <<< "${ARGS:-}"
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import omegaconf, pytest" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/fedmeta-site .gpu/wheels/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/fedmeta-site"
fi
[ -d .gpu/data ] && export FEDMETA_DATA=${FEDMETA_DATA:-$PWD/.gpu/data}
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 FEDMETA_CACHE=${FEDMETA_CACHE:-/tmp/fedmeta-cache}
LOG="$OUT/table-$SETTING.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no GPU";
  "$PY" -c "import torch; print('torch', torch.__version__)"; } | tee "$LOG"

DATASET=${SETTING%%-*}
ESTIMATE=${ESTIMATE:-$OUT/bench-$DATASET.json}
if [ ! -f "$ESTIMATE" ]; then
  "$PY" -m fedmeta.cli bench --config configs/bench_campaign.yaml --datasets "$DATASET" --no-memory \
    ${METHODS[@]:+--methods "${METHODS[@]}"} --out "$ESTIMATE" "${EXTRA[@]}" 2>&1 | tee -a "$LOG"
fi

LEFT=$(( BUDGET - ($(date +%s) - START) - 30 ))  # 30 s for the archive and the copy back
"$PY" -m fedmeta.cli table --preset "$PRESET" --datasets "$SETTING" ${METHODS[@]:+--methods "${METHODS[@]}"} \
  --budget "$LEFT" --estimate "$ESTIMATE" --out "$OUT/TABLES-$SETTING.md" logger=[] "${EXTRA[@]}" 2>&1 | tee -a "$LOG"

if [ -d "results/runs/$PRESET/$SETTING" ]; then
  tar czf "$OUT/runs-$SETTING.tar.gz" -C "results/runs/$PRESET" "$SETTING"
  echo "wrote $OUT/runs-$SETTING.tar.gz: $(tar tzf "$OUT/runs-$SETTING.tar.gz" | grep -c summary.json) finished runs" | tee -a "$LOG"
fi
echo "$(( $(date +%s) - START )) s in all" | tee -a "$LOG"
