"""The peers benchmark's own parts, on fedmeta's side: the partition it shares with every library,
fedmeta's driver, and the result line the runner reads (the peer libraries themselves are not
installed in CI: their drivers run only where a user points the runner at their checkouts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import peer_common  # noqa: E402
import run as peers_run  # noqa: E402


@pytest.fixture(scope="module")
def experiment(mnist_dir):
    return peers_run.Experiment(data=str(mnist_dir / "mnist.npz"), n_train=800, rounds=2, warmup=1)


def test_the_shared_partition_is_two_shards_a_client_split_three_to_one_and_the_same_every_time(experiment):
    part = peers_run.make_partition(experiment)
    again = peers_run.make_partition(experiment)
    assert part.fingerprint == again.fingerprint and len(part.clients) == experiment.num_clients
    everyone = np.concatenate([np.concatenate([c["train"], c["test"]]) for c in part.clients])
    assert len(everyone) == len(set(everyone.tolist())) == experiment.n_train  # every image once
    for c in part.clients:
        n = len(c["train"]) + len(c["test"])
        assert n == experiment.n_train // experiment.num_clients and len(c["test"]) == n // 4
        # two shards of label-sorted data: a client holds at most the classes two shards straddle
        assert len(set(part.y[np.concatenate([c["train"], c["test"]])].tolist())) <= 4


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_fedmetas_driver_trains_the_peers_cnn_and_prints_the_result_line(experiment, tmp_path):
    part = peers_run.make_partition(experiment)
    peers_run.prepare_fedmeta(experiment, part, tmp_path)
    argv, cwd = peers_run.command_fedmeta("false", "32-true")(experiment, "fedrep", tmp_path)
    done = subprocess.run(
        [sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(peer_common.RESULT_PREFIX))
    result = json.loads(line[len(peer_common.RESULT_PREFIX) :])
    assert result["model"]["params"] == peer_common.EXPECTED_PARAMS
    assert result["model"]["macs_per_sample"] == peer_common.EXPECTED_MACS_PER_SAMPLE
    assert [r["index"] for r in result["rounds"]] == [0, 1] and result["timed_rounds"] == [1]
    assert result["cpu_s_per_round"] > 0 and result["setup"]["cpu_s"] > 0
    # two rounds of FedRep on 2-class clients score well above chance on their own test splits
    assert result["final_accuracy"] > 0.3 and 0 < result["mean_client_accuracy"] <= 1


def test_each_pair_runs_the_peers_in_the_other_order():
    """A B, then B A: neither peer always runs first (a machine warming up, or loaded later, would
    favour one of them)."""
    peers = ["fedmeta-sequential", "pfllib", "flbench"]
    orders = [peers_run.run_order(peers, pair) for pair in range(4)]
    assert orders[0] == orders[2] == peers and orders[1] == orders[3] == peers[::-1]


@pytest.mark.slow  # fedmeta train on all 60,000 images: half a minute
def test_the_train_way_times_fedmeta_trains_own_rounds_and_evaluation(experiment, tmp_path, mnist_dir):
    """``--fedmeta train``: ``fedmeta train`` itself, in the driver's process, its rounds and final
    evaluation on the round clock, its training clients scored as the peers score theirs."""
    argv, cwd = peers_run.command_fedmeta("false", "32-true", "--way", "train", "--batch-norm", "true")(
        experiment, "fedavg", tmp_path
    )
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "FEDMETA_DATA": str(mnist_dir), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(peer_common.RESULT_PREFIX))
    result = json.loads(line[len(peer_common.RESULT_PREFIX) :])
    assert [r["index"] for r in result["rounds"]] == [0, 1] and result["timed_rounds"] == [1]
    assert len(result["evals"]) == 1 and result["cpu_s_per_round"] > 0
    assert "model.batch_norm=true" in result["settings"]["overrides"]
    # every client trains on its 2,250 images beside its test split, as the driver's and the peers' do
    assert "method.train_split=all" in result["settings"]["overrides"]
    assert 0.1 < result["final_accuracy"] <= 1  # two rounds of FedAvg on 20 clients of MNIST
