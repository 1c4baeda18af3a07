"""FedAvg (McMahan et al. 2017): local SGD epochs on each client, sample-weighted averaging.

FedAvg-FT is the same training; it differs only at test time, where new clients fine-tune the
global model with the shared personalization procedure (its config sets the steps).
"""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientUpdate, trainable_copy
from fedmeta.data.federation import Client


class FedAvg(Algorithm):
    def local_update(self, client: Client, round_: int) -> ClientUpdate:
        params = trainable_copy(self.global_params())
        loss = self.local_sgd(params, client, client.generator(round_), self.cfg.local_epochs, self.cfg.local_lr,
                              self.cfg.momentum)
        return ClientUpdate(client.id, {k: p.detach() for k, p in params.items()}, float(client.num_samples), loss)
