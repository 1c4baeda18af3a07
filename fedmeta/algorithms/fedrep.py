"""FedRep (Collins et al. 2021): a shared representation (the body) is averaged by the server;
each client's head stays local. Every round a client first trains its head with the body frozen,
then the body with the head frozen, and sends the body only.

Heads are the one piece of per-client state here (``method.head``: the last linear layer, 5,130
numbers on RMNIST, or the authors' whole fully connected block); a client that has not taken
part yet starts from the global head, which the server never changes — so it stays at its
initialization. A new client at test time starts from that head too, and — FedRep's own
procedure for new clients — trains the head alone on the frozen body for its first
``test_head_steps`` personalization steps, then all layers for the rest of the shared budget
(``test_head_steps=0``: all layers from the first step).

The CAFeMe authors' FedRep (``variant=authors``) reads its batches from the client's persistent
iterator — ``head_batches`` (5) for the head, then ``body_batches`` (1) for the body — with two
per-client Adams kept across rounds (``local_optimizer=adam_kept``), and sends the head too, which
the server averages (``share_head``); a new client then starts from that averaged head.
"""

from __future__ import annotations

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, LocalResult
from fedmeta.data.federation import Client
from fedmeta.functional import Params
from fedmeta.models import CLASSIFIER, DENSE

# method.head: the last Linear (FedRep's paper), or the whole fully connected block — the dense layers
# and the classifier, as the CAFeMe authors' code moves the model's ``fc`` into FedRep's head
HEADS = {"classifier": (CLASSIFIER,), "fc_block": (DENSE, CLASSIFIER)}


class FedRep(Algorithm):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.head_names, self.body_names = self.split_names(HEADS[cfg.head])

    def streamed(self) -> int:
        return self.cfg.head_batches + self.cfg.body_batches

    def draw(self, client: Client, round_: int) -> ClientData:
        cfg = self.cfg
        reshuffle = cfg.shuffle == "every_epoch"
        if self.streamed():  # consecutive batches of the client's persistent iterator
            batches = client.stream(
                cfg.train_split,
                cfg.batch_size,
                self.batches_read(client.id),
                self.streamed(),
                reshuffle=reshuffle,
            )
            return {"head": batches[: cfg.head_batches], "body": batches[cfg.head_batches :]}
        generator = client.generator(round_)
        head = client.epochs(cfg.train_split, cfg.batch_size, generator, cfg.head_epochs, reshuffle=reshuffle)
        return {
            "head": head,
            "body": client.epochs(
                cfg.train_split, cfg.batch_size, generator, cfg.body_epochs, reshuffle=reshuffle
            ),
        }

    def client_state(self, client_id: int, params: Params) -> dict:
        # its own head (a fresh dict: the Adams are added to it)
        state = {} if self.cfg.share_head else self.kept_params(client_id, params, self.head_names)
        if self.cfg.local_optimizer == "adam_kept":
            for key, names in (("head_adam", self.head_names), ("body_adam", self.body_names)):
                state[key] = self.kept_adam(client_id, key, {n: params[n] for n in names})
        return state

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **{n: state[n] for n in self.head_names if n in state}}  # its own head

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        params = self.kept_model(params, state)
        lr, kept = self.cfg.local_lr, {}
        if "head_adam" in state:
            params, _, kept["head_adam"] = self.local_adam(
                params, data["head"], lr, state["head_adam"], self.head_names
            )
            params, loss, kept["body_adam"] = self.local_adam(
                params, data["body"], lr, state["body_adam"], self.body_names
            )
        else:
            params, _ = self.local_sgd(params, data["head"], lr, self.cfg.momentum, trainable=self.head_names)
            params, loss = self.local_sgd(
                params, data["body"], lr, self.cfg.momentum, trainable=self.body_names
            )
        sent = self.body_names + (self.head_names if self.cfg.share_head else [])
        if not self.cfg.share_head:
            kept.update({n: params[n] for n in self.head_names})
        return LocalResult({n: params[n] for n in sent}, loss, kept, {})

    def adapted_names(self, step: int) -> list[str] | None:
        return self.head_names if step < self.cfg.test_head_steps else None

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        kept = self.keep(result.state, [n for n in self.head_names if n in result.state])  # the head stays
        kept.update(
            {
                key: self.compact_adam(result.state[key])
                for key in ("head_adam", "body_adam")
                if key in result.state
            }
        )
        if self.streamed():
            kept |= self.read_more(client.id, self.streamed())
        update.state = kept or None
        return update
