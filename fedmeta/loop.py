"""The federated loop, run by Lightning Fabric: config → data → clients → rounds → metrics → runs/.

Each round samples M training clients; rank r of the Fabric world runs clients r, r+W, …; the
clients' updates are all-gathered and every rank aggregates all of them in the round's order, so
any number of processes computes the same global model, bit for bit. Every ``eval_every`` rounds
and at the end, the new clients run the shared personalization procedure (fedmeta.evaluation).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.fabric import Fabric
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from fedmeta import checkpoint
from fedmeta.algorithms import Algorithm, build_algorithm
from fedmeta.capture import resolve
from fedmeta.config import apply_overrides, compose, load_mapping, run_name, setting_name
from fedmeta.data import Federation, federation_of
from fedmeta.data.federation import FAILURE_PURPOSE, Client
from fedmeta.engine import Engine
from fedmeta.errors import FedmetaError
from fedmeta.evaluation import PersonalizationResult, draw_personalization
from fedmeta.runs import RunLock, RunRecorder, append_text, check_run_folder

log = logging.getLogger("fedmeta")


class _TensorCoreAdvice(logging.Filter):
    """Drops Lightning's advice to lower the float32 matmul precision on tensor-core GPUs: the
    choice is ``fabric.matmul_precision``, made in the config."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "set_float32_matmul_precision" not in record.getMessage()


def quiet_tensor_core_advice() -> None:
    """Filters the advice on the logger Lightning's rank-zero messages go to now (the module that
    imported last — lightning.fabric, lightning.pytorch or pytorch_lightning — names it)."""
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


def make_fabric(cfg: DictConfig) -> Fabric:
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


def gather_updates(fabric: Fabric) -> Callable[[list], list]:
    """Every rank's client results (updates, or a failed client's reason) to every rank, in the
    round's client order (rank r ran clients r, r+W, …). Aggregating the same list in the same
    order makes every rank — and one process alone — compute bit-identical global models, and
    carries per-client state to whichever rank runs that client next."""
    world = fabric.world_size
    if world == 1:
        return lambda updates: updates
    import torch.distributed as dist

    def move(result, device):  # a failed client's result is its reason, a string
        return result if isinstance(result, str) else result.to(device)

    def gather(results: list) -> list:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, [move(r, "cpu") for r in results])  # pickled: tensors travel via CPU
        total = sum(len(part) for part in everyone)
        return [move(everyone[i % world][i // world], fabric.device) for i in range(total)]

    return gather


DROPPED_OUT = (
    "dropped out"  # in the reason of a client that left its round (not a bug): simulated, or its node gone
)


class SimulatedClientFailure(RuntimeError):
    """A client dropping out of its round (``federation.client_failure_rate``)."""


@dataclass
class RoundOutcome:
    loss: float  # mean training loss of the clients that took part
    dropped: list[str]  # one line per client left out of the aggregate, and why
    error: str | None = None  # the round could not be aggregated (divergence or a bug): the run stops


@dataclass
class Federated:
    """One federation in a round: its algorithm (global model, client states), clients and seed."""

    algorithm: Algorithm
    federation: Federation
    seed: int


def federated_rounds(
    runs: list[Federated],
    round_: int,
    clients_per_round: int,
    shard: tuple[int, int] = (0, 1),
    gather=lambda updates: updates,
    engine: Engine | None = None,
    failure_rate: float = 0.0,
) -> list[RoundOutcome]:
    """One round of each federation (several with stacked seeds): sample M clients each, compute
    this rank's share of all of them together (``engine``), gather every client's update on every
    rank, and aggregate each federation's updates that finished with finite numbers.

    A client that raises or returns a non-finite update is dropped from its round with a reason;
    if every client of a federation fails, that is not a fault but a divergence (all non-finite)
    or a bug (all raised): its outcome carries the error and its run stops."""
    engine = engine or Engine()
    rank, world_size = shard
    mine: list[list[Client]] = [
        run.federation.sample_round(round_, clients_per_round, run.seed)[rank::world_size] for run in runs
    ]
    results: list[list] = [[None] * len(clients) for clients in mine]
    lanes, places = [], []
    for r, (run, clients) in enumerate(zip(runs, mine)):
        for i, client in enumerate(clients):
            if (
                failure_rate
                and torch.rand((), generator=client.generator(round_, FAILURE_PURPOSE)) < failure_rate
            ):
                results[r][i] = (
                    f"client {client.id} failed: {SimulatedClientFailure.__name__}: {DROPPED_OUT}, simulated "
                    "(federation.client_failure_rate)"
                )
            else:
                lanes.append((run.algorithm, client))
                places.append((r, i))
    for (r, i), result in zip(places, engine.local_updates(lanes, round_)):
        results[r][i] = result
    return [_aggregate(run.algorithm, round_, gather(run_results)) for run, run_results in zip(runs, results)]


def _aggregate(algorithm: Algorithm, round_: int, results: list) -> RoundOutcome:
    dropped = [r for r in results if isinstance(r, str)]
    finished = [r for r in results if not isinstance(r, str)]
    finite = [u.is_finite() for u in finished]  # one device sync per client
    updates = [u for u, ok in zip(finished, finite) if ok]
    dropped += [
        f"client {u.client_id} sent a non-finite loss or update (loss {u.loss})"
        for u, ok in zip(finished, finite)
        if not ok
    ]
    if not updates:
        if finished:
            bad = finished[0]
            return RoundOutcome(
                float("nan"),
                dropped,
                f"round {round_}: client {bad.client_id} produced a non-finite loss "
                f"or update (loss {bad.loss}), as did every client of the round: lower the learning rates "
                "or use fabric.precision=32-true",
            )
        if not all(DROPPED_OUT in line for line in dropped):
            return RoundOutcome(
                float("nan"),
                dropped,
                f"round {round_}: every client failed ({dropped[0]}): this is not a fault of one client",
            )
        return RoundOutcome(float("nan"), dropped)  # all dropped out: the global model stays as it is
    algorithm.aggregate(updates)
    return RoundOutcome(sum(u.loss for u in updates) / len(updates), dropped)


def federated_round(
    algorithm: Algorithm,
    federation: Federation,
    round_: int,
    clients_per_round: int,
    seed: int,
    shard: tuple[int, int] = (0, 1),
    gather=lambda updates: updates,
    engine: Engine | None = None,
    failure_rate: float = 0.0,
) -> RoundOutcome:
    """One round of one federation (``federated_rounds``); a divergence raises."""
    outcome = federated_rounds(
        [Federated(algorithm, federation, seed)],
        round_,
        clients_per_round,
        shard,
        gather,
        engine,
        failure_rate,
    )[0]
    if outcome.error:
        raise FedmetaError(outcome.error)
    return outcome


def evaluate_on_ranks(
    fabric: Fabric, runs: list[Federated], personalization: DictConfig, engine: Engine | None = None
) -> list[PersonalizationResult]:
    """The shared test-time procedure on every federation's new clients, all computed together
    and spread over the Fabric world like a round (rank r takes clients r, r+W, …); each
    federation's curves are gathered back in client order."""
    engine = engine or Engine()
    world, rank = fabric.world_size, fabric.global_rank
    mine = [run.federation.new_clients[rank::world] for run in runs]
    curves = engine.personalization_curves(
        [(run.algorithm, c) for run, clients in zip(runs, mine) for c in clients], personalization
    )
    results, offset = [], 0
    for run, clients in zip(runs, mine):
        own = curves[offset : offset + len(clients)]
        offset += len(clients)
        results.append(
            PersonalizationResult(
                own if world == 1 else _gather_curves(fabric, own, len(run.federation.new_clients))
            )
        )
    return results


def _gather_curves(fabric: Fabric, curves: torch.Tensor, total: int) -> torch.Tensor:
    slots = -(-total // fabric.world_size)
    padded = torch.full((slots, curves.shape[1]), float("nan"))
    padded[: len(curves)] = curves
    gathered = fabric.all_gather(padded.to(fabric.device)).cpu()  # (world, slots, steps + 1)
    # client i sits at rank i % W, slot i // W: interleave; the padding lands past the last client
    return gathered.transpose(0, 1).reshape(-1, curves.shape[1])[:total]


def hardware_name(device: torch.device) -> str:
    """The card's name, or the CPU model and the threads torch uses: what a timing ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    models = (
        [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        if cpuinfo.exists()
        else []
    )
    return f"{models[0] if models else platform.processor()}, {torch.get_num_threads()} thread(s)"


def build(fabric: Fabric, cfg: DictConfig) -> tuple[Federation, Algorithm]:
    """The federation (data on the device) and the algorithm of a config, seeded by its seed."""
    fabric.seed_everything(cfg.seed, verbose=False)
    dataset, federation = federation_of(cfg, device=fabric.device)
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
    vectorize, capture = resolve(cfg.federation.vectorize, cfg.federation.capture, device)
    if capture == "graph" and device.type != "cuda":
        raise FedmetaError(
            f"federation.capture=graph records CUDA graphs and needs a CUDA device, not {device.type}: "
            "use capture=static (the same layout, eagerly), compile or none"
        )
    return Engine(vectorize, cfg.federation.client_threads, cfg.federation.vectorize_lanes, capture)


TEST_TIME_KEYS = {
    "method.test_head_steps",
    "method.lam",
}  # method settings read only by new clients (FedRep, Ditto)


def evaluate_run(run_dir: Path, overrides: list[str], unfinished: bool = False) -> dict:
    """The shared test-time procedure again on a finished run's final model, with other
    ``personalization.*`` settings (e.g. the step size); appended to the run's evaluations.jsonl.
    ``unfinished`` allows the last checkpoint of a run that has not finished."""
    check_run_folder(run_dir)
    if not (run_dir / "checkpoint.ckpt").exists() or not (run_dir / "config.yaml").exists():
        raise FedmetaError(f"{run_dir} holds no run (config.yaml and checkpoint.ckpt): give a run folder")
    if not unfinished and not (run_dir / "summary.json").exists():
        raise FedmetaError(
            f"{run_dir} holds an unfinished run: finish it (output.resume=true), or evaluate its last "
            "checkpoint with --unfinished"
        )
    model_keys = [
        o
        for o in overrides
        if not o.startswith("personalization.") and o.split("=", 1)[0] not in TEST_TIME_KEYS
    ]
    if model_keys:
        raise FedmetaError(
            f"evaluate changes only personalization.* settings and {', '.join(sorted(TEST_TIME_KEYS))} "
            f"(the model is the run's): got {model_keys}"
        )
    saved = load_mapping(run_dir / "config.yaml", "the config.yaml fedmeta wrote for this run")
    try:
        choices = [
            f"dataset={saved.dataset.name}",
            f"partition={saved.partition.name}",
            f"method={saved.method.name}",
            f"variant={saved.variant}",
        ]
    except Exception:  # noqa: BLE001 — OmegaConf's missing-key errors
        raise FedmetaError(
            f"{run_dir / 'config.yaml'} does not name its dataset, partition, method and variant: "
            "it is not the config.yaml fedmeta wrote for this run"
        ) from None
    base = compose(choices)
    try:  # today's defaults under the saved config, so runs from before a new key still load
        OmegaConf.set_struct(base, False)
        cfg = OmegaConf.merge(base, saved)
        OmegaConf.set_struct(cfg, True)
    except Exception as exc:
        raise FedmetaError(
            f"{run_dir / 'config.yaml'} cannot be read as a fedmeta config ({exc})".splitlines()[0]
        ) from None
    cfg = apply_overrides(cfg, overrides)
    lock = RunLock(
        run_dir
    ).acquire()  # not while a training process writes the folder, nor two evaluations at once
    try:
        return _evaluate_run(run_dir, cfg)
    finally:
        lock.release()


def _evaluate_run(run_dir: Path, cfg: DictConfig) -> dict:
    fabric, federation, algorithm = setup(cfg)
    try:
        state = fabric.load(run_dir / "checkpoint.ckpt", weights_only=True)
        saved = state["identity"]
    except Exception as exc:
        raise FedmetaError(
            f"{run_dir / 'checkpoint.ckpt'} cannot be read ({type(exc).__name__}): it is corrupt or not "
            "a fedmeta checkpoint"
        ) from None
    # another seed's or experiment's checkpoint in this folder: refused, as a resume refuses it
    checkpoint.check_identity(
        run_dir / "checkpoint.ckpt",
        saved,
        cfg,
        ignore=("personalization.", *(f"{key}:" for key in TEST_TIME_KEYS)),
    )
    try:
        algorithm.load_federation_state(state["federation"])
    except Exception as exc:
        raise FedmetaError(
            f"{run_dir / 'checkpoint.ckpt'} cannot be loaded into this run's model "
            f"({type(exc).__name__}): it is corrupt or from another run"
        ) from None
    result = evaluate_on_ranks(
        fabric,
        [Federated(algorithm, federation, cfg.seed)],
        cfg.personalization,
        make_engine(cfg, fabric.device),
    )[0]
    record = {
        "personalization": OmegaConf.to_container(cfg.personalization),
        "accuracy": result.accuracy,
        "accuracy_std": result.accuracy_std,
        "curve": result.curve,
    }
    if fabric.is_global_zero:
        append_text(run_dir / "evaluations.jsonl", json.dumps(record) + "\n")
    return record


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
    draw_personalization(
        algorithm, min(federation.new_clients, key=lambda c: c.num_samples), cfg.personalization
    )


class Run:
    """One federation's run: its folder, model, clients, checkpoint and the metrics so far."""

    def __init__(self, fabric: Fabric, cfg: DictConfig, stacked: int):
        self.cfg, self.fabric, self.stacked = cfg, fabric, stacked
        self.started = time.perf_counter()
        self.dir = Path(cfg.output.root) / run_name(cfg)
        self.federation, self.algorithm = build(
            fabric, cfg
        )  # bad data or settings: refused before anything is on disk
        resuming = (
            cfg.output.resume
            and (self.dir / "checkpoint.ckpt").exists()
            and not (self.dir / "summary.json").exists()
        )
        self.warm_start = (
            None if resuming else checkpoint.warm_start(self.algorithm, cfg)
        )  # a resume has its own model
        rehearse(self.algorithm, self.federation, cfg)
        self.lock = RunLock(self.dir)
        if fabric.is_global_zero:
            self.lock.acquire()
        try:
            self._open()
        except BaseException:
            self.lock.release()
            raise

    def _open(self) -> None:
        """The checkpoint to resume from, and the run folder's recorder."""
        cfg, fabric = self.cfg, self.fabric
        self.checkpoint_path = self.dir / "checkpoint.ckpt"
        check_run_folder(self.dir)  # before anything in it is read
        state = None
        if cfg.output.resume and not (self.dir / "summary.json").exists():
            if self.checkpoint_path.exists():
                state = checkpoint.load(fabric, self.checkpoint_path, self.algorithm, cfg)
            elif fabric.is_global_zero:
                print(f"fedmeta: no checkpoint in {self.dir}: starting at round 1", file=sys.stderr)
        self.history = state["history"] if state else {}
        self.warm_start = self.history.get("warm_start", self.warm_start)
        tags = [
            cfg.dataset.name,
            cfg.partition.name,
            cfg.method.name,
            cfg.variant,
            str(cfg.fabric.precision),
            hardware_name(fabric.device),
        ]
        self.recorder = RunRecorder(self.dir, cfg, fabric.is_global_zero, self.history or None, tags)
        self.round_seconds = list(self.history.get("round_seconds", []))
        curves = self.history.get("last_curves")
        self.result = PersonalizationResult(curves) if curves is not None else None
        self.resumed_at = state["round"] if state else None
        self.first_round = (state["round"] + 1) if state else 1
        self.saved_round = state["round"] if state else None
        self.error: str | None = None

    @property
    def federated(self) -> Federated:
        return Federated(self.algorithm, self.federation, self.cfg.seed)

    def save_checkpoint(self, round_: int) -> None:
        checkpoint.save(
            self.fabric,
            self.checkpoint_path,
            self.algorithm,
            self.cfg,
            round_,
            {
                "metrics": self.recorder.rows,
                "curves": self.recorder.curves,
                "round_seconds": self.round_seconds,
                "last_curves": None if self.result is None else self.result.curves,
                "wandb_id": self.recorder.wandb_id,
                "warm_start": self.warm_start,
                "seconds": self.history.get("seconds", 0.0) + time.perf_counter() - self.started,
            },
        )
        self.saved_round = round_

    def fail(self, error: str) -> None:
        kept = (
            (
                f"the last good checkpoint (round {self.saved_round}) is kept in {self.checkpoint_path}: "
                "lower the learning "
                "rates and resume with output.resume=true"
            )
            if self.saved_round
            else "no checkpoint was written yet"
        )
        self.error = f"{self.dir}: {error}; {kept}" if self.stacked > 1 else f"{error}; {kept}"

    def summary(self) -> dict:
        cfg, fabric = self.cfg, self.fabric
        return {
            "setting": setting_name(cfg),
            "dataset": cfg.dataset.name,
            "partition": cfg.partition.name,
            "method": cfg.method.name,
            "variant": cfg.variant,
            "seed": cfg.seed,
            "accuracy": self.result.accuracy,
            "accuracy_std": self.result.accuracy_std,
            "curve": self.result.curve,
            "rounds": cfg.federation.rounds,
            "seconds": self.history.get("seconds", 0.0) + time.perf_counter() - self.started,
            "seconds_per_round": statistics.median(self.round_seconds) if self.round_seconds else None,
            "resumed_at_round": self.resumed_at,
            "new_clients": len(self.result.curves),
            "device": str(fabric.device),
            "world_size": fabric.world_size,
            "seeds_stacked": self.stacked,
            "hardware": hardware_name(fabric.device),
            "init_from": self.warm_start,  # the run whose final model this one started from (model.init_from)
        }


def train(
    cfg: DictConfig,
    show_progress: bool = True,
    on_evaluation: Callable[[int, float], None] | None = None,
    engine=None,
) -> dict | list[dict] | None:
    """Run one experiment end to end and return its summary (also written to summary.json; None
    on the other processes of a multi-process run). With ``seeds=[…]`` the seeds' federations run
    in lockstep in this process, their clients computed together, each in its own run folder
    exactly as a run of that seed alone; the summaries come back as a list.
    With ``output.resume=true`` an unfinished run continues from its last checkpoint.
    ``on_evaluation(round, accuracy)`` is called after each evaluation of a one-seed run (fedmeta
    tune reports to its pruner there; an exception it raises stops the run). ``engine`` computes
    the clients' work (default: fedmeta.engine's, from the config; fedmeta.flower's sends it to
    Flower SuperNodes)."""
    fabric = make_fabric(cfg)
    engine = engine or make_engine(
        cfg, fabric.device
    )  # a setting the device cannot run: refused before any folder
    configs = seed_configs(cfg)
    runs: list[Run] = []
    try:
        for one in configs:
            runs.append(Run(fabric, one, len(configs)))
        return _train(fabric, cfg, runs, show_progress, on_evaluation, engine)
    finally:
        for run in runs:
            run.recorder.close(
                "failed"
            )  # a run that stopped early (error, pruner, Ctrl-C); after finish: nothing left
            run.lock.release()  # a run that failed to set up never took its lock


def _train(
    fabric: Fabric,
    cfg: DictConfig,
    runs: list[Run],
    show_progress: bool,
    on_evaluation: Callable[[int, float], None] | None,
    engine: Engine,
) -> dict | list[dict] | None:
    fed = cfg.federation
    shard, gather = (fabric.global_rank, fabric.world_size), gather_updates(fabric)
    first = min(run.first_round for run in runs)
    label = (
        f"{cfg.method.name} {cfg.dataset.name}-{cfg.partition.name}"
        + (f" ×{len(runs)} seeds" if len(runs) > 1 else "")
        + f" [{fabric.device.type}, {engine.label()}]"
    )  # how it runs, said once at the start
    bar = tqdm(
        range(first, fed.rounds + 1),
        desc=label,
        disable=not (show_progress and fabric.is_global_zero),
        unit="round",
        initial=first - 1,
        total=fed.rounds,
    )
    for round_ in bar:
        active = [run for run in runs if run.error is None and run.first_round <= round_]
        if not active:
            break
        tick = time.perf_counter()
        outcomes = federated_rounds(
            [run.federated for run in active],
            round_,
            fed.clients_per_round,
            shard,
            gather,
            engine,
            fed.client_failure_rate,
        )
        seconds = (time.perf_counter() - tick) / len(active)  # a stacked seed's share of the lockstep round
        evaluating = [
            run
            for run, outcome in zip(active, outcomes)
            if outcome.error is None and (round_ % fed.eval_every == 0 or round_ == fed.rounds)
        ]
        tick = time.perf_counter()
        results = (
            evaluate_on_ranks(fabric, [run.federated for run in evaluating], cfg.personalization, engine)
            if evaluating
            else []
        )
        evaluations = dict(zip(map(id, evaluating), results))
        for run, outcome in zip(active, outcomes):
            if outcome.error:  # divergence: this run stops, its last good checkpoint stays as it is
                run.fail(outcome.error)
                continue
            run.round_seconds.append(seconds)
            if fabric.is_global_zero:
                for line in outcome.dropped:
                    log.warning(f"round {round_}: {line}; dropped from the aggregate")
            row = {
                "round": round_,
                "train_loss": outcome.loss,
                "round_seconds": seconds,
                "clients_dropped": len(outcome.dropped),
                "eval_accuracy": "",
                "eval_accuracy_std": "",
                "eval_step0_accuracy": "",
            }
            if id(run) in evaluations:
                run.result = evaluations[id(run)]
                row.update(
                    eval_accuracy=run.result.accuracy,
                    eval_accuracy_std=run.result.accuracy_std,
                    eval_step0_accuracy=run.result.curve[0],
                )
                run.recorder.log_curve(round_, run.result.curve)
            run.recorder.log_round(row)
            if on_evaluation and id(run) in evaluations and len(runs) == 1:
                on_evaluation(round_, run.result.accuracy)
            if round_ == fed.rounds or (fed.checkpoint_every and round_ % fed.checkpoint_every == 0):
                run.save_checkpoint(round_)
        shown = active[0]
        bar.set_postfix(
            loss=f"{outcomes[0].loss:.3f}",
            acc="-" if shown.result is None else f"{shown.result.accuracy:.3f}",
        )

    final = [
        run
        for run in runs
        if run.error is None and (not run.recorder.curves or run.recorder.curves[-1][0] != fed.rounds)
    ]
    if (
        final
    ):  # resumed at its last round (rounds lowered to the checkpoint's): the final evaluation is still due
        for run, result in zip(
            final, evaluate_on_ranks(fabric, [r.federated for r in final], cfg.personalization, engine)
        ):
            run.result = result
            run.recorder.log_curve(fed.rounds, result.curve)
            if (
                fed.rounds == 0
            ):  # a warm start evaluated as it is: its model is this run's, for evaluate and later runs
                run.save_checkpoint(0)
    summaries = []
    for run in runs:
        if run.error is None:
            summary = {**run.summary(), **engine.describe()}
            run.recorder.finish(summary, run.cfg)
            summaries.append(summary)
    failed = [run.error for run in runs if run.error]
    if failed:
        raise FedmetaError(
            failed[0]
            if len(failed) == 1
            else f"{len(failed)} of {len(runs)} seeds stopped: " + " | ".join(failed)
        )
    if not fabric.is_global_zero:
        return None
    return summaries if cfg.seeds else summaries[0]
