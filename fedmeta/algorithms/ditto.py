"""Ditto (Li et al. 2021): the global model w is trained as in FedAvg; a personal model v is
trained on the client's own data with the proximal term λ/2‖v − w‖², which pulls it toward w.

In this protocol only new clients are evaluated, and a training client's personal model never
feeds back into w, so training clients keep no personal models (stateless, as every client here);
each new client trains its personal model from w with the proximal term in the shared
test-time procedure.

The CAFeMe authors' Ditto (``variant=authors``) trains w with a per-client Adam on 5 batches a
round, after its personal-model update has read 5 batches of the same persistent iterator
(``personal_batches``: read and passed over here — that personal model is anchored on the client's
previous local model and never reaches w or a new client), and fine-tunes new clients without the
proximal term (``lam=0``).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Batch
from fedmeta.functional import Params, proximal


class Ditto(FedAvg):
    def batches_skipped(self) -> int:
        return self.cfg.personal_batches

    def adaptation_loss(self, params: Params, batch: Batch, start: Params) -> torch.Tensor:
        # start = w: the global model a new client's personalization starts from
        return super().adaptation_loss(params, batch, start) + 0.5 * self.cfg.lam * proximal(params, start)
