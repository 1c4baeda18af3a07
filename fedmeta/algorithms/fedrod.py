"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022), its linear personalized head.

The model is a body with two heads: a generic head, trained with the body by every client and
averaged by the server like FedAvg's model, and a personalized head that stays with its client.
A client's prediction adds the two heads' logits. Each local step on a batch:

- the body and the generic head descend the balanced softmax loss, the cross-entropy of the
  generic logits shifted by the log of the client's class counts, log n_{k,j} — so the generic
  head learns as if the client's classes were balanced (the paper's robust generic objective);
- the personalized head descends the cross-entropy of the generic logits (held fixed) plus its
  own, on the body's features (held fixed).

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- Local training: FedAvg's epochs of SGD at ``local_lr`` for both, the two losses from one forward
  pass (PFLlib's order: both steps read the batch's features before either moves); the loss a
  client reports is their sum. The class counts are those of the batches it trains on (every
  epoch holds each sample once: the counts of all its data, times the epochs, which the softmax
  does not see).
- The personalized head of a client that never took part is the model's initial one, a copy of
  the generic head at initialization (PFLlib's deep copy); the server never averages it.
- What travels: the body and the generic head; the personalized head is per-client state (on
  Flower, on its node).
- Evaluation: new clients are scored (the paper's protocol). A new client has no personalized head: it starts from
  zero, so its first prediction is the generic model's, and the shared personalization procedure
  trains that head alone on the two heads' summed logits, as a training client's head step does
  (the paper's hypernetwork for new clients is not implemented). Averaging: FedAvg's, by sample
  count.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fedmeta.algorithms.base import ClientData, ClientUpdate, Context, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedproto import one_hot
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, masked_mean
from fedmeta.models import CLASSIFIER

PERSONAL = "personal_head."  # the personalized head's parameter names


class FedRoD(FedAvg):
    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> nn.Module:
        """The base CNN, its ``head`` the generic one, and ``personal_head``: a copy of it."""
        model = super().build_model(cfg, num_classes, sources)
        model.personal_head = copy.deepcopy(model.head)
        return model

    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.personal_names, self.shared_names = self.split_names((PERSONAL,))

    def heads(self, params: Params, x: torch.Tensor, mask: torch.Tensor | None) -> tuple:
        """The body's features, the generic head's logits and the personalized head's."""
        z = self.run_model(self.model, params, x, mask=mask, embedding=True)
        generic = F.linear(z, params[CLASSIFIER + "weight"], params[CLASSIFIER + "bias"])
        return z, generic, F.linear(z, params[PERSONAL + "weight"], params[PERSONAL + "bias"])

    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        _, generic, personal = self.heads(params, x, mask)
        return generic + personal

    def rod_loss(self, params: Params, batch: Batch, log_counts: torch.Tensor) -> torch.Tensor:
        """The balanced softmax loss of the generic head (and the body), plus the cross-entropy of
        both heads' logits for the personalized head, each on what the other holds fixed."""
        z, generic, _ = self.heads(params, batch.x, batch.mask)
        balanced = F.cross_entropy(generic + log_counts, batch.y, reduction="none")
        personal = F.linear(z.detach(), params[PERSONAL + "weight"], params[PERSONAL + "bias"])
        both = F.cross_entropy(generic.detach() + personal, batch.y, reduction="none")
        return masked_mean(balanced, batch.mask) + masked_mean(both, batch.mask)

    def client_state(self, client_id: int, params: Params) -> dict:
        return {"own": self.kept_params(client_id, params, self.personal_names)}

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["own"]}  # the generic model with its personalized head

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        batches = data["epochs"]
        classes = params[CLASSIFIER + "bias"].shape[0]
        dtype = params[CLASSIFIER + "bias"].dtype
        counts = sum((one_hot(b.y, classes, dtype) * _weights(b, dtype)).sum(0) for b in batches)
        log_counts = counts.log()  # −inf for a class the client lacks: it never enters its softmax
        trained, loss = self.local_sgd(
            {**params, **state["own"]},
            batches,
            self.cfg.local_lr,
            self.cfg.momentum,
            objective=lambda w, batch: self.rod_loss(w, batch, log_counts),
        )
        shared = {n: trained[n] for n in self.shared_names}
        return LocalResult(shared, loss, {"own": {n: trained[n] for n in self.personal_names}}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state={}))  # body and generic head, weight, loss
        update.state = {**(update.state or {}), **self.keep(result.state["own"], self.personal_names)}
        return update

    # ---- new clients: a personalized head from zero, trained alone --------------------------
    def personal_params(self, params: Params, data: ClientData) -> Params:
        return {**params, **{n: torch.zeros_like(params[n]) for n in self.personal_names}}

    def adapted_names(self, step: int) -> list[str] | None:
        return self.personal_names


def _weights(batch: Batch, dtype: torch.dtype) -> torch.Tensor:
    """A batch's samples' weights in a count: 0 for padding and for a stacked client's idle step."""
    weight = torch.ones_like(batch.y, dtype=dtype) if batch.mask is None else batch.mask.to(dtype)
    if batch.active is not None:
        weight = weight * batch.active.to(dtype)
    return weight.unsqueeze(-1)
