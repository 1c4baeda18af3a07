"""A stand-in for a job on a lent machine, for the lease simulator (tests/test_lease.py): its "runs"
advance a round every few milliseconds, each writing its checkpoint as fedmeta does (beside, then
renamed) and finishing with a summary, while a :class:`fedmeta.lease.Packer` packs them into OUT,
exactly as ``fedmeta campaign --pack`` does. The simulator kills it with SIGKILL at chosen moments.

    python tests/lease_standin.py PLAN.json

PLAN: {"root", "out", "rounds", "step_s", "runs": {folder: [identity, start round, config's identity]}};
a run's config.yaml holds its config's identity, of 3 rounds (the tiny campaign's).
"""

import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

from fedmeta import lease

# fedmeta.runs.METRIC_FIELDS (importing fedmeta.runs takes seconds: Lightning's loggers)
METRIC_FIELDS = [
    "round",
    "train_loss",
    "round_seconds",
    "clients_dropped",
    "eval_accuracy",
    "eval_accuracy_std",
    "eval_step0_accuracy",
    "training_clients_accuracy",
    "training_clients_accuracy_std",
    "training_clients_weighted_accuracy",
    "beside_cores",
    "personalization_lr",
]


def write_round(folder: Path, identity: dict, config: dict, round_: int, rounds: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = config | {"federation": config["federation"] | {"rounds": 3}}
    (folder / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    rows = [
        dict.fromkeys(METRIC_FIELDS, "") | {"round": r, "train_loss": 0.5 / r} for r in range(1, round_ + 1)
    ]
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, METRIC_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    if round_ == rounds:
        (folder / "curves.csv").write_text("round,step,accuracy\n")
        summary = {"accuracy": 0.5, "curve": [0.1, 0.5], "rounds": rounds, "seconds": 1.0}
        (folder / "summary.json").write_text(json.dumps(summary))
        return
    tmp = folder / "checkpoint.ckpt.tmp"
    # some weight, so that packing takes a moment in which a kill can land
    state = {"round": round_, "identity": identity, "history": {"metrics": rows}}
    torch.save(state | {"weights": torch.full((20_000,), float(round_))}, tmp)
    os.replace(tmp, folder / "checkpoint.ckpt")


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    root, out, rounds = Path(plan["root"]), Path(plan["out"]), plan["rounds"]
    state = {folder: start for folder, (_, start, _) in plan["runs"].items()}
    started, ended = time.time(), []

    def record() -> dict:
        return {
            "id": plan["id"],
            "started": "2026-01-01T00:00:00+00:00",
            "hardware": "stand-in",
            "budget_seconds": 60,
            "seconds": round(time.time() - started, 3),
            "parallel": 1,
            "units": {},
            "ended": bool(ended),
        }

    packer = lease.Packer(
        root, out, lambda: [Path(f) for f in plan["runs"]], record, poll_s=0.002, every_s=0.05
    )
    packer.start()
    while any(r < rounds for r in state.values()):
        for folder, (identity, _, config) in plan["runs"].items():
            if state[folder] < rounds:
                state[folder] += 1
                write_round(root / folder, identity, config, state[folder], rounds)
        time.sleep(plan["step_s"])
    ended.append(True)
    packer.stop()
    print("stand-in: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
