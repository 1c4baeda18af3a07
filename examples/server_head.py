"""FedAvg whose server also learns, with an optimizer of its own, a classifier for each client: an
embedding per client through one linear layer gives the correction of the global head that client
starts from (pFedHN's idea, Shamsian et al. 2021, for the head alone). A sampled client trains
FedAvg's local epochs from the global body and its own head; the server averages the models as
FedAvg does, then moves its network along Σ_k (made_k − trained_k) · ∂made_k/∂φ, pFedHN's update.
New clients, which have no embedding, start from the global model."""

from __future__ import annotations

import torch
from torch import nn

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.functional import Params
from fedmeta.models import CLASSIFIER


class ServerHead(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.head_shapes = {n: p.shape for n, p in model.named_parameters() if n.startswith(CLASSIFIER)}
        size = sum(shape.numel() for shape in self.head_shapes.values())
        self.network = nn.Sequential(
            nn.Embedding(cfg.num_clients, cfg.embedding_dim), nn.Linear(cfg.embedding_dim, size, bias=False)
        ).to(next(model.parameters()).device)  # float32 whatever the model's precision
        nn.init.zeros_(self.network[1].weight)  # every client starts from the global head
        self.optimizer = torch.optim.Adam(self.network.parameters(), lr=cfg.server_lr)

    def made_heads(self, client_ids: list[int]) -> Params:
        """Each client's head, stacked: the global head plus the network's correction (with autograd
        through the network, for the server's step)."""
        ids = torch.tensor(client_ids, device=self.network[1].weight.device)
        flat, model, heads, start = self.network(ids), dict(self.model.named_parameters()), {}, 0
        for name, shape in self.head_shapes.items():
            piece = flat[:, start : start + shape.numel()].reshape(len(client_ids), *shape)
            heads[name], start = model[name].detach().float() + piece, start + shape.numel()
        return heads

    def client_state(self, client_id: int, params: Params) -> dict:
        with torch.no_grad():
            made = self.made_heads([client_id])
        return {"head": {name: head[0].to(params[name]) for name, head in made.items()}}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        return super().local_update({**params, **state["head"]}, {}, data)  # SGD from its own head

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        made = self.made_heads([u.client_id for u in updates])  # before the global head moves
        super().aggregate(updates)  # the models: FedAvg's weighted mean
        # the gradient of Σ_k ⟨made_k − trained_k, made_k⟩ with the difference held fixed
        surrogate = sum(
            ((made[n] - torch.stack([u.params[n] for u in updates]).to(made[n])).detach() * made[n]).sum()
            for n in self.head_shapes
        )
        self.optimizer.zero_grad()
        surrogate.backward()  # the server's graph, eagerly: aggregate runs with autograd on
        self.optimizer.step()

    def federation_state(self) -> dict:
        network, optimizer = self.network.state_dict(), self.optimizer.state_dict()
        return {**super().federation_state(), "network": network, "optimizer": optimizer}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.network.load_state_dict(state["network"])
        self.optimizer.load_state_dict(state["optimizer"])
