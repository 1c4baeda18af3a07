"""pFedMe (Dinh, Tran & Nguyen, NeurIPS 2020, "Personalized Federated Learning with Moreau
Envelopes"), Algorithm 1.

A client's personalized model is the proximal point of its loss around the global model,
θ̂_i(w) = argmin_θ f_i(θ) + λ/2‖θ − w‖² (the minimizer inside the Moreau envelope F_i(w)). A sampled
client starts its local model at the round's global model, w_{i,0} = w, and for each of R local
rounds (``local_rounds``) draws a batch D and

    θ ← θ − personal_lr · (∇f_i(θ; D) + λ(θ − w_{i,r}))      K times (``inner_steps``),
    w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ)                   (η: ``local_lr``),

the second line being a gradient step on the Moreau envelope, ∇F_i(w) = λ(w − θ̂_i(w)). It sends
w_{i,R}; the server takes the sample-weighted mean of those w and moves the global model
w ← (1 − β) w + β · mean (β = 1: the mean itself, as FedAvg).

Choices fedmeta's protocol forces where the paper leaves them open:

- The inner problem's K steps start from θ where the previous local round left it (θ starts at the
  round's global model), as the authors' code does; the paper only asks for a δ-approximate
  solution, from no particular start.
- Each local round's batch is drawn afresh from the client's data (the paper's "sample a batch");
  the authors' code reads the next batch of an unshuffled loader that persists across rounds.
- The reported training loss is the mean over local rounds of f_i(θ; D) before the first inner step.
- Training clients keep nothing: each round re-solves θ from the round's global model, a training
  client's θ never reaches w or a new client, and only new clients are evaluated (the paper scores
  the training clients' θ), so θ is not kept (as Ditto's personal models).

New clients: a client's personalized model is θ̂_i(w), the solution of the Moreau-envelope
problem around the final global model; the shared test-time procedure computes it — its SGD steps
from w minimize f_i(θ) + λ/2‖θ − w‖² (``adaptation_loss``; the anchor is the start, w), with the
shared budget of steps at a step size chosen for that problem (its config sets ``personalization.lr``
to 0.02, lr·λ = 0.3: at pFedMe's inner step size, lr·λ = 1.35, every step overshoots w and the
curve alternates; at the baselines' 0.001 the steps would stop far short of the solution).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import Algorithm, ClientData, LocalResult, step_weight, unless_idle
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, grad_and_value


class PFedMe(Algorithm):
    def draw(self, client: Client, round_: int) -> ClientData:
        generator = client.generator(round_)
        return {
            "batches": [
                client.batch("all", self.cfg.batch_size, generator) for _ in range(self.cfg.local_rounds)
            ]
        }

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        cfg = self.cfg
        lam = cfg.lam
        w, theta, total, steps = params, params, 0.0, 0.0
        for batch in data["batches"]:
            for k in range(cfg.inner_steps):  # θ ≈ argmin f(θ; D) + λ/2‖θ − w‖², by K gradient steps
                grads, loss = grad_and_value(self.loss)(theta, batch)
                stepped = {
                    n: theta[n] - cfg.personal_lr * (grads[n] + lam * (theta[n] - w[n])) for n in theta
                }
                theta = unless_idle(batch, stepped, theta)
                if k == 0:
                    total, steps = total + step_weight(batch) * loss, steps + step_weight(batch)
            moved = {n: w[n] - cfg.local_lr * lam * (w[n] - theta[n]) for n in w}  # η·∇F_i(w)
            w = unless_idle(batch, moved, w)
        return LocalResult(w, total / steps, {}, {})

    def aggregate(self, updates) -> None:
        """The weighted mean of the clients' w (FedAvg's aggregate), then w ← (1 − β) w + β · mean."""
        beta = self.cfg.beta
        before = None if beta == 1 else {n: p.detach().clone() for n, p in self.model.named_parameters()}
        super().aggregate(updates)
        if before is not None:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(torch.lerp(before[name], p, beta))

    def adaptation_loss(self, params: Params, batch: Batch, start: Params) -> torch.Tensor:
        proximal = sum(((params[name] - start[name]) ** 2).sum() for name in params)  # start = w
        return super().adaptation_loss(params, batch, start) + 0.5 * self.cfg.lam * proximal
