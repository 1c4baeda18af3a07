"""The training-clients protocol: each training client keeps a test split out of its training and is
scored on it with the model its method keeps for it (docs/protocol.md)."""

import csv
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmeta.algorithms import build_algorithm
from fedmeta.algorithms.apfl import ALPHA, PERSONAL
from fedmeta.algorithms.fedcp import CONTEXT
from fedmeta.algorithms.gpfl import CONDITION
from fedmeta.config import compose
from fedmeta.data import ImageDataset, build_federation
from fedmeta.engine import Engine
from fedmeta.errors import FedmetaError
from fedmeta.rounds import Federated, evaluate_on_ranks, federated_rounds

TINY = [
    "model.conv_channels=[8,8]",
    "model.dense_units=[32]",
    "federation.num_clients=8",
    "federation.num_new_clients=2",
    "personalization.steps=2",
]


@pytest.fixture(scope="module")
def data(rmnist):
    return ImageDataset(x=rmnist.x[:640], y=rmnist.y[:640], num_classes=10)


def _federation(data, test_fraction, num_new=2, seed=3):
    return build_federation(
        data, {"name": "shards", "shards_per_client": 2}, 8, num_new, 0.2, seed, test_fraction=test_fraction
    )


def test_a_training_clients_test_split_is_kept_out_of_its_training_and_the_new_clients_stay_as_they_were(
    data,
):
    plain, carved = _federation(data, 0.0), _federation(data, 0.2)
    assert [c.id for c in carved.new_clients] == [c.id for c in plain.new_clients]
    for before, after in zip(plain.new_clients, carved.new_clients):  # the paper's protocol is unchanged
        assert after.test is None
        assert torch.equal(before.pers, after.pers) and torch.equal(before.held_out, after.held_out)
    for before, after in zip(plain.train_clients, carved.train_clients):
        everything = set(before.indices("all").tolist())
        test, training = set(after.test.tolist()), set(after.indices("all").tolist())
        assert not test & training and test | training == everything  # out of both splits, nothing lost
        assert len(test) == round(0.2 * len(everything))
        view = after.scoring()  # scored: its test split held out, its training data to personalize on
        assert set(view.held_out.tolist()) == test and set(view.pers.tolist()) == training
    again = _federation(data, 0.2)
    assert all(torch.equal(a.test, b.test) for a, b in zip(carved.train_clients, again.train_clients))
    other = _federation(data, 0.2, seed=4)
    assert any(not torch.equal(a.test, b.test) for a, b in zip(carved.train_clients, other.train_clients))


def test_no_new_clients_only_where_only_the_training_clients_are_scored(data):
    assert compose([*TINY, "federation.num_new_clients=0", "evaluation.protocol=training_clients"])
    for protocol in ("new_clients", "both"):
        with pytest.raises(
            FedmetaError, match=r"between 1 and num_clients-1.*0 only with evaluation.protocol"
        ):
            compose([*TINY, "federation.num_new_clients=0", f"evaluation.protocol={protocol}"])
    with pytest.raises(FedmetaError, match="evaluation.protocol must be one of"):
        compose([*TINY, "evaluation.protocol=seen"])
    federation = _federation(data, 0.2, num_new=0)
    assert not federation.new_clients and len(federation.train_clients) == 8


def _trained(algorithm_name, data, rounds=3, extra=()):
    cfg = compose([*TINY, f"method={algorithm_name}", "evaluation.protocol=both", *extra])
    torch.manual_seed(0)
    run = Federated(build_algorithm(cfg, 10).double(), _federation(data, 0.2), 3)
    run.federation.x = run.federation.x.double()
    for r in range(1, rounds + 1):
        federated_rounds([run], r, 3, engine=Engine(False))
    return cfg, run


def _accuracy(algorithm, params, batch) -> float:
    with torch.no_grad():
        logits = algorithm(params, batch.x, algorithm.prediction_context(batch, batch), batch.mask)
    return (logits.argmax(1) == batch.y).double().mean().item()


# Each kind of state a method keeps per client, made into the client's model by hand from what the
# algorithm stored (its client_states, or FedPAC's heads): a client that never trained has the
# global model's values.
def _own(a, g, i):
    return {**g, **a.client_states.get(i, {})}


HAND = {
    "fedper": lambda a, g, i: _own(a, g, i),  # its own layers
    "fedbn": lambda a, g, i: _own(a, g, i),  # its own batch norms
    "lgfedavg": lambda a, g, i: _own(a, g, i),
    "fedrod": lambda a, g, i: _own(a, g, i),  # its personalized head beside the generic one
    "fedrep": lambda a, g, i: {**g, **{n: a.client_states.get(i, {}).get(n, g[n]) for n in a.head_names}},
    "apfl": lambda a, g, i: {  # v and α as kept, w global
        **g,
        **{PERSONAL + n: a.client_states[i]["v"][n] if i in a.client_states else g[n] for n in g},
        ALPHA: a.client_states[i]["alpha"] if i in a.client_states else torch.tensor(a.cfg.alpha).double(),
    },
    "fedala": lambda a, g, i: {  # its top layers blended with the global ones by its weights
        **g,
        **{
            n: a.client_states[i]["local"][n]
            + (g[n] - a.client_states[i]["local"][n]) * a.client_states[i]["weights"][n]
            if i in a.client_states
            else g[n]
            for n in a.top_names
        },
    },
    "fedproto": lambda a, g, i: {
        **g,
        **a.client_states.get(i, {}),
        **{k: v.double() for k, v in a.prototypes.items()},
    },
    "fedpac": lambda a, g, i: {**g, **a.heads.get(i, {}), **{k: v.double() for k, v in a.prototypes.items()}},
    "fedfomo": lambda a, g, i: _sent(a, i),  # its own last model, as the server keeps it
    "fedamp": lambda a, g, i: _sent(a, i),
    "fedgh": lambda a, g, i: {  # its own extractor (float16) under the global header
        **g,
        **{k: v.double() for k, v in a.client_states.get(i, {}).get("body", {}).items()},
    },
    "feddbe": lambda a, g, i: _own(a, g, i),  # its own PRBM
    "gpfl": lambda a, g, i: {  # its own head, its label shares' mix of the global embeddings
        **g,
        **{n: a.client_states[i][n] for n in a.head_names if i in a.client_states},
        CONDITION: (a.client_states[i]["share"] if i in a.client_states else torch.full((10,), 0.1).double())
        @ g["gce.weight"],
    },
    "fedcp": lambda a, g, i: {  # its own personalized head, and the sum of its weights as v_i
        **g,
        **a.client_states.get(i, {}),
        CONTEXT: F.normalize({**g, **a.client_states.get(i, {})}["personal_head.weight"].sum(0), dim=0),
    },
    "pfedhn": lambda a, g, i: {  # the model the server's network makes for it
        n: t[0].double() for n, t in a.network.made(torch.tensor([i])).items()
    },
}
# per-client state the server keeps (pFedHN: the clients whose embeddings it trained)
STORED = {"fedpac": "heads", "fedfomo": "sent", "fedamp": "sent", "pfedhn": "took_part"}


def _sent(a, i):
    """The client's last model as the server keeps it (float16), or the initial model before it trained."""
    return {k: v.double() for k, v in a.sent.get(i, a.initial).items()}


LONGER = {m: ["method.local_lr=0.1", "method.local_epochs=3"] for m in ("fedbn", "fedrod", "fedala")}
LONGER["pfedhn"] = [*LONGER["fedbn"], "method.server_lr=0.1"]  # the network's few steps move it further


@pytest.mark.parametrize("method", sorted(HAND))
def test_a_training_client_is_scored_with_the_model_its_method_keeps_for_it(method, data):
    """Hand-computed: each training client's accuracy on its test split with the model made from
    its kept state (the global model's values where it never trained) — as it is, no step taken."""
    # layers whose own values move accuracy little (batch norms, a head beside a generic one, a blend)
    # train longer, so a client's kept model predicts otherwise than the global one somewhere
    cfg, run = _trained(method, data, extra=LONGER.get(method, ()))
    algorithm = run.algorithm
    world = SimpleNamespace(world_size=1, global_rank=0)
    result = evaluate_on_ranks(world, [run], cfg.personalization, Engine(False), protocol="both")[0]
    training = result.training
    assert training.clients == "training" and training.curves.shape == (6, 1)  # scored as kept: no step
    stored = getattr(algorithm, STORED.get(method, "client_states"))  # FedPAC's heads, the kept models
    trained = [c for c in run.federation.train_clients if c.id in stored]
    assert 0 < len(trained) < 6  # some clients kept state, some never trained
    global_params = algorithm.global_params()
    apart = 0  # clients whose kept model scores otherwise than the global one: the check tells them apart
    for row, client in zip(training.curves, run.federation.train_clients):
        test = client.scoring().batch("held_out", None)
        expected = _accuracy(algorithm, HAND[method](algorithm, global_params, client.id), test)
        assert row[0].item() == pytest.approx(expected, abs=1e-12), client.id
        apart += expected != _accuracy(algorithm, global_params, test)
    assert apart > 0
    samples = torch.tensor([len(c.test) for c in run.federation.train_clients]).double()
    assert training.weighted_accuracy == pytest.approx(
        (training.curves[:, 0] * samples).sum().item() / samples.sum().item()
    )
    assert result.clients == "new" and result.curves.shape == (2, 3)  # beside it, the new clients'


def test_a_method_that_keeps_no_model_scores_its_training_clients_by_the_new_clients_procedure(data):
    """FedAvg-FT keeps nothing per client: its training clients start from the global model and take
    the shared test-time steps on their own training data, as a new client would."""
    cfg, run = _trained("fedavg_ft", data, extra=["personalization.lr=0.5", "personalization.steps=5"])
    assert not run.algorithm.keeps_client_models and run.algorithm.client_states == {}
    world = SimpleNamespace(world_size=1, global_rank=0)
    training = evaluate_on_ranks(
        world, [run], cfg.personalization, Engine(False), protocol="training_clients"
    )[0]
    assert training.clients == "training" and training.curves.shape == (6, cfg.personalization.steps + 1)
    global_params = run.algorithm.global_params()
    for row, client in zip(training.curves, run.federation.train_clients):
        expected = _accuracy(run.algorithm, global_params, client.scoring().batch("held_out", None))
        assert row[0].item() == pytest.approx(expected, abs=1e-12)  # step 0: the global model
    assert not torch.equal(training.curves[:, 0], training.curves[:, -1])  # the steps moved it


def test_the_test_split_sizes_weigh_the_sample_weighted_accuracy(data):
    from fedmeta.evaluation import PersonalizationResult

    result = PersonalizationResult(torch.tensor([[0.5], [1.0]]), torch.tensor([30, 10]), "training")
    assert result.accuracy == pytest.approx(0.75) and result.weighted_accuracy == pytest.approx(
        (0.5 * 30 + 1.0 * 10) / 40
    )
    dropped = PersonalizationResult(torch.tensor([[float("nan")], [1.0]]), torch.tensor([30, 10]), "training")
    assert dropped.weighted_accuracy == pytest.approx(1.0) and np.isclose(dropped.accuracy, 1.0)


def test_the_table_shows_the_training_clients_beside_the_new_ones_where_runs_scored_both():
    from fedmeta.report import _training_block

    def summary(mean, weighted):
        return {
            "training_clients": {"accuracy": mean, "weighted_accuracy": weighted},
            "folder": None,
            "rounds": 50,
        }

    runs = {
        ("rmnist-shards", "fedrep"): [summary(0.9, 0.8), summary(0.7, 0.6)],
        ("rmnist-shards", "fedavg"): [],
    }
    lines = _training_block(["fedavg", "fedrep"], ["rmnist-shards"], runs, lambda s: "50 rounds")
    assert "| FedRep | 80.00 ± 14.14 / 70.00 ± 14.14 (n=2) |" in lines
    assert not any(line.startswith("| FedAvg") for line in lines)  # no runs: no row
    assert _training_block(["fedavg"], ["rmnist-shards"], {("rmnist-shards", "fedavg"): [{}]}, str) == []


@pytest.mark.slow  # a run through the command line: seconds
def test_a_run_with_no_new_clients_scores_its_training_clients_and_says_so(
    capsys, tmp_path, mnist_dir, monkeypatch
):
    """``evaluation.protocol=training_clients federation.num_new_clients=0``: the run trains on
    every client, scores them on their test splits, prints and keeps that."""
    from fedmeta.cli import main

    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    common = [
        "train",
        "method=fedrep",
        "federation.num_clients=20",
        "federation.num_new_clients=0",
        "evaluation.protocol=training_clients",
        "federation.clients_per_round=4",
        "model.conv_channels=[8,16]",
        "model.dense_units=[32]",
        f"output.root={tmp_path}",
        "logger=[]",
    ]
    assert main([*common, "federation.rounds=2"]) == 0
    said = capsys.readouterr().out
    assert "training-client accuracy on their test splits:" in said and "over 20 clients" in said
    assert "new-client accuracy" not in said
    run = tmp_path / "rmnist-shards" / "fedrep" / "seed0"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["protocol"] == "training_clients" and summary["new_clients"] == 0
    assert summary["training_clients"]["clients"] == 20
    assert summary["accuracy"] == summary["training_clients"]["accuracy"]
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert float(rows[-1]["training_clients_weighted_accuracy"]) == pytest.approx(
        summary["training_clients"]["weighted_accuracy"]
    )


@pytest.mark.parametrize("protocol", ["training_clients", "both"])
def test_a_checkpoints_history_gives_back_the_training_clients_result(protocol):
    """What a resumed run's summary reads: the last evaluation as its protocol scored it."""
    from fedmeta.evaluation import PersonalizationResult
    from fedmeta.run import _history_of, _result_of

    training = PersonalizationResult(torch.tensor([[0.5], [1.0]]), torch.tensor([30, 10]), "training")
    result = training if protocol == "training_clients" else PersonalizationResult(torch.tensor([[0.2, 0.4]]))
    if protocol == "both":
        result.training = training
    history = {"last_curves": result.curves, **_history_of(result)}
    back = _result_of(history, protocol)
    assert back.clients == ("training" if protocol == "training_clients" else "new")
    assert back.training_clients.weighted_accuracy == pytest.approx(training.weighted_accuracy)
    assert torch.equal(back.curves, result.curves)
    assert _history_of(PersonalizationResult(torch.tensor([[0.2]]))) == {}  # the new clients' only
