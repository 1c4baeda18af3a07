"""Algorithms, one file each, and their registry: ``build_algorithm`` makes the one a config names.

A method's code is its ``Algorithm`` subclass (the model it trains, and its delta on the
protocol); its defaults, the values its keys accept, its label and its tuning space are its
configs/method/<name>.yaml. docs/extending.md walks through adding one.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from pathlib import Path

from lightning_fabric.plugins import Precision

from fedmeta.algorithms.apfl import APFL
from fedmeta.algorithms.base import Algorithm, ClientUpdate
from fedmeta.algorithms.cafeme import CAFeMe
from fedmeta.algorithms.ditto import Ditto
from fedmeta.algorithms.fedala import FedALA
from fedmeta.algorithms.fedamp import FedAMP
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedbabu import FedBABU
from fedmeta.algorithms.fedbn import FedBN
from fedmeta.algorithms.fedcp import FedCP
from fedmeta.algorithms.feddbe import FedDBE
from fedmeta.algorithms.feddyn import FedDyn
from fedmeta.algorithms.fedfomo import FedFomo
from fedmeta.algorithms.fedgh import FedGH
from fedmeta.algorithms.fedmeta import FedMeta
from fedmeta.algorithms.fednova import FedNova
from fedmeta.algorithms.fedpac import FedPAC
from fedmeta.algorithms.fedper import FedPer
from fedmeta.algorithms.fedproto import FedProto
from fedmeta.algorithms.fedprox import FedProx
from fedmeta.algorithms.fedrep import FedRep
from fedmeta.algorithms.fedrod import FedRoD
from fedmeta.algorithms.gpfl import GPFL
from fedmeta.algorithms.ifca import IFCA, ClusteredNets
from fedmeta.algorithms.lgfedavg import LGFedAvg
from fedmeta.algorithms.local import Local
from fedmeta.algorithms.moon import MOON
from fedmeta.algorithms.perfedavg import PerFedAvg
from fedmeta.algorithms.pfedhn import PFedHN
from fedmeta.algorithms.pfedme import PFedMe
from fedmeta.algorithms.scaffold import SCAFFOLD
from fedmeta.errors import FedmetaError
from fedmeta.models import ConvStackError, refuse_oversized, set_channels_last

ALGORITHMS: dict[str, type[Algorithm]] = {
    "cafeme": CAFeMe,
    "fedavg": FedAvg,
    "ifca": IFCA,
    "ditto": Ditto,
    "fedrep": FedRep,
    "fedper": FedPer,
    "lgfedavg": LGFedAvg,
    "fedbabu": FedBABU,
    "fedbn": FedBN,
    "perfedavg": PerFedAvg,
    "fedmeta": FedMeta,
    "pfedme": PFedMe,
    "apfl": APFL,
    "fedprox": FedProx,
    "scaffold": SCAFFOLD,
    "feddyn": FedDyn,
    "fedproto": FedProto,
    "fedrod": FedRoD,
    "fedala": FedALA,
    "fedpac": FedPAC,
    "local": Local,
    "moon": MOON,
    "fednova": FedNova,
    "fedfomo": FedFomo,
    "fedamp": FedAMP,
    "fedgh": FedGH,
    "feddbe": FedDBE,
    "gpfl": GPFL,
    "fedcp": FedCP,
    "pfedhn": PFedHN,
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
    source = _module_source(module) if attribute else None
    if attribute and source is None:
        raise FedmetaError(
            f"method.algorithm {name!r}: cannot import {module} (no such module among the installed packages "
            "and $PYTHONPATH): is its package on the path?"
        )
    if attribute and _holds(source, attribute):
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


def _module_source(module: str) -> Path | None:
    """The source file ``module`` would be imported from (installed packages and $PYTHONPATH, not
    the working folder), found without importing it or its package's ``__init__``; None if none."""
    path = list(sys.path)
    if path and path[0] in ("", os.getcwd()):
        path = path[1:]
    spec = None
    for part in module.split("."):
        search = path if spec is None else list(spec.submodule_search_locations or [])
        if not search:
            return None
        spec = importlib.machinery.PathFinder.find_spec(
            part if spec is None else f"{spec.name}.{part}", search
        )
        if spec is None:
            return None
    return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None


def _holds(source: Path, attribute: str) -> bool:
    """Whether the module's source defines, imports or assigns ``attribute`` at its top level: a
    module that could not hold the method (``this``, ``antigravity``) is never imported, so none of
    its code runs."""
    import ast

    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    names = set()
    for node in tree.body:  # defined there, imported into it, or assigned
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return attribute in names


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
        # sized from shapes first: terabytes of parameters are refused, never allocated
        refuse_oversized(lambda: cls.build_model(cfg, num_classes, tuple(sources)), cfg, num_classes)
        model = cls.build_model(cfg, num_classes, tuple(sources))
    except ConvStackError as exc:  # the conv stack, probed with the data's image size, does not fit it
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
    "FedMeta",
    "FedRep",
    "FedPer",
    "LGFedAvg",
    "FedBABU",
    "FedBN",
    "IFCA",
    "Local",
    "PerFedAvg",
    "PFedMe",
    "APFL",
    "FedProx",
    "SCAFFOLD",
    "algorithm_class",
    "build_algorithm",
    "build_model",
]
