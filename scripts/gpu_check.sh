#!/usr/bin/env bash
# One GPU lease, as one script: scripts/gpu_check.sh [SECONDS, default 540] [SETTING, default rmnist-shards]
#   1. the recorded rounds against eager ones on the card: tests/test_capture.py's GPU tests (CUDA graphs and
#      torch.compile against the eager vmapped path, float64, 3 rounds and an evaluation) for a few methods;
#   2. configs/bench_gpu.yaml: eager vs recorded rounds on 5 stacked seeds (CAFeMe both variants, TF32 too),
#      every method's table unit recorded, % of this card's fp32 peak, kernel launches per round, and the
#      projected wall time of the paper's table on this card;
#   3. scripts/gpu_table.sh SETTING with what time is left, estimated from step 2's rows: the units of the
#      paper's table that fit, all at once on the card; their run files come back as one archive.
# Results go to $OUT (default results/gpu/), at most 7 files: gpu.txt, equivalence.txt, bench_gpu.txt,
# bench_gpu.json, table-SETTING.txt, TABLES-SETTING.md, runs-SETTING.tar.gz.
# Carry .gpu/ (see scripts/gpu_table.sh): .gpu/wheels (omegaconf, antlr4-python3-runtime; pytest, pluggy, iniconfig
# for the GPU tests) and .gpu/data
# (mnist.npz for RMNIST; cifar10-jpeg.tar.gz, femnist.npz or the Meta-Dataset files for other settings).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
SECONDS_GIVEN=${1:-540}
SETTING=${2:-rmnist-shards}
OUT=${OUT:-results/gpu}
export OUT
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PY PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import omegaconf, pytest" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/fedmeta-site .gpu/wheels/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/fedmeta-site"
fi
[ -d .gpu/data ] && export FEDMETA_DATA=${FEDMETA_DATA:-$PWD/.gpu/data}
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 FEDMETA_CACHE=${FEDMETA_CACHE:-/tmp/fedmeta-cache}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c "import torch; print('torch', torch.__version__)";
  nproc; } | tee "$OUT/gpu.txt"

timeout 100 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_capture.py -k "gpu and (cafeme or fedrep or ifca_ft)" 2>&1 \
  | tail -n 30 | tee "$OUT/equivalence.txt"

timeout 240 "$PY" -m fedmeta.cli bench --config configs/bench_gpu.yaml --no-memory --project paper \
  --out "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt"

ESTIMATE="$OUT/bench_gpu.json" BUDGET=$(( SECONDS_GIVEN - ($(date +%s) - START) )) scripts/gpu_table.sh "$SETTING"
