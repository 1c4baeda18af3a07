#!/usr/bin/env bash
# One job of the paper's table on a lent GPU (or any machine), the budget as law:
#   scripts/gpu_job.sh [SECONDS]      a job of SECONDS (default 540) from its start to its last file
#   scripts/gpu_job.sh --outputs      the files a job writes to $OUT, one a line
#   scripts/gpu_job.sh --collect DIR  after a job, here: its runs into results/runs/paper/, then
#                                     results/campaign.md and results/TABLES.md rewritten from them
# Carry .gpu/ (make gpu-kit: the wheels the card's image lacks, the data files of the settings).
# Stages, each given its share of what is left and stopped at it:
#   1. $OUT/gpu.txt: the machine, written first, whatever fails after;
#   2. the kit's wheels whose module does not import, into /tmp/fedmeta-site (no network needed),
#      then the card's matmul peaks (fp32, TF32, bf16) added to gpu.txt;
#   3. on a GPU, tests/test_capture.py's GPU tests (recorded against eager rounds, float64), at most
#      EQUIVALENCE_SECONDS (default 45): if they fail, the table's runs do not record their rounds;
#   4. fedmeta campaign --budget (what is left): the unfinished units of configs/campaign.yaml first,
#      then the next ones, every run stopped at the deadline at a round boundary, checkpointed;
#   5. $OUT: the table, the campaign's state and the runs (finished runs' small files, unfinished
#      runs' checkpoints) as runs.tar.gz, split into parts below 16 MiB when larger.
# Everything the job prints goes to $OUT/job.log too. Environment: OUT (default results/gpu), PY, and
# CAMPAIGN_ARGS (key=value for every run, e.g. the CPU rehearsal's federation.vectorize=false).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTPUTS="gpu.txt job.log equivalence.txt campaign.md TABLES.md runs.tar.gz"  # runs.tar.gz.part-NN when split
PRESET=paper
KEPT=results/runs/$PRESET
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if [ "${1:-}" = "--outputs" ]; then
  tr ' ' '\n' <<< "$OUTPUTS"
  exit 0
fi
if [ "${1:-}" = "--collect" ]; then
  DIR=${2:?usage: scripts/gpu_job.sh --collect DIR (the folder a job wrote, e.g. /work/.device/…/out)}
  if ! ls "$DIR"/runs.tar.gz* >/dev/null 2>&1; then
    echo "gpu_job: $DIR holds no runs.tar.gz: give the folder the job's files came back to" >&2
    exit 2
  fi
  mkdir -p "$KEPT"
  cat "$DIR"/runs.tar.gz* | tar xzf - -C "$KEPT" || exit 2
  for summary in "$KEPT"/*/*/seed*/summary.json; do  # finished now: its carried checkpoint is done with
    [ -e "$summary" ] && rm -f "$(dirname "$summary")/checkpoint.ckpt"
  done
  "$PY" -m fedmeta.cli campaign && "$PY" -m fedmeta.cli table --preset "$PRESET" --no-run >/dev/null \
    && echo "collected $DIR into $KEPT; wrote results/campaign.md and results/TABLES.md"
  exit
fi

BUDGET=${1:-540}
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 60 ]; then
  echo "usage: scripts/gpu_job.sh [SECONDS ≥ 60] | --outputs | --collect DIR" >&2
  exit 2
fi
START=$(date +%s)
DEADLINE=$(( START + BUDGET ))
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/job.log") 2>&1
left() { echo $(( DEADLINE - $(date +%s) )); }
at() { echo "[+$(( $(date +%s) - START )) s] $*"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no GPU"
  "$PY" -c "import torch, platform; print('torch', torch.__version__, '· python', platform.python_version())"
  echo "$(nproc) CPU cores; budget $BUDGET s"; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SITE=/tmp/fedmeta-site
for wheel in .gpu/wheels/*.whl; do
  [ -e "$wheel" ] || break
  module=$("$PY" -c "import sys, zipfile  # the wheel's first package, else its name
names = [n.split('/')[0] for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.count('/') == 1 and n.endswith('/__init__.py')]
print(names[0] if names else sys.argv[1].split('/')[-1].split('-')[0])" "$wheel")
  "$PY" -c "import $module" 2>/dev/null && continue
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" \
    && at "installed $(basename "$wheel")"
done
export PYTHONPATH="$PYTHONPATH:$SITE"
if [ -d .gpu/data ]; then  # the kit's data files, and RMNIST's, which travels with the tree
  [ -e .gpu/data/mnist.npz ] || ln -s "$PWD/data/mnist.npz" .gpu/data/mnist.npz
  export FEDMETA_DATA=${FEDMETA_DATA:-$PWD/.gpu/data}
fi
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 FEDMETA_CACHE=${FEDMETA_CACHE:-/tmp/fedmeta-cache}

timeout 30 "$PY" -c "import torch; from fedmeta.bench import device_peaks
d = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
print('matmul peaks, GFLOP/s:', {k: round(v) for k, v in device_peaks(d, 4096 if d.type == 'cuda' else 1024).items()})" \
  >> "$OUT/gpu.txt" 2>&1 && tail -n 1 "$OUT/gpu.txt"  # the job's own peak, for the runs' % of it

read -r -a RUN_ARGS <<< "${CAMPAIGN_ARGS:-}"
if "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  SECONDS_FOR_TESTS=$(( $(left) / 4 < ${EQUIVALENCE_SECONDS:-45} ? $(left) / 4 : ${EQUIVALENCE_SECONDS:-45} ))
  at "equivalence tests, at most $SECONDS_FOR_TESTS s"
  timeout "$SECONDS_FOR_TESTS" "$PY" -m pytest -q -x -p no:cacheprovider tests/test_capture.py \
    -k "gpu and (cafeme or fedrep or ifca_ft)" > "$OUT/equivalence.txt" 2>&1
  code=$?
  tail -n 3 "$OUT/equivalence.txt"
  if [ $code -eq 124 ]; then
    at "equivalence: not finished in $SECONDS_FOR_TESTS s (recorded rounds kept)"
  elif [ $code -ne 0 ]; then
    RUN_ARGS+=(federation.capture=none)
    at "equivalence FAILED (exit $code): the runs do not record their rounds"
  fi
else
  echo "no GPU: the recorded rounds' GPU tests do not apply" > "$OUT/equivalence.txt"
fi

STAMP="$(cd "$OUT" && pwd)/.started"  # checkpoints newer than this one were written by this job
touch "$STAMP"
RESERVE=15  # the table and the archive
at "campaign, $(( $(left) - RESERVE )) s"
timeout --kill-after=10 $(( $(left) - RESERVE + 20 )) \
  "$PY" -m fedmeta.cli campaign --budget $(( $(left) - RESERVE )) ${RUN_ARGS[@]+"${RUN_ARGS[@]}"}
at "campaign ended (exit $?)"

timeout 15 "$PY" -m fedmeta.cli table --preset "$PRESET" --no-run --out "$OUT/TABLES.md" > /dev/null \
  || at "the table was not written"
cp results/campaign.md "$OUT/campaign.md" 2>/dev/null || at "no campaign state"
if [ -d "$KEPT" ]; then
  (cd "$KEPT" && find . -type f \( -name '*.ckpt' -newer "$STAMP" -o ! -name '*.ckpt' \) \
    ! -name '*.lock' -print0 | tar czf - --null -T -) > "$OUT/runs.tar.gz"
  if [ "$(stat -c %s "$OUT/runs.tar.gz")" -gt $(( 15 * 1024 * 1024 )) ]; then
    split -b 15M -d "$OUT/runs.tar.gz" "$OUT/runs.tar.gz.part-" && rm "$OUT/runs.tar.gz"
  fi
  at "runs: $(du -ch "$OUT"/runs.tar.gz* | tail -1 | cut -f1) ($(tar tzf <(cat "$OUT"/runs.tar.gz*) | grep -c 'summary.json$') finished runs, $(tar tzf <(cat "$OUT"/runs.tar.gz*) | grep -c 'ckpt$') checkpoints)"
fi
rm -f "$STAMP"
at "done: $(ls "$OUT" | tr '\n' ' ')"
