#!/usr/bin/env bash
# The GPU check of the vectorized engine, as one script for a lent GPU machine (a few minutes):
#   1. make bench's rows for CAFeMe (both variants) and FedAvg-FT on RMNIST and CIFAR-10 on the
#      GPU — sequential, vmap and 5 stacked seeds, plus one whole evaluation each way — with the
#      projected wall time of `make table PRESET=paper` on this card;
#   2. one 1,000-round RMNIST-shards CAFeMe run of 5 stacked seeds (the paper's protocol).
# Results go to $OUT (or results/gpu/): gpu.txt, bench_gpu.json/.txt, stacked_seeds.txt/.json (the 5 runs' summaries).
# Usage: scripts/gpu_check.sh [max seconds for the 1,000-round run, default 420]
# A GPU machine image with torch, Lightning and torchmetrics but no network needs OmegaConf as a
# carried wheel: here, `.venv/bin/pip download omegaconf -d .gpu_wheels` (and list .gpu_wheels in
# .git/info/exclude); carry .gpu_wheels along with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import omegaconf" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links .gpu_wheels omegaconf
fi
export WANDB_MODE=disabled PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

"$PY" -m fedmeta.cli bench --datasets rmnist cifar10 --methods cafeme fedavg_ft --no-memory --project paper \
  --out "$OUT/bench_gpu.json" fabric.accelerator=cuda 2>&1 | tee "$OUT/bench_gpu.txt"

timeout "${1:-420}" "$PY" -m fedmeta.cli train dataset=rmnist method=cafeme "seeds=[0,1,2,3,4]" federation.vectorize=true \
  fabric.accelerator=cuda federation.rounds=1000 federation.eval_every=100 output.root="$OUT/runs" 2>&1 \
  | tail -n 12 | tee "$OUT/stacked_seeds.txt" || echo "the 1,000-round run stopped at its time limit: resume it with output.resume=true" | tee -a "$OUT/stacked_seeds.txt"
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summaries = [json.loads(p.read_text()) for p in sorted(out.glob("runs/rmnist-shards/cafeme/seed*/summary.json"))]
(out / "stacked_seeds.json").write_text(json.dumps(summaries, indent=1))
PY
