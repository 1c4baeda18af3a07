"""Algorithms, one file each; ``build_algorithm`` makes the one a config names."""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientUpdate
from fedmeta.algorithms.cafeme import CAFeMe
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.errors import FedmetaError
from fedmeta.models import ModulatedNet, Modulator, build_base_net

ALGORITHMS: dict[str, type[Algorithm]] = {"cafeme": CAFeMe, "fedavg": FedAvg}


def build_model(cfg, num_classes: int):
    """The global model a method trains: the base CNN, with the modulator for CAFeMe."""
    shape = dict(in_channels=cfg.dataset.in_channels, image_size=cfg.dataset.image_size, num_classes=num_classes)
    base = build_base_net(cfg.model, **shape)
    if cfg.method.algorithm != "cafeme":
        return base
    modulator = Modulator(**shape, conv_channels=cfg.model.conv_channels, kernel_size=cfg.model.kernel_size,
                          padding=cfg.model.padding, before_mean=cfg.model.modulator.before_mean,
                          after_mean=cfg.model.modulator.after_mean,
                          layer_sizes=base.hidden_sizes(include_flatten=cfg.method.modulate_flatten),
                          modulation=cfg.method.modulation, use_labels=cfg.method.context == "labelled")
    return ModulatedNet(base, modulator, modulate_flatten=cfg.method.modulate_flatten)


def build_algorithm(cfg, num_classes: int) -> Algorithm:
    name = cfg.method.algorithm
    if name not in ALGORITHMS:
        raise FedmetaError(f"unknown algorithm {name!r}: choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name](build_model(cfg, num_classes), cfg.method)


__all__ = ["ALGORITHMS", "Algorithm", "CAFeMe", "ClientUpdate", "FedAvg", "build_algorithm", "build_model"]
