"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020), Algorithm 1 with option II control variates.

The server keeps the global model x and a server control variate c; each client i keeps its own
control variate c_i. A sampled client starts from y = x and takes K local steps
y ← y − η_l (g_i(y) − c_i + c), which correct its gradient for the drift between its data and
everyone's; then (option II) c_i⁺ = c_i − c + (x − y)/(K η_l), it keeps c_i⁺ and sends
Δy = y − x and Δc = c_i⁺ − c_i. The server moves x ← x + η_g · mean Δy and
c ← c + (|S|/N) · mean Δc over the |S| clients of the round, N the number of clients.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- Local steps: FedAvg's batches (``local_epochs`` epochs over the client's data, or
  ``local_batches`` batches of its persistent iterator), plain SGD at η_l = ``local_lr`` with the
  correction (``momentum`` and a kept Adam are refused: they are not SCAFFOLD's step). K is the
  number of steps the client took — its epochs times its batches — where the paper has one K for
  every client; option II's c_i⁺ is then the client's mean corrected gradient over its own steps.
- What travels: a client sends its parameters y (the server's mean of y is x + mean Δy) and Δc
  under the names ``control_delta.<parameter>``, which the base aggregate (the model's names
  only) passes over; the round's updates reach ``aggregate`` on every Fabric rank, so every rank
  computes the same x and c. On a Flower node c arrives with the model (``broadcast_state``),
  c_i stays on the node like every client's kept state, and Δc returns with the update.
- Averaging: uniform over the round's clients, as the paper (``averaging: uniform`` in
  configs/method/scaffold.yaml; ``averaging=samples`` weights Δy by client size, as FedAvg). Δc
  is always summed with weight 1/N, which keeps c the mean of all N clients' c_i.
- N is the federation's training clients (``federation.num_clients − num_new_clients``); |S| the
  clients whose updates arrived (one that failed or dropped out keeps its old c_i and adds nothing).
- Initial state: c = 0 and c_i = 0 (a client that never took part starts from 0 and keeps nothing
  until it does: per-client state only for clients that took part). η_g = 1, the paper's value.
- Evaluation: new clients are scored (the paper's protocol); they fine-tune the global model x with the shared
  personalization procedure (``personalization.steps``: 50, as FedAvg-FT). Control variates are a
  training device: a new client has no c_i and its fine-tuning is plain SGD.
- The loss a client reports is its plain training loss over its steps (no correction term).

The server's c is part of the federation state (``federation_state``: checkpointed, restored on
resume); each c_i lives in ``client_states`` as every method's per-client state does.
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult, step_weight, unless_idle
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Client
from fedmeta.functional import Params, grad_and_value

CONTROL_DELTA = "control_delta."  # the prefix of the names under which a client sends Δc


class SCAFFOLD(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.control: Params = {}  # c, the server control variate (at least float32); absent: 0

    def client_state(self, client_id: int, params: Params) -> dict:
        kept = self.client_states.get(client_id, {}).get("control")  # c_i; none before its first round

        def like(values: Params | None, name: str) -> torch.Tensor:
            return values[name].to(params[name]) if values else torch.zeros_like(params[name])

        return {
            "control": {n: like(kept, n) for n in params},
            "server_control": {n: like(self.control, n) for n in params},
        }

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        x, c_i, c = params, state["control"], state["server_control"]
        lr, batches = self.cfg.local_lr, data["epochs"]
        if not batches:  # nothing to learn from: y = x, c_i unchanged
            return LocalResult(
                x, torch.zeros(()), {"control": c_i}, {"control_delta": {n: 0 * c_i[n] for n in x}}
            )
        total, steps = 0.0, 0.0
        for batch in batches:
            grads, loss = grad_and_value(self.loss)(params, batch)
            stepped = {n: params[n] - lr * (grads[n] - c_i[n] + c[n]) for n in params}
            params = unless_idle(batch, stepped, params)
            total, steps = total + step_weight(batch) * loss, steps + step_weight(batch)
        # option II: c_i⁺ = c_i − c + (x − y)/(K η_l), K the steps this client took (idle ones not
        # counted); divided by η_l and K one at a time: K counted in float32 is exact, K·η_l is not
        c_plus = {n: c_i[n] - c[n] + (x[n] - params[n]) / lr / steps for n in params}
        delta = {n: c_plus[n] - c_i[n] for n in params}
        return LocalResult(params, total / steps, {"control": c_plus}, {"control_delta": delta})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(
            client, result._replace(state={})
        )  # y, weight, loss; FedAvg's iterator count
        update.params = {
            **update.params,
            **{CONTROL_DELTA + n: d.detach() for n, d in result.extra["control_delta"].items()},
        }
        # copies: a vmapped round's results are views into tensors of all its clients
        kept = {n: c.detach().clone() for n, c in result.state["control"].items()}
        update.state = {**(update.state or {}), "control": kept}
        return update

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """x ← x + η_g · mean Δy (the base aggregate's mean of the clients' y is x + mean Δy), and
        c ← c + (1/N) Σ Δc = c + (|S|/N) · mean Δc; each client's c_i⁺ is kept by the base aggregate."""
        eta = self.cfg.server_lr
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()} if eta != 1 else {}
        super().aggregate(updates)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if before:
                    p.copy_(before[name] + eta * (p - before[name]))
                deltas = [u.params[CONTROL_DELTA + name] for u in updates if CONTROL_DELTA + name in u.params]
                if deltas:
                    dtype = torch.promote_types(p.dtype, torch.float32)
                    old = self.control.get(name, torch.zeros((), dtype=dtype)).to(p.device, dtype)
                    self.control[name] = old + torch.stack(deltas).to(dtype).sum(0) / self.training_clients()

    def broadcast_state(self, client_id: int) -> Params:
        return dict(self.control)

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.control = dict(tensors)

    def federation_state(self) -> dict:
        return {**super().federation_state(), "control": self.control}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.control = dict(state.get("control", {}))
