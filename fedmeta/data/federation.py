"""Clients: index sets into one shared data tensor plus a seed — never model copies.

A client's batches come from a generator seeded by (run seed, client id, round, purpose), so a
client's work is the same whichever process or order runs it. ``Client.stream`` is the other way
to read a client's data, the one of a persistent iterator over a shuffled ``drop_last`` loader:
batch k of an endless sequence of epochs, each epoch shuffled by its own seeded generator, so a
client that has read k batches continues at k — in any process, after any checkpoint.

A client's draws can also yield *index batches* (``Client.indexed``): the same batches as sample
indices, which fedmeta.engine stacks for all the clients of a round, moves to the device in one
copy and gathers from the device-resident data there (``Federation.gather``) — the form a captured
round replays with new indices each round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch.utils._pytree import register_pytree_node

from fedmeta.data.datasets import ImageDataset
from fedmeta.data.partition import partition
from fedmeta.errors import FedmetaError

TRAIN_PURPOSE, PERSONALIZE_PURPOSE, FAILURE_PURPOSE, TRAIN_STREAM_PURPOSE, PERSONALIZE_STREAM_PURPOSE = (
    0,
    1,
    2,
    3,
    4,
)
AGGREGATION_PURPOSE = 5  # a client's own draws for weighing what it receives (FedALA's window)


class Batch(NamedTuple):
    """Images ``x`` and labels ``y`` (None where a batch serves only as an unlabelled context).
    When the clients of a round are stacked into one computation, their batches are padded to one
    size: ``mask`` marks the real samples (1) of each, and ``active`` says whether the step that
    reads the batch is real for its client (a client with fewer steps idles through the others)."""

    x: torch.Tensor
    y: torch.Tensor | None
    mask: torch.Tensor | None = None
    active: torch.Tensor | None = None


def epoch_sizes(count: int, batch_size: int, drop_last: bool) -> tuple[int, tuple[int, ...]]:
    """How many of ``count`` samples an epoch reads, and its batches' sizes: ``drop_last`` leaves out
    a last partial batch; a last batch of one sample joins the one before (BatchNorm with batch
    statistics cannot normalize a single sample)."""
    kept = count // batch_size * batch_size if drop_last and count >= batch_size else count
    full, rest = divmod(kept, batch_size)
    sizes = [batch_size] * full + ([rest] if rest else [])
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes[-2:] = [batch_size + 1]
    return kept, tuple(sizes)


class Steps:
    """A client's batches for several steps as one tensor: ``x`` (and ``y``) hold each step's
    samples after the step before's, ``sizes`` the steps' batch sizes. A round's epochs are drawn,
    stacked over clients and gathered in a few operations this way, not a batch at a time; read
    as the batches themselves (iterating, indexing, ``len``, ``batches()``). Stacked over
    ``lanes`` clients (fedmeta.engine), each step holds its lanes' samples together, lane after
    lane, and ``lane`` says whose each sample is."""

    __slots__ = ("x", "y", "sizes", "lanes", "lane")

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None,
        sizes: tuple[int, ...],
        lanes: int = 0,
        lane: torch.Tensor | None = None,
    ):
        self.x, self.y, self.sizes, self.lanes, self.lane = x, y, sizes, lanes, lane

    def batches(self) -> list[Batch]:
        """The steps' batches: views of ``x`` and ``y`` (``[lanes, size, …]`` each when stacked)."""
        lanes = self.lanes
        counts = [lanes * size for size in self.sizes] if lanes else self.sizes
        xs = self.x.split(counts)
        if lanes:
            xs = [x.view(lanes, size, *x.shape[1:]) for x, size in zip(xs, self.sizes)]
        if self.y is self.x:
            return [Batch(x, x) for x in xs]
        if self.y is None:
            return [Batch(x, None) for x in xs]
        ys = self.y.split(counts)
        if lanes:
            ys = [y.view(lanes, size, *y.shape[1:]) for y, size in zip(ys, self.sizes)]
        return [Batch(x, y) for x, y in zip(xs, ys)]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, step):
        return self.batches()[step]


register_pytree_node(
    Steps,
    lambda s: ([s.x, s.y, s.lane], (s.sizes, s.lanes)),
    lambda leaves, context: Steps(leaves[0], leaves[1], *context, leaves[2]),
    serialized_type_name="fedmeta.data.federation.Steps",
)


@dataclass
class Client:
    id: int
    pers: torch.Tensor  # indices of the personalization split D_pers
    held_out: torch.Tensor  # indices of the held-out split D_eval
    seed: int
    data: Federation = field(repr=False)
    test: torch.Tensor | None = None  # a training client's test split (the training-clients protocol)

    def __post_init__(self):
        self._splits = {
            "pers": self.pers,
            "held_out": self.held_out,
            "all": torch.cat([self.pers, self.held_out]),
        }
        self._indexed: Client | None = None
        self._scoring: Client | None = None

    def scoring(self) -> Client:
        """This training client as the training-clients protocol scores it: its test split as the
        held-out one, its training data (both splits training reads) as the personalization split."""
        if self.test is None:
            raise FedmetaError(
                f"client {self.id} has no test split: evaluation.protocol=new_clients keeps none "
                "(training_clients or both does)"
            )
        if self._scoring is None:
            self._scoring = Client(self.id, self._splits["all"], self.test, self.seed, self.data)
        return self._scoring

    def indexed(self) -> Client:
        """This client with batches of sample indices in place of images and labels (``x`` and ``y``
        both hold the indices): the same draws, gathered later by ``Federation.gather``."""
        if self._indexed is None:
            self._indexed = Client(self.id, self.pers, self.held_out, self.seed, INDICES)
            self._indexed._splits = self._splits
        return self._indexed

    @property
    def num_samples(self) -> int:
        return len(self.pers) + len(self.held_out)

    def generator(self, round_: int, purpose: int = TRAIN_PURPOSE) -> torch.Generator:
        state = np.random.SeedSequence([self.seed, self.id, round_, purpose]).generate_state(1)[0]
        return torch.Generator().manual_seed(int(state))

    def indices(self, split: str) -> torch.Tensor:
        """Sample indices of ``split``: "pers", "held_out" or "all"."""
        return self._splits[split]

    def batch(self, split: str, size: int | None, generator: torch.Generator | None = None) -> Batch:
        """A batch drawn without replacement from ``split``; ``size=None`` takes the whole split."""
        indices = self.indices(split)
        # shape[0], not len(), and index_select, not [ ]: a few times less host time each, in every draw
        count = indices.shape[0]
        if size is not None and size < count:
            indices = indices.index_select(0, torch.randperm(count, generator=generator)[:size])
        return Batch(*self.data.take(indices))

    def batches(self, split: str, size: int, generator: torch.Generator, count: int) -> Steps:
        """``count`` batches drawn as ``batch`` draws them, one after another from ``generator``,
        as one ``Steps`` (one gather for all)."""
        indices = self.indices(split)
        n = indices.shape[0]
        if size >= n:
            return Steps(*self.data.take(indices.repeat(count)), (n,) * count)
        order = torch.cat([torch.randperm(n, generator=generator)[:size] for _ in range(count)])
        return Steps(*self.data.take(indices.index_select(0, order)), (size,) * count)

    def epoch(
        self, split: str, batch_size: int, generator: torch.Generator | None, drop_last: bool = False
    ) -> list[Batch]:
        """One pass over ``split`` in batches of ``batch_size`` (of the sizes ``epoch_sizes`` says),
        shuffled by ``generator`` (None: in order, as a test loader reads)."""
        order, sizes = self._epoch_order(split, batch_size, generator, drop_last)
        return Steps(*self.data.take(order), sizes).batches()

    def _epoch_order(
        self, split: str, batch_size: int, generator: torch.Generator | None, drop_last: bool
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """An epoch's sample indices in the order it reads them, and its batches' sizes (``epoch``'s)."""
        indices = self.indices(split)
        count = indices.shape[0]  # not len(): a tensor's len() costs several times more, in every draw
        kept, sizes = epoch_sizes(count, batch_size, drop_last)
        if generator is not None:
            return indices.index_select(0, torch.randperm(count, generator=generator)[:kept]), sizes
        return indices[:kept], sizes

    def window(self, split: str, fraction: float, batch_size: int, generator: torch.Generator) -> list[Batch]:
        """A contiguous run of ``fraction`` of ``split`` in its stored order, starting at a random
        place, in batches of ``batch_size`` (a last partial one left out): FedALA's sample for
        learning its aggregation weights."""
        indices = self.indices(split)
        size = int(fraction * len(indices))
        start = int(torch.randint(len(indices) - size + 1, (), generator=generator))
        chunk = indices[start : start + size]
        return [
            Batch(*self.data.take(chunk[i : i + batch_size]))
            for i in range(0, len(chunk) - batch_size + 1, batch_size)
        ]

    def epochs(
        self,
        split: str,
        batch_size: int,
        generator: torch.Generator,
        count: int,
        drop_last: bool = False,
        reshuffle: bool = True,
    ) -> Steps:
        """``count`` epochs, each shuffled by ``generator`` — or, without ``reshuffle``, every one in
        the order of the client's persistent iterator (``stream``'s without reshuffling): a sampler
        shuffled once, at construction, as the CAFeMe authors' loaders are. As one ``Steps``: the
        epochs' samples drawn with one gather, not a batch at a time."""
        if not reshuffle:
            order, sizes = self._epoch_order(
                split, batch_size, self.generator(0, TRAIN_STREAM_PURPOSE), drop_last
            )
            return Steps(*self.data.take(order.repeat(count)), sizes * count)
        indices = self.indices(split)
        n = indices.shape[0]
        kept, sizes = epoch_sizes(n, batch_size, drop_last)
        perms = [torch.randperm(n, generator=generator) for _ in range(count)]
        order = torch.cat(perms if kept == n else [perm[:kept] for perm in perms])
        return Steps(*self.data.take(indices.index_select(0, order)), sizes * count)

    def stream(
        self,
        split: str,
        batch_size: int,
        start: int,
        count: int,
        purpose: int = TRAIN_STREAM_PURPOSE,
        reshuffle: bool = True,
    ) -> list[Batch]:
        """Batches ``start`` … ``start + count - 1`` of a persistent iterator over ``split``:
        consecutive, non-overlapping batches of exactly ``batch_size`` (the last partial batch of
        each epoch is dropped), a fresh shuffle every epoch — or, without ``reshuffle``, the first
        epoch's order in every epoch (a sampler shuffled once, at construction: FedLab's
        SubsetSampler in the CAFeMe authors' code) — wrapping around without end."""
        indices = self.indices(split)
        per_epoch = len(indices) // batch_size
        if per_epoch == 0:
            raise FedmetaError(
                f"client {self.id} has {len(indices)} {split} samples, fewer than one batch of "
                f"{batch_size}: lower the batch size or use fewer clients"
            )
        orders: dict[int, torch.Tensor] = {}
        batches = []
        for k in range(start, start + count):
            epoch, position = divmod(k, per_epoch)
            if epoch not in orders:
                order = torch.randperm(
                    len(indices), generator=self.generator(epoch if reshuffle else 0, purpose)
                )
                orders[epoch] = indices.index_select(0, order)
            batches.append(
                Batch(*self.data.take(orders[epoch][position * batch_size : (position + 1) * batch_size]))
            )
        return batches


STREAMS = (
    "stream",
    "stream_fixed",
)  # a ``batches`` setting that reads the persistent iterator (Client.stream)


def map_batches(tree, fn, on_steps=None):
    """``fn`` applied to every batch of a client's data (dicts and lists of batches). ``Steps`` come
    out as their list of batches, mapped with one call on all their samples: ``fn`` on them as one
    batch, or ``on_steps(steps)`` (which returns that batch) where a step's lanes matter."""
    if isinstance(tree, Batch):
        return fn(tree)
    if isinstance(tree, Steps):
        mapped = on_steps(tree) if on_steps else fn(Batch(tree.x, tree.y))
        return Steps(mapped.x, mapped.y, tree.sizes, tree.lanes).batches()
    if isinstance(tree, dict):
        return {key: map_batches(value, fn, on_steps) for key, value in tree.items()}
    if isinstance(tree, list):
        return [map_batches(item, fn, on_steps) for item in tree]
    return tree


def gather(x: torch.Tensor, y: torch.Tensor, tree):
    """The batches of images ``x`` and labels ``y`` that a tree of index batches names."""
    return map_batches(tree, lambda b: b._replace(x=x[b.x], y=None if b.y is None else y[b.y]))


class _Indices:
    """Stands in for a federation's data: ``take`` returns the indices themselves."""

    @staticmethod
    def take(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return indices, indices


INDICES = _Indices()


class Federation:
    """The data tensors (on the training device) and the clients that index them."""

    def __init__(
        self,
        dataset: ImageDataset,
        parts: list[np.ndarray],
        num_new_clients: int,
        held_out_fraction: float,
        seed: int,
        device: torch.device | str = "cpu",
        test_fraction: float = 0.0,
    ):
        if not 0 <= num_new_clients < len(parts):
            raise FedmetaError(
                f"num_new_clients must be between 0 and {len(parts) - 1}, got {num_new_clients}"
            )
        if not 0 < held_out_fraction < 1:
            raise FedmetaError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
        self.x = dataset.x.to(device)
        self.y = dataset.y.to(device)
        self.num_classes = dataset.num_classes
        rng = np.random.default_rng([seed, 0x5E11])
        splits = []
        for client_id, indices in enumerate(parts):
            indices = rng.permutation(indices)
            n_held_out = int(round(len(indices) * held_out_fraction))
            if n_held_out < 2 or len(indices) - n_held_out < 2:  # BatchNorm's batch statistics need 2 samples
                raise FedmetaError(
                    f"client {client_id} has {len(indices)} samples, too few for personalization and held-out "
                    f"splits of at least 2 each (held_out_fraction {held_out_fraction}): use fewer clients"
                )
            splits.append((indices[n_held_out:], indices[:n_held_out], None))
        new_ids = set(rng.choice(len(parts), size=num_new_clients, replace=False).tolist())
        if test_fraction:  # after every draw above: the new-client protocol's splits stay as they were
            splits = _carve_tests(splits, new_ids, test_fraction, seed)
        clients = [
            Client(i, torch.from_numpy(pers), torch.from_numpy(held), seed, self, test)
            for i, (pers, held, test) in enumerate(splits)
        ]
        self.train_clients = [c for c in clients if c.id not in new_ids]
        self.new_clients = [c for c in clients if c.id in new_ids]

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices = indices.to(self.x.device, non_blocking=True)
        return self.x.index_select(0, indices), self.y.index_select(0, indices)

    def gather(self, tree):
        """Index batches (``Client.indexed``, stacked or not, on this federation's device) → the
        batches of images and labels they index; masks and step flags pass through."""
        return gather(self.x, self.y, tree)

    def sample_round(self, round_: int, clients_per_round: int, seed: int) -> list[Client]:
        """The M clients of a round, drawn without replacement by a round-seeded generator."""
        generator = torch.Generator().manual_seed(
            int(np.random.SeedSequence([seed, round_, 0xC11E]).generate_state(1)[0])
        )
        chosen = torch.randperm(len(self.train_clients), generator=generator)[:clients_per_round]
        return [self.train_clients[i] for i in chosen.tolist()]


def _carve_tests(splits: list, new_ids: set, fraction: float, seed: int) -> list:
    """Each training client's test split: ``fraction`` of its samples, drawn by a generator of its
    own, taken out of both of its splits, so training never reads them (the new clients keep all)."""
    rng = np.random.default_rng([seed, 0x7E57])
    carved = []
    for client_id, (pers, held_out, _) in enumerate(splits):
        if client_id in new_ids:
            carved.append((pers, held_out, None))
            continue
        samples = np.concatenate([pers, held_out])
        test = samples[rng.permutation(len(samples))[: int(round(len(samples) * fraction))]]
        pers, held_out = pers[~np.isin(pers, test)], held_out[~np.isin(held_out, test)]
        if len(test) < 2 or len(pers) < 2 or len(held_out) < 2:
            raise FedmetaError(
                f"client {client_id} has {len(samples)} samples, too few for a test split of "
                f"{fraction:g} beside personalization and held-out splits of at least 2 each: use fewer "
                "clients, or evaluation.protocol=new_clients"
            )
        carved.append((pers, held_out, torch.from_numpy(test)))
    return carved


def build_federation(
    dataset: ImageDataset,
    partition_cfg: dict,
    num_clients: int,
    num_new_clients: int,
    held_out_fraction: float,
    seed: int,
    device="cpu",
    test_fraction: float = 0.0,
) -> Federation:
    params = {k: v for k, v in partition_cfg.items() if k != "name"}
    groups = dataset.groups.numpy() if dataset.groups is not None else None
    try:
        parts = partition(partition_cfg["name"], dataset.y.numpy(), groups, num_clients, seed, **params)
    except TypeError as exc:
        raise FedmetaError(f"partition {partition_cfg['name']!r} got an unknown option: {exc}") from None
    return Federation(dataset, parts, num_new_clients, held_out_fraction, seed, device, test_fraction)
