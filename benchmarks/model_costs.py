"""Seconds of a FedAvg round on each model kind (docs/performance.md, "Per-round cost of each model").

Each row: the data set's federation as ``fedmeta train`` builds it (its default partition, 100
clients), FedAvg with one local epoch of batches of ``--batch-size`` on M = 5 clients a round, one
client at a time on one thread; one warm-up round, then the median of ``--rounds`` timed rounds,
and the trained samples per round (so µs a sample). Run it alone: another process on the machine
slows every number (the JSON records the load average before and after).

    OMP_NUM_THREADS=1 python benchmarks/model_costs.py --out results/model_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from fedmeta.algorithms import build_algorithm
from fedmeta.assemble import make_engine, make_fabric
from fedmeta.config import compose
from fedmeta.data import build_federation, load_dataset
from fedmeta.data.sources import data_dir
from fedmeta.rounds import federated_round

ROWS = {  # name → overrides
    "rmnist, the paper's CNN": ["dataset=rmnist"],
    "mini_imagenet, the 32×32 CNN (CIFAR-10/100's)": ["dataset=mini_imagenet"],
    "mini_imagenet, ResNet-18, batch norm": [
        "dataset=mini_imagenet",
        "model.kind=resnet18",
        "model.norm=batch",
    ],
    "mini_imagenet, ResNet-18, group norm": [
        "dataset=mini_imagenet",
        "model.kind=resnet18",
        "model.norm=group",
    ],
    "shakespeare, the character LSTM": ["dataset=shakespeare"],
}


def measure(overrides: list[str], batch_size: int, rounds: int) -> dict:
    cfg = compose(["method=fedavg", "method.local_epochs=1", f"method.batch_size={batch_size}", *overrides])
    fabric = make_fabric(cfg)
    fabric.seed_everything(0, verbose=False)
    data = load_dataset(cfg.dataset.name, data_dir(cfg.dataset.dir), 0, False, **cfg.dataset.options)
    fed = cfg.federation
    federation = build_federation(
        data, dict(cfg.partition), fed.num_clients, fed.num_new_clients, fed.held_out_fraction, seed=0
    )
    algorithm = build_algorithm(cfg, data.num_classes, precision=fabric.strategy.precision)
    engine = make_engine(cfg, torch.device("cpu"))
    seconds, samples = [], []
    for round_ in range(rounds + 1):
        clients = federation.sample_round(round_, fed.clients_per_round, 0)
        tick = time.perf_counter()
        federated_round(algorithm, federation, round_, fed.clients_per_round, 0, engine=engine)
        if round_:  # the first is a warm-up
            seconds.append(time.perf_counter() - tick)
            samples.append(sum(len(c.indices("all")) for c in clients))
    per_round = statistics.median(seconds)
    return {
        "overrides": overrides,
        "parameters": sum(p.numel() for p in algorithm.model.parameters()),
        "seconds_per_round": round(per_round, 3),
        "samples_per_round": round(statistics.mean(samples)),
        "us_per_sample": round(1e6 * sum(seconds) / sum(samples), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/model_costs.json"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = {}
    for name, overrides in ROWS.items():
        rows[name] = measure(overrides, args.batch_size, args.rounds)
        print(name, rows[name], flush=True)
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        ),
        "threads": 1,
        "batch_size": args.batch_size,
        "load_average_before": round(load, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
