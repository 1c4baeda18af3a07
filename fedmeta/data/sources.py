"""Canonical on-disk sources: one ``<name>.npz`` per data set in the data directory.

Canonical form (see data/README.md): ``x`` uint8 (N,H,W) or (N,H,W,3), ``y`` int64, optional
``split`` uint8 (0 train, 1 test). A file that is missing is downloaded with torchvision and
converted; without a network the loader stops with one line naming the file and the folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from fedmeta.errors import FedmetaError

DATA_ENV = "FEDMETA_DATA"


def data_dir(configured: str | None = None) -> Path:
    """The data directory: the config value, else $FEDMETA_DATA, else ./data."""
    return Path(configured or os.environ.get(DATA_ENV) or "data").expanduser()


def _download_mnist(target: Path) -> None:
    """Fetch MNIST with torchvision and store it in the canonical form at ``target``."""
    from torchvision.datasets import MNIST

    with tempfile.TemporaryDirectory() as tmp:
        train = MNIST(tmp, train=True, download=True)
        test = MNIST(tmp, train=False, download=True)
        x = np.concatenate([train.data.numpy(), test.data.numpy()])
        y = np.concatenate([train.targets.numpy(), test.targets.numpy()]).astype(np.int64)
        split = np.concatenate([np.zeros(len(train), np.uint8), np.ones(len(test), np.uint8)])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_target = target.with_suffix(".partial.npz")
    np.savez_compressed(tmp_target, x=x, y=y, split=split)
    tmp_target.replace(target)


DOWNLOADERS = {"mnist": _download_mnist}


def load_npz(name: str, directory: Path, download: bool = True) -> dict[str, np.ndarray]:
    """Load ``<directory>/<name>.npz``, downloading it first when it is missing."""
    path = directory / f"{name}.npz"
    if not path.exists():
        if not download or name not in DOWNLOADERS:
            raise FedmetaError(f"{path} not found: put {name}.npz there or set {DATA_ENV} to the folder that holds it")
        try:
            DOWNLOADERS[name](path)
        except Exception as exc:  # any network or conversion failure ends in the same advice
            raise FedmetaError(
                f"{path} not found and downloading {name} failed ({type(exc).__name__}): "
                f"put {name}.npz there or set {DATA_ENV} to the folder that holds it"
            ) from None
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except Exception as exc:
        raise FedmetaError(f"{path} is not a readable .npz archive ({exc}): delete it and download again") from None
    missing = {"x", "y"} - arrays.keys()
    if missing:
        raise FedmetaError(f"{path} lacks the arrays {sorted(missing)}: it is not in fedmeta's canonical form (see data/README.md)")
    if arrays["x"].dtype != np.uint8 or len(arrays["x"]) != len(arrays["y"]):
        raise FedmetaError(f"{path} must hold uint8 images x and one label y per image: it is not in fedmeta's canonical form")
    return arrays
