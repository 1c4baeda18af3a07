#!/usr/bin/env bash
# A GPU job rehearsed on this machine's CPU, before it costs a lease: scripts/gpu_rehearse.sh (make gpu-rehearse).
#   1. .cache/rehearse-venv: Python 3.12 with the image's torch, torchvision, lightning and numpy
#      (configs/gpu_image.txt) and what they pull in, nothing else: what the job needs beyond them must
#      come from the kit (.gpu/, make gpu-kit), as on the card. Built once (a stamp holds the pins).
#   2. The tree as the device machine receives it (git ls-files -co --exclude-standard, plus .gpu/) in a
#      fresh folder; there `CUDA_VISIBLE_DEVICES= PY=<venv python> OUT=out1 timeout 200 scripts/gpu_job.sh 120`.
#      Checks: it exits 0, within 120 + 15 s, and leaves every file `scripts/gpu_job.sh --outputs` promises.
#   3. out1 collected into a stand-in of the developer's tree (`scripts/gpu_job.sh --collect out1`, with
#      .venv's python), shipped again as a fresh copy, a second job into out2: the same checks, and its
#      output says it resumed.
# Each job starts with empty /tmp/fedmeta-site and /tmp/fedmeta-cache, as on a fresh machine.
# Environment: CAMPAIGN_ARGS (the runs' overrides, default federation.vectorize=false), JOB (a stand-in for scripts/gpu_job.sh, copied into the copies in its place), SECONDS_GIVEN
# (default 120), CARRY (the ignored paths a lease carries, default .gpu), PY312 (the Python 3.12 to build
# the venv with). The log: stdout and .cache/rehearse/rehearsal.log. Exits 1 if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOB=${JOB:-scripts/gpu_job.sh}
SECONDS_GIVEN=${SECONDS_GIVEN:-120}
CARRY=${CARRY:-.gpu}
PY312=${PY312:-}
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  [ -n "$PY312" ] && break
  "$candidate" -c "" 2>/dev/null && PY312=$candidate  # a pyenv shim may exist and not run
done
VENV=$ROOT/.cache/rehearse-venv
WORK=$ROOT/.cache/rehearse
LOG=$WORK/rehearsal.log
FAILED=0

mkdir -p "$WORK"
rm -rf "$WORK"/out1 "$WORK"/out2 "$WORK"/job*.txt
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
fail() { say "FAILED: $*"; FAILED=1; }
mib() { du -sm "$1" | cut -f1; }

if [ ! -f "$JOB" ]; then
  say "no $JOB yet: nothing to rehearse (JOB=path names a stand-in)"
  exit 1
fi
if [ ! -d .gpu ]; then
  say "no .gpu/: make gpu-kit first (the rehearsal carries it as a lease would)"
  exit 1
fi

# 1. The image's stand-in. PyPI's torch 2.11.0 is its CUDA build: it pulls CUDA 13's libraries (about 2.6 GB
# of wheels), which libtorch_cuda.so links against, so `import torch` needs most of them even on a CPU.
PINS=$(grep -E '^(torch|torchvision|lightning|numpy)==' configs/gpu_image.txt | sort | tr '\n' ' ')
if [ "$(cat "$VENV/.pins" 2>/dev/null)" != "$PINS" ]; then
  [ -n "$PY312" ] || { say "no Python 3.12 found: set PY312 to one (the image's Python is 3.12)"; exit 1; }
  say "building $VENV with $PINS(once)"
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV" || exit 1
  # Downloaded first, then installed from there: a rebuild needs no network. (This machine's pip config names
  # local indexes that hold no Python 3.12 files: pip's warnings about them are dropped.)
  # shellcheck disable=SC2086  # the pins are words
  "$VENV/bin/python" -m pip download -q --only-binary=:all: -d "$WORK/wheels" $PINS 2>&1 | grep -v "is ignored"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --no-index --find-links "$WORK/wheels" $PINS || exit 1
  echo "$PINS" > "$VENV/.pins"
fi
VPY=$VENV/bin/python
DEV_PY=$ROOT/.venv/bin/python
[ -x "$DEV_PY" ] || DEV_PY=python3
say "venv: $("$VPY" -c 'import sys, torch, lightning, numpy; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, lightning {lightning.__version__}, numpy {numpy.__version__}")'), $(mib "$VENV") MiB"
if "$VPY" -c "import omegaconf" 2>/dev/null; then
  fail "the venv has omegaconf: it would hide a kit without it"
fi

# The files a lease ships from a tree: git's list of it (tracked, untracked and not ignored) and CARRY.
ship() {  # ship FROM TO
  mkdir -p "$2"
  git --git-dir="$ROOT/.git" --work-tree="$1" ls-files -z -co --exclude-standard \
    | (cd "$1" && tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$2"
  for path in $CARRY; do
    [ -e "$1/$path" ] && mkdir -p "$(dirname "$2/$path")" && cp -a "$1/$path" "$2/$path"
  done
}

# A job as the device runs it: in a fresh copy, on a fresh machine, with the checks of its promises.
run_job() {  # run_job NAME TREE
  local name=$1 out=$WORK/$1 copy=$SCRATCH/device-$1 start end wall rc
  ship "$2" "$copy"
  say "$name: shipped $(find "$copy" -type f | wc -l) files, $(mib "$copy") MiB (.gpu $(mib "$copy/.gpu") MiB)"
  rm -rf /tmp/fedmeta-site /tmp/fedmeta-cache
  mkdir -p "$out"
  start=$(date +%s.%N)
  # On 2 CPU cores a unit's five stacked, vmapped seeds take over a minute for their first round: one seed a
  # process (the CPU's default) lets the units advance and checkpoint within the budget.
  (cd "$copy" && CUDA_VISIBLE_DEVICES= PY=$VPY OUT=$out CAMPAIGN_ARGS=${CAMPAIGN_ARGS-federation.vectorize=false} \
    timeout 200 scripts/gpu_job.sh "$SECONDS_GIVEN") \
    > "$WORK/job-$name.txt" 2>&1
  rc=$?
  end=$(date +%s.%N)
  wall=$(awk -v s="$start" -v e="$end" 'BEGIN { printf "%.1f", e - s }')
  say "$name: exit $rc after $wall s (given $SECONDS_GIVEN s; its output: $WORK/job-$name.txt)"
  [ "$rc" -eq 0 ] || { fail "$name exited $rc; its last lines:"; tail -n 15 "$WORK/job-$name.txt" | tee -a "$LOG"; }
  awk -v w="$wall" -v g="$SECONDS_GIVEN" 'BEGIN { exit !(w <= g + 15) }' || fail "$name ran $wall s, over $SECONDS_GIVEN + 15 s"
  say "$name: OUT holds"
  (cd "$out" && find . -type f -printf '  %p %s bytes\n' | sort) | tee -a "$LOG"
  if grep -q -- '--outputs' "$copy/scripts/gpu_job.sh"; then
    while read -r promised; do
      [ -n "$promised" ] || continue
      compgen -G "$out/$promised" > /dev/null || fail "$name: $promised promised by --outputs, not in OUT"
    done < <(cd "$copy" && scripts/gpu_job.sh --outputs)
  else
    say "$name: skipped the promised-files check: scripts/gpu_job.sh has no --outputs yet"
  fi
}

SCRATCH=$(mktemp -d /tmp/fedmeta-rehearse.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
DEV=$SCRATCH/developer  # the developer's tree, without its .git: the jobs' copies are shipped from it
ship "$ROOT" "$DEV"
[ "$JOB" -ef scripts/gpu_job.sh ] || cp "$JOB" "$DEV/scripts/gpu_job.sh"

run_job out1 "$DEV"

if grep -q -- '--collect' "$DEV/scripts/gpu_job.sh"; then
  touch "$SCRATCH/before-collect"
  # The developer collects with the project's own environment, not the image's.
  (cd "$DEV" && PY=$DEV_PY scripts/gpu_job.sh --collect "$WORK/out1") 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || fail "scripts/gpu_job.sh --collect exited $rc"
  # What collect wrote travels with the next job only where git does not ignore it (or CARRY names it).
  (cd "$DEV" && find . -type f -cnewer "$SCRATCH/before-collect" -not -path "*/__pycache__/*" | sed 's|^\./||' | sort) \
    > "$SCRATCH/collected"
  (cd "$DEV" && git --git-dir="$ROOT/.git" --work-tree=. check-ignore --stdin < "$SCRATCH/collected") > "$SCRATCH/ignored"
  say "collected: $(wc -l < "$SCRATCH/collected") files written or changed in the tree ($(wc -l < "$SCRATCH/ignored") ignored by git: they do not travel)"
  awk 'FILENAME == ARGV[1] { ignored[$0] = 1; next } { print "  " $0 (ignored[$0] ? "  (ignored by git)" : "") }' \
    "$SCRATCH/ignored" "$SCRATCH/collected" | head -n 20 | tee -a "$LOG"
  run_job out2 "$DEV"
  # "resumed"/"resuming", not fedmeta's advice "continue with output.resume=true" on a stop
  resumed=$(grep -rIiE -m1 "resum(ed|ing)" "$WORK/out2" | head -n 1)
  if [ -n "$resumed" ]; then say "out2 resumed: ${resumed#"$WORK"/}"; else fail "out2's output never says it resumed"; fi
else
  say "skipped the second job: scripts/gpu_job.sh has no --collect yet"
fi

[ "$FAILED" -eq 0 ] && say "rehearsal passed" || say "rehearsal FAILED (see above)"
exit "$FAILED"
