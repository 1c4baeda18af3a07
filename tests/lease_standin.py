"""A stand-in for a job on a lent machine, for the lease simulator (tests/test_lease.py): its "runs"
advance a round every few milliseconds, each writing its checkpoint as fedmeta does (beside, then
renamed) and finishing with a summary, while a :class:`fedmeta.lease.Packer` packs them into OUT,
exactly as ``fedmeta campaign --pack`` does. The simulator kills it with SIGKILL at chosen moments.

    python tests/lease_standin.py SPEC.json

SPEC: {"root", "out", "rounds", "step_s", "runs": {folder: [identity, start round]}}.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from fedmeta import lease


def write_round(folder: Path, identity: dict, round_: int, rounds: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text("seed: 0\n")
    (folder / "metrics.csv").write_text(
        "round,train_loss,round_seconds\n" + "".join(f"{r},0.5,0.01\n" for r in range(1, round_ + 1))
    )
    if round_ == rounds:
        summary = {"accuracy": 0.5, "curve": [0.1, 0.5], "rounds": rounds, "seconds": 1.0}
        (folder / "summary.json").write_text(json.dumps(summary))
        return
    tmp = folder / "checkpoint.ckpt.tmp"
    # some weight, so that packing takes a moment in which a kill can land
    torch.save({"round": round_, "identity": identity, "weights": torch.full((20_000,), float(round_))}, tmp)
    os.replace(tmp, folder / "checkpoint.ckpt")


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    root, out, rounds = Path(spec["root"]), Path(spec["out"]), spec["rounds"]
    state = {folder: start for folder, (_, start) in spec["runs"].items()}
    started, ended = time.time(), []

    def record() -> dict:
        return {
            "id": spec["id"],
            "started": "2026-01-01T00:00:00+00:00",
            "hardware": "stand-in",
            "budget_seconds": 60,
            "seconds": round(time.time() - started, 3),
            "parallel": 1,
            "units": {},
            "ended": bool(ended),
        }

    packer = lease.Packer(
        root, out, lambda: [Path(f) for f in spec["runs"]], record, poll_s=0.002, every_s=0.05
    )
    packer.start()
    while any(r < rounds for r in state.values()):
        for folder, (identity, _) in spec["runs"].items():
            if state[folder] < rounds:
                state[folder] += 1
                write_round(root / folder, identity, state[folder], rounds)
        time.sleep(spec["step_s"])
    ended.append(True)
    packer.stop()
    print("stand-in: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
