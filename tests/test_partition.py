import numpy as np
import pytest

from fedmeta.data import build_federation
from fedmeta.data.partition import partition
from fedmeta.errors import FedmetaError


@pytest.fixture(scope="module")
def labels(rmnist):
    return rmnist.y.numpy()


@pytest.mark.parametrize(
    "name,params",
    [
        ("shards", {}),
        ("dirichlet", {"alpha": 0.3}),
        ("dirichlet", {"alpha": 0.3, "balance": True}),
        ("iid", {}),
        ("groups", {}),
    ],
)
def test_partitions_cover_disjoint_and_are_deterministic(rmnist, labels, name, params):
    groups = rmnist.groups.numpy()
    parts = partition(name, labels, groups, 100, seed=0, **params)
    assert len(parts) == 100
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything))  # disjoint
    assert len(everything) == len(labels)  # every sample is dealt
    again = partition(name, labels, groups, 100, seed=0, **params)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition(name, labels, groups, 100, seed=1, **params)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_shards_give_at_most_two_classes_to_most_clients(labels):
    parts = partition("shards", labels, None, 100, seed=0)
    classes = np.array([len(np.unique(labels[p])) for p in parts])
    assert (classes <= 2).mean() >= 0.9
    assert {len(p) for p in parts} == {600}


def _mean_dominant_share(labels, parts):
    return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])


def test_dirichlet_alpha_controls_label_skew(labels):
    skewed = _mean_dominant_share(labels, partition("dirichlet", labels, None, 100, seed=0, alpha=0.1))
    balanced = _mean_dominant_share(labels, partition("dirichlet", labels, None, 100, seed=0, alpha=1000.0))
    assert skewed > 0.5
    assert balanced < 0.2  # 10 classes: near-uniform shares


def test_balanced_dirichlet_stops_filling_clients_above_the_mean_size(labels):
    plain = np.array([len(p) for p in partition("dirichlet", labels, None, 100, seed=0, alpha=0.3)])
    balanced_parts = partition("dirichlet", labels, None, 100, seed=0, alpha=0.3, balance=True)
    balanced = np.array([len(p) for p in balanced_parts])
    assert balanced.std() < 0.75 * plain.std()  # sizes spread less (221 against 359 images here)
    assert balanced.max() < plain.max()
    assert _mean_dominant_share(labels, balanced_parts) > 0.4  # still label-skewed


def test_groups_put_ten_clients_in_each_rotation(rmnist, labels):
    groups = rmnist.groups.numpy()
    parts = partition("groups", labels, groups, 100, seed=0)
    rotation_of_client = [np.unique(groups[p]) for p in parts]
    assert all(len(r) == 1 for r in rotation_of_client)
    assert np.bincount([r[0] for r in rotation_of_client]).tolist() == [10] * 10


def test_federation_splits_clients_and_their_data(rmnist):
    fed = build_federation(rmnist, {"name": "shards"}, 100, 20, 0.2, seed=0)
    assert len(fed.train_clients) == 80 and len(fed.new_clients) == 20
    for client in fed.train_clients + fed.new_clients:
        assert len(client.held_out) == 120 and len(client.pers) == 480
        assert not set(client.held_out.tolist()) & set(client.pers.tolist())
    round_clients = fed.sample_round(1, 5, seed=0)
    assert len({c.id for c in round_clients}) == 5
    assert {c.id for c in round_clients} <= {c.id for c in fed.train_clients}
    x, y = round_clients[0].batch("pers", 30, round_clients[0].generator(1))[:2]
    x2, y2 = round_clients[0].batch("pers", 30, round_clients[0].generator(1))[:2]
    assert x.shape == (30, 1, 28, 28) and torch_equal(y, y2) and torch_equal(x, x2)

    # An epoch never ends in a batch of one (BatchNorm on batch statistics cannot train on it).
    client = fed.train_clients[0]
    sizes = [len(b.y) for b in client.epoch("pers", 479, client.generator(1))]
    assert sizes == [480]
    assert [len(b.y) for b in client.epoch("pers", 100, client.generator(1))] == [100, 100, 100, 100, 80]


def torch_equal(a, b):
    return bool((a == b).all())


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("dirichlet", {"alpha": 0.0}, "alpha must be > 0"),
        ("dirichlet", {"alpha": -1.0}, "alpha must be > 0"),
        ("shards", {"shards_per_client": 1000}, "cannot be cut"),
        ("nope", {}, "unknown partition"),
    ],
)
def test_impossible_partitions_are_refused(labels, name, params, message):
    with pytest.raises(FedmetaError, match=message):
        partition(name, labels, None, 100, seed=0, **params)


def test_groups_need_groups_and_a_multiple(labels, rmnist):
    with pytest.raises(FedmetaError, match="no natural groups"):
        partition("groups", labels, None, 100, seed=0)
    with pytest.raises(FedmetaError, match="evenly"):
        partition("groups", labels, rmnist.groups.numpy(), 95, seed=0)


def test_clients_too_small_for_two_splits_of_two_are_refused(rmnist):
    """10,000 clients of 6 images: a 20 % held-out split is 1 image, which BatchNorm's batch
    statistics cannot normalize — refused up front; a third held out (2 images) is accepted."""
    with pytest.raises(FedmetaError, match="too few for personalization and held-out splits of at least 2"):
        build_federation(rmnist, {"name": "iid"}, 10_000, 20, 0.2, seed=0)
    federation = build_federation(rmnist, {"name": "iid"}, 10_000, 20, 0.34, seed=0)
    assert min(len(c.held_out) for c in federation.train_clients) == 2


@pytest.mark.parametrize("batch_size, drop_last", [(30, False), (30, True), (479, False), (7, True)])
def test_a_clients_steps_drawn_at_once_are_its_batches_drawn_one_at_a_time(rmnist, batch_size, drop_last):
    """``Client.epochs`` and ``Client.batches`` (one gather for all steps) give the batches that
    ``epoch`` and ``batch`` give one after another from the same generator: a run's draws do not
    depend on which way they were made."""
    client = build_federation(rmnist, {"name": "dirichlet", "alpha": 0.5}, 20, 2, 0.2, seed=0).train_clients[
        3
    ]
    together = client.epochs("all", batch_size, client.generator(1), 3, drop_last)
    generator = client.generator(1)
    apart = [b for _ in range(3) for b in client.epoch("all", batch_size, generator, drop_last)]
    assert len(together) == len(apart) > 3
    assert all(torch_equal(a.x, b.x) and torch_equal(a.y, b.y) for a, b in zip(together, apart))
    fixed = client.epochs("all", batch_size, client.generator(1), 2, drop_last, reshuffle=False)
    assert torch_equal(fixed[0].y, fixed[len(fixed) // 2].y)  # one order, fixed at the start, every epoch
    together = client.batches("pers", batch_size, client.generator(2), 4)
    generator = client.generator(2)
    apart = [client.batch("pers", batch_size, generator) for _ in range(4)]
    assert len(together) == 4
    assert all(torch_equal(a.x, b.x) and torch_equal(a.y, b.y) for a, b in zip(together, apart))
