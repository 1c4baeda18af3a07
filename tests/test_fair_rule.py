"""One test-time rule for every method (``personalization.lr_rule=selected``): the step size is chosen
from one grid on training clients' test splits, never on the clients it scores, and recorded; a kept
run re-scores from its compact final model (``model.pt``) as from its checkpoint."""

import json

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from fedmeta.assemble import setup
from fedmeta.cli import main
from fedmeta.config import compose
from fedmeta.engine import Engine
from fedmeta.errors import FedmetaError
from fedmeta.evaluation import Diverged
from fedmeta.rounds import (
    Federated,
    evaluate_on_ranks,
    scored_clients,
    scored_training_clients,
    validation_clients,
)

TINY = [
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "federation.num_new_clients=4",
    "federation.clients_per_round=3",
    "personalization.steps=2",
    "personalization.select_clients=5",
    "logger=[]",
]


class ScriptedEngine:
    """Stands in for fedmeta.engine.Engine: each client's curve is ``score(lr)``; what it was asked
    to personalize, at which step size, is recorded."""

    def __init__(self, score):
        self.score, self.calls = score, []

    def personalization_curves(self, lanes, cfg, done=lambda n: None, kept=False):
        self.calls.append((cfg.lr, [client for _, client in lanes]))
        accuracy = self.score(cfg.lr)
        if accuracy is None:
            raise Diverged("personalizing client 0 gave a non-finite loss")
        done(len(lanes))
        return torch.full((len(lanes), cfg.steps + 1), accuracy)


@pytest.fixture(scope="module")
def federated(mnist_dir):
    cfg = compose(["method=fedavg_ft", *TINY, "personalization.lr_rule=selected", f"dataset.dir={mnist_dir}"])
    fabric, federation, algorithm = setup(cfg)
    return fabric, cfg, Federated(algorithm, federation, cfg.seed)


def test_the_step_size_is_chosen_on_validation_clients_never_on_the_scored_ones(federated):
    fabric, cfg, run = federated
    engine = ScriptedEngine(lambda lr: {0.001: 0.2, 0.003: 0.5, 0.01: 0.9, 0.03: 0.7, 0.1: 0.1}[lr])
    result = evaluate_on_ranks(fabric, [run], cfg.personalization, engine)[0]
    assert result.lr == 0.01 and result.accuracy == pytest.approx(0.9)
    assert result.lr_selection == pytest.approx({0.001: 0.2, 0.003: 0.5, 0.01: 0.9, 0.03: 0.7, 0.1: 0.1})
    *choosing, (scored_lr, scored) = engine.calls
    assert [lr for lr, _ in choosing] == list(cfg.personalization.lr_grid) and scored_lr == 0.01
    new = {client.id for client in run.federation.new_clients}
    assert {client.id for client in scored} == new
    train = {client.id: client for client in run.federation.train_clients}
    for _, clients in choosing:
        assert len(clients) == 5 and not {client.id for client in clients} & new
        for client in clients:  # fine-tuned on what it trained on, scored on what it never did
            assert torch.equal(client.held_out, train[client.id].test)
            assert not set(client.held_out.tolist()) & set(train[client.id].indices("all").tolist())
    # the same clients at every candidate and every evaluation, drawn by the run's seed
    assert [c.id for c in validation_clients(run, 5)] == [c.id for c in choosing[0][1]]


def test_the_training_clients_protocol_leaves_out_the_clients_that_chose_the_step_size(federated):
    """Their test splits chose the step size: scoring them with it would score the choice on its own
    data. Every method of a seed leaves out the same ones (one without steps too), so the methods'
    training-client numbers are over the same clients."""
    fabric, cfg, run = federated
    engine = ScriptedEngine(lambda lr: 0.5)
    evaluate_on_ranks(fabric, [run], cfg.personalization, engine, protocol="both")
    *choosing, (_, new), (_, training) = engine.calls
    chose = {client.id for client in choosing[0][1]}
    every = {client.id for client in run.federation.train_clients}
    assert {client.id for client in training} == every - chose and len(chose) == 5
    assert scored_clients([run], "both", 0, 1, cfg.personalization)[0] == (
        len(new) + len(training) + 5 * len(cfg.personalization.lr_grid)
    )
    own = cfg.personalization.copy()
    own.lr_rule = "method"
    assert len(scored_training_clients(run, own)) == len(every)
    without_steps = OmegaConf.merge(cfg.personalization, {"steps": 0})
    assert [c.id for c in scored_training_clients(run, without_steps)] == [c.id for c in training]


@pytest.mark.parametrize("vectorize", [False, True], ids=["one-at-a-time", "vmapped"])
@pytest.mark.parametrize("method", ["fedavg_ft", "cafeme"])
def test_a_candidate_scored_after_its_last_step_only_gets_its_curves_last_number(
    method, vectorize, mnist_dir
):
    """A step-size candidate is scored once, after its last step (``every_step`` false), not after
    each: exactly the full curve's last number, and not the one before it."""
    cfg = compose([f"method={method}", *TINY, "personalization.lr_rule=selected", f"dataset.dir={mnist_dir}"])
    fabric, federation, algorithm = setup(cfg)
    lanes = [(algorithm, c) for c in validation_clients(Federated(algorithm, federation, cfg.seed), 5)]
    engine = Engine(vectorize=vectorize)
    full_curve = OmegaConf.merge(cfg.personalization, {"lr": 0.1})
    last_only = OmegaConf.merge(full_curve, {})
    with open_dict(last_only):
        last_only.every_step = False
    full = engine.personalization_curves(lanes, full_curve)
    last = engine.personalization_curves(lanes, last_only)
    assert full.shape == (5, cfg.personalization.steps + 1) and last.shape == (5, 1)
    assert torch.equal(last[:, 0], full[:, -1])
    assert not torch.equal(full[:, -1], full[:, -2])  # the last step changed some client's score


def test_a_tie_takes_the_smaller_step_size_and_a_diverging_one_scores_nothing(federated):
    fabric, cfg, run = federated
    engine = ScriptedEngine(lambda lr: None if lr >= 0.03 else (0.8 if lr >= 0.003 else 0.1))
    result = evaluate_on_ranks(fabric, [run], cfg.personalization, engine)[0]
    assert result.lr == 0.003 and result.lr_selection[0.1] == 0.0
    with pytest.raises(FedmetaError, match="every step size of personalization.lr_grid"):
        evaluate_on_ranks(fabric, [run], cfg.personalization, ScriptedEngine(lambda lr: None))


def test_the_method_rule_scores_at_the_methods_own_step_size_and_chooses_nothing(federated):
    fabric, cfg, run = federated
    engine = ScriptedEngine(lambda lr: 0.5)
    own = cfg.personalization.copy()
    own.lr_rule = "method"
    result = evaluate_on_ranks(fabric, [run], own, engine)[0]
    assert [lr for lr, _ in engine.calls] == [own.lr] and result.lr == own.lr and result.lr_selection is None


@pytest.mark.parametrize(
    "override, said",
    [
        ("personalization.lr_rule=best", "personalization.lr_rule must be one of method, selected"),
        ("personalization.lr_grid=[]", "personalization.lr_grid must list 1 to 16 distinct step sizes"),
        ("personalization.lr_grid=[0.1,0]", "personalization.lr_grid must list"),
        ("personalization.lr_grid=[0.1,0.1]", "personalization.lr_grid must list"),
        ("personalization.select_clients=0", "personalization.select_clients must be an integer ≥ 1"),
        ("output.keep_model=int8", "output.keep_model must be float16, bfloat16, float32 or none"),
        ("output.keep_model_mib=0", "output.keep_model_mib must be a size in MiB"),
    ],
)
def test_a_rule_or_kept_model_setting_that_is_not_one_is_one_line(override, said, capsys):
    assert main(["train", "--print-config", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mnist_dir):
    """A FedAvg-FT run under the rule, its model kept in float32, and one under the method's own rule."""
    root = tmp_path_factory.mktemp("fair")
    common = ["train", "method=fedavg_ft", *TINY, "federation.rounds=2", f"dataset.dir={mnist_dir}"]
    assert (
        main(
            [*common, f"output.root={root}", "personalization.lr_rule=selected", "output.keep_model=float32"]
        )
        == 0
    )
    assert main([*common, f"output.root={root / 'own'}"]) == 0
    return (
        root / "rmnist-shards" / "fedavg_ft" / "seed0",
        root / "own" / "rmnist-shards" / "fedavg_ft" / "seed0",
    )


def test_a_run_under_the_rule_records_its_choice_in_its_summary_and_metrics(trained):
    run, _ = trained
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lr_rule"] == "selected" and summary["personalization_lr"] in (
        0.001,
        0.003,
        0.01,
        0.03,
        0.1,
    )
    assert set(summary["lr_selection"]) == {"0.001", "0.003", "0.01", "0.03", "0.1"}
    assert (
        max(summary["lr_selection"].values()) == summary["lr_selection"][f"{summary['personalization_lr']:g}"]
    )
    last = (run / "metrics.csv").read_text().splitlines()[-1].split(",")
    assert float(last[-1]) == summary["personalization_lr"]
    assert summary["kept_model"] == {"dtype": "float32", "mib": pytest.approx(0.2, abs=0.2), "left_out": []}


def test_a_kept_run_re_scores_from_its_model_as_from_its_checkpoint(trained, tmp_path):
    import shutil

    run, _ = trained
    kept = tmp_path / "rmnist-shards" / "fedavg_ft" / "seed0"
    shutil.copytree(run, kept)
    (kept / "checkpoint.ckpt").unlink()  # as the tables' folders hold it
    rule = ["personalization.lr_rule=method", "personalization.lr=0.05"]
    assert main(["evaluate", str(run), *rule]) == 0
    assert main(["evaluate", str(kept), *rule]) == 0
    from_checkpoint = json.loads((run / "evaluations.jsonl").read_text().splitlines()[-1])
    from_model = json.loads((kept / "evaluations.jsonl").read_text().splitlines()[-1])
    assert from_model["model"] == "model.pt (float32)" and from_checkpoint["model"] == "checkpoint.ckpt"
    assert from_model["curve"] == from_checkpoint["curve"] and from_model["personalization_lr"] == 0.05
    assert main(["evaluate", str(kept)]) == 0  # its own rule again: its own number
    again = json.loads((kept / "evaluations.jsonl").read_text().splitlines()[-1])
    assert again["accuracy"] == json.loads((run / "summary.json").read_text())["accuracy"]


def test_evaluate_never_chooses_on_data_the_model_trained_on_nor_takes_a_chosen_lr(trained, capsys):
    selected, own = trained
    assert main(["evaluate", str(own), "personalization.lr_rule=selected"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained on all of its training clients' data" in err
    assert main(["evaluate", str(own), "evaluation.protocol=both"]) == 2  # nor score clients it trained on
    assert "trained on all of its training clients' data" in capsys.readouterr().err
    assert main(["evaluate", str(selected), "personalization.lr=0.05"]) == 2
    assert "add personalization.lr_rule=method" in capsys.readouterr().err


def test_a_model_over_its_size_leaves_out_the_client_states_and_says_so(tmp_path, mnist_dir, capsys):
    common = ["train", "method=fedrep", *TINY, "federation.rounds=2", f"dataset.dir={mnist_dir}"]
    extra = [f"output.root={tmp_path}", "evaluation.protocol=both", "output.keep_model_mib=0.01"]
    assert main([*common, *extra]) == 0
    run = tmp_path / "rmnist-shards" / "fedrep" / "seed0"
    assert json.loads((run / "summary.json").read_text())["kept_model"]["left_out"] == ["client_states"]
    (run / "checkpoint.ckpt").unlink()
    capsys.readouterr()
    assert main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "left out client_states" in err
        and "training clients cannot be scored" in err
    )
    assert main(["evaluate", str(run), "evaluation.protocol=new_clients"]) == 0  # its new clients alone
    record = json.loads((run / "evaluations.jsonl").read_text().splitlines()[-1])
    assert record["protocol"] == "new_clients" and "training_clients" not in record
