"""Checkpoints: a run killed with SIGKILL and resumed ends bit-exactly as the uninterrupted run;
corrupt or foreign checkpoints and finished runs are refused in one line; divergence keeps the
last good checkpoint."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fedmeta.checkpoint import identity, identity_differences
from fedmeta.cli import main
from fedmeta.config import compose
from fedmeta.errors import FedmetaError
from fedmeta.loop import train

# CAFeMe as the authors' code: per-client Adam state must survive the restart too.
RUN = [
    "method=cafeme",
    "variant=authors",
    "federation.rounds=4",
    "federation.checkpoint_every=2",
    "federation.eval_every=2",
    "federation.num_new_clients=4",
    "personalization.steps=5",
    "wandb.mode=disabled",
]


def fedmeta(*args, root, data, wait=True, wandb_mode="disabled"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDMETA_DATA": str(data), "WANDB_MODE": wandb_mode}
    command = [sys.executable, "-m", "fedmeta.cli", "train", *RUN, f"output.root={root}", *args]
    return (
        subprocess.run(command, env=env, capture_output=True, text=True)
        if wait
        else subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    )


def run_dir(root):
    return root / "rmnist-shards" / "cafeme-authors" / "seed0"


def rounds_logged(directory) -> int:
    path = directory / "metrics.csv"
    return len(list(csv.DictReader(open(path)))) if path.exists() else 0


@pytest.mark.slow
def test_killed_run_resumes_to_exactly_the_same_result(tmp_path, mnist_dir):
    # With the loggers a user gets by default (TensorBoard and offline W&B): the killed process's
    # W&B run is still "in use" when the resumed one starts.
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert fedmeta(root=straight, data=mnist_dir).returncode == 0

    process = fedmeta("wandb.mode=offline", root=killed, data=mnist_dir, wait=False, wandb_mode="offline")
    while rounds_logged(run_dir(killed)) < 3 and process.poll() is None:  # killed during round 4, the last
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (run_dir(killed) / "summary.json").exists()
    assert torch.load(run_dir(killed) / "checkpoint.ckpt", weights_only=True)["round"] == 2

    resumed = fedmeta(
        "wandb.mode=offline", "output.resume=true", root=killed, data=mnist_dir, wandb_mode="offline"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr and list((run_dir(killed) / "wandb").glob("offline-run-*"))
    assert list((run_dir(killed) / "tensorboard").rglob("events.out.tfevents.*"))
    a, b = (json.loads((run_dir(r) / "summary.json").read_text()) for r in (straight, killed))
    assert b["resumed_at_round"] == 2 and a["accuracy"] == b["accuracy"] and a["curve"] == b["curve"]
    ckpt_a, ckpt_b = (
        torch.load(run_dir(r) / "checkpoint.ckpt", weights_only=True) for r in (straight, killed)
    )
    model_a, model_b = ckpt_a["federation"]["model"], ckpt_b["federation"]["model"]
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    states_a, states_b = (c["federation"]["client_states"] for c in (ckpt_a, ckpt_b))
    assert states_a.keys() == states_b.keys() and len(states_a) > 5
    losses = [
        [row["train_loss"] for row in csv.DictReader(open(run_dir(r) / "metrics.csv"))]
        for r in (straight, killed)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 4

    # Resuming a finished run is refused: its results are never replaced unless asked.
    again = fedmeta("output.resume=true", root=killed, data=mnist_dir)
    assert again.returncode == 2 and "already holds a finished run" in again.stderr


def test_foreign_and_corrupt_checkpoints_are_refused(tmp_path, mnist_dir, capsys):
    small = ["model.conv_channels=[8,16]", "model.dense_units=[32]", "federation.num_new_clients=1"]
    base = [*RUN, *small, "federation.rounds=2", f"dataset.dir={mnist_dir}", f"output.root={tmp_path}"]
    assert main(["train", *base]) == 0
    directory = run_dir(tmp_path)
    (directory / "summary.json").unlink()  # as if it had been killed after its last checkpoint

    assert main(["train", *base, "output.resume=true", "method.inner_lr=0.5"]) == 2
    assert "belongs to another experiment (method.inner_lr: 0.05 there, 0.5 here)" in capsys.readouterr().err

    (directory / "checkpoint.ckpt").write_bytes(b"not a checkpoint")
    assert main(["train", *base, "output.resume=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is corrupt or not a fedmeta checkpoint" in err[0]
    assert not (directory / "summary.json").exists()


@pytest.mark.parametrize(
    "setting",
    [
        "federation.vectorize=true",
        "federation.vectorize_lanes=2",
        "federation.lane_buckets=2",
        "federation.client_threads=2",
        "federation.capture=static",
        "federation.rounds=7",
        "federation.checkpoint_every=3",
    ],
)
def test_how_fast_or_long_a_run_goes_is_not_what_it_computes_so_it_may_resume_changed(setting):
    # lane_buckets came after checkpoints of the CPU grid were written (their identity lacks it), and
    # others were written while it still counted (theirs holds it): both continue, with it set or not.
    written = identity(compose(["method=fedavg"]))
    assert identity_differences(written, compose(["method=fedavg", setting])) == []
    while_it_counted = written | {"federation": written["federation"] | {setting[11:].split("=")[0]: 1}}
    assert identity_differences(while_it_counted, compose(["method=fedavg", setting])) == []
    assert identity_differences(written, compose(["method=fedavg", "method.local_epochs=2"]))


def test_divergence_keeps_the_last_good_checkpoint(tmp_path, mnist_dir, monkeypatch):
    from fedmeta.algorithms import FedAvg

    honest = FedAvg.run_client

    def diverging_in_round_3(self, client, round_):
        update = honest(self, client, round_)
        if round_ == 3:
            update.loss = float("nan")
        return update

    monkeypatch.setattr(FedAvg, "run_client", diverging_in_round_3)
    cfg = compose(
        [
            "method=fedavg",
            "method.local_epochs=1",
            "model.conv_channels=[8,16]",
            "model.dense_units=[32]",
            "federation.clients_per_round=2",
            "federation.rounds=6",
            "federation.checkpoint_every=2",
            "wandb.mode=disabled",
            f"dataset.dir={mnist_dir}",
            f"output.root={tmp_path}",
        ]
    )
    with pytest.raises(
        FedmetaError,
        match=r"round 3: client \d+ produced a non-finite loss .*the last good checkpoint "
        r"\(round 2\) is kept in .*resume with output.resume=true",
    ):
        train(cfg, show_progress=False)
    directory = tmp_path / "rmnist-shards" / "fedavg" / "seed0"
    assert torch.load(directory / "checkpoint.ckpt", weights_only=True)["round"] == 2
    assert not (directory / "summary.json").exists()


def test_a_setting_added_since_a_run_was_written_counts_at_its_default():
    """A run written before ``model.kind`` existed (the CNN, as every run then) is the experiment of
    a config at the default, for resume, re-scoring and a campaign's carry-in alike; a config that
    asks for another value of the new key is another experiment."""
    from fedmeta.checkpoint import differences, identity
    from fedmeta.config import compose

    ours = identity(compose([]))
    written_before = {**ours, "model": {k: v for k, v in ours["model"].items() if k not in ("kind", "width")}}
    assert differences(written_before, ours) == []
    resnet = identity(compose(["model.kind=resnet18"]))
    assert differences(written_before, resnet) == ["model.kind: None there, 'resnet18' here"]
    assert differences(written_before, resnet, added_ok=True) == []
