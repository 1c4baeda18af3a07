#!/usr/bin/env bash
# One job of the paper's table on a lent GPU (or any machine), the budget as law:
#   scripts/gpu_job.sh [SECONDS]      a job of SECONDS (default 540) from its start to its last file;
#                                     refused if SECONDS could pass the lease's per-command limit
#                                     (COMMAND_LIMIT, default 600, less a 10 s margin)
#   scripts/gpu_job.sh --outputs      the files a job writes to $OUT, one pattern a line
#   scripts/gpu_job.sh --collect DIR  after a job, here: what it packed into DIR checked and taken into
#                                     results/runs/paper/ (never losing or rewinding a kept run), its log
#                                     into results/gpu/jobs/, then results/campaign.md and TABLES.md
# Carry .gpu/ (make gpu-kit: the wheels the card's image lacks, the data files of the settings).
# What the job gains leaves as it is made: from its first checkpoint on, $OUT holds a whole archive of
# it (lease.json and its parts runs-a.NN or runs-b.NN, fedmeta/lease.py), replaced atomically after
# every checkpoint and at least once a minute, so a kill at any moment loses only the last minute.
# Stages, each stopped in time:
#   1. the machine (into job.log, first, whatever fails after), and what may be carried: the 64 MiB
#      less what travelled here (the tree and the kit, kept checkpoints aside), at most 28 MiB;
#   2. the kit's wheels whose module does not import, into /tmp/fedmeta-site (no network needed);
#   3. on a GPU whose model has not passed them with these sources (the engine, the tests and the
#      campaign's methods' algorithm files: results/gpu/equivalence.txt), the
#      recorded rounds' GPU tests of every method the campaign runs, in three processes at once, at
#      most EQUIVALENCE_SECONDS (default 90): a failure or a timeout turns recording off for the job;
#   4. on a GPU, at most PROFILE_SECONDS (default 75; 0: none) measuring the next unit alone
#      (fedmeta campaign --profile): its speed, an evaluation, its top kernels, then whether it and
#      the same method's unit in another setting fill the card better in one process, into job.log;
#   5. fedmeta campaign --budget (what is left) --pack $OUT: the unfinished units of
#      configs/campaign.yaml first, then the next ones, every run stopped at the deadline at a round
#      boundary, checkpointed; units whose data is not here are skipped in one line.
# Exit 0 and "done" only when $OUT's last archive is the campaign's final one. Environment: OUT
# (default .cache/gpu-out), PY, PARALLEL (units at once), AHEAD (units that set up while others train),
# CAMPAIGN_ARGS (key=value for every run); PARALLEL and AHEAD default to configs/campaign.yaml's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTPUTS="job.log lease.json runs-[ab].[0-9][0-9]"
PRESET=paper
KEPT=results/runs/$PRESET
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if [ "${1:-}" = "--outputs" ]; then
  tr ' ' '\n' <<< "$OUTPUTS"
  exit 0
fi
if [ "${1:-}" = "--collect" ]; then
  DIR=${2:?usage: scripts/gpu_job.sh --collect DIR, the folder the files of a job came back to}
  # the runs, the job's record and its log: all read and checked in python (no path here is built from them)
  "$PY" -m fedmeta.cli campaign --collect "$DIR" || exit $?
  "$PY" -m fedmeta.cli table --preset "$PRESET" --no-run >/dev/null \
    && echo "collected $DIR into $KEPT; wrote results/campaign.md and results/TABLES.md"
  exit
fi

LIMIT=${COMMAND_LIMIT:-600}
BUDGET=${1:-540}
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 60 ] || [ "$BUDGET" -gt $(( LIMIT - 10 )) ]; then
  echo "usage: scripts/gpu_job.sh [SECONDS: 60 to $(( LIMIT - 10 )), the lease's per-command limit $LIMIT s less 10] | --outputs | --collect DIR" >&2
  exit 2
fi
START=$(date +%s)
DEADLINE=$(( START + BUDGET ))
OUT=${OUT:-.cache/gpu-out}
mkdir -p "$OUT"
rm -f "$OUT"/lease.json "$OUT"/lease.json.tmp "$OUT"/runs-[ab].[0-9][0-9]  # an earlier job's, never mixed in
exec > >(tee "$OUT/job.log") 2>&1
left() { echo $(( DEADLINE - $(date +%s) )); }
at() { echo "[+$(( $(date +%s) - START )) s] $*"; }

# What travelled (the tree and the kit, the kept checkpoints aside: they are what the next job replaces)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then  # a checkout: what a lease would carry of it
  LISTED=$( (git ls-files -co --exclude-standard; find .gpu -type f 2>/dev/null) | grep -v "^$KEPT/.*/checkpoint.ckpt$")
else  # a lease's copy: everything here travelled
  LISTED=$(find . -path ./runs -prune -o -path ./.cache -prune -o -type f -print | grep -v "^./$KEPT/.*/checkpoint.ckpt$")
fi
TRAVELLED=$(tr '\n' '\0' <<< "$LISTED" | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { printf "%.0f", s / 1048576 }')
CARRY=$(( 64 - TRAVELLED - 2 ))
(( CARRY > 28 )) && CARRY=28
(( CARRY < 0 )) && CARRY=0
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo "machine: ${GPU:-no GPU}; $("$PY" -c "import torch, platform; print('torch', torch.__version__, '· python', platform.python_version())" 2>&1); $(nproc) CPU cores"
echo "budget $BUDGET s (per-command limit $LIMIT s); travelled ${TRAVELLED} MiB: unfinished runs may carry ${CARRY} MiB"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SITE=/tmp/fedmeta-site
for wheel in .gpu/wheels/*.whl; do
  [ -e "$wheel" ] || break
  module=$("$PY" -c "import sys, zipfile  # the wheel's first package, else its name
names = [n.split('/')[0] for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.count('/') == 1 and n.endswith('/__init__.py')]
print(names[0] if names else sys.argv[1].split('/')[-1].split('-')[0])" "$wheel")
  "$PY" -c "import $module" 2>/dev/null && continue
  timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" \
    && at "installed $(basename "$wheel")"
done
export PYTHONPATH="$PYTHONPATH:$SITE"
if [ -d .gpu/data ]; then  # the kit's data files, and RMNIST's, which travels with the tree
  [ -e .gpu/data/mnist.npz ] || ln -s "$PWD/data/mnist.npz" .gpu/data/mnist.npz
  export FEDMETA_DATA=${FEDMETA_DATA:-$PWD/.gpu/data}
fi
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 FEDMETA_CACHE=${FEDMETA_CACHE:-/tmp/fedmeta-cache}

read -r -a RUN_ARGS <<< "${CAMPAIGN_ARGS:-}"
if [ -n "$GPU" ]; then
  # the campaign's methods (else its preset's), and the sources their recorded rounds run: the engine,
  # the tests, and the algorithm files of those methods and of what they import (fedmeta itself is not
  # imported: that costs seconds)
  read -r METHODS_AND_SOURCES < <("$PY" - <<'PYTHON'
import re, yaml
from pathlib import Path
plan = yaml.safe_load(open("configs/campaign.yaml"))
methods = plan.get("methods") or yaml.safe_load(open(f"configs/preset/{plan['preset']}.yaml"))["methods"]
files = {"fedmeta/algorithms/__init__.py", "fedmeta/algorithms/base.py"}
for method in methods:
    name = method
    while not Path(f"fedmeta/algorithms/{name}.py").exists():  # fedavg_ft: FedAvg's file
        name = yaml.safe_load(open(f"configs/method/{name}.yaml")).get("inherits")
        if name is None:
            break
    todo = [f"fedmeta/algorithms/{name}.py"] if name else []
    while todo:
        file = todo.pop()
        if file not in files:
            files.add(file)
            todo += [f"fedmeta/algorithms/{m}.py" for m in re.findall(r"fedmeta\.algorithms\.(\w+)", open(file).read())]
print(" ".join(methods), "|", " ".join(sorted(files)))
PYTHON
)
  METHODS=${METHODS_AND_SOURCES%% | *}
  SOURCES="tests/test_capture.py tests/test_vectorize.py fedmeta/capture.py fedmeta/engine.py fedmeta/functional.py ${METHODS_AND_SOURCES#* | }"
  # shellcheck disable=SC2086  # the sources are words
  HASH=$(cat $SOURCES | sha256sum | cut -c1-16)
  if grep -qxF "$GPU sources $HASH" results/gpu/equivalence.txt 2>/dev/null; then
    at "equivalence: $GPU passed the recorded rounds' GPU tests with these sources before: not rerun"
  else
    CAP=${EQUIVALENCE_SECONDS:-90}
    at "equivalence: the recorded rounds' GPU tests of $METHODS, three processes, at most $CAP s"
    read -r -a ALL <<< "$METHODS"
    pids=()
    for k in 0 1 2; do
      group=()
      for i in "${!ALL[@]}"; do (( i % 3 == k )) && group+=("${ALL[$i]}"); done
      (( ${#group[@]} )) || continue
      filter="gpu and ($(printf '%s or ' "${group[@]}" | sed 's/ or $//'))"
      timeout "$CAP" "$PY" -m pytest -q -p no:cacheprovider tests/test_capture.py -k "$filter" \
        > "/tmp/equivalence-$k.txt" 2>&1 &
      pids+=($!)
    done
    failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=$?; done
    passed=$(cat /tmp/equivalence-*.txt | grep -oE '^[0-9]+ passed' | awk '{ s += $1 } END { print s + 0 }')
    if [ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]; then
      echo "equivalence: passed $GPU sources $HASH"
      at "equivalence: $passed tests passed"
    else
      RUN_ARGS+=(federation.capture=none)
      tail -n 5 /tmp/equivalence-*.txt
      at "equivalence FAILED ($([ "$failed" -eq 124 ] && echo "not finished in $CAP s" || echo "exit $failed")): the runs do not record their rounds"
    fi
  fi
fi

# What the lease teaches the next change (fedmeta.profiling): the next unit alone — its speed, an
# evaluation, its top kernels, achieved GB/s and TFLOP/s — then it and its partner unit as lanes of
# one round and on two CUDA streams, into this log, before the campaign starts anything beside it.
# On a card only, once a lease: the second command passes PROFILE_SECONDS=0.
PROFILE_SECONDS=${PROFILE_SECONDS:-$([ -n "$GPU" ] && echo 75 || echo 0)}
if [[ "$PROFILE_SECONDS" =~ ^[0-9]+$ ]] && (( PROFILE_SECONDS > 5 && $(left) > 4 * PROFILE_SECONDS )); then
  at "profile: the next unit alone, at most $PROFILE_SECONDS s"
  timeout --kill-after=2 "$PROFILE_SECONDS" "$PY" -m fedmeta.cli campaign --profile $(( PROFILE_SECONDS - 3 )) \
    --carry-mib "$CARRY" ${RUN_ARGS[@]+"${RUN_ARGS[@]}"}
  at "profile ended (exit $?)"
fi

RESERVE=6  # after the campaign: reading its manifest
at "campaign, $(( $(left) - RESERVE )) s"
# --until, not --budget: the campaign's own start (43 s at load 8 on 2 cores) is spent from its time
timeout --kill-after=2 $(( $(left) - RESERVE )) "$PY" -m fedmeta.cli campaign --until $(( DEADLINE - RESERVE - 2 )) \
  --pack "$OUT" --carry-mib "$CARRY" ${PARALLEL:+--parallel "$PARALLEL"} ${AHEAD:+--start-ahead "$AHEAD"} \
  ${RUN_ARGS[@]+"${RUN_ARGS[@]}"}
code=$?
at "campaign ended (exit $code)"
summary=$("$PY" -m fedmeta.lease "$OUT")
case "$summary" in
  final*) at "done: ${summary#final }"; exit 0 ;;
  partial*) at "the campaign ended before its last pack: OUT holds its ${summary#partial }"; exit 1 ;;
  *) at "the campaign packed nothing into $OUT"; exit 1 ;;
esac
