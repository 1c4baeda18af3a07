"""``fedmeta bench --count``: what one lockstep round of stacked seeds runs, counted on the CPU.

On a GPU a round's time follows the number of kernels it launches and the bytes they move far more
than its FLOPs (thousands of small kernels, each a few microseconds). Those are properties of the
computation, not of the device, so they are counted here, on the CPU, in seconds, and compared
from change to change: a round of the campaign's configuration (clients vmapped, seeds stacked,
inputs padded to the fixed layout a recording replays) runs under a dispatch mode that sees every
operator below vmap and autograd — the operators that really run. For each it records:

- ``ops``: every dispatched operator, and ``kernels``: those that launch work (not views,
  aliases, shape queries or bare allocations);
- where it ran: ``recorded`` (inside the computation a CUDA graph records and replays as one
  launch), ``eager`` (device work around it: screening, aggregation, what clients keep) or
  ``host`` (the clients' batch draws and their stacking, on host tensors even on a GPU: no kernels
  there, but host time);
- ``gbytes``: bytes read and written, the tensors each kernel takes and returns (an upper bound of
  what the device moves: an operator that reads a tensor twice counts it once, a fused one once),
  except that a gather (a batch indexed out of the stacked data set) reads only what it selects;
- ``host_reads``: reads of a computed value by the host (each a device sync on a GPU);
- ``gflop``: the same round's FLOPs, counted one client at a time (vmap's counter over-counts
  grouped convolutions' backward).

The counts do not depend on the layers' widths (the same operators run on wider tensors); bytes
and FLOPs do. ``results/census.json`` holds the paper's methods at their real widths;
tests/test_census.py holds every method's kernel count to it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fedmeta.bench import HostReads, flop_counter, run_isolated, stacked_runs

PLACES = ("recorded", "eager", "host")
TOP_OPS = 12  # the most frequent kernels listed per row: where the next cut is
TIMED_ROUNDS = 3  # rounds whose host work is timed (the median)
# Operators that launch no work of their own: allocations (filled by the kernel that writes them),
# shape and metadata queries, and aliases the view check does not catch.
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "_local_scalar_dense",
    "set_",
    "resize_",
    "_has_compatible_shallow_copy_type",
    "_unsafe_view",
    "promote_types",
}


# Operators that read only the elements they select from their first argument (a batch drawn from a
# stacked data set of many megabytes): counted as reading as much of it as they write.
GATHERS = {"index", "index_select", "gather", "embedding"}


def launches_kernel(func) -> bool:
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


class Census(TorchDispatchMode):
    """Counts operators, kernels and bytes, split by whether they run inside the recorded computation."""

    def __init__(self):
        super().__init__()
        self.place = PLACES[1]
        self.ops = Counter()
        self.kernels = Counter()
        self.bytes = Counter()
        self.names: Counter = Counter()  # recorded kernels by operator name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        place = self.place
        self.ops[place] += 1
        if launches_kernel(func):
            self.kernels[place] += 1
            source = _bytes(out) if func.overloadpacket.__name__ in GATHERS else _bytes(args[:1])
            self.bytes[place] += source + _bytes((args[1:], kwargs)) + _bytes(out)
            if place != "host":
                self.names[func.overloadpacket.__name__] += 1
        return out

    @contextmanager
    def at(self, place: str):
        outer, self.place = self.place, place
        try:
            yield
        finally:
            self.place = outer

    def marking(self, place: str, fn):
        """``fn``, its operators counted as ``place``."""

        def marked(*args, **kwargs):
            with self.at(place):
                return fn(*args, **kwargs)

        return marked


class HostClock:
    """Seconds a round spends in each place, the outermost call timed (a draw inside a draw once)."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self._depth = 0

    def marking(self, place: str, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            tick = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds[place] += time.perf_counter() - tick

        return timed


@contextmanager
def watching(engine, runs, marking):
    """What the recording would hold marked recorded, the batch draws and their stacking host work
    (``marking(place, fn)`` wraps each): the engine's and the algorithms' methods wrapped on the
    instances, then unwrapped."""
    targets = [
        (engine.capture, "run", "recorded"),
        (engine, "_indices", "host"),
        *((run.algorithm, "draw", "host") for run in runs),
    ]
    for instance, name, place in targets:
        setattr(instance, name, marking(place, getattr(instance, name)))
    try:
        yield
    finally:
        for instance, name, _ in targets:
            del instance.__dict__[name]  # the class's method again


def count_round(
    overrides: list[str], warmup: int = 1, count_flops: bool = True, timed_rounds: int = TIMED_ROUNDS
) -> dict:
    """One row: the counts of one lockstep round (all seeds together) after ``warmup`` rounds, and
    the host work of ``timed_rounds`` more (their median; none: ``host_ms`` None), in the calling
    process (``fedmeta.bench.run_isolated`` gives it a fresh one)."""
    from fedmeta.assemble import make_engine
    from fedmeta.engine import Engine
    from fedmeta.fastest import hardware_name
    from fedmeta.rounds import federated_rounds

    cfg, fabric, runs = stacked_runs(overrides)
    engine = make_engine(cfg, fabric.device)
    clients = cfg.federation.clients_per_round
    for r in range(1, warmup + 1):
        federated_rounds(runs, r, clients, engine=engine)

    census = Census()
    with watching(engine, runs, census.marking), census, HostReads() as reads:
        federated_rounds(runs, warmup + 1, clients, engine=engine)
    host_ms = []
    for r in range(warmup + 2, warmup + 2 + timed_rounds):  # host work, timed without the census
        clock = HostClock()
        with watching(engine, runs, clock.marking):
            federated_rounds(runs, r, clients, engine=engine)
        host_ms.append(1e3 * clock.seconds["host"])
    gflop = None
    if count_flops:
        with flop_counter() as flops:
            federated_rounds(runs, warmup + 2 + timed_rounds, clients, engine=Engine())
        gflop = flops.get_total_flops() / 1e9
    return {
        "dataset": cfg.dataset.name,
        "partition": cfg.partition.name,
        "method": cfg.method.name,
        "variant": cfg.variant,
        "overrides": list(overrides),  # the widths among them: bytes and FLOPs are those widths'
        "seeds": len(runs),
        "clients": "vmap" if engine.vectorize else "sequential",
        "fallback": engine.describe()["fallback"],
        "ops": census.ops["recorded"] + census.ops["eager"],
        "kernels": census.kernels["recorded"] + census.kernels["eager"],  # the device's: not the host's
        **{f"kernels_{place}": census.kernels[place] for place in PLACES[:2]},
        "host_ops": census.ops["host"],
        "host_ms": round(statistics.median(host_ms), 2) if host_ms else None,  # draws, stacking: timed here
        "hardware": hardware_name(fabric.device),
        "gbytes": (census.bytes["recorded"] + census.bytes["eager"]) / 1e9,
        **{f"gbytes_{place}": census.bytes[place] / 1e9 for place in PLACES[:2]},
        "host_reads": reads.count,
        "gflop": gflop,
        "top_kernels": dict(census.names.most_common(TOP_OPS)),
    }


def plan(bench, datasets: list[str] | None, methods: list[str] | None, extra: list[str]) -> list[list[str]]:
    """The overrides of each census row: every bench data set × method, seeds stacked, clients
    vmapped, inputs in the recorded layout (``census`` in configs/bench.yaml)."""
    seeds = f"seeds=[{','.join(str(s) for s in bench.census.seeds)}]"
    return [
        [*setting, f"method={method}", seeds, *bench.census.overrides, *extra]
        for name, setting in bench.datasets.items()
        if not datasets or name in datasets
        for method in methods or bench.methods
    ]


def run(rows: list[list[str]], out: Path, warmup: int, count_flops: bool = True) -> list[dict]:
    """Each row counted in a fresh process, printed, and written to ``out`` as it finishes (a row of
    another data set or method already there is kept)."""
    document = json.loads(out.read_text()) if out.exists() else {}
    kept = document.get("rows", [])
    print(
        f"{'data set':9s} {'method':10s} {'seeds':>5s} {'ops':>7s} {'kernels':>7s} {'recorded':>8s} "
        f"{'eager':>6s} {'GB':>7s} {'GB eager':>8s} {'reads':>5s} {'host ms':>7s} {'GFLOP':>7s}"
    )
    counted = []
    for overrides in rows:
        row = run_isolated(count_round, overrides, warmup, count_flops)
        counted.append(row)
        print(
            f"{row['dataset']:9s} {row['method']:10s} {row['seeds']:5d} {row['ops']:7d} {row['kernels']:7d} "
            f"{row['kernels_recorded']:8d} {row['kernels_eager']:6d} {row['gbytes']:7.1f} "
            f"{row['gbytes_eager']:8.3f} {row['host_reads']:5d} {row['host_ms'] or float('nan'):7.2f} "
            + (f"{row['gflop']:7.1f}" if row["gflop"] is not None else f"{'-':>7s}"),
            flush=True,
        )
        if row["fallback"]:
            print(f"    fell back: {row['fallback']}")
        key = lambda r: (r["dataset"], r["partition"], r["method"], r["variant"])  # noqa: E731
        kept = [r for r in kept if key(r) != key(row)] + [row]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({**document, "rows": kept}, indent=1) + "\n")
        os.replace(tmp, out)
    print(f"wrote {out}")
    return counted
