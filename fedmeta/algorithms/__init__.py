"""Algorithms, one file each, and their registry: ``build_algorithm`` makes the one a config names.

A method's code is its ``Algorithm`` subclass (the model it trains, and its delta on the
protocol); its defaults, the values its keys accept, its label and its tuning space are its
configs/method/<name>.yaml. docs/extending.md walks through adding one.
"""

from __future__ import annotations

import importlib
import os
import sys

from lightning.fabric.plugins import Precision

from fedmeta.algorithms.base import Algorithm, ClientUpdate
from fedmeta.algorithms.cafeme import CAFeMe
from fedmeta.algorithms.ditto import Ditto
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedrep import FedRep
from fedmeta.algorithms.ifca import IFCA, ClusteredNets
from fedmeta.algorithms.local import Local
from fedmeta.algorithms.perfedavg import PerFedAvg
from fedmeta.errors import FedmetaError
from fedmeta.models import set_channels_last

ALGORITHMS: dict[str, type[Algorithm]] = {
    "cafeme": CAFeMe,
    "fedavg": FedAvg,
    "ifca": IFCA,
    "ditto": Ditto,
    "fedrep": FedRep,
    "perfedavg": PerFedAvg,
    "local": Local,
}


def algorithm_class(name: str) -> type[Algorithm]:
    """A registered algorithm, or ``package.module:Class`` — an Algorithm subclass of your own package,
    named by a method file of your own (never by a run folder: see ``fedmeta.reevaluate``). It is
    imported from the installed packages and $PYTHONPATH, never from the working folder that
    ``python -m`` puts first on the path, where someone else's files (a shared run folder) may lie."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    module, _, attribute = str(name).partition(":")
    found = None
    if attribute:
        try:
            found = getattr(_import_outside_working_folder(module), attribute, None)
        except ImportError as exc:
            raise FedmetaError(
                f"method.algorithm {name!r}: cannot import {module} ({exc}): is its package on the path?"
            ) from None
    if isinstance(found, type) and issubclass(found, Algorithm):
        return found
    raise FedmetaError(
        f"unknown algorithm {name!r}: choose one of {sorted(ALGORITHMS)}, or give package.module:Class "
        "of an Algorithm subclass"
    )


def _import_outside_working_folder(module: str):
    """``python -m`` puts the working folder first on the path; $PYTHONPATH's entries stay."""
    path = sys.path[:]
    if path and path[0] in ("", os.getcwd()):
        del sys.path[0]
    try:
        return importlib.import_module(module)
    finally:
        sys.path[:] = path


def build_model(cfg, num_classes: int, sources: tuple[str, ...] = ()):
    """The global model the config's method trains, in the memory layout it runs fastest in."""
    cls = algorithm_class(cfg.method.algorithm)
    try:
        model = cls.build_model(cfg, num_classes, tuple(sources))
    except RuntimeError as exc:  # the conv stack, probed with the data's image size, does not fit it
        m = cfg.model
        raise FedmetaError(
            f"the model does not fit {cfg.dataset.image_size}×{cfg.dataset.image_size} images (conv_channels "
            f"{list(m.conv_channels)}, kernel_size {m.kernel_size}, padding {m.padding}: "
            f"{str(exc).splitlines()[0]}): use a smaller kernel, more padding or fewer conv blocks"
        ) from None
    set_channels_last(model, cls.channels_last(cfg))
    return model


def build_algorithm(
    cfg, num_classes: int, sources: tuple[str, ...] = (), precision: Precision | None = None
) -> Algorithm:
    """The config's method around a fresh global model; ``precision``: the run's Fabric plugin."""
    return algorithm_class(cfg.method.algorithm)(
        build_model(cfg, num_classes, sources), cfg.method, precision
    )


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CAFeMe",
    "ClientUpdate",
    "ClusteredNets",
    "Ditto",
    "FedAvg",
    "FedRep",
    "IFCA",
    "Local",
    "PerFedAvg",
    "algorithm_class",
    "build_algorithm",
    "build_model",
]
