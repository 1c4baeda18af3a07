"""Canonical on-disk sources: one ``<name>.npz`` per data set in the data directory.

Canonical form (see data/README.md): ``x`` uint8 (N,H,W) or (N,H,W,3), ``y`` int64, optional
``split`` uint8 (0 train, 1 test). A file that is missing is downloaded with torchvision and
converted; without a network the loader stops with one line naming the file and the folder.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from fedmeta.errors import FedmetaError

DATA_ENV, CACHE_ENV = "FEDMETA_DATA", "FEDMETA_CACHE"


def data_dir(configured: str | None = None) -> Path:
    """The data directory: the config value, else $FEDMETA_DATA, else ./data."""
    return Path(configured or os.environ.get(DATA_ENV) or "data").expanduser()


def cache_dir() -> Path:
    """Where converted files go ($FEDMETA_CACHE, else ./.cache): never beside the source files,
    which may be read-only."""
    return Path(os.environ.get(CACHE_ENV) or ".cache").expanduser()


def _save_canonical(target: Path, **arrays: np.ndarray) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial.npz")
    np.savez(partial, **arrays)
    partial.replace(target)


def _download_mnist(target: Path) -> None:
    """Fetch MNIST with torchvision and store it in the canonical form at ``target``."""
    from torchvision.datasets import MNIST

    with tempfile.TemporaryDirectory() as tmp:
        train = MNIST(tmp, train=True, download=True)
        test = MNIST(tmp, train=False, download=True)
        x = np.concatenate([train.data.numpy(), test.data.numpy()])
        y = np.concatenate([train.targets.numpy(), test.targets.numpy()]).astype(np.int64)
        split = np.concatenate([np.zeros(len(train), np.uint8), np.ones(len(test), np.uint8)])
    _save_canonical(target, x=x, y=y, split=split)


def _download_cifar10(target: Path) -> None:
    """Fetch CIFAR-10 with torchvision and store it in the canonical form at ``target``."""
    from torchvision.datasets import CIFAR10

    with tempfile.TemporaryDirectory() as tmp:
        train, test = CIFAR10(tmp, train=True, download=True), CIFAR10(tmp, train=False, download=True)
        x = np.concatenate([train.data, test.data])
        y = np.array(train.targets + test.targets, dtype=np.int64)
        split = np.concatenate([np.zeros(len(train), np.uint8), np.ones(len(test), np.uint8)])
    _save_canonical(target, x=x, y=y, split=split, classes=np.array(train.classes))


def _decode_image_folder_tar(archive: Path, target: Path) -> None:
    """An ImageFolder tree in a tar archive (``<split>/<class>/<image>``, split train or test) →
    the canonical form, decoded once."""
    from PIL import Image

    images, class_names, splits = [], [], []
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 3 or parts[-3] not in ("train", "test"):
                continue
            with Image.open(tar.extractfile(member)) as image:
                images.append(np.asarray(image.convert("RGB")))
            class_names.append(parts[-2])
            splits.append(parts[-3] == "test")
    classes = sorted(set(class_names))
    index = {name: i for i, name in enumerate(classes)}
    _save_canonical(target, x=np.stack(images), y=np.array([index[c] for c in class_names], np.int64),
                    split=np.array(splits, np.uint8), classes=np.array(classes))


DOWNLOADERS = {"mnist": _download_mnist, "cifar10": _download_cifar10}
RAW_FILES = {"cifar10": ("cifar10-jpeg.tar.gz", _decode_image_folder_tar)}


def _find_or_convert(name: str, directory: Path) -> Path:
    """The canonical file: in the data directory, else in the cache, else converted into the cache
    from a raw file of the data directory; the data directory's own path if none of these."""
    for path in (directory / f"{name}.npz", cache_dir() / f"{name}.npz"):
        if path.exists():
            return path
    if name in RAW_FILES and (directory / RAW_FILES[name][0]).exists():
        raw_name, convert = RAW_FILES[name]
        target = cache_dir() / f"{name}.npz"
        try:
            convert(directory / raw_name, target)
        except (OSError, tarfile.TarError, ValueError) as exc:
            raise FedmetaError(f"{directory / raw_name} could not be read ({exc}): download it again") from None
        return target
    return directory / f"{name}.npz"


def load_npz(name: str, directory: Path, download: bool = True) -> dict[str, np.ndarray]:
    """Load the canonical ``<name>.npz`` (see ``_find_or_convert``), downloading it when missing."""
    path = _find_or_convert(name, directory)
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
