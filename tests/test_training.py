"""Short real runs on RMNIST shards: learning on new clients, the run folder, reproducibility."""

import csv
import json
import statistics

import pytest
import torch

from fedmeta.algorithms import build_algorithm
from fedmeta.cli import main
from fedmeta.config import compose, run_name
from fedmeta.loop import train

SMALL_CNN = ("model.conv_channels=[8,16]", "model.dense_units=[64]")


def config(tmp_path, mnist_dir, *overrides):
    return compose([f"dataset.dir={mnist_dir}", f"output.root={tmp_path}", "wandb.mode=disabled", *overrides])


@pytest.fixture(scope="module")
def cafeme_run(tmp_path_factory, mnist_dir):
    root = tmp_path_factory.mktemp("runs")
    cfg = config(
        root,
        mnist_dir,
        "method=cafeme",
        "federation.rounds=8",
        "federation.eval_every=4",
        "federation.num_new_clients=10",
        "personalization.steps=20",
    )
    return cfg, train(cfg, show_progress=False)


@pytest.mark.slow  # the module's 8-round CAFeMe run: 1.5 min
def test_cafeme_learns_to_personalize_new_clients(cafeme_run):
    _, summary = cafeme_run
    assert len(summary["curve"]) == 21
    assert summary["accuracy"] > 0.6  # chance is 0.1
    assert summary["accuracy"] > summary["curve"][0] + 0.15  # personalization helps
    assert 0 <= summary["accuracy_std"] < 0.5


@pytest.mark.slow  # the module's 8-round CAFeMe run: 1.5 min
def test_run_folder_holds_config_metrics_summary_and_checkpoint(cafeme_run):
    cfg, summary = cafeme_run
    run_dir = cfg.output.root / run_name(cfg)
    assert (run_dir / "config.yaml").exists()
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert [int(r["round"]) for r in rows] == list(range(1, 9))
    assert [bool(r["eval_accuracy"]) for r in rows] == [False] * 3 + [True] + [False] * 3 + [True]
    beside = [float(r["beside_cores"]) for r in rows]  # what else ran: every round says, ≥ 0 cores
    assert len(beside) == 8 and min(beside) >= 0
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["beside_cores"] == pytest.approx(statistics.median(beside))
    assert on_disk["accuracy"] == summary["accuracy"] and on_disk["rounds"] == 8
    assert {"accuracy", "accuracy_std", "curve", "rounds", "seconds"} <= on_disk.keys()
    curves = list(csv.DictReader(open(run_dir / "curves.csv")))
    assert len(curves) == 2 * 21

    checkpoint = torch.load(run_dir / "checkpoint.ckpt", weights_only=False)
    restored = build_algorithm(cfg, 10)
    restored.load_federation_state(checkpoint["federation"])
    fresh = build_algorithm(cfg, 10)
    assert checkpoint["round"] == 8
    assert any(not torch.equal(a, b) for a, b in zip(restored.parameters(), fresh.parameters()))


@pytest.mark.slow  # the module's 8-round CAFeMe run: 1.5 min
def test_finished_run_is_not_overwritten(cafeme_run, capsys):
    cfg, _ = cafeme_run
    code = main(
        ["train", "method=cafeme", f"dataset.dir={cfg.dataset.dir}", f"output.root={cfg.output.root}"]
    )
    assert code == 2 and "already holds a finished run" in capsys.readouterr().err


@pytest.mark.slow
def test_fedavg_ft_fine_tunes_and_fedavg_does_not(tmp_path, mnist_dir):
    local = [
        "method.local_lr=0.05",
        "method.local_epochs=1",
        "federation.rounds=5",
    ]  # the same training for both
    fedavg_ft = train(
        config(
            tmp_path,
            mnist_dir,
            "method=fedavg_ft",
            *local,
            "personalization.steps=20",
            "personalization.lr=0.01",
        ),
        show_progress=False,
    )
    assert len(fedavg_ft["curve"]) == 21
    assert fedavg_ft["accuracy"] > fedavg_ft["curve"][0] + 0.1 and fedavg_ft["accuracy"] > 0.4
    fedavg = train(config(tmp_path, mnist_dir, "method=fedavg", *local), show_progress=False)
    assert len(fedavg["curve"]) == 1
    assert fedavg["accuracy"] == pytest.approx(fedavg_ft["curve"][0])  # same training, same global model


@pytest.mark.slow
def test_same_seed_same_result_and_wandb_offline_run(tmp_path, mnist_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = ["method=fedavg_ft", "variant=tuned", "federation.rounds=2", "personalization.steps=3"]
    args += [
        "model.conv_channels=[8,16]",
        "model.dense_units=[32]",
    ]  # the same seed, not learning, is checked
    first = train(config(tmp_path / "a", mnist_dir, *args), show_progress=False)
    second = train(config(tmp_path / "b", mnist_dir, *args), show_progress=False)
    assert first["curve"] == second["curve"]
    run_dir = tmp_path / "a" / run_name(config(tmp_path, mnist_dir, *args))
    assert list((run_dir / "wandb").glob("offline-run-*"))
    third = train(config(tmp_path / "c", mnist_dir, *args, "seed=1"), show_progress=False)
    assert third["curve"] != first["curve"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cafeme variant=authors", "fedavg"])
def test_clients_run_side_by_side_give_the_same_model(tmp_path, mnist_dir, method):
    """federation.client_threads=2 runs a round's clients two at a time: the global model after two
    rounds and the new clients' accuracies are exactly those of one client after another."""
    from fedmeta.assemble import make_engine, setup
    from fedmeta.rounds import Federated, evaluate_on_ranks, federated_round

    outcomes = []
    for threads in (1, 2):
        cfg = config(
            tmp_path,
            mnist_dir,
            *method.replace("cafeme", "method=cafeme")
            .replace("fedavg", "method=fedavg method.local_epochs=1")
            .split(),
            "federation.num_new_clients=4",
            "personalization.steps=3",
            f"federation.client_threads={threads}",
        )
        fabric, federation, algorithm = setup(cfg)
        engine = make_engine(cfg, fabric.device)
        for round_ in (1, 2):
            federated_round(algorithm, federation, round_, 5, seed=0, engine=engine)
        result = evaluate_on_ranks(
            fabric, [Federated(algorithm, federation, 0)], cfg.personalization, engine
        )[0]
        outcomes.append(({k: v.clone() for k, v in algorithm.model.state_dict().items()}, result.curves))
    torch.set_num_threads(1)  # two client threads set it for the process
    (model_1, curves_1), (model_2, curves_2) = outcomes
    assert all(torch.equal(model_1[k], model_2[k]) for k in model_1)
    assert torch.equal(curves_1, curves_2)


@pytest.mark.slow
def test_bf16_mixed_personalization_learns(tmp_path, mnist_dir):
    """Under fabric.precision=bf16-mixed, in-place fine-tuning steps must reach the next forward
    pass (autocast caches low-precision weight copies until it exits: it is entered per forward)."""
    from fedmeta.assemble import setup
    from fedmeta.evaluation import personalize_client

    cfg = config(
        tmp_path,
        mnist_dir,
        "method=fedavg_ft",
        "fabric.precision=bf16-mixed",
        "personalization.lr=0.05",
        "personalization.steps=20",
    )
    _, federation, algorithm = setup(cfg)
    _, curve = personalize_client(algorithm, federation.new_clients[0], cfg.personalization)
    assert curve[-1] > curve[0] + 0.3


@pytest.mark.slow
@pytest.mark.parametrize("precision, dtype", [("64-true", torch.float64), ("bf16-true", torch.bfloat16)])
def test_true_precisions_convert_the_model_and_train(tmp_path, mnist_dir, precision, dtype):
    """Fabric's "-true" precisions reach the model (fabric.setup_module) and its inputs: the
    parameters and the logits have the precision's dtype, and training still learns."""
    from fedmeta.assemble import setup
    from fedmeta.evaluation import personalize_client
    from fedmeta.rounds import federated_round

    cfg = config(
        tmp_path,
        mnist_dir,
        "method=fedavg_ft",
        "variant=tuned",
        f"fabric.precision={precision}",
        "personalization.lr=0.05",
        "personalization.steps=10",
        *SMALL_CNN,  # a CPU's bfloat16 and float64 are slow: the full CNN took 4 minutes here
    )
    _, federation, algorithm = setup(cfg)
    assert {p.dtype for p in algorithm.model.parameters()} == {dtype}
    client = federation.new_clients[0]
    assert algorithm(algorithm.global_params(), client.batch("pers", 4).x).dtype in (dtype, torch.float32)
    losses = [federated_round(algorithm, federation, r, 5, cfg.seed).loss for r in range(1, 4)]
    assert losses[-1] < losses[0]
    _, curve = personalize_client(algorithm, client, cfg.personalization)
    assert curve[-1] > curve[0] + 0.2 and {p.dtype for p in algorithm.model.parameters()} == {dtype}
