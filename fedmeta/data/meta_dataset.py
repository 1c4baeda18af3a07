"""Meta-Dataset clients, built with learn2learn's task machinery.

A client is one few-shot task: one source data set, N of its classes, K images of each, its
labels remapped to 0…N−1 in an order of its own — learn2learn's ``Taskset`` (formerly ``TaskDataset``) over a
``MetaDataset`` with the ``NWays``, ``KShots``, ``LoadData`` and ``RemapLabels`` transforms. Each
client's task is drawn under a seed of its own (run seed, client), so a federation is the same in
every process. learn2learn samples descriptions of rows; the images are gathered once from the
canonical arrays (32×32 RGB; grey sources copied to three channels). All of a source's splits are
pooled: a client's own 80/20 split is made later, as for every data set.

The paper's sources are Aircraft, CUB Birds, DTD, Traffic Signs, VGG Flowers, Omniglot,
mini-ImageNet and CIFAR-FS; the default list names their canonical files, runs on those present
and names the missing ones in one line.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from fedmeta.data.convert import learn2learn_data
from fedmeta.data.sources import is_available, load_source
from fedmeta.errors import FedmetaError

log = logging.getLogger("fedmeta")

PAPER_SOURCES = {
    "fgvc_aircraft32": "Aircraft",
    "cu_birds32": "CUB Birds",
    "dtd32": "DTD",
    "gtsrb32": "Traffic Signs",
    "vgg_flowers32": "VGG Flowers",
    "omniglot": "Omniglot",
    "mini_imagenet32": "mini-ImageNet",
    "cifar_fs32": "CIFAR-FS",
}


class _Rows(torch.utils.data.Dataset):
    """(row, label) pairs of one source: what a task description is made of."""

    def __init__(self, labels: np.ndarray):
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, int(self.labels[i])


def taskset(labels: np.ndarray, ways: int, shots: int):
    """learn2learn's N-way K-shot tasks over one source's labels."""
    l2l = learn2learn_data()
    t = l2l.transforms
    meta = l2l.MetaDataset(
        _Rows(labels),
        labels_to_indices={int(c): np.flatnonzero(labels == c).tolist() for c in np.unique(labels)},
    )
    return l2l.Taskset(
        meta,
        [t.NWays(meta, ways), t.KShots(meta, shots), t.LoadData(meta), t.RemapLabels(meta)],
        num_tasks=-1,
    )


def draw_task(tasks, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows and remapped labels of one task, drawn under ``seed`` (learn2learn samples with
    Python's ``random``, whose global state is restored afterwards)."""
    state = random.getstate()
    random.seed(seed)
    try:
        rows, labels = tasks.get_task(tasks.sample_task_description())
    finally:
        random.setstate(state)
    return rows.numpy(), labels.numpy()


def present_sources(sources: list[str], directory: Path, download: bool) -> list[str]:
    """The sources that can be read; the missing ones named in one line (never dropped silently)."""
    present = [s for s in sources if download or is_available(s, directory)]
    missing = [s for s in sources if s not in present]
    if not present:
        raise FedmetaError(
            f"meta_dataset: none of the sources {sources} is in {directory}: get them with "
            f"`fedmeta data download NAME` or list others in dataset.options.sources"
        )
    if missing:
        log.warning(
            f"meta_dataset: {', '.join(missing)} not in {directory}: running on the {len(present)} others "
            f"({', '.join(present)}); `fedmeta data download NAME` fetches a missing one"
        )
    return present


def shots_per_source(labels: dict[str, np.ndarray], ways: int, images_per_client: int) -> dict[str, int]:
    """K for each source: images_per_client / N, or fewer where a source's smallest class holds fewer
    images (said once per source: it changes that source's clients' size)."""
    wanted = images_per_client // ways
    shots = {}
    for name, y in labels.items():
        classes, counts = np.unique(y, return_counts=True)
        if len(classes) < ways:
            raise FedmetaError(
                f"meta_dataset: source {name} has {len(classes)} classes, fewer than "
                f"classes_per_client={ways}: drop it or lower classes_per_client"
            )
        shots[name] = min(wanted, int(counts.min()))
        if shots[name] < wanted:
            log.warning(
                f"meta_dataset: {name} gives {ways} × {shots[name]} = {ways * shots[name]} images per client, "
                f"not images_per_client={images_per_client} (its smallest class holds {int(counts.min())} images)"
            )
    if images_per_client % ways:
        log.warning(
            f"meta_dataset: images_per_client={images_per_client} is not a multiple of classes_per_client={ways}: "
            f"clients get {ways} × {wanted} = {ways * wanted}"
        )
    return shots


def build_clients(
    directory: Path,
    seed: int,
    download: bool,
    sources: list[str],
    num_clients: int,
    classes_per_client: int,
    images_per_client: int,
    to_images,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """Images, remapped labels and client of every image, and the sources used; client i's source
    is drawn uniformly, its task by learn2learn under the seed (run seed, i)."""
    if not sources:
        raise FedmetaError(
            "meta_dataset: dataset.options.sources is empty: list at least one source file name"
        )
    sources = present_sources([str(s) for s in sources], directory, download)
    arrays = {name: load_source(name, directory, download, size=32) for name in sources}
    shots = shots_per_source(
        {name: a["y"] for name, a in arrays.items()}, classes_per_client, images_per_client
    )
    tasks = {name: taskset(a["y"], classes_per_client, shots[name]) for name, a in arrays.items()}
    rng = np.random.default_rng([seed, 0x3E7A])
    images, labels, owners = [], [], []
    for client in range(num_clients):
        name = sources[rng.integers(len(sources))]
        client_seed = int(np.random.SeedSequence([seed, client, 0x7A5C]).generate_state(1)[0])
        rows, local = draw_task(tasks[name], client_seed)
        images.append(to_images(arrays[name]["x"][rows]))
        labels.append(torch.from_numpy(local).long())
        owners.append(torch.full((len(rows),), client, dtype=torch.long))
    return torch.cat(images), torch.cat(labels), torch.cat(owners), sources
