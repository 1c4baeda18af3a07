"""Run the same federated experiment in peer FL libraries and compare their cost per round.

    .venv/bin/python benchmarks/peers/run.py --pfllib /path/to/PFLlib --flbench /path/to/FL-bench \
        [--methods fedavg,fedrep] [--rounds 4] [--warmup 1] [--pairs 1] [--out results.json]

Each peer is a *source checkout* given by the user; its commit is read with `git rev-parse HEAD`
(or given with --pfllib-commit / --flbench-commit when it is not a git checkout). Its code is never
copied here: a driver of ours (drive_<peer>.py) runs in the peer's own venv
(benchmarks/peers/.venvs/<peer>, made by setup_env.sh), puts the checkout on sys.path, wraps the
peer's round entry points at runtime in its own process and calls the peer's own main. It prints
one line `PEER_RESULT {json}`; this runner collects those lines.

The experiment (identical in every peer; README.md lists what each peer could not match):
MNIST from fedmeta's data/mnist.npz (--data), its 60,000 training images (--n-train to use a seed-0
subset for smoke tests), normalised with mean 0.1307 / std 0.3081; 20 clients, pathological
non-IID: the images sorted by label, cut into 40 shards, 2 random shards a client (seed 0); each
client's data split 75 % train / 25 % test (seed 0). The partition is made ONCE here and written
into each peer's own data format. 10 clients a round (--clients-per-round; --num-clients 20), 1 local epoch, batch 10,
SGD lr 0.01 (no momentum, no weight decay), FedAvg; FedRep with PFLlib's defaults (head = last
Linear, 1 head epoch then 1 body epoch). Model: FedAvgCNN (582,026 parameters, 4,267,008 MACs a
sample), checked by each driver.

Measured per (peer, method, run): setup seconds (process start to the first training round), CPU
seconds (user+sys of the process) and wall seconds per training round — median over the timed
rounds, evaluation excluded (evaluated only at the end where the peer allows; its time is measured
separately) —, peak RSS, and the peer's own final accuracy by its own protocol. Runs alternate
peers, their order reversed every other pair (A B, B A, ...), one process at a time, each with
OMP_NUM_THREADS=1 and one torch thread.

Adding a peer
-------------
A peer is an entry of the list that `build_peers()` returns, a `Peer`:

    Peer(
        name="mylib",                         # key in the results
        path=Path("/src/mylib"),              # its checkout (commit read from it) or None
        commit=None,                          # None: read with git from `path`
        python=HERE / ".venvs" / "mylib" / "bin" / "python",
        methods=("fedavg", "fedrep"),         # the methods it can run
        prepare=prepare_mylib,                # (exp, partition, peer_work_dir) -> None
        command=command_mylib,                # (exp, method, peer_work_dir) -> (argv, cwd)
    )

`prepare` writes the shared partition (`Partition`: per client the train/test positions into the
60,000 MNIST training images, plus the normalised images) into the peer's own data format under
its work folder; it is called once per invocation of run.py. `command` returns the argv and cwd of
one run; the process gets OMP_NUM_THREADS=1, MKL_NUM_THREADS=1 and PEER_SPAWN_WALL (time.time() at
spawn), and must print one line `PEER_RESULT {json}` with at least the keys that
peer_common.summarize + emit produce: setup{wall_s,cpu_s}, rounds[{index,cpu_s,wall_s}],
cpu_s_per_round, wall_s_per_round, peak_rss_mb, final_accuracy, accuracy_protocol, model{params,
macs_per_sample}, status. A driver written in peer_common's style gets those for free.

fedmeta itself is such an entry, once per way of running its clients (`--fedmeta sequential,vmap,
bf16`; drive_fedmeta.py), and through its own `fedmeta train` (`train`: its default model, with batch
norms; `train-fedavgcnn`: the peers' model). Runs with fedmeta's venv: stdlib and numpy only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import pickle
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULT_PREFIX = "PEER_RESULT "
METHODS = ("fedavg", "fedrep")


# --------------------------------------------------------------------------- the experiment


@dataclasses.dataclass
class Experiment:
    data: str = str(
        Path(__file__).resolve().parent.parent.parent / "data" / "mnist.npz"
    )  # fedmeta's own copy
    n_train: int = 60_000  # MNIST training images used (a seed-0 subset when fewer)
    num_clients: int = 20
    shards: int = 40
    shards_per_client: int = 2
    train_fraction: float = 0.75
    seed: int = 0
    mean: float = 0.1307
    std: float = 0.3081
    clients_per_round: int = 10

    def join_ratio(self) -> float:
        """The peers' fraction of clients a round: they take int(num_clients · ratio), so a ratio a
        half-client above cpr/num_clients gives cpr whatever the float rounding (10/3,597 · 3,597 is
        9.999…)."""
        return (self.clients_per_round + 0.5) / self.num_clients

    local_epochs: int = 1
    batch_size: int = 10
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    rounds: int = 4  # training rounds; the first `warmup` are not timed
    warmup: int = 1
    # FedRep as PFLlib's defaults say (main.py: -pls/--plocal_epochs 1 head epoch, -ls/--local_epochs 1 body epoch)
    fedrep_head_epochs: int = 1
    fedrep_body_epochs: int = 1
    model: str = "FedAvgCNN: conv(1,32,5) relu pool2 conv(32,64,5) relu pool2 flatten(1024) linear(512) relu linear(10)"
    model_params: int = 582_026
    model_macs_per_sample: int = 4_267_008


@dataclasses.dataclass
class Partition:
    clients: list[dict]  # per client {"train": positions, "test": positions} into the training images
    x: np.ndarray  # uint8 (60000, 28, 28): all MNIST training images, in mnist.npz order
    y: np.ndarray  # int64 (60000,)
    x_test: np.ndarray  # MNIST's own test images (FL-bench's MNIST class loads them too; unused)
    y_test: np.ndarray
    fingerprint: str

    def normalised(self, positions: np.ndarray, exp: Experiment) -> np.ndarray:
        """float32 (n, 1, 28, 28): x/255, then (x - mean)/std, in float32 as torchvision's Normalize does."""
        x = self.x[positions].astype(np.float32) / np.float32(255.0)
        return ((x - np.float32(exp.mean)) / np.float32(exp.std))[:, None, :, :].astype(np.float32)

    def summary(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "clients": [
                {
                    "train": len(c["train"]),
                    "test": len(c["test"]),
                    "classes": sorted({int(v) for v in self.y[np.concatenate([c["train"], c["test"]])]}),
                }
                for c in self.clients
            ],
        }


def make_partition(exp: Experiment) -> Partition:
    d = np.load(exp.data)
    x, y, split = d["x"], d["y"].astype(np.int64), d["split"]
    train = np.flatnonzero(split == 0)
    test = np.flatnonzero(split == 1)
    x_tr, y_tr = x[train], y[train]
    n = len(train)
    if exp.n_train < n:
        pool = np.sort(np.random.default_rng(exp.seed).choice(n, exp.n_train, replace=False))
    else:
        pool = np.arange(n)
    order = pool[np.argsort(y_tr[pool], kind="stable")]  # sort by label
    size = len(order) // exp.shards
    shards = [order[i * size : (i + 1) * size] for i in range(exp.shards)]
    rng = np.random.default_rng(exp.seed)
    perm = rng.permutation(exp.shards)
    clients = []
    for c in range(exp.num_clients):
        own = perm[c * exp.shards_per_client : (c + 1) * exp.shards_per_client]
        idx = np.concatenate([shards[s] for s in own])
        shuffled = idx[rng.permutation(len(idx))]
        k = int(len(idx) * exp.train_fraction)
        clients.append({"train": np.sort(shuffled[:k]), "test": np.sort(shuffled[k:])})
    h = hashlib.sha256()
    data_fields = (
        "n_train",
        "num_clients",
        "shards",
        "shards_per_client",
        "train_fraction",
        "seed",
        "mean",
        "std",
    )
    h.update(json.dumps({f: getattr(exp, f) for f in data_fields}, sort_keys=True).encode())
    for c in clients:
        h.update(c["train"].astype(np.int64).tobytes())
        h.update(c["test"].astype(np.int64).tobytes())
    h.update(hashlib.sha256(x_tr.tobytes()).digest())
    return Partition(clients, x_tr, y_tr, x[test], y[test].astype(np.int64), h.hexdigest()[:16])


def _up_to_date(folder: Path, fingerprint: str) -> bool:
    f = folder / "fingerprint.txt"
    return f.is_file() and f.read_text().strip() == fingerprint


def _stamp(folder: Path, fingerprint: str):
    (folder / "fingerprint.txt").write_text(fingerprint + "\n")


# --------------------------------------------------------------------------- peers


@dataclasses.dataclass
class Peer:
    name: str
    path: Path | None
    commit: str | None
    python: Path
    methods: tuple[str, ...]
    prepare: Callable[[Experiment, Partition, Path], None]
    command: Callable[[Experiment, str, Path], tuple[list[str], Path]]
    commit_source: str = ""
    notes: str = ""


# PFLlib ----------------------------------------------------------------------------------------
PFLLIB_DATASET = "MNIST_pat20"  # PFLlib picks its MNIST FedAvgCNN for a name containing "MNIST"


def prepare_pfllib(exp: Experiment, part: Partition, work: Path):
    """PFLlib's format (dataset/utils/dataset_utils.py save_file): dataset/<name>/{train,test}/<client>.npz,
    each np.savez_compressed(f, data={'x': float32 (n,1,28,28) normalised, 'y': int64}), and config.json."""
    root = work / "dataset" / PFLLIB_DATASET
    (work / "run").mkdir(parents=True, exist_ok=True)
    if _up_to_date(root, part.fingerprint):
        return
    if root.exists():
        shutil.rmtree(root)
    for sub in ("train", "test"):
        (root / sub).mkdir(parents=True)
    stats = []
    for c, cl in enumerate(part.clients):
        for sub in ("train", "test"):
            pos = cl[sub]
            with open(root / sub / f"{c}.npz", "wb") as f:
                np.savez_compressed(
                    f, data={"x": part.normalised(pos, exp), "y": part.y[pos].astype(np.int64)}
                )
        labels, counts = np.unique(part.y[np.concatenate([cl["train"], cl["test"]])], return_counts=True)
        stats.append([(int(a), int(b)) for a, b in zip(labels, counts)])
    config = {
        "num_clients": exp.num_clients,
        "num_classes": 10,
        "non_iid": True,
        "balance": True,
        "partition": "pat",
        "Size of samples for labels in clients": stats,
        "alpha": None,
        "batch_size": exp.batch_size,
        "written_by": f"fedmeta benchmarks/peers/run.py (shards {exp.shards}, {exp.shards_per_client} per client, "
        f"seed {exp.seed}, mean {exp.mean} std {exp.std})",
    }
    (root / "config.json").write_text(json.dumps(config))
    _stamp(root, part.fingerprint)


def common_flags(exp: Experiment, method: str) -> list[str]:
    """The flags every driver takes alike: the method and the experiment's training settings."""
    flags = {
        "method": method,
        "rounds": exp.rounds,
        "warmup": exp.warmup,
        "local-epochs": exp.local_epochs,
        "batch-size": exp.batch_size,
        "lr": exp.lr,
        "seed": exp.seed,
    }
    return [word for name, value in flags.items() for word in (f"--{name}", str(value))]


def command_pfllib(checkout: Path):
    def command(exp: Experiment, method: str, work: Path):
        argv = [
            str(HERE / "drive_pfllib.py"),
            "--checkout",
            str(checkout),
            "--dataset",
            PFLLIB_DATASET,
            *common_flags(exp, method),
            "--num-clients",
            str(exp.num_clients),
            "--join-ratio",
            str(exp.join_ratio()),
        ]
        return argv, work / "run"

    return command


# FL-bench ----------------------------------------------------------------------------------------


def _idx_images(x: np.ndarray) -> bytes:
    return struct.pack(">IIII", 2051, len(x), 28, 28) + np.ascontiguousarray(x, dtype=np.uint8).tobytes()


def _idx_labels(y: np.ndarray) -> bytes:
    return struct.pack(">II", 2049, len(y)) + np.ascontiguousarray(y, dtype=np.uint8).tobytes()


def _symlink(target: Path, link: Path):
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def prepare_flbench(checkout: Path):
    """FL-bench reads data from <FLBENCH_ROOT>/data/<dataset>/, FLBENCH_ROOT being where its source is.
    So a root is laid out here: symlinks to the checkout's src, config, main.py and data/utils beside a
    real data/mnist holding FL-bench's format: MNIST/raw/*-idx*-ubyte (its MNIST class is
    torchvision.datasets.MNIST over train + test, concatenated: positions 0..59999 are the training
    images), partition.pkl ({'separation', 'data_indices'} as generate_data.py writes for split
    'sample', val empty) and args.json."""

    def prepare(exp: Experiment, part: Partition, work: Path):
        root = work / "root"
        for name in ("src", "config", "main.py"):
            _symlink(checkout / name, root / name)
        _symlink(checkout / "data" / "utils", root / "data" / "utils")
        (work / "run").mkdir(parents=True, exist_ok=True)
        mnist = root / "data" / "mnist"
        if _up_to_date(mnist, part.fingerprint):
            return
        if mnist.exists():
            shutil.rmtree(mnist)
        raw = mnist / "MNIST" / "raw"
        raw.mkdir(parents=True)
        (raw / "train-images-idx3-ubyte").write_bytes(_idx_images(part.x))
        (raw / "train-labels-idx1-ubyte").write_bytes(_idx_labels(part.y))
        (raw / "t10k-images-idx3-ubyte").write_bytes(_idx_images(part.x_test))
        (raw / "t10k-labels-idx1-ubyte").write_bytes(_idx_labels(part.y_test))
        ids = list(range(exp.num_clients))
        partition = {
            "separation": {"train": ids, "val": ids, "test": ids, "total": exp.num_clients},
            "data_indices": [
                {"train": [int(i) for i in c["train"]], "val": [], "test": [int(i) for i in c["test"]]}
                for c in part.clients
            ],
        }
        with open(mnist / "partition.pkl", "wb") as f:
            pickle.dump(partition, f)
        args = {
            "client_num": exp.num_clients,
            "test_ratio": round(1 - exp.train_fraction, 6),
            "val_ratio": 0.0,
            "seed": exp.seed,
            "split": "sample",
            "IID_ratio": 0.0,
            "monitor_window_name_suffix": f"mnist-{exp.num_clients}clients-0%IID",
        }
        (mnist / "args.json").write_text(json.dumps(args, indent=4))
        _stamp(mnist, part.fingerprint)

    return prepare


def command_flbench(exp: Experiment, method: str, work: Path):
    argv = [
        str(HERE / "drive_flbench.py"),
        "--root",
        str(work / "root"),
        *common_flags(exp, method),
        "--join-ratio",
        str(exp.join_ratio()),
        "--fedrep-head-epochs",
        str(exp.fedrep_head_epochs),
        "--fedrep-body-epochs",
        str(exp.fedrep_body_epochs),
    ]
    return argv, work / "run"


# --------------------------------------------------------------------------- provenance


def checkout_commit(path: Path, given: str | None) -> tuple[str, str]:
    """(commit, how it was known). A git checkout's HEAD when `path` is the top of a work tree."""
    if not path.is_dir():
        refuse(f"no checkout at {path}: clone the library there first (benchmarks/peers/README.md)")
    try:
        top = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if Path(top).resolve() == path.resolve():
            head = subprocess.run(
                ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
            if given and not head.startswith(given) and not given.startswith(head):
                refuse(f"{path} is at {head}, not the commit given ({given})")
            return head, "git rev-parse HEAD"
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    if given:
        return given, "given on the command line (not a git checkout)"
    refuse(f"{path} is not a git checkout: say its commit with --<peer>-commit")


def refuse(message: str):
    """Bad input: one line on stderr, exit status 2."""
    print(f"run.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def checkout_changes(path: Path) -> list[str] | None:
    """Tracked files changed in a git checkout (None when that cannot be told)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        return out.splitlines()[:50]
    except (subprocess.SubprocessError, FileNotFoundError):
        return None


def machine() -> dict:
    model, flags = "", []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                simd = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
                flags = [f for f in line.split(":", 1)[1].split() if f in simd]
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_simd_flags": flags,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "python_runner": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "env": {
            k: os.environ.get(k) for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "PYTHONHASHSEED")
        },
    }


def venv_freeze(python: Path) -> list[str]:
    f = python.parent.parent / "freeze.txt"
    return f.read_text().split() if f.is_file() else []


# --------------------------------------------------------------------------- running


def run_one(peer: Peer, exp: Experiment, method: str, work: Path, log: Path, timeout: float) -> dict:
    argv, cwd = peer.command(exp, method, work)
    argv = [str(peer.python), *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{peer.python.parent}{os.pathsep}{env.get('PATH', '')}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(f"$ cd {cwd} && {' '.join(argv)}\n")
        out.flush()
        env["PEER_SPAWN_WALL"] = repr(time.time())
        t0 = time.time()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - t0
    result = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
    return {
        "peer": peer.name,
        "method": method,
        "exit_code": proc.returncode,
        "process_wall_s": wall,
        "process_rusage": {"user_s": ru.ru_utime, "sys_s": ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024.0},
        "log": str(log),
        "result": result,
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in sorted({(r["peer"], r["method"]) for r in runs}):
        rs = [
            r["result"]
            for r in runs
            if (r["peer"], r["method"]) == key and r["result"] and r["exit_code"] == 0
        ]
        if not rs:
            out["/".join(key)] = {"runs_ok": 0}
            continue
        out["/".join(key)] = {
            "runs_ok": len(rs),
            "cpu_s_per_round": _median(r["cpu_s_per_round"] for r in rs),
            "wall_s_per_round": _median(r["wall_s_per_round"] for r in rs),
            "cpu_s_per_round_all_timed": [
                x["cpu_s"] for r in rs for x in r["rounds"] if x["index"] in r["timed_rounds"]
            ],
            "setup_wall_s": _median(r["setup"]["wall_s"] for r in rs),
            "setup_cpu_s": _median(r["setup"]["cpu_s"] for r in rs),
            "eval_cpu_s_total": _median(r.get("eval_cpu_s_total") for r in rs),
            # ru_maxrss of the driver process when it writes its result (setup, rounds and evaluation done)
            "peak_rss_mb": _median(r["peak_rss_mb"] for r in rs),
            # the anonymous part of it (RssAnon, sampled): without the shared libraries' pages, whose
            # count varies with the page cache from one process to the next
            "peak_anon_mb": _median(r.get("peak_anon_mb") for r in rs),
            # the same from the runner's wait4: the process's whole life, interpreter teardown included
            # (torch's own teardown adds ~0.4-1 s CPU and ~100 MB there) and any child it reaped
            "peak_rss_mb_process": _median(
                r["process_rusage"]["maxrss_mb"]
                for r in runs
                if (r["peer"], r["method"]) == key and r["result"] and r["exit_code"] == 0
            ),
            "final_accuracy": _median(r["final_accuracy"] for r in rs),
            "statuses": sorted({r.get("status", "?") for r in rs}),
        }
    return out


def print_table(summary: dict):
    cols = (
        "cpu_s_per_round",
        "wall_s_per_round",
        "setup_wall_s",
        "setup_cpu_s",
        "peak_rss_mb",
        "peak_anon_mb",
        "final_accuracy",
    )
    print(f"{'peer/method':16s} {'runs':>4s} " + " ".join(f"{c:>16s}" for c in cols))
    for key, s in summary.items():
        cells = []
        for c in cols:
            v = s.get(c)
            text = "-" if v is None else (f"{v:.4f}" if c == "final_accuracy" else f"{v:.3f}")
            cells.append(f"{text:>16s}")
        print(f"{key:16s} {s['runs_ok']:4d} " + " ".join(cells))


# fedmeta ---------------------------------------------------------------------------------------
REPO = HERE.parent.parent


def prepare_fedmeta(exp: Experiment, part: Partition, work: Path):
    """One .npz: the normalised images, labels and each client's train/test positions into them."""
    work.mkdir(parents=True, exist_ok=True)
    target = work / "partition.npz"
    if _up_to_date(work, part.fingerprint) and target.is_file():
        return
    positions = np.arange(len(part.y))
    arrays = {
        "x": part.normalised(positions, exp),
        "y": part.y.astype(np.int64),
        "clients": len(part.clients),
    }
    for c, cl in enumerate(part.clients):
        arrays[f"train{c}"] = np.asarray(cl["train"], dtype=np.int64)
        arrays[f"test{c}"] = np.asarray(cl["test"], dtype=np.int64)
    np.savez(target, **arrays)
    _stamp(work, part.fingerprint)


def command_fedmeta(vectorize: str, precision: str, *extra: str):
    def command(exp: Experiment, method: str, work: Path):
        argv = [
            str(HERE / "drive_fedmeta.py"),
            "--data",
            str(work / "partition.npz"),
            *common_flags(exp, method),
            "--num-clients",
            str(exp.num_clients),
            "--clients-per-round",
            str(exp.clients_per_round),
            "--vectorize",
            vectorize,
            "--precision",
            precision,
            *extra,
        ]
        return argv, work

    return command


def fedmeta_peers(ways: str) -> list[Peer]:
    """fedmeta itself, once per way asked for (``--fedmeta sequential,vmap,bf16``)."""
    commit, how = checkout_commit(REPO, None)
    settings = {
        "sequential": ("false", "32-true"),
        "vmap": ("true", "32-true"),
        "bf16": ("false", "bf16-mixed"),
        "vmap-bf16": ("true", "bf16-mixed"),
        # fedmeta train itself (its data path, partition, loop), with its default model or the peers'
        "train": ("false", "32-true", "--way", "train", "--batch-norm", "true"),
        "train-fedavgcnn": ("false", "32-true", "--way", "train", "--batch-norm", "false"),
    }
    peers = []
    for way in [w.strip() for w in ways.split(",") if w.strip()]:
        if way not in settings:
            refuse(f"--fedmeta: unknown way {way!r} (known: {', '.join(settings)})")
        peers.append(
            Peer(
                name=f"fedmeta-{way}",
                path=REPO,
                commit=commit,
                commit_source=how,
                python=Path(sys.executable),
                methods=METHODS,
                prepare=prepare_fedmeta,
                command=command_fedmeta(*settings[way]),
            )
        )
    return peers


def run_order(peers: list, pair: int) -> list:
    """The peers in the order pair ``pair`` runs them: as given in even pairs, reversed in odd ones
    (A B, B A, …), so that neither always runs first on a machine that warms up or is loaded later."""
    return list(peers) if pair % 2 == 0 else list(reversed(peers))


def build_peers(a) -> list[Peer]:
    """The peers of this invocation. Add an entry here for another peer (see the module docstring)."""
    peers = fedmeta_peers(a.fedmeta)
    if a.pfllib:
        path = Path(a.pfllib).resolve()
        commit, how = checkout_commit(path, a.pfllib_commit)
        peers.append(
            Peer(
                name="pfllib",
                path=path,
                commit=commit,
                commit_source=how,
                python=Path(a.pfllib_python or HERE / ".venvs" / "pfllib" / "bin" / "python"),
                methods=METHODS,
                prepare=prepare_pfllib,
                command=command_pfllib(path),
            )
        )
    if a.flbench:
        path = Path(a.flbench).resolve()
        commit, how = checkout_commit(path, a.flbench_commit)
        peers.append(
            Peer(
                name="flbench",
                path=path,
                commit=commit,
                commit_source=how,
                python=Path(a.flbench_python or HERE / ".venvs" / "flbench" / "bin" / "python"),
                methods=METHODS,
                prepare=prepare_flbench(path),
                command=command_flbench,
            )
        )
    return peers


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pfllib", help="PFLlib checkout")
    ap.add_argument("--pfllib-commit", help="its commit when it is not a git checkout")
    ap.add_argument("--pfllib-python", help="default: benchmarks/peers/.venvs/pfllib/bin/python")
    ap.add_argument("--flbench", help="FL-bench checkout")
    ap.add_argument("--flbench-commit", help="its commit when it is not a git checkout")
    ap.add_argument("--flbench-python", help="default: benchmarks/peers/.venvs/flbench/bin/python")
    ap.add_argument(
        "--fedmeta",
        default="sequential",
        help="fedmeta's ways, comma-separated: sequential, vmap, bf16, vmap-bf16, train, train-fedavgcnn ('' for none)",
    )
    ap.add_argument("--methods", default="fedavg,fedrep")
    ap.add_argument(
        "--rounds", type=int, default=4, help="training rounds a run (default 4: 1 warm-up + 3 timed)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="first rounds not timed")
    ap.add_argument("--pairs", type=int, default=1, help="runs of each (peer, method), alternating peers")
    ap.add_argument(
        "--n-train", type=int, default=60_000, help="MNIST training images used (fewer: seed-0 subset)"
    )
    ap.add_argument(
        "--num-clients", type=int, default=Experiment.num_clients, help="clients, 2 label-sorted shards each"
    )
    ap.add_argument("--clients-per-round", type=int, default=None, help="default: half of them")
    ap.add_argument("--data", default=Experiment.data)
    ap.add_argument("--work", default=str(HERE / "work"))
    ap.add_argument("--out", default=None, help="results JSON (default WORK/results-<time>.json)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before a run is killed")
    return ap


def main(argv=None):
    ap = arguments()
    a = ap.parse_args(argv)

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r} (known: {', '.join(METHODS)})")
    if a.warmup >= a.rounds:
        ap.error("--rounds must exceed --warmup (no round would be timed)")
    peers = build_peers(a)
    if not peers:
        ap.error("give at least one peer checkout (--pfllib, --flbench) or fedmeta's ways (--fedmeta)")
    for p in peers:
        if not p.python.is_file():
            refuse(f"no venv for {p.name}: run  bash benchmarks/peers/setup_env.sh {p.name} {p.path}")

    if not 1 <= (a.clients_per_round or 1) <= a.num_clients:
        ap.error(f"--clients-per-round must be between 1 and --num-clients ({a.num_clients})")
    if a.num_clients * Experiment.shards_per_client * 2 > a.n_train:
        ap.error(f"--num-clients {a.num_clients} leaves fewer than 2 images a shard of {a.n_train}")
    exp = Experiment(
        data=a.data,
        n_train=a.n_train,
        rounds=a.rounds,
        warmup=a.warmup,
        num_clients=a.num_clients,
        shards=a.num_clients * Experiment.shards_per_client,
        clients_per_round=a.clients_per_round or a.num_clients // 2,
    )
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else work / f"results-{stamp}.json"

    t = time.time()
    part = make_partition(exp)
    for p in peers:
        p.prepare(exp, part, work / p.name)
    print(f"data prepared in {time.time() - t:.1f} s (partition {part.fingerprint})", flush=True)

    report = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv if argv is None else argv,
        "machine": machine(),
        "experiment": dataclasses.asdict(exp),
        "partition": part.summary(),
        "peers": {
            p.name: {
                "path": str(p.path) if p.path else None,
                "commit": p.commit,
                "commit_source": p.commit_source,
                "changed_files": checkout_changes(p.path) if p.commit_source.startswith("git") else None,
                "python": str(p.python),
                "venv_freeze": venv_freeze(p.python),
            }
            for p in peers
        },
        "runs": [],
    }
    for k in range(a.pairs):
        for method in methods:
            for position, p in enumerate(run_order(peers, k)):
                if method not in p.methods:
                    continue
                log = work / "logs" / f"{stamp}-{p.name}-{method}-{k}.log"
                r = run_one(p, exp, method, work / p.name, log, a.timeout)
                r["pair"], r["position"] = k, position
                report["runs"].append(r)
                res = r["result"] or {}
                print(
                    f"[{k}] {p.name:8s} {method:7s} exit {r['exit_code']}  "
                    f"cpu/round {res.get('cpu_s_per_round')}  wall/round {res.get('wall_s_per_round')}  "
                    f"setup {res.get('setup', {}).get('wall_s') if res.get('setup') else None}  "
                    f"rss {res.get('peak_rss_mb') or 0:.0f} MB  acc {res.get('final_accuracy')}  "
                    f"({r['process_wall_s']:.1f} s)",
                    flush=True,
                )
                if r["exit_code"] != 0 or not r["result"]:
                    print(f"    failed: see {log}", flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1))  # keep what is done if a later run dies
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["summary"] = summarize(report["runs"])
    out.write_text(json.dumps(report, indent=1))
    print_table(report["summary"])
    print(f"results: {out}")
    failed = [r for r in report["runs"] if r["exit_code"] != 0 or not r["result"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
