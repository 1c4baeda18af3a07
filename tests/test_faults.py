"""Fault tolerance: a client that raises or sends non-finite numbers is dropped from its round
with a warning and the run goes on; a simulated failure rate drops clients reproducibly."""

import csv
import logging

import pytest
import torch

from fedmeta.algorithms import FedAvg
from fedmeta.assemble import setup
from fedmeta.config import compose
from fedmeta.errors import FedmetaError
from fedmeta.loop import train
from fedmeta.rounds import federated_round


def small(tmp_path, mnist_dir, *overrides):
    return compose(
        [
            "method=fedavg",
            "method.local_epochs=1",
            "federation.num_new_clients=4",
            "personalization.steps=3",
            "wandb.mode=disabled",
            f"dataset.dir={mnist_dir}",
            f"output.root={tmp_path}",
            *overrides,
        ]
    )


def test_failing_and_nonfinite_clients_are_dropped_not_fatal(tmp_path, mnist_dir, monkeypatch):
    cfg = small(tmp_path, mnist_dir)
    _, federation, algorithm = setup(cfg)
    honest = FedAvg.run_client
    clients = federation.sample_round(1, 5, cfg.seed)
    broken, poisoned = clients[1].id, clients[3].id

    def faulty(self, client, round_):
        if client.id == broken:
            raise RuntimeError("connection reset")
        update = honest(self, client, round_)
        if client.id == poisoned:
            update.params = {k: torch.full_like(v, float("inf")) for k, v in update.params.items()}
        return update

    monkeypatch.setattr(FedAvg, "run_client", faulty)
    before = {k: v.clone() for k, v in algorithm.global_params().items()}
    outcome = federated_round(algorithm, federation, 1, 5, cfg.seed)
    assert len(outcome.dropped) == 2
    assert any(str(broken) in line and "connection reset" in line for line in outcome.dropped)
    assert any(str(poisoned) in line and "non-finite" in line for line in outcome.dropped)
    after = algorithm.global_params()
    assert all(torch.isfinite(p).all() for p in after.values())  # the aggregate of the 3 good clients
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # every client raising is not a fault of one client: the run stops in one line
    monkeypatch.setattr(FedAvg, "run_client", lambda self, client, round_: 1 / 0)
    with pytest.raises(FedmetaError, match="round 2: every client failed .*ZeroDivisionError"):
        federated_round(algorithm, federation, 2, 5, cfg.seed)


@pytest.mark.slow
def test_failure_rate_drops_clients_reproducibly_and_still_learns(tmp_path, mnist_dir, caplog):
    cfg = small(
        tmp_path,
        mnist_dir,
        "federation.rounds=6",
        "federation.eval_every=6",
        "federation.client_failure_rate=0.4",
        "personalization.steps=10",
    )
    with caplog.at_level(logging.WARNING, logger="fedmeta"):
        summary = train(cfg, show_progress=False)
    rows = list(csv.DictReader(open(tmp_path / "rmnist-shards" / "fedavg" / "seed0" / "metrics.csv")))
    dropped = [int(r["clients_dropped"]) for r in rows]
    assert 3 <= sum(dropped) <= 21 and len(rows) == 6  # of 30 client-rounds, at a rate of 0.4
    assert sum("dropped out, simulated" in r.message for r in caplog.records) == sum(dropped)
    assert summary["accuracy"] > 0.3  # chance is 0.1: the surviving clients still train the model

    # the same seed drops the same clients
    _, federation, algorithm = setup(cfg)
    again = [
        len(federated_round(algorithm, federation, r, 5, cfg.seed, failure_rate=0.4).dropped)
        for r in range(1, 7)
    ]
    assert again == dropped
