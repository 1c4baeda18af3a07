"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei & Zhang, "Personalized Cross-Silo Federated Learning on
Non-IID Data", AAAI 2021), with the paper's heuristic attention for deep networks (HeurFedAMP).

Every client i has a personalized model w_i, kept on the server. Before client i's round the server
passes it a message from every kept model — attentive message passing — its cloud model

    u_i = ξ_ii·w_i + Σ_{j≠i} ξ_ij·w_j,   ξ_ij = (1 − ξ_ii)·exp(σ·cos(w_i, w_j)) / Σ_{h≠i} exp(σ·cos(w_i, w_h)),

so the weights of a row sum to one and the models most similar to w_i weigh most. The client then
minimizes F_i(w) + λ/(2α_k)·‖w − u_i‖² and sends the result, its new w_i.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The heuristic weights above, over the models of every client that has taken part (the ones the
  server keeps); a client with no other kept model starts from its own. The paper's first form,
  ξ_ij = α_k·A'(‖w_i − w_j‖²) with A(x) = 1 − e^{−x/σ}, is not implemented.
- The local problem is solved inexactly, by FedAvg's SGD epochs from u_i on the loss plus the
  proximal term (each step w ← w − η(∇F_i(w) + λ/α_k·(w − u_i))), at the protocol's step size.
- Defaults (the values of the paper's experiments were not at hand): ξ_ii = 0.5 (``self_weight``,
  fedmeta's choice: half a client's own model, half the others'), σ = 25 (``sigma``, FLGo's
  HeurFedAMP), λ = 1 and α_k = 1 (``lam``, ``alpha_k``: PFLlib's defaults; a constant α_k, no
  decay). Only λ/α_k enters the heuristic form.
- A client that has not trained yet has the initial model as w_i (the paper starts every w_i there).
- What the server keeps: each client's last model, in ``method.kept_dtype`` (float16 by default:
  half the bytes of float32; u_i is then mixed from rounded copies), the ``method.kept_models``
  most recently sent (0: every client's, at most the federation's training clients). A client
  whose model was dropped starts again from the initial model.
- The server's own model is the round's FedAvg mean of the clients' models (no client trains from
  it): new clients fine-tune it with the shared procedure (``personalization.steps``: 50). The
  training-clients protocol scores each training client's w_i, its personalized model.
- On Flower the server sends a client u_i and w_i with the global model (``broadcast_state``).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedfomo import flat_state, keep_models, nested_state
from fedmeta.data.federation import Batch
from fedmeta.functional import Params, proximal


class FedAMP(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.names = [n for n, _ in model.named_parameters()]
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}  # every w_i at first
        self.sent: dict[int, Params] = {}  # w_i: each client's last model, in method.kept_dtype
        self.arrived: dict[int, dict] = {}  # on a Flower node: the state that came with the message
        self.norms: dict[int, torch.Tensor] = {}  # ‖w_j‖ of each kept model, until the next round

    def attention(self, client_id: int) -> tuple[list[int], torch.Tensor]:
        """The clients whose kept models client ``client_id``'s cloud model mixes, itself first, and
        the weights ξ_i· over them (a row: they sum to one)."""
        others = [j for j in self.sent if j != client_id]
        if not others:
            return [client_id], torch.ones(1, dtype=torch.float64)
        similarity = torch.stack([self.cosine(client_id, j) for j in others])
        self_weight = self.cfg.self_weight
        weights = (1 - self_weight) * torch.softmax(self.cfg.sigma * similarity, 0)
        return [client_id, *others], torch.cat([torch.full((1,), self_weight, dtype=weights.dtype), weights])

    def cosine(self, i: int, j: int) -> torch.Tensor:
        """cos(w_i, w_j) over all parameters, in float64, a tensor at a time (no copy of whole models)."""
        a, b = self.sent.get(i, self.initial), self.sent[j]
        dot = sum((a[n].double() * b[n].double()).sum() for n in self.names)
        return dot / (self.norm(i) * self.norm(j)).clamp(min=1e-12)

    def norm(self, client_id: int) -> torch.Tensor:
        if client_id not in self.norms:
            kept = self.sent.get(client_id, self.initial)
            self.norms[client_id] = sum((kept[n].double() ** 2).sum() for n in self.names).sqrt()
        return self.norms[client_id]

    def model_of(self, client_id: int, params: Params) -> Params:
        kept = self.sent.get(client_id, self.initial)  # w_i; the initial model before its first round
        return {n: kept[n].to(params[n]) for n in params}

    def client_state(self, client_id: int, params: Params) -> dict:
        if client_id in self.arrived:  # a node has no kept models: the server sent u_i and w_i
            return self.arrived[client_id]
        ids, weights = self.attention(client_id)
        models = [self.model_of(j, params) for j in ids]
        cloud = {
            n: sum(w * m[n].double() for w, m in zip(weights.tolist(), models)).to(params[n]) for n in params
        }
        return {"own": models[0], "cloud": cloud}

    def kept_model(self, params: Params, state: dict) -> Params:
        return state["own"]  # w_i, what the training-clients protocol scores

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        cloud, pull = state["cloud"], self.cfg.lam / self.cfg.alpha_k  # u_i, held fixed

        def objective(w: Params, batch: Batch) -> torch.Tensor:
            return self.loss(w, batch) + 0.5 * pull * proximal(w, cloud)

        trained, loss = self.local_sgd(
            cloud, data["epochs"], self.cfg.local_lr, self.cfg.momentum, objective=objective
        )
        return LocalResult(trained, loss, {}, {})

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """The server's model: the round's FedAvg mean (for new clients); each client's model kept
        as its w_i."""
        super().aggregate(updates)
        dtype = getattr(torch, self.cfg.kept_dtype)
        keep_models(self.sent, updates, self.names, dtype, self.cfg.kept_models)
        self.norms = {}

    def broadcast_state(self, client_id: int) -> Params:
        return flat_state(self.client_state(client_id, self.global_params()))

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.arrived = {client_id: nested_state(tensors, ("own", "cloud"))}

    def federation_state(self) -> dict:
        return {**super().federation_state(), "sent": self.sent, "initial": self.initial}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.sent = dict(state.get("sent", {}))
        self.initial = dict(state.get("initial", self.initial))
        self.norms = {}
