"""FedAvg whose server keeps the last model each client sent and gives each client a model of its
own to start from: the mean of every kept model weighted by how similar it is to the client's
(FedAMP's attentive message passing, Huang et al. 2021, in its simplest form). Client k starts
from u_k = ξ_kk w_k + Σ_{j≠k} ξ_kj w_j, ξ_kk = ``self_weight``, the other weights a softmax of
``sharpness`` · cos(w_k, w_j), and trains FedAvg's epochs with a pull λ/2‖w − u_k‖² toward it.
A client that has not sent a model starts from the global one (FedAvg's mean, which new clients
fine-tune); the training-clients protocol scores each client's u_k."""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.functional import Params, proximal


class ServerModels(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.sent: dict[int, Params] = {}  # w_k: each client's last model, in method.kept_dtype
        self.arrived: dict[int, Params] = {}  # on a Flower node: the u_k that came with the message

    def own_model(self, client_id: int, params: Params) -> Params:
        """u_k from the kept models; the global ``params`` for a client that has sent none."""
        if client_id in self.arrived:  # a node has no kept models: the server sent u_k
            return self.arrived[client_id]
        if client_id not in self.sent:
            return params
        ids = list(self.sent)
        flat = torch.stack([torch.cat([t.float().flatten() for t in self.sent[i].values()]) for i in ids])
        k = ids.index(client_id)
        weights = torch.zeros(len(ids))
        if len(ids) > 1:
            others = torch.arange(len(ids)) != k
            similarity = torch.nn.functional.cosine_similarity(flat[k : k + 1], flat[others])
            weights[others] = (1 - self.cfg.self_weight) * torch.softmax(self.cfg.sharpness * similarity, 0)
        weights[k] = self.cfg.self_weight if len(ids) > 1 else 1.0
        mixed = weights.to(flat) @ flat
        model, start = {}, 0
        for name, p in params.items():
            model[name], start = mixed[start : start + p.numel()].view_as(p).to(p), start + p.numel()
        return model

    def client_state(self, client_id: int, params: Params) -> dict:
        return {"own": self.own_model(client_id, params)}

    def kept_model(self, params: Params, state: dict) -> Params:
        return state["own"]  # what the training-clients protocol scores

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        own, lam = state["own"], self.cfg.lam
        params, loss = self.local_sgd(
            own,
            data["epochs"],
            self.cfg.local_lr,
            self.cfg.momentum,
            objective=lambda w, batch: self.loss(w, batch) + 0.5 * lam * proximal(w, own),
        )
        return LocalResult(params, loss, {}, {})

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        super().aggregate(updates)  # the global model: FedAvg's mean, for new clients
        dtype = getattr(torch, self.cfg.kept_dtype)  # bfloat16 halves every checkpoint's share
        names = [n for n, _ in self.model.named_parameters()]
        for update in updates:
            self.sent[update.client_id] = {n: update.params[n].detach().to(dtype).clone() for n in names}

    def broadcast_state(self, client_id: int) -> Params:
        params = self.global_params()  # the global parameters, outside a round
        return {"own." + n: t for n, t in self.own_model(client_id, params).items()}

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.arrived = {client_id: {n[4:]: t for n, t in tensors.items() if n.startswith("own.")}}

    def federation_state(self) -> dict:
        return {**super().federation_state(), "sent": self.sent}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.sent = dict(state.get("sent", {}))
