"""A run's parts from its config: Fabric (processes, devices, precision), the federation with its
data on the device, the algorithm around a fresh global model, and the engine that computes the
clients' work. Everything a run or a benchmark needs before its first round, and nothing on disk."""

from __future__ import annotations

import logging
import os
import time

import torch
from lightning_fabric import Fabric
from omegaconf import DictConfig

from fedmeta.algorithms import Algorithm, build_algorithm
from fedmeta.allocator import keep_freed_memory
from fedmeta.capture import resolve
from fedmeta.data import Federation, federation_of, scores_training_clients
from fedmeta.engine import Engine
from fedmeta.errors import FedmetaError
from fedmeta.evaluation import draw_personalization
from fedmeta.fastest import vmap_measured_faster

phase = logging.getLogger("fedmeta.phase")  # at a terminal, what a slow start is doing (fedmeta.cli)


class _TensorCoreAdvice(logging.Filter):
    """Drops Lightning's advice to lower the float32 matmul precision on tensor-core GPUs: the
    choice is ``fabric.matmul_precision``, made in the config."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "set_float32_matmul_precision" not in record.getMessage()


def quiet_tensor_core_advice() -> None:
    """Filters the advice on the logger Lightning's rank-zero messages go to now (the module that
    imported last — lightning_fabric, lightning.fabric, lightning.pytorch or pytorch_lightning — names it)."""
    from lightning_utilities.core import rank_zero

    logger = rank_zero.log
    if not any(isinstance(f, _TensorCoreAdvice) for f in logger.filters):
        logger.addFilter(_TensorCoreAdvice())


# what Fabric's cluster environments read (torchrun, SLURM, LSF, Kubeflow, its own): a node among others
CLUSTER_VARIABLES = (
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "LSB_JOBID",
    "KUBERNETES_PORT",
    "NODE_RANK",
    "MASTER_ADDR",
)


def check_accelerator(cfg: DictConfig) -> None:
    """A GPU asked for on a machine that has none: refused at once, in one line."""
    if cfg.fabric.accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise FedmetaError(
            f"fabric.accelerator={cfg.fabric.accelerator}: this machine has no CUDA device that torch can use; "
            "run on the CPU (fabric.accelerator=cpu or auto) or on a GPU machine"
        )


def make_fabric(cfg: DictConfig) -> Fabric:
    check_accelerator(cfg)
    f = cfg.fabric
    on_cpu = f.accelerator == "cpu" or (f.accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and str(f.precision) == "16-mixed":  # Fabric would run bf16 while the config says 16
        raise FedmetaError("fabric.precision=16-mixed needs a GPU; on the CPU use bf16-mixed")
    if f.num_nodes > 1 and not any(os.environ.get(v) for v in CLUSTER_VARIABLES):
        raise FedmetaError(
            f"fabric.num_nodes={f.num_nodes} needs every node started by a launcher (torchrun, SLURM's "
            "srun, or NODE_RANK/MASTER_ADDR/MASTER_PORT set): alone, this process would wait for the "
            "other nodes forever; see docs/scaling.md"
        )
    torch.set_float32_matmul_precision(f.matmul_precision)
    quiet_tensor_core_advice()
    try:
        fabric = Fabric(
            accelerator=f.accelerator,
            devices=f.devices,
            num_nodes=f.num_nodes,
            strategy=f.strategy,
            precision=f.precision,
        )
    except (ValueError, RuntimeError, TypeError) as exc:
        raise FedmetaError(
            f"fabric settings rejected ({str(exc).splitlines()[0]}): check "
            "fabric.accelerator/devices/strategy/precision"
        ) from None
    fabric.launch()
    return fabric


def build(fabric: Fabric, cfg: DictConfig) -> tuple[Federation, Algorithm]:
    """The federation (data on the device) and the algorithm of a config, seeded by its seed."""
    fabric.seed_everything(cfg.seed, verbose=False)
    started = time.perf_counter()
    dataset, federation = federation_of(cfg, device=fabric.device)
    phase.info(
        f"{cfg.dataset.name}: {len(dataset):,} images over {len(federation.train_clients)} training and "
        f"{len(federation.new_clients)} new clients ({cfg.partition.name}), "
        f"seed {cfg.seed}, in {time.perf_counter() - started:.1f} s"
    )
    # Fabric converts the model to the run's precision and places it; the algorithm calls it as a
    # function of its parameters (Algorithm.run_model), under the same precision plugin, so the
    # wrapper itself is not kept: clients' updates are aggregated by fedmeta, not by DDP's hooks.
    algorithm = build_algorithm(cfg, federation.num_classes, dataset.sources, fabric.strategy.precision)
    return federation, fabric.setup_module(algorithm).module


def setup(cfg: DictConfig) -> tuple[Fabric, Federation, Algorithm]:
    """Fabric, the federation and the algorithm of a config, seeded."""
    fabric = make_fabric(cfg)
    return fabric, *build(fabric, cfg)


def make_engine(cfg: DictConfig, device: torch.device) -> Engine:
    """The engine the config asks for on ``device`` (``auto`` resolved: fedmeta.capture.resolve)."""
    vectorize, capture = resolve(
        cfg.federation.vectorize, cfg.federation.capture, device, vmap_measured_faster(cfg, device)
    )
    if capture == "graph" and device.type != "cuda":
        raise FedmetaError(
            f"federation.capture=graph records CUDA graphs and needs a CUDA device, not {device.type}: "
            "use capture=static (the same layout, eagerly) or none"
        )
    if capture == "graph":  # one fixed layout, recorded once: cuDNN may time its algorithms for it
        torch.backends.cudnn.benchmark = True
    if device.type == "cpu":
        keep_freed_memory()
    fed = cfg.federation
    return Engine(vectorize, fed.client_threads, fed.vectorize_lanes, capture, fed.lane_buckets)


def seed_configs(cfg: DictConfig) -> list[DictConfig]:
    """One config per federation of a run: ``seeds=[0,1,2]`` stacks three, each a plain run of its seed."""
    if not cfg.seeds:
        return [cfg]
    configs = []
    for seed in cfg.seeds:
        one = cfg.copy()
        one.seed, one.seeds = int(seed), None
        configs.append(one)
    return configs


def rehearse(algorithm: Algorithm, federation: Federation, cfg: DictConfig) -> None:
    """The draws of a round and of an evaluation on the smallest clients, once, before anything is on
    disk: what only the data can refuse (a batch larger than a client's data) is said before a run
    folder exists to block the corrected run. A draw has no effect but its result."""
    algorithm.draw(min(federation.train_clients, key=lambda c: c.num_samples), 1)
    scored = list(federation.new_clients) if cfg.evaluation.protocol != "training_clients" else []
    if scores_training_clients(cfg):
        scored += [c.scoring() for c in federation.train_clients]
    draw_personalization(algorithm, min(scored, key=lambda c: c.num_samples), cfg.personalization)
