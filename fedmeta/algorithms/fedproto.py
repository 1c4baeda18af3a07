"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, "FedProto: Federated Prototype Learning
across Heterogeneous Clients", AAAI 2022): clients share class prototypes, never parameters.

Every client trains a model of its own. A class's prototype on a client is the mean of its
samples' embeddings — the representation the classifier reads. The server's global prototype of
class j is the mean of the round's clients' prototypes of j, over the clients that hold j. A
client's local loss is its cross-entropy plus λ times the squared distance between each sample's
embedding and its class's global prototype:

    L = CE(f(x), y) + λ · MSE(z(x), C̄_y)

After its local epochs a client computes its prototypes over all its data and sends them.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- Local training: FedAvg's epochs of SGD at ``local_lr`` (``local_epochs``, batch) on that loss;
  λ = 1 (``method.lam``), the authors' code's default. The distance is the authors' code's:
  the mean squared error over a batch's samples and the embedding's units (samples of a class
  without a global prototype add nothing; in the first round none has one).
- A client's model starts at the federation's initial model (every client the same one: the
  protocol's one initial model per seed; the authors initialize each client's model on its own)
  and is then its own (``client_states``: on Flower, its node). The server's model is never
  trained: nothing but prototypes is sent. The local SGD is the protocol's (``method.momentum``,
  0 by default; the authors' code uses 0.5).
- A client's prototypes are computed after its training, with its trained model, over all its
  data in one pass (batch statistics, as every forward here). The authors' code instead averages
  the embeddings its model produced during the last local epoch's steps, so its prototypes mix
  that epoch's models. It sends, per class, its prototype and whether it holds the class.
- The global prototypes: the uniform mean over the clients that hold the class, as both reference
  codes (the paper's formula also weighs by the client's count of the class). Here the server
  samples clients each round: a class none of the round's clients holds keeps its last global
  prototype (the authors' code trains every client every round). They travel to a client with
  the model (``broadcast_state``) and are part of the federation state.
- Evaluation: new clients are scored (the paper's protocol). A new client has no model of its own: it starts from
  the initial model, as Local's, and personalizes with the shared procedure on FedProto's loss —
  the global prototypes are what the federation gives it (in its personalization data, so that
  vmapped new clients of stacked seeds each read their own federation's). It predicts with its classifier (the
  authors also report the nearest global prototype's class, which PFLlib reports alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, masked_mean
from fedmeta.models import CLASSIFIER

PROTOTYPE, HELD = "prototype.mean", "prototype.held"  # what a client sends: its prototypes, its classes


def one_hot(labels: torch.Tensor, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """N × C indicators (``F.one_hot`` checks its input's values: vmap cannot run it)."""
    return (labels.unsqueeze(-1) == torch.arange(classes, device=labels.device)).to(dtype)


class FedProto(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.model_names = [name for name, _ in self.model.named_parameters()]
        classes, units = self.model.head.weight.shape
        # the global prototypes (C × units) and which classes have one (float 0/1: it is vmapped)
        self.prototypes = {PROTOTYPE: torch.zeros(classes, units), HELD: torch.zeros(classes)}

    def draw(self, client: Client, round_: int) -> ClientData:
        return {**super().draw(client, round_), "all": client.batch(self.cfg.train_split, None)}

    def embed(self, params: Params, batch: Batch) -> torch.Tensor:
        return self.run_model(self.model, self.weights(params), batch.x, mask=batch.mask, embedding=True)

    def weights(self, params: Params) -> Params:
        """The model's own parameters among ``params`` (a new client's also hold the prototypes)."""
        return {n: params[n] for n in self.model_names}

    def forward(self, params: Params, x: torch.Tensor, context=None, mask: torch.Tensor | None = None):
        return super().forward(self.weights(params), x, context, mask)

    def prototype_loss(self, params: Params, batch: Batch, prototypes: Params) -> torch.Tensor:
        """CE + λ·MSE between each sample's embedding and its class's global prototype."""
        z = self.embed(params, batch)
        logits = F.linear(z, params[CLASSIFIER + "weight"], params[CLASSIFIER + "bias"])
        ce = masked_mean(F.cross_entropy(logits, batch.y, reduction="none"), batch.mask)
        classes = one_hot(batch.y, len(prototypes[HELD]), z.dtype)
        held = classes @ prototypes[HELD].to(z)  # samples of a class without a prototype add nothing
        distance = ((z - classes @ prototypes[PROTOTYPE].to(z)) ** 2).mean(-1) * held
        return ce + self.cfg.lam * masked_mean(distance, batch.mask)

    def client_state(self, client_id: int, params: Params) -> dict:
        return {
            "own": self.kept_params(client_id, params, list(params)),
            "prototypes": {k: v.to(params[CLASSIFIER + "weight"]) for k, v in self.prototypes.items()},
        }

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["own"], **state["prototypes"]}  # its own model, the global prototypes

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        prototypes = state["prototypes"]
        own, loss = self.local_sgd(
            state["own"],
            data["epochs"],
            self.cfg.local_lr,
            self.cfg.momentum,
            objective=lambda w, batch: self.prototype_loss(w, batch, prototypes),
        )
        means, counts, _ = self.class_means(own, data["all"])
        mine = {PROTOTYPE: means, HELD: (counts > 0).to(means.dtype)}
        return LocalResult(mine, loss, {"own": own}, {})

    def class_means(self, params: Params, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mean embedding of each class over ``batch`` (C × units; zeros for a class it lacks),
        each class's sample count (C), and the mean squared norm of each class's embeddings (C)."""
        z = self.embed(params, batch).detach()
        weights = one_hot(batch.y, self.model.head.weight.shape[0], z.dtype)  # N × C
        if batch.mask is not None:
            weights = weights * batch.mask.unsqueeze(-1).to(z.dtype)
        counts = weights.sum(0)
        per_sample = counts.clamp(min=1)
        return (weights.T @ z) / per_sample.unsqueeze(-1), counts, (weights.T @ (z**2).sum(-1)) / per_sample

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state={}))  # prototypes, weight, loss
        update.state = {**(update.state or {}), **self.keep(result.state["own"], list(result.state["own"]))}
        return update

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """Each class's global prototype: the mean of the prototypes of the round's clients that
        hold it; a class none of them holds keeps its last one. Each client's model is kept."""
        super().aggregate(updates)  # keeps the clients' models; sends no model names: the model stays
        sent = [u for u in updates if PROTOTYPE in u.params]
        if not sent:
            return
        self.update_prototypes(sent, HELD)

    def update_prototypes(self, sent: list[ClientUpdate], weight: str) -> None:
        """Each class's global prototype: the mean of the ``sent`` prototypes, each client's weighed
        by its ``weight`` tensor's entry for the class (FedProto: whether it holds it; FedPAC: its
        count); a class none of them holds keeps its last one."""
        dtype = torch.promote_types(sent[0].params[PROTOTYPE].dtype, torch.float32)
        weights = torch.stack([u.params[weight].to(dtype) for u in sent])  # clients × C
        means = torch.stack([u.params[PROTOTYPE].to(dtype) for u in sent])  # clients × C × units
        totals = weights.sum(0)
        fresh = (weights.unsqueeze(-1) * means).sum(0) / totals.clamp(min=1e-12).unsqueeze(-1)
        self.prototypes = {
            PROTOTYPE: torch.where((totals > 0).unsqueeze(-1), fresh, self.prototypes[PROTOTYPE].to(fresh)),
            HELD: torch.maximum(self.prototypes[HELD].to(totals), (totals > 0).to(dtype)),
        }

    # ---- new clients: the initial model, FedProto's loss with the global prototypes ----------
    # A new client's personalization reads its own federation's prototypes from its own data, never
    # from the algorithm: vmapped, every lane (stacked seeds too) runs through one algorithm's hooks.
    def personalization_data(self, client: Client) -> ClientData:
        like = next(self.model.parameters())
        return {"prototypes": {k: v.to(like) for k, v in self.prototypes.items()}}

    def personal_params(self, params: Params, data: ClientData) -> Params:
        """The global model, and the prototypes along (held fixed: ``adapted_names``)."""
        return {**params, **data["prototypes"]}

    def adapted_names(self, step: int) -> list[str] | None:
        return self.model_names

    def adaptation_loss(self, params: Params, batch: Batch, start: Params) -> torch.Tensor:
        like = params[CLASSIFIER + "weight"]
        return self.prototype_loss(params, batch, {k: params[k].to(like) for k in (PROTOTYPE, HELD)})

    def broadcast_state(self, client_id: int) -> Params:
        return dict(self.prototypes)

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.prototypes = dict(tensors)

    def federation_state(self) -> dict:
        return {**super().federation_state(), "prototypes": self.prototypes}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.prototypes = dict(state["prototypes"])
