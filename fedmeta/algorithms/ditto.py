"""Ditto (Li, Hu, Beirami & Smith, ICML 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization"), Algorithm 1.

Two models: the global model w, trained by the federation as in FedAvg, and for each client k a
personal model v_k that stays with it. A sampled client, in its round:

1. trains a copy of the round's global model w^t by FedAvg's local update (its local epochs of SGD)
   and sends the result, which the server averages as FedAvg does;
2. takes ``personal_epochs`` epochs of SGD steps on its own v_k, each on
   f_k(v) + λ/2‖v − w^t‖² — v_k ← v_k − η(∇f_k(v_k) + λ(v_k − w^t)) — pulled toward the global
   model it received that round (not toward its own updated copy), at the method's local step
   size η (``local_lr``) and momentum.

v_k never reaches the server: w is exactly what FedAvg's rounds give. With ``personal_epochs``
equal to ``local_epochs`` (the default) v's steps read the very batches w's steps read, one v step
per w step, as the authors' code does; otherwise v takes its own shuffled epochs. The loss a
client reports is w's, as FedAvg's.

Choices fedmeta's protocol makes where the paper leaves them open:

- A client's v_k starts, the first time it takes part, from the global model it receives then; the
  authors' code creates every client's v at the start, as a copy of the initial model. v_k is
  kept in ``client_states`` for the clients that have taken part (one number per parameter).
- Under the training-clients protocol a client is scored with its v_k as it is
  (``kept_model``); a client that never took part, with the global model.
- New clients have no v: they train one from w in the shared test-time procedure, each step on
  their loss plus λ/2‖v − w‖² (``adaptation_loss``).

``personal_epochs=0`` keeps no personal model: FedAvg's training, and the proximal fine-tuning
for new and training clients alike. The CAFeMe authors' Ditto (``variant=authors``) is that: it
trains w with a per-client Adam on 5 batches a round, after its personal-model update has read 5
batches of the same persistent iterator (``personal_batches``: read and passed over here — that
personal model is anchored on the client's previous local model and never reaches w or a new
client), and fine-tunes new clients without the proximal term (``lam=0``).
"""

from __future__ import annotations

import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Batch, Client
from fedmeta.functional import Params, proximal

PERSONAL_PURPOSE = 16  # the generator of v's own epochs (federation.py's purposes are 0–5)


class Ditto(FedAvg):
    def batches_skipped(self) -> int:
        return self.cfg.personal_batches

    @property
    def keeps_client_models(self) -> bool:
        return bool(self.cfg.personal_epochs)

    def draw(self, client: Client, round_: int) -> ClientData:
        data, cfg = super().draw(client, round_), self.cfg
        if cfg.personal_epochs and (cfg.local_batches or cfg.personal_epochs != cfg.local_epochs):
            generator = client.generator(round_, PERSONAL_PURPOSE)
            reshuffle = cfg.shuffle == "every_epoch"
            data["personal"] = client.epochs(
                cfg.train_split, cfg.batch_size, generator, cfg.personal_epochs, cfg.drop_last, reshuffle
            )
        return data

    def client_state(self, client_id: int, params: Params) -> dict:
        fedavg = super().client_state(client_id, params)  # FedAvg's own (its kept Adam), if any
        if not self.cfg.personal_epochs:
            return fedavg
        v = self.client_states.get(client_id, {}).get("v")
        return {"fedavg": fedavg, "v": dict(params) if v is None else v}  # first time: the w received

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["v"]}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        if not self.cfg.personal_epochs:
            return super().local_update(params, state, data)
        result = super().local_update(params, state["fedavg"], data)
        anchor, lam = params, self.cfg.lam  # w^t: the round's global model, held fixed

        def objective(v: Params, batch: Batch) -> torch.Tensor:
            return self.loss(v, batch) + 0.5 * lam * proximal(v, anchor)

        batches = data.get("personal", data["epochs"])
        v, _ = self.local_sgd(state["v"], batches, self.cfg.local_lr, self.cfg.momentum, objective=objective)
        return result._replace(state={"fedavg": result.state, "v": v})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        if not self.cfg.personal_epochs:
            return super().to_update(client, result)
        update = super().to_update(client, result._replace(state=result.state["fedavg"]))
        update.state = {**(update.state or {}), "v": self.keep(result.state["v"], list(result.state["v"]))}
        return update

    def adaptation_loss(self, params: Params, batch: Batch, start: Params) -> torch.Tensor:
        # start = w: the global model a new client's personalization starts from
        return super().adaptation_loss(params, batch, start) + 0.5 * self.cfg.lam * proximal(params, start)
