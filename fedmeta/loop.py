"""The federated loop, run by Lightning Fabric: config → data → clients → rounds → metrics → runs/.

Each round samples M training clients; rank r of the Fabric world runs clients r, r+W, …; the
clients' updates are all-gathered and every rank aggregates all of them in the round's order, so
any number of processes computes the same global model, bit for bit. Every ``eval_every`` rounds
and at the end, the new clients run the shared personalization procedure (fedmeta.evaluation).
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.fabric import Fabric
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from fedmeta import checkpoint
from fedmeta.algorithms import Algorithm, ClientUpdate, build_algorithm
from fedmeta.config import compose, run_name, setting_name
from fedmeta.data import Federation, build_federation, load_dataset
from fedmeta.data.federation import FAILURE_PURPOSE, Client
from fedmeta.data.sources import data_dir
from fedmeta.errors import FedmetaError
from fedmeta.evaluation import ClientMap, PersonalizationResult, evaluate_new_clients, sequential
from fedmeta.runs import RunRecorder

log = logging.getLogger("fedmeta")


def make_fabric(cfg: DictConfig) -> Fabric:
    f = cfg.fabric
    try:
        fabric = Fabric(accelerator=f.accelerator, devices=f.devices, num_nodes=f.num_nodes, strategy=f.strategy,
                        precision=f.precision)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise FedmetaError(f"fabric settings rejected ({str(exc).splitlines()[0]}): check fabric.accelerator/devices/strategy/precision") from None
    fabric.launch()
    return fabric


def client_map(threads: int) -> ClientMap:
    """How the clients of a round (and the new clients at evaluation) run: one after another, or
    ``threads`` at a time, each on one intra-op thread — a client's small ops use CPU cores better
    side by side than split across them. A client's result does not depend on the thread that ran it."""
    if threads <= 1:
        return sequential
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="client")
    return lambda fn, clients: list(pool.map(fn, clients))


def gather_updates(fabric: Fabric) -> Callable[[list], list]:
    """Every rank's client results (updates, or a failed client's reason) to every rank, in the round's client order (rank r ran clients
    r, r+W, …). Aggregating the same list in the same order makes every rank — and one process
    alone — compute bit-identical global models, and carries per-client state to whichever rank
    runs that client next."""
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


class SimulatedClientFailure(RuntimeError):
    """A client dropping out of its round (``federation.client_failure_rate``)."""


@dataclass
class RoundOutcome:
    loss: float  # mean training loss of the clients that took part
    dropped: list[str]  # one line per client left out of the aggregate, and why


def federated_round(algorithm: Algorithm, federation: Federation, round_: int, clients_per_round: int, seed: int,
                    shard: tuple[int, int] = (0, 1), gather=lambda updates: updates,
                    map_clients: ClientMap = sequential, failure_rate: float = 0.0) -> RoundOutcome:
    """One round: sample M clients, run this rank's share of them, gather every client's update
    on every rank, aggregate those that finished with finite numbers.

    A client that raises or returns a non-finite update is dropped from this round with a reason;
    if every client fails, the round is not a fault but a divergence (all non-finite) or a bug
    (all raised), and it stops the run."""
    rank, world_size = shard
    clients = federation.sample_round(round_, clients_per_round, seed)

    def attempt(client: Client) -> ClientUpdate | str:
        try:
            if failure_rate and torch.rand((), generator=client.generator(round_, FAILURE_PURPOSE)) < failure_rate:
                raise SimulatedClientFailure("simulated failure (federation.client_failure_rate)")
            return algorithm.local_update(client, round_)
        except (FedmetaError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 — a failing client is dropped, not the run
            return f"client {client.id} failed: {type(exc).__name__}: {exc}".splitlines()[0]

    results = gather(map_clients(attempt, clients[rank::world_size]))
    dropped = [r for r in results if isinstance(r, str)]
    finished = [r for r in results if not isinstance(r, str)]
    finite = [u.is_finite() for u in finished]  # one device sync per client
    updates = [u for u, ok in zip(finished, finite) if ok]
    dropped += [f"client {u.client_id} sent a non-finite loss or update (loss {u.loss})"
                for u, ok in zip(finished, finite) if not ok]
    if not updates:
        if finished:
            bad = finished[0]
            raise FedmetaError(f"round {round_}: client {bad.client_id} produced a non-finite loss or update "
                               f"(loss {bad.loss}), as did every client of the round: lower the learning rates "
                               "or use fabric.precision=32-true")
        if not all("simulated failure" in line for line in dropped):
            raise FedmetaError(f"round {round_}: every client failed ({dropped[0]}): this is not a fault of one client")
        return RoundOutcome(float("nan"), dropped)  # all dropped out: the global model stays as it is
    algorithm.aggregate(updates)
    return RoundOutcome(sum(u.loss for u in updates) / len(updates), dropped)


def evaluate_on_ranks(fabric: Fabric, algorithm: Algorithm, federation: Federation, personalization: DictConfig,
                      map_clients: ClientMap = sequential) -> PersonalizationResult:
    """The shared test-time procedure on the new clients, spread over the Fabric world like a
    round (rank r takes clients r, r+W, …); the curves are gathered back in client order."""
    world, rank, clients = fabric.world_size, fabric.global_rank, federation.new_clients
    mine = clients[rank::world]
    curves = (evaluate_new_clients(algorithm, mine, personalization, federation.num_classes, map_clients).curves
              if mine else torch.empty(0, personalization.steps + 1))
    if world == 1:
        return PersonalizationResult(curves)
    slots = -(-len(clients) // world)
    padded = torch.full((slots, curves.shape[1]), float("nan"))
    padded[:len(curves)] = curves
    gathered = fabric.all_gather(padded.to(fabric.device)).cpu()  # (world, slots, steps + 1)
    # client i sits at rank i % W, slot i // W: interleave; the padding lands past the last client
    return PersonalizationResult(gathered.transpose(0, 1).reshape(-1, curves.shape[1])[:len(clients)])


def hardware_name(device: torch.device) -> str:
    """The card's name, or the CPU model and the threads torch uses: what a timing ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{models[0] if models else platform.processor()}, {torch.get_num_threads()} thread(s)"


def setup(cfg: DictConfig) -> tuple[Fabric, Federation, Algorithm]:
    """Fabric, the federation (data on the device) and the algorithm of a config, seeded."""
    fabric = make_fabric(cfg)
    fabric.seed_everything(cfg.seed, verbose=False)
    dataset = load_dataset(cfg.dataset.name, data_dir(cfg.dataset.dir), cfg.seed, download=cfg.dataset.download,
                           **cfg.dataset.options)
    fed = cfg.federation
    federation = build_federation(dataset, dict(cfg.partition), fed.num_clients, fed.num_new_clients,
                                  fed.held_out_fraction, cfg.seed, device=fabric.device)
    algorithm = fabric.to_device(build_algorithm(cfg, federation.num_classes))
    algorithm.autocast = fabric.autocast  # entered per forward pass (Algorithm.run_model)
    return fabric, federation, algorithm


def evaluate_run(run_dir: Path, overrides: list[str]) -> dict:
    """The shared test-time procedure again on a finished run's final model, with other
    ``personalization.*`` settings (e.g. the step size); appended to the run's evaluations.jsonl."""
    if not (run_dir / "checkpoint.ckpt").exists() or not (run_dir / "config.yaml").exists():
        raise FedmetaError(f"{run_dir} holds no finished run (config.yaml and checkpoint.ckpt): give a run folder")
    if any(not o.startswith("personalization.") for o in overrides):
        raise FedmetaError("evaluate changes only personalization.* settings (the model is the run's): "
                           f"got {[o for o in overrides if not o.startswith('personalization.')]}")
    saved = OmegaConf.load(run_dir / "config.yaml")
    try:  # today's defaults under the saved config, so runs from before a new key still load
        base = compose([f"dataset={saved.dataset.name}", f"partition={saved.partition.name}",
                        f"method={saved.method.name}", f"variant={saved.variant}"])
        OmegaConf.set_struct(base, False)
        cfg = OmegaConf.merge(base, saved, OmegaConf.from_dotlist(overrides))
    except Exception as exc:
        raise FedmetaError(f"bad override ({exc})") from None
    fabric, federation, algorithm = setup(cfg)
    try:
        state = fabric.load(run_dir / "checkpoint.ckpt")
        algorithm.load_federation_state(state["federation"])
    except Exception as exc:
        raise FedmetaError(f"{run_dir / 'checkpoint.ckpt'} cannot be loaded into this run's model "
                           f"({type(exc).__name__}): it is corrupt or from another run") from None
    result = evaluate_on_ranks(fabric, algorithm, federation, cfg.personalization, client_map(cfg.federation.client_threads))
    record = {"personalization": OmegaConf.to_container(cfg.personalization), "accuracy": result.accuracy,
              "accuracy_std": result.accuracy_std, "curve": result.curve}
    if fabric.is_global_zero:
        with open(run_dir / "evaluations.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def train(cfg: DictConfig, show_progress: bool = True) -> dict | None:
    """Run one experiment end to end and return its summary (also written to summary.json; None
    on the other processes of a multi-process run).
    With ``output.resume=true`` an unfinished run continues from its last checkpoint."""
    started = time.perf_counter()
    run_dir = Path(cfg.output.root) / run_name(cfg)
    fabric, federation, algorithm = setup(cfg)
    fed = cfg.federation
    checkpoint_path = run_dir / "checkpoint.ckpt"
    state = None
    if cfg.output.resume and not (run_dir / "summary.json").exists():
        if checkpoint_path.exists():
            state = checkpoint.load(fabric, checkpoint_path, algorithm, cfg)
        elif fabric.is_global_zero:
            print(f"fedmeta: no checkpoint in {run_dir}: starting at round 1", file=sys.stderr)
    history = state["history"] if state else {}
    recorder = RunRecorder(run_dir, cfg, fabric.is_global_zero, history or None)

    shard, gather = (fabric.global_rank, fabric.world_size), gather_updates(fabric)
    map_clients = client_map(fed.client_threads)
    round_seconds = list(history.get("round_seconds", []))
    result = PersonalizationResult(history["last_curves"]) if history.get("last_curves") is not None else None
    first_round, saved_round = (state["round"] + 1, state["round"]) if state else (1, None)

    def save_checkpoint(round_: int) -> None:
        checkpoint.save(fabric, checkpoint_path, algorithm, cfg, round_, {
            "metrics": recorder.rows, "curves": recorder.curves, "round_seconds": round_seconds,
            "last_curves": None if result is None else result.curves, "wandb_id": recorder.wandb_id,
            "seconds": history.get("seconds", 0.0) + time.perf_counter() - started})

    bar = tqdm(range(first_round, fed.rounds + 1), desc=f"{cfg.method.name} {cfg.dataset.name}-{cfg.partition.name}",
               disable=not (show_progress and fabric.is_global_zero), unit="round", initial=first_round - 1, total=fed.rounds)
    for round_ in bar:
        tick = time.perf_counter()
        try:
            outcome = federated_round(algorithm, federation, round_, fed.clients_per_round, cfg.seed, shard, gather,
                                      map_clients, fed.client_failure_rate)
        except FedmetaError as exc:  # divergence: the last good checkpoint stays as it is
            kept = (f"the last good checkpoint (round {saved_round}) is kept in {checkpoint_path}: lower the learning "
                    "rates and resume with output.resume=true") if saved_round else "no checkpoint was written yet"
            raise FedmetaError(f"{exc}; {kept}") from None
        round_seconds.append(time.perf_counter() - tick)

        if fabric.is_global_zero:
            for line in outcome.dropped:
                log.warning(f"round {round_}: {line}; dropped from the aggregate")
        row = {"round": round_, "train_loss": outcome.loss, "round_seconds": round_seconds[-1],
               "clients_dropped": len(outcome.dropped),
               "eval_accuracy": "", "eval_accuracy_std": "", "eval_step0_accuracy": ""}
        if round_ % fed.eval_every == 0 or round_ == fed.rounds:
            result = evaluate_on_ranks(fabric, algorithm, federation, cfg.personalization, map_clients)
            row.update(eval_accuracy=result.accuracy, eval_accuracy_std=result.accuracy_std, eval_step0_accuracy=result.curve[0])
            recorder.log_curve(round_, result.curve)
        recorder.log_round(row)
        bar.set_postfix(loss=f"{outcome.loss:.3f}", acc="-" if result is None else f"{result.accuracy:.3f}")
        if round_ == fed.rounds or (fed.checkpoint_every and round_ % fed.checkpoint_every == 0):
            save_checkpoint(round_)
            saved_round = round_

    summary = {
        "setting": setting_name(cfg), "dataset": cfg.dataset.name, "partition": cfg.partition.name, "method": cfg.method.name,
        "variant": cfg.variant, "seed": cfg.seed,
        "accuracy": result.accuracy, "accuracy_std": result.accuracy_std, "curve": result.curve,
        "rounds": fed.rounds, "seconds": history.get("seconds", 0.0) + time.perf_counter() - started,
        "seconds_per_round": statistics.median(round_seconds), "resumed_at_round": state["round"] if state else None,
        "new_clients": len(federation.new_clients), "device": str(fabric.device), "world_size": fabric.world_size,
        "hardware": hardware_name(fabric.device),
    }
    recorder.finish(summary)
    return summary if fabric.is_global_zero else None
