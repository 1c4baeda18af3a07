"""Local-only: no federation. Clients never send anything, so the global model stays at its
initialization, and each new client trains it from there on its own data with the same
test-time step budget as every method — the floor every federated method must beat."""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, LocalResult
from fedmeta.data.federation import Client
from fedmeta.functional import Params


class Local(Algorithm):
    def draw(self, client: Client, round_: int) -> ClientData:
        return {"batch": client.batch("all", self.cfg.batch_size, client.generator(round_))}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        # Nothing is trained or sent; the reported loss is that of the (untouched) initial model.
        return LocalResult({}, self.loss(params, data["batch"]).detach(), {}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        return ClientUpdate(client.id, {}, 0.0, result.loss.detach())
