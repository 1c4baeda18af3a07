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

from fedmeta.algorithms.base import Algorithm, Batch, ClientUpdate, Context, Params, trainable_copy
from fedmeta.data.federation import Client
from fedmeta.functional import sgd_step
from fedmeta.models import ModulatedNet


class CAFeMe(Algorithm):
    model: ModulatedNet

    def __init__(self, model: ModulatedNet, cfg):
        super().__init__(model, cfg)
        self.transductive = cfg.context == "transductive"

    def forward(self, params: Params, x: torch.Tensor, context: Context = None) -> torch.Tensor:
        context_x, context_y = context
        return self.run_model(self.model, params, x, context_x, context_y)

    def adaptation_context(self, batch: Batch) -> Context:
        x, y = batch
        return (x, None) if self.transductive else (x, y)

    def prediction_context(self, x: torch.Tensor, last_batch: Batch) -> Context:
        # Paper: ζ = g_μ'(D') from the last personalization batch. Authors' code: from x itself.
        return (x, None) if self.transductive else self.adaptation_context(last_batch)

    def personalize(self, params: Params, client: Client, generator: torch.Generator) -> tuple[Params, Batch]:
        """Algorithm 2, differentiable: returns ψ', μ' and the last batch D' (which gives ζ)."""
        for _ in range(self.cfg.inner_steps):
            batch = client.batch("pers", self.cfg.batch_size, generator)
            loss = self.loss(params, batch, self.adaptation_context(batch))
            params = sgd_step(params, loss, self.cfg.inner_lr, create_graph=not self.cfg.first_order)
        return params, batch

    def meta_loss(self, omega: Params, client: Client, generator: torch.Generator) -> torch.Tensor:
        """L_{D_eval}(f_ψ'|ζ) after Personalization(S, α, D_pers, ω): the outer objective of line 8."""
        adapted, last_batch = self.personalize(omega, client, generator)
        x, y = client.batch("held_out", self.cfg.eval_batch_size, generator)
        return self.loss(adapted, (x, y), self.prediction_context(x, last_batch))

    def local_update(self, client: Client, round_: int) -> ClientUpdate:
        generator = client.generator(round_)
        omega = trainable_copy(self.global_params())
        optimizer = torch.optim.Adam(omega.values(), lr=self.cfg.outer_lr)
        if self.cfg.client_optimizer_state and client.id in self.client_states:
            # load_state_dict casts the moments back to the parameters' dtype
            optimizer.load_state_dict({"state": self.client_states[client.id],
                                       "param_groups": optimizer.state_dict()["param_groups"]})

        outer_loss = self.meta_loss(omega, client, generator)
        outer_loss.backward()
        optimizer.step()

        kept = None
        if self.cfg.client_optimizer_state:  # the client's Adam moments, for its next round
            dtype = getattr(torch, self.cfg.client_state_dtype)
            kept = {index: {key: value if key == "step" else value.to(dtype) for key, value in moments.items()}
                    for index, moments in optimizer.state_dict()["state"].items()}
        return ClientUpdate(client.id, {k: p.detach() for k, p in omega.items()}, 1.0, outer_loss.item(), state=kept)
