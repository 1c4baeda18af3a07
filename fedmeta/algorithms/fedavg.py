"""FedAvg (McMahan et al. 2017): local SGD epochs on each client, sample-weighted averaging.

FedAvg-FT is the same training; it differs only at test time, where new clients fine-tune the
global model with the shared personalization procedure (its config sets the steps).

Options for the CAFeMe authors' code, which trained its baselines differently (``variant=authors``):
``train_split=pers`` (the client's 80 % only), ``drop_last``, ``averaging=uniform``, and — their
Ditto — ``local_optimizer=adam_kept`` (a per-client Adam kept across rounds) with
``local_batches=n`` (n batches read from the client's persistent iterator instead of epochs);
``shuffle=once``: every epoch (and the iterator) reads the client's data in one order, fixed at
the start (FedLab's SubsetSampler, which all their loaders use).
"""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, LocalResult
from fedmeta.data.federation import Client
from fedmeta.functional import Params


class FedAvg(Algorithm):
    def draw(self, client: Client, round_: int) -> ClientData:
        cfg = self.cfg
        reshuffle = cfg.shuffle == "every_epoch"
        if cfg.local_batches:
            start = self.batches_read(client.id) + self.batches_skipped()
            return {
                "epochs": client.stream(
                    cfg.train_split, cfg.batch_size, start, cfg.local_batches, reshuffle=reshuffle
                )
            }
        return {
            "epochs": client.epochs(
                cfg.train_split,
                cfg.batch_size,
                client.generator(round_),
                cfg.local_epochs,
                cfg.drop_last,
                reshuffle,
            )
        }

    def batches_skipped(self) -> int:
        """Batches of the persistent iterator read each round before the local update's (none here)."""
        return 0

    def client_state(self, client_id: int, params: Params) -> dict:
        return self.kept_adam(client_id, "adam", params) if self.cfg.local_optimizer == "adam_kept" else {}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        if state:
            params, loss, state = self.local_adam(params, data["epochs"], self.cfg.local_lr, state)
            return LocalResult(params, loss, state, {})
        params, loss = self.local_sgd(params, data["epochs"], self.cfg.local_lr, self.cfg.momentum)
        return LocalResult(params, loss, {}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        kept = {"adam": self.compact_adam(result.state)} if result.state else {}
        if self.cfg.local_batches:
            kept |= self.read_more(client.id, self.batches_skipped() + self.cfg.local_batches)
        update.state = kept or None
        return update
