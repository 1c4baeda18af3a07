"""Two CPU processes (Fabric DDP, gloo) split each round's clients and all-gather their updates:
the global model is the single-process one, bit for bit — per-client state included."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # make test-all; make test skips it


def train(root, data, devices: int, method: str, *extra: str):
    strategy = "ddp" if devices > 1 else "auto"
    command = [
        sys.executable,
        "-m",
        "fedmeta.cli",
        "train",
        f"method={method}",
        "federation.rounds=2",
        "federation.eval_every=2",
        "federation.num_new_clients=3",
        "personalization.steps=2",
        "wandb.mode=disabled",
        "model.conv_channels=[8,16]",  # bit equality does not depend on the width
        "model.dense_units=[32]",
        "fabric.accelerator=cpu",
        f"fabric.devices={devices}",
        f"fabric.strategy={strategy}",
        f"output.root={root}",
        *extra,
    ]
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", "FEDMETA_DATA": str(data)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


# FedAvg with simulated drop-outs: failed clients' reasons travel between ranks too, the same ones fail
@pytest.mark.parametrize(
    "method,extra",
    [
        ("cafeme", []),
        ("fedavg", ["federation.client_failure_rate=0.4", "method.local_epochs=1"]),
        ("ifca", ["method.local_epochs=1"]),
        ("fedrep", ["method.head_epochs=1"]),
    ],
)
def test_two_processes_compute_the_single_process_model(tmp_path, mnist_dir, method, extra):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, mnist_dir, 1, method, *extra)
    done = train(two, mnist_dir, 2, method, *extra)
    assert done.stdout.count("new-client accuracy") == 1  # only the main process reports
    assert "deprecated" not in done.stderr, done.stderr[-2000:]  # nothing that reads like an error

    run = f"rmnist-shards/{method}/seed0"
    models = [
        torch.load(root / run / "checkpoint.ckpt", weights_only=True)["federation"]["model"]
        for root in (one, two)
    ]
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][name], models[1][name]) for name in models[0])
    summaries = [json.loads((root / run / "summary.json").read_text()) for root in (one, two)]
    assert summaries[1]["world_size"] == 2 and summaries[0]["world_size"] == 1
    # 3 new clients over 2 ranks, gathered back in order: the same personalization curves
    assert summaries[0]["curve"] == summaries[1]["curve"] and summaries[0]["accuracy"] > 0
