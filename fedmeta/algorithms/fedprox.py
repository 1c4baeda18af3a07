"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020), Algorithm 2: each sampled client k inexactly minimizes the proximal
objective h_k(w; w_t) = F_k(w) + μ/2·‖w − w_t‖² — its loss plus the squared distance to the
round's global model w_t — starting from w_t, and the server averages the results.

As implemented: the local solver is FedAvg's — E = ``local_epochs`` epochs of mini-batch SGD over
the client's data (the paper's experiments, and the authors' PerturbedGradientDescent: each step
w ← w − η(∇F_k(w) + μ(w − w_t))) — and so are the batches, what a client sends (all its
parameters) and the average. μ = 1 by default, the paper's best value for its MNIST and FEMNIST
models (chosen from {0.001, 0.01, 0.1, 1}; 0.001 and 0.01 for its two language tasks). The loss a
client reports is the mean of h_k over its steps (the proximal term included).

Where fedmeta's protocol decides what the paper leaves open:
- Partial work: the paper lets each device do a variable amount of work (γ-inexact solutions:
  stragglers that run fewer epochs, which FedProx keeps and FedAvg drops). fedmeta's protocol has
  no stragglers: every sampled client runs its ``local_epochs`` in full (a client that fails or
  drops out — ``federation.client_failure_rate``, a Flower node gone — is left out of the round).
- Sampling and averaging: Algorithm 2 samples devices with probability p_k and averages the
  results with equal weights; the authors' code samples uniformly and weights by sample count.
  fedmeta does the latter, as its FedAvg (``method.averaging=uniform``: equal weights).
- Evaluation: the paper scores the global model. Here new clients are scored (the paper's protocol); they fine-tune
  the global model with the shared personalization procedure (``personalization.steps``: 50, as
  FedAvg-FT; 0 scores the global model as it is, as the paper does). The proximal term is a
  training device: a new client's fine-tuning minimizes its plain loss.
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Batch
from fedmeta.functional import Params, proximal


class FedProx(FedAvg):
    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        anchor, mu = params, self.cfg.mu  # w_t: the round's global model, held fixed

        def objective(w: Params, batch: Batch) -> torch.Tensor:
            return self.loss(w, batch) + 0.5 * mu * proximal(w, anchor)

        params, loss = self.local_sgd(
            params, data["epochs"], self.cfg.local_lr, self.cfg.momentum, objective=objective
        )
        return LocalResult(params, loss, {}, {})
