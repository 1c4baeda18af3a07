"""FedGH (Yi, Wang, Liu, Shi & Yu, "FedGH: Heterogeneous Federated Learning with Generalized Global
Header", ACM MM 2023): every client keeps a feature extractor of its own; only the header, the
classifier on top of it, is shared, and the server trains it.

Each round a sampled client puts the server's global header on its own extractor, trains the
whole model on its data (cross-entropy), then computes, with the trained extractor, the mean
representation of each class it holds (its local averaged representations) and sends those with
their labels — never parameters. The server trains the global header on the received pairs
(representation, label) with SGD on the cross-entropy and sends it back; the client's own trained
header is dropped, replaced by the global one next time.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The extractor is everything below the model's classifier (``head.``): its ``embedding=True``
  output is the representation, on any of the models (CNN, ResNet, LSTM). The paper's clients may
  have extractors of different architectures; here every client has the federation's model.
- Local training: FedAvg's SGD epochs at the protocol's step size (``method.momentum``, 0 by
  default). The authors' code trains with momentum 0.9, weight decay 10⁻³ and a gradient-norm clip
  of 50; the protocol's plain SGD is every baseline's.
- A class's representation is the mean of the trained extractor's outputs over all the client's
  samples of the class, in one pass (as PFLlib's FedGH; the authors' code averages per-batch class
  means).
- The server's training: one SGD step at ``method.server_lr`` per received pair, client after
  client in the round's order and each client's classes in increasing order (the authors' code
  takes a step per pair; PFLlib shuffles the pairs into batches). Each step is the exact gradient
  of the pair's cross-entropy, (softmax − one-hot) ⊗ (z, 1). server_lr = 0.01: the authors'
  code's step size (their server loop steps, with it, the optimizer they built over the client
  network's parameters, so their header as written never moves; this steps the header, as the
  paper says).
- What is kept: each client's extractor, in ``method.kept_dtype`` (float16 by default: half the
  bytes of float32, and the client starts from a rounded copy); the global header is the server
  model's ``head`` (the rest of the server model is never trained: nothing but representations is
  sent). A client that has not trained yet has the initial extractor (the authors' first round).
- Evaluation: the training-clients protocol scores each client's own extractor under the global
  header (the paper's evaluation). A new client has no extractor of its own: it starts from the
  initial extractor under the global header and fine-tunes with the shared procedure.
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedproto import HELD, PROTOTYPE, one_hot
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params
from fedmeta.models import CLASSIFIER


class FedGH(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.head_names, self.body_names = self.split_names((CLASSIFIER,))

    def draw(self, client: Client, round_: int) -> ClientData:
        return {**super().draw(client, round_), "all": client.batch(self.cfg.train_split, None)}

    def client_state(self, client_id: int, params: Params) -> dict:
        kept = self.client_states.get(client_id, {}).get("body")  # none before its first round
        return {"body": {n: params[n] if kept is None else kept[n].to(params[n]) for n in self.body_names}}

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["body"]}  # its own extractor under the global header

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        trained, loss = self.local_sgd(
            {**params, **state["body"]}, data["epochs"], self.cfg.local_lr, self.cfg.momentum
        )
        means, counts = self.class_means(trained, data["all"])
        sent = {PROTOTYPE: means, HELD: (counts > 0).to(means.dtype)}
        return LocalResult(sent, loss, {"body": {n: trained[n] for n in self.body_names}}, {})

    def class_means(self, params: Params, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each class's mean representation over ``batch`` (C × units; zeros for a class it lacks)
        and each class's sample count."""
        z = self.run_model(self.model, params, batch.x, mask=batch.mask, embedding=True).detach()
        weights = one_hot(batch.y, params[CLASSIFIER + "bias"].shape[0], z.dtype)
        if batch.mask is not None:
            weights = weights * batch.mask.unsqueeze(-1).to(z.dtype)
        counts = weights.sum(0)
        return (weights.T @ z) / counts.clamp(min=1).unsqueeze(-1), counts

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state={}))  # representations, weight, loss
        dtype = getattr(torch, self.cfg.kept_dtype)  # copies: vmapped results are views
        body = {n: t.detach().to(dtype, copy=True) for n, t in result.state["body"].items()}
        update.state = {**(update.state or {}), "body": body}
        return update

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """Each client's extractor kept; the global header trained on the round's representations."""
        super().aggregate(updates)  # keeps the extractors; no model name is sent: nothing is averaged
        self.train_header([u for u in updates if PROTOTYPE in u.params])

    def train_header(self, sent: list[ClientUpdate]) -> None:
        """One SGD step on the header's cross-entropy per (representation, label) pair, in order."""
        head = dict(self.model.named_parameters())
        weight, bias = head[CLASSIFIER + "weight"], head[CLASSIFIER + "bias"]
        with torch.no_grad():
            for update in sent:
                means = update.params[PROTOTYPE].to(weight)
                for label in torch.nonzero(update.params[HELD] > 0).flatten().tolist():
                    z = means[label]
                    error = torch.softmax(weight @ z + bias, 0)  # ∂CE/∂logits = softmax − one-hot
                    error[label] -= 1
                    weight.sub_(self.cfg.server_lr * torch.outer(error, z))
                    bias.sub_(self.cfg.server_lr * error)
