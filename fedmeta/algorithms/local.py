"""Local-only: no federation. Clients never send anything, so the global model stays at its
initialization, and each new client trains it from there on its own data with the same
test-time step budget as every method — the floor every federated method must beat."""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import Algorithm, ClientUpdate
from fedmeta.data.federation import Client


class Local(Algorithm):
    def local_update(self, client: Client, round_: int) -> ClientUpdate:
        # Nothing is trained or sent; the reported loss is that of the (untouched) initial model.
        with torch.no_grad():
            loss = self.loss(self.global_params(), client.batch("all", self.cfg.batch_size, client.generator(round_)))
        return ClientUpdate(client.id, {}, 0.0, loss.item())
