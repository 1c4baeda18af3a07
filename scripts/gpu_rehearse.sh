#!/usr/bin/env bash
# A lease simulated on this machine's CPU, before it costs one: scripts/gpu_rehearse.sh (make gpu-rehearse).
#   1. .cache/rehearse-venv: Python 3.12 with the image's torch, torchvision, lightning and numpy
#      (configs/gpu_image.txt) and what they pull in, nothing else: what the job needs beyond them must
#      come from the kit (.gpu/, make gpu-kit), as on the card. Built once (a stamp holds the pins).
#   2. The tree as the device machine receives it (git ls-files -co --exclude-standard, plus .gpu/) in a
#      fresh folder, and there `CUDA_VISIBLE_DEVICES= PY=<venv python> OUT=outN scripts/gpu_job.sh SECONDS`
#      under `timeout -s KILL LIMIT`, as the device's per-command limit kills a command:
#        out1  killed with SIGKILL in the middle of its campaign (at KILL_AT s: 2/3 of SECONDS or, on a
#              loaded machine, later, once it has checkpointed);
#        out2  a whole job: it must exit 0 within SECONDS, its last archive the final one.
#   3. Collected out of order into a stand-in of the developer's tree: out2, then the older out1, out2
#      again, then a copy of out2 with a part cut short (refused, exit 2). After each: no kept run moved
#      back, every round a collected archive reported is kept, every kept checkpoint loads.
#   4. The collected tree shipped again: a third job (out3) continues the units under way ("resuming").
# The units run as on a card: vmapped, each unit's seeds stacked, PARALLEL at once and AHEAD more setting
# up beside them, waiting for a turn (defaults: configs/campaign.yaml's for a card, not for a CPU); on 2 cores that is slow, so CAMPAIGN_ARGS (default: 2 clients a round, 2 new clients, 2 steps each, a
# smaller CNN, a checkpoint every round) makes the rounds small, and a loaded machine only means fewer rounds: the deadline holds whatever the load.
# Each job's SECONDS (at least 150) comes from a round and a process start measured here first, under
# the machine's present load, so that each job trains at least 2 rounds and job 1 checkpoints before
# its kill; a machine too loaded for a job within a lease's limit is said in one line.
# Environment: SECONDS_GIVEN (default: so measured), KILL_AT, PARALLEL, AHEAD, CAMPAIGN_ARGS, JOB (a stand-in for
# scripts/gpu_job.sh, copied into the copies in its place), CARRY (default .gpu), PY312. The log: stdout
# and .cache/rehearse/rehearsal.log. Exits 1 if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOB=${JOB:-scripts/gpu_job.sh}
SMALL="federation.clients_per_round=2 federation.num_new_clients=2 personalization.steps=2 model.conv_channels=[8,16] model.dense_units=[32] federation.checkpoint_every=1"
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
rm -rf "$WORK"/out[0-9]* "$WORK"/job*.txt
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
CARD=$("$DEV_PY" -c "import yaml; c = yaml.safe_load(open('configs/campaign.yaml'))
print(c['parallel']['cuda'], (c.get('start_ahead') or {}).get('cuda', 0))")
PARALLEL=${PARALLEL:-${CARD% *}}
AHEAD=${AHEAD:-${CARD#* }}
say "as on a card: $PARALLEL unit(s) at once, $AHEAD setting up ahead"
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

# A job as the device runs it: in a fresh copy, on a fresh machine, killed at LIMIT as the device kills.
run_job() {  # run_job NAME TREE LIMIT
  local name=$1 out=$WORK/$1 copy=$SCRATCH/device-$1 start end wall rc
  ship "$2" "$copy"
  say "$name: shipped $(find "$copy" -type f | wc -l) files, $(mib "$copy") MiB (.gpu $(mib "$copy/.gpu") MiB); killed at $3 s"
  rm -rf /tmp/fedmeta-site /tmp/fedmeta-cache
  mkdir -p "$out"
  start=$(date +%s.%N)
  (cd "$copy" && CUDA_VISIBLE_DEVICES= PY=$VPY OUT=$out CAMPAIGN_ARGS=${CAMPAIGN_ARGS-$SMALL} PARALLEL=$PARALLEL AHEAD=$AHEAD \
    timeout -s KILL "$3" scripts/gpu_job.sh "$SECONDS_GIVEN") > "$WORK/job-$name.txt" 2>&1
  rc=$?
  # As the device ends a command: everything it started goes with it (the campaign's own timeout
  # puts it in a process group of its own, which the kill above does not reach).
  for proc in /proc/[0-9]*; do
    [[ "$(readlink "$proc/cwd" 2>/dev/null)" == "$copy"* ]] && kill -KILL "${proc#/proc/}" 2>/dev/null
  done
  end=$(date +%s.%N)
  wall=$(awk -v s="$start" -v e="$end" 'BEGIN { printf "%.1f", e - s }')
  say "$name: exit $rc after $wall s (given $SECONDS_GIVEN s; its output: $WORK/job-$name.txt)"
  say "$name: $(grep -E 'done:|ended before|packed nothing|skipped|not carried' "$out/job.log" | tail -n 3 | tr '\n' ' ')"
  (cd "$out" && find . -type f -printf '  %p %s bytes\n' | sort) | tee -a "$LOG"
  [ "$(find "$out" -type f | wc -l)" -le 8 ] || fail "$name: more than the 8 files a lease brings back"
}

# The kept runs' state in the developer's tree: folder round, a line each; fails on a checkpoint that does not load.
kept_state() {
  (cd "$DEV" && "$DEV_PY" - <<'PY'
from pathlib import Path
import torch
from fedmeta import campaign
plan = campaign.load()
kept = Path("results/runs") / plan.preset
for path in sorted(kept.glob("*/*/seed*/checkpoint.ckpt")):
    torch.load(path, map_location="cpu", weights_only=True)  # whole, or this raises
for unit in campaign.units(plan, kept):
    for folder, done in zip(unit.folders(kept), unit.rounds_done(kept)):
        if done:
            print(folder.relative_to(kept), done)
PY
  )
}

# collect_check NAME: collect outNAME into the developer's tree, then the checks of step 3.
collect_check() {
  local before after reported
  before=$(kept_state) || fail "a kept checkpoint does not load before collecting $1"
  (cd "$DEV" && PY=$DEV_PY scripts/gpu_job.sh --collect "$WORK/$1") >> "$LOG" 2>&1
  local rc=$?
  after=$(kept_state) || fail "a kept checkpoint does not load after collecting $1"
  reported=$("$DEV_PY" -c "import json, sys
m = json.load(open(sys.argv[1]))
for f, r in m['runs'].items(): print(f, 'finished' if r == 'finished' else r)" "$WORK/$1/lease.json" 2>/dev/null)
  say "collect $1: exit $rc; kept: $(echo "$after" | grep -c .) runs begun"
  awk -v who="$1" 'FILENAME == ARGV[1] { b[$1] = $2; next } ($1 in b) && $2 < b[$1] { print "FAILED: collecting " who " moved " $1 " back from " b[$1] " to " $2; bad = 1 } END { exit bad }' \
    <(echo "$before") <(echo "$after") | tee -a "$LOG" || FAILED=1
  echo "$reported" | while read -r folder round; do
    [ -n "$folder" ] || continue
    got=$(echo "$after" | awk -v f="$folder" '$1 == f { print $2 }')
    if [ "$round" = finished ]; then
      [ -f "$DEV/results/runs/paper/$folder/summary.json" ] || echo "FAILED: $folder finished in $1, not kept"
    elif [ "${got:-0}" -lt "$round" ]; then
      echo "FAILED: $folder at round $round in $1, kept at ${got:-0}"
    fi
  done | tee -a "$LOG" | grep -q FAILED && FAILED=1
  return $rc
}

SCRATCH=$(mktemp -d /tmp/fedmeta-rehearse.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
DEV=$SCRATCH/developer  # the developer's tree, without its .git: the jobs' copies are shipped from it
ship "$ROOT" "$DEV"
[ "$JOB" -ef scripts/gpu_job.sh ] || cp "$JOB" "$DEV/scripts/gpu_job.sh"
# The small rounds are the rehearsal campaign's own settings: collect takes a run only if it is of the
# campaign's settings for its folder, whatever the job says it ran with.
# shellcheck disable=SC2086  # the overrides are words
"$DEV_PY" - "$DEV/configs/campaign.yaml" ${CAMPAIGN_ARGS-$SMALL} <<'PY'
import sys, yaml
path, extra = sys.argv[1], sys.argv[2:]
plan = yaml.safe_load(open(path))
plan["overrides"] += extra
open(path, "w").write(yaml.safe_dump(plan, sort_keys=False, allow_unicode=True))
PY

# The jobs sized from a round measured now, under whatever load the machine has: the unit job 1 runs
# first, set up and timed alone on one thread, as a job's runs are (fedmeta campaign --profile). A
# job must start (the wheels, the campaign's import, the unit's process: about three process
# starts), make its recording (the first round), train at least 2 more rounds (at the stop's
# margin, 1.5 rounds each) and keep its reserve; job 1, killed at 2/3 of its time or
# later, must have checkpointed first (a checkpoint every round). Unless SECONDS_GIVEN is set.
if [ -z "${SECONDS_GIVEN:-}" ]; then
  # shellcheck disable=SC2086  # the overrides are words
  measured=$(cd "$DEV" && OMP_NUM_THREADS=1 timeout 150 "$DEV_PY" -m fedmeta.cli campaign --profile 120 \
    ${CAMPAIGN_ARGS-$SMALL} 2>/dev/null | sed -n '/^measured alone: /{s///;p;q}')  # the profile ends at its next line (a broken pipe)
  read -r START FIRST ROUND < <("$DEV_PY" -c "import json, sys
m = json.loads(sys.argv[1] or '{}')
print(m.get('start_seconds', 0), m.get('first_round_seconds', 0), round(m.get('seconds_per_seed_round', 0) * m.get('seeds', 1), 3))" "$measured" 2>/dev/null)
  if [ -z "${ROUND:-}" ] || [ "$ROUND" = 0 ]; then
    say "the rehearsal could not time a round here within 150 s (fedmeta campaign --profile 120 in $DEV): the machine is too loaded to rehearse a lease; try again when it is quieter, or set SECONDS_GIVEN"
    exit 1
  fi
  read -r SECONDS_GIVEN KILL_AT < <(awk -v s="$START" -v f="$FIRST" -v r="$ROUND" 'BEGIN {
    job = 1.3 * (3 * s + f + 2 * 1.5 * r + 30); kill = 1.3 * (3 * s + f + r)
    if (job < kill / 0.85) job = kill / 0.85
    if (job < 150) job = 150
    if (kill < job * 2 / 3) kill = job * 2 / 3
    printf "%d %d\n", job + 0.999, kill }')
  say "measured here, now (load $(cut -d' ' -f1 /proc/loadavg)): a process sets up in $START s, its first round takes $FIRST s and the next $ROUND s: jobs of $SECONDS_GIVEN s, the first killed at $KILL_AT s"
  LIMIT=$(( ${COMMAND_LIMIT:-600} - 10 ))
  if [ "$SECONDS_GIVEN" -gt "$LIMIT" ]; then
    say "a job here would need $SECONDS_GIVEN s to train 2 rounds, past a lease's $LIMIT s: the machine is too loaded to rehearse one; try again when it is quieter"
    exit 1
  fi
fi
KILL_AT=${KILL_AT:-$(( SECONDS_GIVEN * 2 / 3 ))}

RECORDS_BEFORE=$(grep -c . "$DEV/results/runs/paper/jobs.jsonl" 2>/dev/null || true)
run_job out1 "$DEV" "$KILL_AT"
[ -f "$WORK/out1/lease.json" ] || fail "out1 was killed at $KILL_AT s with no archive in OUT"
run_job out2 "$DEV" $(( SECONDS_GIVEN + 20 ))
grep -q "done:" "$WORK/out2/job.log" || fail "out2 did not end with its final archive"

collect_check out2 || fail "collecting out2 failed"
collect_check out1 || fail "collecting the older out1 after out2 failed"
collect_check out2 || fail "collecting out2 a second time failed"
records=$(grep -c . "$DEV/results/runs/paper/jobs.jsonl")
cp -r "$WORK/out2" "$WORK/out2-cut"
part=$WORK/out2-cut/$("$DEV_PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['parts'][0]['name'])" "$WORK/out2/lease.json")
head -c $(( $(stat -c %s "$part") / 2 )) "$part" > "$part.cut" && mv "$part.cut" "$part"
if collect_check out2-cut; then fail "a truncated archive was collected"; else say "out2-cut refused, as it should be"; fi
[ "$(grep -c . "$DEV/results/runs/paper/jobs.jsonl")" -eq "$records" ] || fail "the refused archive changed jobs.jsonl"
[ "$records" -eq "$(( RECORDS_BEFORE + 2 ))" ] || fail "jobs.jsonl gained $(( records - RECORDS_BEFORE )) records from 2 jobs collected 4 times"

run_job out3 "$DEV" $(( SECONDS_GIVEN + 20 ))
resumed=$(grep -m1 -iE "resum(ed|ing)" "$WORK/out3/job.log")
if [ -n "$resumed" ]; then say "out3 resumed: $resumed"; else fail "out3's output never says it resumed"; fi

[ "$FAILED" -eq 0 ] && say "rehearsal passed" || say "rehearsal FAILED (see above)"
exit "$FAILED"
