"""FedRep (Collins et al. 2021): a shared representation (the body) is averaged by the server;
each client's head stays local. Every round a client first trains its head with the body frozen,
then the body with the head frozen, and sends the body only.

Heads are the one piece of per-client state here (the last linear layer: 5,130 numbers on
RMNIST); a client that has not taken part yet starts from the global head, which the server
never changes — so it stays at its initialization, as does a new client's at test time.
"""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, LocalResult
from fedmeta.data.federation import Client
from fedmeta.functional import Params

HEAD_PREFIX = "head."


class FedRep(Algorithm):
    def __init__(self, model, cfg):
        super().__init__(model, cfg)
        names = [name for name, _ in model.named_parameters()]
        self.head_names = [n for n in names if n.startswith(HEAD_PREFIX)]
        self.body_names = [n for n in names if not n.startswith(HEAD_PREFIX)]

    def draw(self, client: Client, round_: int) -> ClientData:
        generator = client.generator(round_)
        head = client.epochs("all", self.cfg.batch_size, generator, self.cfg.head_epochs)
        return {"head": head, "body": client.epochs("all", self.cfg.batch_size, generator, self.cfg.body_epochs)}

    def client_state(self, client_id: int, params: Params) -> dict:
        return self.client_states.get(client_id) or {n: params[n] for n in self.head_names}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        params = {**params, **state}  # the client's own head
        params, _ = self.local_sgd(params, data["head"], self.cfg.local_lr, self.cfg.momentum, trainable=self.head_names)
        params, loss = self.local_sgd(params, data["body"], self.cfg.local_lr, self.cfg.momentum, trainable=self.body_names)
        return LocalResult({n: params[n] for n in self.body_names}, loss, {n: params[n] for n in self.head_names}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        update.state = {n: p.detach().clone() for n, p in result.state.items()}  # the head stays with the client
        return update
