"""FedDBE (Zhang, Hua, Cao, Wang, Song, Xue, Ma & Guan, "Eliminating Domain Bias for Federated
Learning in Representation Space", NeurIPS 2023): FedAvg with the domain bias eliminator (DBE).

Two changes to FedAvg's clients, both on the representation z, the classifier's input:
- PRBM, the personalized representation bias memory: a learnable vector b̄_i per client, added to
  the representation before the classifier, h(z + b̄_i). It is trained with the model, by the same
  SGD, and stays with its client; the server never sees it.
- MR, mean regularization: during local training the client tracks a running mean of its
  representations over its steps, z̄_i ← (1 − μ)·z̄_i + μ·mean_batch(z) (restarted at 0 each round,
  gradients only through the current batch's mean), and adds κ·mean_units(½(z̄_i − z̄^g)²) to its
  cross-entropy: a pull of its mean representation toward the global one, z̄^g.

z̄^g is measured once, in an initialization period: clients train without DBE (no PRBM, no MR) and
send their running means; z̄^g is their mean, weighted by sample count, and stays fixed after.
The server averages the model (extractor and classifier) as FedAvg does.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The initialization period is the first round: its sampled clients train without DBE and send
  their running means with their models, which the server averages as any round's (the authors'
  code trains every client once before the first round and discards the models it trained there).
  Every later round uses the fixed z̄^g.
- κ = 50 and μ = 1 (``method.kappa``, ``method.mean_momentum``): the authors' run script (their
  code's defaults are μ = 0.1 and κ = 0, which turns MR off). With μ = 1 the running mean is the
  current batch's mean representation.
- The PRBM is a parameter of the model (``prbm``, as many numbers as the representation), never
  sent; a client that has not trained yet has the initial one, zero. Local training: FedAvg's SGD
  epochs at the protocol's step size, the PRBM at the same (as the authors' code).
- The representation is the model's ``embedding=True`` output, on any of the models.
- Evaluation: the training-clients protocol scores the global model with each client's own PRBM
  (the paper's personalization); new clients have none (zero: the global model) and fine-tune the
  model and their PRBM with the shared procedure (the paper's new clients fine-tune the global
  model).
- On Flower the server sends z̄^g (and whether it exists) with the model; the PRBM stays on the
  client's node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedmeta.algorithms.base import ClientData, ClientUpdate, Context, LocalResult, step_weight, unless_idle
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, cross_entropy, grad_and_value, masked_mean, sgd
from fedmeta.models import CLASSIFIER

PRBM = "prbm"  # the personalized representation bias memory: a parameter of the model, never sent
MEAN, READY = "feddbe.mean", "feddbe.ready"  # z̄^g, and whether it was measured (0/1: it is vmapped)
PROBE = "feddbe.probe"  # a zero input whose gradient is the batch's mean representation


class FedDBE(FedAvg):
    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> nn.Module:
        """The base network with ``prbm``: a zero vector of the representation's size."""
        model = super().build_model(cfg, num_classes, sources)
        model.prbm = nn.Parameter(torch.zeros(model.head.weight.shape[1]))
        return model

    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.own_names, self.shared_names = self.split_names((PRBM,))
        # z̄^g (at least float32) and whether the initialization period has measured it
        units, like = model.prbm.shape[0], model.prbm
        self.global_mean = {
            MEAN: torch.zeros(units, device=like.device),
            READY: torch.zeros((), device=like.device),
        }

    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        z = self.run_model(self.model, params, x, mask=mask, embedding=True)
        return F.linear(z + params[PRBM].to(z), params[CLASSIFIER + "weight"], params[CLASSIFIER + "bias"])

    def dbe_loss(self, params: Params, batch: Batch, running: torch.Tensor, mean: Params) -> torch.Tensor:
        """CE(h(z + b̄)) + κ·mean ½(z̄ − z̄^g)², z̄ = (1 − μ)·``running`` + μ·mean_batch(z); before z̄^g
        exists, the plain cross-entropy. The batch's mean representation also comes back, as the
        gradient of the zero ``params[PROBE]`` (one forward pass for both)."""
        weights = {n: p for n, p in params.items() if n != PROBE}
        z = self.run_model(self.model, weights, batch.x, mask=batch.mask, embedding=True)
        ready = mean[READY].to(z)
        logits = F.linear(
            z + ready * params[PRBM].to(z), params[CLASSIFIER + "weight"], params[CLASSIFIER + "bias"]
        )
        ce = masked_mean(cross_entropy(logits, batch.y), batch.mask)
        real = torch.ones_like(z[:, 0]) if batch.mask is None else batch.mask.to(z)
        batch_mean = (real.unsqueeze(-1) * z).sum(0) / real.sum()
        tracked = (1 - self.cfg.mean_momentum) * running + self.cfg.mean_momentum * batch_mean
        regularizer = (0.5 * (tracked - mean[MEAN].to(z)) ** 2).mean()
        return ce + ready * self.cfg.kappa * regularizer + (params[PROBE] * batch_mean.detach()).sum()

    def client_state(self, client_id: int, params: Params) -> dict:
        like = params[PRBM]
        return {
            "own": self.kept_params(client_id, params, self.own_names),
            "mean": {k: v.to(like) for k, v in self.global_mean.items()},
        }

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["own"]}  # the global model with the client's own PRBM

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        trained = {**params, **state["own"]}
        running = torch.zeros_like(trained[PRBM])  # z̄_i, restarted every round
        velocity = {n: torch.zeros_like(p) for n, p in trained.items()} if self.cfg.momentum else None
        total, steps = 0.0, 0.0
        for batch in data["epochs"]:

            def loss_of(p: Params, batch=batch, running=running) -> torch.Tensor:
                return self.dbe_loss(p, batch, running, state["mean"])

            grads, loss = grad_and_value(loss_of)({**trained, PROBE: torch.zeros_like(running)})
            stepped, new_velocity = sgd(
                trained, {n: grads[n] for n in trained}, self.cfg.local_lr, self.cfg.momentum, velocity
            )
            tracked = (1 - self.cfg.mean_momentum) * running + self.cfg.mean_momentum * grads[PROBE]
            trained, running = unless_idle(batch, stepped, trained), unless_idle(batch, tracked, running)
            velocity = unless_idle(batch, new_velocity, velocity) if velocity is not None else None
            total, steps = total + step_weight(batch) * loss, steps + step_weight(batch)
        loss = total / steps if data["epochs"] else torch.zeros(())
        shared = {n: trained[n] for n in self.shared_names}
        return LocalResult(
            {**shared, MEAN: running}, loss, {"own": {n: trained[n] for n in self.own_names}}, {}
        )

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state={}))  # the model, z̄_i, weight, loss
        update.state = {**(update.state or {}), **self.keep(result.state["own"], self.own_names)}
        return update

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """FedAvg's mean of the models (each client's PRBM kept); after the first round that sent
        any, z̄^g: the sample-weighted mean of that round's running means, fixed from then on."""
        super().aggregate(updates)
        sent = [u for u in updates if MEAN in u.params]
        if self.global_mean[READY] > 0 or not sent:
            return
        dtype = torch.promote_types(sent[0].params[MEAN].dtype, torch.float32)
        total = sum(u.weight for u in sent)
        mean = sum(u.params[MEAN].to(dtype) * (u.weight / total) for u in sent)
        self.global_mean = {MEAN: mean, READY: torch.ones((), dtype=dtype, device=mean.device)}

    def broadcast_state(self, client_id: int) -> Params:
        return dict(self.global_mean)

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.global_mean = {MEAN: tensors[MEAN], READY: tensors[READY]}

    def federation_state(self) -> dict:
        return {**super().federation_state(), "global_mean": self.global_mean}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.global_mean = dict(state["global_mean"])
