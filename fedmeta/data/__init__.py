"""Data layer: canonical sources → image data sets → partitions → clients."""

from fedmeta.data.datasets import ImageDataset, load_dataset
from fedmeta.data.federation import Batch, Client, Federation, build_federation
from fedmeta.data.sources import data_dir


def scores_training_clients(cfg) -> bool:
    """Whether the config's evaluation scores the training clients (each then keeps a test split
    of the new clients' held-out fraction out of training)."""
    return cfg.evaluation.protocol in ("training_clients", "both")


def keeps_test_splits(cfg) -> bool:
    """Whether each training client keeps a test split out of training: to be scored on it (the
    training-clients protocol), or for a step size chosen by validation (``personalization.lr_rule=
    selected``; every method of such a table then trains on the same data, FedAvg's included)."""
    return scores_training_clients(cfg) or cfg.personalization.get("lr_rule", "method") == "selected"


def federation_of(cfg, device=None) -> tuple[ImageDataset, Federation]:
    """A config's data set and its clients (the data on ``device``), seeded by the config's seed."""
    dataset = load_dataset(
        cfg.dataset.name,
        data_dir(cfg.dataset.dir),
        cfg.seed,
        download=cfg.dataset.download,
        **cfg.dataset.options,
    )
    fed = cfg.federation
    federation = build_federation(
        dataset,
        dict(cfg.partition),
        fed.num_clients,
        fed.num_new_clients,
        fed.held_out_fraction,
        cfg.seed,
        device=device,
        test_fraction=fed.held_out_fraction if keeps_test_splits(cfg) else 0.0,
    )
    return dataset, federation


__all__ = [
    "Batch",
    "Client",
    "Federation",
    "ImageDataset",
    "build_federation",
    "federation_of",
    "keeps_test_splits",
    "load_dataset",
    "scores_training_clients",
]
