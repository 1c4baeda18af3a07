"""Upstream file formats → fedmeta's canonical arrays (x uint8, y int64, split uint8, classes, …).

Each function reads files exactly as their publishers ship them (MNIST's, Fashion-MNIST's and
EMNIST's idx files, CIFAR's pickled batches, SVHN's MATLAB files, USPS's LIBSVM text, the
Tiny-ImageNet zip, TensorFlow Federated's EMNIST HDF5, ImageFolder trees in folders, zip or tar
archives) and returns the arrays to save; a file in another format raises ``ValueError`` naming it.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import os
import pickle
import tarfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np

from fedmeta.errors import FedmetaError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".ppm", ".bmp", ".gif", ".tif", ".tiff"}
VALID_FOLDERS = ("valid", "val", "validation")  # the validation split's folders (split 2)
SPLIT_FOLDERS = {"train", "test", *VALID_FOLDERS}
LAYOUT = "a folder data set is <class>/<image> or train|test|valid/<class>/<image>, directly under its path"


def mnist_idx(
    train_images: Path,
    train_labels: Path,
    test_images: Path,
    test_labels: Path,
    classes: list[str] | None = None,
) -> dict[str, np.ndarray]:
    """MNIST's four gzipped idx files (train images/labels, t10k images/labels); Fashion-MNIST
    ships the same four, and names its ``classes``."""
    train_x, test_x = (_idx(p.name, p.read_bytes(), dims=3) for p in (train_images, test_images))
    train_y, test_y = (_idx(p.name, p.read_bytes(), dims=1) for p in (train_labels, test_labels))
    return _idx_splits(train_x, train_y, test_x, test_y, classes)


def _idx_splits(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    classes: list[str] | None = None,
) -> dict[str, np.ndarray]:
    """Training and test images and labels of idx files as one canonical set (split 0, then 1)."""
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise ValueError("the image and label idx files hold different numbers of items")
    arrays = {
        "x": np.concatenate([train_x, test_x]),
        "y": np.concatenate([train_y, test_y]).astype(np.int64),
        "split": np.repeat(np.array([0, 1], np.uint8), [len(train_y), len(test_y)]),
    }
    return arrays | ({"classes": np.array(classes)} if classes else {})


def _idx(name: str, raw: bytes, dims: int) -> np.ndarray:
    """An idx file of unsigned bytes (gunzipped first if its name ends in .gz): magic 0x0000 08
    <dims>, then <dims> big-endian sizes, then data."""
    if name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ValueError(f"{name} is not a gzip file ({exc})") from None
    if raw[:4] != bytes([0, 0, 8, dims]):
        raise ValueError(f"{name} is not an idx file of {dims}-dimensional unsigned bytes")
    shape = [int.from_bytes(raw[4 + 4 * d : 8 + 4 * d], "big") for d in range(dims)]
    if len(raw) != 4 + 4 * dims + int(np.prod(shape)):
        raise ValueError(
            f"{name} holds {len(raw) - 4 - 4 * dims} bytes of data, not the {shape} its header says"
        )
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


EMNIST_CLASSES = [*"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"]  # byclass's 62


def emnist_zip(archive: Path, split: str = "byclass") -> dict[str, np.ndarray]:
    """EMNIST's ``gzip.zip`` (NIST): ``gzip/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz``.
    Its images are stored transposed (column by column); they are transposed back here, so that
    characters stand upright as MNIST's do (torchvision's EMNIST class leaves them transposed)."""
    wanted = {
        f"emnist-{split}-{part}-{kind}-ubyte.gz": (part, kind)
        for part in ("train", "test")
        for kind in ("images-idx3", "labels-idx1")
    }
    read = {}
    with zipfile.ZipFile(archive) as z:
        for name in z.namelist():
            if (key := wanted.get(PurePosixPath(name).name)) is not None:
                read[key] = _idx(name, z.read(name), dims=3 if key[1] == "images-idx3" else 1)
    if missing := sorted(n for n, key in wanted.items() if key not in read):
        raise ValueError(f"{archive.name} lacks {', '.join(missing)}")
    train_x, test_x = (read[part, "images-idx3"].transpose(0, 2, 1) for part in ("train", "test"))
    classes = EMNIST_CLASSES if split == "byclass" else None
    return _idx_splits(train_x, read["train", "labels-idx1"], test_x, read["test", "labels-idx1"], classes)


def svhn_mats(train: Path, test: Path) -> dict[str, np.ndarray]:
    """SVHN's cropped digits, ``train_32x32.mat`` and ``test_32x32.mat`` (MATLAB 5): ``X`` 32×32×3×N
    uint8 and ``y`` N×1 in 1…10, where 10 is the digit 0 — stored here as label 0."""
    try:
        from scipy.io import loadmat
        from scipy.io.matlab import MatReadError
    except ImportError:
        raise FedmetaError("reading SVHN's .mat files needs scipy: pip install scipy") from None
    xs, ys = [], []
    for path in (train, test):
        try:
            mat = loadmat(path)
        except MatReadError as exc:
            raise ValueError(f"{path.name} is not a MATLAB file scipy can read ({exc})") from None
        if "X" not in mat or "y" not in mat or mat["X"].shape[:3] != (32, 32, 3):
            raise ValueError(f"{path.name} holds no 32×32×3×N images X and labels y")
        y = mat["y"].reshape(-1).astype(np.int64)
        if len(y) != mat["X"].shape[3] or (len(y) and (y.min() < 1 or y.max() > 10)):
            raise ValueError(
                f"{path.name}: SVHN has a label in 1…10 per image, found {len(y)} in {y.min()}…{y.max()}"
            )
        xs.append(np.ascontiguousarray(mat["X"].transpose(3, 0, 1, 2)).astype(np.uint8))
        ys.append(y % 10)
    return _labelled_splits(xs, ys, [str(d) for d in range(10)])


def usps_libsvm(train: Path, test: Path) -> dict[str, np.ndarray]:
    """USPS in LIBSVM's format (``usps.bz2``, ``usps.t.bz2``): a line per image, ``label index:value …``
    with labels 1…10 (digits 0…9) and 256 pixel values in [−1, 1] (an index left out is 0)."""
    xs, ys = [], []
    for path in (train, test):
        with bz2.open(path, "rt") as lines:
            rows = [line.split() for line in lines if line.strip()]
        x = np.zeros((len(rows), 256), np.float32)
        for i, row in enumerate(rows):
            for item in row[1:]:
                index, value = item.split(":")
                x[i, int(index) - 1] = float(value)
        ys.append(np.array([int(float(row[0])) - 1 for row in rows], np.int64))
        if len(ys[-1]) and (ys[-1].min() < 0 or ys[-1].max() > 9):
            raise ValueError(
                f"{path.name}: USPS labels are 1…10, found {ys[-1].min() + 1}…{ys[-1].max() + 1}"
            )
        xs.append(np.round((x.clip(-1, 1) + 1) / 2 * 255).astype(np.uint8).reshape(-1, 16, 16))
    return _labelled_splits(xs, ys, [str(d) for d in range(10)])


def _labelled_splits(xs: list[np.ndarray], ys: list[np.ndarray], classes: list[str]) -> dict[str, np.ndarray]:
    """A training part and a test part (images, labels) as one canonical set."""
    return {
        "x": np.concatenate(xs),
        "y": np.concatenate(ys),
        "split": np.repeat(np.array([0, 1], np.uint8), [len(y) for y in ys]),
        "classes": np.array(classes),
    }


def tiny_imagenet_zip(archive: Path) -> dict[str, np.ndarray]:
    """Tiny-ImageNet-200's zip (cs231n): ``train/<wnid>/images/*.JPEG`` (split 0) and ``val/images/*.JPEG``
    with ``val/val_annotations.txt`` naming each file's wnid (split 1); ``test/`` has no labels and
    is left out. Classes are the wnids of ``wnids.txt``, sorted; images 64×64 RGB (a few are grey)."""
    from PIL import Image

    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
        wnids = sorted(_member_text(z, names, "wnids.txt").split())
        annotations = _member_text(z, names, "val_annotations.txt").splitlines()
        val = dict(line.split("\t")[:2] for line in annotations if line.strip())
        index = {w: i for i, w in enumerate(wnids)}
        images, labels, splits = [], [], []
        for name in names:
            if (found := _tiny_imagenet_class(name, val)) is None:
                continue
            wnid, split = found
            if wnid not in index:
                raise ValueError(f"{name}: its class {wnid} is not in wnids.txt (nor val_annotations.txt)")
            with Image.open(io.BytesIO(z.read(name))) as image:
                image = image.convert("RGB")
                images.append(np.asarray(image if image.size == (64, 64) else image.resize((64, 64))))
            labels.append(index[wnid])
            splits.append(split)
    if not images:
        raise ValueError(f"{archive.name} holds no train/<wnid>/images/*.JPEG")
    return {
        "x": np.stack(images),
        "y": np.array(labels, np.int64),
        "split": np.array(splits, np.uint8),
        "classes": np.array(wnids),
    }


def _tiny_imagenet_class(name: str, val: dict[str, str]) -> tuple[str | None, int] | None:
    """(wnid, split) of a Tiny-ImageNet member: ``train/<wnid>/images/<file>`` or ``val/images/<file>``
    (its wnid from the annotations); None for anything else (test images, boxes, folders)."""
    path = PurePosixPath(name)
    if path.suffix.lower() != ".jpeg" or len(path.parts) < 3 or path.parts[-2] != "images":
        return None
    if len(path.parts) >= 4 and path.parts[-4] == "train":
        return path.parts[-3], 0
    if path.parts[-3] == "val":
        return val.get(path.name), 1
    return None


def _member_text(z: zipfile.ZipFile, names: list[str], base: str) -> str:
    """The text of the one member of ``z`` named ``base`` (in any folder)."""
    found = [n for n in names if PurePosixPath(n).name == base]
    if not found:
        raise ValueError(f"{z.filename} holds no {base}")
    return z.read(found[0]).decode()


class _ArraysOnly(pickle.Unpickler):
    """Unpickles plain data only — containers, strings, numbers and numpy arrays. A pickle that
    names any other callable (which is how a pickle runs code) is refused."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a data file")


def _load_pickle(stream) -> dict:
    return _ArraysOnly(stream, encoding="bytes").load()


def cifar_pickles(
    archive: Path, label_key: str = "labels", names_key: str = "label_names"
) -> dict[str, np.ndarray]:
    """CIFAR-10/100's python tarball: pickled batches ``data_batch_*``/``train`` and ``test_batch``/``test``
    of (N, 3072) uint8 rows, plus ``batches.meta``/``meta`` with the class names."""
    batches: dict[int, list[dict]] = {0: [], 1: []}
    names = None
    with tarfile.open(archive) as tar:
        for member in sorted((m for m in tar if m.isfile()), key=lambda m: m.name):
            base = PurePosixPath(member.name).name
            if base.startswith("data_batch") or base == "train":
                batches[0].append(_load_pickle(tar.extractfile(member)))
            elif base in ("test_batch", "test"):
                batches[1].append(_load_pickle(tar.extractfile(member)))
            elif base in ("batches.meta", "meta"):
                names = [n.decode() for n in _load_pickle(tar.extractfile(member))[names_key.encode()]]
    if not batches[0] or names is None:
        raise ValueError(f"{archive.name} holds no CIFAR training batches or no class names")
    parts = [(b[b"data"], b[label_key.encode()], split) for split in (0, 1) for b in batches[split]]
    return {
        "x": np.concatenate([d for d, _, _ in parts]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy(),
        "y": np.concatenate([np.asarray(labels, np.int64) for _, labels, _ in parts]),
        "split": np.concatenate([np.full(len(labels), split, np.uint8) for _, labels, split in parts]),
        "classes": np.array(names),
    }


def tff_emnist(archive: Path) -> dict[str, np.ndarray]:
    """TensorFlow Federated's ``fed_emnist.tar.bz2``: ``fed_emnist_{train,test}.h5`` with
    ``examples/<writer>/pixels`` (float 28×28, 1 = white paper as in LEAF) and ``.../label``.
    Stored in LEAF's polarity with writer ids, as ``femnist.npz``."""
    import h5py

    xs, ys, splits, writers, names = [], [], [], [], {}
    with tarfile.open(archive) as tar:
        for member in tar:
            split = {"fed_emnist_train.h5": 0, "fed_emnist_test.h5": 1}.get(PurePosixPath(member.name).name)
            if split is None:
                continue
            with h5py.File(io.BytesIO(tar.extractfile(member).read()), "r") as h5:
                for writer, group in h5["examples"].items():
                    pixels = np.asarray(group["pixels"], np.float32)
                    xs.append(np.round(pixels * 255).clip(0, 255).astype(np.uint8))
                    ys.append(np.asarray(group["label"], np.int64).reshape(-1))
                    splits.append(np.full(len(pixels), split, np.uint8))
                    writers.append(np.full(len(pixels), names.setdefault(writer, len(names)), np.int64))
    if not xs:
        raise ValueError(f"{archive.name} holds no fed_emnist_train.h5 / fed_emnist_test.h5")
    split, writer = np.concatenate(splits), np.concatenate(writers)
    complete = np.zeros(len(names), bool)
    complete[np.intersect1d(writer[split == 0], writer[split == 1])] = True
    return {
        "x": np.concatenate(xs),
        "y": np.concatenate(ys),
        "split": split,
        "writer": writer,
        "writer_names": np.array(list(names)),
        "writer_complete": complete,
    }


def image_tree(
    *sources: Path,
    size: int | None = None,
    mode: str = "RGB",
    train_folders: tuple[str, ...] = ("train",),
    test_folders: tuple[str, ...] = ("test",),
    valid_folders: tuple[str, ...] = VALID_FOLDERS,
) -> dict[str, np.ndarray]:
    """ImageFolder trees — folders (see ``folder_images``), zip or tar archives of ``…/<class>/<image>``
    — as one data set.

    The class of an image is its folder path (so Omniglot's ``alphabet/character`` stays unique)
    without its split folder; an image is in the test split (1) when its path goes through one of
    ``test_folders``, in the validation split (2) through one of ``valid_folders``, else in the
    training split. ``size`` center-crops and resizes every image to a square (needed when sizes
    differ); ``mode`` is PIL's "RGB" or "L".
    """
    from PIL import Image, ImageOps

    tests, valids = {f.lower() for f in test_folders}, {f.lower() for f in valid_folders}
    splits_named = {f.lower() for f in (*train_folders, *test_folders, *valid_folders)}
    images, class_names, splits = [], [], []
    for name, data in (item for source in sources for item in _tree_members(source)):
        try:
            with (
                warnings.catch_warnings()
            ):  # PIL's decompression-bomb warning (> 89M pixels) refuses the image too
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as image:
                    image = image.convert(mode)
                    images.append(np.asarray(ImageOps.fit(image, (size, size)) if size else image))
        except (OSError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ValueError(
                f"{name} is not an image PIL can decode within its size limit "
                f"({type(exc).__name__}: {str(exc)[:120]}); remove it or fix it"
            ) from None
        folders = PurePosixPath(name).parts[:-1]
        class_names.append("/".join(f for f in folders if f.lower() not in splits_named))
        splits.append(
            1
            if any(f.lower() in tests for f in folders)
            else 2
            if any(f.lower() in valids for f in folders)
            else 0
        )
    if not images:
        raise ValueError(
            f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {', '.join(str(s) for s in sources)}"
        )
    if len({i.shape for i in images}) > 1:
        raise ValueError(f"images of different sizes under {sources[0]}: give a size to resize them to")
    classes = sorted(set(class_names))
    index = {c: i for i, c in enumerate(classes)}
    return {
        "x": np.stack(images),
        "y": np.array([index[c] for c in class_names], np.int64),
        "split": np.array(splits, np.uint8),
        "classes": np.array(classes),
    }


def _tree_members(source: Path) -> Iterator[tuple[str, bytes]]:
    """(relative path, bytes) of every image file under a folder (sorted), zip or tar (archive order:
    fixed by the file, and a compressed tar cannot seek back), so the same files give the same arrays."""
    if source.is_dir():
        for path in folder_images(source):
            yield path.relative_to(source).as_posix(), path.read_bytes()
    elif zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as archive:
            for name in (n for n in archive.namelist() if _is_image(n) and "__MACOSX" not in n):
                yield name, archive.read(name)
    elif tarfile.is_tarfile(source):
        with tarfile.open(source) as archive:
            for member in archive:
                if member.isfile() and _is_image(member.name):
                    yield member.name, archive.extractfile(member).read()
    else:
        raise ValueError(f"{source} is neither a folder nor a zip or tar archive")


def tree_image_count(source: Path) -> int | None:
    """How many images ``image_tree`` would decode from a folder or a zip; None for a tar, which
    only a pass through all of it could count."""
    if source.is_dir():
        return len(folder_images(source))
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as archive:
            return sum(_is_image(n) and "__MACOSX" not in n for n in archive.namelist())
    return None


def _is_image(name: str) -> bool:
    return PurePosixPath(name).suffix.lower() in IMAGE_SUFFIXES


def folder_images(root: Path) -> list[Path]:
    """The images of an ImageFolder folder, sorted: ``<class>/<image>``, or
    ``<split>/<class>/<image>`` under the split folders (train, test, valid), and nothing deeper.

    The folder is never walked recursively: a path that is not laid out so (``/``, a home folder)
    is refused at its first folder that does not fit, having read the names in that folder alone.
    Hidden entries (.DS_Store, .ipynb_checkpoints) and files that are not images are passed over."""

    def visible(folder) -> list[os.DirEntry]:
        with os.scandir(folder) as entries:
            return sorted((e for e in entries if not e.name.startswith(".")), key=lambda e: e.name)

    def class_folders(folder) -> list[os.DirEntry]:
        entries = visible(folder)
        if loose := next((e for e in entries if e.is_file() and _is_image(e.name)), None):
            raise ValueError(f"the image {loose.path} lies outside a class folder: {LAYOUT}")
        return [e for e in entries if e.is_dir()]

    images = []
    for top in class_folders(root):
        split_folder = top.name.lower() in SPLIT_FOLDERS
        for folder in class_folders(top) if split_folder else [top]:
            entries = visible(folder)
            if inner := next((e for e in entries if e.is_dir()), None):
                raise ValueError(f"{folder.path} holds a folder ({inner.name}), not only images: {LAYOUT}")
            found = [Path(e.path) for e in entries if e.is_file() and _is_image(e.name)]
            if not found:
                raise ValueError(
                    f"{folder.path} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}): {LAYOUT}"
                )
            images += found
    if not images:
        raise ValueError(f"{root} holds no class folders: {LAYOUT}")
    return images


def learn2learn_splits(dataset_class, root: Path, size: int) -> dict[str, np.ndarray]:
    """A learn2learn vision data set (``learn2learn.vision.datasets``), read through its own class —
    which downloads its publisher's files into ``root`` and knows their layout — split by split.
    Its splits are Meta-Dataset's class splits: training classes get ``split`` 0, validation 2,
    test 1; labels run over all classes. Every image is center-cropped and resized to ``size``²."""
    from PIL import Image, ImageOps

    images, labels, splits, offset = [], [], [], 0
    for split, mode in ((0, "train"), (2, "validation"), (1, "test")):
        data = dataset_class(root=str(root), mode=mode, download=True)
        if isinstance(getattr(data, "data", None), list):  # (path, label) in os.listdir order: fix it
            data.data = sorted(data.data)
        seen = []
        for i in range(len(data)):
            image, label = data[i]
            if not isinstance(image, Image.Image):  # mini-ImageNet: a float CHW tensor of 0…255
                image = Image.fromarray(np.asarray(image.permute(1, 2, 0), dtype=np.uint8))
            images.append(np.asarray(ImageOps.fit(image.convert("RGB"), (size, size))))
            seen.append(int(label))
        labels += [offset + label for label in seen]
        splits += [split] * len(seen)
        offset += max(seen, default=-1) + 1
    if not images:
        raise ValueError(f"{dataset_class.__name__} holds no images under {root}")
    _, y = np.unique(np.array(labels), return_inverse=True)  # classes with no image leave no gap
    return {"x": np.stack(images), "y": y.astype(np.int64), "split": np.array(splits, np.uint8)}


def learn2learn_data():
    """``learn2learn.data``, imported without the deprecation notices its package prints about gym
    (learn2learn's reinforcement-learning part, which fedmeta does not use)."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        import learn2learn.data
        import learn2learn.data.transforms
    return learn2learn.data
