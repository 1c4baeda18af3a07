#!/usr/bin/env bash
# Proves `pip install .` (not editable) gives a working fedmeta from any folder: builds the wheel,
# installs it into a fresh venv whose other packages come from .venv (a .pth line: torch and the
# rest are not installed twice), and from an empty folder prints a config, trains two rounds on
# the committed MNIST file, checks where `fedmeta tune` would write, and trains docs/extending.md's
# method from a package of one's own named in a config file of the user's folder.
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
guide=$(pwd)/docs/extending.md
mkdir "$work/elsewhere" && cd "$work/elsewhere"
export FEDMETA_DATA=$data FEDMETA_CONFIG_HOME=$work/user-configs
fedmeta=$work/venv/bin/fedmeta
where=$("$work/venv/bin/python" -c "import fedmeta.config as c; print(c.CONFIG_DIR, c.user_config_dir())")
case "$where" in "$site/fedmeta/configs $work/user-configs") ;; *) echo "configs found at $where"; exit 1;; esac
"$fedmeta" train --print-config method=fedavg_ft variant=authors > "$work/config.txt"  # not piped: grep -q stops reading
grep -q "name: fedavg_ft" "$work/config.txt"
"$fedmeta" train dataset=rmnist method=cafeme federation.rounds=2 federation.num_clients=20 federation.num_new_clients=4 \
  federation.clients_per_round=4 personalization.steps=3 logger=[csv] output.root=runs > "$work/train.log"
grep -q "new-client accuracy" "$work/train.log"
test -f runs/rmnist-shards/cafeme/seed0/summary.json
echo "pip install . works: $(head -c 300 "$work/train.log" | tail -n 1)"

# docs/extending.md, installed: the method's class in one's own package, its config in the user's folder
mkdir -p "$work/mine/mypackage" "$FEDMETA_CONFIG_HOME/method"
touch "$work/mine/mypackage/__init__.py"
"$work/venv/bin/python" - "$guide" "$work/mine/mypackage/fedavgm.py" "$FEDMETA_CONFIG_HOME/method/fedavgm.yaml" <<'PY'
import re, sys
guide, code, config = sys.argv[1:]
blocks = dict(re.findall(r"```(?:python|yaml) (\S+)\n(.*?)```", open(guide).read(), re.S))
open(code, "w").write(blocks["fedmeta/algorithms/fedavgm.py"])
open(config, "w").write(blocks["configs/method/fedavgm.yaml"].replace("algorithm: fedavgm", "algorithm: mypackage.fedavgm:FedAvgM"))
PY
"$fedmeta" train --help > "$work/help.txt"
grep -q "fedavgm .*FedAvgM" "$work/help.txt"
PYTHONPATH=$work/mine "$fedmeta" train dataset=rmnist method=fedavgm federation.rounds=2 federation.clients_per_round=2 \
  method.local_epochs=1 logger=[csv] output.root=runs > "$work/fedavgm.log"
test -f runs/rmnist-shards/fedavgm/seed0/summary.json
echo "a method of one's own package, installed: $(tail -n 1 "$work/fedavgm.log")"
