"""Meta-Dataset clients are learn2learn tasks: one source, N classes, K shots, labels 0…N−1."""

import logging

import numpy as np
import pytest

from fedmeta.assemble import build, make_fabric
from fedmeta.config import compose
from fedmeta.data import build_federation, load_dataset
from fedmeta.data.download import save_canonical
from fedmeta.data.meta_dataset import draw_task, taskset
from fedmeta.errors import FedmetaError


@pytest.fixture()
def sources(tmp_path):
    """Two canonical sources: 'wide' (12 classes × 30 images, colour) and 'small' (10 classes × 8, grey)."""
    rng = np.random.default_rng(0)
    save_canonical(
        tmp_path / "wide.npz",
        x=rng.integers(0, 255, (360, 32, 32, 3), dtype=np.uint8),
        y=np.repeat(np.arange(12), 30),
    )
    save_canonical(
        tmp_path / "small.npz",
        x=rng.integers(0, 255, (80, 20, 20), dtype=np.uint8),
        y=np.repeat(np.arange(10), 8),
        split=np.tile(np.array([0, 1, 2, 0], np.uint8), 20),
    )
    return tmp_path


def test_a_client_is_the_learn2learn_task_drawn_under_its_seed(sources):
    labels = np.repeat(np.arange(12), 30)
    tasks = taskset(labels, 5, 4)
    rows, local = draw_task(tasks, seed=7)
    assert len(rows) == 20 and sorted(np.unique(local)) == [0, 1, 2, 3, 4]
    assert all(len(np.unique(labels[rows[local == k]])) == 1 for k in range(5))  # one source class per label
    again, _ = draw_task(tasks, seed=7)
    other, _ = draw_task(tasks, seed=8)
    assert np.array_equal(rows, again) and not np.array_equal(rows, other)


def test_meta_dataset_names_missing_sources_and_what_each_source_gave(sources, caplog):
    with caplog.at_level(logging.WARNING, logger="fedmeta"):
        data = load_dataset(
            "meta_dataset",
            sources,
            seed=0,
            download=False,
            sources=["wide", "small", "absent32"],
            num_clients=10,
            classes_per_client=5,
            images_per_client=50,
        )
    assert data.sources == ("wide", "small") and data.x.shape[1:] == (3, 32, 32)
    said = " | ".join(r.message for r in caplog.records)
    assert "absent32 not in" in said and "fedmeta data download" in said  # named, not dropped silently
    assert "small gives 5 × 8 = 40 images per client" in said  # its classes hold 8 images: fewer than 50/5
    sizes = {int((data.groups == c).sum()) for c in range(10)}
    assert (
        sizes <= {40, 50} and len(sizes) == 2
    )  # both sources drew clients; validation images (split 2) pooled
    fed = build_federation(data, {"name": "sources"}, 10, 2, 0.2, seed=0)
    for client in fed.train_clients:
        assert sorted(np.unique(data.y[client.indices("all")].numpy())) == [0, 1, 2, 3, 4]


def test_no_source_present_is_one_line(sources):
    with pytest.raises(FedmetaError, match="none of the sources"):
        load_dataset("meta_dataset", sources, seed=0, download=False, sources=["absent32"], num_clients=4)


def test_ifca_has_one_model_per_source_used(sources):
    cfg = compose(
        [
            "dataset=meta_dataset",
            "method=ifca",
            f"dataset.dir={sources}",
            "dataset.options.sources=[wide,small,absent32]",
            "federation.num_clients=10",
            "federation.num_new_clients=2",
            "federation.clients_per_round=2",
            "dataset.options.classes_per_client=5",
            "dataset.options.images_per_client=50",
            "model.conv_channels=[4,4,4]",
            "model.dense_units=[8,8]",
            "wandb.mode=disabled",
        ]
    )
    assert cfg.method.clusters is None
    _, algorithm = build(make_fabric(cfg), cfg)
    assert algorithm.clusters == 2
    assert cfg.method.clusters is None  # the count comes from the data; the composed config stays as it was
    with pytest.raises(FedmetaError, match="method.clusters"):  # null (one per source) is refused elsewhere
        compose(["method=ifca", "method.clusters=null"])
