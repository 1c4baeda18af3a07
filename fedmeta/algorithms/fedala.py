"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023).

FedAvg's server and local training; what changes is how a client takes the global model. It keeps
its own local model θ_i from its last round. On receiving the global θ, its lower layers take θ's,
and its top layers become θ_i + (θ − θ_i) ⊙ W_i, with W_i element-wise weights in [0, 1] that the
client learns: on a random s % of its data it steps W_i ← clip(W_i − η·∇_θ L ⊙ (θ − θ_i), 0, 1),
the gradient taken at the blended model, batch by batch. It then trains from that start as in
FedAvg and sends the result.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The top layers: the last ``top_tensors`` parameter tensors in model order (2: the classifier's
  weight and bias, the reference code's default; the paper's p counts layers, p = 1 here).
  s = 80 % (``sample_fraction``) as a contiguous run of the client's data from a random place,
  in batches of the protocol's size with a last partial one left out; η = 1 (``ala_lr``). W_i
  starts at 1.
- When: every time a client trains, as the paper and the reference code. Before its first round a
  client's local model is the initial model (the reference code gives every client a copy of it),
  so on a first round ALA blends the global model into the initial one's top layers. The one
  exception is the reference code's: ALA is skipped while the local model equals the global one,
  which happens in round 1 only (the global model is still the initial one) — here, for a client
  whose first round is round 1. The first time ALA runs, the reference code trains W_i until the
  standard deviation of its last 10 epochs' losses falls below 0.1 (at least 11 epochs); here a
  fixed ``first_epochs`` (11, the least that rule allows), so that the computation's shape is known
  in advance and clients can be vmapped. Later rounds: one epoch.
- Per-client state: the top layers of the model the client trained last round, W_i, and whether
  W_i has been trained (on Flower, on its node); the initial model's top layers (part of the
  federation state) stand in for a client's before its first round. The lower layers need no
  keeping: they always take the global model's.
- Evaluation: new clients are scored (the paper's protocol). A new client trains no round, so ALA does not run for
  it: the shared personalization procedure fine-tunes the global model (``personalization.steps``:
  50) — FedAvg-FT's procedure on FedALA's global model.
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult, unless_idle
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import AGGREGATION_PURPOSE, Client
from fedmeta.functional import Params, grad_and_value


class FedALA(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        names = [name for name, _ in self.model.named_parameters()]
        self.top_names = names[-cfg.top_tensors :]
        # every client's local model before its first round: the initial model (its top layers)
        self.initial = {
            n: p.detach().clone() for n, p in self.model.named_parameters() if n in self.top_names
        }
        self.ala_runs: dict[int, bool] = {}  # whether the window drawn this round trains W_i (for to_update)

    def draw(self, client: Client, round_: int) -> ClientData:
        kept = self.client_states.get(client.id, {})
        # skipped only where the local model is the global one: a first round that is round 1
        runs = "local" in kept or round_ > 1
        self.ala_runs[client.id] = runs
        epochs = 0 if not runs else (1 if kept.get("weights_trained") else self.cfg.first_epochs)
        window = client.window(
            self.cfg.train_split,
            self.cfg.sample_fraction,
            self.cfg.batch_size,
            client.generator(round_, AGGREGATION_PURPOSE),
        )
        return {**super().draw(client, round_), "ala": window * epochs}

    def client_state(self, client_id: int, params: Params) -> dict:
        kept = self.client_states.get(client_id, {})
        local = kept.get("local", self.initial)  # before its first round: the initial model's
        weights = kept.get("weights", {})
        return {
            "local": {n: local[n].to(params[n]) for n in self.top_names},
            "weights": {
                n: weights[n].to(params[n]) if weights else torch.ones_like(params[n]) for n in self.top_names
            },
        }

    def kept_model(self, params: Params, state: dict) -> Params:
        """The global model with the client's top layers blended in by its kept weights, as its next
        round would start (its bottom layers are the global ones then)."""
        local, weights = state["local"], state["weights"]
        return {**params, **{n: local[n] + (params[n] - local[n]) * weights[n] for n in self.top_names}}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        received, local, weights = params, state["local"], state["weights"]

        def blended(w: Params) -> Params:
            return {n: local[n] + (received[n] - local[n]) * w[n] for n in self.top_names}

        for batch in data["ala"]:
            grads, _ = grad_and_value(lambda top, batch=batch: self.loss({**received, **top}, batch))(
                blended(weights)
            )
            stepped = {
                n: torch.clamp(weights[n] - self.cfg.ala_lr * grads[n] * (received[n] - local[n]), 0, 1)
                for n in self.top_names
            }
            weights = unless_idle(batch, stepped, weights)
        result = super().local_update({**received, **blended(weights)}, {}, data)
        kept = {"local": {n: result.params[n] for n in self.top_names}, "weights": weights}
        return result._replace(state=kept)

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        trained = self.ala_runs.pop(client.id, True) or self.client_states.get(client.id, {}).get(
            "weights_trained", False
        )  # this round's window trained W_i, or an earlier one did
        update = super().to_update(client, result._replace(state={}))  # every parameter, weight, loss
        update.state = {
            **(update.state or {}),
            "local": self.keep(result.state["local"], self.top_names),
            "weights": self.keep(result.state["weights"], self.top_names),
            "weights_trained": trained,
        }
        return update

    def federation_state(self) -> dict:
        return {**super().federation_state(), "initial": self.initial}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.initial = dict(state.get("initial", self.initial))
