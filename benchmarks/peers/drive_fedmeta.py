"""Run the benchmark's experiment in fedmeta and time its rounds, as the peers' drivers do theirs.

Run by benchmarks/peers/run.py in fedmeta's own venv, with the partition run.py wrote
(WORK/fedmeta/partition.npz: the normalised images, labels and each client's train/test positions).

fedmeta is driven through its own building blocks, not its CLI, because the experiment fixes what
the CLI draws itself: the clients are the partition's 20 (each its 75 % train split as the data it
trains on, and its 25 % test split as the test split fedmeta's training-clients protocol keeps out of
training), and all 20 take part in training (``federation.num_new_clients=0``). Everything else is
what ``fedmeta train`` runs: the config composed from configs/ with the experiment's overrides, the
algorithm and model its registry builds (``model.batch_norm=false``: FedAvgCNN's plain CNN), Fabric's
precision plugin, the engine of ``federation.vectorize`` (one client at a time, or vmapped),
``federated_round`` and ``evaluate_on_ranks``.

``--way train`` times fedmeta's own ``fedmeta train`` instead, run in-process (``fedmeta.cli.main``)
as a user runs it: its RMNIST data path with no rotation (MNIST's 60,000 training images,
standardized as the partition's), its own shards partition into the experiment's 20 clients of
3,000 images (2 label shards each, a 75 % / 25 % split: the same sizes, its own draw of them), the
default model with its batch norms (``--batch-norm false``: the peers' FedAvgCNN), its loop,
metrics, checkpoints and progress bar; the round clock wraps the rounds ``fedmeta.loop`` trains and
the evaluation it runs at the end. Its accuracy is the same protocol on its own clients.

The accuracy is the peers' protocol, fedmeta's ``evaluation.protocol=training_clients``: every
training client's test split scored with the model it has after the last round — the global model,
or its kept model where its method keeps one (FedRep: the global body with its own head) —
sample-weighted over the 20 clients, as PFLlib and FL-bench print it. Prints one line:
PEER_RESULT {json}.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402

CLOCK = pc.RoundClock()  # as early as possible: the driver's own start


def overrides(a) -> list[str]:
    common = [
        "dataset=rmnist",  # the model's shape (28×28 grey, 32-64 conv, 512 dense); the data is replaced below
        "model.batch_norm=false",
        f"method={a.method}",
        f"method.local_lr={a.lr}",
        f"method.batch_size={a.batch_size}",
        "method.momentum=0.0",
        "method.train_split=pers",
        # the federation below: these clients, all training, scored as the peers score them
        f"federation.num_clients={a.num_clients}",
        "federation.num_new_clients=0",
        "evaluation.protocol=training_clients",
        f"federation.clients_per_round={a.clients_per_round}",
        f"federation.vectorize={a.vectorize}",
        f"fabric.precision={a.precision}",
        f"seed={a.seed}",
        "wandb.mode=disabled",
        "logger=[]",
    ]
    if (
        a.method == "fedrep"
    ):  # PFLlib's defaults: one head epoch, then one body epoch; the head the last Linear
        return [*common, "method.head_epochs=1", "method.body_epochs=1", "method.head=classifier"]
    return [*common, f"method.local_epochs={a.local_epochs}"]


def train_overrides(a, root: str) -> list[str]:
    """``fedmeta train``'s own data, partition and model, sized as the experiment (``--way train``)."""
    held_out = "federation.held_out_fraction=0.25"  # the 25 % test split of each client
    common = [
        o
        for o in overrides(a)
        if not o.startswith(("dataset=", "model.batch_norm", "logger", "method.train_split"))
    ]
    return [
        *common,
        # the 75 % left beside the test split, every sample of it, as the peers' clients train: pers
        # would also leave out the held-out quarter fedmeta keeps for new clients' procedure
        "method.train_split=all",
        "dataset=rmnist",
        # the driver runs in its work folder: the data folder a user's run reads, else the repository's
        f"dataset.dir={os.environ.get('FEDMETA_DATA') or Path(__file__).resolve().parents[2] / 'data'}",
        "dataset.options.degrees_per_group=0",  # MNIST itself, standardized by its mean and deviation
        "partition=shards",
        held_out,
        f"model.batch_norm={a.batch_norm}",
        f"federation.rounds={a.rounds}",
        f"federation.eval_every={a.rounds}",
        "federation.checkpoint_minutes=0",
        "evaluation.protocol=training_clients",
        "logger=[]",
        f"output.root={root}",
        "output.overwrite=true",
    ]


def train_way(a) -> dict:
    """``fedmeta train`` in this process, its rounds and final evaluation on the round clock."""
    import json
    import tempfile

    import fedmeta.loop as loop
    from fedmeta.cli import main as fedmeta_main

    def clocked(function, start, end):
        def call(*args, **kwargs):
            start()
            try:
                return function(*args, **kwargs)
            finally:
                end()

        return call

    loop.federated_rounds = clocked(loop.federated_rounds, CLOCK.round_start, CLOCK.round_end)
    loop.evaluate_on_ranks = clocked(
        loop.evaluate_on_ranks, CLOCK.eval_start, lambda: CLOCK.eval_end("training clients' test splits")
    )
    with tempfile.TemporaryDirectory() as root:
        settings = train_overrides(a, root)
        status = fedmeta_main(["train", *settings])
        if status:
            raise SystemExit(f"fedmeta train exited {status}")
        summary = json.loads(next(Path(root).glob("*/*/seed*/summary.json")).read_text())
    training = summary.get("training_clients") or {}
    return {
        "final_accuracy": training.get("weighted_accuracy"),
        "mean_client_accuracy": training.get("accuracy"),
        "settings": {"overrides": settings, "way": "fedmeta train"},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="partition.npz written by run.py")
    ap.add_argument("--method", choices=("fedavg", "fedrep"), required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--num-clients", type=int, default=20)
    ap.add_argument("--clients-per-round", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vectorize", choices=("false", "true"), default="false")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--way", choices=("rounds", "train"), default="rounds")
    ap.add_argument("--batch-norm", choices=("true", "false"), default="true", help="--way train's model")
    a = ap.parse_args()
    pc.limit_threads()
    if a.way == "train":
        result = {"peer": "fedmeta", "method": a.method, "status": "ok", "rounds_requested": a.rounds}
        result |= train_way(a)
        pc.emit({**result, **pc.summarize(CLOCK, a.warmup, a.rounds), "env": pc.environment()}, CLOCK)
        return

    import numpy as np
    import torch

    from fedmeta.algorithms import build_algorithm
    from fedmeta.assemble import make_engine, make_fabric
    from fedmeta.config import compose
    from fedmeta.data import ImageDataset
    from fedmeta.data.federation import Client, Federation
    from fedmeta.rounds import Federated, evaluate_on_ranks, federated_round

    cfg = compose(overrides(a))
    fabric = make_fabric(cfg)
    fabric.seed_everything(a.seed, verbose=False)  # the model's initialization, as fedmeta train seeds it
    with np.load(a.data) as f:
        x, y = torch.from_numpy(f["x"]), torch.from_numpy(f["y"])
        splits = [
            (torch.from_numpy(f[f"train{c}"]), torch.from_numpy(f[f"test{c}"]))
            for c in range(int(f["clients"]))
        ]
    dataset = ImageDataset(x=x, y=y, num_classes=10)
    parts = [torch.cat(split).numpy() for split in splits]
    # every client's splits the partition's own: its train split all it trains on, its test split kept
    federation = Federation(dataset, parts, 0, 0.25, a.seed)
    federation.train_clients = [
        Client(c, train, train[:0], a.seed, federation, test) for c, (train, test) in enumerate(splits)
    ]
    algorithm = build_algorithm(cfg, 10, precision=fabric.strategy.precision)
    model = pc.check_model(algorithm.model)
    engine = make_engine(cfg, torch.device("cpu"))

    R = a.rounds
    for round_ in range(R):
        CLOCK.round_start()
        federated_round(algorithm, federation, round_, a.clients_per_round, a.seed, engine=engine)
        CLOCK.round_end()

    CLOCK.eval_start()
    world = argparse.Namespace(world_size=1, global_rank=0)
    scored = evaluate_on_ranks(
        world,
        [Federated(algorithm, federation, a.seed)],
        cfg.personalization,
        engine,
        protocol="training_clients",
    )[0]
    CLOCK.eval_end("training clients' test splits")

    result = {
        "peer": "fedmeta",
        "method": a.method,
        "status": "ok",
        "rounds_requested": R,
        **pc.summarize(CLOCK, a.warmup, R),
        "final_accuracy": scored.weighted_accuracy,
        "mean_client_accuracy": scored.accuracy,
        "accuracy_protocol": (
            "fedmeta's evaluation.protocol=training_clients: every training client's test split (25 %) scored "
            "with its model after the last round (FedAvg: the global model; FedRep: the global body with the "
            "client's own head), sum of correct / sum of samples over all 20 clients (sample-weighted); "
            "mean_client_accuracy: the unweighted mean"
        ),
        "model": model,
        "settings": {
            "overrides": overrides(a),
            "vectorized": engine.vectorize,
            "precision": a.precision,
        },
        "hooks": ["federated_round (round)", "the scoring loop (eval)"],
        "env": pc.environment(),
    }
    pc.emit(result, CLOCK)


if __name__ == "__main__":
    main()
