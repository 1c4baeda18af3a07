#!/usr/bin/env bash
# The GPU check of the vectorized engine, as one script sized for a short lease of a GPU machine:
#   1. the rows of configs/bench_gpu.yaml on the GPU: CAFeMe (both variants) and FedAvg-FT on RMNIST and
#      CIFAR-10, sequential and vmapped clients, 5 stacked seeds, one whole evaluation each way, and the
#      projected wall time of `make table PRESET=paper` on this card;
#   2. the paper's protocol for as long as it is given: an RMNIST-shards CAFeMe run of 5 stacked seeds,
#      1,000 rounds, resumable (output.resume=true) where the time limit stops it.
# Results go to $OUT (or results/gpu/): gpu.txt, bench_gpu.txt (+ bench_gpu.json when the bench ends in
# time), stacked_seeds.txt and stacked_seeds.json (each seed's summary, or its rounds so far).
# Usage: scripts/gpu_check.sh [bench seconds, default 270] [1,000-round run seconds, default 120]
# The GPU image has torch, Lightning and torchmetrics but no network and no OmegaConf: carry .gpu/ with
#   .gpu/wheels: `pip download omegaconf==2.3.0` and a wheel built from antlr4-python3-runtime==4.9.3;
#   .gpu/data:   mnist.npz and cifar10-jpeg.tar.gz (the data directory does not travel with the checkout).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import omegaconf" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/fedmeta-site .gpu/wheels/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/fedmeta-site"
fi
[ -d .gpu/data ] && export FEDMETA_DATA=${FEDMETA_DATA:-.gpu/data}
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 FEDMETA_CACHE=${FEDMETA_CACHE:-/tmp/fedmeta-cache}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c "import torch; print('torch', torch.__version__)"; } | tee "$OUT/gpu.txt"

timeout "${1:-270}" "$PY" -m fedmeta.cli bench --config configs/bench_gpu.yaml --no-memory --project paper \
  --out "$OUT/bench_gpu.json" fabric.accelerator=cuda 2>&1 | tee "$OUT/bench_gpu.txt"

timeout "${2:-120}" "$PY" -m fedmeta.cli train dataset=rmnist method=cafeme "seeds=[0,1,2,3,4]" federation.vectorize=true \
  fabric.accelerator=cuda federation.rounds=1000 federation.eval_every=250 output.root="$OUT/runs" output.resume=true 2>&1 \
  | tail -n 12 | tee "$OUT/stacked_seeds.txt"
"$PY" - "$OUT" <<'PY' | tee -a "$OUT/stacked_seeds.txt"
import csv, json, pathlib, sys
out = pathlib.Path(sys.argv[1])
seeds = {}
for folder in sorted(out.glob("runs/rmnist-shards/cafeme/seed*")):
    summary = folder / "summary.json"
    if summary.is_file():
        seeds[folder.name] = json.loads(summary.read_text())
    elif (folder / "metrics.csv").is_file():
        rows = list(csv.DictReader((folder / "metrics.csv").open()))
        seeds[folder.name] = {"unfinished": True, "rounds": len(rows), "last": rows[-1] if rows else None}
(out / "stacked_seeds.json").write_text(json.dumps(seeds, indent=1))
print({name: s.get("accuracy", s.get("rounds")) for name, s in seeds.items()})
PY
