"""What a lockstep round launches (``fedmeta bench --count``) never rises more than 10 % over the
committed results/census.json. Counts are deterministic — the same operators for the same code —
and do not depend on the layers' widths, so the round is recounted on a model a hundred times
narrower, in seconds rather than minutes. Not a timed test: nothing here depends on the machine."""

import json
from pathlib import Path

import pytest

from fedmeta import census
from fedmeta.census import HostClock, count_round, plan
from fedmeta.config import load_mapping

ROOT = Path(__file__).resolve().parent.parent
NARROW = [
    "model.conv_channels=[2,3]",
    "model.dense_units=[5]",
    "model.modulator.before_mean=[4,6]",
    "model.modulator.after_mean=[7]",
]
RISE = 1.10


def committed(dataset: str, method: str) -> dict:
    rows = json.loads((ROOT / "results" / "census.json").read_text())["rows"]
    return next(r for r in rows if (r["dataset"], r["partition"], r["method"]) == (dataset, "shards", method))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cafeme", "fedavg_ft"])  # the paper's method, and its costliest baseline
def test_a_rounds_kernels_do_not_rise_over_the_committed_census(method, mnist_dir, monkeypatch):
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    bench = load_mapping(ROOT / "configs" / "bench.yaml", "the bench config")
    [overrides] = plan(bench, ["rmnist"], [method], NARROW)
    row = count_round(overrides, bench.census.warmup_rounds, count_flops=False, timed_rounds=0)
    kept = committed("rmnist", method)
    assert row["fallback"] is None and row["clients"] == "vmap"  # the path the card runs was counted
    for key in ("kernels", "kernels_recorded", "kernels_eager", "host_reads"):
        assert row[key] <= RISE * kept[key], (
            f"{method}: {key} {row[key]} against {kept[key]} committed: find the new kernels "
            "(make bench COUNT=1) or, if they are needed, recount and commit results/census.json"
        )


def test_the_host_clock_times_each_places_outermost_call_once(monkeypatch):
    """A draw that calls another draw is host time once, not twice."""
    clock, now = HostClock(), [0.0]
    monkeypatch.setattr(census.time, "perf_counter", lambda: now[0])

    def draw(depth):
        now[0] += 1.0
        return timed(depth - 1) if depth else None

    timed = clock.marking("host", draw)
    timed(2)  # three nested calls, a second each: 3 s, not 3 + 2 + 1
    clock.marking("recorded", lambda: now.__setitem__(0, now[0] + 0.5))()
    assert clock.seconds == {"host": 3.0, "recorded": 0.5}
