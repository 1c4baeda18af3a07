"""FedNova (Wang, Liu, Liang, Joshi & Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020), with plain local SGD.

Clients that take different numbers of local steps τ_i pull FedAvg's mean toward the objectives
of those that take more: the mean solves a different problem than the federation's. FedNova
normalizes each client's update by its steps before averaging. Client i starts from the server's
x, takes τ_i SGD steps to y_i and sends y_i (and τ_i); its normalized update is
d_i = (x − y_i)/τ_i, and the server steps

    x ← x − τ_eff · Σ_i p_i d_i,    τ_eff = Σ_i p_i τ_i,

p_i the clients' shares of the round (by sample count, as the paper's p_i = n_i/n). With equal τ_i
the step is FedAvg's mean exactly, and it is computed as that mean.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The local solver is plain SGD (``momentum`` 0, no kept Adam): each step's weight in the paper's
  a_i is 1, so ‖a_i‖₁ = τ_i. τ_i counts the steps the client actually took — its epochs times its
  batches, however many samples it holds (a padded lane's idle steps are not counted) — so
  clients of different sizes are what makes FedNova differ from FedAvg here.
- τ_eff = Σ p_i τ_i, the paper's choice (its experiments' default); no server momentum or step
  size besides it (the paper's η_g = 1). ``averaging=uniform`` takes p_i = 1/m.
- The loss a client reports is its training loss; new clients fine-tune the server's model with
  the shared procedure (``personalization.steps``: 50, as FedAvg-FT; 0 scores it as the paper does).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult, step_weight
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Client
from fedmeta.functional import Params

STEPS = "fednova.steps"  # the name under which a client sends τ_i beside its parameters


class FedNova(FedAvg):
    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        result = super().local_update(params, state, data)  # FedAvg's SGD epochs
        steps = sum((step_weight(batch) for batch in data["epochs"]), 0.0)
        return result._replace(extra={"steps": torch.zeros_like(result.loss) + steps})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        update.params = {**update.params, STEPS: result.extra["steps"].detach()}
        return update

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """x ← x − τ_eff·Σ p_i (x − y_i)/τ_i: the mean of the y_i weighted by p_i/τ_i, m, gives
        Σ p_i (x − y_i)/τ_i = S·(x − m) with S = Σ p_i/τ_i, so x ← x + τ_eff·S·(m − x)."""
        steps = [float(u.params[STEPS]) for u in updates]
        if len(set(steps)) == 1:  # equal steps: FedAvg's mean is FedNova's step
            return super().aggregate(updates)
        total = sum(u.weight for u in updates)
        shares = [u.weight / total for u in updates]  # p_i
        effective = sum(p * tau for p, tau in zip(shares, steps))  # τ_eff
        # a client that took no step sent x back: its d_i is 0 (it still counts in p and τ_eff)
        scale = effective * sum(p / tau for p, tau in zip(shares, steps) if tau > 0)  # τ_eff·S
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        normalized = [_reweighted(u, u.weight / tau if tau > 0 else 0.0) for u, tau in zip(updates, steps)]
        super().aggregate(normalized)  # m, the mean weighted by p_i/τ_i (and each client's state kept)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if any(name in u.params for u in updates):
                    p.copy_(before[name] + scale * (p - before[name]))


def _reweighted(update: ClientUpdate, weight: float) -> ClientUpdate:
    return ClientUpdate(update.client_id, update.params, weight, update.loss, update.state)
