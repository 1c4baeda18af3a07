"""Canonical on-disk sources: one ``<name>.npz`` per data set in the data directory.

Canonical form (docs/data.md): ``x`` uint8 (N,H,W) or (N,H,W,3), ``y`` int64, optional
``split`` uint8 (0 train, 1 test, 2 validation: a data set that uses only the training split
leaves validation images out as it does test ones; Meta-Dataset pools every split). A file that
is missing is downloaded from its publisher and converted (``download.py``); without a network the
loader stops with one line naming the file and the folder. Any ImageFolder tree or canonical file
a user points to is a source too.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedmeta.data import convert
from fedmeta.data.download import download as fetch
from fedmeta.data.download import known, save_canonical
from fedmeta.errors import FedmetaError

DATA_ENV, CACHE_ENV = "FEDMETA_DATA", "FEDMETA_CACHE"


def data_dir(configured: str | None = None) -> Path:
    """The data directory: the config value, else $FEDMETA_DATA, else ./data."""
    return Path(configured or os.environ.get(DATA_ENV) or "data").expanduser()


def cache_dir() -> Path:
    """Where converted files go ($FEDMETA_CACHE, else ./.cache): never beside the source files,
    which may be read-only."""
    return Path(os.environ.get(CACHE_ENV) or ".cache").expanduser()


RAW_FILES = {"cifar10": "cifar10-jpeg.tar.gz"}  # ImageFolder archives decoded once into the cache


def _find_or_convert(name: str, directory: Path) -> Path:
    """The canonical file: in the data directory, else in the cache, else converted into the cache
    from a raw file of the data directory; the data directory's own path if none of these."""
    for path in (directory / f"{name}.npz", cache_dir() / f"{name}.npz"):
        if path.exists():
            return path
    if name in RAW_FILES and (directory / RAW_FILES[name]).exists():
        return _converted_tree(directory / RAW_FILES[name], cache_dir() / f"{name}.npz")
    return directory / f"{name}.npz"


def _converted_tree(tree: Path, target: Path, **options) -> Path:
    """An ImageFolder tree (folder, zip or tar) decoded once into the canonical file ``target``,
    checked first: a tree that is no data set leaves no cache file behind."""
    if not target.exists():
        try:
            arrays = convert.image_tree(tree, **options)
        except (OSError, tarfile.TarError, zipfile.BadZipFile, ValueError) as exc:
            raise FedmetaError(f"{tree} could not be read as an ImageFolder tree ({exc})") from None
        save_canonical(target, **check_canonical(arrays, tree))
    return target


def _fingerprint(path: Path) -> str:
    """What the decoded copy of a tree depends on: every image's relative path, size and
    modification time (a folder's own time does not change when a file inside it is edited)."""
    if path.is_dir():
        try:
            files = convert.folder_images(path)
        except (OSError, ValueError) as exc:
            raise FedmetaError(f"{path} is not an ImageFolder folder: {exc}") from None
    else:
        files = [path]
    return "|".join(
        f"{p.relative_to(path) if path.is_dir() else p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
        for p in files
    )


def load_source(
    entry: str,
    directory: Path,
    download: bool = True,
    size: int | None = None,
    channels: int = 3,
    before_decoding: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """A data set named in a config: a path to a canonical ``.npz`` or to an ImageFolder tree
    (folder, zip or tar; decoded once into the cache, as ``channels``-channel images, resized to
    ``size`` if given), else the name of a canonical file (see ``load_npz``). ``before_decoding``
    is given the number of images of a folder or zip that is about to be decoded (it may refuse)."""
    path = Path(entry).expanduser()
    if not path.exists() and (directory / path).exists():
        path = directory / path
    if not path.exists():
        if path.suffix or "/" in entry:
            raise FedmetaError(
                f"{entry} not found: give the path of a canonical .npz, an ImageFolder folder or archive, "
                f"or the name of a file in {directory}"
            )
        return load_npz(entry, directory, download)
    if not (path.is_file() or path.is_dir()):  # a device or a pipe (/dev/zero) would be read without end
        raise FedmetaError(
            f"{path} is neither a regular file nor a folder: give a canonical .npz or an ImageFolder tree"
        )
    if path.suffix == ".npz":
        return read_canonical(path)
    key = hashlib.sha1(f"{path.resolve()}|{_fingerprint(path)}|{size}|{channels}".encode()).hexdigest()[:12]
    target = cache_dir() / "trees" / f"{path.stem}-{key}.npz"
    if before_decoding and not target.exists() and (count := convert.tree_image_count(path)):
        before_decoding(count)
    return read_canonical(_converted_tree(path, target, size=size, mode="L" if channels == 1 else "RGB"))


def is_available(entry: str, directory: Path) -> bool:
    """Whether ``load_source`` would find ``entry`` without downloading."""
    path = Path(entry).expanduser()
    return path.exists() or (directory / path).exists() or _find_or_convert(entry, directory).exists()


CANONICAL = {  # a built-in data set → its file
    "rmnist": "mnist",
    "cifar10": "cifar10",
    "femnist": "femnist",
    "cifar100": "cifar100",
    "fmnist": "fmnist",
    "emnist": "emnist",
    "svhn": "svhn",
    "usps": "usps",
    "tiny_imagenet": "tiny_imagenet",
    "mini_imagenet": "mini_imagenet32",  # the Meta-Dataset source's file, all 100 classes
}


def missing_files(dataset) -> str | None:
    """Why the data set of a config (its ``dataset`` block) cannot be read here without a download
    (a short job on a machine with no network must not start one), or None."""
    directory = data_dir(dataset.dir)
    if dataset.name == "meta_dataset":
        names = list(dataset.options.sources)
    elif dataset.name in CANONICAL:
        names = [CANONICAL[dataset.name]]
    else:  # a user's own tree or file: its loader says what is wrong
        return None

    def found(name: str) -> bool:  # as _find_or_convert looks, without converting anything
        raw = RAW_FILES.get(name)
        return (
            any(p.exists() for p in (directory / f"{name}.npz", cache_dir() / f"{name}.npz"))
            or bool(raw and (directory / raw).exists())
            or Path(name).expanduser().exists()
        )

    absent = [name for name in names if not found(name)]
    if not absent:
        return None
    return f"{', '.join(f'{n}.npz' for n in absent[:3])}{' …' if len(absent) > 3 else ''} not in {directory}"


def load_npz(name: str, directory: Path, download: bool = True) -> dict[str, np.ndarray]:
    """Load the canonical ``<name>.npz`` (see ``_find_or_convert``), downloading it when missing."""
    path = _find_or_convert(name, directory)
    if not path.exists():
        if not download or name not in known():
            raise FedmetaError(
                f"{path} not found: put {name}.npz there, set {DATA_ENV} to the folder that holds it"
                + (f", or run `fedmeta data download {name}`" if name in known() else "")
            )
        try:
            fetch(name, directory)
        except FedmetaError as exc:
            raise FedmetaError(
                f"{path} not found, and {exc}; or put {name}.npz there / set {DATA_ENV}"
            ) from None
    return read_canonical(path)


def read_canonical(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a canonical ``.npz``, checked (``check_canonical``)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except Exception as exc:
        raise FedmetaError(
            f"{path} is not a readable .npz archive ({exc}): delete it and download again"
        ) from None
    return check_canonical(arrays, path)


SPLITS = {0: "train", 1: "test", 2: "validation"}


def check_canonical(arrays: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """``arrays`` if they are in the canonical form every data set needs; else one line naming
    ``path``, the file or tree they come from."""
    missing = {"x", "y"} - arrays.keys()
    if missing:
        raise FedmetaError(
            f"{path} lacks the arrays {sorted(missing)}: it is not in fedmeta's canonical form (docs/data.md)"
        )
    x, y = arrays["x"], arrays["y"]
    if x.dtype != np.uint8 or len(x) != len(y):
        raise FedmetaError(
            f"{path} must hold uint8 images x and one label y per image: it is not in fedmeta's canonical form"
        )
    if not (x.ndim == 3 or (x.ndim == 4 and x.shape[-1] in (1, 3))) or min(x.shape[1:3], default=0) < 1:
        raise FedmetaError(f"{path}: images x must be N×H×W (grey) or N×H×W×3 (colour), got shape {x.shape}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise FedmetaError(
            f"{path}: labels y must be one integer per image, got {y.dtype} of shape {y.shape}"
        )
    if len(y) and y.min() < 0:
        raise FedmetaError(f"{path}: labels y must be ≥ 0, found {int(y.min())}")
    if "classes" in arrays and len(y) and y.max() >= len(arrays["classes"]):
        raise FedmetaError(
            f"{path}: label {int(y.max())} has no entry in its {len(arrays['classes'])} classes"
        )
    if (
        "classes" not in arrays and len(y) and y.max() >= len(np.unique(y))
    ):  # the labels name the model's outputs
        raise FedmetaError(
            f"{path}: labels must be 0…K−1 for K classes (or list the names in a `classes` array); "
            f"found {len(np.unique(y))} distinct labels up to {int(y.max())}"
        )
    if "split" in arrays and (
        arrays["split"].shape != y.shape or not np.issubdtype(arrays["split"].dtype, np.integer)
    ):
        raise FedmetaError(
            f"{path}: split must hold one integer per image (0 train, 1 test, 2 validation), "
            f"got {arrays['split'].dtype} of shape {arrays['split'].shape}"
        )
    if "split" in arrays and (unknown := sorted(set(np.unique(arrays["split"]).tolist()) - SPLITS.keys())):
        raise FedmetaError(
            f"{path}: split values must be 0 (train), 1 (test) or 2 (validation), found {unknown}: "
            "an image of another value would belong to no split"
        )
    if len(classes := np.unique(y)) < 2:
        names = f" ({', '.join(map(str, arrays['classes'][classes]))})" if "classes" in arrays else ""
        raise FedmetaError(
            f"{path}: a classification data set needs at least 2 classes, found {len(classes)}{names}: "
            "give it images of two classes or more"
        )
    return arrays
