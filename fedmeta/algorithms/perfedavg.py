"""Per-FedAvg (Fallah et al. 2020), Hessian-free variant: MAML-style FedAvg.

Each local step draws three independent batches D, D', D'' and moves w by
    w ← w − β (I − α ∇²f(w; D'')) ∇f(w − α∇f(w; D); D'),
with the Hessian-vector product taken by finite differences,
    ∇²f(w) v ≈ [∇f(w + δv) − ∇f(w − δv)] / 2δ   (δ = 1e-3),
the paper's Hessian-free approximation (``hessian=finite_difference``, the default), or exactly
(``hessian=exact``: forward-mode differentiation of the gradient, ``torch.func.jvp`` of
``torch.func.grad`` — one forward-over-reverse pass, vmappable like the rest).
``first_order=true`` drops the Hessian term (Per-FedAvg FO). The server averages as FedAvg.

As the CAFeMe authors' code ran it (``variant=authors``): ``batches=stream`` — each local step
reads D, D', D'' and then a batch it reports the loss on, consecutively from the client's
persistent iterator over its 80 % (``train_split=pers``) — and uniform averaging.
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, LocalResult
from fedmeta.data.federation import STREAMS, Batch, Client
from fedmeta.functional import Params, grad_and_value, sgd


class PerFedAvg(Algorithm):
    def gradient(self, params: Params, batch: Batch) -> Params:
        return grad_and_value(self.loss)(params, batch)[0]

    def hessian_vector_product(self, w: Params, v: Params, batch: Batch) -> Params:
        if self.cfg.hessian == "exact":
            return torch.func.jvp(lambda p: torch.func.grad(self.loss)(p, batch), (w,), (v,))[1]
        delta = self.cfg.delta
        plus = self.gradient({k: w[k] + delta * v[k] for k in w}, batch)
        minus = self.gradient({k: w[k] - delta * v[k] for k in w}, batch)
        return {k: (plus[k] - minus[k]) / (2 * delta) for k in w}

    def meta_gradient(self, w: Params, batches: list[Batch]) -> Params:
        inner, outer, hessian = batches
        step = self.gradient(w, inner)
        g = self.gradient(sgd(w, step, self.cfg.inner_lr)[0], outer)
        if self.cfg.first_order:
            return g
        hv = self.hessian_vector_product(w, g, hessian)
        return sgd(g, hv, self.cfg.inner_lr)[0]  # g − α·Hg

    def draw(self, client: Client, round_: int) -> ClientData:
        cfg = self.cfg
        if cfg.batches in STREAMS:
            read = client.stream(
                cfg.train_split,
                cfg.batch_size,
                self.batches_read(client.id),
                4 * cfg.local_steps,
                reshuffle=cfg.batches == "stream",
            )
            steps = [batch for i in range(cfg.local_steps) for batch in read[4 * i : 4 * i + 3]]
            return {"steps": steps, "loss": read[-1]}
        generator = client.generator(round_)
        steps = client.batches(cfg.train_split, cfg.batch_size, generator, 3 * cfg.local_steps)
        return {"steps": steps, "loss": client.batch(cfg.train_split, cfg.batch_size, generator)}

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        if self.cfg.batches in STREAMS:
            update.state = self.read_more(client.id, 4 * self.cfg.local_steps)
        return update

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        w, batches = params, list(data["steps"])
        for i in range(0, len(batches), 3):  # a step's three batches: inner, outer, Hessian's
            g = self.meta_gradient(w, batches[i : i + 3])
            w, _ = sgd(w, g, self.cfg.outer_lr)
        with torch.no_grad():
            loss = self.loss(w, data["loss"])
        return LocalResult(w, loss, {}, {})
