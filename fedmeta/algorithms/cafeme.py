"""CAFeMe (paper Algorithms 1–2): a federated modulator g_μ gates a MAML-personalized base f_ψ.

Each sampled client runs Personalization(S, α, D_pers, ω) — S differentiable SGD steps on μ and ψ,
each on a fresh batch D' with ζ = g_μ'(D') — then takes one outer step of the optimizer (Adam, β)
on ω through that inner loop, with the loss of f_ψ'|ζ on a held-out batch. The server averages
the clients' ω_i' (uniform weights, as in the paper's Algorithm 1).

Options (the authors' code, ``variant=authors`` turns on all of them):
- ``context=transductive``: ζ comes from the batch being classified (x only), also at test time;
- ``first_order=true``: the inner gradients are not differentiated (first-order MAML);
- ``client_optimizer_state=true``: each client keeps its Adam state across rounds — only the two
  moments and the step (2 × |ω| numbers a client seen), as ``client_state_dtype`` (float32 is exact;
  bfloat16 halves the memory).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, Context, LocalResult
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, adam, adam_state, grad_and_value
from fedmeta.models import ModulatedNet


class CAFeMe(Algorithm):
    model: ModulatedNet

    def __init__(self, model: ModulatedNet, cfg):
        super().__init__(model, cfg)
        self.transductive = cfg.context == "transductive"

    def forward(self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.run_model(self.model, params, x, context.x, context.y, mask, context.mask)

    def adaptation_context(self, batch: Batch) -> Context:
        return Batch(batch.x, None, batch.mask) if self.transductive else Batch(batch.x, batch.y, batch.mask)

    def prediction_context(self, batch: Batch, last_batch: Batch) -> Context:
        # Paper: ζ = g_μ'(D') from the last personalization batch. Authors' code: from x itself.
        return Batch(batch.x, None, batch.mask) if self.transductive else self.adaptation_context(last_batch)

    def draw(self, client: Client, round_: int) -> ClientData:
        generator = client.generator(round_)
        inner = [client.batch("pers", self.cfg.batch_size, generator) for _ in range(self.cfg.inner_steps)]
        return {"inner": inner, "outer": client.batch("held_out", self.cfg.eval_batch_size, generator)}

    def personalize(self, params: Params, batches: list[Batch]) -> tuple[Params, Batch]:
        """Algorithm 2, differentiable: returns ψ', μ' and the last batch D' (which gives ζ)."""
        for batch in batches:
            # first-order MAML: the inner gradient is a constant
            grads, _ = grad_and_value(lambda p, b=batch: self.loss(p, b, self.adaptation_context(b)),
                                      second_order=not self.cfg.first_order)(params)
            params = {k: params[k] - self.cfg.inner_lr * grads[k] for k in params}
        return params, batch

    def meta_loss(self, omega: Params, data: ClientData) -> torch.Tensor:
        """L_{D_eval}(f_ψ'|ζ) after Personalization(S, α, D_pers, ω): the outer objective of line 8."""
        adapted, last_batch = self.personalize(omega, data["inner"])
        outer = data["outer"]
        return self.loss(adapted, outer, self.prediction_context(outer, last_batch))

    def client_state(self, client_id: int, params: Params) -> dict:
        if not self.cfg.client_optimizer_state:
            return {}
        kept = self.client_states.get(client_id)
        if kept is None:
            return adam_state(params)
        dtype = next(iter(params.values())).dtype  # moments kept in bfloat16 are used in the parameters' dtype
        return {"step": kept["step"], **{key: {k: v.to(dtype) for k, v in kept[key].items()} for key in ("exp_avg", "exp_avg_sq")}}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        grads, outer_loss = grad_and_value(self.meta_loss)(params, data)
        # A fresh Adam per client per round unless the client keeps its own (client_optimizer_state)
        new, adam_after = adam(params, grads, state or adam_state(params), self.cfg.outer_lr)
        return LocalResult(new, outer_loss, adam_after if self.cfg.client_optimizer_state else {}, {})

    def update_weight(self, client: Client) -> float:
        return 1.0  # uniform, as the paper's Algorithm 1

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        if update.state is not None:  # the client's Adam moments, compactly, for its next round
            dtype = getattr(torch, self.cfg.client_state_dtype)
            # copies: a vmapped round's results are views into tensors of all its clients
            update.state = {"step": result.state["step"].detach().clone(),
                            **{key: {k: v.detach().to(dtype, copy=True) for k, v in result.state[key].items()}
                               for key in ("exp_avg", "exp_avg_sq")}}
        return update
