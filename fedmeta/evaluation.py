"""The one test-time personalization procedure shared by every method (SPEC §4).

Each new client starts from ``algorithm.personal_params``, takes ``steps`` SGD steps on batches
of its personalization split (step size decayed by ``decay`` every ``decay_every`` steps), and its
held-out accuracy is measured before the first step and after every step: a curve of steps+1
points. The batches come from the client's own seeded generator, so every method sees the same
batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics.functional.classification import multiclass_accuracy

from fedmeta.algorithms import Algorithm
from fedmeta.algorithms.base import Params
from fedmeta.data.federation import PERSONALIZE_PURPOSE, Client
from fedmeta.errors import FedmetaError


ClientMap = Callable[[Callable[[Client], Any], list[Client]], list]  # runs a function on each client, in order


def sequential(fn: Callable[[Client], Any], clients: list[Client]) -> list:
    return [fn(client) for client in clients]


@dataclass
class PersonalizationResult:
    curves: torch.Tensor  # (clients, steps + 1) held-out accuracy per client after each step

    @property
    def curve(self) -> list[float]:
        return self.curves.mean(0).tolist()

    @property
    def accuracy(self) -> float:
        return self.curves[:, -1].mean().item()

    @property
    def accuracy_std(self) -> float:
        return self.curves[:, -1].std(unbiased=False).item() if len(self.curves) > 1 else 0.0


def personalize_client(algorithm: Algorithm, client: Client, cfg, num_classes: int) -> tuple[Params, torch.Tensor]:
    """The personalized parameters of ``client`` and its held-out accuracy after 0, 1, …, ``cfg.steps`` steps."""
    generator = client.generator(0, PERSONALIZE_PURPOSE)
    params = algorithm.personal_params(client)
    optimizer = torch.optim.SGD(params.values(), lr=cfg.lr)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.decay_every, gamma=cfg.decay)
    x_held_out, y_held_out = client.batch("held_out", None, generator)

    def held_out_accuracy(last_batch) -> torch.Tensor:
        with torch.no_grad():
            logits = algorithm(params, x_held_out, algorithm.prediction_context(x_held_out, last_batch))
        return multiclass_accuracy(logits, y_held_out, num_classes=num_classes, average="micro")

    batch = client.batch("pers", cfg.batch_size, generator)  # the context before any step
    accuracies, losses = [held_out_accuracy(batch)], []
    for _ in range(cfg.steps):
        batch = client.batch("pers", cfg.batch_size, generator)
        loss = algorithm.adaptation_loss(params, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        accuracies.append(held_out_accuracy(batch))
        losses.append(loss.detach())
    if losses and not bool(torch.isfinite(torch.stack(losses)).all()):
        raise FedmetaError(f"personalizing new client {client.id} gave a non-finite loss: "
                           "lower personalization.lr or use fabric.precision=32-true")
    return params, torch.stack(accuracies).cpu()


def evaluate_new_clients(algorithm: Algorithm, clients: list[Client], cfg, num_classes: int,
                         map_clients: ClientMap = sequential) -> PersonalizationResult:
    return PersonalizationResult(torch.stack(map_clients(lambda c: personalize_client(algorithm, c, cfg, num_classes)[1], clients)))
