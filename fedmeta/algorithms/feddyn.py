"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, "Federated Learning Based on Dynamic
Regularization", ICLR 2021), Algorithm 1.

Each client k keeps ∇L_k(θ_k), the gradient of its loss where its last local model ended (0 before
it takes part); the server keeps h (0 at the start). A sampled client starts from the server's
θ^{t−1} and minimizes its dynamically regularized loss

    L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + α/2 · ‖θ − θ^{t−1}‖²,

whose minimum makes its new gradient ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α(θ_k^t − θ^{t−1}): that is
what it keeps. The server then takes h ← h − α·(1/m)·Σ_{k∈P_t}(θ_k^t − θ^{t−1}) and
θ^t = mean_{k∈P_t} θ_k^t − h/α, m the number of clients. At a fixed point every client's local
optimum is the global one: the linear term cancels each client's drift.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The local minimization is FedAvg's SGD (``local_epochs`` epochs over the client's data at
  ``local_lr``, ``momentum`` optional) with each step's gradient ∇L_k(θ) − ∇L_k(θ_k^{t−1}) +
  α(θ − θ^{t−1}), as the authors' code does with SGD's weight decay α and a linear term. The paper
  minimizes exactly; its experiments, like this, take a few epochs of SGD.
- α = 0.01: the authors' example scripts' value (the paper searches {0.1, 0.01, 0.001}).
- What travels: a client sends θ_k^t; the server knows θ^{t−1}, so it computes the drifts itself.
  ∇L_k stays with its client (``client_states``: on a Flower node, on the node); h is the server's
  alone (``federation_state``: checkpointed, restored on resume). Nothing but the model is sent to
  a client.
- Averaging: uniform over the round's clients, as Algorithm 1 (``averaging: samples`` weights the
  mean of θ_k by client size, as FedAvg). m is the federation's training clients
  (``federation.num_clients − num_new_clients``); a client that failed or dropped out adds nothing.
- The authors' code divides α by each client's share of the data (α·n̄/n_k, so larger clients are
  regularized less); the paper and this implementation use one α for every client.
- Evaluation: new clients are scored (the paper's protocol); they fine-tune the server's θ^t (Algorithm 1's server
  model, h's correction included: the one every next client receives) with the shared
  personalization procedure (``personalization.steps``: 50, as FedAvg-FT). The authors' code scores
  other models, the mean of the round's client models and of every client's latest one
  (docs/methods.md). The regularizer is a training device: their fine-tuning is plain SGD.
- The loss a client reports is its plain training loss over its steps (no regularizer).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Client
from fedmeta.functional import Params


class FedDyn(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.h: Params = {}  # the server's state (at least float32); absent: 0

    def client_state(self, client_id: int, params: Params) -> dict:
        kept = self.client_states.get(client_id, {}).get(
            "gradient"
        )  # ∇L_k(θ_k^{t−1}); none before its first round
        return {
            "gradient": {n: kept[n].to(params[n]) if kept else torch.zeros_like(params[n]) for n in params}
        }

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        anchor, gradient, alpha = params, state["gradient"], self.cfg.alpha

        def regularized(trained: Params, grads: Params) -> Params:
            return {n: grads[n] - gradient[n] + alpha * (trained[n] - anchor[n]) for n in grads}

        params, loss = self.local_sgd(
            params, data["epochs"], self.cfg.local_lr, self.cfg.momentum, correction=regularized
        )
        kept = {n: gradient[n] - alpha * (params[n] - anchor[n]) for n in params}
        return LocalResult(params, loss, {"gradient": kept}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(
            client, result._replace(state={})
        )  # θ_k, weight, loss; FedAvg's iterator count
        # copies: a vmapped round's results are views into tensors of all its clients
        kept = {n: g.detach().clone() for n, g in result.state["gradient"].items()}
        update.state = {**(update.state or {}), "gradient": kept}
        return update

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """h ← h − α·(1/m)·Σ(θ_k − θ^{t−1}), then θ^t = mean θ_k − h/α (the base aggregate's mean,
        which also keeps each client's ∇L_k)."""
        alpha, m = self.cfg.alpha, self.training_clients()
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        super().aggregate(updates)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                sent = [u.params[name] for u in updates if name in u.params]
                if not sent:
                    continue
                dtype = torch.promote_types(p.dtype, torch.float32)
                drift = (torch.stack(sent).to(dtype) - before[name].to(dtype)).sum(0)
                h = self.h.get(name, torch.zeros((), dtype=dtype)).to(p.device, dtype) - alpha * drift / m
                self.h[name] = h
                p.copy_(p.to(dtype) - h / alpha)

    def federation_state(self) -> dict:
        return {**super().federation_state(), "h": self.h}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.h = dict(state.get("h", {}))
