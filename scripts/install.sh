#!/usr/bin/env bash
# Creates .venv with every dependency. learn2learn 0.2.0 ships no wheel for Python 3.11 and its
# pre-generated C files do not compile there, so it is rebuilt from its .pyx sources with Cython 3.
set -euo pipefail
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
L2L_VERSION=0.2.0

say() { echo "[install +$SECONDS s] $*"; }  # a line per step: the quiet pip steps take minutes
say "creating $VENV"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
say "torch 2.14.1 and torchvision 0.29.1"
$PIP install -q "torch==2.14.1" "torchvision==0.29.1"
$PIP install -q "cython>=3.0" numpy

if ! "$VENV/bin/python" -c "import learn2learn" 2>/dev/null; then
  say "learn2learn $L2L_VERSION, built from its sources with Cython 3"
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  # its sdist only: --no-binary=:all: would also build its build requirements (Cython) from source, minutes
  $PIP download -q --no-deps --no-build-isolation --no-binary=learn2learn "learn2learn==$L2L_VERSION" -d "$build"
  tar xzf "$build"/learn2learn-$L2L_VERSION.tar.gz -C "$build"
  src="$build/learn2learn-$L2L_VERSION"
  for pyx in "$src"/learn2learn/data/*.pyx; do "$VENV/bin/cython" -3 "$pyx"; done
  $PIP install -q --no-build-isolation "$src"
fi

# EXTRAS=flower: the Flower adapter too. setuptools' editable install prints an informational
# "be careful with folders named like your package" box; fedmeta/ is that package: hidden.
say "fedmeta and its other dependencies${EXTRAS:+ (extras: $EXTRAS)}"
"$VENV/bin/python" -W "ignore:Editable installation" -m pip install -q -e ".[dev${EXTRAS:+,$EXTRAS}]"
say "environment ready in $VENV"
