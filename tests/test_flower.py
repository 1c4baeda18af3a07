"""fedmeta on Flower (the optional extra): the same algorithm through Flower's Simulation Engine
gives the same global model as ``fedmeta train``; the same run across real processes on loopback
(a SuperLink and three SuperNodes) survives a node killed mid-run."""

import csv
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")
pytest.importorskip("ray", reason="Flower's Simulation Engine needs Ray: pip install -e '.[flower]'")

from fedmeta.config import compose  # noqa: E402
from fedmeta.loop import train  # noqa: E402

pytestmark = pytest.mark.slow  # make test-all; make test skips it

SMALL = [  # two rounds: the second reads what the first left on the nodes and the server
    "federation.rounds=2",
    "federation.eval_every=2",
    "personalization.steps=3",
    "federation.num_new_clients=4",
    "evaluation.protocol=both",  # the training clients scored on their nodes, from what each node keeps
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "logger=[]",
]
TWO_ROUNDS = ["federation.rounds=2", "federation.eval_every=2"]


def model_of(run_dir):
    return torch.load(run_dir / "checkpoint.ckpt", weights_only=True)["federation"]["model"]


def simulate(overrides: list[str], *options: str) -> None:
    """``fedmeta flower sim`` in a process of its own: Ray and Flower change the logging and
    process state of whatever runs them, which the other tests share. A node's reply may wait up
    to 600 s: Ray's nodes took over the default 120 s to come up on a busy 2-core machine."""
    done = subprocess.run(
        [sys.executable, "-m", "fedmeta.cli", "flower", "sim", "--timeout", "600", *options, *overrides],
        capture_output=True,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_node_never_gets_two_training_messages_at_once():
    """Flower's Simulation Engine runs a node's messages concurrently, each on a copy of its Context:
    a node holding several of a round's clients must get them in waves, one message each."""
    from types import SimpleNamespace

    from fedmeta.flower import _waves

    nodes = [1, 2, 1, 3, 1, 2]  # _waves reads a message's destination only
    messages = [
        SimpleNamespace(metadata=SimpleNamespace(dst_node_id=n, group_id=str(i))) for i, n in enumerate(nodes)
    ]
    waves = _waves(messages)
    assert [[m.metadata.dst_node_id for m in wave] for wave in waves] == [[1, 2, 3], [1, 2], [1]]
    assert sorted(m.metadata.group_id for wave in waves for m in wave) == sorted(str(i) for i in range(6))


# One method per way a method's data travels through fedmeta.flower (the server-side steps — pFedMe's
# β, FedMeta's Adam, FedDyn's h — are the in-process code, run by the ServerApp unchanged; every
# method's kept state reads back from a node's bytes unchanged: tests/test_lanes.py):
@pytest.mark.parametrize(
    "method",
    [
        "cafeme",  # the model alone, out and back (second-order local work)
        "fedrep",  # a client's kept tensors (its head) on its node between rounds
        "fedala",  # kept state that is not only tensors (a flag beside the top layers and weights)
        "scaffold",  # kept state on the node, and server state sent to every client with the model
        "fedpac",  # server state sent to each client for that client alone (its combined head)
    ],
)
def test_flower_simulation_trains_the_same_model_as_fedmeta_train(method, tmp_path, mnist_dir):
    overrides = [f"method={method}", f"dataset.dir={mnist_dir}", *SMALL]
    alone = train(compose([*overrides, f"output.root={tmp_path / 'alone'}"]), show_progress=False)
    simulate([*overrides, f"output.root={tmp_path / 'flower'}"], "--nodes", "4")
    run = tmp_path / "flower" / "rmnist-shards" / method / "seed0"
    expected, got = model_of(tmp_path / "alone" / "rmnist-shards" / method / "seed0"), model_of(run)
    assert expected.keys() == got.keys()
    assert all(torch.allclose(expected[k].float(), got[k].float(), atol=1e-6) for k in expected)
    import json

    summary = json.loads((run / "summary.json").read_text())
    assert abs(summary["accuracy"] - alone["accuracy"]) < 1e-6 and summary["new_clients"] == 4
    trained, trained_alone = summary["training_clients"], alone["training_clients"]
    assert trained["clients"] == trained_alone["clients"] > 0
    assert abs(trained["accuracy"] - trained_alone["accuracy"]) < 1e-6
    assert (run / "metrics.csv").read_text().count("\n") == 3 and (run / "curves.csv").exists()


def test_under_one_step_size_rule_the_nodes_personalize_at_the_servers_candidates(tmp_path, mnist_dir):
    """``lr_rule=selected`` on Flower: every candidate step size reaches the nodes (a node once used
    its own), so the choice and the score are fedmeta train's."""
    overrides = [
        "method=fedavg_ft",
        "personalization.lr_rule=selected",
        "personalization.select_clients=3",
        f"dataset.dir={mnist_dir}",
        *SMALL,
    ]
    alone = train(compose([*overrides, f"output.root={tmp_path / 'alone'}"]), show_progress=False)
    simulate([*overrides, f"output.root={tmp_path / 'flower'}"], "--nodes", "4")
    import json

    summary = json.loads(
        (tmp_path / "flower" / "rmnist-shards" / "fedavg_ft" / "seed0" / "summary.json").read_text()
    )
    expected = json.loads(json.dumps(alone["lr_selection"]))  # its keys as the file writes them
    assert len(set(expected.values())) > 1  # the candidates score differently: the step size matters
    assert summary["lr_selection"] == pytest.approx(expected, abs=1e-6)
    assert summary["personalization_lr"] == alone["personalization_lr"]
    assert abs(summary["accuracy"] - alone["accuracy"]) < 1e-6


TINY_FEDERATION = [
    "federation.num_clients=9",
    "federation.num_new_clients=3",
    "federation.clients_per_round=3",
    "federation.rounds=3",
    "federation.eval_every=3",
    "personalization.steps=3",
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "logger=[]",
]


def test_deployment_on_loopback_survives_a_killed_node(tmp_path, mnist_dir, monkeypatch):
    """A SuperLink and three SuperNodes as real processes on 127.0.0.1: CAFeMe runs 2 rounds on
    them with one node killed during the second — its clients drop out (no reply within the
    timeout), the other nodes' clients carry the round, the run finishes and writes its summary
    from the new clients that remain. (One run of two rounds: every message starts a ClientApp
    process, and each exchange after the kill waits out the timeout.)"""
    import json
    import time

    from fedmeta.flower import Deployment

    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    deployment = Deployment(nodes=3, folder=tmp_path, port=29391)
    deployment.start()
    try:
        folder = tmp_path / "runs" / "rmnist-shards" / "cafeme" / "seed0"
        deployment.submit(
            ["method=cafeme", f"output.root={tmp_path / 'runs'}", *TINY_FEDERATION, *TWO_ROUNDS],
            timeout=75,
        )  # a node starts a process per message: ~30 s on a busy 2-core machine
        deadline = time.monotonic() + 480  # bounded: the test stops by itself
        while not (folder / "summary.json").exists():
            assert time.monotonic() < deadline, (
                f"no summary after 480 s: {sorted(p.name for p in tmp_path.glob('*.log'))}"
            )
            rounds = (
                (folder / "metrics.csv").read_text().count("\n") - 1
                if (folder / "metrics.csv").exists()
                else 0
            )
            if rounds == 1 and deployment.supernodes[2].poll() is None:
                deployment.kill(deployment.supernodes[2])  # during round 2
            time.sleep(0.5)
        rows = list(csv.DictReader(open(folder / "metrics.csv")))
        assert [int(r["round"]) for r in rows] == [1, 2]
        assert int(rows[1]["clients_dropped"]) >= 1  # the killed node's clients
        from fedmeta.assemble import build, make_fabric

        cfg = compose(["method=cafeme", *TINY_FEDERATION, *TWO_ROUNDS])
        federation, _ = build(make_fabric(cfg), cfg)
        alive = [c.id for c in federation.new_clients if c.id % 3 != 2]  # node 2 held ids ≡ 2 (mod 3)
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["rounds"] == 2 and summary["new_clients"] == len(alive) and summary["accuracy"] > 0
        # one message per client and round, one per new client whose node was still listed
        traffic = json.loads((folder / "flower.json").read_text())
        assert 2 * 3 + len(alive) <= traffic["messages"] <= 2 * 3 + 3
        assert traffic["model_bytes_sent"] > traffic["update_bytes_received"] > 0
    finally:
        deployment.stop()
    assert all(p.poll() is not None for p in deployment.processes)


def test_local_differential_privacy_clips_every_update(tmp_path, mnist_dir):
    """Flower's LocalDpMod on the nodes (``dp``): with the noise off, every update that leaves a
    node is clipped to the norm, so two rounds move the global model by at most twice it (an
    average of vectors in a ball stays in the ball)."""
    from fedmeta.assemble import build, make_fabric

    clip = 0.01
    overrides = [
        "method=fedavg_ft",
        f"dataset.dir={mnist_dir}",
        *SMALL,
        f"output.root={tmp_path}",
    ]
    cfg = compose(overrides)
    _, algorithm = build(make_fabric(cfg), cfg)
    start = {k: v.clone() for k, v in algorithm.model.state_dict().items()}
    simulate(overrides, "--nodes", "2", "--dp", str(clip), "0", "1", "1e-5")

    def moved(run_dir) -> float:
        end = model_of(run_dir / "rmnist-shards" / "fedavg_ft" / "seed0")
        return torch.sqrt(sum(((end[k] - start[k]) ** 2).sum() for k in start)).item()

    train(compose([*overrides[:-1], f"output.root={tmp_path / 'alone'}"]), show_progress=False)
    assert moved(tmp_path / "alone") > 10 * clip  # without the mod, the same two rounds move it far more
    assert 0 < moved(tmp_path) <= 2 * clip + 1e-6
