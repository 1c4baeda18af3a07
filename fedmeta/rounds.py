"""One federated round and one evaluation, spread over the processes of a Fabric world.

Each round samples M training clients; rank r of the world runs clients r, r+W, …; the clients'
updates are all-gathered and every rank aggregates all of them in the round's order, so any number
of processes computes the same global model, bit for bit. The new clients' shared test-time
procedure (fedmeta.evaluation) is spread the same way and its curves gathered back in client order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from lightning_fabric import Fabric
from omegaconf import DictConfig, OmegaConf, open_dict

from fedmeta.algorithms import Algorithm, ClientUpdate
from fedmeta.data import Federation
from fedmeta.data.federation import FAILURE_PURPOSE, Client
from fedmeta.engine import Engine
from fedmeta.errors import FedmetaError
from fedmeta.evaluation import Diverged, PersonalizationResult


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
    gathered = [gather(run_results) for run_results in results]
    screened = iter(_screen([u for run_results in gathered for u in run_results if not isinstance(u, str)]))
    return [
        _aggregate(
            run.algorithm,
            round_,
            run_results,
            [next(screened) for u in run_results if not isinstance(u, str)],
        )
        for run, run_results in zip(runs, gathered)
    ]


def _screen(updates: list[ClientUpdate]) -> list[tuple[bool, float]]:
    """Each update's finiteness (its loss and every parameter it sends) and its loss, read from the
    device at once: one host read a round, however many clients and seeds (a check per client
    would make the host wait for the device once per client)."""
    if not updates:
        return []
    tensors = [u.loss for u in updates if isinstance(u.loss, torch.Tensor)]
    tensors += [p for u in updates for p in u.params.values()]
    device = tensors[0].device if tensors else torch.device("cpu")
    losses = torch.stack(  # then one cast, not one a client
        [
            u.loss
            if isinstance(u.loss, torch.Tensor)
            else torch.tensor(u.loss, dtype=torch.float64, device=device)
            for u in updates
        ]
    ).to(device, torch.float64)
    sent = [p for u in updates for p in u.params.values()]
    if sent:  # x·0 is 0 where x is finite, NaN where it is not: a norm of them is NaN if any is not
        norms = torch.stack(torch._foreach_norm(torch._foreach_mul(sent, 0.0), 2, dtype=torch.float64))
        owners = torch.tensor([i for i, u in enumerate(updates) for _ in u.params], device=device)
        losses_and_norms = losses + torch.zeros_like(losses).index_add_(0, owners, norms)
    else:
        losses_and_norms = losses
    finite, values = torch.stack([torch.isfinite(losses_and_norms).to(losses.dtype), losses]).tolist()
    return [(bool(ok), value) for ok, value in zip(finite, values)]


def _aggregate(
    algorithm: Algorithm, round_: int, results: list, screened: list[tuple[bool, float]]
) -> RoundOutcome:
    """``screened``: (finite, loss) of each update among ``results``, in order (``_screen``)."""
    dropped = [r for r in results if isinstance(r, str)]
    finished = [r for r in results if not isinstance(r, str)]
    finite = [ok for ok, _ in screened]
    losses = {id(u): loss for u, (_, loss) in zip(finished, screened)}
    updates = [u for u, ok in zip(finished, finite) if ok]
    dropped += [
        f"client {u.client_id} sent a non-finite loss or update (loss {losses[id(u)]})"
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
                f"or update (loss {losses[id(bad)]}), as did every client of the round: lower the learning rates "
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
    return RoundOutcome(sum(losses[id(u)] for u in updates) / len(updates), dropped)


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
    fabric: Fabric,
    runs: list[Federated],
    personalization: DictConfig,
    engine: Engine | None = None,
    done: Callable[[int], None] = lambda clients: None,
    protocol: str = "new_clients",
) -> list[PersonalizationResult]:
    """Every federation's clients scored by ``protocol`` (docs/protocol.md): the new clients by the
    shared test-time procedure, the training clients on their test splits with the model their
    method keeps for each (or, where it keeps none, the same procedure), or both (the new clients'
    result, the training clients' as its ``training``). All computed together and spread over the
    Fabric world like a round (rank r takes clients r, r+W, …); each federation's curves are
    gathered back in client order. ``done(n)``: n of this rank's clients finished.

    With ``personalization.lr_rule=selected`` each federation's step size is first chosen from
    ``lr_grid`` on its validation clients (``validation_clients``), never on the clients it scores;
    each result says the step size it was scored at and what every candidate gave."""
    engine = engine or Engine()
    chosen, selection = [personalization.lr] * len(runs), [None] * len(runs)
    if selects_lr(personalization):
        selection = _select_lr(fabric, runs, personalization, engine, done)
        chosen = [max(scores, key=lambda lr: (scores[lr], -lr)) for scores in selection]  # a tie: the smaller
    results: list[PersonalizationResult | None] = [None] * len(runs)
    for lr in dict.fromkeys(chosen):  # seeds that chose the same step size are scored together
        which = [i for i, own in enumerate(chosen) if own == lr]
        at = OmegaConf.merge(personalization, {"lr": lr})
        for i, result in zip(which, _scored_by(fabric, [runs[i] for i in which], at, engine, done, protocol)):
            result.lr, result.lr_selection = lr, selection[i]
            results[i] = result
    return results


def selects_lr(personalization: DictConfig) -> bool:
    """Whether the step size is chosen by validation (``lr_rule=selected``): a method scored without
    a step (FedAvg, IFCA) has none to choose."""
    return personalization.get("lr_rule", "method") == "selected" and personalization.steps > 0


def validation_clients(federated: Federated, count: int) -> list[Client]:
    """The training clients ``lr_rule=selected`` chooses the step size on: ``count`` of them, drawn by
    the run's seed, each as a new client would be — its training data to fine-tune on, its test split
    (kept out of training) to score — so the choice never sees a scored client's data."""
    clients = federated.federation.train_clients
    return [clients[i].scoring() for i in _validation_indices(federated, count)]


def _validation_indices(federated: Federated, count: int) -> list[int]:
    generator = torch.Generator().manual_seed(
        int(np.random.SeedSequence([federated.seed, 0x5E1EC7]).generate_state(1)[0])
    )
    order = torch.randperm(len(federated.federation.train_clients), generator=generator)
    return order[:count].sort().values.tolist()


def scored_training_clients(federated: Federated, personalization: DictConfig | None) -> list[Client]:
    """The training clients the training-clients protocol scores, each on its test split: all of them,
    except under ``lr_rule=selected``, where the validation clients are left out — their test splits
    chose the step size — for every method alike (one without steps too), so every method of a seed
    is scored on the same clients."""
    clients = federated.federation.train_clients
    left_out = set()
    if personalization is not None and personalization.get("lr_rule", "method") == "selected":
        left_out = set(_validation_indices(federated, personalization.select_clients))
    return [c.scoring() for i, c in enumerate(clients) if i not in left_out]


def _select_lr(
    fabric: Fabric, runs: list[Federated], personalization: DictConfig, engine: Engine, done
) -> list[dict[float, float]]:
    """Each federation's validation accuracy (mean over its validation clients after the last step)
    at every step size of ``lr_grid``."""
    every = [validation_clients(run, personalization.select_clients) for run in runs]
    scores: list[dict[float, float]] = [{} for _ in runs]
    for lr in personalization.lr_grid:
        at = OmegaConf.merge(personalization, {"lr": float(lr)})
        with open_dict(at):  # a candidate's score is its last step's: no held-out scoring before it
            at.every_step = False
        try:
            results = _scored(fabric, runs, at, engine, done, every, kept=False)
        except Diverged:  # that step size is too large for some client: it scores nothing
            results = [None] * len(runs)
        for i, result in enumerate(results):
            scores[i][float(lr)] = 0.0 if result is None else result.accuracy
    if all(not any(own.values()) for own in scores):
        raise FedmetaError(
            f"every step size of personalization.lr_grid {list(personalization.lr_grid)} diverged or scored "
            "nothing on the validation clients: give smaller ones"
        )
    return scores


def _scored_by(
    fabric: Fabric, runs: list[Federated], personalization: DictConfig, engine: Engine, done, protocol: str
) -> list[PersonalizationResult]:
    """``evaluate_on_ranks`` at one step size: the new clients, the training clients, or both."""
    new = training = None
    if protocol in ("new_clients", "both"):
        new = _scored(
            fabric, runs, personalization, engine, done, [run.federation.new_clients for run in runs]
        )
    if protocol in ("training_clients", "both"):
        every = [scored_training_clients(run, personalization) for run in runs]
        kept = runs[0].algorithm.keeps_client_models
        training = _scored(fabric, runs, personalization, engine, done, every, kept, "training")
    if new is None:
        return training
    for result, theirs in zip(new, training or [None] * len(new)):
        result.training = theirs
    return new


def scored_clients(
    runs: list[Federated], protocol: str, rank: int, world: int, personalization: DictConfig | None = None
) -> tuple[int, str]:
    """How many clients this rank scores in an evaluation by ``protocol`` (with the validation
    clients of a step size chosen by ``personalization``), and what it does to them."""
    count = 0
    if protocol in ("new_clients", "both"):
        count += sum(len(run.federation.new_clients[rank::world]) for run in runs)
    if protocol in ("training_clients", "both"):
        count += sum(len(scored_training_clients(run, personalization)[rank::world]) for run in runs)
    if personalization is not None and selects_lr(personalization):
        per_run = min(personalization.select_clients, len(runs[0].federation.train_clients))
        count += len(range(rank, per_run, world)) * len(runs) * len(personalization.lr_grid)
    if protocol == "new_clients":
        return count, "personalizing the new clients"
    return count, f"scoring the {'new and training' if protocol == 'both' else 'training'} clients"


def _scored(
    fabric: Fabric,
    runs: list[Federated],
    personalization: DictConfig,
    engine: Engine,
    done: Callable[[int], None],
    every: list[list[Client]],
    kept: bool = False,
    clients: str = "new",
) -> list[PersonalizationResult]:
    """Each federation's clients ``every[i]`` scored: new clients (or a training client's scoring view
    fine-tuned as one) by the test-time procedure, or training clients as their method keeps them
    (``kept``)."""
    world, rank = fabric.world_size, fabric.global_rank
    if kept:  # scored as the method keeps them, not fine-tuned further
        personalization = OmegaConf.merge(personalization, {"steps": 0})
    mine = [scored[rank::world] for scored in every]
    curves = engine.personalization_curves(
        [(run.algorithm, c) for run, own in zip(runs, mine) for c in own], personalization, done, kept
    )
    results, offset = [], 0
    for scored, own in zip(every, mine):
        part = curves[offset : offset + len(own)]
        offset += len(own)
        results.append(
            PersonalizationResult(
                part if world == 1 else _gather_curves(fabric, part, len(scored)),
                torch.tensor([len(c.held_out) for c in scored]),
                clients,
            )
        )
    return results


def _gather_curves(fabric: Fabric, curves: torch.Tensor, total: int) -> torch.Tensor:
    slots = -(-total // fabric.world_size)
    padded = torch.full((slots, curves.shape[1]), float("nan"))
    padded[: len(curves)] = curves
    # torch.distributed's own gather: Fabric's goes through an autograd-aware collective that
    # PyTorch now warns is deprecated, a warning every rank printed at every evaluation
    import torch.distributed as dist

    pieces = [torch.empty_like(padded, device=fabric.device) for _ in range(fabric.world_size)]
    dist.all_gather(pieces, padded.to(fabric.device))
    gathered = torch.stack(pieces).cpu()  # (world, slots, steps + 1)
    # client i sits at rank i % W, slot i // W: interleave; the padding lands past the last client
    return gathered.transpose(0, 1).reshape(-1, curves.shape[1])[:total]
