"""pFedHN (Shamsian, Navon, Fetaya & Chechik, "Personalized Federated Learning using
Hypernetworks", ICML 2021).

No model is shared: the server holds a hypernetwork h(·; φ) and an embedding v_i per client, and
makes each client's whole model, θ_i = h(v_i; φ). A sampled client receives θ_i, trains it on its
data to θ̃_i and sends it back; the server moves φ and v_i along

    ∇_{φ, v_i} = (∂θ_i/∂(φ, v_i))ᵀ (θ_i − θ̃_i),

the gradient of ⟨θ_i(φ, v_i), Δθ_i⟩ with the change held fixed, with its own optimizer. The network
is an MLP from the embedding (a linear layer, then ``hidden_layers`` × (ReLU, linear), all
``hidden_dim`` wide) and a linear layer per parameter tensor of the model, from the MLP's output
to the tensor's entries.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- The authors' code's settings for the network and its optimizer: embedding size 1 + N/4 (N: the
  training clients; ``method.embedding_dim: 0``), 100 hidden units, 3 hidden layers, SGD with step
  size 10⁻², momentum 0.9 and weight decay 10⁻³, the gradient's norm clipped at 50.
- Its output layers start with zero weights and the model's initial parameters as their biases,
  so every client first receives the seed's one initial model, as in every fedmeta method (the
  authors' layers start at torch's random initialization, which gives BatchNorm and dense layers
  weights of other scales than the model's own initialization). The architecture is theirs.
- The paper steps the network once per client update, a client at a time. Here the round's
  clients train from the same network; the server then takes a step per client, in the round's
  order, each on that client's Δθ_i (from the model it received) with the Jacobian of the network
  as the earlier steps left it (FL-bench trains the round's clients one after another instead).
- Local training: FedAvg's SGD epochs at the protocol's step size (the authors: 50 steps of SGD
  with momentum 0.9 and weight decay 5·10⁻⁵ at 5·10⁻³).
- What it costs: the network holds ``hidden_dim`` + 1 numbers per model parameter (58 million
  for the RMNIST CNN), its optimizer as many again, all in every checkpoint.
- Evaluation: the training-clients protocol scores h(v_i) for each client, as the paper. The
  server's model — where new clients start, fine-tuning with the shared procedure — is the model
  the network makes for the mean embedding of the clients that have taken part (the paper instead
  learns a new client's embedding with the network fixed). On Flower the server sends a client its
  θ_i with the model.
"""

from __future__ import annotations

import torch
from torch import nn

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.functional import Params


class HyperNetwork(nn.Module):
    """v_i → θ_i: an embedding per client, an MLP, a linear layer per parameter tensor of ``model``
    (zero weights, the model's values as biases: every client's first θ_i is ``model``)."""

    def __init__(self, model: nn.Module, clients: int, embedding_dim: int, hidden_dim: int, layers: int):
        super().__init__()
        self.embeddings = nn.Embedding(clients, embedding_dim)
        mlp = [nn.Linear(embedding_dim, hidden_dim)]
        for _ in range(layers):
            mlp += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*mlp)
        self.shapes = {n: p.shape for n, p in model.named_parameters()}
        self.outputs = nn.ModuleDict()
        for name, p in model.named_parameters():
            layer = nn.Linear(hidden_dim, p.numel())
            nn.init.zeros_(layer.weight)
            with torch.no_grad():
                layer.bias.copy_(p.detach().flatten())
            self.outputs[name.replace(".", "-")] = layer

    def forward(self, features: torch.Tensor) -> Params:
        """The model made from ``features`` (the MLP's output) — one set, or a batch of them."""
        lead = features.shape[:-1]
        return {
            n: self.outputs[n.replace(".", "-")](features).view(*lead, *s) for n, s in self.shapes.items()
        }

    def made(self, clients: torch.Tensor) -> Params:
        return self(self.mlp(self.embeddings(clients)))


class PFedHN(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        size = cfg.embedding_dim or int(1 + self.training_clients() / 4)  # the authors' rule by default
        self.network = HyperNetwork(model, cfg.num_clients, size, cfg.hidden_dim, cfg.hidden_layers)
        self.network.to(next(model.parameters()).device)
        self.optimizer = torch.optim.SGD(
            self.network.parameters(),
            lr=cfg.server_lr,
            momentum=cfg.server_momentum,
            weight_decay=cfg.server_weight_decay,
        )
        self.took_part: list[int] = []  # the clients whose embeddings the server's model averages
        self.arrived: dict[int, Params] = {}  # on a Flower node: the θ_i that came with the message

    def made(self, client_id: int, params: Params) -> Params:
        """θ_i = h(v_i), without a graph, in the parameters' dtype and device."""
        with torch.no_grad():
            ids = torch.tensor([client_id], device=self.network.embeddings.weight.device)
            made = self.network.made(ids)
        return {n: made[n][0].to(params[n]) for n in params}

    def client_state(self, client_id: int, params: Params) -> dict:
        if client_id in self.arrived:  # a node has no network: the server sent θ_i
            return {"own": self.arrived[client_id]}
        return {"own": self.made(client_id, params)}

    def kept_model(self, params: Params, state: dict) -> Params:
        return state["own"]  # h(v_i), what the training-clients protocol scores

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        return super().local_update(state["own"], {}, data)  # FedAvg's SGD epochs from θ_i

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """A step of the network per client, in the round's order, on ⟨h(v_i), θ_i − θ̃_i⟩; then the
        server's model: the network's model for the mean embedding of the clients that took part."""
        names = list(self.network.shapes)
        sent = [u for u in updates if all(n in u.params for n in names)]
        received = {u.client_id: self.made(u.client_id, u.params) for u in sent}  # the θ_i they trained
        for update in sent:
            self.step(update.client_id, {n: received[update.client_id][n] - update.params[n] for n in names})
            if update.client_id not in self.took_part:
                self.took_part.append(update.client_id)
        self.refresh_model()

    def step(self, client_id: int, change: Params) -> None:
        """One optimizer step on the network along (∂θ_i/∂φ)ᵀ·``change`` (and v_i's)."""
        with torch.enable_grad():
            ids = torch.tensor([client_id], device=self.network.embeddings.weight.device)
            made = self.network.made(ids)
            surrogate = sum((made[n][0] * change[n].detach().to(made[n])).sum() for n in change)
            self.optimizer.zero_grad()
            surrogate.backward()
        nn.utils.clip_grad_norm_(self.network.parameters(), self.cfg.clip_norm)
        self.optimizer.step()

    def refresh_model(self) -> None:
        """The server's model: h(mean of the embeddings of the clients that took part)."""
        if not self.took_part:
            return
        with torch.no_grad():
            device = self.network.embeddings.weight.device
            embedding = self.network.embeddings(torch.tensor(self.took_part, device=device)).mean(0)
            made = self.network(self.network.mlp(embedding))
            for name, p in self.model.named_parameters():
                p.copy_(made[name].to(p))

    def broadcast_state(self, client_id: int) -> Params:
        return {"own." + n: t for n, t in self.made(client_id, self.global_params()).items()}

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.arrived = {client_id: {n[4:]: t for n, t in tensors.items() if n.startswith("own.")}}

    def federation_state(self) -> dict:
        return {
            **super().federation_state(),
            "network": self.network.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "took_part": list(self.took_part),
        }

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.network.load_state_dict(state["network"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.took_part = list(state.get("took_part", []))
