"""Algorithms, one file each; ``build_algorithm`` makes the one a config names."""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientUpdate
from fedmeta.algorithms.cafeme import CAFeMe
from fedmeta.algorithms.ditto import Ditto
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedrep import FedRep
from fedmeta.algorithms.ifca import IFCA, ClusteredNets
from fedmeta.algorithms.local import Local
from fedmeta.algorithms.perfedavg import PerFedAvg
from fedmeta.errors import FedmetaError
from fedmeta.models import ModulatedNet, Modulator, build_base_net, set_channels_last

ALGORITHMS: dict[str, type[Algorithm]] = {
    "cafeme": CAFeMe,
    "fedavg": FedAvg,
    "ifca": IFCA,
    "ditto": Ditto,
    "fedrep": FedRep,
    "perfedavg": PerFedAvg,
    "local": Local,
}


def build_model(cfg, num_classes: int):
    """The global model a method trains: the base CNN; with the modulator for CAFeMe; k of them for IFCA.
    Activations are NHWC (faster convolutions on CPU) except for second-order CAFeMe, whose batch
    norm double backward is slower in it (and fedmeta.engine turns NHWC off for vmapped clients)."""
    model = _model(cfg, num_classes)
    set_channels_last(model, not (cfg.method.algorithm == "cafeme" and not cfg.method.first_order))
    return model


def _model(cfg, num_classes: int):
    shape = dict(
        in_channels=cfg.dataset.in_channels, image_size=cfg.dataset.image_size, num_classes=num_classes
    )
    if cfg.method.algorithm == "ifca":
        return ClusteredNets(
            lambda: build_base_net(cfg.model, **shape), cfg.method.clusters, cfg.method.share_body
        )
    base = build_base_net(cfg.model, **shape)
    if cfg.method.algorithm != "cafeme":
        return base
    modulator = Modulator(
        **shape,
        conv_channels=cfg.model.conv_channels,
        kernel_size=cfg.model.kernel_size,
        padding=cfg.model.padding,
        before_mean=cfg.model.modulator.before_mean,
        after_mean=cfg.model.modulator.after_mean,
        layer_sizes=base.hidden_sizes(include_flatten=cfg.method.modulate_flatten),
        modulation=cfg.method.modulation,
        use_labels=cfg.method.context == "labelled",
    )
    return ModulatedNet(base, modulator, modulate_flatten=cfg.method.modulate_flatten)


def build_algorithm(cfg, num_classes: int) -> Algorithm:
    name = cfg.method.algorithm
    if name not in ALGORITHMS:
        raise FedmetaError(f"unknown algorithm {name!r}: choose one of {sorted(ALGORITHMS)}")
    try:
        model = build_model(cfg, num_classes)
    except RuntimeError as exc:  # the conv stack, probed with the data's image size, does not fit it
        m = cfg.model
        raise FedmetaError(
            f"the model does not fit {cfg.dataset.image_size}×{cfg.dataset.image_size} images (conv_channels "
            f"{list(m.conv_channels)}, kernel_size {m.kernel_size}, padding {m.padding}: "
            f"{str(exc).splitlines()[0]}): use a smaller kernel, more padding or fewer conv blocks"
        ) from None
    return ALGORITHMS[name](model, cfg.method)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CAFeMe",
    "ClientUpdate",
    "Ditto",
    "FedAvg",
    "FedRep",
    "IFCA",
    "Local",
    "PerFedAvg",
    "build_algorithm",
    "build_model",
]
