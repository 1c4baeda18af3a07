"""FedAvg (McMahan et al. 2017): local SGD epochs on each client, sample-weighted averaging.

FedAvg-FT is the same training; it differs only at test time, where new clients fine-tune the
global model with the shared personalization procedure (its config sets the steps).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import Algorithm, ClientUpdate, trainable_copy
from fedmeta.data.federation import Client


class FedAvg(Algorithm):
    def local_update(self, client: Client, round_: int) -> ClientUpdate:
        generator = client.generator(round_)
        params = trainable_copy(self.global_params())
        optimizer = torch.optim.SGD(params.values(), lr=self.cfg.local_lr, momentum=self.cfg.momentum)
        losses = []
        for _ in range(self.cfg.local_epochs):
            for batch in client.epoch("all", self.cfg.batch_size, generator):
                loss = self.loss(params, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
        return ClientUpdate(client.id, {k: p.detach() for k, p in params.items()}, float(client.num_samples),
                            torch.stack(losses).mean().item())
