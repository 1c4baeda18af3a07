"""IFCA (Ghosh et al. 2020): k global models. A sampled client evaluates every model on its own
data, picks the one with the lowest loss, trains that one locally and sends it back; the server
averages each model over the clients that chose it (a model nobody chose is kept).

``share_body=true`` is the paper's weight-sharing variant: the k models share everything but the
head; a client's trained body is sent for every cluster, so the body is averaged over all clients
while each head is averaged over its own cluster. IFCA-FT: a new client picks its model the same
way, on its personalization split, and fine-tunes it with the shared test-time procedure.

The choice is data-dependent, yet the local update stays one vmappable function: the chosen
model's parameters are gathered from the k stacked ones by index, so stacked clients may choose
different models.
"""

from __future__ import annotations

import torch
from torch import nn

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, Context, LocalResult, masked
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params
from fedmeta.models import CLASSIFIER


class ClusteredNets(nn.Module):
    """k networks of one architecture; ``share_body`` starts them from one body."""

    def __init__(self, make_net, k: int, share_body: bool):
        super().__init__()
        self.nets = nn.ModuleList(make_net() for _ in range(k))
        if share_body:
            body = {n: p for n, p in self.nets[0].state_dict().items() if not n.startswith(CLASSIFIER)}
            for net in self.nets[1:]:
                net.load_state_dict(body, strict=False)


class IFCA(Algorithm):
    model: ClusteredNets

    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> nn.Module:
        """k networks: ``method.clusters``, or (null, on Meta-Dataset) one per source drawn."""
        return ClusteredNets(
            lambda: super(IFCA, cls).build_model(cfg, num_classes),
            cfg.method.clusters or len(sources),
            cfg.method.share_body,
        )

    @property
    def clusters(self) -> int:
        return len(self.model.nets)

    def cluster_params(self, params: Params, j: int | torch.Tensor) -> Params:
        """Model ``j`` of the k in ``params``; ``j`` may be a (vmapped) tensor."""
        names = [n[len("nets.0.") :] for n in params if n.startswith("nets.0.")]
        if isinstance(j, int):
            return {n: params[f"nets.{j}.{n}"] for n in names}
        return {n: torch.stack([params[f"nets.{c}.{n}"] for c in range(self.clusters)])[j] for n in names}

    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.run_model(self.model.nets[0], params, x, **masked(mask))  # params: one cluster's network

    def choose(self, params: Params, batch: Batch) -> torch.Tensor:
        """The index of the model with the lowest loss on ``batch``."""
        with torch.no_grad():
            losses = torch.stack(
                [self.loss(self.cluster_params(params, j), batch) for j in range(self.clusters)]
            )
        return losses.argmin()

    def choose_cluster(self, client: Client, split: str) -> int:
        return int(self.choose(self.global_params(), client.batch(split, None)))

    def draw(self, client: Client, round_: int) -> ClientData:
        cfg = self.cfg
        return {
            "choice": client.batch(cfg.train_split, None),
            "epochs": client.epochs(
                cfg.train_split,
                cfg.batch_size,
                client.generator(round_),
                cfg.local_epochs,
                cfg.drop_last,
                cfg.shuffle == "every_epoch",
            ),
        }

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        j = self.choose(params, data["choice"])
        trained, loss = self.local_sgd(
            self.cluster_params(params, j), data["epochs"], self.cfg.local_lr, self.cfg.momentum
        )
        return LocalResult(trained, loss, {}, {"cluster": j})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        j = int(result.extra["cluster"])  # which model it sends: one host read a client, IFCA's own
        clusters = range(self.clusters) if self.cfg.share_body else [j]
        sent = {
            f"nets.{c}.{n}": p.detach()
            for c in clusters
            for n, p in result.params.items()
            if c == j or not n.startswith(CLASSIFIER)
        }
        return ClientUpdate(client.id, sent, self.update_weight(client), result.loss.detach())

    def personalization_data(self, client: Client) -> ClientData:
        return {"choice": client.batch("pers", None)}

    def personal_params(self, params: Params, data: ClientData) -> Params:
        return self.cluster_params(params, self.choose(params, data["choice"]))
