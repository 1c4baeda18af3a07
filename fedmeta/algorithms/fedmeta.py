"""FedMeta (Chen, Luo, Dong, Li & He, arXiv:1802.07876, 2018: "Federated Meta-Learning with Fast
Convergence and Efficient Communication"): the server holds a meta-learner — MAML's initialization
θ, or Meta-SGD's (θ, α) with α one learned step size per weight — and each sampled client returns
the gradient of its query loss after adapting on its support set (the paper's Algorithm 1).

As implemented, a sampled client u
  1. draws its support batches from its personalization split (``pers``, 80 %) and its query batch
     from its held-out split (``held_out``, 20 %), as CAFeMe draws its inner and outer batches;
  2. adapts: ``inner_steps`` SGD steps θ_u ← θ_u − α·∇L_S(θ_u) (MAML, α = ``inner_lr``) or
     θ_u ← θ_u − α ⊙ ∇L_S(θ_u) (Meta-SGD, ``meta_sgd=true``: α the learned rates);
  3. computes g_u = ∇_θ L_Q(θ_u) (Meta-SGD: ∇_(θ,α)), second order through the adaptation
     (``first_order=true``: the inner gradients are constants — first-order MAML; Meta-SGD's α
     still gets its gradient −∇L_S ⊙ ∇L_Q);
  4. with ``outer_optimizer=sgd`` sends θ − β·g_u (and α − β·g_u^α): the server's weighted mean of
     what is sent is θ − β·mean(g_u), Algorithm 1's server step. With ``outer_optimizer=adam`` (the
     default) it sends g_u itself, under the names ``meta_grad.<name>`` (as SCAFFOLD sends Δc), and
     the server takes one step of an Adam it keeps across rounds on their weighted mean (its
     moments are server state, in the checkpoint; clients keep nothing). Reading mean(g_u) back
     from a mean of θ − β·g_u would lose it to float32: Meta-SGD's rates' gradients (median
     ~3e-6) are the size of that subtraction's rounding error.

Meta-SGD's α lives in the model (``LearnedRates``: ``base.*`` the network, ``rates.*`` α with the
same names and shapes, initialized to ``inner_lr``): it is averaged with θ, checkpointed, sent to
Flower nodes with the model, and used by new clients.

Where fedmeta's protocol forces a choice the paper does not make:
- support and query sets: the client's fixed 80 / 20 % split (``federation.held_out_fraction``)
  rather than the paper's support fraction p; each step reads a mini-batch of ``batch_size`` from
  the support split and the query loss one batch of ``eval_batch_size`` from the query split (the
  paper's Algorithm 1 writes the losses over the whole sets; fedmeta reads the protocol's
  mini-batches, as CAFeMe does);
- the server optimizer: Algorithm 1 writes an SGD step; the paper's experiments use Adam ("as the
  local optimizer for all approaches"), which for FedMeta — whose clients take no step of their
  own on θ — is the server's step on the mean meta-gradient, as both public reimplementations
  apply it; ``sgd`` is Algorithm 1 as printed;
- averaging: Algorithm 1's uniform 1/m (``averaging=uniform``); ``samples`` weighs by client size.

New clients (the paper's test: the meta-learner adapts on a new client's support set, then is
scored on its query set): ``personal_params`` takes ``test_inner_steps`` of the method's own
adaptation steps — at α (MAML) or at the learned α ⊙ (Meta-SGD) — on batches of ``batch_size``
from the new client's personalization split; the shared procedure of fedmeta.evaluation then
starts from there (its step-0 accuracy is the adapted model's) and takes its
``personalization.steps`` plain SGD steps on θ (never on α), as for every method.
``personalization.steps=0`` scores the paper's procedure alone.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedmeta.algorithms.base import Algorithm, ClientData, LocalResult, masked
from fedmeta.data.federation import PERSONALIZE_PURPOSE, Batch, Client
from fedmeta.functional import Params, adam, adam_state, grad_and_value, sgd

BASE, RATES = "base.", "rates."
META_GRAD = "meta_grad."  # the prefix of the names under which a client sends g_u to the server's Adam
TEST_SUPPORT_STREAM = 1  # the ``round`` of a new client's support generator (the shared procedure uses 0)


class LearnedRates(nn.Module):
    """Meta-SGD's meta-learner: the network ``base`` and ``rates`` — α, one learned step size per
    weight, under the weight's own name (``rates.head.weight`` steps ``base.head.weight``)."""

    def __init__(self, base: nn.Module, initial_rate: float):
        super().__init__()
        self.base = base
        self.rates = copy.deepcopy(base)  # a holder of α with the network's names and shapes
        with torch.no_grad():
            for rate in self.rates.parameters():
                rate.fill_(initial_rate)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.base(x, **masked(mask))


class FedMeta(Algorithm):
    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> nn.Module:
        """MAML: the base CNN (θ). Meta-SGD: the base CNN and its learned rates α (``LearnedRates``)."""
        base = super().build_model(cfg, num_classes)
        return LearnedRates(base, cfg.method.inner_lr) if cfg.method.meta_sgd else base

    @classmethod
    def channels_last(cls, cfg) -> bool:
        return cfg.method.first_order  # batch norm's double backward is slower in NHWC (as CAFeMe)

    def __init__(self, model: nn.Module, cfg, precision=None):
        super().__init__(model, cfg, precision)
        names = [name for name, _ in model.named_parameters()]
        self.weight_names = [n for n in names if not n.startswith(RATES)]  # θ: what the inner steps move
        self.server_adam: dict | None = None  # outer_optimizer=adam: the server's moments and step

    # ---- the client's adaptation (Algorithm 1, lines "θ_u ← θ − α∇L_S(θ)") ---------------------
    def step_sizes(self, params: Params) -> dict:
        """Each weight's inner step size: α (MAML), or its learned rate in ``params`` (Meta-SGD)."""
        if self.cfg.meta_sgd:
            return {n: params[RATES + n[len(BASE) :]] for n in self.weight_names}
        return dict.fromkeys(self.weight_names, self.cfg.inner_lr)

    def adapt(self, params: Params, batches: list[Batch], second_order: bool) -> Params:
        """θ adapted by one SGD step per support batch (differentiable in θ and α with ``second_order``;
        α is always differentiable: it multiplies the step)."""
        rates = self.step_sizes(params)
        weights = {n: params[n] for n in self.weight_names}
        for batch in batches:
            grads, _ = grad_and_value(self.loss, second_order=second_order)(weights, batch)
            weights = {n: weights[n] - rates[n] * grads[n] for n in weights}
        return weights

    def meta_loss(self, params: Params, data: ClientData) -> torch.Tensor:
        """L_Q(θ_u): the query loss after the adaptation on the support batches."""
        adapted = self.adapt(params, data["support"], second_order=not self.cfg.first_order)
        return self.loss(adapted, data["query"])

    # ---- federated training ------------------------------------------------------------------
    def draw(self, client: Client, round_: int) -> ClientData:
        cfg, generator = self.cfg, client.generator(round_)
        return {
            "support": [client.batch("pers", cfg.batch_size, generator) for _ in range(cfg.inner_steps)],
            "query": client.batch("held_out", cfg.eval_batch_size, generator),
        }

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        grads, query_loss = grad_and_value(self.meta_loss)(params, data)  # g_u, for θ (and α)
        if self.cfg.outer_optimizer == "sgd":
            sent, _ = sgd(params, grads, self.cfg.outer_lr)  # θ − β·g_u: their mean is the server's SGD step
            return LocalResult(sent, query_loss, {}, {})
        return LocalResult({META_GRAD + n: g for n, g in grads.items()}, query_loss, {}, {})

    def aggregate(self, updates) -> None:
        """The mean of θ − β·g_u (``sgd``: Algorithm 1's step), or one step of the server's Adam on
        the weighted mean of the g_u the clients sent (``adam``)."""
        if self.cfg.outer_optimizer == "sgd":
            super().aggregate(updates)
            return
        super().aggregate(updates)  # the clients' kept state, if any: no parameter was sent
        with torch.no_grad():
            params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            weights = torch.tensor([u.weight for u in updates], dtype=torch.float64)
            weights = weights / weights.sum()
            mean_grad = {
                n: sum(
                    w * u.params[META_GRAD + n].to(torch.float64) for w, u in zip(weights.tolist(), updates)
                ).to(p)
                for n, p in params.items()
            }
            new, self.server_adam = adam(
                params, mean_grad, self.server_adam or adam_state(params), self.cfg.outer_lr
            )
            for n, p in self.model.named_parameters():
                p.copy_(new[n])

    def federation_state(self) -> dict:
        return {**super().federation_state(), "server_adam": self.server_adam}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        kept = state.get("server_adam")
        device = next(self.model.parameters()).device
        self.server_adam = None if kept is None else _to_device(kept, device)

    # ---- new clients: the meta-learner's own adaptation, then the shared procedure -------------
    def personalization_data(self, client: Client) -> ClientData:
        generator = client.generator(TEST_SUPPORT_STREAM, PERSONALIZE_PURPOSE)
        steps = range(self.cfg.test_inner_steps)
        return {"support": [client.batch("pers", self.cfg.batch_size, generator) for _ in steps]}

    def personal_params(self, params: Params, data: ClientData) -> Params:
        """The new client's θ after ``test_inner_steps`` adaptation steps (Meta-SGD: at its learned
        rates); Meta-SGD's rates come along unchanged (the shared procedure never trains them)."""
        adapted = self.adapt(params, data["support"], second_order=False)
        return {**params, **{n: w.detach() for n, w in adapted.items()}}

    def adapted_names(self, step: int) -> list[str] | None:
        return self.weight_names  # θ; Meta-SGD's α is no weight of the network


def _to_device(tree, device):
    if isinstance(tree, dict):
        return {key: _to_device(value, device) for key, value in tree.items()}
    return tree.to(device) if isinstance(tree, torch.Tensor) else tree
