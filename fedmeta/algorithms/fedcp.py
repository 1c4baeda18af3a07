"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy", KDD 2023).

The model is a shared feature extractor, a global head, a personalized head per client and a
conditional policy network (CPN, shared). For each sample the CPN reads the representation z
times the client's conditional vector v_i (normalized) and gives a policy {r, s} — for every
feature a pair that sums to one (a softmax over the pair: linear layer to twice the features,
layer norm, ReLU, then Gumbel-softmax at τ = 1). The personalized head reads z ⊙ r, the global
head z ⊙ s, and the prediction is the sum of their logits. v_i is the sum over classes of the
client's personalized head's weights.

A client trains the extractor, its personalized head and the CPN — the global head it received
held fixed — on the cross-entropy plus λ·MMD(z, z⁰), the maximum mean discrepancy (Gaussian
kernels of bandwidths 10, 15, 20 and 50, as the authors' code) between its representations and
those of the extractor it received (held fixed), and sends the extractor, the CPN and the global
head moved halfway to its personalized one, ½(W_p + W_g). The server averages them by sample count.

As implemented, and where fedmeta's protocol decides what the paper leaves open:
- λ = 5 (``method.lam``): the authors' run script. Local training: FedAvg's SGD epochs at the
  protocol's step size (``method.momentum``, 0 by default, as theirs).
- The Gumbel noise of the policy is drawn from the client's own seed of the round by a counter-
  based hash (a pure local update has no random generator of its own), one draw per sample,
  feature and step. Predictions — evaluation, a new client's fine-tuning — take the noise-free
  policy, the softmax alone (the authors' code also draws noise when it evaluates).
- v_i: the sum over classes of the personalized head's weights, normalized, as PFLlib's FedCP,
  computed from the head the client starts the round with and fixed during it (the authors'
  repository sums |W_p − W_g| instead). A client that has not trained yet has the initial
  personalized head (a copy of the global head at initialization; PFLlib's first v_i is random).
- The representation is the model's ``embedding=True`` output, on any of the models; the CPN
  (``cpn.``) and the personalized head (``personal_head.``) are parameters of the model.
- Evaluation: the training-clients protocol scores each client's personalized head with the
  global modules, as the paper. A new client starts from the global model with the global head
  as its personalized head too (then, as r + s = 1, its logits are the global head's on z, plus
  the bias once more) and fine-tunes everything with the shared procedure, v_i held fixed.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fedmeta.algorithms.base import ClientData, ClientUpdate, Context, LocalResult, step_weight, unless_idle
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, cross_entropy, grad_and_value, masked_mean, sgd
from fedmeta.models import CLASSIFIER

PERSONAL, CPN = "personal_head.", "cpn."  # the personalized head and the conditional policy network
CONTEXT = "fedcp.context"  # a client's conditional vector v_i, in the parameters it predicts with
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # the MMD's Gaussian kernels (the authors' code)
NOISE_PURPOSE = 41  # the client's draw of its round's noise seed (apart from its batches' draws)
MASK = 0x7FFFFFFF  # 31 bits: products of two such numbers fit in int64


def _mix(h: torch.Tensor) -> torch.Tensor:
    """An integer hash of 31-bit values (int64 tensors, no overflow), a few xorshift-multiply rounds."""
    for constant in (0x2C1B3C6D, 0x297A2D39, 0x5BD1E995 & MASK):
        h = ((h ^ (h >> 15)) * constant) & MASK
    return h ^ (h >> 16)


def gumbel(seed: torch.Tensor, step: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Standard Gumbel noise of ``shape`` (samples first), a function of ``seed``, ``step`` and each
    entry's place: a sample's draws do not depend on how many samples pad its batch."""
    place = torch.arange(torch.Size(shape).numel(), device=seed.device).view(shape)
    key = _mix((seed + 0x9E3779B * (step + 1)) & MASK)
    uniform = (_mix((place + key) & MASK).to(torch.float64) + 0.5) / (MASK + 1)
    return (-torch.log(-torch.log(uniform))).to(dtype)


def mmd(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The (biased) squared maximum mean discrepancy between the rows of ``x`` and ``y``, with the
    authors' sum of Gaussian kernels; over the real rows of a padded batch."""
    squares = lambda a, b: (a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2 * a @ b.T  # noqa: E731
    kernel = lambda d: sum(torch.exp(-0.5 * d / width) for width in BANDWIDTHS)  # noqa: E731
    terms = kernel(squares(x, x)) + kernel(squares(y, y)) - 2 * kernel(squares(x, y))
    if mask is None:
        return terms.mean()
    pairs = mask.to(terms.dtype).unsqueeze(1) * mask.to(terms.dtype).unsqueeze(0)
    return torch.where(pairs > 0, terms, 0.0).sum() / pairs.sum()


class FedCP(FedAvg):
    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> nn.Module:
        """The base network (its ``head`` the global head), ``personal_head`` (a copy of it) and
        ``cpn``: a linear layer to twice the representation's size and a layer norm."""
        model = super().build_model(cfg, num_classes, sources)
        units = model.head.weight.shape[1]
        model.personal_head = copy.deepcopy(model.head)
        model.cpn = nn.Sequential(nn.Linear(units, 2 * units), nn.LayerNorm([2 * units]))
        return model

    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.model_names = [n for n, _ in model.named_parameters()]
        self.personal_names = [n for n in self.model_names if n.startswith(PERSONAL)]
        self.global_head = [n for n in self.model_names if n.startswith(CLASSIFIER)]
        self.trained_names = [n for n in self.model_names if not n.startswith(CLASSIFIER)]

    def embed(self, params: Params, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        weights = {n: params[n] for n in self.model_names}
        return self.run_model(self.model, weights, x, mask=mask, embedding=True)

    @staticmethod
    def context(params: Params) -> torch.Tensor:
        """v_i: the personalized head's weights summed over classes, normalized."""
        return F.normalize(params[PERSONAL + "weight"].sum(0), dim=0)

    def logits(self, params: Params, z: torch.Tensor, context: torch.Tensor, noise=None) -> torch.Tensor:
        """The personalized head on z ⊙ r plus the global head on z ⊙ s, {r, s} the CPN's policy
        for z ⊙ v_i (Gumbel-softmax over each feature's pair with ``noise``; the softmax without)."""
        h = F.linear(z * context, params[CPN + "0.weight"], params[CPN + "0.bias"])
        h = F.relu(F.layer_norm(h, h.shape[-1:], params[CPN + "1.weight"], params[CPN + "1.bias"]))
        h = h.view(*z.shape[:-1], 2, z.shape[-1])
        policy = torch.softmax(h if noise is None else h + noise, dim=-2)
        personal = F.linear(z * policy[..., 0, :], params[PERSONAL + "weight"], params[PERSONAL + "bias"])
        shared = F.linear(z * policy[..., 1, :], params[CLASSIFIER + "weight"], params[CLASSIFIER + "bias"])
        return personal + shared

    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        vector = params[CONTEXT] if CONTEXT in params else self.context(params)
        return self.logits(params, self.embed(params, x, mask), vector)

    def cp_loss(self, params: Params, batch: Batch, fixed: dict, noise: torch.Tensor) -> torch.Tensor:
        """CE of the summed logits + λ·MMD(z, z⁰); ``fixed``: v_i and the received extractor's z⁰."""
        z = self.embed(params, batch.x, batch.mask)
        ce = masked_mean(cross_entropy(self.logits(params, z, fixed["context"], noise), batch.y), batch.mask)
        return ce + self.cfg.lam * mmd(z, fixed["received"], batch.mask)

    def draw(self, client: Client, round_: int) -> ClientData:
        generator = client.generator(round_, NOISE_PURPOSE)
        return {**super().draw(client, round_), "seed": torch.randint(MASK, (), generator=generator)}

    def client_state(self, client_id: int, params: Params) -> dict:
        return {"own": self.kept_params(client_id, params, self.personal_names)}

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["own"], CONTEXT: self.context(state["own"])}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        received, trained = params, {**params, **state["own"]}
        context, lr = self.context(state["own"]), self.cfg.local_lr
        velocity = (
            {n: torch.zeros_like(trained[n]) for n in self.trained_names} if self.cfg.momentum else None
        )
        total, steps = 0.0, 0.0
        for step, batch in enumerate(data["epochs"]):
            z = self.embed(received, batch.x, batch.mask).detach()  # the received extractor's z⁰
            fixed = {"context": context, "received": z}
            noise = gumbel(data["seed"], step, (*z.shape[:-1], 2, z.shape[-1]), z.dtype)

            def loss_of(p: Params, batch=batch, fixed=fixed, noise=noise, base=trained) -> torch.Tensor:
                return self.cp_loss({**base, **p}, batch, fixed, noise)

            grads, loss = grad_and_value(loss_of)({n: trained[n] for n in self.trained_names})
            stepped, new_velocity = sgd(trained, grads, lr, self.cfg.momentum, velocity)
            trained = {**trained, **unless_idle(batch, stepped, {n: trained[n] for n in stepped})}
            velocity = unless_idle(batch, new_velocity, velocity) if velocity is not None else None
            total, steps = total + step_weight(batch) * loss, steps + step_weight(batch)
        sent = {n: trained[n] for n in self.trained_names if n not in self.personal_names}
        for name in self.global_head:  # the global head moved halfway to the personalized one
            sent[name] = 0.5 * trained[PERSONAL + name[len(CLASSIFIER) :]] + 0.5 * received[name]
        loss = total / steps if len(data["epochs"]) else torch.zeros(())
        return LocalResult(sent, loss, {"own": {n: trained[n] for n in self.personal_names}}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state={}))  # extractor, CPN, global head
        update.state = {**(update.state or {}), **self.keep(result.state["own"], self.personal_names)}
        return update

    # ---- new clients: the global model, the global head as their personalized one too ----------
    def personal_params(self, params: Params, data: ClientData) -> Params:
        own = {PERSONAL + n[len(CLASSIFIER) :]: params[n] for n in self.global_head}
        return {**params, **own, CONTEXT: self.context(own)}

    def adapted_names(self, step: int) -> list[str] | None:
        return self.model_names  # v_i held fixed
