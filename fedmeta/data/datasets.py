"""Image data sets built from canonical sources, as normalized tensors ready for indexing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms.v2 import functional as TF

from fedmeta.data.memory import refuse_beyond_memory
from fedmeta.data.sources import CANONICAL, SPLITS, load_npz, load_source
from fedmeta.errors import FedmetaError


@dataclass
class ImageDataset:
    """All samples of a data set; ``groups`` marks a natural grouping (rotation, writer, source)."""

    x: torch.Tensor  # float32 (N, C, H, W), normalized
    y: torch.Tensor  # int64 (N,)
    num_classes: int
    groups: torch.Tensor | None = None  # int64 (N,)
    sources: tuple[str, ...] = ()  # Meta-Dataset: the source data sets its clients were drawn from

    def __len__(self) -> int:
        return len(self.y)


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def build_rmnist(
    directory: Path,
    seed: int,
    download: bool = True,
    num_groups: int = 10,
    degrees_per_group: float = 20.0,
    interpolation: str = "bilinear",
    standardize: bool = True,
) -> ImageDataset:
    """Rotated MNIST: MNIST-train cut into equal random groups, group g rotated g·20°.

    Every image is rotated once here, not per sample per epoch, with ``interpolation`` (torchvision's
    "bilinear" or "nearest", its default: the CAFeMe authors') on pixels in [0, 1]; then, with
    ``standardize``, shifted and scaled by MNIST's mean and deviation (the authors' code does not).
    """
    modes = {"bilinear": TF.InterpolationMode.BILINEAR, "nearest": TF.InterpolationMode.NEAREST}
    if interpolation not in modes:
        raise FedmetaError(
            f"dataset.options.interpolation must be bilinear or nearest, got {interpolation!r}"
        )
    arrays = load_npz("mnist", directory, download)
    train = training_split(arrays, "mnist.npz")
    images = images_to_tensor(arrays["x"][train])
    refuse_constant(images, "mnist.npz")
    labels = torch.from_numpy(arrays["y"][train]).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    groups = torch.empty(len(labels), dtype=torch.long)
    for g, members in enumerate(order.tensor_split(num_groups)):
        groups[members] = g
        images[members] = TF.rotate(
            images[members], angle=g * degrees_per_group, interpolation=modes[interpolation]
        )
    if standardize:
        images.sub_(MNIST_MEAN).div_(MNIST_STD)
    return ImageDataset(x=images, y=labels, num_classes=10, groups=groups)


def images_to_tensor(x: np.ndarray) -> torch.Tensor:
    """uint8 (N,H,W) or (N,H,W,3) → float (N,C,H,W) in [0, 1]."""
    images = torch.from_numpy(x).float().div_(255.0)
    return images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2).contiguous()


def training_split(arrays: dict[str, np.ndarray], source: str) -> np.ndarray:
    """Which images are in the training split (0; every image of a file without a ``split``), checked
    to hold two classes or more: a model cannot be trained on fewer."""
    if "split" not in arrays:
        return np.ones(len(arrays["y"]), bool)
    train = arrays["split"] == 0
    if not train.any():
        values, counts = np.unique(arrays["split"], return_counts=True)
        found = ", ".join(f"{n} {SPLITS.get(int(v), v)}" for v, n in zip(values, counts))
        raise FedmetaError(
            f"{source} has no training images (split 0), only {found}: training uses split 0 alone; "
            "mark the training images 0 (a folder: put them in train/<class>/ or <class>/)"
        )
    if len(classes := np.unique(arrays["y"][train])) < 2:
        name = arrays["classes"][classes[0]] if "classes" in arrays else f"label {classes[0]}"
        raise FedmetaError(
            f"{source}: its training split (split 0) holds one class only ({name}): "
            "a classifier needs training images of two classes or more"
        )
    return train


def refuse_constant(images: torch.Tensor, source: str) -> None:
    """Images that are all one value (std 0) cannot be standardized or learnt from: said here, not
    as a non-finite loss rounds later."""
    if len(images) and images.amin() == images.amax():
        raise FedmetaError(
            f"{source}: the images are constant (every pixel {round(images.flatten()[0].item() * 255)}, "
            "std 0): there is nothing to learn from them; check the files"
        )


def standardize(images: torch.Tensor, source: str = "the data set") -> torch.Tensor:
    """Per-channel zero mean, unit variance (statistics of this very set); ``source`` names the
    images where they are constant."""
    refuse_constant(images, source)
    mean = images.mean(dim=(0, 2, 3), keepdim=True)
    std = images.std(dim=(0, 2, 3), keepdim=True)
    # a channel of one value (blue always 0) carries nothing: centred to 0, it is left unscaled
    return images.sub_(mean).div_(torch.where(std > 0, std, 1.0))


def build_cifar10(directory: Path, seed: int, download: bool = True) -> ImageDataset:
    """CIFAR-10's 50,000 training images, 32×32 RGB."""
    arrays = load_npz("cifar10", directory, download)
    train = training_split(arrays, "cifar10.npz")
    return ImageDataset(
        x=standardize(images_to_tensor(arrays["x"][train]), "cifar10.npz"),
        y=torch.from_numpy(arrays["y"][train]).long(),
        num_classes=10,
    )


def build_femnist(directory: Path, seed: int, download: bool = True) -> ImageDataset:
    """FEMNIST (LEAF): 62 classes, grouped by writer. LEAF's dark ink on white is inverted to
    MNIST's polarity so the two can share sources and models."""
    arrays = load_npz("femnist", directory, download)
    if "writer" not in arrays:
        raise FedmetaError(f"{directory}/femnist.npz has no writer array: the writers partition needs it")
    return ImageDataset(
        x=standardize(images_to_tensor(255 - arrays["x"]), "femnist.npz"),
        y=torch.from_numpy(arrays["y"]).long(),
        num_classes=62,
        groups=torch.from_numpy(arrays["writer"]).long(),
    )


def build_image_set(
    name: str, directory: Path, seed: int, download: bool = True, num_classes: int | None = None
) -> ImageDataset:
    """A labelled image set read from its canonical file (``CANONICAL[name]``, e.g. ``svhn.npz``):
    its training split, standardized per channel, as stored (no resizing: the config's shape is the
    file's). ``num_classes`` — the model's outputs — is the config's, else the file's class count.

    A file whose splits hold different classes (learn2learn's mini-ImageNet, split by class for
    meta-learning) is used whole: its training split alone would lack most classes."""
    source = f"{CANONICAL[name]}.npz"
    arrays = load_npz(CANONICAL[name], directory, download)
    train = np.ones(len(arrays["y"]), bool) if class_splits(arrays) else training_split(arrays, source)
    labels = torch.from_numpy(arrays["y"][train]).long()
    count = num_classes or (len(arrays["classes"]) if "classes" in arrays else int(arrays["y"].max()) + 1)
    if int(labels.max()) >= count:
        raise FedmetaError(
            f"{source} holds label {int(labels.max())}, beyond the {count} classes of "
            f"dataset.options.num_classes: raise it, or check that {source} is {name}'s file"
        )
    refuse_beyond_memory(
        int(train.sum()) * int(np.prod(arrays["x"].shape[1:])) * 4,
        f"dataset={name}: {int(train.sum()):,} images of {source} as float32",
        "use a machine with more memory, or a smaller file of the same form",
    )
    return ImageDataset(
        x=standardize(images_to_tensor(arrays["x"][train]), source), y=labels, num_classes=count
    )


def class_splits(arrays: dict[str, np.ndarray]) -> bool:
    """Whether the file's splits share no class (a meta-learning split by class), not images of the
    same classes."""
    if "split" not in arrays or len(np.unique(arrays["split"])) < 2:
        return False
    train = arrays["split"] == 0
    return not np.isin(arrays["y"][~train], arrays["y"][train]).any()


def image_set(name: str) -> Callable[..., ImageDataset]:
    """The builder of the labelled image set ``name`` (``build_image_set``), as BUILDERS calls it."""
    return functools.partial(build_image_set, name)


def to_shape(x: np.ndarray, channels: int, size: int) -> torch.Tensor:
    """Any canonical images → float (N, channels, size, size) in [0, 1]: grey copied to 3 channels
    or colour averaged to grey, resized where the size differs."""
    images = images_to_tensor(x)
    if images.shape[1] != channels:
        images = images.expand(-1, 3, -1, -1) if channels == 3 else images.mean(dim=1, keepdim=True)
    if images.shape[-2:] != (size, size):
        images = TF.resize(images, [size, size], antialias=True)
    return images.contiguous()


def build_meta_dataset(
    directory: Path,
    seed: int,
    download: bool = True,
    sources: tuple[str, ...] = (),
    num_clients: int = 100,
    classes_per_client: int = 10,
    images_per_client: int = 600,
) -> ImageDataset:
    """Meta-Dataset-style concept shift (fedmeta.data.meta_dataset): client i is one learn2learn
    task — one source, N classes, K images each, labels 0…N−1 in its own order. ``groups`` holds
    the client of every image; only the drawn images are kept, as 32×32 RGB."""
    from fedmeta.data.meta_dataset import build_clients

    x, y, owners, used = build_clients(
        directory,
        seed,
        download,
        list(sources),
        num_clients,
        classes_per_client,
        images_per_client,
        lambda images: to_shape(images, 3, 32),
    )
    return ImageDataset(
        x=standardize(x, f"meta_dataset sources {', '.join(used)}"),
        y=y,
        num_classes=classes_per_client,
        groups=owners,
        sources=tuple(used),
    )


def build_folder(
    directory: Path,
    seed: int,
    download: bool = True,
    path: str | None = None,
    channels: int = 3,
    image_size: int = 32,
) -> ImageDataset:
    """Any data set a user points to (``dataset.options.path``): a canonical ``.npz`` or an
    ImageFolder tree (folder, zip or tar of ``[train|test/]<class>/<image>``); its training split,
    as ``channels``×``image_size``² images."""
    if not path:
        raise FedmetaError(
            "dataset=folder needs dataset.options.path=<canonical .npz, ImageFolder folder or archive>"
        )

    def refuse_oversized(count: int) -> None:
        refuse_beyond_memory(
            count * channels * image_size**2 * 4,
            f"dataset.image_size={image_size}: {'one image' if count == 1 else f'{count:,} images'} of "
            f"{channels}×{image_size}×{image_size} float32",
            "lower dataset.image_size",
        )

    refuse_oversized(1)  # before a single image is decoded at that size, then before all of them are
    arrays = load_source(path, directory, download, image_size, channels, before_decoding=refuse_oversized)
    train = training_split(arrays, path)
    refuse_oversized(int(train.sum()))
    labels = torch.from_numpy(arrays["y"][train]).long()
    return ImageDataset(
        x=standardize(to_shape(arrays["x"][train], channels, image_size), path),
        y=labels,
        num_classes=int(labels.max()) + 1,
    )


def build_shakespeare(directory: Path, seed: int, download: bool = True, **options) -> ImageDataset:
    """Shakespeare's text, a client per speaking role (fedmeta.data.shakespeare, which builds on
    this module: imported when called)."""
    from fedmeta.data.shakespeare import build_shakespeare as build

    return build(directory, seed, download, **options)


def build_shakespeare_complete(directory: Path, seed: int, download: bool = True, **options) -> ImageDataset:
    """Shakespeare's complete works, a client per (play, role) as in LEAF (fedmeta.data.shakespeare,
    imported when called)."""
    from fedmeta.data.shakespeare import build_shakespeare_complete as build

    return build(directory, seed, download, **options)


BUILDERS = {
    "shakespeare": build_shakespeare,
    "shakespeare_complete": build_shakespeare_complete,
    "rmnist": build_rmnist,
    "cifar10": build_cifar10,
    "femnist": build_femnist,
    "meta_dataset": build_meta_dataset,
    "folder": build_folder,
    "cifar100": image_set("cifar100"),
    "fmnist": image_set("fmnist"),
    "emnist": image_set("emnist"),
    "svhn": image_set("svhn"),
    "usps": image_set("usps"),
    "tiny_imagenet": image_set("tiny_imagenet"),
    "mini_imagenet": image_set("mini_imagenet"),
}


def load_dataset(name: str, directory: Path, seed: int, download: bool = True, **options) -> ImageDataset:
    if name not in BUILDERS:
        raise FedmetaError(f"unknown data set {name!r}: choose one of {sorted(BUILDERS)}")
    return BUILDERS[name](directory, seed, download, **options)
