"""The one test-time personalization procedure shared by every method.

Each new client starts from ``algorithm.personal_params``, takes ``steps`` SGD steps on batches
of its personalization split (step size decayed by ``decay`` every ``decay_every`` steps), and its
held-out accuracy is measured before the first step and after every step: a curve of steps+1
points. The batches come from the client's own seeded generator, so every method sees the same
batches: each drawn afresh (``batches=independent``) or read from a persistent drop_last iterator
(``stream``). The held-out split is scored in one pass, or in loader batches of
``held_out_batch_size`` (then each batch gives its own context and batch statistics, and the
accuracy is the mean of the per-batch accuracies, as a loop over a test loader computes it).
``personalize`` is a pure function of one client's parameters and batches, so
fedmeta.engine runs it for one client at a time or vmapped over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedmeta.algorithms import Algorithm
from fedmeta.algorithms.base import ClientData, step_weight
from fedmeta.data.federation import PERSONALIZE_PURPOSE, PERSONALIZE_STREAM_PURPOSE, STREAMS, Batch, Client
from fedmeta.errors import FedmetaError
from fedmeta.functional import Params, grad_and_value, masked_mean, sgd


@dataclass
class PersonalizationResult:
    curves: torch.Tensor  # (clients, steps + 1) held-out accuracy per client after each step
    samples: torch.Tensor | None = None  # (clients,) the samples each was scored on: the weighted mean
    clients: str = "new"  # "new" | "training": which protocol scored them
    training: PersonalizationResult | None = None  # beside the new clients', the training clients' (both)
    lr: float | None = None  # the step size the clients were personalized at
    lr_selection: dict[float, float] | None = None  # lr_rule=selected: each candidate's validation accuracy

    def __post_init__(
        self,
    ):  # a client that could not be evaluated (its node gone: fedmeta.flower) is a row of NaN
        scored = ~torch.isnan(self.curves).all(1)
        self.curves = self.curves[scored]
        if self.samples is not None:
            self.samples = self.samples[scored]

    @property
    def curve(self) -> list[float]:
        return self.curves.mean(0).tolist()

    @property
    def accuracy(self) -> float:
        return self.curves[:, -1].mean().item()

    @property
    def accuracy_std(self) -> float:
        return self.curves[:, -1].std(unbiased=False).item() if len(self.curves) > 1 else 0.0

    @property
    def training_clients(self) -> PersonalizationResult | None:
        """The training clients' result: this one, or the one beside it (protocol both), or None."""
        return self if self.clients == "training" else self.training

    @property
    def weighted_accuracy(self) -> float:
        """The share of all scored samples predicted right (each client weighted by its samples): what
        PFLlib and FL-bench print; ``accuracy`` is the mean over clients."""
        if self.samples is None:
            return self.accuracy
        weights = self.samples.to(self.curves.dtype)
        return ((self.curves[:, -1] * weights).sum() / weights.sum()).item()


def draw_personalization(algorithm: Algorithm, client: Client, cfg) -> ClientData:
    """A new client's batches: its held-out split (one batch, or loader batches in order), the
    context batch before any step, one batch per step."""
    generator = client.generator(0, PERSONALIZE_PURPOSE)
    held_out = client.batch("held_out", None, generator)
    if cfg.held_out_batch_size:
        held_out = client.epoch("held_out", cfg.held_out_batch_size, None)
    if cfg.batches in STREAMS:  # the first batch is also the context of the step-0 accuracy
        steps = client.stream(
            "pers",
            cfg.batch_size,
            0,
            max(cfg.steps, 1),
            PERSONALIZE_STREAM_PURPOSE,
            reshuffle=cfg.batches == "stream",
        )
        context, steps = steps[0], steps[: cfg.steps]
    else:
        context = client.batch("pers", cfg.batch_size, generator)
        steps = [client.batch("pers", cfg.batch_size, generator) for _ in range(cfg.steps)]
    return {
        "held_out": held_out,
        "context": context,
        "steps": steps,
        **algorithm.personalization_data(client),
    }


def step_sizes(cfg) -> list[float]:
    """``torch.optim.lr_scheduler.StepLR``'s schedule: lr·decay^⌊k / decay_every⌋ at step k."""
    return [cfg.lr * cfg.decay ** (k // cfg.decay_every) for k in range(cfg.steps)]


def personalize(
    algorithm: Algorithm, params: Params, data: ClientData, cfg, kept: dict | None = None
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    """From the global ``params``: the personalized parameters, the held-out accuracy after 0, 1, …,
    ``cfg.steps`` steps (after the last only, with ``cfg.every_step`` false) and the loss of each
    step. Accuracy is the share of correct predictions (written out rather than torchmetrics', whose
    input checks cannot run under vmap). ``kept``: a
    training client's kept state (the training-clients protocol), the start its method's model of it."""
    start = algorithm.personal_params(params, data) if kept is None else algorithm.kept_model(params, kept)
    held_out: list[Batch] = data["held_out"] if isinstance(data["held_out"], list) else [data["held_out"]]

    def held_out_accuracy(p: Params, last_batch: Batch) -> torch.Tensor:
        accuracies, weights = [], []
        with torch.no_grad():
            for batch in held_out:
                logits = algorithm(p, batch.x, algorithm.prediction_context(batch, last_batch), batch.mask)
                accuracies.append(masked_mean((logits.argmax(1) == batch.y).float(), batch.mask))
                weights.append(step_weight(batch))  # a padded (idle) batch of a stacked client counts 0
        if len(held_out) == 1:
            return accuracies[0]
        # a constant weight as a fill, not a host-to-device copy: a recorded evaluation (CUDA graph) cannot copy
        weights = torch.stack(
            [
                w.to(accuracies[0].dtype)
                if isinstance(w, torch.Tensor)
                else torch.full_like(accuracies[0], w)
                for w in weights
            ]
        )
        return (torch.stack(accuracies) * weights).sum() / weights.sum()

    # every_step false (a step-size candidate of lr_rule=selected, whose score is its last step's):
    # the held-out split is scored once, after the last step, not after each; the same last number
    steps = list(zip(data["steps"], step_sizes(cfg)))
    every_step = cfg.get("every_step", True) or not steps
    personal, losses = start, []
    accuracies = [held_out_accuracy(start, data["context"])] if every_step else []
    for step, (batch, lr) in enumerate(steps):
        names = algorithm.adapted_names(step) or list(personal)
        trained = {n: personal[n] for n in names}

        def loss_of(p: Params, fixed=personal, batch=batch) -> torch.Tensor:
            return algorithm.adaptation_loss({**fixed, **p}, batch, start)

        grads, loss = grad_and_value(loss_of)(trained)
        personal = {**personal, **sgd(trained, grads, lr)[0]}
        if every_step or step == len(steps) - 1:
            accuracies.append(held_out_accuracy(personal, batch))
        losses.append(loss.detach())
    return personal, torch.stack(accuracies), torch.stack(losses) if losses else torch.zeros(0)


class Diverged(FedmetaError):
    """A personalization whose loss went non-finite: a fault of the step size, which a step-size
    choice by validation (``lr_rule=selected``) counts as that candidate's failure, not the run's."""


def check_finite(client: Client, losses: torch.Tensor) -> None:
    if not bool(torch.isfinite(losses).all()):
        raise Diverged(
            f"personalizing client {client.id} gave a non-finite loss: "
            "lower personalization.lr or use fabric.precision=32-true"
        )


def personalize_client(
    algorithm: Algorithm, client: Client, cfg, kept: bool = False
) -> tuple[Params, torch.Tensor]:
    """One new client's personalized parameters and its held-out accuracy curve; ``kept``: a training
    client (its scoring view) from the model its method keeps for it."""
    params = algorithm.global_params()
    state = algorithm.client_state(client.id, params) if kept else None
    params, curve, losses = personalize(
        algorithm, params, draw_personalization(algorithm, client, cfg), cfg, state
    )
    check_finite(client, losses)
    return params, curve.cpu()
