"""APFL (Deng, Kamani & Mahdavi, 2020, "Adaptive Personalized Federated Learning"), Algorithm 1
with the adaptive mixing weight.

Each client keeps a personal model v_i and a mixing weight α_i; its personalized model is the mix
v̄_i = α_i v_i + (1 − α_i) w_i of v_i and its local copy w_i of the global model. A sampled client
starts w_i at the round's global model and, on each batch ξ of its local epochs, takes one step of
each, all from the values before the step:

    w_i ← w_i − η ∇f_i(w_i; ξ)
    v_i ← v_i − η ∇_v f_i(v̄_i; ξ)                    (= η α_i ∇f_i(v̄_i; ξ))
    α_i ← Π_[0,1](α_i − η ∇_α f_i(v̄_i; ξ))           (∇_α = ⟨v_i − w_i, ∇f_i(v̄_i; ξ)⟩)

(``adaptive_alpha=false`` keeps α_i fixed). It sends w_i; the server averages the w_i (sample-
weighted, as every method here; ``averaging=uniform`` is the paper's 1/|U_t|). v_i and α_i stay
with the client: kept in ``client_states`` for the clients that have taken part.

``mixing=parameters`` (default) mixes in parameter space, v̄ = α v + (1 − α) w, as the paper's
algorithm and analysis write it; ``mixing=outputs`` mixes the two networks' logits,
α·v(x) + (1 − α)·w(x), as the authors' code (FedTorch) and FL-bench do, and the α and v gradients
are then those of the loss of the mixed logits.

Choices fedmeta's protocol forces where the paper leaves them open:

- A client's v_i starts, the first time it takes part, from the global model it receives then
  (with α_i = ``alpha``); the reference codes create every client's v at the start, as a copy of
  the initial model.
- The reported training loss is the mean loss of the mixed model v̄_i over the local steps.

New clients run APFL's own local procedure through the shared test-time procedure: they start
with w_i = v_i = the global model and α_i = ``alpha`` (so the step-0 model is the global model)
and each personalization step is the local step above on that step's batch, at the shared step
size — w_i on its own loss, (v_i, α_i) on the loss of the mix with w_i held fixed
(``adaptation_loss``) — and the model scored is the mix v̄_i. ``test_local_w=false`` holds w_i
at the global model instead and trains only v_i and α_i. The shared procedure's plain SGD step
cannot project α onto [0, 1]; the mix uses α clamped to [0, 1] (from 50 steps that start at
v = w, α moves by far less than its distance to either bound).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import (
    Algorithm,
    ClientData,
    ClientUpdate,
    Context,
    LocalResult,
    masked,
    step_weight,
    unless_idle,
)
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, grad_and_value

PERSONAL = "apfl_v."  # v's parameters in a personalization dict: this prefix + the global name
ALPHA = "apfl_alpha"


class APFL(Algorithm):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.names = [name for name, _ in model.named_parameters()]

    def draw(self, client: Client, round_: int) -> ClientData:
        cfg = self.cfg
        return {
            "epochs": client.epochs(
                "all",
                cfg.batch_size,
                client.generator(round_),
                cfg.local_epochs,
            )
        }

    # ---- the mixed model ------------------------------------------------------------------------
    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The global network; for a dict holding v and α too (personalization), the mix v̄."""
        if ALPHA not in params:
            return super().forward(params, x, context, mask)
        alpha = params[ALPHA].clamp(0.0, 1.0)
        w = {n: params[n] for n in self.names}
        v = {n: params[PERSONAL + n] for n in self.names}
        if self.cfg.mixing == "outputs":
            return alpha * self.run_model(self.model, v, x, **masked(mask)) + (1 - alpha) * self.run_model(
                self.model, w, x, **masked(mask)
            )
        mixed = {n: alpha * v[n] + (1 - alpha) * w[n] for n in self.names}
        return self.run_model(self.model, mixed, x, **masked(mask))

    def mixed_loss(self, personal: Params, w: Params, batch: Batch) -> torch.Tensor:
        """The loss of v̄ as a function of ``personal`` (v and α); w enters as a constant."""
        return self.loss({**{n: w[n].detach() for n in self.names}, **personal}, batch)

    @staticmethod
    def personal(v: Params, alpha: torch.Tensor) -> Params:
        return {**{PERSONAL + n: p for n, p in v.items()}, ALPHA: alpha}

    # ---- federated training ---------------------------------------------------------------------
    def initial_alpha(self, like: torch.Tensor) -> torch.Tensor:
        return torch.full((), self.cfg.alpha, dtype=like.dtype, device=like.device)

    def client_state(self, client_id: int, params: Params) -> dict:
        kept = self.client_states.get(client_id)
        if kept is None:  # first round it takes part: v from the global model it receives
            return {"v": dict(params), "alpha": self.initial_alpha(next(iter(params.values())))}
        return {"v": kept["v"], "alpha": kept["alpha"]}

    def kept_model(self, params: Params, state: dict) -> Params:
        """w and the client's v mixed by its α: the model APFL's client predicts with."""
        return {**params, **self.personal(state["v"], state["alpha"])}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        cfg = self.cfg
        w, personal = params, self.personal(state["v"], state["alpha"])
        total, steps = 0.0, 0.0
        for batch in data["epochs"]:
            grads_w, _ = grad_and_value(self.loss)(w, batch)
            grads, loss = grad_and_value(self.mixed_loss)(personal, w, batch)
            stepped = {n: personal[n] - cfg.local_lr * grads[n] for n in personal if n != ALPHA}
            alpha = personal[ALPHA]
            if cfg.adaptive_alpha:
                alpha = (alpha - cfg.local_lr * grads[ALPHA]).clamp(0.0, 1.0)
            personal = unless_idle(batch, {**stepped, ALPHA: alpha}, personal)
            w = unless_idle(batch, {n: w[n] - cfg.local_lr * grads_w[n] for n in w}, w)
            total, steps = total + step_weight(batch) * loss, steps + step_weight(batch)
        state = {"v": {n: personal[PERSONAL + n] for n in self.names}, "alpha": personal[ALPHA]}
        return LocalResult(w, total / steps, state, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        update.state = {  # copies: a vmapped round's results are views into tensors of all its clients
            "v": {n: p.detach().clone() for n, p in result.state["v"].items()},
            "alpha": result.state["alpha"].detach().clone(),
        }
        return update

    # ---- new clients: APFL's local steps in the shared procedure -------------------------------
    def personal_params(self, params: Params, data: ClientData) -> Params:
        """w, and v = w with α = ``alpha``: the mix starts at the global model."""
        return {**params, **self.personal(params, self.initial_alpha(next(iter(params.values()))))}

    def adapted_names(self, step: int) -> list[str] | None:
        return None if self.cfg.test_local_w else [PERSONAL + n for n in self.names] + [ALPHA]

    def adaptation_loss(self, params: Params, batch: Batch, start: Params) -> torch.Tensor:
        """f(v̄) with w held fixed in the mix (its gradient reaches v and α only), plus f(w) where
        w is trained too: one SGD step on it is APFL's local step."""
        personal = {n: p for n, p in params.items() if n.startswith(PERSONAL) or n == ALPHA}
        w = {n: params[n] for n in self.names}
        mixed = self.mixed_loss(personal, w, batch)
        return mixed + self.loss(w, batch) if self.cfg.test_local_w else mixed
