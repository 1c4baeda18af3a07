"""``fedmeta data download NAME``: fetch a data set's files from its publisher, check them against
the publisher's checksum, convert them to the canonical ``<name>.npz`` in the data folder.

URLs and checksums are torchvision's own where torchvision knows the data set, so they stay in step
with it; Tiny-ImageNet, which torchvision lacks, is cs231n's zip with its published MD5. The
Meta-Dataset sources torchvision lacks (Aircraft, CUB Birds, VGG Flowers, CIFAR-FS, mini-ImageNet)
are fetched by learn2learn's own data set classes, which hold their publishers' URLs (and
fallbacks) and read their layouts; learn2learn publishes no checksums for them.
``mirror`` replaces the folder of every URL (an institutional mirror, or a loopback server in the
tests), for both kinds. Text data sets are kept as the publisher's file; Shakespeare's complete
works, which Gutenberg publishes no checksum for, are checked by parsing them instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import io
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torchvision.datasets import CIFAR10, CIFAR100, DTD, EMNIST, MNIST, SVHN, USPS, FashionMNIST, Omniglot
from torchvision.datasets.utils import USER_AGENT
from tqdm.auto import tqdm

from fedmeta.data import convert
from fedmeta.data.plays import check_complete_works
from fedmeta.errors import FedmetaError
from fedmeta.waiting import said_after

GTSRB_URL = "https://sid.erda.dk/public/archives/daaeac0d7ce1152aea9b61d9f1e19370/GTSRB-Training_fixed.zip"
GTSRB_MD5 = "513f3c79a4c5141765e10e952eaa2478"  # torchvision's GTSRB.download()
TFF_EMNIST_URL = "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2"
TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"  # torchvision has no Tiny-ImageNet
TINY_IMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


@dataclass(frozen=True)
class Upstream:
    """Where a data set comes from: its files (URL, MD5 or None where no checksum is published)
    and the function that turns the fetched files, in that order, into canonical arrays."""

    files: tuple[tuple[str, str | None], ...]
    convert: Callable[..., dict[str, np.ndarray]]
    description: str


CATALOG: dict[str, Upstream] = {
    "mnist": Upstream(
        tuple((MNIST.mirrors[0] + f, md5) for f, md5 in MNIST.resources),
        convert.mnist_idx,
        "MNIST, 70,000 28×28 grey digits (idx files)",
    ),
    "cifar10": Upstream(
        ((CIFAR10.url, CIFAR10.tgz_md5),),
        convert.cifar_pickles,
        "CIFAR-10, 60,000 32×32 colour images, 10 classes (python batches)",
    ),
    "cifar100": Upstream(
        ((CIFAR100.url, CIFAR100.tgz_md5),),
        functools.partial(convert.cifar_pickles, label_key="fine_labels", names_key="fine_label_names"),
        "CIFAR-100, 60,000 32×32 colour images, 100 classes (python batches)",
    ),
    "fmnist": Upstream(
        tuple((FashionMNIST.mirrors[0] + f, md5) for f, md5 in FashionMNIST.resources),
        functools.partial(convert.mnist_idx, classes=FashionMNIST.classes),
        "Fashion-MNIST, 70,000 28×28 grey images of clothing, 10 classes (idx files)",
    ),
    "emnist": Upstream(
        ((EMNIST.url, EMNIST.md5),),
        convert.emnist_zip,
        "EMNIST ByClass, 814,255 28×28 grey characters, 62 classes (idx files in NIST's gzip.zip, over 500 MB)",
    ),
    "svhn": Upstream(
        tuple((SVHN.split_list[part][0], SVHN.split_list[part][2]) for part in ("train", "test")),
        convert.svhn_mats,
        "SVHN cropped digits, 99,289 32×32 colour images, 10 classes (MATLAB files; extra left out)",
    ),
    "usps": Upstream(
        tuple((USPS.split_list[part][0], USPS.split_list[part][2]) for part in ("train", "test")),
        convert.usps_libsvm,
        "USPS, 9,298 16×16 grey digits, 10 classes (LIBSVM text, bz2)",
    ),
    "tiny_imagenet": Upstream(
        ((TINY_IMAGENET_URL, TINY_IMAGENET_MD5),),
        convert.tiny_imagenet_zip,
        "Tiny-ImageNet-200, 110,000 labelled 64×64 colour images, 200 classes (JPEG zip; test unlabelled, left out)",
    ),
    "omniglot": Upstream(
        tuple(
            (f"{Omniglot.download_url_prefix}/{n}.zip", Omniglot.zips_md5[n])
            for n in ("images_background", "images_evaluation")
        ),
        functools.partial(
            convert.image_tree,
            mode="L",
            train_folders=("images_background",),
            test_folders=("images_evaluation",),
        ),
        "Omniglot, 32,460 105×105 grey characters, 1,623 classes (PNG zips)",
    ),
    "gtsrb32": Upstream(
        ((GTSRB_URL, GTSRB_MD5),),
        functools.partial(convert.image_tree, size=32),
        "GTSRB training set, 26,640 traffic signs, 43 classes, resized to 32×32 (PPM zip)",
    ),
    "dtd32": Upstream(
        ((DTD._URL, DTD._MD5),),
        functools.partial(convert.image_tree, size=32),
        "DTD, 5,640 textures, 47 classes, cropped and resized to 32×32 (JPEG tarball)",
    ),
    "femnist": Upstream(
        ((TFF_EMNIST_URL, None),),
        convert.tff_emnist,
        "FEMNIST by writer, 3,400 writers, 62 classes (TensorFlow Federated's HDF5; no published MD5)",
    ),
}


@dataclass(frozen=True)
class Learn2LearnSource:
    """A source fetched and read by a ``learn2learn.vision.datasets`` class, stored as 32×32 RGB."""

    dataset: str  # the class name in learn2learn.vision.datasets
    description: str


LEARN2LEARN: dict[str, Learn2LearnSource] = {
    "fgvc_aircraft32": Learn2LearnSource(
        "FGVCAircraft", "FGVC-Aircraft, 10,000 aircraft photos, 100 variants"
    ),
    "cu_birds32": Learn2LearnSource(
        "CUBirds200", "CUB-200-2011, 11,788 bird photos, 200 species (less ImageNet duplicates)"
    ),
    "vgg_flowers32": Learn2LearnSource(
        "VGGFlower102", "Oxford VGG Flowers, 8,189 flower photos, 102 species"
    ),
    "cifar_fs32": Learn2LearnSource("CIFARFS", "CIFAR-FS: CIFAR-100's 60,000 32×32 images, 100 classes"),
    "mini_imagenet32": Learn2LearnSource("MiniImagenet", "mini-ImageNet, 60,000 84×84 images, 100 classes"),
}


@dataclass(frozen=True)
class Text:
    """A text data set, kept as the publisher's file (``filename`` in the data folder): nothing to
    convert. Where no MD5 is published, ``check`` reads the file instead, and refuses it."""

    url: str
    md5: str | None
    filename: str
    member: str | None = None  # the file to take out of the zip that ``url`` is
    check: Callable[[Path], None] | None = None


TINY_SHAKESPEARE = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e/"
    "data/tinyshakespeare/input.txt"
)
COMPLETE_WORKS = "https://www.gutenberg.org/files/100/old/old/1994-01-100.zip"  # LEAF's, moved since
TEXTS: dict[str, Text] = {
    "shakespeare": Text(TINY_SHAKESPEARE, "6fb458f1232090904fb40fe944165e91", "shakespeare.txt"),
    "shakespeare_complete": Text(
        COMPLETE_WORKS, None, "shakespeare_complete.txt", member="100.txt", check=check_complete_works
    ),
}


def known() -> list[str]:
    return sorted({*CATALOG, *LEARN2LEARN, *TEXTS})


def download_text(name: str, directory: Path, mirror: str | None = None, verify: bool = True) -> Path:
    """A text data set's file into ``directory``, taken out of its zip if it comes in one, checked
    against its MD5 or by its ``check``, written atomically."""
    text = TEXTS[name]
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=f".{name}-download-") as tmp:
        fetched = _fetch(text.url, text.md5 if verify else None, Path(tmp), mirror)
        if text.member:
            fetched = _unzipped(fetched, text.member)
        if text.check:  # what stands in for a checksum: --no-verify does not skip it
            text.check(fetched)
        os.replace(fetched, directory / text.filename)
    return directory / text.filename


def _unzipped(archive: Path, member: str) -> Path:
    """``member`` of the zip ``archive``, extracted beside it."""
    try:
        with zipfile.ZipFile(archive) as opened:
            return Path(opened.extract(member, archive.parent))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise FedmetaError(
            f"{archive.name} is not the zip expected ({exc}): download it again, or check the mirror"
        ) from None


def download(name: str, directory: Path, mirror: str | None = None, verify: bool = True) -> Path:
    """Fetch ``name``'s files (into a temporary folder), convert them, and write
    ``directory/<name>.npz`` atomically. Returns that path."""
    if name in TEXTS:
        return download_text(name, directory, mirror, verify)
    if name not in CATALOG and name not in LEARN2LEARN:
        raise FedmetaError(
            f"no download known for {name!r}: choose one of {known()}, "
            "or put a canonical .npz or an ImageFolder tree in the data folder"
        )
    target = directory / f"{name}.npz"
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f".{name}-download-*"):  # left by a download that was killed
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=f".{name}-download-") as tmp:
        if name in LEARN2LEARN:
            arrays = _through_learn2learn(name, Path(tmp), mirror)
        else:
            paths = [
                _fetch(url, md5 if verify else None, Path(tmp), mirror) for url, md5 in CATALOG[name].files
            ]
            try:
                arrays = CATALOG[name].convert(*paths)
            except (
                ValueError,
                KeyError,
                OSError,
                EOFError,
                tarfile.TarError,
                zipfile.BadZipFile,
                pickle.UnpicklingError,
            ) as exc:
                raise FedmetaError(
                    f"the files of {name} are not in the expected format ({exc}): "
                    "check the mirror, or download again"
                ) from None
    save_canonical(target, **arrays)
    return target


def _through_learn2learn(name: str, root: Path, mirror: str | None) -> dict[str, np.ndarray]:
    """learn2learn's data set class downloads into ``root`` (every request with a timeout, and sent
    to ``mirror`` if given) and reads its files; fedmeta converts what it reads."""
    from fedmeta.data.convert import learn2learn_data

    learn2learn_data()  # learn2learn, imported quietly
    import learn2learn.vision.datasets as l2l_datasets

    source = LEARN2LEARN[name]
    try:
        with (
            _requests_to(mirror),
            contextlib.redirect_stderr(io.StringIO()),
        ):  # its progress bars: noise in a log
            return convert.learn2learn_splits(getattr(l2l_datasets, source.dataset), root, size=32)
    except Exception as exc:  # noqa: BLE001 — network, archive and layout errors all surface from learn2learn's code
        raise FedmetaError(
            f"fetching {name} through learn2learn's {source.dataset} failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}): "
            "check the network, or pass --mirror URL serving the publisher's files"
        ) from None


@contextlib.contextmanager
def _requests_to(mirror: str | None):
    """While learn2learn downloads: every ``requests`` call gets a timeout and a status check and,
    with a mirror, goes to the mirror's file of the same name."""
    import requests

    def redirected(original):
        def call(*args, **kwargs):
            args = list(args)
            url_index = 1 if args and isinstance(args[0], requests.Session) else 0
            if mirror and len(args) > url_index:
                args[url_index] = f"{mirror.rstrip('/')}/{args[url_index].split('?', 1)[0].rsplit('/', 1)[1]}"
            kwargs.setdefault("timeout", TIMEOUT_S)
            response = original(*args, **kwargs)
            response.raise_for_status()  # learn2learn would save a 404 page as the archive
            return response

        return call

    patched = [(requests, "get"), (requests.Session, "get")]
    originals = [getattr(owner, attr) for owner, attr in patched]
    for (owner, attr), original in zip(patched, originals):
        setattr(owner, attr, redirected(original))
    try:
        yield
    finally:
        for (owner, attr), original in zip(patched, originals):
            setattr(owner, attr, original)


def _fetch(url: str, md5: str | None, folder: Path, mirror: str | None) -> Path:
    """``url`` (or the mirror's file of its name) into ``folder``, with a progress bar that the
    error line replaces, checked against ``md5`` unless it is None."""
    filename = url.rsplit("/", 1)[1]
    if mirror:
        url = f"{mirror.rstrip('/')}/{filename}"
    with tqdm(desc=filename, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr) as bar:
        try:
            digest = _with_retries(lambda: _get(url, folder / filename, bar), bar)
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
            bar.leave = False  # the error line alone is left on the terminal
            raise _failure(url, exc) from None
    if md5 is not None and digest != md5:
        raise FedmetaError(
            f"{filename} from {url} does not match the publisher's MD5 {md5}: the download is "
            "corrupt or the mirror serves another file (--no-verify skips the check)"
        )
    return folder / filename


def _failure(url: str, exc: Exception) -> FedmetaError:
    """The line for a download that failed: urllib wraps what fails while connecting in a URLError,
    and lets a timeout while waiting for the answer through as it is."""
    if isinstance(exc, TimeoutError):
        cause = f"the server accepted the connection, then sent nothing for {TIMEOUT_S} s"
    elif isinstance(getattr(exc, "reason", None), TimeoutError):
        cause = f"no connection within {TIMEOUT_S} s"
    else:
        cause = None
    if cause:
        return FedmetaError(
            f"downloading {url} failed: {cause} ({ATTEMPTS} tries): check the network, "
            "or pass --mirror URL of a server that answers"
        )
    if isinstance(exc, ValueError):  # urllib: "unknown url type"
        return FedmetaError(
            f"{url} is not a URL fedmeta can fetch ({exc}): give --mirror as http(s)://host/folder/"
        )
    return FedmetaError(f"downloading {url} failed ({exc}): check the network, or pass --mirror URL")


TIMEOUT_S, ATTEMPTS = 60, 3  # the longest wait for a byte (connecting, or reading); tries per file
CHUNK = 1 << 16


def _get(url: str, target: Path, bar: tqdm) -> str:
    """One GET of ``url`` into ``target``, counted on ``bar``; its MD5. Connecting and every read
    wait at most TIMEOUT_S for a byte: a server that accepts and never answers must not hang it."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    digest = hashlib.md5(usedforsecurity=False)
    waiting = f"waiting for the server to answer (each try gives up after {TIMEOUT_S:g} s without a byte)"
    with said_after(waiting, bar.set_postfix_str):
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    with response, target.open("wb") as out:
        bar.reset(total=response.length)
        while chunk := response.read(CHUNK):
            out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _with_retries(fetch: Callable[[], str], bar: tqdm) -> str:
    """``fetch``, tried again after 1 s and 2 s on network errors, which ``bar`` shows meanwhile."""
    for attempt in range(ATTEMPTS):
        try:
            return fetch()
        except urllib.error.HTTPError:  # the server answered (404, 403): asking again will not help
            raise
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            if attempt == ATTEMPTS - 1:
                raise
            bar.set_postfix_str(f"{getattr(exc, 'reason', exc)}: try {attempt + 2} of {ATTEMPTS}")
            time.sleep(2**attempt)


def save_canonical(target: Path, **arrays: np.ndarray) -> None:
    """Write a canonical archive atomically (a partial file never takes the real name)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial.npz")  # two processes converting at once
    np.savez(partial, **arrays)
    partial.replace(target)
