"""CIFAR-10 and FEMNIST from the real files (CI: FEDMETA_DATA=../shared/data)."""

import numpy as np
import pytest

from fedmeta.config import compose, group_choices
from fedmeta.data import build_federation, load_dataset
from fedmeta.data.sources import data_dir
from fedmeta.errors import FedmetaError
from fedmeta.loop import train

pytestmark = pytest.mark.slow  # make test-all; make test skips it

SMALL_32 = [
    "model.conv_channels=[8,8,8]",
    "model.dense_units=[32,32]",
    "model.modulator.before_mean=[16,16,16]",
    "model.modulator.after_mean=[16]",
]


def require(name):
    if not (data_dir() / name).exists():
        pytest.skip(f"{name} is not in {data_dir()} (CI points FEDMETA_DATA at ../shared/data)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache, so the JPEG archive is really decoded once here."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("FEDMETA_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def cifar10(cache):
    require("cifar10-jpeg.tar.gz")
    return load_dataset("cifar10", data_dir(), seed=0, download=False)


def test_cifar10_is_decoded_once_into_the_cache(cifar10, cache):
    assert cifar10.x.shape == (50000, 3, 32, 32) and cifar10.num_classes == 10
    assert np.bincount(cifar10.y.numpy()).tolist() == [5000] * 10
    assert abs(cifar10.x.mean().item()) < 1e-3 and (cache / "cifar10.npz").exists()
    assert not (data_dir() / "cifar10.npz").exists()  # never written beside the sources


def test_cifar10_shards_and_dirichlet(cifar10):
    shards = build_federation(cifar10, {"name": "shards"}, 100, 20, 0.2, seed=0)
    classes = [len(np.unique(cifar10.y[c.indices("all")].numpy())) for c in shards.train_clients]
    assert np.mean(np.array(classes) <= 2) > 0.9
    dirichlet = build_federation(cifar10, {"name": "dirichlet", "alpha": 0.3}, 100, 20, 0.2, seed=0)
    assert sum(c.num_samples for c in dirichlet.train_clients + dirichlet.new_clients) == 50000


def test_cafeme_runs_on_cifar10(cifar10, cache, tmp_path):
    cfg = compose(
        [
            "dataset=cifar10",
            "partition=dirichlet",
            "method=cafeme",
            f"output.root={tmp_path}",
            "wandb.mode=disabled",
            "federation.rounds=2",
            "federation.num_new_clients=4",
            "personalization.steps=5",
            *SMALL_32,
        ]
    )
    summary = train(cfg, show_progress=False)
    assert len(summary["curve"]) == 6 and summary["accuracy"] > summary["curve"][0]


@pytest.fixture(scope="module")
def femnist():
    require("femnist.npz")
    return load_dataset("femnist", data_dir(), seed=0, download=False)


def test_femnist_writers_are_clients(femnist):
    assert femnist.num_classes == 62 and femnist.x.shape[1:] == (1, 28, 28)
    fed = build_federation(femnist, {"name": "writers", "min_samples": 20}, 100, 20, 0.2, seed=0)
    writers = [
        np.unique(femnist.groups[c.indices("all")].numpy()) for c in fed.train_clients + fed.new_clients
    ]
    assert all(len(w) == 1 for w in writers)  # one writer per client
    assert len({int(w[0]) for w in writers}) == 100  # no writer twice
    assert all(c.num_samples >= 20 for c in fed.train_clients)


def test_femnist_refuses_more_writers_than_it_has(femnist):
    with pytest.raises(FedmetaError, match="writers: only"):
        build_federation(femnist, {"name": "writers", "min_samples": 20}, 5000, 20, 0.2, seed=0)


def test_fedavg_ft_runs_on_femnist(femnist, tmp_path):
    cfg = compose(
        [
            "dataset=femnist",
            "method=fedavg_ft",
            "variant=tuned",
            f"output.root={tmp_path}",
            "wandb.mode=disabled",
            "federation.rounds=3",
            "federation.num_new_clients=4",
            "personalization.steps=5",
            "model.conv_channels=[8,16]",
            "model.dense_units=[32]",
        ]
    )
    summary = train(cfg, show_progress=False)
    assert 0 <= summary["accuracy"] <= 1 and len(summary["curve"]) == 6


def meta_dataset(**options):
    for name in ("omniglot.npz", "gtsrb32.npz", "dtd32.npz"):
        require(name)
    settings = {"sources": ["omniglot", "gtsrb32", "dtd32"], "num_clients": 20, **options}
    return load_dataset("meta_dataset", data_dir(), seed=0, download=False, **settings)


def test_meta_dataset_clients_hold_n_classes_relabelled_from_zero():
    data = meta_dataset(classes_per_client=5, images_per_client=100)
    fed = build_federation(data, {"name": "sources"}, 20, 4, 0.2, seed=0)
    assert data.x.shape[1:] == (3, 32, 32) and data.num_classes == 5
    for client in fed.train_clients + fed.new_clients:
        assert sorted(np.unique(data.y[client.indices("all")].numpy())) == [0, 1, 2, 3, 4]
        assert client.num_samples == 100
    bigger = meta_dataset(classes_per_client=5, images_per_client=200)
    assert len(bigger) > len(data)  # the images-per-client knob (Fig. 4)


def test_meta_dataset_refuses_more_classes_than_a_source_has():
    with pytest.raises(FedmetaError, match="dtd32 has 10 classes, fewer than classes_per_client=20"):
        meta_dataset(classes_per_client=20)


def test_cafeme_runs_on_meta_dataset(tmp_path):
    for name in ("omniglot.npz", "gtsrb32.npz", "dtd32.npz"):
        require(name)
    cfg = compose(
        [
            "dataset=meta_dataset",
            "dataset.options.sources=[omniglot,gtsrb32,dtd32]",
            "federation.num_clients=20",
            "federation.num_new_clients=4",
            "federation.clients_per_round=3",
            f"output.root={tmp_path}",
            "wandb.mode=disabled",
            "federation.rounds=2",
            "personalization.steps=5",
            *SMALL_32,
        ]
    )
    summary = train(cfg, show_progress=False)
    assert len(summary["curve"]) == 6 and 0 <= summary["accuracy"] <= 1


SMALL_28 = [
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "model.modulator.before_mean=[16,16]",
    "model.modulator.after_mean=[16]",
]
SETTINGS = {  # data set → (files it needs, overrides): every method must run on each
    # CIFAR-10's 50,000 images over 100 clients: 12 clients of ~4,000 images each took 6 minutes
    "cifar10": (
        ["cifar10-jpeg.tar.gz"],
        ["dataset=cifar10", "partition=dirichlet", "federation.num_clients=100", *SMALL_32],
    ),
    "femnist": (["femnist.npz"], ["dataset=femnist", "federation.num_clients=12", *SMALL_28]),
    "meta_dataset": (
        ["omniglot.npz", "gtsrb32.npz", "dtd32.npz"],
        [
            "dataset=meta_dataset",
            "dataset.options.sources=[omniglot,gtsrb32,dtd32]",
            "dataset.options.images_per_client=100",
            "federation.num_clients=12",
            *SMALL_32,
        ],
    ),
}


@pytest.mark.parametrize("dataset", sorted(SETTINGS))
def test_every_method_runs_on_every_data_set(dataset, cache, tmp_path):
    files, overrides = SETTINGS[dataset]
    for name in files:
        require(name)
    for method in group_choices("method"):
        cfg = compose(
            [
                *overrides,
                f"method={method}",
                "federation.num_new_clients=2",
                "federation.clients_per_round=2",
                "federation.rounds=1",
                "personalization.steps=2",
                f"output.root={tmp_path}",
                "wandb.mode=disabled",
            ]
        )
        summary = train(cfg, show_progress=False)
        assert summary["method"] == method and len(summary["curve"]) == 3 and 0 <= summary["accuracy"] <= 1
