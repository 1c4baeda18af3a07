"""Seconds a step-size candidate of ``personalization.lr_rule=selected`` costs a validation client,
scored after every step (the curve a scored client keeps) against after its last step only (what a
candidate needs: its score is its last step's). docs/protocol.md, "Equal footing".

Each method: its federation as ``fedmeta train`` builds it (RMNIST shards by default), untrained
global values, ``--clients`` of the validation clients the rule draws, personalized one at a time
on one thread at the grid's largest step size; the two ways alternate (A B, B A) ``--pairs`` times
and the median of each is kept. Run it alone: the JSON records the load average before and after.

    OMP_NUM_THREADS=1 python benchmarks/selection.py --out results/selection_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict

from fedmeta.assemble import make_engine, setup
from fedmeta.config import compose
from fedmeta.fastest import hardware_name
from fedmeta.rounds import Federated, validation_clients


def seconds_per_client(engine, lanes, personalization) -> float:
    start = time.perf_counter()
    engine.personalization_curves(lanes, personalization)
    return (time.perf_counter() - start) / len(lanes)


def measure(method: str, overrides: list[str], clients: int, pairs: int) -> dict:
    cfg = compose([f"method={method}", *overrides, "personalization.lr_rule=selected", "logger=[]"])
    fabric, federation, algorithm = setup(cfg)
    engine = make_engine(cfg, fabric.device)
    lanes = [(algorithm, c) for c in validation_clients(Federated(algorithm, federation, cfg.seed), clients)]
    every = OmegaConf.merge(cfg.personalization, {"lr": float(max(cfg.personalization.lr_grid))})
    last = OmegaConf.merge(every, {})
    with open_dict(last):
        last.every_step = False
    ways = {"every step": every, "last step": last}
    seconds_per_client(engine, lanes[:1], every)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in ways}
    for pair in range(pairs):
        for name in list(ways)[:: 1 if pair % 2 == 0 else -1]:
            times[name].append(seconds_per_client(engine, lanes, ways[name]))
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "method": method,
        "overrides": overrides,
        "steps": int(cfg.personalization.steps),
        "clients": len(lanes),
        "held_out_per_client": statistics.mean(len(c.held_out) for _, c in lanes),
        "seconds_per_client": median,
        "all": times,
        "last_step_over_every_step": median["last step"] / median["every step"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="cafeme,fedavg_ft")
    ap.add_argument("--overrides", nargs="*", default=["dataset=rmnist", "partition=shards"])
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = [measure(m, a.overrides, a.clients, a.pairs) for m in a.methods.split(",")]
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": hardware_name(torch.device("cpu")),
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "rows": rows,
    }
    for row in rows:
        s = row["seconds_per_client"]
        print(
            f"{row['method']:10s} every step {s['every step']:.3f} s/client, last step {s['last step']:.3f}"
            f" ({row['last_step_over_every_step']:.2f}×)"
        )
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
