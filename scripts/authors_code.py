"""Run the authors' own code (github.com/annaVettoruzzo/CAFeMe) on RMNIST, unmodified, with fewer rounds.

Their main.py trains CAFeMe, then the baselines one after another on one shared model object (the
chain fedmeta's ``--preset published`` reproduces) and scores each on the held-out clients. This
script fetches their code at a pinned commit, installs what it imports beside this project's torch
(FedLab 1.1, scikit-learn, pandas, OpenCV, tfrecord: into a folder under .cache, not into the
venv), gives torchvision's MNIST loader the MNIST files from ``$FEDMETA_DATA/mnist.npz`` (no
download), sets the number of rounds per method (their ``global_steps``; 1000 in their arguments)
and runs their main.py as it is (without a GPU, their GPU-picking lines are answered: see RUNNER).
Every accuracy their code saves is written to one JSON file beside the run's log.

    python scripts/authors_code.py --rounds 100 --seed 0 --partition shards

The run leaves their own outputs (saved models, accuracy pickles) under .cache/authors-code/.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "ae46d3972f6771c7d9f94046bdae9bf38a98dec4"  # their newest commit when this was written
SOURCE = "https://github.com/annaVettoruzzo/CAFeMe"
# What their code imports that fedmeta's venv lacks; --no-deps keeps the venv's torch and numpy.
DEPENDENCIES = [
    "fedlab==1.1.2",
    "scikit-learn<1.6",
    "scipy<1.14",
    "joblib",
    "threadpoolctl",
    "pandas<2.3",
    "python-dateutil",
    "pytz",
    "tzdata",
    "six",
    "pynvml",
    "nvidia-ml-py",
    "tfrecord",
    "crc32c",
    "opencv-python-headless<4.11",
]
# Their accuracy pickles (main.py's save= names) and the method each one scores.
PICKLES = {
    "acc_proposed_c1": "cafeme",
    "acc_perfedavg": "perfedavg",
    "acc_fedavg": "fedavg",
    "acc_fedavg_ft": "fedavg_ft",
    "acc_ifca": "ifca",
    "acc_ifca_ft": "ifca_ft",
    "acc_ifca_sharing": "ifca_sharing",
    "acc_ditto": "ditto",
    "acc_fedrep": "fedrep",
}
# Runs their main.py with their arguments, the rounds per method changed, nothing else. Their
# utils/common.py picks the GPU with the most free memory (nvidia-smi, then torch.cuda.set_device)
# at import: without a GPU, nvidia-smi's answer is one card's line and set_device does nothing.
RUNNER = """
import os, runpy, sys, torch
if not torch.cuda.is_available():
    their_system = os.system
    def system(command):
        if not command.startswith("nvidia-smi"):
            return their_system(command)
        with open("tmp", "w") as out:
            out.write("Free : 0 MiB\\n")
        return 0
    os.system = system
    torch.cuda.set_device = lambda device: None
import arguments
rounds = int(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]))
their_set_args = arguments.set_args
def set_args():
    args = their_set_args()
    args["global_steps"] = rounds
    return args
arguments.set_args = set_args
sys.argv = ["main.py", *sys.argv[3:]]
runpy.run_path("main.py", run_name="__main__")
"""


def fail(message: str):
    print(f"authors_code: error: {message}", file=sys.stderr)
    sys.exit(2)


def checkout(source: str, folder: Path) -> Path:
    """Their code at COMMIT, extracted once (a clone that lacks the commit is refused in one line)."""
    code = folder / COMMIT[:12]
    if not (code / "main.py").exists():
        clone = folder / "clone"
        if not clone.exists() and subprocess.run(["git", "clone", "--quiet", source, str(clone)]).returncode:
            fail(f"could not clone {source}: give --source a clone URL or a path of their repository")
        archive = subprocess.run(["git", "-C", str(clone), "archive", COMMIT], capture_output=True)
        if archive.returncode:
            fail(f"{source} has no commit {COMMIT}: fetch it, or remove {clone} to clone again")
        code.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True)
    return code


def install(folder: Path) -> Path:
    deps = folder / "deps"
    if not (deps / "fedlab").exists():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(deps)]
        if subprocess.run([*command, *DEPENDENCIES]).returncode:
            shutil.rmtree(deps, ignore_errors=True)  # a half-installed folder would pass the check above
            fail(f"pip could not install {' '.join(DEPENDENCIES)}: see its message above")
    return deps


def write_mnist(mnist: Path, raw: Path):
    """The training and test sets as the idx files torchvision's MNIST reads (same order as the originals)."""
    raw.mkdir(parents=True, exist_ok=True)
    data = np.load(mnist)
    for split, prefix in ((0, "train"), (1, "t10k")):
        images, labels = data["x"][data["split"] == split], data["y"][data["split"] == split]
        header = np.array([2051, len(images), 28, 28], ">i4").tobytes()
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(header + images.astype(np.uint8).tobytes())
        header = np.array([2049, len(labels)], ">i4").tobytes()
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(header + labels.astype(np.uint8).tobytes())


def scores(folder: Path) -> dict:
    """Each method's accuracy as their code saved it: the mean over held-out clients, after every
    personalization step (a curve) or without personalization (one number)."""
    found = {}
    for name, method in PICKLES.items():
        path = folder / f"{name}.pkl"
        if path.exists():
            with open(path, "rb") as file:
                curve = np.atleast_1d(np.asarray(pickle.load(file), dtype=float))
            found[method] = {
                "final": round(100 * curve[-1], 2),
                "step0": round(100 * curve[0], 2),
                "curve": curve.tolist(),
            }
    return found


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="rounds per method (theirs: 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partition", default="shards", choices=["shards", "dirichlet"])
    parser.add_argument("--source", default=SOURCE, help="a clone URL or path of their repository")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count()
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "authors_code")
    return parser


def main():
    args = arguments().parse_args()
    mnist = Path(os.environ.get("FEDMETA_DATA", ROOT / "data")) / "mnist.npz"
    if not mnist.exists():
        fail(f"{mnist} not found: set FEDMETA_DATA to the folder holding mnist.npz")
    if args.rounds < 1:
        fail(f"--rounds must be at least 1, got {args.rounds}")

    name = f"rmnist-{args.partition}-seed{args.seed}-{args.rounds}rounds"
    log, result = args.out / f"{name}.log", args.out / f"{name}.json"
    if result.exists():
        fail(f"{result} exists: move it away to run again, or give another --out")
    folder = ROOT / ".cache" / "authors-code"
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / "lock", "w")  # their code writes into its own folder: one run at a time
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"another run of their code is using {folder}: wait for it to end")
    code = checkout(args.source, folder)
    deps = install(folder)
    write_mnist(mnist, code / "data" / "rmnist" / "MNIST" / "raw")
    args.out.mkdir(parents=True, exist_ok=True)
    saved = code / "_saved_models" / "rmnist_complete" / args.partition / f"seed{args.seed}"
    for stale in saved.glob("*.pkl"):  # an earlier run's scores must not stand in for a failed stage
        stale.unlink()
    env = dict(os.environ, PYTHONPATH=str(deps), OMP_NUM_THREADS=str(args.threads))
    start = time.time()
    with open(log, "w") as out:
        command = [
            sys.executable,
            "-c",
            RUNNER,
            str(args.rounds),
            str(args.threads),
            str(args.seed),
            "rmnist",
            "--partition",
            args.partition,
        ]
        status = subprocess.run(command, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.time() - start
    summary = {
        "source": f"{SOURCE} @ {COMMIT}",
        "command": " ".join(["python scripts/authors_code.py", *sys.argv[1:]]),
        "rounds_per_method": args.rounds,
        "threads": args.threads,
        "seconds": round(seconds),
        "exit_status": status,
        "accuracy_percent": scores(saved),
    }
    result.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "accuracy_percent"}))
    for method, score in summary["accuracy_percent"].items():
        print(f"{method:12s} {score['final']:6.2f} % (step 0: {score['step0']:.2f} %)")
    if status != 0:
        fail(f"their main.py exited with {status}: see {log}")


if __name__ == "__main__":
    main()
