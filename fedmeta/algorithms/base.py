"""The interface every algorithm implements, on top of a functional view of one global model.

A federated algorithm differs from another in three places only, and a subclass overrides just
those: ``local_update`` (what a sampled client does with the global parameters),
``aggregate`` (how the server combines the clients' results) and the personalization hooks
(``personal_params``, ``adaptation_loss``, ``adaptation_context``, ``prediction_context``) used
by the one test-time procedure that all methods share (fedmeta.evaluation).

Models are used as pure functions of a parameter dict (``torch.func.functional_call``), so a
client is data plus a seed: no per-client module copies, and the same code can later be
vmapped over the clients of a round.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from fedmeta.data.federation import Client
from fedmeta.functional import call

Params = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]
Context = tuple[torch.Tensor, torch.Tensor | None] | None


@dataclass
class ClientUpdate:
    client_id: int
    params: Params  # what the client sends to the server, detached: a subset of the global names
    weight: float  # its share in the aggregate
    loss: float  # the training loss it reports
    state: dict | None = None  # what the client keeps for its next round (FedRep's head, the authors' Adam moments)

    def to(self, device) -> ClientUpdate:
        return ClientUpdate(self.client_id, _tree_to(self.params, device), self.weight, self.loss, _tree_to(self.state, device))

    def is_finite(self) -> bool:
        checks = [torch.isfinite(p).all() for p in self.params.values()]
        return math.isfinite(self.loss) and (not checks or bool(torch.stack(checks).all()))  # one device sync


def _tree_to(tree, device):
    if isinstance(tree, dict):
        return {key: _tree_to(value, device) for key, value in tree.items()}
    return tree.to(device) if isinstance(tree, torch.Tensor) else tree


def trainable_copy(params: Params) -> Params:
    """Fresh leaf tensors with gradients, starting from ``params``."""
    return {name: p.detach().clone().requires_grad_() for name, p in params.items()}


class Algorithm(L.LightningModule):
    """A federated method around one global model ``self.model``."""

    def __init__(self, model: nn.Module, cfg):
        super().__init__()
        self.model = model
        self.cfg = cfg
        # Per-client state, only for algorithms defined by it: client id → what its last update kept.
        self.client_states: dict[int, dict] = {}
        self.autocast = nullcontext  # Fabric's autocast under bf16-mixed / 16-mixed (loop.setup)

    # ---- the model as a function of its parameters -------------------------------------------
    def global_params(self) -> Params:
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def run_model(self, module: nn.Module, params: Params, *inputs) -> torch.Tensor:
        """``module`` as a function of ``params``, under the run's precision; logits in float32.
        Autocast is entered per forward pass, not around a whole round: it caches the low-precision
        copies of leaf parameters until it exits, so in-place optimizer steps inside one long
        autocast region would go unseen by later forward passes."""
        with self.autocast():
            logits = call(module, params, *inputs)
        return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits

    def forward(self, params: Params, x: torch.Tensor, context: Context = None) -> torch.Tensor:
        return self.run_model(self.model, params, x)

    def loss(self, params: Params, batch: Batch, context: Context = None) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(params, x, context), y)

    # ---- federated training ------------------------------------------------------------------
    @abstractmethod
    def local_update(self, client: Client, round_: int) -> ClientUpdate:
        """Run a sampled client's local work from the current global parameters."""

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """Each global parameter becomes the weighted mean of the clients that sent it (FedAvg);
        one that no client sent keeps its value. ``updates`` are all the round's clients, in the
        round's order, on every Fabric rank — so every rank computes the same model."""
        for update in updates:
            if update.state is not None:
                self.client_states[update.client_id] = update.state
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                senders = [u for u in updates if name in u.params]
                if senders:
                    total = sum((u.weight * u.params[name] for u in senders), torch.zeros_like(p))
                    p.copy_(total / sum(u.weight for u in senders))

    def local_sgd(self, params: Params, client: Client, generator: torch.Generator, epochs: int, lr: float,
                  momentum: float = 0.0, trainable: list[str] | None = None) -> float:
        """``epochs`` shuffled passes of SGD over the client's data, updating ``params[trainable]``
        (all by default) in place; returns the mean training loss."""
        optimizer = torch.optim.SGD([params[n] for n in (trainable or params)], lr=lr, momentum=momentum)
        losses = []
        for _ in range(epochs):
            for batch in client.epoch("all", self.cfg.batch_size, generator):
                loss = self.loss(params, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
        return torch.stack(losses).mean().item()

    # ---- the shared test-time personalization (fedmeta.evaluation) ---------------------------
    def personal_params(self, client: Client) -> Params:
        """Where a new client's personalization starts: the global model by default."""
        return trainable_copy(self.global_params())

    def adaptation_loss(self, params: Params, batch: Batch) -> torch.Tensor:
        """The loss a personalization step minimizes (Ditto adds its proximal term)."""
        return self.loss(params, batch, self.adaptation_context(batch))

    def adaptation_context(self, batch: Batch) -> Context:
        """The context a personalization step on ``batch`` conditions on (none for plain models)."""
        return None

    def prediction_context(self, x: torch.Tensor, last_batch: Batch) -> Context:
        """The context used to classify held-out ``x`` after adapting on ``last_batch``."""
        return None

    # ---- the whole federation state, for checkpoints ----------------------------------------
    def federation_state(self) -> dict:
        return {"model": self.model.state_dict(), "client_states": self.client_states}

    def load_federation_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.client_states = dict(state.get("client_states", {}))
