"""Run FL-bench's own main.py on the benchmark's experiment and time its rounds.

Run by benchmarks/peers/run.py in FL-bench's venv (benchmarks/peers/.venvs/flbench). FL-bench finds
its data from the location of its source (FLBENCH_ROOT = src/utils/constants.py/../../..), so run.py
lays out a root in the work folder made of symlinks into the checkout (src, config, main.py,
data/utils) beside a real data/mnist/ holding the partition in FL-bench's format (MNIST/raw idx
files read by its torchvision-based MNIST class, partition.pkl, args.json). Python does not
resolve the symlinks in __file__, so FL-bench takes that folder as its root: it reads our data and
writes its out/ there, never into the checkout, and no code of it is copied.

FL-bench's main.py runs as __main__ (runpy) with hydra command-line overrides; it builds its own
"avgcnn" model (src/utils/models.py FedAvgCNN) and its own FedAvgServer / FedRepServer. The driver
wraps, in this process only:

  <Server>.train_one_round      one training round (clients' train + aggregate) -> round start/end
  <Server>.test_client_models   FL-bench's evaluation -> timed on its own (it runs outside rounds)
  <Server>.test_global_model    (server-side evaluation: switched off here, wrapped for safety)

and sets src.utils.constants.DATA_STD["mnist"] = [0.3081] (FL-bench ships 0.3015) so that its own
Normalize transform uses the experiment's mean/std.

Prints one line: PEER_RESULT {json}.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as pc  # noqa: E402

CLOCK = pc.RoundClock()

MEAN, STD = 0.1307, 0.3081


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="the shadow FL-bench root that run.py laid out")
    ap.add_argument("--method", choices=["fedavg", "fedrep"], required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--join-ratio", type=float, default=0.5)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--fedrep-head-epochs", type=int, default=1)
    ap.add_argument("--fedrep-body-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    root = os.path.abspath(a.root)
    main_py = os.path.join(root, "main.py")
    for need in ("main.py", "src/server/fedavg.py", "config/defaults.yaml", "data/mnist/partition.pkl"):
        if not os.path.exists(os.path.join(root, need)):
            raise SystemExit(f"{root} lacks {need} (run.py lays it out)")

    pc.limit_threads()
    sys.path.insert(0, root)
    import src.utils.constants as C

    if os.path.abspath(str(C.FLBENCH_ROOT)) != root:
        raise SystemExit(f"FL-bench took {C.FLBENCH_ROOT} as its root, not {root}")
    shipped_norm = {"mean": list(C.DATA_MEAN["mnist"]), "std": list(C.DATA_STD["mnist"])}
    C.DATA_MEAN["mnist"] = [MEAN]  # the dicts fedavg.py reads (imported by name, same objects)
    C.DATA_STD["mnist"] = [STD]

    from src.server.fedavg import FedAvgServer
    from src.server.fedrep import FedRepServer

    server_cls = {"fedavg": FedAvgServer, "fedrep": FedRepServer}[a.method]
    state = {"server": None, "model": None}

    def before_round(server):
        if state["server"] is None:
            state["server"] = server
            state["model"] = pc.check_model(server.model)
        CLOCK.round_start()

    pc.wrap_method(server_cls, "train_one_round", before=before_round, after=lambda s: CLOCK.round_end())
    for name in ("test_client_models", "test_global_model"):
        pc.wrap_method(
            server_cls, name, before=lambda s: CLOCK.eval_start(), after=lambda s, n=name: CLOCK.eval_end(n)
        )

    R = a.rounds
    if a.method == "fedrep":
        # FL-bench's FedRep trains the head for local_epoch - train_body_epoch epochs, then the body for
        # train_body_epoch epochs: PFLlib's default (1 head epoch, then 1 body epoch) is
        # local_epoch=2, train_body_epoch=1.
        local_epoch = a.fedrep_head_epochs + a.fedrep_body_epochs
        method_overrides = [f"+fedrep.train_body_epoch={a.fedrep_body_epochs}"]
    else:
        local_epoch = a.local_epochs
        method_overrides = []
    overrides = [
        f"method={a.method}",
        "dataset.name=mnist",
        "model.name=avgcnn",
        "model.use_torchvision_pretrained_weights=false",
        "optimizer.name=sgd",
        f"optimizer.lr={a.lr}",
        "optimizer.momentum=0",
        "optimizer.weight_decay=0",
        "optimizer.dampening=0",
        "optimizer.nesterov=false",
        "lr_scheduler.name=null",
        "mode=serial",
        f"common.seed={a.seed}",
        f"common.join_ratio={a.join_ratio}",
        f"common.global_epoch={R}",
        f"common.local_epoch={local_epoch}",
        f"common.batch_size={a.batch_size}",
        "common.reset_optimizer_on_global_epoch=true",
        "common.straggler_ratio=0",
        "common.buffers=global",
        # evaluation only at the end: no client-side before/after-training evaluation in the rounds,
        # client test once after round R, no centralized (server-side) test
        "common.client_side_evaluation=false",
        f"common.test.client.interval={R}",
        "common.test.client.finetune_epoch=0",
        "common.test.client.train=false",
        "common.test.client.val=false",
        "common.test.client.test=true",
        "common.test.server.interval=-1",
        "common.monitor=null",
        "common.use_cuda=false",
        # post-run artefacts that would pull matplotlib/pandas writing into the timing-free tail: off
        "common.save_learning_curve_plot=false",
        "common.save_metrics=false",
        "common.save_model=false",
        *method_overrides,
    ]
    sys.argv = [main_py, *overrides]
    import runpy

    status = "ok"
    try:
        runpy.run_path(main_py, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise

    server = state["server"]
    if server is None:
        raise SystemExit("FL-bench never started a round")
    if len(CLOCK.rounds) != R:
        status = f"expected {R} rounds, saw {len(CLOCK.rounds)}"
    summary = pc.summarize(CLOCK, a.warmup, R)

    from omegaconf import OmegaConf

    final = server.test_results.get(R, {}).get("all_clients")
    acc = None
    n_test = None
    if final is not None:
        m = final["before"]["test"]
        acc = m.accuracy / 100.0
        n_test = len(m._targets)
    curve = [
        {"after_rounds": int(e), "accuracy": r["all_clients"]["before"]["test"].accuracy / 100.0}
        for e, r in sorted(server.test_results.items())
        if "all_clients" in r
    ]
    result = {
        "peer": "flbench",
        "method": a.method,
        "status": status,
        "rounds_requested": R,
        **summary,
        "final_accuracy": acc,
        "best_accuracy": max((c["accuracy"] for c in curve), default=None),
        "accuracy_curve": curve,
        "final_test_samples": n_test,
        "accuracy_protocol": (
            "FL-bench test_client_models after round R (common.test.client.interval=R): every client (train = "
            "val = test clients, split 'sample') loads the server's parameters plus its own personal ones "
            "(FedAvg: none; FedRep: its classifier) and predicts its test split; accuracy over the "
            "concatenated predictions of all clients = sample-weighted ('before' fine-tuning, finetune_epoch=0)"
        ),
        "model": state["model"],
        "settings": OmegaConf.to_container(server.args, resolve=True),
        "normalization": {"shipped": shipped_norm, "used": {"mean": [MEAN], "std": [STD]}},
        "hooks": [
            f"{server_cls.__name__}.train_one_round (round)",
            "test_client_models / test_global_model (eval, outside rounds)",
            "src.utils.constants.DATA_MEAN/DATA_STD['mnist'] set to 0.1307/0.3081",
        ],
        "env": pc.environment(),
    }
    if a.method == "fedrep":
        result["fedrep"] = {
            "head": "classifier = Linear(512, 10) "
            "(FedAvgCNN.classifier; personal params: names containing 'classifier')",
            "head_epochs": local_epoch - a.fedrep_body_epochs,
            "body_epochs_train_body_epoch": a.fedrep_body_epochs,
            "local_epoch": local_epoch,
            "order": "head epochs first (base grads zeroed after backward), then body epochs (classifier grads zeroed)",
        }
    pc.emit(result, CLOCK)


if __name__ == "__main__":
    main()
