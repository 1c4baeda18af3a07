"""Partitioners: split sample indices among clients. Each is a pure function of its generator.

Every partitioner takes the labels, the optional natural groups, the number of clients and a
``numpy.random.Generator`` and returns one index array per client.
"""

from __future__ import annotations

import numpy as np

from fedmeta.errors import FedmetaError


def shards(
    labels: np.ndarray, groups, num_clients: int, rng: np.random.Generator, shards_per_client: int = 2
) -> list[np.ndarray]:
    """Sort by label, cut into ``num_clients·shards_per_client`` shards, deal them at random."""
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise FedmetaError(
            f"shards: {num_shards} shards cannot be cut from {len(labels)} samples: use fewer clients or "
            "shards_per_client"
        )
    by_label = np.argsort(labels, kind="stable")
    pieces = np.array_split(by_label, num_shards)
    dealt = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.concatenate([pieces[s] for s in client]) for client in dealt]


def dirichlet(
    labels: np.ndarray,
    groups,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float = 0.3,
    min_samples: int = 10,
    max_tries: int = 100,
    balance: bool = False,
) -> list[np.ndarray]:
    """For each class draw p ~ Dir(α) over clients and give client i the share p_i of that class.

    Draws are repeated until every client has ``min_samples`` (the usual guard, as in FL-bench);
    a setting where that never happens is reported instead of returning empty clients.
    ``balance``: class by class, a client already holding the mean client size or more gets no
    share of the next class (the others' shares renormalized) — FedLab's Dirichlet partitioner,
    which the CAFeMe authors used; client sizes vary far less than with plain Dirichlet.
    """
    if not alpha > 0:
        raise FedmetaError(f"dirichlet: alpha must be > 0, got {alpha}")
    if num_clients * min_samples > len(labels):
        raise FedmetaError(
            f"dirichlet: {num_clients} clients × {min_samples} samples exceed the {len(labels)} samples: "
            "use fewer clients"
        )
    classes = np.unique(labels)
    for _ in range(max_tries):
        clients: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            if balance:
                sizes = np.array([sum(len(part) for part in client) for client in clients])
                shares = shares * (sizes < len(labels) / num_clients)
                shares = shares / shares.sum()
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, part in zip(clients, np.split(members, cuts)):
                client.append(part)
        result = [np.concatenate(parts) for parts in clients]
        if min(len(r) for r in result) >= min_samples:
            return result
    raise FedmetaError(
        f"dirichlet: no draw in {max_tries} gave every client {min_samples} samples at alpha={alpha}: "
        "raise alpha or lower min_samples"
    )


def iid(labels: np.ndarray, groups, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """An i.i.d. equal split."""
    if num_clients > len(labels):
        raise FedmetaError(f"iid: {num_clients} clients need at least as many samples, got {len(labels)}")
    return np.array_split(rng.permutation(len(labels)), num_clients)


def by_group(labels: np.ndarray, groups, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Equal numbers of clients per natural group (RMNIST rotation), i.i.d. within a group."""
    if groups is None:
        raise FedmetaError("groups: this data set has no natural groups: choose another partition")
    group_ids = np.unique(groups)
    if num_clients % len(group_ids):
        raise FedmetaError(
            f"groups: {num_clients} clients cannot be spread evenly over {len(group_ids)} groups: use a "
            f"multiple of {len(group_ids)}"
        )
    per_group = num_clients // len(group_ids)
    return [
        part
        for g in group_ids
        for part in np.array_split(rng.permutation(np.flatnonzero(groups == g)), per_group)
    ]


def writers(
    labels: np.ndarray, groups, num_clients: int, rng: np.random.Generator, min_samples: int = 20
) -> list[np.ndarray]:
    """One client per natural group (FEMNIST's writers): ``num_clients`` groups drawn at random
    among those with at least ``min_samples`` samples, each client holding all of its group."""
    if groups is None:
        raise FedmetaError("writers: this data set has no writers: choose another partition")
    ids, counts = np.unique(groups, return_counts=True)
    eligible = ids[counts >= min_samples]
    if len(eligible) < num_clients:
        raise FedmetaError(
            f"writers: only {len(eligible)} writers have {min_samples} samples, {num_clients} clients asked: "
            "use fewer clients or lower min_samples"
        )
    return [np.flatnonzero(groups == w) for w in rng.choice(eligible, size=num_clients, replace=False)]


def sources(labels: np.ndarray, groups, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Meta-Dataset's natural partition: the data set already drew one group of images per client."""
    if groups is None or len(np.unique(groups)) != num_clients:
        raise FedmetaError("sources: only meta_dataset has this partition, built for the same num_clients")
    return [np.flatnonzero(groups == client) for client in range(num_clients)]


PARTITIONERS = {
    "shards": shards,
    "dirichlet": dirichlet,
    "iid": iid,
    "groups": by_group,
    "writers": writers,
    "sources": sources,
}


def partition(
    name: str, labels: np.ndarray, groups: np.ndarray | None, num_clients: int, seed: int, **params
) -> list[np.ndarray]:
    if name not in PARTITIONERS:
        raise FedmetaError(f"unknown partition {name!r}: choose one of {sorted(PARTITIONERS)}")
    if num_clients < 1:
        raise FedmetaError(f"num_clients must be ≥ 1, got {num_clients}")
    rng = np.random.default_rng([seed, 0x9A27])
    return PARTITIONERS[name](labels, groups, num_clients, rng, **params)
