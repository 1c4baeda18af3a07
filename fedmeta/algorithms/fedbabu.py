"""FedBABU (Oh, Kim & Yun, ICLR 2022, "FedBABU: Toward Enhanced Representation for Federated Image
Classification"): the body is trained federatedly under a head that stays at its random
initialization — a sampled client trains the body only (the head frozen) for FedAvg's local
epochs and sends the body; the server averages it. The head is never trained, sent or averaged
during federated training, so clients keep nothing.

At test time the whole model is fine-tuned (the paper, and the authors' notebook: body and head at
the same step size): a new client fine-tunes all layers with the shared procedure from the trained
body and the initial head. The head is the last linear layer (the authors' ``linear``), initialized
as the model's other layers are (PyTorch's default for Linear, as in the authors' federated code;
their orthogonal and other initializations are a centralized ablation, ``main_single.py``).
"""

from __future__ import annotations

from fedmeta.algorithms.base import ClientData, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.functional import Params
from fedmeta.models import CLASSIFIER


class FedBABU(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.head_names, self.body_names = self.split_names((CLASSIFIER,))

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        params, loss = self.local_sgd(
            params, data["epochs"], self.cfg.local_lr, self.cfg.momentum, trainable=self.body_names
        )
        return LocalResult({n: params[n] for n in self.body_names}, loss, {}, {})
