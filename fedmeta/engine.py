"""How clients are computed: one after another (optionally on CPU threads), or stacked into one
``torch.func.vmap``-ed computation (``federation.vectorize``).

A *lane* is one client of one federation: (algorithm, client). A round of one run is M lanes;
with stacked seeds (``seeds=[0,1,2]``) it is M lanes per seed, each seed with its own algorithm
instance (its own global model and client states) — the algorithms share their class and
config, so one pure ``local_update`` serves every lane. Vectorized, each lane's global
parameters, kept state and batches are stacked along a new leading axis and the algorithm's
``local_update`` (or the shared ``personalize``) is vmapped over it.

Clients whose batches differ in size (Dirichlet partitions, FEMNIST writers, small held-out
splits) are **padded**: each batch to the largest size among the lanes at that step, with a
sample mask that keeps the padding out of the loss, the batch-norm statistics, the modulator's
mean and the accuracy; a lane with fewer steps (fewer batches per epoch) idles through the
others' extra steps, its parameters unchanged (``Batch.active``). Lanes of equal size are
stacked without masks, so the common case runs the same kernels as one client alone.

Vectorized, the clients draw *index* batches (``Client.indexed``): the lanes' indices are stacked
on the host, moved to the device in one copy per dtype, and the images are gathered there from the
device-resident data — one gather per batch for all lanes, stacked seeds included (their data sets
share one device bank). With ``federation.capture`` the stacked inputs are also padded to a fixed
layout that only grows (the largest batch and the most steps seen at each position), so every
round has the same shapes and fedmeta.capture can record the round once and replay it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fedmeta.algorithms import Algorithm, ClientUpdate
from fedmeta.capture import Capture
from fedmeta.data.federation import Batch, Client, Federation, Steps, gather, map_batches
from fedmeta.errors import FedmetaError
from fedmeta.evaluation import check_finite, draw_personalization, personalize, personalize_client
from fedmeta.functional import vmapped
from fedmeta.models import set_channels_last

log = logging.getLogger("fedmeta")

Lane = tuple[Algorithm, Client]
ClientMap = Callable[[Callable[[Any], Any], list], list]  # runs a function on each item, in order


def sequential(fn: Callable[[Any], Any], items: list) -> list:
    return [fn(item) for item in items]


def thread_map(threads: int) -> ClientMap:
    """``threads`` clients at a time, each on one intra-op thread — a client's small ops use CPU
    cores better side by side than split across them. A result does not depend on its thread."""
    if threads <= 1:
        return sequential
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="client")
    return lambda fn, items: list(pool.map(fn, items))


# ---- stacking lanes ---------------------------------------------------------------------------
def _idle(tree):
    """A copy of a lane's last step that changes nothing: padding for lanes with fewer steps."""
    if isinstance(tree, Batch):
        return tree._replace(active=torch.zeros((), dtype=torch.bool, device=tree.x.device))
    return [_idle(item) for item in tree]


def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    n = t.shape[0]
    return torch.cat([t, t.new_zeros((size - n, *t.shape[1:]))]) if n < size else t


def _stack_batches(batches: list[Batch]) -> Batch:
    # Called for every step of every round: shapes read as ``shape[0]`` (``len`` of a tensor costs
    # several times more), padding only where sizes differ, and the labels of index batches (the
    # same tensor as their samples) stacked once.
    sizes = [b.x.shape[0] for b in batches]
    size = max(sizes)
    ragged = min(sizes) != size or any(b.mask is not None for b in batches)
    x = torch.stack([_pad(b.x, size) for b in batches] if ragged else [b.x for b in batches])
    if batches[0].y is None:
        y = None
    elif all(b.y is b.x for b in batches):
        y = x
    else:
        y = torch.stack([_pad(b.y, size) for b in batches] if ragged else [b.y for b in batches])
    mask = None
    if ragged:
        mask = torch.stack(
            [
                _pad(torch.ones(n, dtype=torch.bool, device=b.x.device) if b.mask is None else b.mask, size)
                for b, n in zip(batches, sizes)
            ]
        )
    active = None
    if any(b.active is not None for b in batches):
        true = torch.ones((), dtype=torch.bool, device=x.device)
        active = torch.stack([true if b.active is None else b.active for b in batches])
    return Batch(x, y, mask, active)


def _stack_uniform_steps(items: list[list]) -> list[Batch] | None:
    """Lanes' lists of batches when every lane has the same steps of one shape, none masked or idle
    (a round's epochs over equal clients): one stack for every step, in step-major order so each
    step's batch is a contiguous slice. None when they are not so: stacked step by step instead."""
    steps = len(items[0])
    if not steps or any(len(item) != steps for item in items):
        return None
    batches = [item[s] for s in range(steps) for item in items]
    first = batches[0]
    if not isinstance(first, Batch) or any(
        b.mask is not None or b.active is not None or b.x.shape != first.x.shape for b in batches
    ):
        return None

    def stacked(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return torch.stack(tensors).view(steps, len(items), *tensors[0].shape).unbind(0)

    x = stacked([b.x for b in batches])
    if all(b.y is b.x for b in batches):
        y = x
    elif all(b.y is None for b in batches):
        y = [None] * steps
    elif first.y is not None and all(b.y is not None and b.y.shape == first.y.shape for b in batches):
        y = stacked([b.y for b in batches])
    else:
        return None
    return [Batch(xs, ys) for xs, ys in zip(x, y)]


@functools.lru_cache(maxsize=64)
def _step_major(lanes: int, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sample of lanes' equal ``Steps``, stacked lane after lane, goes when each step
    holds its lanes' samples together (its batch a contiguous ``[lanes, size]`` block), and the
    lane of each place: the same for every round of one shape, so made once."""
    total = sum(sizes)
    places = torch.arange(lanes * total).view(lanes, total).split(list(sizes), dim=1)
    order = torch.cat([block.reshape(-1) for block in places])
    return order, torch.div(order, total, rounding_mode="floor")


def _stack_steps(items: list[Steps]) -> Steps | list[Batch]:
    """Lanes' ``Steps``: stacked in two operations when their steps have the same sizes (a round's
    epochs over clients of one size), else as their lists of batches (lanes with fewer or smaller
    steps masked and idled)."""
    sizes = items[0].sizes
    if not sizes or any(item.sizes != sizes for item in items):
        return stack([item.batches() for item in items])
    order, lane = _step_major(len(items), sizes)
    x = torch.stack([item.x for item in items]).view(-1, *items[0].x.shape[1:]).index_select(0, order)
    if all(item.y is item.x for item in items):
        y = x
    elif all(item.y is None for item in items):
        y = None
    else:
        y = torch.stack([item.y for item in items]).view(-1, *items[0].y.shape[1:]).index_select(0, order)
    return Steps(x, y, sizes, len(items), lane)


def stack(items: list):
    """Lanes' pytrees (dicts, lists of batches, ``Steps``, tensors) stacked along a new axis 0, padded
    (``Steps`` stacked step by step: see ``Steps``)."""
    first = items[0]
    if isinstance(first, Batch):
        return _stack_batches(items)
    if isinstance(first, Steps):
        return _stack_steps(items)
    if isinstance(first, dict):
        return {key: stack([item[key] for item in items]) for key in first}
    if isinstance(first, list):
        uniform = _stack_uniform_steps(items)
        if uniform is not None:
            return uniform
        longest = max(items, key=len)  # a lane with no steps idles through copies of another's
        return [
            stack([item[i] if i < len(item) else _idle(item[-1] if item else longest[i]) for item in items])
            for i in range(len(longest))
        ]
    return torch.stack(items)


# ---- a fixed layout, for recorded rounds ------------------------------------------------------
# A layout mirrors a stacked tree: for a batch (samples, masked, stepped), for a list its items'
# layouts, for a dict its values'. It only grows, so after a few rounds every round fits it.
def layout_of(tree):
    if isinstance(tree, Batch):
        return ("batch", tree.x.shape[1], tree.mask is not None, tree.active is not None)
    if isinstance(tree, Steps):  # stacked: the layout of its batches
        return [("batch", size, False, False) for size in tree.sizes]
    if isinstance(tree, dict):
        return {key: layout_of(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [layout_of(item) for item in tree]
    return None


def merge_layouts(a, b):
    """The smallest layout that holds both (``a`` may be None: nothing seen yet)."""
    if a is None:
        return b
    if isinstance(b, tuple):
        return ("batch", max(a[1], b[1]), a[2] or b[2] or a[1] != b[1], a[3] or b[3])
    if isinstance(b, dict):
        return {key: merge_layouts(a.get(key), value) for key, value in b.items()}
    if isinstance(b, list):
        longer = a if len(a) >= len(b) else b  # the steps past the shorter one are idle in some rounds
        return [merge_layouts(x, y) for x, y in zip(a, b)] + [
            _stepped(s) for s in longer[min(len(a), len(b)) :]
        ]
    return b


def pad_to(tree, layout):
    """``tree`` (stacked) padded to ``layout``: samples masked out, steps idled through."""
    if isinstance(tree, Batch):
        _, size, masked, stepped = layout
        lanes, n = tree.x.shape[:2]
        mask = tree.mask
        if (masked or size > n) and mask is None:
            mask = torch.ones(lanes, n, dtype=torch.bool, device=tree.x.device)
        if size > n:
            pad = lambda t: torch.cat([t, t.new_zeros((lanes, size - n, *t.shape[2:]))], 1)  # noqa: E731
            tree = tree._replace(x=pad(tree.x), y=None if tree.y is None else pad(tree.y))
            mask = pad(mask)
        active = tree.active
        if stepped and active is None:
            active = torch.ones(lanes, dtype=torch.bool, device=tree.x.device)
        return tree._replace(mask=mask, active=active)
    if isinstance(tree, dict):
        return {key: pad_to(value, layout[key]) for key, value in tree.items()}
    if isinstance(tree, Steps):
        return tree if layout == layout_of(tree) else pad_to(tree.batches(), layout)
    if isinstance(tree, list):
        return [
            pad_to(tree[i] if i < len(tree) else _idle_lanes(tree[-1]), item) for i, item in enumerate(layout)
        ]
    return tree


def _idle_lanes(tree):
    """A stacked step that no lane takes: padding for a round with fewer steps than its layout."""
    return map_batches(
        tree, lambda b: b._replace(active=torch.zeros(len(b.x), dtype=torch.bool, device=b.x.device))
    )


def _stepped(layout):
    """A step some rounds do not have: idled through (and masked: the idle copy of a lane's last
    batch may be smaller than the step's largest)."""
    if isinstance(layout, tuple):
        return (*layout[:2], True, True)
    if isinstance(layout, dict):
        return {key: _stepped(value) for key, value in layout.items()}
    return [_stepped(item) for item in layout] if isinstance(layout, list) else layout


def to_device(tree, device: torch.device):
    """A tree of host tensors on ``device``: one copy per dtype, however many tensors (a tensor the
    tree holds twice, as index batches hold their indices for samples and labels, copied once)."""
    leaves, spec = tree_flatten(tree)
    first_place: dict[int, int] = {}
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.device != device:
            first_place.setdefault(id(t), i)
    tensors = list(first_place.values())
    moved_leaves = {}
    for dtype in {leaves[i].dtype for i in tensors}:
        group = [i for i in tensors if leaves[i].dtype == dtype]
        moved = torch.cat([leaves[i].reshape(-1) for i in group]).to(device, non_blocking=True)
        for i, part in zip(group, moved.split([leaves[i].numel() for i in group])):
            moved_leaves[id(leaves[i])] = part.view(leaves[i].shape)
    leaves = [moved_leaves.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in leaves]
    return tree_unflatten(leaves, spec)


class DataBank:
    """The data tensors of several federations (stacked seeds) as one (K, N, …) device tensor, so one
    gather fetches every lane's batches; each federation's own tensors become views into it."""

    def __init__(self, federations: list[Federation]):
        self.x = torch.stack([f.x for f in federations])
        self.y = torch.stack([f.y for f in federations])
        for k, federation in enumerate(federations):
            federation.x, federation.y = self.x[k], self.y[k]

    @staticmethod
    def fits(federations: list[Federation]) -> bool:
        first = federations[0]
        return all(
            f.x.shape == first.x.shape and f.x.dtype == first.x.dtype and f.y.shape == first.y.shape
            for f in federations
        )

    def gather(self, tree, sources: torch.Tensor):
        """Stacked index batches of lanes whose data are ``sources`` (a federation's place per lane)."""

        def take(b: Batch, rows: torch.Tensor) -> Batch:
            return b._replace(x=self.x[rows, b.x], y=None if b.y is None else self.y[rows, b.y])

        rows = sources.view(-1, 1)  # a batch's lanes along its first axis
        return map_batches(
            tree, lambda b: take(b, rows), lambda steps: take(Batch(steps.x, steps.y), sources[steps.lane])
        )


def lane(tree, i: int):
    """Lane ``i`` of a stacked result."""
    return tree_map(lambda t: t[i] if isinstance(t, torch.Tensor) else t, tree)


def in_dims(tree):
    """vmap's ``in_dims`` for a stacked pytree: 0 for tensors, None for the absent (None) fields."""
    return tree_map(lambda t: 0 if isinstance(t, torch.Tensor) else None, tree)


def _for_vmap(lanes: list[Lane]) -> Algorithm:
    """The algorithm whose pure functions serve every lane, with NCHW activations throughout:
    vmap cannot lay batched tensors out as channels_last (the same function, another layout)."""
    for algorithm in {id(a): a for a, _ in lanes}.values():
        set_channels_last(algorithm.model, False)
    return lanes[0][0]


class Engine:
    """Runs the local updates of a round's lanes and the personalization of new clients."""

    def __init__(
        self,
        vectorize: bool = False,
        threads: int = 1,
        max_lanes: int = 0,
        capture: str = "none",
        lane_buckets: int = 1,
    ):
        self.vectorize = vectorize
        self.map = thread_map(threads)
        self.max_lanes = max_lanes  # lanes per vmapped call (memory); 0: all at once
        self.lane_buckets = lane_buckets  # vmapped calls of clients of similar size (padding); 1: one call
        self.capture = Capture(capture)
        self.layouts: dict[tuple, Any] = {}  # per computation, the fixed layout its inputs are padded to
        self.banks: dict[tuple, DataBank] = {}
        self.fallback: str | None = None  # why clients run one at a time after all

    def describe(self) -> dict:
        """What computed the clients in the end, for summary.json: vmapped or not, recorded or not, and
        why not where it was asked for."""
        return {
            "vectorized": self.vectorize,
            "capture": self.capture.mode if self.vectorize else "none",
            "recorded": self.vectorize and self.capture.records,
            "calls_replayed": self.capture.replayed,  # of the vmapped rounds and evaluations: recorded ones
            "calls_eager": self.capture.eager,  # and eager ones (none where all were recorded)
            "fallback": self.fallback or self.capture.failed,
        }

    def label(self) -> str:
        if not self.vectorize:
            return "clients one at a time"
        return "clients vmapped" + {
            "graph": ", rounds as CUDA graphs",
            "static": ", fixed layout",
        }.get(self.capture.mode, "")

    def _chunks(self, lanes: list[Lane]) -> list[tuple[int, list[int]]]:
        """(bucket, lane positions) of each vmapped call. With ``lane_buckets`` = k > 1 the lanes are
        sorted by their client's data and cut into k groups of equal count, so a call pads its batches
        to the largest of clients of similar size rather than of all of them (Dirichlet partitions,
        FEMNIST's writers); each group is then cut to ``max_lanes``."""
        order = list(range(len(lanes)))
        buckets = max(1, min(self.lane_buckets, len(lanes)))
        if buckets > 1:
            order.sort(key=lambda i: lanes[i][1].num_samples)
        per = -(-len(order) // buckets)
        size = self.max_lanes or len(lanes)
        return [
            (bucket, group[i : i + size])
            for bucket, group in enumerate(order[j : j + per] for j in range(0, len(order), per))
            for i in range(0, len(group), size)
        ]

    def _in_chunks(self, run: Callable[[list[Lane], int], Any], lanes: list[Lane]) -> list:
        """Each lane's result, in lane order, from ``run(chunk, bucket)`` on each chunk of lanes (it
        returns one result a lane of the chunk); out of memory, the chunks halve until they fit (a
        vmapped call's results are applied only after all of them, so a repeated chunk changes nothing)."""
        while True:
            try:
                results: list = [None] * len(lanes)
                for bucket, positions in self._chunks(lanes):
                    for position, result in zip(positions, run([lanes[i] for i in positions], bucket)):
                        results[position] = result
                return results
            except torch.OutOfMemoryError:
                size = len(self._chunks(lanes)[0][1])
                if size == 1:
                    raise
                self.max_lanes = size // 2
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                log.warning(
                    f"federation.vectorize_lanes: {size} lanes did not fit in memory; "
                    f"now {self.max_lanes} per vmapped call"
                )

    # ---- federated training ------------------------------------------------------------------
    def local_updates(self, lanes: list[Lane], round_: int) -> list[ClientUpdate | str]:
        """Each lane's update, or a failed client's reason (one line), in lane order."""
        if self.vectorize and len(lanes) > 1:
            try:
                return self._in_chunks(lambda c, bucket: self._vectorized_updates(c, round_, bucket), lanes)
            except (FedmetaError, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 — find out below whether a client or vmap failed
                results = self._sequential_updates(lanes, round_)
                if not any(isinstance(r, str) for r in results):
                    self._give_up(lanes[0][0], exc)
                return results
        return self._sequential_updates(lanes, round_)

    def _sequential_updates(self, lanes: list[Lane], round_: int) -> list[ClientUpdate | str]:
        def attempt(item: Lane) -> ClientUpdate | str:
            algorithm, client = item
            try:
                return algorithm.run_client(client, round_)
            except (FedmetaError, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 — a failing client is dropped, not the run
                return f"client {client.id} failed: {type(exc).__name__}: {exc}".splitlines()[0]

        return self.map(attempt, lanes)

    def _indices(
        self, kind: str, lanes: list[Lane], draws: list, bucket: int = 0
    ) -> tuple[tuple, Any, Callable]:
        """The lanes' stacked index batches on the device (padded to the computation's layout when
        it is recorded: one layout per bucket of client sizes), the computation's key, and the
        function that gathers their data."""
        federations = list({id(c.data): c.data for _, c in lanes}.values())
        key = (kind, bucket, len(lanes), *(id(a) for a, _ in lanes), *(id(f) for f in federations))
        indices = stack(draws)
        if self.capture.pads:
            self.layouts[key] = merge_layouts(self.layouts.get(key), layout_of(indices))
            indices = pad_to(indices, self.layouts[key])
        device = federations[0].x.device
        indices = to_device(indices, device)
        if (
            len(federations) == 1
        ):  # the tensors themselves, not the federation: a recording keeps what it read
            x, y = federations[0].x, federations[0].y
            return key, indices, lambda tree: gather(x, y, tree)
        bank_key = tuple(id(f) for f in federations)
        if bank_key not in self.banks and DataBank.fits(federations):
            self.banks[bank_key] = DataBank(federations)
        place = {id(f): k for k, f in enumerate(federations)}
        sources = torch.tensor([place[id(c.data)] for _, c in lanes], device=device)
        if bank_key in self.banks:
            bank = self.banks[bank_key]
            return key, (indices, sources), lambda both: bank.gather(*both)
        data = [(c.data.x, c.data.y) for _, c in lanes]  # data sets of different shapes: a gather per lane
        return (
            key,
            (indices, sources),
            lambda both: stack([gather(*xy, lane(both[0], i)) for i, xy in enumerate(data)]),
        )

    def _vectorized_updates(self, lanes: list[Lane], round_: int, bucket: int = 0) -> list[ClientUpdate]:
        algorithm = _for_vmap(lanes)
        shared = all(
            a is algorithm for a, _ in lanes
        )  # one federation: the global parameters need no stacking
        params = [a.global_params() for a, _ in lanes]
        states = stack([a.client_state(c.id, p) for (a, c), p in zip(lanes, params)])
        key, indices, gather = self._indices(
            "round", lanes, [a.draw(c.indexed(), round_) for a, c in lanes], bucket
        )
        params_in = params[0] if shared else stack(params)

        def update_all(params_in, states, indices):
            data = gather(indices)
            dims = (None if shared else in_dims(params_in), in_dims(states), in_dims(data))
            with vmapped():
                return torch.func.vmap(algorithm.local_update, in_dims=dims)(params_in, states, data)

        results = self.capture.run(key, update_all, (params_in, states, indices))
        return [a.to_update(c, lane(results, i)) for i, (a, c) in enumerate(lanes)]

    def _give_up(self, algorithm: Algorithm, exc: Exception) -> None:
        self.vectorize = False
        reason = str(exc).splitlines()[0][:200]
        self.fallback = f"{type(algorithm).__name__} could not be vmapped ({type(exc).__name__}: {reason})"
        log.warning(
            f"federation.vectorize: {type(algorithm).__name__} could not be vmapped "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); its clients run one at a time"
        )

    # ---- the shared test-time procedure ------------------------------------------------------
    def personalization_curves(
        self, lanes: list[Lane], cfg, done: Callable[[int], None] = lambda clients: None, kept: bool = False
    ) -> torch.Tensor:
        """(lanes, steps + 1): each new client's held-out accuracy after 0…steps personalization steps
        (lanes, 1 with ``cfg.every_step`` false: after the last).
        ``done(n)`` is called as each n clients are finished (a progress bar). ``kept``: the lanes are
        training clients (their scoring views), each starting from the model its method keeps for it."""
        if not lanes:
            return torch.empty(0, cfg.steps + 1 if cfg.get("every_step", True) else 1)
        if self.vectorize and len(lanes) > 1:
            try:
                return torch.stack(
                    self._in_chunks(
                        lambda c, bucket: _then(self._vectorized_curves(c, cfg, kept, bucket), done, len(c)),
                        lanes,
                    )
                )
            except (FedmetaError, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 — vmap could not run it: one at a time instead
                self._give_up(lanes[0][0], exc)

        return torch.stack(
            self.map(lambda item: _then(personalize_client(*item, cfg, kept)[1], done, 1), lanes)
        )

    def _vectorized_curves(self, lanes: list[Lane], cfg, kept: bool = False, bucket: int = 0) -> torch.Tensor:
        algorithm = _for_vmap(lanes)
        shared = all(a is algorithm for a, _ in lanes)
        globals_ = [a.global_params() for a, _ in lanes]
        params = globals_[0] if shared else stack(globals_)
        states = stack([a.client_state(c.id, p) for (a, c), p in zip(lanes, globals_)]) if kept else {}
        key, indices, gather = self._indices(
            "kept curves" if kept else "curves",
            lanes,
            [draw_personalization(a, c.indexed(), cfg) for a, c in lanes],
            bucket,
        )

        def curve(p, s, d):
            _, accuracies, losses = personalize(algorithm, p, d, cfg, s if kept else None)
            return accuracies, losses

        def curves_all(params, states, indices):
            data = gather(indices)
            dims = (None if shared else in_dims(params), in_dims(states), in_dims(data))
            with vmapped():
                return torch.func.vmap(curve, in_dims=dims)(params, states, data)

        curves, losses = self.capture.run((*key, str(cfg)), curves_all, (params, states, indices))
        for (_, client), client_losses in zip(lanes, losses):
            check_finite(client, client_losses)
        return curves.cpu()


def _then(result, done: Callable[[int], None], clients: int):
    done(clients)
    return result
