"""The interface every algorithm implements, on top of a functional view of one global model.

A federated algorithm differs from another in a few places only, and a subclass overrides just
those: which batches a sampled client reads (``draw``), what it computes from the global
parameters and those batches (``local_update``), what it sends and keeps (``to_update``), how the
server combines the clients' results (``aggregate``), and the personalization hooks
(``personal_params``, ``adaptation_loss``, ``adaptation_context``, ``prediction_context``) used by
the one test-time procedure that all methods share (fedmeta.evaluation).

``local_update`` is a pure function of tensors — parameters, the client's kept state and its
batches in, new parameters, loss and state out — written with ``torch.func`` gradients and the
optimizers of fedmeta.functional. It is written once, for one client; fedmeta.engine calls it for
one client at a time or ``vmap``s it over the stacked clients of a round (and of several seeds).
A client is therefore data plus a seed: no per-client module copies.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from lightning_fabric.plugins import Precision
from omegaconf import OmegaConf
from torch import nn

from fedmeta.data.federation import Batch, Client
from fedmeta.functional import (
    Params,
    adam,
    adam_state,
    call,
    cross_entropy,
    grad_and_value,
    masked_mean,
    sgd,
    weighted_sum,
)
from fedmeta.models import build_base_net

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")

Context = Batch | None  # what a modulated model conditions on: a batch (labels optional)
ClientData = dict[str, Any]  # a client's batches for one local update: Batch / list[Batch] / Steps values
Objective = Callable[[Params, Batch], torch.Tensor]  # what a local step minimizes: self.loss by default


class LocalResult(NamedTuple):
    """What ``local_update`` returns, per client (stacked along dim 0 when vmapped)."""

    params: Params  # the parameters after local training
    loss: torch.Tensor  # the training loss the client reports
    state: dict  # what the client keeps for its next round ({} when nothing)
    extra: dict  # anything else ``to_update`` needs (IFCA: the chosen model)


@dataclass
class ClientUpdate:
    client_id: int
    params: Params  # what the client sends to the server, detached: a subset of the global names
    weight: float  # its share in the aggregate
    loss: torch.Tensor | float  # the training loss it reports: a device scalar until the round reads them all
    state: dict | None = (
        None  # what the client keeps for its next round (FedRep's head, the authors' Adam moments)
    )

    def to(self, device) -> ClientUpdate:
        return ClientUpdate(
            self.client_id,
            _tree_to(self.params, device),
            self.weight,
            _tree_to(self.loss, device),
            _tree_to(self.state, device),
        )


def _tree_to(tree, device):
    if isinstance(tree, dict):
        return {key: _tree_to(value, device) for key, value in tree.items()}
    return tree.to(device) if isinstance(tree, torch.Tensor) else tree


def masked(mask: torch.Tensor | None) -> dict:
    """The ``mask`` keyword for a model's forward, only where there is one (any module works unpadded)."""
    return {} if mask is None else {"mask": mask}


def unless_idle(batch: Batch, new, old):
    """``new`` (parameters, or an optimizer's nested state), except on a padding step of a stacked
    client (``batch.active`` false): ``old``."""
    if batch.active is None:
        return new
    if isinstance(new, dict):
        return {k: unless_idle(batch, new[k], old[k]) for k in new}
    return torch.where(batch.active, new, old)


def step_weight(batch: Batch) -> torch.Tensor | float:
    return 1.0 if batch.active is None else batch.active.float()


class Settings(dict):
    """A method's settings, resolved once into a plain dict read by attribute: a round's draws read
    them hundreds of times, and a ``DictConfig`` read costs microseconds (resolving, validating)."""

    __slots__ = ()

    def __init__(self, cfg):
        super().__init__(cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True))

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the method has no setting {name!r}") from None

    __setattr__ = dict.__setitem__


class Algorithm(nn.Module):
    """A federated method around one global model ``self.model``; ``cfg`` is the config's ``method``
    (read once: later changes to the config do not reach it)."""

    def __init__(self, model: nn.Module, cfg, precision: Precision | None = None):
        super().__init__()
        self.model = model
        self.cfg = Settings(cfg)
        # Per-client state, only for algorithms defined by it: client id → what its last update kept.
        self.client_states: dict[int, dict] = {}
        self.precision = precision or Precision()  # Fabric's precision plugin of the run: 32-bit by default

    # ---- the model it trains -------------------------------------------------------------------
    @classmethod
    def build_model(cls, cfg, num_classes: int, sources: tuple[str, ...] = ()) -> nn.Module:
        """The global model of a (whole) config: the base CNN of ``cfg.model`` for the data's
        images; ``sources``: the source data sets a Meta-Dataset federation was drawn from."""
        return build_base_net(
            cfg.model,
            in_channels=cfg.dataset.in_channels,
            image_size=cfg.dataset.image_size,
            num_classes=num_classes,
        )

    @classmethod
    def channels_last(cls, cfg) -> bool:
        """NHWC activations (faster convolutions on the CPU), unless the method's gradients are
        slower in them (fedmeta.engine turns NHWC off for vmapped clients in any case)."""
        return True

    # ---- the model as a function of its parameters -------------------------------------------
    def global_params(self) -> Params:
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def run_model(self, module: nn.Module, params: Params, *inputs, **options) -> torch.Tensor:
        """``module`` as a function of ``params``, under the run's precision (what Fabric's wrapped
        module does in its forward: inputs converted, the plugin's context entered); logits in float32.
        The context is entered per forward pass, not around a whole round: autocast caches the
        low-precision copies of leaf parameters until it exits, so in-place optimizer steps inside
        one long autocast region would go unseen by later forward passes."""
        with self.precision.forward_context():
            logits = call(
                module, params, *self.precision.convert_input(inputs), **self.precision.convert_input(options)
            )
        return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits

    def forward(
        self, params: Params, x: torch.Tensor, context: Context = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.run_model(self.model, params, x, **masked(mask))

    def loss(self, params: Params, batch: Batch, context: Context = None) -> torch.Tensor:
        logits = self(params, batch.x, context, batch.mask)
        return masked_mean(cross_entropy(logits, batch.y), batch.mask)

    # ---- federated training ------------------------------------------------------------------
    @abstractmethod
    def draw(self, client: Client, round_: int) -> ClientData:
        """The batches a sampled client reads in its local update of ``round_`` (its own seeded
        generator decides them, so they do not depend on which process or lane runs it)."""

    @abstractmethod
    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        """A client's local work from the global ``params``, its kept ``state`` and its batches:
        a pure function of tensors (vmappable)."""

    def client_state(self, client_id: int, params: Params) -> dict:
        """The state a client's local update starts from; ``{}`` for stateless methods."""
        return {}

    def update_weight(self, client: Client) -> float:
        """A client's share of the average: its sample count (FedAvg), or 1 (``method.averaging=uniform``)."""
        return 1.0 if self.cfg.get("averaging") == "uniform" else float(client.num_samples)

    def training_clients(self) -> int:
        """N: the clients that train the model (the new clients are only evaluated). A method that
        reads it sets ``num_clients: ${federation.num_clients}`` and ``num_new_clients:
        ${federation.num_new_clients}`` in its method file (SCAFFOLD's and FedDyn's 1/N)."""
        return self.cfg.num_clients - self.cfg.num_new_clients

    # ---- what a client carries between rounds, where a method (or its authors' code) keeps it ----
    def batches_read(self, client_id: int) -> int:
        """How many batches of its persistent iterator (``Client.stream``) the client has read."""
        return int(self.client_states.get(client_id, {}).get("batches_read", 0))

    def read_more(self, client_id: int, count: int) -> dict:
        """The state that records ``count`` more batches read from the client's iterator."""
        return {"batches_read": self.batches_read(client_id) + count}

    def kept_adam(self, client_id: int, key: str, params: Params) -> dict:
        """The Adam state the client kept under ``key`` (in the parameters' dtype), or a fresh one."""
        kept = self.client_states.get(client_id, {}).get(key)
        if kept is None:
            return adam_state(params)
        dtype = next(
            iter(params.values())
        ).dtype  # moments kept in bfloat16 are used in the parameters' dtype
        return {
            "step": kept["step"],
            **{m: {k: v.to(dtype) for k, v in kept[m].items()} for m in ADAM_MOMENTS},
        }

    def compact_adam(self, state: dict) -> dict:
        """Copies of an Adam state to keep (moments as ``method.client_state_dtype``, float32 by
        default): a vmapped round's results are views into tensors of all its clients."""
        dtype = getattr(torch, self.cfg.get("client_state_dtype", "float32"))
        return {
            "step": state["step"].detach().clone(),
            **{m: {k: v.detach().to(dtype, copy=True) for k, v in state[m].items()} for m in ADAM_MOMENTS},
        }

    # ---- parameters that stay with their client (FedRep, FedPer, LG-FedAvg, FedBN) --------------
    def split_names(self, prefixes: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """The model's parameter names that start with one of ``prefixes``, and the others (model order)."""
        names = [name for name, _ in self.model.named_parameters()]
        return [n for n in names if n.startswith(prefixes)], [n for n in names if not n.startswith(prefixes)]

    def kept_params(self, client_id: int, params: Params, names: list[str]) -> Params:
        """The client's own ``names`` as its last update kept them; the global ``params``' for a client
        that has not taken part (the server never averages them: they stay at their initialization)."""
        kept = self.client_states.get(client_id, {})
        return {n: kept.get(n, params[n]) for n in names}

    @staticmethod
    def keep(params: Params, names: list[str]) -> dict:
        """Copies of ``params[names]`` for the client to keep: a vmapped round's results are views
        into tensors of all its clients."""
        return {n: params[n].detach().clone() for n in names}

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        """What the client sends (all trained parameters by default) and keeps."""
        return ClientUpdate(
            client.id,
            {k: p.detach() for k, p in result.params.items()},
            self.update_weight(client),
            result.loss.detach(),
            result.state or None,
        )

    def run_client(self, client: Client, round_: int) -> ClientUpdate:
        """One client's local update on its own (fedmeta.engine runs many at once)."""
        params = self.global_params()
        return self.to_update(
            client, self.local_update(params, self.client_state(client.id, params), self.draw(client, round_))
        )

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """Each global parameter becomes the weighted mean of the clients that sent it (FedAvg);
        one that no client sent keeps its value. ``updates`` are all the round's clients, in the
        round's order, on every Fabric rank — so every rank computes the same model."""
        for update in updates:
            if update.state is not None:
                self.client_states[update.client_id] = update.state
        params = dict(self.model.named_parameters())
        senders: dict[tuple[int, ...], list[str]] = {}  # the parameters each set of clients sent
        for name in params:
            who = tuple(i for i, u in enumerate(updates) if name in u.params)
            if who:
                senders.setdefault(who, []).append(name)
        with torch.no_grad():  # one multi-tensor kernel per client, however many parameters it sent
            for who, names in senders.items():
                total = sum(updates[i].weight for i in who)
                means = weighted_sum(
                    [[updates[i].params[n] for n in names] for i in who],
                    [updates[i].weight / total for i in who],
                )
                torch._foreach_copy_([params[n] for n in names], means)

    def local_sgd(
        self,
        params: Params,
        batches: list[Batch],
        lr: float,
        momentum: float = 0.0,
        trainable: list[str] | None = None,
        objective: Objective | None = None,
        correction: Callable[[Params, Params], Params] | None = None,
    ) -> tuple[Params, torch.Tensor]:
        """SGD over ``batches`` (a client's shuffled epochs), updating ``params[trainable]`` (all by
        default); returns the new parameters and the mean training loss. ``objective(params, batch)``:
        what each step minimizes instead of ``self.loss`` (FedProx: the loss plus a proximal term,
        ``fedmeta.functional.proximal``); its value is the loss reported. ``correction(params,
        grads)``: the gradient a step takes instead (FedDyn's linear and quadratic terms, whose
        value is no loss to report)."""
        names = trainable or list(params)
        velocity = {n: torch.zeros_like(params[n]) for n in names} if momentum else None

        def step(trained: Params, grads: Params, v):
            return sgd(trained, correction(trained, grads) if correction else grads, lr, momentum, v)

        params, loss, _ = self._local_steps(params, batches, names, velocity, step, objective)
        return params, loss

    def local_adam(
        self,
        params: Params,
        batches: list[Batch],
        lr: float,
        state: dict,
        trainable: list[str] | None = None,
        objective: Objective | None = None,
    ) -> tuple[Params, torch.Tensor, dict]:
        """Adam over ``batches`` from ``state`` (a client's kept optimizer); also returns the state after."""
        names = trainable or list(params)
        return self._local_steps(
            params, batches, names, state, lambda trained, grads, s: adam(trained, grads, s, lr), objective
        )

    def _local_steps(
        self,
        params: Params,
        batches: list[Batch],
        names: list[str],
        optimizer_state,
        step,
        objective: Objective | None = None,
    ):
        if not batches:
            return params, torch.zeros(()), optimizer_state
        objective = objective or self.loss
        total, steps = 0.0, 0.0
        for batch in batches:

            def loss_of(trained: Params, batch=batch, params=params) -> torch.Tensor:
                return objective({**params, **trained}, batch)

            grads, loss = grad_and_value(loss_of)({n: params[n] for n in names})
            trained, new_state = step({n: params[n] for n in names}, grads, optimizer_state)
            params = {**params, **unless_idle(batch, trained, params)}
            if optimizer_state is not None:
                optimizer_state = unless_idle(batch, new_state, optimizer_state)
            total, steps = total + step_weight(batch) * loss, steps + step_weight(batch)
        return params, total / steps, optimizer_state

    # ---- the shared test-time personalization (fedmeta.evaluation) ---------------------------
    def kept_model(self, params: Params, state: dict) -> Params:
        """The model a training client has from what the method keeps for it (``client_state``), given
        the global ``params``: what the training-clients protocol scores, as it is. A method that
        keeps no model per client does not define it: its training clients take the new clients'
        test-time procedure (fedmeta.evaluation)."""
        raise NotImplementedError

    @property
    def keeps_client_models(self) -> bool:
        return type(self).kept_model is not Algorithm.kept_model

    def personalization_data(self, client: Client) -> ClientData:
        """Batches a method needs to choose a new client's starting point (IFCA's model choice)."""
        return {}

    def personal_params(self, params: Params, data: ClientData) -> Params:
        """Where a new client's personalization starts, given the global ``params``: those."""
        return params

    def adapted_names(self, step: int) -> list[str] | None:
        """The parameters personalization step ``step`` (0-based) trains; None: all of them."""
        return None

    def adaptation_loss(self, params: Params, batch: Batch, start: Params) -> torch.Tensor:
        """The loss a personalization step minimizes; ``start`` is where the client started (Ditto
        pulls toward it)."""
        return self.loss(params, batch, self.adaptation_context(batch))

    def adaptation_context(self, batch: Batch) -> Context:
        """The context a personalization step on ``batch`` conditions on (none for plain models)."""
        return None

    def prediction_context(self, batch: Batch, last_batch: Batch) -> Context:
        """The context used to classify the held-out ``batch`` after adapting on ``last_batch``."""
        return None

    # ---- what the server sends a sampled client besides the global model --------------------
    def broadcast_state(self, client_id: int) -> Params:
        """Tensors of the server's state, besides the model, that client ``client_id``'s local update
        or personalization reads (SCAFFOLD's server control variate, FedProto's prototypes, the head
        FedPAC's server combined for that client); none by default. In one process they are read
        from the algorithm itself; on a Flower node they arrive with the model (fedmeta.flower)."""
        return {}

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        """Takes the server's ``broadcast_state`` where a node trains or personalizes client ``client_id``."""

    # ---- the whole federation state, for checkpoints ----------------------------------------
    def federation_state(self) -> dict:
        return {"model": self.model.state_dict(), "client_states": self.client_states}

    def load_federation_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.client_states = dict(state.get("client_states", {}))
