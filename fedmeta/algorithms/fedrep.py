"""FedRep (Collins et al. 2021): a shared representation (the body) is averaged by the server;
each client's head stays local. Every round a client first trains its head with the body frozen,
then the body with the head frozen, and sends the body only.

Heads are the one piece of per-client state here (the last linear layer: 5,130 numbers on
RMNIST); a client that has not taken part yet starts from the global head, which the server
never changes — so it stays at its initialization, as does a new client's at test time.
"""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientUpdate, trainable_copy
from fedmeta.data.federation import Client

HEAD_PREFIX = "head."


class FedRep(Algorithm):
    def __init__(self, model, cfg):
        super().__init__(model, cfg)
        names = [name for name, _ in model.named_parameters()]
        self.head_names = [n for n in names if n.startswith(HEAD_PREFIX)]
        self.body_names = [n for n in names if not n.startswith(HEAD_PREFIX)]

    def local_update(self, client: Client, round_: int) -> ClientUpdate:
        generator = client.generator(round_)
        params = trainable_copy({**self.global_params(), **self.client_states.get(client.id, {})})
        self.local_sgd(params, client, generator, self.cfg.head_epochs, self.cfg.local_lr, self.cfg.momentum,
                       trainable=self.head_names)
        loss = self.local_sgd(params, client, generator, self.cfg.body_epochs, self.cfg.local_lr, self.cfg.momentum,
                              trainable=self.body_names)
        return ClientUpdate(client.id, {n: params[n].detach() for n in self.body_names}, float(client.num_samples), loss,
                            state={n: params[n].detach().clone() for n in self.head_names})  # the head stays with the client
