"""IFCA (Ghosh et al. 2020): k global models. A sampled client evaluates every model on its own
data, picks the one with the lowest loss, trains that one locally and sends it back; the server
averages each model over the clients that chose it (a model nobody chose is kept).

``share_body=true`` is the paper's weight-sharing variant: the k models share everything but the
head; a client's trained body is sent for every cluster, so the body is averaged over all clients
while each head is averaged over its own cluster. IFCA-FT: a new client picks its model the same
way, on its personalization split, and fine-tunes it with the shared test-time procedure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedmeta.algorithms.base import Algorithm, ClientUpdate, Context, Params, trainable_copy
from fedmeta.data.federation import Client

HEAD_PREFIX = "head."


class ClusteredNets(nn.Module):
    """k networks of one architecture; ``share_body`` starts them from one body."""

    def __init__(self, make_net, k: int, share_body: bool):
        super().__init__()
        self.nets = nn.ModuleList(make_net() for _ in range(k))
        if share_body:
            body = {n: p for n, p in self.nets[0].state_dict().items() if not n.startswith(HEAD_PREFIX)}
            for net in self.nets[1:]:
                net.load_state_dict(body, strict=False)


class IFCA(Algorithm):
    model: ClusteredNets

    def cluster_params(self, j: int) -> Params:
        prefix = f"nets.{j}."
        return {n[len(prefix):]: p for n, p in self.global_params().items() if n.startswith(prefix)}

    def forward(self, params: Params, x: torch.Tensor, context: Context = None) -> torch.Tensor:
        return self.run_model(self.model.nets[0], params, x)  # params: one cluster's network

    def choose_cluster(self, client: Client, split: str) -> int:
        x, y = client.data.take(client.indices(split))
        with torch.no_grad():
            losses = [F.cross_entropy(self(self.cluster_params(j), x), y) for j in range(len(self.model.nets))]
        return int(torch.stack(losses).argmin())

    def local_update(self, client: Client, round_: int) -> ClientUpdate:
        j = self.choose_cluster(client, "all")
        params = trainable_copy(self.cluster_params(j))
        loss = self.local_sgd(params, client, client.generator(round_), self.cfg.local_epochs, self.cfg.local_lr,
                              self.cfg.momentum)
        clusters = range(len(self.model.nets)) if self.cfg.share_body else [j]
        sent = {f"nets.{c}.{n}": p.detach() for c in clusters for n, p in params.items()
                if c == j or not n.startswith(HEAD_PREFIX)}
        return ClientUpdate(client.id, sent, float(client.num_samples), loss)

    def personal_params(self, client: Client) -> Params:
        return trainable_copy(self.cluster_params(self.choose_cluster(client, "pers")))
