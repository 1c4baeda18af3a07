"""Ditto (Li et al. 2021), Algorithm 1: each training client keeps a personal model v_k, trained in
each round it takes part on its loss plus λ/2‖v − w^t‖² toward the global model it received; w is
FedAvg's, untouched by v; the training-clients protocol scores v_k as it is. In float64."""

from types import SimpleNamespace

import pytest
import torch

from fedmeta.algorithms import build_algorithm
from fedmeta.config import compose
from fedmeta.data import ImageDataset, build_federation
from fedmeta.engine import Engine
from fedmeta.rounds import Federated, evaluate_on_ranks, federated_round

TINY = [
    "model.conv_channels=[8,8]",
    "model.dense_units=[32]",
    "wandb.mode=disabled",
    "federation.num_clients=8",
    "federation.num_new_clients=2",
    "personalization.steps=2",
    "method.local_epochs=1",
    "method.local_lr=0.05",
]
PER_ROUND = 3


@pytest.fixture(scope="module")
def federation(rmnist):
    """8 clients (2 new) of two label shards each, in float64; training clients keep test splits."""
    data = ImageDataset(x=rmnist.x[:960], y=rmnist.y[:960], num_classes=10)
    built = build_federation(
        data, {"name": "shards", "shards_per_client": 2}, 8, 2, 0.2, 3, test_fraction=0.2
    )
    built.x = built.x.double()
    return built


def built(method: str, *overrides: str):
    cfg = compose([f"method={method}", *TINY, *overrides])
    torch.manual_seed(0)
    return cfg, build_algorithm(cfg, 10).double()


def hand_personal(algorithm, v: dict, anchor: dict, batches, lr: float, lam: float) -> dict:
    """Ditto's personal steps written out: v ← v − η(∇f_k(v) + λ(v − w^t)) on each batch."""
    for batch in batches:
        p = {n: t.detach().clone().requires_grad_() for n, t in v.items()}
        loss = algorithm.loss(p, batch)
        grads = torch.autograd.grad(loss, list(p.values()))
        v = {n: p[n].detach() - lr * (g + lam * (p[n].detach() - anchor[n])) for n, g in zip(p, grads)}
    return v


def distance(a: dict, b: dict) -> float:
    return sum(((a[n] - b[n]) ** 2).sum() for n in b).sqrt().item()


def twice_sampled(federation, rounds: int) -> tuple[int, list[int]]:
    """A training client sampled in at least two of the first ``rounds`` rounds, and those rounds."""
    taken: dict[int, list[int]] = {}
    for r in range(1, rounds + 1):
        for client in federation.sample_round(r, PER_ROUND, 0):
            taken.setdefault(client.id, []).append(r)
    client_id, in_rounds = next((i, rs) for i, rs in sorted(taken.items()) if len(rs) >= 2)
    return client_id, in_rounds


@pytest.mark.parametrize("personal_epochs", [None, 2])  # w's own batches; epochs of its own
def test_a_training_clients_personal_model_is_kept_and_moves_and_w_is_fedavgs(federation, personal_epochs):
    extra = [] if personal_epochs is None else [f"method.personal_epochs={personal_epochs}"]
    cfg, ditto = built("ditto", *extra)
    _, fedavg = built("fedavg")
    assert all(torch.equal(p, fedavg.global_params()[n]) for n, p in ditto.global_params().items())
    client_id, in_rounds = twice_sampled(federation, 4)
    client = next(c for c in federation.train_clients if c.id == client_id)
    kept = []
    for r in range(1, in_rounds[1] + 1):
        w_t = {n: p.clone() for n, p in ditto.global_params().items()}
        before = ditto.client_states.get(client_id, {}).get("v", w_t)  # first time: the w it receives
        federated_round(ditto, federation, r, PER_ROUND, seed=0)
        federated_round(fedavg, federation, r, PER_ROUND, seed=0)
        for name, p in ditto.global_params().items():  # v never feeds back: w is FedAvg's, bit for bit
            assert torch.equal(p, fedavg.global_params()[name]), (r, name)
        if r in in_rounds:
            data = ditto.draw(client, r)
            batches = data.get("personal", data["epochs"])
            if personal_epochs is None:
                assert "personal" not in data  # v's steps read w's very batches
            v = ditto.client_states[client_id]["v"]
            expected = hand_personal(ditto, before, w_t, batches, cfg.method.local_lr, cfg.method.lam)
            for name in v:
                torch.testing.assert_close(v[name], expected[name], rtol=1e-9, atol=1e-12)
            kept.append({n: t.clone() for n, t in v.items()})
    first, second = kept
    w = ditto.global_params()
    assert distance(second, first) > 0 and distance(second, w) > 0 and distance(first, w) > 0
    assert set(ditto.client_states) <= {c.id for c in federation.train_clients}


def test_a_training_clients_personal_model_is_pulled_toward_w_more_as_lambda_grows(federation):
    client = federation.sample_round(1, PER_ROUND, 0)[0]
    distances = []
    for lam in (0.0, 0.1, 10.0):
        _, ditto = built("ditto", f"method.lam={lam}")
        w_t = {n: p.clone() for n, p in ditto.global_params().items()}
        federated_round(ditto, federation, 1, PER_ROUND, seed=0)
        distances.append(distance(ditto.client_states[client.id]["v"], w_t))
    assert distances[0] > distances[1] > distances[2] > 0


def test_training_clients_are_scored_with_their_own_personal_model(federation):
    """Under the training-clients protocol a client that took part is scored with its v_k as it is
    (no step taken), one that never took part with the global model."""
    cfg, ditto = built("ditto", "evaluation.protocol=training_clients")
    assert ditto.keeps_client_models
    run = Federated(ditto, federation, 0)
    for r in (1, 2):
        federated_round(ditto, federation, r, PER_ROUND, seed=0)
    w = ditto.global_params()
    trained = [c for c in federation.train_clients if c.id in ditto.client_states]
    assert 0 < len(trained) < len(federation.train_clients)  # some took part, some never did
    for client in federation.train_clients:
        state = ditto.client_state(client.id, w)
        own = ditto.client_states[client.id]["v"] if client in trained else w
        assert all(torch.equal(ditto.kept_model(w, state)[n], own[n]) for n in w)
    world = SimpleNamespace(world_size=1, global_rank=0)
    result = evaluate_on_ranks(world, [run], cfg.personalization, Engine(False), protocol="training_clients")[
        0
    ]
    assert result.clients == "training" and result.curves.shape == (6, 1)  # as kept: no step
    apart = 0
    for row, client in zip(result.curves, federation.train_clients):
        test = client.scoring().batch("held_out", None)
        own = ditto.client_states[client.id]["v"] if client in trained else w
        expected = accuracy(ditto, own, test)
        assert row[0].item() == pytest.approx(expected, abs=1e-6), client.id  # curves: float32
        apart += expected != accuracy(ditto, w, test)
    assert apart > 0  # some client's v predicts otherwise than w: the check tells them apart


def accuracy(algorithm, params, batch) -> float:
    with torch.no_grad():
        logits = algorithm(params, batch.x, None, batch.mask)
    return (logits.argmax(1) == batch.y).double().mean().item()


def test_no_personal_model_with_personal_epochs_0_and_in_the_authors_variant(federation):
    for overrides in (["method.personal_epochs=0"], ["variant=authors"]):
        _, ditto = built("ditto", *overrides)
        federated_round(ditto, federation, 1, PER_ROUND, seed=0)
        assert not ditto.keeps_client_models
        assert all("v" not in state for state in ditto.client_states.values())


def test_ditto_learns_and_its_personal_models_beat_the_global_model_on_their_clients(federation):
    """A short real training: the round losses fall, and the training clients' own v_k score well
    above chance on their test splits, above the global model there (two labels a client)."""
    cfg, ditto = built("ditto", "evaluation.protocol=training_clients")
    run = Federated(ditto, federation, 0)
    losses = [federated_round(ditto, federation, r, PER_ROUND, seed=0).loss for r in range(1, 11)]
    assert sum(losses[-3:]) < sum(losses[:3])
    world = SimpleNamespace(world_size=1, global_rank=0)
    result = evaluate_on_ranks(world, [run], cfg.personalization, Engine(False), protocol="training_clients")[
        0
    ]
    w = ditto.global_params()
    trained = [i for i, c in enumerate(federation.train_clients) if c.id in ditto.client_states]
    personal = result.curves[trained, 0].mean().item()
    global_ = sum(
        accuracy(ditto, w, federation.train_clients[i].scoring().batch("held_out", None)) for i in trained
    ) / len(trained)
    assert personal > 0.5 and personal > global_, (personal, global_)
