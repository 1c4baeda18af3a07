"""FedAvg (McMahan et al. 2017): local SGD epochs on each client, sample-weighted averaging.

FedAvg-FT is the same training; it differs only at test time, where new clients fine-tune the
global model with the shared personalization procedure (its config sets the steps).
"""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientData, LocalResult
from fedmeta.data.federation import Client
from fedmeta.functional import Params


class FedAvg(Algorithm):
    def draw(self, client: Client, round_: int) -> ClientData:
        return {"epochs": client.epochs("all", self.cfg.batch_size, client.generator(round_), self.cfg.local_epochs)}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        params, loss = self.local_sgd(params, data["epochs"], self.cfg.local_lr, self.cfg.momentum)
        return LocalResult(params, loss, {}, {})
