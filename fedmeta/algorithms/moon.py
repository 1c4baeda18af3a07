"""MOON (Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021): FedAvg whose clients
also pull their representation toward the global model's and push it away from their own previous
model's.

On a batch, z is the representation of the model being trained, z_glob that of the global model the
client received this round and z_prev that of the model it ended its last round with (both held
fixed). Each sample adds the model-contrastive loss

    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

sim the cosine similarity, to its cross-entropy: L = CE + μ·mean(ℓ_con). The server averages as
FedAvg does. μ = 0 is FedAvg.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The representation is the model's own ``embedding=True`` output, the input of its classifier
  (as FL-bench's and PFLlib's MOON). The paper adds a two-layer projection head (256 outputs)
  between the encoder and the classifier and contrasts its output; the model here has none.
- τ = 0.5, the paper's value everywhere; μ = 1, the default of the authors' code and the paper's
  best value on CIFAR-100 and Tiny-ImageNet (its grid {0.1, 1, 5, 10}; 5 on CIFAR-10, which the
  authors' README uses). One previous model per client (the authors' ``model_buffer_size`` 1).
- The previous model is per-client state (``client_states``; on Flower, on its node), kept in
  ``method.kept_dtype`` (float16 by default: half the bytes of float32, and the negatives' features
  come from a rounded copy). A client that has not trained before has none: it takes the global
  model it receives as its previous one, which makes ℓ_con the constant log 2 with no gradient —
  the authors' first round, whose pool of previous models is empty.
- Local training is FedAvg's SGD epochs at the protocol's step size (the authors' code: momentum
  0.9 and weight decay 10⁻⁵; ``method.momentum`` is there to set). The loss a client reports is L.
- Evaluation: new clients fine-tune the global model with the shared procedure (the contrastive
  term is a training device; the paper scores the global model: ``personalization.steps=0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, cross_entropy, masked_mean
from fedmeta.models import CLASSIFIER


class MOON(FedAvg):
    def embed(self, params: Params, batch: Batch) -> torch.Tensor:
        return self.run_model(self.model, params, batch.x, mask=batch.mask, embedding=True)

    def contrastive_loss(self, params: Params, batch: Batch, anchors: tuple[Params, Params]) -> torch.Tensor:
        """CE + μ·mean ℓ_con on ``batch``; ``anchors``: the global and the previous parameters."""
        z = self.embed(params, batch)
        logits = F.linear(z, params[CLASSIFIER + "weight"].to(z), params[CLASSIFIER + "bias"].to(z))
        ce = masked_mean(cross_entropy(logits, batch.y), batch.mask)
        positive, negative = (
            F.cosine_similarity(z, self.embed(anchor, batch).detach(), dim=-1) for anchor in anchors
        )
        tau = self.cfg.tau
        contrast = torch.logsumexp(torch.stack([positive, negative], -1) / tau, -1) - positive / tau
        return ce + self.cfg.mu * masked_mean(contrast, batch.mask)

    def client_state(self, client_id: int, params: Params) -> dict:
        kept = self.client_states.get(client_id, {}).get("previous")
        previous = dict(params) if kept is None else {n: kept[n].to(params[n]) for n in params}
        return {"previous": previous}  # a first round: the global model, so ℓ_con has no gradient

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        anchors = (params, state["previous"])  # the round's global model and the client's last one
        trained, loss = self.local_sgd(
            params,
            data["epochs"],
            self.cfg.local_lr,
            self.cfg.momentum,
            objective=lambda w, batch: self.contrastive_loss(w, batch, anchors),
        )
        return LocalResult(trained, loss, {"previous": trained}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state={}))  # every parameter, weight, loss
        dtype = getattr(torch, self.cfg.kept_dtype)  # copies: vmapped results are views
        previous = {n: p.detach().to(dtype, copy=True) for n, p in result.state["previous"].items()}
        update.state = {**(update.state or {}), "previous": previous}
        return update
