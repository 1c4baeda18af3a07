#!/usr/bin/env bash
# Proves `pip install .` (not editable) gives a working fedmeta from any folder: builds the wheel,
# installs it into a fresh venv whose other packages come from .venv (a .pth line: torch and the
# rest are not installed twice), and from an empty folder prints a config, trains two rounds on
# the committed MNIST file and checks where `fedmeta tune` would write.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"  # the checkout's files (not what git ignores), built outside it: no build/ left behind
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$work/src"
"$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src" > "$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
"$VENV/bin/python" -m venv "$work/venv"
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/dependencies.pth"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$work"/dist/fedmeta-*.whl
data=$(pwd)/data
mkdir "$work/elsewhere" && cd "$work/elsewhere"
export WANDB_MODE=disabled FEDMETA_DATA=$data FEDMETA_CONFIG_HOME=$work/user-configs
fedmeta=$work/venv/bin/fedmeta
where=$("$work/venv/bin/python" -c "import fedmeta.config as c; print(c.CONFIG_DIR, c.USER_CONFIG_DIR)")
case "$where" in "$site/fedmeta/configs $work/user-configs") ;; *) echo "configs found at $where"; exit 1;; esac
"$fedmeta" train --print-config method=fedavg_ft variant=authors | grep -q "name: fedavg_ft"
"$fedmeta" train dataset=rmnist method=cafeme federation.rounds=2 federation.num_clients=20 federation.num_new_clients=4 \
  federation.clients_per_round=4 personalization.steps=3 logger=[csv] output.root=runs > "$work/train.log"
grep -q "new-client accuracy" "$work/train.log"
test -f runs/rmnist-shards/cafeme/seed0/summary.json
echo "pip install . works: $(head -c 300 "$work/train.log" | tail -n 1)"
