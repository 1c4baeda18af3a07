"""CAFeMe (paper Algorithms 1–2): a federated modulator g_μ gates a MAML-personalized base f_ψ.

Each sampled client runs Personalization(S, α, D_pers, ω) — S differentiable SGD steps on μ and ψ,
each on a fresh batch D' with ζ = g_μ'(D') — then takes one outer step on ω through that inner
loop, with the loss of f_ψ'|ζ on a batch of its held-out part D_eval. The server averages the
clients' ω_i' (uniform weights, as in the paper's Algorithm 1).

Options (``variant=authors`` sets each to what the authors' code does):
- ``outer_optimizer``: ``adam_fresh`` (a new Adam per client per round: its one step moves every
  weight by ≈ β·sign(g), i.e. sign-SGD), ``adam_kept`` (each client keeps its Adam across rounds —
  only the two moments and the step, 2 × |ω| numbers per client seen, as ``client_state_dtype``:
  float32 is exact, bfloat16 halves the memory), or ``sgd`` (ω − β·g, Algorithm 1 line 8 as written);
- ``batches=stream``: the inner batches and the outer batch (6 consecutive batches) are read one
  after another from one persistent iterator over D_pers (``Client.stream``, carried from round
  to round); D_eval is never used in training. ``independent``: each inner batch is drawn afresh
  from D_pers and the outer batch from D_eval;
- ``context=transductive``: ζ comes from the batch being classified (x only), also at test time;
- ``first_order=true``: the inner gradients are not differentiated (first-order MAML).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fedmeta.algorithms.base import Algorithm, ClientData, ClientUpdate, Context, LocalResult
from fedmeta.data.federation import STREAMS, Batch, Client
from fedmeta.functional import Params, adam, adam_first_step, grad_and_value, sgd
from fedmeta.models import ModulatedNet, Modulator
from fedmeta.models.cnn import ConvFeatures
from fedmeta.models.lstm import SequenceFeatures

log = logging.getLogger("fedmeta")


def extractor(cfg, num_classes: int) -> nn.Module:
    """The modulator's h_x for the base network's kind: the data set's conv blocks for images (a
    ResNet's modulator reads the images with them too), an embedding and the LSTM layers of
    ``model.modulator.lstm_units`` for text."""
    if cfg.model.kind == "lstm":
        return SequenceFeatures(num_classes, cfg.model.embedding_dim, list(cfg.model.modulator.lstm_units))
    m = cfg.model
    return ConvFeatures(
        cfg.dataset.in_channels, cfg.dataset.image_size, m.conv_channels, m.kernel_size, m.padding
    )


class CAFeMe(Algorithm):
    model: ModulatedNet

    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> ModulatedNet:
        """The base CNN and the modulator that reads a client's batch and gates its activations."""
        base = super().build_model(cfg, num_classes)
        modulator = Modulator(
            extractor(cfg, num_classes),
            num_classes,
            before_mean=cfg.model.modulator.before_mean,
            after_mean=cfg.model.modulator.after_mean,
            layer_sizes=base.hidden_sizes(include_flatten=cfg.method.modulate_flatten),
            modulation=cfg.method.modulation,
            use_labels=cfg.method.context == "labelled",
        )
        return ModulatedNet(base, modulator, modulate_flatten=cfg.method.modulate_flatten)

    @classmethod
    def channels_last(cls, cfg) -> bool:
        return cfg.method.first_order  # batch norm's double backward is slower in NHWC

    def __init__(self, model: ModulatedNet, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.transductive = cfg.context == "transductive"
        self.keeps_adam = cfg.outer_optimizer == "adam_kept"
        self.said_outer_size = False

    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.run_model(self.model, params, x, context.x, context.y, mask, context.mask)

    def adaptation_context(self, batch: Batch) -> Context:
        return Batch(batch.x, None, batch.mask) if self.transductive else Batch(batch.x, batch.y, batch.mask)

    def prediction_context(self, batch: Batch, last_batch: Batch) -> Context:
        # Paper: ζ = g_μ'(D') from the last personalization batch. Authors' code: from x itself.
        return Batch(batch.x, None, batch.mask) if self.transductive else self.adaptation_context(last_batch)

    def outer_batches(self) -> int:
        return max(1, self.cfg.eval_batch_size // self.cfg.batch_size)

    def draw(self, client: Client, round_: int) -> ClientData:
        cfg = self.cfg
        if cfg.batches in STREAMS:
            batches = client.stream(
                "pers",
                cfg.batch_size,
                self.batches_read(client.id),
                cfg.inner_steps + self.outer_batches(),
                reshuffle=cfg.batches == "stream",
            )
            outer = batches[cfg.inner_steps :]
            return {
                "inner": batches[: cfg.inner_steps],
                "outer": Batch(torch.cat([b.x for b in outer]), torch.cat([b.y for b in outer])),
            }
        generator = client.generator(round_)
        inner = client.batches("pers", cfg.batch_size, generator, cfg.inner_steps)
        held_out = len(client.indices("held_out"))
        if cfg.eval_batch_size is not None and held_out < cfg.eval_batch_size and not self.said_outer_size:
            self.said_outer_size = True
            log.info(  # the protocol's, as the authors' code has it: nothing to act on
                f"CAFeMe: a client with fewer than method.eval_batch_size={cfg.eval_batch_size} held-out images "
                f"(client {client.id}: {held_out}) takes them all as its outer batch, as the paper's protocol does"
            )
        return {"inner": inner, "outer": client.batch("held_out", cfg.eval_batch_size, generator)}

    def personalize(self, params: Params, batches: list[Batch]) -> tuple[Params, Batch]:
        """Algorithm 2, differentiable: returns ψ', μ' and the last batch D' (which gives ζ)."""
        for batch in batches:
            # first-order MAML: the inner gradient is a constant
            grads, _ = grad_and_value(
                lambda p, b=batch: self.loss(p, b, self.adaptation_context(b)),
                second_order=not self.cfg.first_order,
            )(params)
            params, _ = sgd(params, grads, self.cfg.inner_lr)
        return params, batch

    def meta_loss(self, omega: Params, data: ClientData) -> torch.Tensor:
        """L_{D_eval}(f_ψ'|ζ) after Personalization(S, α, D_pers, ω): the outer objective of line 8."""
        adapted, last_batch = self.personalize(omega, data["inner"])
        outer = data["outer"]
        return self.loss(adapted, outer, self.prediction_context(outer, last_batch))

    def client_state(self, client_id: int, params: Params) -> dict:
        return self.kept_adam(client_id, "adam", params) if self.keeps_adam else {}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        grads, outer_loss = grad_and_value(self.meta_loss)(params, data)
        if self.cfg.outer_optimizer == "sgd":
            new, _ = sgd(params, grads, self.cfg.outer_lr)
            return LocalResult(new, outer_loss, {}, {})
        if not self.keeps_adam:  # a fresh Adam's one step
            return LocalResult(adam_first_step(params, grads, self.cfg.outer_lr), outer_loss, {}, {})
        new, adam_after = adam(params, grads, state, self.cfg.outer_lr)
        return LocalResult(new, outer_loss, adam_after, {})

    def update_weight(self, client: Client) -> float:
        return 1.0  # uniform, as the paper's Algorithm 1

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result)
        kept = {"adam": self.compact_adam(result.state)} if self.keeps_adam else {}
        if self.cfg.batches in STREAMS:
            kept |= self.read_more(client.id, self.cfg.inner_steps + self.outer_batches())
        update.state = kept or None
        return update
