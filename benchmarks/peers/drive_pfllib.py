"""Run PFLlib's own main.py on the benchmark's experiment and time its rounds.

Run by benchmarks/peers/run.py in PFLlib's venv (benchmarks/peers/.venvs/pfllib), with the cwd
WORK/pfllib/run, where ../dataset/<DATASET>/{train,test}/<client>.npz is the partition that run.py
wrote in PFLlib's format (so PFLlib's relative paths '../dataset', '../results', 'models', 'items'
all land in the work folder, never in the checkout).

Nothing of PFLlib is copied: its system/ folder goes on sys.path, its main.py runs as __main__
(runpy) with its own argparse flags, so it builds its own FedAvgCNN (-m CNN) and its own FedAvg /
FedRep server. The driver only wraps, in this process, three methods of that server class:

  select_clients        first call of each loop iteration  -> round start
  aggregate_parameters  last call of each loop iteration   -> round end
  evaluate              PFLlib's evaluation                -> timed on its own, subtracted from its round

PFLlib's loop runs iterations 0..global_rounds and evaluates at the start of iteration i when
i % eval_gap == 0. With -gr R -eg R it evaluates at iteration 0 (untrained) and at iteration R,
after R rounds of training: that is the final accuracy. Iteration R then trains once more (PFLlib's
loop does, after its last evaluation); it is reported as an untimed tail round.

Prints one line: PEER_RESULT {json}.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402

CLOCK = pc.RoundClock()  # as early as possible: the driver's own start

ALGORITHMS = {"fedavg": "FedAvg", "fedrep": "FedRep"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", required=True)
    ap.add_argument("--dataset", required=True, help="folder name under ../dataset (must contain 'MNIST')")
    ap.add_argument("--method", choices=sorted(ALGORITHMS), required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--num-clients", type=int, default=20)
    ap.add_argument("--join-ratio", type=float, default=0.5)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    system = os.path.join(os.path.abspath(a.checkout), "system")
    main_py = os.path.join(system, "main.py")
    if not os.path.isfile(main_py):
        raise SystemExit(f"no PFLlib main.py at {main_py}")
    if not os.path.isdir(os.path.join("..", "dataset", a.dataset, "train")):
        raise SystemExit(f"cwd {os.getcwd()} has no ../dataset/{a.dataset}/train (run.py prepares it)")
    if "MNIST" not in a.dataset:
        raise SystemExit(
            "PFLlib picks FedAvgCNN(in_features=1, dim=1024) only for a dataset name containing 'MNIST'"
        )

    pc.limit_threads()
    import random

    import numpy as np

    # PFLlib seeds torch (main.py: torch.manual_seed(0); each client: torch.manual_seed(0)) but samples
    # the clients of a round with np.random and drops with random, unseeded: seed them for repeatable runs.
    np.random.seed(a.seed)
    random.seed(a.seed)

    sys.path.insert(0, system)
    from flcore.servers.serveravg import FedAvg
    from flcore.servers.serverrep import FedRep

    server_cls = {"fedavg": FedAvg, "fedrep": FedRep}[a.method]
    state = {"server": None, "model": None}

    def before_select(server):
        if state["server"] is None:
            state["server"] = server
            state["model"] = pc.check_model(server.global_model)  # the full BaseHeadSplit before any round
        CLOCK.round_start()

    pc.wrap_method(server_cls, "select_clients", before=before_select)
    pc.wrap_method(server_cls, "aggregate_parameters", after=lambda s: CLOCK.round_end())
    pc.wrap_method(
        server_cls,
        "evaluate",
        before=lambda s: CLOCK.eval_start(),
        after=lambda s: CLOCK.eval_end("evaluate"),
    )

    R = a.rounds
    argv = [
        main_py,
        "-data",
        a.dataset,
        "-m",
        "CNN",
        "-algo",
        ALGORITHMS[a.method],
        "-dev",
        "cpu",
        "-nc",
        str(a.num_clients),
        "-jr",
        str(a.join_ratio),
        "-ncl",
        "10",
        "-gr",
        str(R),
        "-eg",
        str(R),
        "-ls",
        str(a.local_epochs),
        "-lbs",
        str(a.batch_size),
        "-lr",
        str(a.lr),
        "-t",
        "1",
        "-go",
        "peerbench",
    ]  # FedRep's -pls (head epochs) stays at PFLlib's default; recorded below from the parsed args
    sys.argv = argv
    import runpy

    status = "ok"
    try:
        runpy.run_path(main_py, run_name="__main__")
    except SystemExit as e:  # main.py does not exit on success; anything here is a failure
        if e.code not in (None, 0):
            raise

    server = state["server"]
    if server is None:
        raise SystemExit("PFLlib never started a round")
    n_iter = len(CLOCK.rounds)
    if n_iter != R + 1:
        status = f"expected {R + 1} loop iterations, saw {n_iter}"
    # iterations 0..R-1 are the experiment's R rounds; iteration R is PFLlib's extra one after the final evaluation
    summary = pc.summarize(CLOCK, a.warmup, R)

    args = server.args
    settings = {
        k: v for k, v in sorted(vars(args).items()) if isinstance(v, (int, float, str, bool, type(None)))
    }
    accs = [float(x) for x in server.rs_test_acc]
    eval_rounds = [i for i in range(R + 1) if i % args.eval_gap == 0]
    result = {
        "peer": "pfllib",
        "method": a.method,
        "status": status,
        "rounds_requested": R,
        **summary,
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "accuracy_curve": [{"after_rounds": i, "accuracy": x} for i, x in zip(eval_rounds, accs)],
        "accuracy_protocol": (
            "PFLlib Server.evaluate at the start of iteration R (after R rounds): every client (all 20) gets the "
            "server model by send_models (FedAvg: the whole global model; FedRep: the global base, each client "
            "keeps its own head), then test accuracy = sum of correct / sum of samples over all clients' test "
            "splits (sample-weighted); best_accuracy = max over PFLlib's evaluations (what main.py prints)"
        ),
        "model": state["model"],
        "settings": settings,
        "hooks": [
            "select_clients (round start)",
            "aggregate_parameters (round end)",
            "evaluate (eval, subtracted)",
        ],
        "driver_seed": {"numpy": a.seed, "random": a.seed},
        "env": pc.environment(),
    }
    if a.method == "fedrep":
        result["fedrep"] = {
            "head": "model.fc = Linear(512, 10) (main.py: BaseHeadSplit(base, head))",
            "head_epochs_plocal_epochs": args.plocal_epochs,
            "body_epochs_local_epochs": args.local_epochs,
            "order": "head epochs first (base frozen by requires_grad=False), then body epochs (head frozen)",
            "aggregated": "base only",
        }
    pc.emit(result, CLOCK)


if __name__ == "__main__":
    main()
