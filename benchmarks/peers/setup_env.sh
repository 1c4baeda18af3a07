#!/usr/bin/env bash
# Make the private virtual environment of one peer library for benchmarks/peers/run.py.
#
#   bash benchmarks/peers/setup_env.sh pfllib  /path/to/PFLlib
#   bash benchmarks/peers/setup_env.sh flbench /path/to/FL-bench
#
# The venv goes to benchmarks/peers/.venvs/<peer> (gitignored). It gets the same torch build as
# fedmeta's own venv (torch==2.14.1, torchvision==0.29.1, installed by pip from this machine's
# configured local index and constraint) plus only the packages that the peer's code imports on the
# path the benchmark runs (its main script, the FedAvg and FedRep servers/clients and what they
# import at module level). Nothing enters /work/main/.venv. Uses pip, not uv. The install runs
# under nice/ionice so that it disturbs other work on the machine as little as possible.
#
# What each peer imports (read from its source, see README.md):
#   pfllib : system/main.py imports every server module, so besides torch/numpy:
#            scikit-learn (clientbase), h5py (serverbase, result_utils), matplotlib (utils/dlg.py),
#            cvxpy (serverpac.py), calmsize (utils/mem_utils.py). numpy<2 as its env_cuda_latest.yaml says.
#   flbench: main.py + src/server/fedavg.py import hydra-core/omegaconf, ray (module level, also in
#            serial mode), rich, pandas (data/utils/datasets.py), pynvml (src/utils/functional.py),
#            scikit-learn (src/utils/metrics.py), Pillow. Versions are pinned to the checkout's own
#            .env/requirements.txt where it names them. Not installed: faiss, visdom, tensorboard,
#            statsmodels, pytorch-minimize, flwr-datasets, cvxpy, matplotlib (only imported by
#            methods/options this benchmark does not use; the driver switches off the learning-curve plot).
set -euo pipefail

PEER=${1:?usage: setup_env.sh pfllib|flbench CHECKOUT}
CHECKOUT=${2:?usage: setup_env.sh pfllib|flbench CHECKOUT}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV="$HERE/.venvs/$PEER"
PY=${PYTHON:-python3.11}

case "$PEER" in
  pfllib)
    [ -f "$CHECKOUT/system/main.py" ] || { echo "not a PFLlib checkout: $CHECKOUT (no system/main.py)" >&2; exit 2; }
    EXTRA=("numpy<2" scikit-learn h5py matplotlib cvxpy calmsize)
    ;;
  flbench)
    [ -f "$CHECKOUT/main.py" ] && [ -d "$CHECKOUT/src/server" ] || { echo "not an FL-bench checkout: $CHECKOUT" >&2; exit 2; }
    REQ="$CHECKOUT/.env/requirements.txt"
    EXTRA=()
    for pkg in hydra-core rich ray pandas pynvml scikit-learn PyYAML Pillow; do
      pin=""
      if [ -f "$REQ" ]; then
        # "ray[default]==2.49.2" -> "ray==2.49.2": the extras are for the dashboard/cluster, not used here
        pin=$(grep -i -E "^${pkg}(\[[^]]*\])?==" "$REQ" | head -1 | sed -E 's/\[[^]]*\]//' || true)
      fi
      EXTRA+=("${pin:-$pkg}")
    done
    ;;
  *) echo "unknown peer: $PEER (pfllib|flbench)" >&2; exit 2 ;;
esac

NICE=(nice -n 19)
command -v ionice >/dev/null && NICE+=(ionice -c 3)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# (pip's configured local indexes warn about every package they lack: those lines are dropped)
quiet() { "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
quiet "${NICE[@]}" "$VENV/bin/python" -m pip install --disable-pip-version-check -q "torch==2.14.1" "torchvision==0.29.1"
quiet "${NICE[@]}" "$VENV/bin/python" -m pip install --disable-pip-version-check -q "${EXTRA[@]}"
"$VENV/bin/python" -m pip freeze --disable-pip-version-check > "$VENV/freeze.txt"
"$VENV/bin/python" -c "import torch, torchvision, numpy; print('$PEER venv:', 'torch', torch.__version__, 'torchvision', torchvision.__version__, 'numpy', numpy.__version__)"
echo "installed: ${EXTRA[*]}"
