"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao & Guan, "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning", ICCV 2023).

The feature extractor is shared and averaged, the head stays with its client; between them sits
the conditional valve (CoV), which turns the extractor's output z into a global feature and a
personalized one. CoV is two small networks, γ(·) and β(·) (each a linear layer, ReLU and layer
norm), applied to a conditional input c: CoV(z, c) = ReLU(z ⊙ (γ(c) + 1) + β(c)). The global
category embedding layer (GCE) holds one learned embedding e_y per class; from it a client makes
two conditional inputs, the generic g = mean_y e_y and the personalized p_i = Σ_y P_i(y)·e_y
(P_i: the client's label distribution). A client's loss on a batch:

    CE(head(CoV(z, p_i)), y)                                  — the personalized feature predicts
  + CE(cos(CoV(z, g), e_·), y)                                — the global feature, by angle to each e
  + λ·‖CoV(z, g) − ē_y‖₂                                      — and close to its class's embedding

(ē: the GCE the client received, held fixed; the norm is the Frobenius norm over the batch), with
weight decay μ on GCE and CoV. The server averages the extractor, GCE and CoV by sample count.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- λ = 0.01, μ = 0.1 (``method.lam``, ``method.mu``): the authors' run script's values for a
  4-layer CNN (they give λ = 10⁻⁴, μ = 0 for ResNet-18 and fastText).
- GCE and CoV are parameters of the model (``gce.``, ``cov.``), of the representation's size; the
  representation is the model's ``embedding=True`` output, on any of the models. GCE starts as a
  standard normal embedding, CoV as torch's default layers, as the authors' code.
- Local training: FedAvg's SGD epochs at the protocol's step size for everything the client
  trains (extractor, head, GCE, CoV: one step size, as the authors' code), weight decay μ added to
  the gradient of GCE and CoV as torch's SGD does.
- The conditional inputs are made from the GCE the client receives, with its label distribution
  over the data it trains on. The authors' code makes them, for the next round, from the GCE the
  client holds before it takes the new global one (its own trained GCE if it trained that round),
  and every client starts from zero inputs.
- A client's head starts as the initial model's, never averaged. What a client keeps: its head and
  its label distribution (the personalized input is remade from the current GCE).
- Evaluation: the training-clients protocol scores each client's model as the paper does (its
  head on CoV(z, p_i)). A new client starts from the global model — the averaged extractor, GCE
  and CoV, the initial head — with p_i from the label distribution of its personalization data,
  and fine-tunes with the shared procedure (p_i held fixed). The global model alone predicts
  through the generic input g.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedmeta.algorithms.base import ClientData, ClientUpdate, Context, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedproto import one_hot
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, cross_entropy, masked_mean
from fedmeta.models import CLASSIFIER

GCE, COV = "gce.", "cov."  # the global category embedding layer and the conditional valve
EMBEDDINGS = GCE + "weight"
CONDITION = "gpfl.condition"  # a client's personalized conditional input, in the parameters it predicts with


class ConditionalValve(nn.Module):
    """CoV's parameters: γ and β, each a linear layer, ReLU and layer norm of ``units`` (its forward
    is ``valve``, on a parameter dict)."""

    def __init__(self, units: int):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(units, units), nn.ReLU(), nn.LayerNorm([units]))
        self.beta = nn.Sequential(nn.Linear(units, units), nn.ReLU(), nn.LayerNorm([units]))


def valve(params: Params, z: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """CoV(z, c) = ReLU(z ⊙ (γ(c) + 1) + β(c))."""

    def branch(name: str) -> torch.Tensor:
        prefix = f"{COV}{name}."
        h = F.relu(F.linear(condition, params[prefix + "0.weight"], params[prefix + "0.bias"]))
        return F.layer_norm(h, h.shape[-1:], params[prefix + "2.weight"], params[prefix + "2.bias"])

    return F.relu(z * (branch("gamma") + 1) + branch("beta"))


def label_share(batch: Batch, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """The share of each class among ``batch``'s real samples."""
    weights = one_hot(batch.y, classes, dtype)
    if batch.mask is not None:
        weights = weights * batch.mask.unsqueeze(-1).to(dtype)
    counts = weights.sum(0)
    return counts / counts.sum()


class GPFL(FedAvg):
    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> nn.Module:
        """The base network with ``gce`` (an embedding per class) and ``cov`` (the conditional
        valve), both of the representation's size."""
        model = super().build_model(cfg, num_classes, sources)
        units = model.head.weight.shape[1]
        model.gce = nn.Embedding(num_classes, units)
        model.cov = ConditionalValve(units)
        return model

    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.head_names, self.shared_names = self.split_names((CLASSIFIER,))
        self.model_names = [n for n, _ in model.named_parameters()]
        self.decayed = [n for n in self.model_names if n.startswith((GCE, COV))]

    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The head on CoV(z, p_i); without a client's p_i (the global model), on CoV(z, g)."""
        condition = params[CONDITION] if CONDITION in params else params[EMBEDDINGS].mean(0)
        return self.head(params, valve(params, self.embed(params, x, mask), condition))

    def embed(self, params: Params, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        weights = {n: params[n] for n in self.model_names}
        return self.run_model(self.model, weights, x, mask=mask, embedding=True)

    @staticmethod
    def head(params: Params, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, params[CLASSIFIER + "weight"], params[CLASSIFIER + "bias"])

    def gpfl_loss(self, params: Params, batch: Batch, share: torch.Tensor, received: torch.Tensor):
        """The three terms on ``batch``; ``received``: the GCE the client started from (fixed), whose
        embeddings make both conditional inputs (``share``: the client's label distribution)."""
        z = self.embed(params, batch.x, batch.mask)
        personal = valve(params, z, share @ received)
        generic = valve(params, z, received.mean(0))
        ce = masked_mean(cross_entropy(self.head(params, personal), batch.y), batch.mask)
        cosines = F.normalize(generic, dim=-1) @ F.normalize(params[EMBEDDINGS], dim=-1).T
        angular = masked_mean(cross_entropy(cosines, batch.y), batch.mask)
        gap = generic - one_hot(batch.y, received.shape[0], received.dtype) @ received
        if batch.mask is not None:
            gap = torch.where(batch.mask.to(torch.bool).unsqueeze(-1), gap, 0.0)
        return ce + angular + self.cfg.lam * gap.pow(2).sum().sqrt()

    def client_state(self, client_id: int, params: Params) -> dict:
        kept = self.client_states.get(client_id, {})
        classes = params[CLASSIFIER + "bias"]  # a client that never trained: the uniform distribution
        share = kept["share"].to(classes) if "share" in kept else torch.full_like(classes, 1 / len(classes))
        return {"own": self.kept_params(client_id, params, self.head_names), "share": share}

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["own"], CONDITION: state["share"] @ params[EMBEDDINGS]}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        received, mu = params[EMBEDDINGS], self.cfg.mu
        share = label_share(data["all"], received.shape[0], received.dtype)

        def decayed(trained: Params, grads: Params) -> Params:  # torch SGD's weight decay on GCE and CoV
            return {n: grads[n] + mu * trained[n] if n in self.decayed else grads[n] for n in grads}

        trained, loss = self.local_sgd(
            {**params, **state["own"]},
            data["epochs"],
            self.cfg.local_lr,
            self.cfg.momentum,
            objective=lambda w, batch: self.gpfl_loss(w, batch, share, received),
            correction=decayed,
        )
        own = {n: trained[n] for n in self.head_names}
        return LocalResult({n: trained[n] for n in self.shared_names}, loss, {"own": own, "share": share}, {})

    def draw(self, client: Client, round_: int) -> ClientData:
        return {**super().draw(client, round_), "all": client.batch(self.cfg.train_split, None)}

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state={}))  # extractor, GCE, CoV, weight, loss
        kept = self.keep(result.state["own"], self.head_names)
        update.state = {**(update.state or {}), **kept, "share": result.state["share"].detach().clone()}
        return update

    # ---- new clients: the global model, p_i from the label distribution of their data ----------
    def personalization_data(self, client: Client) -> ClientData:
        return {"labelled": client.batch("pers", None)}

    def personal_params(self, params: Params, data: ClientData) -> Params:
        embeddings = params[EMBEDDINGS]
        share = label_share(data["labelled"], embeddings.shape[0], embeddings.dtype)
        return {**params, CONDITION: share @ embeddings}

    def adapted_names(self, step: int) -> list[str] | None:
        return self.model_names  # p_i held fixed
