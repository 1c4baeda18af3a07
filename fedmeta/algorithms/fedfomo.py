"""FedFomo (Zhang, Sapra, Fidler, Yeung & Alvarez, "Personalized Federated Learning with First
Order Model Optimization", ICLR 2021), Algorithm 1.

No global model is trained for the clients: each has a model of its own. The server keeps every
client's last model and an affinity matrix P; a sampled client i downloads M of the others' kept
models θ_n and weighs each by how much it lowers the loss on the client's validation split, per
unit of distance from its own last model θ_i:

    w_n = max(0, (L_i(θ_i) − L_i(θ_n)) / ‖θ_n − θ_i‖),

then starts from θ_i + Σ_n (w_n / Σ_m w_m)·(θ_n − θ_i) — θ_i itself when no model helps — trains
its local epochs on its training split and sends the result, which the server keeps as θ_i.
The server adds each client's weights to its row of P and sends a client the M models with the
highest affinity.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- M = 5 (``method.models``; the paper's 5- and 10-model runs, PFLlib's and FL-bench's default).
  The validation split is the client's held-out 20 % (the protocol's split; PFLlib and FL-bench
  also hold out 20 %), the training split its other 80 % (``train_split: pers``); the loss on it is
  the whole split's mean, and ‖θ_n − θ_i‖ gets 10⁻⁵ added, as both reference codes.
- P starts at 0 and row i adds the raw (signed) w_n of the models client i weighed, as PFLlib and
  FL-bench do. The M models are those with the highest affinity among the other clients' kept
  models, ties (every P_ij still 0) going to the most recently sent — deterministic top-M, as the
  reference codes; the paper and the authors' code explore with ε-greedy draws (ε = 0.3, decaying
  0.05 a round), which this does not.
- A client that has not trained yet has the initial model as θ_i (every client starts from it in
  the paper). With fewer than M other models kept the missing slots are left out.
- What the server keeps: each client's last model, in ``method.kept_dtype`` (float16 by default:
  half the bytes of float32; a client then starts from a rounded copy of its own model), the
  ``method.kept_models`` most recently sent (0: every client's — the bound is then the
  federation's training clients), and P (clients × clients numbers). A client whose model was
  dropped starts again from the initial model.
- The server's own model is the round's FedAvg mean (by sample count) of the clients' models: no
  client trains from it; new clients, which have no model of their own, fine-tune it with the
  shared procedure (``personalization.steps``: 50). The training-clients protocol scores each
  training client's own θ_i. The paper evaluates the training clients' models only.
- On Flower the server sends a client θ_i, the M models and their clients' ids with the global
  model (``broadcast_state``); the node sends back its model and its weights.
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Client
from fedmeta.functional import Params

WEIGHTS, IDS = "fedfomo.weights", "fedfomo.ids"  # what a client sends besides its model


def keep_models(store: dict[int, Params], updates: list[ClientUpdate], names: list[str], dtype, limit: int):
    """Each update's model into ``store`` (client id → its last model, in ``dtype``), the most
    recent last; beyond ``limit`` models (0: no limit) the least recently sent are dropped."""
    for update in updates:
        store.pop(update.client_id, None)
        store[update.client_id] = {n: update.params[n].detach().to(dtype, copy=True) for n in names}
    while limit and len(store) > limit:
        store.pop(next(iter(store)))


def flat_state(state: dict) -> Params:
    """A client state of tensors and dicts of tensors as one flat dict ("key.name" names)."""
    flat = {}
    for key, value in state.items():
        flat |= {f"{key}.{n}": t for n, t in value.items()} if isinstance(value, dict) else {key: value}
    return flat


def nested_state(tensors: Params, nested: tuple[str, ...]) -> dict:
    """``flat_state`` undone: the names under each of ``nested`` back into a dict of their own."""
    state: dict = {key: {} for key in nested}
    for name, t in tensors.items():
        key, _, rest = name.partition(".")
        if key in nested:
            state[key][rest] = t
        else:
            state[name] = t
    return state


class FedFomo(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.names = [n for n, _ in model.named_parameters()]
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}  # every θ_i at first
        self.sent: dict[int, Params] = {}  # θ_i: each client's last model, in method.kept_dtype
        self.affinity = torch.zeros(cfg.num_clients, cfg.num_clients)  # P
        self.arrived: dict[int, dict] = {}  # on a Flower node: the state that came with the message

    def draw(self, client: Client, round_: int) -> ClientData:
        return {**super().draw(client, round_), "validation": client.batch("held_out", None)}

    def downloads(self, client_id: int) -> list[int]:
        """The (at most) M other clients whose kept models client ``client_id`` receives: the highest
        affinity first, among equals the most recently sent."""
        row = self.affinity[client_id].tolist()
        recent_first = [j for j in reversed(self.sent) if j != client_id]
        return sorted(recent_first, key=lambda j: -row[j])[: self.cfg.models]

    def own(self, client_id: int, params: Params) -> Params:
        kept = self.sent.get(client_id, self.initial)  # θ_i; the initial model before its first round
        return {n: kept[n].to(params[n]) for n in params}

    def client_state(self, client_id: int, params: Params) -> dict:
        if client_id in self.arrived:  # a node has no kept models: the server sent them
            return self.arrived[client_id]
        own, ids = self.own(client_id, params), self.downloads(client_id)
        models = [self.own(j, params) for j in ids] + [own] * (self.cfg.models - len(ids))
        like = params[self.names[0]]  # the device of the lane's tensors
        return {
            "own": own,
            "others": {n: torch.stack([m[n] for m in models]) for n in params},
            "ids": torch.tensor(ids + [-1] * (self.cfg.models - len(ids)), device=like.device),  # -1: none
        }

    def kept_model(self, params: Params, state: dict) -> Params:
        return state["own"]  # θ_i, what the training-clients protocol scores

    def weights(self, state: dict, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The M models' raw weights (L(θ_i) − L(θ_n))/(‖θ_n − θ_i‖ + 10⁻⁵) (0 for an empty slot),
        and their shares of the start: the positive ones normalized to sum 1 (all 0 if none)."""
        own, others, ids = state["own"], state["others"], state["ids"]
        losses = torch.stack([self.loss({n: others[n][m] for n in own}, batch) for m in range(ids.shape[0])])
        wide = torch.promote_types(losses.dtype, torch.float32)  # distances of bfloat16 models in float32
        squares = sum((others[n] - own[n].unsqueeze(0)).to(wide).flatten(1).pow(2).sum(1) for n in own)
        raw = (self.loss(own, batch) - losses) / (squares.sqrt() + 1e-5) * (ids >= 0).to(losses.dtype)
        positive = raw.clamp(min=0)
        total = positive.sum()
        return raw, positive / torch.where(total > 0, total, torch.ones_like(total))

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        raw, shares = self.weights(state, data["validation"])
        own, others = state["own"], state["others"]
        start = {
            n: own[n]
            + (shares.to(own[n]).view(-1, *[1] * own[n].dim()) * (others[n] - own[n].unsqueeze(0))).sum(0)
            for n in own
        }
        result = super().local_update(start, {}, data)  # FedAvg's SGD epochs on the training split
        return result._replace(extra={"weights": raw, "ids": state["ids"]})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(extra={}))  # θ_i, weight, loss
        ids = result.extra["ids"].detach().float()  # sent as floats, as every tensor a round screens
        update.params |= {WEIGHTS: result.extra["weights"].detach(), IDS: ids}
        return update

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """The server's model: the round's FedAvg mean (for new clients); each client's weights
        added to its row of P, and its model kept as its θ_i."""
        super().aggregate(updates)
        for update in updates:
            if WEIGHTS not in update.params:
                continue
            weights = update.params[WEIGHTS].detach()
            self.affinity = self.affinity.to(torch.promote_types(weights.dtype, torch.float32))
            for j, w in zip(update.params[IDS].tolist(), weights.to(self.affinity).cpu()):
                if j >= 0:
                    self.affinity[update.client_id, int(j)] += w
        dtype = getattr(torch, self.cfg.kept_dtype)
        keep_models(self.sent, updates, self.names, dtype, self.cfg.kept_models)

    def broadcast_state(self, client_id: int) -> Params:
        return flat_state(self.client_state(client_id, self.global_params()))

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.arrived = {client_id: nested_state(tensors, ("own", "others"))}

    def federation_state(self) -> dict:
        return {
            **super().federation_state(),
            "sent": self.sent,
            "affinity": self.affinity,
            "initial": self.initial,
        }

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.sent = dict(state.get("sent", {}))
        self.affinity = state.get("affinity", self.affinity)
        self.initial = dict(state.get("initial", self.initial))
