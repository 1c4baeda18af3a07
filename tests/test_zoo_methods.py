"""The methods of the zoo learn, and each keeps its defining property.

One tiny federation serves every method: 3,000 RMNIST images in label shards over 20 clients
(about two classes each), 5 of them new; a small CNN; a few rounds of 5 clients. A method's
test trains it with ``trained(method, *overrides)`` (cached per module: a method trained once
serves all its tests), asserts that new clients end well above chance (10 classes) after the
shared personalization procedure, and checks what makes the method itself.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch

from fedmeta.algorithms import build_algorithm
from fedmeta.assemble import make_fabric
from fedmeta.config import compose
from fedmeta.data import ImageDataset, build_federation
from fedmeta.evaluation import personalize_client
from fedmeta.rounds import federated_round

ROUNDS = 8
TINY = [
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "wandb.mode=disabled",
    "personalization.steps=10",
    "personalization.lr=0.05",
]


@pytest.fixture(scope="module")
def zoo_data(rmnist):
    keep = torch.arange(3000)
    return ImageDataset(x=rmnist.x[keep], y=rmnist.y[keep], num_classes=10)


def federation_of(data):
    return build_federation(data, {"name": "shards", "shards_per_client": 2}, 20, 5, 0.25, seed=0)


@pytest.fixture(scope="module")
def trained(zoo_data):
    """``trained(method, *overrides)``: (algorithm, federation, cfg, curves) after ROUNDS rounds;
    curves: each new client's held-out accuracy after 0…steps personalization steps."""

    @functools.cache
    def run(method: str, *overrides: str):
        cfg = compose([f"method={method}", *TINY, *overrides])
        make_fabric(cfg).seed_everything(0, verbose=False)
        algorithm, federation = build_algorithm(cfg, 10), federation_of(zoo_data)
        for r in range(1, ROUNDS + 1):
            federated_round(algorithm, federation, r, 5, seed=0)
        curves = torch.stack(
            [personalize_client(algorithm, c, cfg.personalization)[1] for c in federation.new_clients]
        )
        return algorithm, federation, cfg, curves

    return run


def final_accuracy(curves: torch.Tensor) -> float:
    return curves[:, -1].mean().item()


def learned(trained, method: str, *overrides: str):
    """``trained(method, *overrides)``, its new clients well above chance (10 classes) after the
    shared personalization procedure."""
    algorithm, federation, cfg, curves = trained(method, *overrides)
    print(f"{method}: new-client accuracy {final_accuracy(curves):.4f} (step 0: {curves[:, 0].mean():.4f})")
    assert final_accuracy(curves) > 0.5  # chance: 0.1
    return algorithm, federation, cfg, curves


def clients_that_took_part(federation) -> set[int]:
    return {c.id for r in range(1, ROUNDS + 1) for c in federation.sample_round(r, 5, 0)}


# ---- pFedMe ----------------------------------------------------------------------------------------
# a few short rounds: 5 local rounds, and a larger step on the Moreau envelope than the paper's 0.005
PFEDME = ["method.local_lr=0.05", "method.local_rounds=5"]


def pooled_accuracy(algorithm, federation) -> float:
    """The global model's accuracy on the training clients' held-out data, pooled (every class)."""
    batches = [c.batch("held_out", None) for c in federation.train_clients]
    x, y = torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches])
    with torch.no_grad():
        return (algorithm(algorithm.global_params(), x).argmax(1) == y).float().mean().item()


def test_pfedme_learns_and_keeps_no_client_state(trained):
    """The global model learns as FedAvg's would (measured 0.10 → 0.52 pooled, FedAvg 0.52); a new
    client's model, the proximal point of its loss with λ = 15, may move only ~‖∇f‖/λ from w, so on
    two-class clients it stays near the global model's accuracy (measured 0.29; FedAvg-FT: 0.90)."""
    algorithm, federation, cfg, curves = trained("pfedme", *PFEDME)
    pooled = pooled_accuracy(algorithm, federation)
    print(
        f"pFedMe: new-client accuracy {final_accuracy(curves):.4f} (step 0: {curves[:, 0].mean():.4f}), "
        f"global model on the training clients' held-out data {pooled:.4f}"
    )
    assert pooled > 0.4  # chance: 0.1
    assert final_accuracy(curves) > max(0.2, curves[:, 0].mean().item())  # above chance, and above step 0
    assert algorithm.client_states == {}  # θ is re-solved from w every round: nothing stays with a client


def test_pfedme_local_update_is_a_step_on_the_moreau_envelope(zoo_data):
    """R = K = 1 from θ = w: θ' = w − p∇f(w) (the proximal term is 0 there), then w' = w − ηλ(w − θ')
    = w − ηλp∇f(w): what local_update computes, written out."""
    cfg = compose(["method=pfedme", *TINY, "method.local_rounds=1", "method.inner_steps=1"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client = federation_of(zoo_data).train_clients[0]
    batch = client.batch("all", 30, client.generator(1))
    batch = batch._replace(x=batch.x.double())
    w = algorithm.global_params()
    params = {k: p.clone().requires_grad_() for k, p in w.items()}
    grads = torch.autograd.grad(algorithm.loss(params, batch), list(params.values()))
    m = cfg.method
    expected = {k: w[k] - m.local_lr * m.lam * m.personal_lr * g for k, g in zip(w, grads)}
    result = algorithm.local_update(w, {}, {"batches": [batch]})
    for k in w:
        torch.testing.assert_close(result.params[k], expected[k])
    assert any(not torch.equal(result.params[k], w[k]) for k in w)


def test_pfedme_server_moves_by_beta_times_the_mean_update():
    """β = 2: the global model becomes w + 2·(mean − w), not the mean."""
    from fedmeta.algorithms.base import ClientUpdate

    algorithm = build_algorithm(compose(["method=pfedme", *TINY, "method.beta=2.0"]), 10)
    before = algorithm.global_params()
    before = {k: p.clone() for k, p in before.items()}
    sent = [{k: p + shift for k, p in before.items()} for shift in (0.1, 0.3)]
    algorithm.aggregate([ClientUpdate(i, s, 1.0, 0.0) for i, s in enumerate(sent)])
    for k, p in algorithm.global_params().items():
        torch.testing.assert_close(p, before[k] + 2 * 0.2)  # the mean's shift, 0.2, twice


def test_pfedme_new_clients_stay_near_the_global_model(trained):
    """The personalized model solves min f + λ/2‖θ − w‖²: the larger λ, the closer it stays to w."""
    algorithm, federation, cfg, _ = trained("pfedme", *PFEDME)
    client, w = federation.new_clients[0], algorithm.global_params()
    distances = {}
    for lam in (0.0, 15.0):
        algorithm.cfg.lam = lam
        personal, _ = personalize_client(algorithm, client, cfg.personalization)
        distances[lam] = sum(((personal[k] - w[k]) ** 2).sum() for k in w).sqrt().item()
    algorithm.cfg.lam = cfg.method.lam
    assert 0 < distances[15.0] < 0.8 * distances[0.0], distances


# ---- APFL ------------------------------------------------------------------------------------------
APFL = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_apfl_learns_and_keeps_v_and_alpha_per_client(trained):
    algorithm, federation, cfg, curves = learned(trained, "apfl", *APFL)
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part  # only clients that took part keep anything
    assert len(took_part) < len(federation.train_clients)  # …and some never did: memory flat in them
    w = algorithm.global_params()
    states = list(algorithm.client_states.values())
    alphas = torch.stack([s["alpha"] for s in states])
    assert ((alphas >= 0) & (alphas <= 1)).all() and not torch.equal(alphas, torch.full_like(alphas, 0.5))
    v = [s["v"]["head.weight"] for s in states]
    assert all(not torch.equal(a, w["head.weight"]) for a in v)  # v stayed local: the server has w
    assert not torch.equal(v[0], v[1])  # each client its own


def test_apfl_local_step_is_the_papers(zoo_data):
    """One batch from v = w, α: w' = w − η∇f(w), v' = v − ηα∇f(v̄) with v̄ = w, and α' = α (∇_α =
    ⟨v − w, ∇f(v̄)⟩ = 0 at v = w); then a kept state v ≠ w moves α by −η⟨v − w, ∇f(v̄)⟩."""
    cfg = compose(["method=apfl", *TINY, "method.local_lr=0.1"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client = federation_of(zoo_data).train_clients[0]
    batch = client.batch("all", 30, client.generator(1))
    batch = batch._replace(x=batch.x.double())
    eta, w = 0.1, algorithm.global_params()

    def gradient(params):
        params = {k: p.clone().requires_grad_() for k, p in params.items()}
        return dict(zip(params, torch.autograd.grad(algorithm.loss(params, batch), list(params.values()))))

    g = gradient(w)
    result = algorithm.local_update(w, algorithm.client_state(client.id, w), {"epochs": [batch]})
    for k in w:
        torch.testing.assert_close(result.params[k], w[k] - eta * g[k])
        torch.testing.assert_close(result.state["v"][k], w[k] - eta * 0.5 * g[k])
    assert result.state["alpha"].item() == 0.5
    v, alpha = result.state["v"], torch.tensor(0.3, dtype=torch.float64)
    mixed = {k: alpha * v[k] + (1 - alpha) * w[k] for k in w}
    g_mixed = gradient(mixed)
    expected = alpha - eta * sum((v[k] - w[k]).flatten() @ g_mixed[k].flatten() for k in w)
    again = algorithm.local_update(w, {"v": v, "alpha": alpha}, {"epochs": [batch]})
    torch.testing.assert_close(again.state["alpha"], expected.clamp(0, 1))
    for k in w:
        torch.testing.assert_close(again.state["v"][k], v[k] - eta * alpha * g_mixed[k])


def test_apfl_new_clients_start_at_the_global_model(trained):
    """v = w at the start, so the step-0 model is the global model, whatever α; the steps then move v
    and α (and w, as APFL's local step) and the mix is what is scored."""
    algorithm, federation, cfg, curves = trained("apfl", *APFL)
    client = federation.new_clients[0]
    held_out = client.batch("held_out", None)
    w = algorithm.global_params()
    start = algorithm.personal_params(w, {})
    torch.testing.assert_close(algorithm(start, held_out.x), algorithm(w, held_out.x))
    personal, curve = personalize_client(algorithm, client, cfg.personalization)
    assert curve[0] == curves[0, 0]
    assert personal["apfl_alpha"].item() != cfg.method.alpha  # α learned at test time too
    assert any(not torch.equal(personal[f"apfl_v.{k}"], w[k]) for k in w)


# ---- FedProx ---------------------------------------------------------------------------------------
FEDPROX = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedprox_learns_and_keeps_no_client_state(trained):
    algorithm, _, _, curves = trained("fedprox", *FEDPROX)
    print(f"FedProx: new-client accuracy {final_accuracy(curves):.4f} (step 0: {curves[:, 0].mean():.4f})")
    assert final_accuracy(curves) > 0.5  # chance: 0.1
    assert algorithm.client_states == {}


def two_batches(algorithm, zoo_data):
    client = federation_of(zoo_data).train_clients[0]
    generator = client.generator(1)
    batches = [client.batch("all", 30, generator) for _ in range(2)]
    return client, [b._replace(x=b.x.double()) for b in batches]


def gradient(algorithm, params, batch):
    params = {k: p.clone().requires_grad_() for k, p in params.items()}
    return dict(zip(params, torch.autograd.grad(algorithm.loss(params, batch), list(params.values()))))


def test_fedprox_local_step_adds_mu_times_the_distance_to_the_global_model(zoo_data):
    """Two SGD steps from w_t: w1 = w_t − η∇F(w_t) (the proximal gradient is 0 there), then
    w2 = w1 − η(∇F(w1) + μ(w1 − w_t)): FedProx's (and its authors' PerturbedGradientDescent) step."""
    cfg = compose(["method=fedprox", *TINY, "method.local_lr=0.1", "method.mu=0.5"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    _, batches = two_batches(algorithm, zoo_data)
    eta, mu, w = 0.1, 0.5, algorithm.global_params()
    g0 = gradient(algorithm, w, batches[0])
    w1 = {k: w[k] - eta * g0[k] for k in w}
    g1 = gradient(algorithm, w1, batches[1])
    w2 = {k: w1[k] - eta * (g1[k] + mu * (w1[k] - w[k])) for k in w}
    result = algorithm.local_update(w, {}, {"epochs": batches})
    for k in w:
        torch.testing.assert_close(result.params[k], w2[k])
    plain = {k: w1[k] - eta * g1[k] for k in w}  # FedAvg's second step: μ = 0
    assert any(not torch.allclose(w2[k], plain[k]) for k in w)


# ---- SCAFFOLD --------------------------------------------------------------------------------------
# the config's federation is the fixture's (20 clients, 5 new): N = 15 in c's update
SCAFFOLD = [
    "method.local_lr=0.05",
    "method.local_epochs=1",
    "federation.num_clients=20",
    "federation.num_new_clients=5",
]


def test_scaffold_learns_and_c_is_the_mean_of_every_clients_c_i(trained):
    algorithm, federation, _, curves = learned(trained, "scaffold", *SCAFFOLD)
    # c ← c + (1/N) Σ Δc_i from c = c_i = 0 keeps c = (1/N) Σ_i c_i over all N training clients
    assert_the_mean_of_every_clients(algorithm.control, "control", algorithm, federation)


def assert_the_mean_of_every_clients(server: dict, key: str, algorithm, federation) -> None:
    """Each client that took part, and only those, keeps its own ``key``; ``server`` is their sum
    over all N training clients / N (those that never took part count as 0)."""
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part  # state only for clients that took part…
    assert len(took_part) < len(federation.train_clients)  # …and some never did (theirs is 0)
    kept = [s[key] for s in algorithm.client_states.values()]
    assert not torch.equal(kept[0]["head.weight"], kept[1]["head.weight"])  # each client its own
    n = len(federation.train_clients)
    for name, value in server.items():
        torch.testing.assert_close(value, sum(k[name] for k in kept) / n, rtol=1e-5, atol=1e-7)
        assert value.abs().max() > 0


def test_scaffold_local_steps_control_variates_and_server_update(zoo_data):
    """From kept c_i and server c (random here): y ← y − η(∇F(y) − c_i + c) for K = 2 steps,
    c_i⁺ = c_i − c + (x − y)/(Kη), Δc = c_i⁺ − c_i sent beside y; the server then takes
    x ← x + η_g·mean(y − x) and c ← c + (1/N)·ΣΔc, and keeps c_i⁺ as the client's state."""
    from fedmeta.algorithms.scaffold import CONTROL_DELTA

    cfg = compose(["method=scaffold", *TINY, "method.local_lr=0.1", "method.server_lr=0.5"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    eta, x = 0.1, algorithm.global_params()
    x = {k: p.clone() for k, p in x.items()}
    torch.manual_seed(1)
    c = {k: 0.01 * torch.randn_like(p) for k, p in x.items()}
    c_i = {k: 0.01 * torch.randn_like(p) for k, p in x.items()}
    algorithm.control, algorithm.client_states = dict(c), {client.id: {"control": dict(c_i)}}
    y = x
    for batch in batches:
        g = gradient(algorithm, y, batch)
        y = {k: y[k] - eta * (g[k] - c_i[k] + c[k]) for k in x}
    c_plus = {k: c_i[k] - c[k] + (x[k] - y[k]) / (2 * eta) for k in x}
    result = algorithm.local_update(x, algorithm.client_state(client.id, x), {"epochs": batches})
    update = algorithm.to_update(client, result)
    for k in x:
        torch.testing.assert_close(update.params[k], y[k])
        torch.testing.assert_close(update.params[CONTROL_DELTA + k], c_plus[k] - c_i[k])
        torch.testing.assert_close(update.state["control"][k], c_plus[k])
    other = type(update)(client.id + 1, {k: 2 * v for k, v in update.params.items()}, 1.0, 0.0, None)
    algorithm.aggregate([update, other])
    n = cfg.federation.num_clients - cfg.federation.num_new_clients
    for k, p in algorithm.global_params().items():
        mean_y = (y[k] + 2 * y[k]) / 2
        torch.testing.assert_close(p, x[k] + 0.5 * (mean_y - x[k]))  # η_g = 0.5
        torch.testing.assert_close(algorithm.control[k], c[k] + 3 * (c_plus[k] - c_i[k]) / n)
    torch.testing.assert_close(
        algorithm.client_states[client.id]["control"]["head.weight"], c_plus["head.weight"]
    )
    assert client.id + 1 not in algorithm.client_states  # a reply without state (a Flower node keeps its own)


def test_scaffold_server_control_variate_is_checkpointed(trained, tmp_path):
    """c is part of the federation state: saved as a checkpoint saves it and restored into a fresh
    algorithm, whose next client then starts from the same c and c_i."""
    algorithm, federation, cfg, _ = trained("scaffold", *SCAFFOLD)
    torch.save(algorithm.federation_state(), tmp_path / "state.pt")
    fresh = build_algorithm(cfg, 10)
    fresh.load_federation_state(torch.load(tmp_path / "state.pt", weights_only=True))
    client_id = next(iter(algorithm.client_states))
    params = algorithm.global_params()
    for key in ("control", "server_control"):
        for name, value in algorithm.client_state(client_id, params)[key].items():
            assert torch.equal(fresh.client_state(client_id, fresh.global_params())[key][name], value)


# ---- FedDyn ----------------------------------------------------------------------------------------
# the config's federation is the fixture's (20 clients, 5 new): m = 15 in h's update; a few short
# rounds: a larger step and α than the protocol's
FEDDYN = [
    "method.local_lr=0.05",
    "method.local_epochs=1",
    "method.alpha=0.1",
    "federation.num_clients=20",
    "federation.num_new_clients=5",
]


def test_feddyn_learns_and_h_is_the_mean_of_every_clients_gradient_state(trained):
    """From h = 0 and ∇L_k = 0, h ← h − α/m·Σ(θ_k − θ) and ∇L_k ← ∇L_k − α(θ_k − θ) keep
    h = (1/m)·Σ_k ∇L_k over all m training clients, those that never took part at 0."""
    algorithm, federation, _, curves = learned(trained, "feddyn", *FEDDYN)
    assert_the_mean_of_every_clients(algorithm.h, "gradient", algorithm, federation)


def test_feddyn_local_steps_gradient_state_and_server_update(zoo_data):
    """From a kept ∇L_k and h (random here): θ ← θ − η(∇L_k(θ) − ∇L_k^{old} + α(θ − θ^{t−1})) for
    2 steps, the client keeps ∇L_k^{old} − α(θ_k − θ^{t−1}); the server takes
    h ← h − α/m·Σ(θ_k − θ^{t−1}) and θ^t = mean θ_k − h/α — the paper's Algorithm 1 by hand."""
    cfg = compose(["method=feddyn", *TINY, "method.local_lr=0.1", "method.alpha=0.5"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    eta, alpha, x = 0.1, 0.5, {k: p.clone() for k, p in algorithm.global_params().items()}
    torch.manual_seed(1)
    old = {k: 0.01 * torch.randn_like(p) for k, p in x.items()}
    h = {k: 0.01 * torch.randn_like(p) for k, p in x.items()}
    algorithm.h, algorithm.client_states = dict(h), {client.id: {"gradient": dict(old)}}
    theta = x
    for batch in batches:
        g = gradient(algorithm, theta, batch)
        theta = {k: theta[k] - eta * (g[k] - old[k] + alpha * (theta[k] - x[k])) for k in x}
    result = algorithm.local_update(x, algorithm.client_state(client.id, x), {"epochs": batches})
    update = algorithm.to_update(client, result)
    for k in x:
        torch.testing.assert_close(update.params[k], theta[k])
        torch.testing.assert_close(update.state["gradient"][k], old[k] - alpha * (theta[k] - x[k]))
    other = type(update)(client.id + 1, {k: 2 * v for k, v in update.params.items()}, 1.0, 0.0, None)
    algorithm.aggregate([update, other])
    m = cfg.federation.num_clients - cfg.federation.num_new_clients
    for k, p in algorithm.global_params().items():
        h_new = h[k] - alpha * ((theta[k] - x[k]) + (2 * theta[k] - x[k])) / m
        torch.testing.assert_close(algorithm.h[k], h_new)
        torch.testing.assert_close(p, (theta[k] + 2 * theta[k]) / 2 - h_new / alpha)
    assert client.id + 1 not in algorithm.client_states  # a reply without state (a Flower node keeps its own)


def test_feddyn_server_state_is_checkpointed(trained, tmp_path):
    algorithm, _, cfg, _ = trained("feddyn", *FEDDYN)
    torch.save(algorithm.federation_state(), tmp_path / "state.pt")
    fresh = build_algorithm(cfg, 10)
    fresh.load_federation_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert fresh.h.keys() == algorithm.h.keys() and all(
        torch.equal(fresh.h[k], algorithm.h[k]) for k in fresh.h
    )
    client_id = next(iter(algorithm.client_states))
    params = algorithm.global_params()
    for name, value in algorithm.client_state(client_id, params)["gradient"].items():
        assert torch.equal(fresh.client_state(client_id, fresh.global_params())["gradient"][name], value)


# ---- FedProto --------------------------------------------------------------------------------------
FEDPROTO = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedproto_learns_sends_only_prototypes_and_each_client_keeps_its_model(trained):
    from fedmeta.algorithms.fedproto import HELD, PROTOTYPE

    algorithm, federation, _, curves = learned(trained, "fedproto", *FEDPROTO)
    initial = starting_params("fedproto", *FEDPROTO)
    assert all(
        torch.equal(p, initial[n]) for n, p in algorithm.global_params().items()
    )  # no parameter is sent
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part
    models = [algorithm.client_states[c]["head.weight"] for c in sorted(took_part)]
    assert not torch.equal(models[0], models[1]) and not torch.equal(models[0], initial["head.weight"])
    assert algorithm.prototypes[HELD].sum() == 10  # every class has a global prototype by now
    assert algorithm.prototypes[PROTOTYPE].norm(dim=1).min() > 0


def assert_prototypes(algorithm, old: torch.Tensor, sent: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each class's global prototype is the mean of the ``sent`` (weights per class, prototypes),
    weighed so; a class no client sent keeps its ``old`` one."""
    from fedmeta.algorithms.fedproto import PROTOTYPE

    totals = sum(weights for weights, _ in sent)
    for j in range(len(old)):
        expected = old[j] if totals[j] == 0 else sum(w[j] * means[j] for w, means in sent) / totals[j]
        torch.testing.assert_close(algorithm.prototypes[PROTOTYPE][j], expected)


def test_fedproto_local_loss_prototypes_and_their_aggregation_by_hand(zoo_data):
    """Two SGD steps on CE + λ·MSE(z, C̄_y) from the client's own model; its prototypes are its
    embeddings' class means over all its data; the server's C̄_j is the mean over the clients that
    hold j, and a class no client of the round holds keeps its last prototype."""
    from fedmeta.algorithms.fedproto import HELD, PROTOTYPE

    cfg = compose(["method=fedproto", *TINY, "method.local_lr=0.1", "method.lam=0.5"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    torch.manual_seed(1)
    own = {k: p + 0.01 * torch.randn_like(p) for k, p in w.items()}  # the client's model, already its own
    global_protos = torch.randn(10, 32, dtype=torch.float64)
    held = torch.tensor([1.0] * 9 + [0.0], dtype=torch.float64)  # class 9 has no global prototype yet
    algorithm.prototypes = {PROTOTYPE: global_protos, HELD: held}
    algorithm.client_states = {client.id: dict(own)}

    def embed(params, x):
        return torch.func.functional_call(algorithm.model, params, (x,), {"embedding": True})

    def loss(params, batch):
        z = embed(params, batch.x)
        ce = torch.nn.functional.cross_entropy(algorithm(params, batch.x), batch.y)
        mse = torch.stack([((z[i] - global_protos[y]) ** 2).mean() * held[y] for i, y in enumerate(batch.y)])
        return ce + 0.5 * mse.mean()

    theta = own
    for batch in batches:
        leaves = {k: p.clone().requires_grad_() for k, p in theta.items()}
        g = dict(zip(leaves, torch.autograd.grad(loss(leaves, batch), list(leaves.values()))))
        theta = {k: theta[k] - 0.1 * g[k] for k in theta}
    everything = client.batch("all", None)
    everything = everything._replace(x=everything.x.double())
    result = algorithm.local_update(
        w, algorithm.client_state(client.id, w), {"epochs": batches, "all": everything}
    )
    for k in theta:
        torch.testing.assert_close(result.state["own"][k], theta[k])
    with torch.no_grad():
        z = embed(theta, everything.x)
    mine = torch.zeros(10, 32, dtype=torch.float64)
    for j in everything.y.unique():
        mine[j] = z[everything.y == j].mean(0)
    torch.testing.assert_close(result.params[PROTOTYPE], mine)
    assert result.params[HELD].tolist() == [float(j in everything.y.tolist()) for j in range(10)]

    update = algorithm.to_update(client, result)
    other_protos = torch.randn(10, 32, dtype=torch.float64)
    other_held = torch.zeros(10, dtype=torch.float64)
    other_held[[int(everything.y[0]), 3]] = 1  # shares one class with the client, and holds class 3
    other = type(update)(client.id + 1, {PROTOTYPE: other_protos, HELD: other_held}, 1.0, 0.0, None)
    algorithm.aggregate([update, other])
    assert_prototypes(algorithm, global_protos, [(result.params[HELD], mine), (other_held, other_protos)])
    assert torch.equal(algorithm.client_states[client.id]["head.weight"], result.state["own"]["head.weight"])


# ---- FedPAC ----------------------------------------------------------------------------------------
FEDPAC = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedpac_learns_an_extractor_and_combines_a_head_per_client(trained):
    from fedmeta.algorithms.fedproto import HELD

    algorithm, federation, _, curves = learned(trained, "fedpac", *FEDPAC)
    initial = starting_params("fedpac", *FEDPAC)
    params = algorithm.global_params()
    assert not torch.equal(
        params["features.blocks.0.0.weight"], initial["features.blocks.0.0.weight"]
    )  # the extractor is averaged
    took_part = clients_that_took_part(federation)
    assert set(algorithm.heads) == took_part and algorithm.client_states == {}  # the server holds the heads
    heads = [algorithm.heads[c]["head.weight"] for c in sorted(took_part)]
    assert not torch.equal(heads[0], heads[1])
    assert algorithm.prototypes[HELD].sum() == 10


def test_fedpac_server_state_is_checkpointed_and_each_client_gets_its_head(trained, tmp_path):
    """The combined heads and the centroids round-trip a checkpoint; what a Flower node is sent for
    a client (``broadcast_state``) gives it that client's head and nobody else's."""
    algorithm, _, cfg, _ = trained("fedpac", *FEDPAC)
    torch.save(algorithm.federation_state(), tmp_path / "state.pt")
    fresh = build_algorithm(cfg, 10)
    fresh.load_federation_state(torch.load(tmp_path / "state.pt", weights_only=True))
    client_id = min(algorithm.heads)
    params = algorithm.global_params()
    for key in ("head", "prototypes"):
        kept, loaded = (
            algorithm.client_state(client_id, params)[key],
            fresh.client_state(client_id, params)[key],
        )
        assert kept.keys() == loaded.keys() and all(torch.equal(kept[k], loaded[k]) for k in kept)
    node = build_algorithm(cfg, 10)
    node.load_broadcast_state(algorithm.broadcast_state(client_id), client_id)
    assert set(node.heads) == {client_id}
    sent = node.client_state(client_id, params)["head"]
    assert all(torch.equal(sent[k], algorithm.heads[client_id][k]) for k in sent)


def test_fedpac_statistics_local_phases_centroids_and_head_combination_by_hand(zoo_data):
    """The statistics with the received model; one SGD step on the head alone (CE), one on the
    extractor alone (CE + λ·MSE to the global centroid, or to the client's own where there is
    none); the server's count-weighted centroids; and for two clients the head combination whose
    quadratic program has a closed form: α₀ = (V₁ + d) / (V₀ + V₁ + d), d = ‖H₀ − H₁‖²."""
    from fedmeta.algorithms.fedpac import BIAS, COUNT, VARIANCE
    from fedmeta.algorithms.fedproto import HELD, PROTOTYPE

    cfg = compose(["method=fedpac", *TINY, "method.local_lr=0.1", "method.head_lr=0.2", "method.lam=0.5"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, (head_batch, body_batch) = two_batches(algorithm, zoo_data)
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    torch.manual_seed(1)
    combined = {k: w[k] + 0.1 * torch.randn_like(w[k]) for k in ("head.weight", "head.bias")}
    global_protos = torch.randn(10, 32, dtype=torch.float64)
    held = torch.tensor([1.0] * 9 + [0.0], dtype=torch.float64)  # class 9 has no global centroid yet
    algorithm.prototypes = {PROTOTYPE: global_protos, HELD: held}
    algorithm.heads = {client.id: combined}
    everything = client.batch("all", None)
    everything = everything._replace(x=everything.x.double())

    def embed(params, x):
        return torch.func.functional_call(algorithm.model, params, (x,), {"embedding": True})

    def step(params, names, loss):
        leaves = {k: params[k].clone().requires_grad_() for k in names}
        grads = dict(zip(leaves, torch.autograd.grad(loss({**params, **leaves}), list(leaves.values()))))
        return {
            **params,
            **{k: params[k] - (0.2 if k.startswith("head.") else 0.1) * grads[k] for k in names},
        }

    start = {**w, **combined}
    with torch.no_grad():
        z = embed(start, everything.x)
    n, classes = len(everything.y), everything.y.unique()
    own = torch.zeros(10, 32, dtype=torch.float64)
    variance, bias = 0.0, torch.zeros(10, 32, dtype=torch.float64)
    for j in classes:
        zj, p = z[everything.y == j], (everything.y == j).double().mean()
        own[j], bias[j] = zj.mean(0), p * zj.mean(0)
        variance += p * (zj**2).sum(1).mean() - p**2 * (zj.mean(0) ** 2).sum()
    variance /= n
    heads, body = ["head.weight", "head.bias"], [k for k in w if not k.startswith("head.")]
    theta = step(
        start, heads, lambda q: torch.nn.functional.cross_entropy(algorithm(q, head_batch.x), head_batch.y)
    )
    target = torch.where(held.unsqueeze(-1) > 0, global_protos, own)

    def aligned(q):
        zb = embed(q, body_batch.x)
        mse = torch.stack([((zb[i] - target[y]) ** 2).mean() for i, y in enumerate(body_batch.y)])
        return torch.nn.functional.cross_entropy(algorithm(q, body_batch.x), body_batch.y) + 0.5 * mse.mean()

    theta = step(theta, body, aligned)
    result = algorithm.local_update(
        w,
        algorithm.client_state(client.id, w),
        {"head": [head_batch], "epochs": [body_batch], "all": everything},
    )
    for k in theta:
        torch.testing.assert_close(result.params[k], theta[k])
    torch.testing.assert_close(result.params[VARIANCE], variance)
    torch.testing.assert_close(result.params[BIAS], bias)
    with torch.no_grad():
        z = embed(theta, everything.x)
    centroids = torch.zeros(10, 32, dtype=torch.float64)
    for j in classes:
        centroids[j] = z[everything.y == j].mean(0)
    torch.testing.assert_close(result.params[PROTOTYPE], centroids)

    update = algorithm.to_update(client, result)
    other = {k: v + 0.3 * torch.randn_like(v) for k, v in result.params.items() if k in w}
    other_counts = torch.zeros(10, dtype=torch.float64)
    other_counts[[int(everything.y[0]), 3]] = 7  # shares a class with the client, and holds class 3
    other |= {
        PROTOTYPE: torch.randn(10, 32, dtype=torch.float64),
        COUNT: other_counts,
        # statistics near the client's, so that neither weight is under the 10⁻³ that is dropped
        VARIANCE: 2 * variance,
        BIAS: bias + (variance / bias.numel()).sqrt() * torch.randn(10, 32, dtype=torch.float64),
    }
    second = type(update)(client.id + 1, other, 50.0, 0.0, None)
    algorithm.aggregate([update, second])
    assert_prototypes(
        algorithm, global_protos, [(result.params[COUNT], centroids), (other_counts, other[PROTOTYPE])]
    )
    d = ((bias - other[BIAS]) ** 2).sum()
    alpha = (other[VARIANCE] + d) / (variance + other[VARIANCE] + d)  # client 0's weight on its own head
    assert 0.5 < alpha < 0.9
    for k in heads:
        torch.testing.assert_close(algorithm.heads[client.id][k], alpha * theta[k] + (1 - alpha) * other[k])
    share = client.num_samples / (client.num_samples + 50.0)
    name = "features.blocks.0.0.weight"  # the extractor: FedAvg's weighted mean
    torch.testing.assert_close(
        algorithm.global_params()[name], share * theta[name] + (1 - share) * other[name]
    )


def fedpac_problem(rng: np.random.Generator) -> np.ndarray:
    """A FedPAC-shaped matrix diag(V) + D_i for 2 to 6 clients (10 classes × 5 units), often near
    degenerate: clients alike to 1e-6, collinear, a variance of 0, one client far from the others
    (its entries dwarf theirs), variances down to 1e-12."""
    m, kind = int(rng.integers(2, 7)), int(rng.integers(5))
    share = rng.dirichlet(np.full(10, 0.3), size=m)
    means = rng.normal(size=(m, 10, 5))
    if kind in (1, 4):
        means = means[:1] + 10.0 ** rng.uniform(-6, -2) * rng.normal(size=means.shape)
        share = np.repeat(share[:1], m, 0)
    if kind == 2:
        means = means[:1] * rng.uniform(0.5, 2, size=(m, 1, 1))
    h = (share[..., None] * means).reshape(m, -1)
    if kind == 4:
        h[-1] *= 10.0 ** rng.uniform(1, 4)
    variances = rng.uniform(0, 1, m) * 10.0 ** rng.uniform(-12, 0)
    if kind == 3:
        variances[rng.integers(m)] = 0.0
    gaps = h[rng.integers(m)] - h
    return np.diag(variances) + gaps @ gaps.T


def brute_force_simplex_qp(matrices: np.ndarray) -> np.ndarray:
    """For same-sized matrices at once: every support's minimizer over its plane Σα = 1 (the KKT
    system of the clients in it alone), the nonnegative ones kept, the least objective's taken."""
    n, m = matrices.shape[:2]
    best, objective = np.zeros((n, m)), np.full(n, np.inf)
    for k in range(1, m + 1):
        for support in itertools.combinations(range(m), k):
            s = list(support)
            systems = np.zeros((n, k + 1, k + 1))
            systems[:, :k, :k] = 2 * matrices[:, s][:, :, s]
            systems[:, :k, k], systems[:, k, :k] = -1.0, 1.0
            rhs = np.r_[np.zeros(k), 1.0]
            try:
                solved = np.linalg.solve(systems, np.broadcast_to(rhs, (n, k + 1))[..., None])[..., 0]
            except np.linalg.LinAlgError:  # a singular one: least squares, one at a time
                solved = np.stack([np.linalg.lstsq(a, rhs, rcond=None)[0] for a in systems])
            alpha = np.zeros((n, m))
            alpha[:, s] = solved[:, :k]
            values = np.einsum("ni,nij,nj->n", alpha, matrices, alpha)
            better = (alpha >= -1e-12).all(1) & (values < objective)
            best[better], objective[better] = alpha[better], values[better]
    return best


def test_fedpac_head_combination_is_the_exact_minimum_on_near_degenerate_problems():
    """On 1,500 random FedPAC-shaped problems, many near degenerate, the combination's weights are
    a certified minimum (KKT: on the simplex, the gradient equal on the support and no smaller off
    it), of the least objective a brute force over every support finds, and equal to its weights
    wherever the minimum is well determined (the scaled matrix's least eigenvalue above 1e-9). An
    SLSQP solve with absolute tolerances was off by up to 0.74 in 34 of those 925 problems."""
    from fedmeta.algorithms.fedpac import simplex_qp

    rng = np.random.default_rng(0)
    problems = [fedpac_problem(rng) for _ in range(1500)]
    scaled = [q / np.abs(q).max() for q in problems]
    ours = [simplex_qp(q) for q in problems]
    for size in {len(q) for q in scaled}:
        which = [i for i, q in enumerate(scaled) if len(q) == size]
        brute = brute_force_simplex_qp(np.stack([scaled[i] for i in which]))
        for i, reference in zip(which, brute):
            q, alpha = scaled[i], ours[i]
            assert (alpha >= 0).all() and abs(alpha.sum() - 1) < 1e-12
            gradient = 2 * q @ alpha
            level = alpha @ gradient  # ν: the gradient on the support
            assert np.abs(gradient[alpha > 0] - level).max() < 1e-8 and (gradient > level - 1e-8).all()
            assert alpha @ q @ alpha <= reference @ q @ reference + 1e-13
            if np.linalg.eigvalsh(q)[0] > 1e-9:
                np.testing.assert_allclose(alpha, reference, atol=1e-6)


# ---- FedRoD ----------------------------------------------------------------------------------------
FEDROD = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedrod_learns_a_generic_model_and_a_personalized_head_per_client(trained):
    algorithm, federation, _, curves = learned(trained, "fedrod", *FEDROD)
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part
    heads = [algorithm.client_states[c]["personal_head.weight"] for c in sorted(took_part)]
    assert not torch.equal(heads[0], heads[1])
    initial = starting_params("fedrod", *FEDROD)
    assert torch.equal(initial["personal_head.weight"], initial["head.weight"])  # a copy of the generic head
    params = algorithm.global_params()
    assert torch.equal(params["personal_head.weight"], initial["personal_head.weight"])  # never averaged
    assert not torch.equal(params["head.weight"], initial["head.weight"])


def test_fedrod_local_steps_are_the_balanced_softmax_and_the_personal_heads_by_hand(zoo_data):
    """Two SGD steps: the body and generic head on CE(g(z) + log n_y) with n the client's class
    counts over its batches; the personalized head on CE(g(z) + p(z)) with g(z) and z held fixed;
    the client sends the body and generic head and keeps its head."""
    cfg = compose(["method=fedrod", *TINY, "method.local_lr=0.1"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    torch.manual_seed(1)
    own = {k: w[k] + 0.1 * torch.randn_like(w[k]) for k in ("personal_head.weight", "personal_head.bias")}
    algorithm.client_states = {client.id: dict(own)}
    labels = torch.cat([b.y for b in batches])
    log_counts = torch.bincount(labels, minlength=10).double().log()
    body = [k for k in w if not k.startswith("personal_head.")]

    def embed(params, x):
        return torch.func.functional_call(algorithm.model, params, (x,), {"embedding": True})

    theta = {**w, **own}
    for batch in batches:
        leaves = {k: p.clone().requires_grad_() for k, p in theta.items()}
        z = embed(leaves, batch.x)
        g = z @ leaves["head.weight"].T + leaves["head.bias"]
        p_ = z.detach() @ leaves["personal_head.weight"].T + leaves["personal_head.bias"]
        loss = torch.nn.functional.cross_entropy(g + log_counts, batch.y)
        loss = loss + torch.nn.functional.cross_entropy(g.detach() + p_, batch.y)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        theta = {k: theta[k] - 0.1 * grads[k] for k in theta}
    result = algorithm.local_update(w, algorithm.client_state(client.id, w), {"epochs": batches})
    update = algorithm.to_update(client, result)
    assert set(update.params) == set(body)
    for k in body:
        torch.testing.assert_close(update.params[k], theta[k])
    for k in own:
        torch.testing.assert_close(update.state[k], theta[k])


# ---- FedALA ----------------------------------------------------------------------------------------
FEDALA = ["method.local_lr=0.05", "method.local_epochs=1", "method.first_epochs=2"]


def test_fedala_learns_and_each_client_keeps_its_top_layers_and_weights(trained):
    algorithm, federation, _, curves = learned(trained, "fedala", *FEDALA)
    states = list(algorithm.client_states.values())
    assert all(set(s["local"]) == {"head.weight", "head.bias"} for s in states)
    assert any(s["weights_trained"] for s in states)  # some clients came back and learned their weights
    weights = [s["weights"]["head.weight"] for s in states if s["weights_trained"]]
    assert all(((w >= 0) & (w <= 1)).all() for w in weights) and any((w < 1).any() for w in weights)


def test_fedala_blends_with_learned_weights_then_trains_as_fedavg_by_hand(zoo_data):
    """With a kept local head θ_i and weights W (random here), two window batches step
    W ← clip(W − η·∇L(θ_t) ⊙ (θ − θ_i), 0, 1) at θ_t = θ_i + (θ − θ_i) ⊙ W (the body: θ's); the
    client then takes FedAvg's SGD steps from the blended model and keeps its new head and W."""
    from fedmeta.algorithms import FedAvg

    cfg = compose(["method=fedala", *TINY, "method.local_lr=0.1", "method.ala_lr=5.0"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    theta = {k: p.clone() for k, p in algorithm.global_params().items()}
    top = ["head.weight", "head.bias"]
    torch.manual_seed(1)
    local = {k: theta[k] + 0.3 * torch.randn_like(theta[k]) for k in top}
    weights = {k: torch.rand_like(theta[k]) for k in top}
    algorithm.client_states = {client.id: {"local": dict(local), "weights": dict(weights)}}
    w = dict(weights)
    for batch in batches:
        blended = {k: local[k] + (theta[k] - local[k]) * w[k] for k in top}
        g = gradient(algorithm, {**theta, **blended}, batch)
        w = {k: torch.clamp(w[k] - 5.0 * g[k] * (theta[k] - local[k]), 0, 1) for k in top}
    assert any(((v > 0) & (v < 1)).any() for v in w.values())  # the weights moved, and not all to a bound
    start = {**theta, **{k: local[k] + (theta[k] - local[k]) * w[k] for k in top}}
    trained = FedAvg.local_update(algorithm, start, {}, {"epochs": batches}).params
    result = algorithm.local_update(
        theta, algorithm.client_state(client.id, theta), {"epochs": batches, "ala": batches}
    )
    for k in theta:
        torch.testing.assert_close(result.params[k], trained[k])
    for k in top:
        torch.testing.assert_close(result.state["weights"][k], w[k])
        torch.testing.assert_close(result.state["local"][k], trained[k])


def test_fedala_runs_whenever_a_client_trains_longer_the_first_time(zoo_data):
    """ALA runs on every round a client trains, from the initial model's top layers on its first;
    only where its local model is the global one — a first round that is round 1 — is it skipped
    (the reference code's test), and then the longer first training of W_i is still to come."""
    cfg = compose(["method=fedala", *TINY, "method.first_epochs=3"])
    algorithm = build_algorithm(cfg, 10)
    initial = {n: p.detach().clone() for n, p in algorithm.model.named_parameters()}
    client = federation_of(zoo_data).train_clients[0]
    window = len(client.window("all", 0.8, cfg.method.batch_size, client.generator(1)))
    assert window > 0
    assert algorithm.draw(client, 1)["ala"] == []  # round 1: the local model is the global one
    assert len(algorithm.draw(client, 2)["ala"]) == 3 * window  # a first round later: ALA, first time
    with torch.no_grad():  # the global model moved; the client has none of its own yet
        for p in algorithm.model.parameters():
            p.add_(0.1)
    state = algorithm.client_state(client.id, algorithm.global_params())
    assert all(torch.equal(state["local"][n], initial[n]) for n in ("head.weight", "head.bias"))
    algorithm.client_states[client.id] = {"local": {}, "weights": {}, "weights_trained": False}
    assert len(algorithm.draw(client, 3)["ala"]) == 3 * window  # its first round was round 1
    algorithm.client_states[client.id]["weights_trained"] = True
    assert len(algorithm.draw(client, 4)["ala"]) == window


def test_fedala_trains_its_weights_on_nearly_every_client_update(trained):
    """Only the round-1 first participations skip ALA: the rest of the updates learned W_i."""
    algorithm, federation, _, _ = trained("fedala", *FEDALA)
    first_round = {c.id for c in federation.sample_round(1, 5, 0)}
    skipped = {i for i, s in algorithm.client_states.items() if not s["weights_trained"]}
    assert skipped <= first_round  # a client seen in round 1 alone never ran ALA


# ---- FedPer, LG-FedAvg, FedBN: some layers stay with each client; FedBABU: a head never trained ------
PARTIAL = ["method.local_lr=0.05", "method.local_epochs=1"]


def layers(*modules: str) -> set[str]:
    return {f"{m}.{kind}" for m in modules for kind in ("weight", "bias")}


CONV_BN = ("features.blocks.0.1", "features.blocks.1.1")  # each conv block: 0 the conv, 1 its batch norm
KEPT = {  # method: its overrides (a new client's own-layers-first steps: 3 of the 10), the layers it keeps
    "fedper": (PARTIAL, layers("head")),
    "lgfedavg": (
        [*PARTIAL, "method.test_local_steps=3"],
        layers(
            "features.blocks.0.0", "features.blocks.1.0", *CONV_BN
        ),  # global_layers=fc_block: the dense ones global
    ),
    "fedbn": ([*PARTIAL, "method.test_bn_steps=3"], layers(*CONV_BN, "dense.0.1")),
}


def initial_params(cfg) -> dict:
    """The global model before any round: ``trained`` builds it from the same seed."""
    make_fabric(cfg).seed_everything(0, verbose=False)
    return build_algorithm(cfg, 10).global_params()


def took_part(federation) -> set[int]:
    return {c.id for r in range(1, ROUNDS + 1) for c in federation.sample_round(r, 5, 0)}


@pytest.mark.parametrize("method", sorted(KEPT))
def test_partial_sharing_learns_and_each_client_keeps_its_own_layers(method, trained):
    algorithm, federation, cfg, curves = trained(method, *KEPT[method][0])
    print(f"{method}: new-client accuracy {final_accuracy(curves):.4f} (step 0: {curves[:, 0].mean():.4f})")
    assert final_accuracy(curves) > 0.7  # chance: 0.1
    own, shared = set(algorithm.own_names), set(algorithm.shared_names)
    w, start = algorithm.global_params(), initial_params(cfg)
    assert own == KEPT[method][1] and shared == set(w) - own
    assert all(torch.equal(w[n], start[n]) for n in own)  # never sent: the server's copy is the initial one
    assert all(not torch.equal(w[n], start[n]) for n in shared)  # averaged from the clients' training
    assert set(algorithm.client_states) == took_part(federation)  # only clients that took part keep layers
    assert len(algorithm.client_states) < len(federation.train_clients)
    first, second = (algorithm.client_states[c] for c in sorted(algorithm.client_states)[:2])
    for n in own:  # trained, each client its own
        assert not torch.equal(first[n], start[n]) and not torch.equal(first[n], second[n])
    client = federation.train_clients[0]
    state = algorithm.client_state(client.id, w)["own"]
    kept = algorithm.client_states.get(client.id, start)
    assert all(torch.equal(state[n], kept[n]) for n in own)  # a client resumes from its own layers
    assert set(algorithm.run_client(client, ROUNDS + 1).params) == shared  # and sends only the shared ones


@pytest.mark.parametrize("method,key", [("lgfedavg", "test_local_steps"), ("fedbn", "test_bn_steps")])
def test_new_clients_fit_their_own_layers_first(method, key, trained):
    """LG-FedAvg's new client learns its local representation under the fixed global layers, FedBN's
    its batch norm on the shared layers, for the first steps; then every layer trains."""
    algorithm, federation, cfg, _ = trained(method, *KEPT[method][0])
    w, client = algorithm.global_params(), federation.new_clients[0]
    moved = []
    for steps in (cfg.method[key], cfg.personalization.steps):
        personalization = cfg.personalization.copy()
        personalization.steps = steps
        personal, _ = personalize_client(algorithm, client, personalization)
        moved.append({n for n in w if not torch.equal(personal[n], w[n])})
    assert moved == [set(algorithm.own_names), set(w)]


def test_fedbabu_learns_under_a_head_it_never_trains(trained):
    algorithm, federation, cfg, curves = trained("fedbabu", *PARTIAL)
    print(f"fedbabu: new-client accuracy {final_accuracy(curves):.4f} (step 0: {curves[:, 0].mean():.4f})")
    assert final_accuracy(curves) > 0.7  # chance: 0.1
    w, start = algorithm.global_params(), initial_params(cfg)
    head = {"head.weight", "head.bias"}
    assert set(algorithm.head_names) == head and set(algorithm.body_names) == set(w) - head
    assert all(torch.equal(w[n], start[n]) for n in head)  # the random head, fixed through training
    assert all(not torch.equal(w[n], start[n]) for n in algorithm.body_names)
    assert algorithm.client_states == {}
    sent = algorithm.run_client(federation.train_clients[0], ROUNDS + 1).params
    assert set(sent) == set(algorithm.body_names)  # the body only
    personal, _ = personalize_client(algorithm, federation.new_clients[0], cfg.personalization)
    assert all(not torch.equal(personal[n], w[n]) for n in w)  # at test time the whole model is fine-tuned


# ---- FedMeta (MAML, Meta-SGD) and Per-FedAvg with the exact Hessian-vector product ----------------
FEDMETA = ["method.outer_lr=0.005"]  # a few rounds: a larger server step than the protocol's β = 0.001
PERFEDAVG_EXACT = ["method.hessian=exact", "method.local_steps=2", "method.outer_lr=0.1"]


def pooled_loss(algorithm, federation, params=None) -> float:
    """The global model's cross-entropy on all new clients' held-out images together (10 classes):
    what the federation learned, before any client adapts."""
    held_out = [c.batch("held_out", None) for c in federation.new_clients]
    x, y = torch.cat([b.x for b in held_out]), torch.cat([b.y for b in held_out])
    with torch.no_grad():
        logits = algorithm(algorithm.global_params() if params is None else params, x)
    return torch.nn.functional.cross_entropy(logits, y).item()


def starting_params(method: str, *overrides: str):
    """The global parameters ``trained(method, *overrides)`` started from."""
    cfg = compose([f"method={method}", *TINY, *overrides])
    make_fabric(cfg).seed_everything(0, verbose=False)
    return build_algorithm(cfg, 10).global_params()


@pytest.mark.parametrize("method", ["fedmeta_maml", "fedmeta_metasgd"])
def test_fedmeta_learns_and_only_the_server_keeps_state(trained, method):
    algorithm, federation, cfg, curves = trained(method, *FEDMETA)
    before = pooled_loss(algorithm, federation, starting_params(method, *FEDMETA))
    after = pooled_loss(algorithm, federation)
    print(
        f"{method}: new-client accuracy {final_accuracy(curves):.4f} (step 0, after its own adaptation: "
        f"{curves[:, 0].mean():.4f}); pooled held-out loss {before:.3f} → {after:.3f}"
    )
    assert final_accuracy(curves) > 0.5  # chance: 0.1
    assert after < before - 0.15  # the meta-learner learned from the clients (measured 2.40 → 2.03)
    assert algorithm.client_states == {}  # clients send their meta-gradient and keep nothing
    assert int(algorithm.server_adam["step"]) == ROUNDS  # the server's Adam, one step a round


def test_fedmeta_metasgd_learns_a_rate_per_weight_that_new_clients_step_with(trained):
    algorithm, federation, cfg, _ = trained("fedmeta_metasgd", *FEDMETA)
    rates = torch.cat([r.detach().flatten() for r in algorithm.model.rates.parameters()])
    assert rates.std() > 0 and not torch.allclose(rates, torch.full_like(rates, cfg.method.inner_lr))
    client = federation.new_clients[0]
    params = algorithm.global_params()
    start = algorithm.personal_params(params, algorithm.personalization_data(client))
    uniform = {
        k: torch.full_like(v, cfg.method.inner_lr) if k.startswith("rates.") else v for k, v in params.items()
    }
    at_alpha = algorithm.personal_params(uniform, algorithm.personalization_data(client))
    base = [k for k in params if k.startswith("base.")]
    assert all(not torch.equal(start[k], params[k]) for k in base)  # the new client adapted…
    assert any(not torch.allclose(start[k], at_alpha[k]) for k in base)  # …at its learned rates, not at α


def test_fedmeta_metasgd_server_steps_its_adam_on_the_exact_mean_meta_gradient(zoo_data, monkeypatch):
    """The server's Adam gets the clients' mean meta-gradient as they computed it, the learned
    rates' included (median ~3e-6: read back from a mean of θ − β·g in float32, a third of them
    came back with the wrong sign and a third as 0)."""
    from fedmeta.algorithms import fedmeta as fedmeta_module
    from fedmeta.functional import grad_and_value

    cfg = compose(["method=fedmeta_metasgd", *TINY])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm, federation = build_algorithm(cfg, 10), federation_of(zoo_data)
    clients = federation.train_clients[:4]
    params = algorithm.global_params()
    exact = [grad_and_value(algorithm.meta_loss)(params, algorithm.draw(c, 1))[0] for c in clients]
    given = {}
    real_adam = fedmeta_module.adam

    def adam(params, grads, state, lr):
        given.update(grads)
        return real_adam(params, grads, state, lr)

    monkeypatch.setattr(fedmeta_module, "adam", adam)
    algorithm.aggregate([algorithm.run_client(c, 1) for c in clients])  # averaging=uniform: the plain mean
    rates = [n for n in params if n.startswith("rates.")]
    assert rates and set(given) == set(params)
    for name in params:
        mean = torch.stack([g[name] for g in exact]).mean(0)
        torch.testing.assert_close(given[name], mean, rtol=1e-5, atol=1e-9)  # float32 rounding of the mean
        if name in rates:  # the old read-back's error was ~1e-6: larger than most of these
            clear = mean.abs() > 1e-9
            assert torch.equal(torch.sign(given[name])[clear], torch.sign(mean)[clear])


def test_perfedavg_with_the_exact_hessian_vector_product_learns(trained):
    algorithm, federation, cfg, curves = trained("perfedavg", *PERFEDAVG_EXACT)
    before = pooled_loss(algorithm, federation, starting_params("perfedavg", *PERFEDAVG_EXACT))
    after = pooled_loss(algorithm, federation)
    print(
        f"Per-FedAvg (exact HVP): new-client accuracy {final_accuracy(curves):.4f}; "
        f"pooled held-out loss {before:.3f} → {after:.3f}"
    )
    assert cfg.method.hessian == "exact"
    assert final_accuracy(curves) > 0.5  # chance: 0.1
    assert after < before - 0.15  # measured 2.40 → 2.17


# ---- every method: the federation, not only the new clients' fine-tuning, learned ------------------
# Clients of about two classes each reach high accuracy from any start after a few fine-tuning steps,
# so each method's own test above is joined by this one: its global model, before any client adapts,
# has learned on the pooled classes of the new clients (chance's cross-entropy: ln 10 ≈ 2.30).
# LG-FedAvg's global model is the initial representation under an averaged head: it is left out.
LEARNED = {
    "apfl": APFL,
    "fedpac": FEDPAC,
    "fedbabu": PARTIAL,
    "fedbn": KEPT["fedbn"][0],
    "feddyn": FEDDYN,
    "fedala": FEDALA,
    "fedper": KEPT["fedper"][0],
    "fedprox": FEDPROX,
    "pfedme": PFEDME,
    "scaffold": SCAFFOLD,
}


@pytest.mark.parametrize("method", sorted(LEARNED))
def test_the_federation_itself_learned(method, trained):
    algorithm, federation, _, _ = trained(method, *LEARNED[method])
    before = pooled_loss(algorithm, federation, starting_params(method, *LEARNED[method]))
    after = pooled_loss(algorithm, federation)
    print(f"{method}: pooled held-out loss of the global model {before:.3f} → {after:.3f}")
    assert after < before - 0.2  # measured drops: 0.31 (FedProx) to 0.41 (SCAFFOLD)


@pytest.mark.parametrize(
    "method,said",
    [
        ("fedproto", "50 steps at lr 0.001; from the initial model, on FedProto's loss"),
        ("fedrod", "50 steps at lr 0.001; on a personalized head alone, from zero"),
        ("fedpac", "50 steps at lr 0.001; on FedPAC's loss with the global centroids"),
        ("feddyn", "50 steps at lr 0.001"),
        ("fedgh", "50 steps at lr 0.001; from the initial extractor under the global header"),
        ("pfedhn", "50 steps at lr 0.001; from the model the hypernetwork makes for the mean embedding"),
    ],
)
def test_the_table_says_how_a_methods_new_clients_are_scored(method, said, tmp_path):
    from omegaconf import OmegaConf

    from fedmeta import report

    OmegaConf.save(compose([f"method={method}"]), tmp_path / "config.yaml")
    assert report.procedure([tmp_path]).startswith(said)


def test_a_table_row_says_each_data_sets_step_size_where_they_differ(tmp_path):
    """Meta-Dataset personalizes at lr 0.05 (CAFeMe) where RMNIST takes 0.01: a row over both says
    which is which, not the first setting's alone."""
    from omegaconf import OmegaConf

    from fedmeta import report

    firsts = []
    for dataset in ("rmnist", "femnist", "meta_dataset"):
        folder = tmp_path / dataset
        folder.mkdir()
        OmegaConf.save(compose(["method=cafeme", f"dataset={dataset}"]), folder / "config.yaml")
        firsts.append({"folder": folder, "dataset": dataset})
    assert report._procedures(firsts) == (
        "50 steps at lr 0.01 (rmnist, femnist)<br>50 steps at lr 0.05 (meta_dataset)"
    )
    assert report._procedures(firsts[:2]) == "50 steps at lr 0.01"


# ---- MOON ------------------------------------------------------------------------------------------
MOON = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_moon_learns_and_each_client_keeps_its_previous_model_in_float16(trained):
    algorithm, federation, _, _ = learned(trained, "moon", *MOON)
    assert set(algorithm.client_states) == clients_that_took_part(federation)
    previous = [s["previous"] for s in algorithm.client_states.values()]
    assert all(t.dtype == torch.float16 for p in previous for t in p.values())  # method.kept_dtype
    assert not torch.equal(previous[0]["head.weight"], previous[1]["head.weight"])  # each client its own
    before = pooled_loss(algorithm, federation, starting_params("moon", *MOON))
    assert pooled_loss(algorithm, federation) < before - 0.2  # the global model learned


def test_moon_with_mu_0_is_fedavg_bit_for_bit(trained):
    """μ = 0 leaves the cross-entropy alone: the same global model as FedAvg's, to the last bit, with
    previous models kept (clients took part more than once) that a μ > 0 would have contrasted."""
    fedavg, federation, _, _ = trained("fedavg_ft", *MOON)
    moon, _, _, _ = trained("moon", *MOON, "method.mu=0")
    contrasted, _, _, _ = trained("moon", *MOON)
    took_part = [c.id for r in range(1, ROUNDS + 1) for c in federation.sample_round(r, 5, 0)]
    assert len(took_part) > len(set(took_part))  # some clients contrasted with a previous model
    plain, same, other = fedavg.global_params(), moon.global_params(), contrasted.global_params()
    assert all(torch.equal(plain[k], same[k]) for k in plain)
    assert any(not torch.equal(plain[k], other[k]) for k in plain)


def test_moon_loss_is_the_papers_and_a_first_round_has_no_contrastive_gradient(zoo_data):
    """CE + μ·mean −log(e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ})), z the
    classifier's input, by hand in float64; with the global model as the previous one (a client's
    first round) the term is log 2 and adds no gradient."""
    cfg = compose(["method=moon", *TINY, "method.mu=2.0", "method.tau=0.5"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    _, (batch, _) = two_batches(algorithm, zoo_data)
    w = algorithm.global_params()
    torch.manual_seed(1)
    glob, prev = ({k: p + 0.05 * torch.randn_like(p) for k, p in w.items()} for _ in range(2))

    def features(params):
        return algorithm.run_model(algorithm.model, params, batch.x, embedding=True)

    def cosine(a, b):
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))

    z = features(w)
    positive, negative = cosine(z, features(glob)) / 0.5, cosine(z, features(prev)) / 0.5
    contrast = -torch.log(positive.exp() / (positive.exp() + negative.exp()))
    expected = algorithm.loss(w, batch) + 2.0 * contrast.mean()
    torch.testing.assert_close(algorithm.contrastive_loss(w, batch, (glob, prev)), expected)
    first = algorithm.client_state(12345, w)["previous"]  # a client that never trained: the global model
    assert all(torch.equal(first[k], value) for k, value in w.items())
    torch.testing.assert_close(
        algorithm.contrastive_loss(w, batch, (w, first)), algorithm.loss(w, batch) + 2.0 * math.log(2)
    )
    moon = gradient_of(lambda p: algorithm.contrastive_loss(p, batch, (w, first)), w)
    plain = gradient_of(lambda p: algorithm.loss(p, batch), w)
    for k in w:
        torch.testing.assert_close(moon[k], plain[k], rtol=0, atol=1e-12)


def gradient_of(loss, params):
    params = {k: p.clone().requires_grad_() for k, p in params.items()}
    return dict(zip(params, torch.autograd.grad(loss(params), list(params.values()))))


# ---- FedNova ---------------------------------------------------------------------------------------
FEDNOVA = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fednova_learns_and_with_equal_steps_is_fedavg_bit_for_bit(trained):
    """The zoo's shards give every client 150 samples, so every client takes the same steps: the
    normalized average is FedAvg's, to the last bit."""
    algorithm, federation, _, _ = learned(trained, "fednova", *FEDNOVA)
    assert algorithm.client_states == {}
    assert len({c.num_samples for c in federation.train_clients}) == 1
    fedavg, _, _, _ = trained("fedavg_ft", *FEDNOVA)
    nova, plain = algorithm.global_params(), fedavg.global_params()
    assert all(torch.equal(nova[k], plain[k]) for k in plain)


def test_fednova_counts_a_clients_real_steps_and_normalizes_the_average_by_hand(zoo_data):
    """τ_i counts the steps a client took (an idle step of a padded lane does not count); the server
    steps x ← x − τ_eff·Σ p_i (x − y_i)/τ_i with τ_eff = Σ p_i τ_i, p_i by sample count (a client of
    no step adds nothing but its share)."""
    from fedmeta.algorithms.base import ClientUpdate
    from fedmeta.algorithms.fednova import STEPS

    cfg = compose(["method=fednova", *TINY, "method.local_lr=0.1"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    idle = batches[1]._replace(active=torch.tensor(False))
    x = {k: p.clone() for k, p in algorithm.global_params().items()}
    result = algorithm.local_update(x, {}, {"epochs": [batches[0], idle, batches[1]]})
    assert algorithm.to_update(client, result).params[STEPS].item() == 2.0
    torch.manual_seed(1)
    sent = [{k: p + 0.1 * torch.randn_like(p) for k, p in x.items()} for _ in range(3)]
    steps, sizes = [2.0, 5.0, 0.0], [30.0, 10.0, 20.0]
    sent[2] = dict(x)  # no step: y = x
    updates = [
        ClientUpdate(i, {**y, STEPS: torch.tensor(tau)}, n, 0.0)
        for i, (y, tau, n) in enumerate(zip(sent, steps, sizes))
    ]
    algorithm.aggregate(updates)
    shares = [n / sum(sizes) for n in sizes]
    effective = sum(p * tau for p, tau in zip(shares, steps))
    for k, p in algorithm.global_params().items():
        step = sum(s * (x[k] - y[k]) / tau for s, y, tau in zip(shares, sent, steps) if tau)
        torch.testing.assert_close(p, x[k] - effective * step)
        mean = sum(s * y[k] for s, y in zip(shares, sent))  # FedAvg's: another model
        assert not torch.allclose(p, mean)


# ---- FedFomo ---------------------------------------------------------------------------------------
FEDFOMO = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedfomo_learns_and_the_server_keeps_each_clients_model_and_affinities(trained):
    algorithm, federation, _, _ = learned(trained, "fedfomo", *FEDFOMO)
    took_part = clients_that_took_part(federation)
    assert algorithm.client_states == {}  # the models are the server's, not the clients'
    assert set(algorithm.sent) == took_part
    assert all(t.dtype == torch.float16 for m in algorithm.sent.values() for t in m.values())
    rows = set(torch.nonzero(algorithm.affinity.abs().sum(1)).flatten().tolist())
    assert rows and rows <= took_part  # a row for each client that weighed others' models
    client, params = next(iter(algorithm.sent)), algorithm.global_params()
    own = algorithm.kept_model(params, algorithm.client_state(client, params))
    assert all(torch.equal(own[k], algorithm.sent[client][k].float()) for k in own)  # scored: its own θ_i
    assert_personal_models_learned(algorithm, federation)  # measured 0.83 against the mean's 0.18


def assert_personal_models_learned(algorithm, federation) -> None:
    """The model the method keeps for each client that took part, on that client's held-out data:
    well above chance and above the server's mean model (which no client trains from)."""
    params, own, mean = algorithm.global_params(), [], []
    for client in (c for c in federation.train_clients if c.id in algorithm.sent):
        batch = client.batch("held_out", None)
        kept = algorithm.kept_model(params, algorithm.client_state(client.id, params))
        with torch.no_grad():
            own.append((algorithm(kept, batch.x).argmax(1) == batch.y).float().mean().item())
            mean.append((algorithm(params, batch.x).argmax(1) == batch.y).float().mean().item())
    print(f"personal models {np.mean(own):.4f}, the server's mean model {np.mean(mean):.4f}")
    assert np.mean(own) > max(0.6, np.mean(mean) + 0.2)


def test_fedfomo_weights_are_nonnegative_and_favour_the_models_that_help(trained, zoo_data):
    """Client i's own model is the initial one; it downloads a trained client's model (lower loss on
    its validation split), a worse one and an empty slot. Raw weights (L(θ_i) − L(θ_n))/(‖θ_n − θ_i‖ +
    10⁻⁵), by hand; the start mixes only the helpful models, by their positive weights summed to one."""
    trained_algorithm, federation, _, _ = trained("fedfomo", *FEDFOMO)
    cfg = compose(["method=fedfomo", *TINY, *FEDFOMO])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client = federation.train_clients[0]
    validation = client.batch("held_out", None)
    validation = validation._replace(x=validation.x.double())
    own = algorithm.global_params()
    torch.manual_seed(1)
    kept = [{k: v.double() for k, v in m.items()} for m in trained_algorithm.sent.values()]
    good = min(kept, key=lambda m: algorithm.loss(m, validation).item())  # the most helpful of them
    bad = {k: p + 0.5 * torch.randn_like(p) for k, p in own.items()}
    models = [good, bad, own]
    state = {
        "own": own,
        "others": {k: torch.stack([m[k] for m in models]) for k in own},
        "ids": torch.tensor([3, 7, -1]),
    }
    raw, shares = algorithm.weights(state, validation)

    def by_hand(model):
        distance = sum(((model[k] - own[k]) ** 2).sum() for k in own).sqrt()
        return (algorithm.loss(own, validation) - algorithm.loss(model, validation)) / (distance + 1e-5)

    torch.testing.assert_close(raw[:2], torch.stack([by_hand(good), by_hand(bad)]))
    assert raw[0] > 0 > raw[1] and raw[2] == 0  # the trained model helps, the noisy one hurts
    assert (shares >= 0).all() and shares.tolist() == [1.0, 0.0, 0.0]
    start = algorithm.local_update(own, state, {"epochs": [], "validation": validation}).params
    assert all(torch.equal(start[k], own[k] + (good[k] - own[k])) for k in own)  # no epochs: the start
    hurt = {**state, "others": {k: torch.stack([bad[k], bad[k], own[k]]) for k in own}}
    nothing = algorithm.local_update(own, hurt, {"epochs": [], "validation": validation}).params
    assert all(torch.equal(nothing[k], own[k]) for k in own)  # no model helps: its own


def test_fedfomo_sends_the_most_affine_models_and_keeps_the_most_recent():
    from fedmeta.algorithms.base import ClientUpdate

    cfg = compose(["method=fedfomo", *TINY, "method.models=2", "method.kept_models=3"])
    algorithm = build_algorithm(cfg, 10)
    params = algorithm.global_params()
    for i in (4, 1, 2, 5):  # sent in this order: 5 most recently, 4 dropped beyond 3 kept models
        algorithm.aggregate([ClientUpdate(i, dict(params), 1.0, 0.0)])
    assert list(algorithm.sent) == [1, 2, 5]
    assert algorithm.downloads(1) == [5, 2]  # equal affinities: the most recent first, not its own
    algorithm.affinity[1, 2] = 0.5
    assert algorithm.downloads(1) == [2, 5]
    assert algorithm.client_state(1, params)["ids"].tolist() == [2, 5]
    ids = algorithm.client_state(9, params)["ids"].tolist()  # a client with no model: the initial one
    assert ids == [5, 2]


# ---- FedAMP ----------------------------------------------------------------------------------------
FEDAMP = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedamp_learns_and_the_server_keeps_each_clients_model(trained):
    algorithm, federation, _, _ = learned(trained, "fedamp", *FEDAMP)
    assert algorithm.client_states == {} and set(algorithm.sent) == clients_that_took_part(federation)
    assert all(t.dtype == torch.float16 for m in algorithm.sent.values() for t in m.values())
    assert_personal_models_learned(algorithm, federation)  # measured 0.95 against the mean's 0.23


def test_fedamp_attention_weights_sum_to_one_and_favour_similar_models(trained):
    """ξ_ii = self_weight, ξ_ij = (1 − ξ_ii)·softmax_j(σ·cos(w_i, w_j)), by hand: a row sums to one,
    the most similar model weighs most; u_i is the weighted sum of the kept models."""
    algorithm, _, cfg, _ = trained("fedamp", *FEDAMP)
    client = next(iter(algorithm.sent))
    ids, weights = algorithm.attention(client)
    assert ids[0] == client and sorted(ids) == sorted(algorithm.sent)
    flat = [torch.cat([algorithm.sent[j][k].double().flatten() for k in algorithm.names]) for j in ids]
    similarity = torch.stack([torch.nn.functional.cosine_similarity(flat[0], f, 0) for f in flat[1:]])
    xi = cfg.method.self_weight
    others = (1 - xi) * torch.softmax(cfg.method.sigma * similarity, 0)
    expected = torch.cat([torch.tensor([xi]).double(), others])
    torch.testing.assert_close(weights, expected)
    assert weights.sum().item() == pytest.approx(1.0, abs=1e-12) and (weights >= 0).all()
    assert weights[1:].argmax() == similarity.argmax() and weights[1:].max() > weights[1:].min()
    params = algorithm.global_params()
    cloud = algorithm.client_state(client, params)["cloud"]
    for k in params:
        mixed = sum(w * algorithm.sent[j][k].double() for j, w in zip(ids, weights.tolist()))
        torch.testing.assert_close(cloud[k], mixed.float())


def test_fedamp_local_steps_pull_toward_the_cloud_model_by_hand(zoo_data):
    """From u: w1 = u − η∇F(u) (the pull is 0 there), w2 = w1 − η(∇F(w1) + λ/α_k·(w1 − u))."""
    cfg = compose(["method=fedamp", *TINY, "method.local_lr=0.1", "method.lam=2.0", "method.alpha_k=4.0"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    _, batches = two_batches(algorithm, zoo_data)
    torch.manual_seed(1)
    u = {k: p + 0.01 * torch.randn_like(p) for k, p in algorithm.global_params().items()}
    g0 = gradient(algorithm, u, batches[0])
    w1 = {k: u[k] - 0.1 * g0[k] for k in u}
    g1 = gradient(algorithm, w1, batches[1])
    w2 = {k: w1[k] - 0.1 * (g1[k] + 0.5 * (w1[k] - u[k])) for k in u}
    result = algorithm.local_update(algorithm.global_params(), {"cloud": u}, {"epochs": batches})
    for k in u:
        torch.testing.assert_close(result.params[k], w2[k])


def test_fedamp_and_fedfomo_kept_models_are_checkpointed(trained, tmp_path):
    for method, overrides in (("fedamp", FEDAMP), ("fedfomo", FEDFOMO)):
        algorithm, _, cfg, _ = trained(method, *overrides)
        torch.save(algorithm.federation_state(), tmp_path / "state.pt")
        fresh = build_algorithm(cfg, 10)
        fresh.load_federation_state(torch.load(tmp_path / "state.pt", weights_only=True))
        assert list(fresh.sent) == list(algorithm.sent)  # the order too: the most recent last
        client = next(iter(algorithm.sent))
        kept, back = (a.client_state(client, a.global_params()) for a in (algorithm, fresh))
        for key in kept:
            for got, expected in zip(_tensors(back[key]), _tensors(kept[key])):
                assert torch.equal(got, expected), (method, key)
        node = build_algorithm(cfg, 10)  # a Flower node: none of the kept models, only what arrives
        node.load_broadcast_state(algorithm.broadcast_state(client), client)
        arrived = node.client_state(client, node.global_params())
        assert arrived.keys() == kept.keys()
        assert all(
            torch.equal(a, b) for key in kept for a, b in zip(_tensors(arrived[key]), _tensors(kept[key]))
        )


def _tensors(tree):
    return [t for key in sorted(tree) for t in _tensors(tree[key])] if isinstance(tree, dict) else [tree]


# ---- FedGH, FedDBE, GPFL, FedCP, pFedHN --------------------------------------------------------------
def kept_and_server_accuracy(algorithm, federation, ids) -> tuple[float, float]:
    """The mean held-out accuracy, over the training clients ``ids``, of the model the method keeps
    for each, and of the server's model on the same clients."""
    params, own, server = algorithm.global_params(), [], []
    for client in (c for c in federation.train_clients if c.id in ids):
        batch = client.batch("held_out", None)
        kept = algorithm.kept_model(params, algorithm.client_state(client.id, params))
        with torch.no_grad():
            own.append((algorithm(kept, batch.x).argmax(1) == batch.y).float().mean().item())
            server.append((algorithm(params, batch.x).argmax(1) == batch.y).float().mean().item())
    print(f"kept models {np.mean(own):.4f}, the server's model {np.mean(server):.4f}")
    return float(np.mean(own)), float(np.mean(server))


def doubled(batch):
    return batch._replace(x=batch.x.double())


FEDGH = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedgh_learns_each_client_keeps_its_extractor_and_the_server_trains_the_header(trained):
    from fedmeta.models import CLASSIFIER

    algorithm, federation, _, _ = learned(trained, "fedgh", *FEDGH)
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part
    bodies = [algorithm.client_states[c]["body"] for c in sorted(took_part)]
    assert all(t.dtype == torch.float16 for b in bodies for t in b.values())  # method.kept_dtype
    assert set(bodies[0]) == set(algorithm.body_names)  # the extractor only: the header is global
    assert not torch.equal(bodies[0]["features.blocks.0.0.weight"], bodies[1]["features.blocks.0.0.weight"])
    initial, now = starting_params("fedgh", *FEDGH), algorithm.global_params()
    assert all(torch.equal(now[n], initial[n]) for n in algorithm.body_names)  # no extractor is sent
    assert not torch.equal(now[CLASSIFIER + "weight"], initial[CLASSIFIER + "weight"])  # the header trained
    own, server = kept_and_server_accuracy(algorithm, federation, took_part)
    assert own > max(0.6, server + 0.3)  # measured 0.78 against the server model's 0.10


def test_fedgh_local_training_representations_and_header_steps_by_hand(zoo_data):
    """The client trains its own extractor under the global header (two SGD steps on the cross-
    entropy), sends its class means of the trained extractor's representations; the server takes
    one SGD step on the header per (representation, class), client after client, classes in order."""
    from fedmeta.algorithms.fedproto import HELD, PROTOTYPE

    cfg = compose(
        ["method=fedgh", *TINY, "method.local_lr=0.1", "method.server_lr=0.5", "method.kept_dtype=float32"]
    )
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    torch.manual_seed(1)
    own = {k: w[k] + 0.01 * torch.randn_like(w[k]) for k in algorithm.body_names}
    algorithm.client_states = {client.id: {"body": dict(own)}}
    theta = {**w, **own}
    for batch in batches:
        g = gradient(algorithm, theta, batch)
        theta = {k: theta[k] - 0.1 * g[k] for k in theta}
    everything = doubled(client.batch("all", None))
    result = algorithm.local_update(
        w, algorithm.client_state(client.id, w), {"epochs": batches, "all": everything}
    )
    for k in algorithm.body_names:
        torch.testing.assert_close(result.state["body"][k], theta[k])
    with torch.no_grad():
        z = algorithm.run_model(algorithm.model, theta, everything.x, embedding=True)
    classes = sorted(set(everything.y.tolist()))
    for j in range(10):
        expected = z[everything.y == j].mean(0) if j in classes else torch.zeros(32, dtype=torch.float64)
        torch.testing.assert_close(result.params[PROTOTYPE][j], expected)
    assert result.params[HELD].tolist() == [float(j in classes) for j in range(10)]
    update = algorithm.to_update(client, result)
    other_means = torch.randn(10, 32, dtype=torch.float64)
    other_held = torch.zeros(10, dtype=torch.float64)
    other_held[[7, 2]] = 1
    other = type(update)(client.id + 1, {PROTOTYPE: other_means, HELD: other_held}, 1.0, 0.0, None)
    head = {k: w[k].clone().requires_grad_() for k in ("head.weight", "head.bias")}
    pairs = [(result.params[PROTOTYPE], j) for j in classes] + [(other_means, 2), (other_means, 7)]
    for means, label in pairs:  # the client's classes in order, then the other client's
        loss = torch.nn.functional.cross_entropy(
            (head["head.weight"] @ means[label] + head["head.bias"]).unsqueeze(0), torch.tensor([label])
        )
        grads = torch.autograd.grad(loss, list(head.values()))
        head = {k: (p - 0.5 * g).detach().requires_grad_() for (k, p), g in zip(head.items(), grads)}
    algorithm.aggregate([update, other])
    for k, p in head.items():
        torch.testing.assert_close(algorithm.global_params()[k], p.detach())
    assert all(torch.equal(algorithm.global_params()[k], w[k]) for k in algorithm.body_names)
    kept = algorithm.client_states[client.id]["body"]["dense.0.0.weight"]  # in method.kept_dtype
    assert torch.equal(kept, theta["dense.0.0.weight"].to(kept.dtype))


FEDDBE = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_feddbe_learns_and_each_client_keeps_only_its_representation_bias(trained):
    from fedmeta.algorithms.feddbe import MEAN, PRBM, READY

    algorithm, federation, _, _ = learned(trained, "feddbe", *FEDDBE)
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part
    assert all(set(s) == {PRBM} and s[PRBM].shape == (32,) for s in algorithm.client_states.values())
    biases = [algorithm.client_states[c][PRBM] for c in sorted(took_part)]
    assert not torch.equal(biases[0], biases[1]) and all(b.abs().max() > 0 for b in biases)
    assert algorithm.global_mean[READY] == 1 and algorithm.global_mean[MEAN].abs().max() > 0
    assert torch.equal(algorithm.global_params()[PRBM], torch.zeros(32))  # never sent, never averaged
    before = pooled_loss(algorithm, federation, starting_params("feddbe", *FEDDBE))
    assert pooled_loss(algorithm, federation) < before - 0.2  # the global model learned


def test_feddbe_first_round_is_fedavg_bit_for_bit_and_fixes_the_global_mean(zoo_data):
    """The initialization period: the first round's clients train without DBE — FedAvg's round to the
    last bit — and their running means (μ = 1: the mean representation of the last batch, under the
    model before its step), weighted by sample count, are z̄^g, which no later round moves."""
    from fedmeta.algorithms.feddbe import MEAN, PRBM, READY

    federation, runs = federation_of(zoo_data), {}
    for method in ("fedavg_ft", "feddbe"):
        cfg = compose([f"method={method}", *TINY, *FEDDBE])
        make_fabric(cfg).seed_everything(0, verbose=False)
        runs[method] = build_algorithm(cfg, 10)
    plain, dbe = runs["fedavg_ft"], runs["feddbe"]
    w = dbe.global_params()
    clients = federation.sample_round(1, 5, 0)
    updates = [dbe.run_client(client, 1) for client in clients]
    for client, update in zip(clients, updates):
        batches = list(dbe.draw(client, 1)["epochs"])
        before_last, _ = plain.local_sgd({k: w[k] for k in plain.global_params()}, batches[:-1], 0.05)
        with torch.no_grad():
            z = dbe.run_model(dbe.model, {**w, **before_last}, batches[-1].x, embedding=True)
        torch.testing.assert_close(update.params[MEAN], z.mean(0))
    federated_round(plain, federation, 1, 5, seed=0)
    federated_round(dbe, federation, 1, 5, seed=0)
    assert all(torch.equal(plain.global_params()[k], dbe.global_params()[k]) for k in plain.global_params())
    assert all(torch.equal(s[PRBM], torch.zeros(32)) for s in dbe.client_states.values())  # no DBE yet
    total = sum(u.weight for u in updates)
    expected = sum(u.params[MEAN] * u.weight / total for u in updates)
    assert dbe.global_mean[READY] == 1
    torch.testing.assert_close(dbe.global_mean[MEAN], expected)
    fixed = dbe.global_mean[MEAN].clone()
    federated_round(dbe, federation, 2, 5, seed=0)
    assert torch.equal(dbe.global_mean[MEAN], fixed)  # fixed from then on
    assert any(s[PRBM].abs().max() > 0 for s in dbe.client_states.values())  # the PRBMs train now


def test_feddbe_local_steps_add_the_bias_and_pull_the_running_mean_by_hand(zoo_data):
    """With z̄^g measured: each step descends CE(h(z + b̄)) + κ·mean ½(z̄ − z̄^g)², z̄ = (1 − μ)·z̄_prev +
    μ·mean_batch(z) (z̄_prev held fixed, 0 at the start), for the model and the client's b̄ together."""
    from fedmeta.algorithms.feddbe import MEAN, PRBM, READY

    cfg = compose(
        ["method=feddbe", *TINY, "method.local_lr=0.1", "method.kappa=2.0", "method.mean_momentum=0.5"]
    )
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, batches = two_batches(algorithm, zoo_data)
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    torch.manual_seed(1)
    target, bias = torch.rand(32, dtype=torch.float64), 0.1 * torch.randn(32, dtype=torch.float64)
    algorithm.global_mean = {MEAN: target, READY: torch.tensor(1.0, dtype=torch.float64)}
    algorithm.client_states = {client.id: {PRBM: bias}}

    def loss(params, batch, running):
        z = algorithm.run_model(algorithm.model, params, batch.x, embedding=True)
        logits = z + params[PRBM]
        logits = logits @ params["head.weight"].T + params["head.bias"]
        tracked = 0.5 * running + 0.5 * z.mean(0)
        return (
            torch.nn.functional.cross_entropy(logits, batch.y) + 2.0 * (0.5 * (tracked - target) ** 2).mean()
        )

    theta, running = {**w, PRBM: bias}, torch.zeros(32, dtype=torch.float64)
    for batch in batches:
        leaves = {k: p.clone().requires_grad_() for k, p in theta.items()}
        g = dict(zip(leaves, torch.autograd.grad(loss(leaves, batch, running), list(leaves.values()))))
        with torch.no_grad():
            z = algorithm.run_model(algorithm.model, theta, batch.x, embedding=True)
        running = 0.5 * running + 0.5 * z.mean(0)
        theta = {k: theta[k] - 0.1 * g[k] for k in theta}
    result = algorithm.local_update(w, algorithm.client_state(client.id, w), {"epochs": batches})
    for k in w:
        torch.testing.assert_close((result.state["own"] if k == PRBM else result.params)[k], theta[k])
    torch.testing.assert_close(result.params[MEAN], running)
    assert PRBM not in result.params  # the bias never leaves its client


GPFL = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_gpfl_learns_each_client_keeps_its_head_and_label_shares(trained):
    from fedmeta.algorithms.gpfl import EMBEDDINGS

    algorithm, federation, _, _ = learned(trained, "gpfl", *GPFL)
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part
    state = algorithm.client_states[next(iter(took_part))]
    assert set(state) == {*algorithm.head_names, "share"}  # the head and the label distribution only
    assert state["share"].sum().item() == pytest.approx(1.0) and (state["share"] > 0).sum() <= 3  # ~2 classes
    initial, now = starting_params("gpfl", *GPFL), algorithm.global_params()
    assert not torch.equal(now[EMBEDDINGS], initial[EMBEDDINGS])  # GCE averaged
    assert not torch.equal(now["cov.gamma.0.weight"], initial["cov.gamma.0.weight"])  # CoV averaged
    assert torch.equal(now["head.weight"], initial["head.weight"])  # heads never averaged
    own, server = kept_and_server_accuracy(algorithm, federation, took_part)
    assert own > max(0.6, server + 0.3)  # measured 0.82 against the server model's 0.16


def test_gpfl_loss_conditional_inputs_and_weight_decay_by_hand(zoo_data):
    """One step on CE(head(CoV(z, p_i))) + CE(cos(CoV(z, g), e)) + λ‖CoV(z, g) − ē_y‖, CoV(z, c) =
    ReLU(z ⊙ (γ(c) + 1) + β(c)), g = mean e, p_i = Σ P_i(y) e_y from the received GCE ē, weight
    decay μ on GCE and CoV only; the client keeps its head and P_i, sends the rest."""
    from fedmeta.algorithms.gpfl import EMBEDDINGS

    cfg = compose(["method=gpfl", *TINY, "method.local_lr=0.1", "method.lam=0.5", "method.mu=0.2"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, (batch, _) = two_batches(algorithm, zoo_data)
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    everything = doubled(client.batch("all", None))
    share = torch.bincount(everything.y, minlength=10).double() / len(everything.y)
    received = w[EMBEDDINGS]
    layer_norm = torch.nn.functional.layer_norm

    def cov(p, z, c):
        def branch(name):
            h = torch.relu(c @ p[f"cov.{name}.0.weight"].T + p[f"cov.{name}.0.bias"])
            return layer_norm(h, (32,), p[f"cov.{name}.2.weight"], p[f"cov.{name}.2.bias"])

        return torch.relu(z * (branch("gamma") + 1) + branch("beta"))

    def loss(p):
        z = algorithm.run_model(algorithm.model, p, batch.x, embedding=True)
        personal, generic = cov(p, z, share @ received), cov(p, z, received.mean(0))
        ce = torch.nn.functional.cross_entropy(personal @ p["head.weight"].T + p["head.bias"], batch.y)
        e = p[EMBEDDINGS]
        cosines = (generic / generic.norm(dim=1, keepdim=True)) @ (e / e.norm(dim=1, keepdim=True)).T
        angular = torch.nn.functional.cross_entropy(cosines, batch.y)
        return ce + angular + 0.5 * torch.linalg.norm(generic - received[batch.y])

    leaves = {k: p.clone().requires_grad_() for k, p in w.items()}
    g = dict(zip(leaves, torch.autograd.grad(loss(leaves), list(leaves.values()))))
    decay = {k: 0.2 * w[k] if k.startswith(("gce.", "cov.")) else 0.0 for k in w}
    expected = {k: w[k] - 0.1 * (g[k] + decay[k]) for k in w}
    result = algorithm.local_update(
        w, algorithm.client_state(client.id, w), {"epochs": [batch], "all": everything}
    )
    for k in w:
        torch.testing.assert_close(
            (result.state["own"] if k.startswith("head.") else result.params)[k], expected[k]
        )
    torch.testing.assert_close(result.state["share"], share)
    kept = algorithm.kept_model(w, result.state)
    torch.testing.assert_close(kept["gpfl.condition"], share @ received)


FEDCP = ["method.local_lr=0.05", "method.local_epochs=1"]


def test_fedcp_learns_each_client_keeps_its_personalized_head(trained):
    algorithm, federation, _, _ = learned(trained, "fedcp", *FEDCP)
    took_part = clients_that_took_part(federation)
    assert set(algorithm.client_states) == took_part
    assert all(set(s) == set(algorithm.personal_names) for s in algorithm.client_states.values())
    initial, now = starting_params("fedcp", *FEDCP), algorithm.global_params()
    assert torch.equal(now["personal_head.weight"], initial["personal_head.weight"])  # never averaged
    assert not torch.equal(now["head.weight"], initial["head.weight"])  # the global head moved
    assert not torch.equal(now["cpn.0.weight"], initial["cpn.0.weight"])  # the CPN averaged
    own, server = kept_and_server_accuracy(algorithm, federation, took_part)
    assert own > max(0.6, server + 0.3)  # measured 0.76 against the server model's 0.26


def test_fedcp_policy_loss_and_the_uploaded_head_by_hand(zoo_data):
    """One step on CE(W_p(z ⊙ r) + W_g(z ⊙ s)) + λ·MMD(z, z⁰), {r, s} = softmax over each feature's
    pair of (ReLU(LN(A(z ⊙ v̂_i))) + Gumbel noise), v̂_i the normalized sum of W_p's rows; W_g held
    fixed; the client sends ½(W_p + W_g) as the global head and keeps W_p."""
    from fedmeta.algorithms.fedcp import BANDWIDTHS, gumbel

    cfg = compose(["method=fedcp", *TINY, "method.local_lr=0.1", "method.lam=2.0"])
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    client, (batch, _) = two_batches(algorithm, zoo_data)
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    torch.manual_seed(1)
    own = {k: w[k.replace("personal_", "")] + 0.05 * torch.randn_like(w[k]) for k in algorithm.personal_names}
    algorithm.client_states = {client.id: dict(own)}
    seed = torch.tensor(12345)
    noise = gumbel(seed, 0, (len(batch.y), 2, 32), torch.float64)
    context = own["personal_head.weight"].sum(0) / own["personal_head.weight"].sum(0).norm()
    with torch.no_grad():
        z0 = algorithm.run_model(algorithm.model, w, batch.x, embedding=True)

    def kernel(a, b):
        d = torch.cdist(a, b) ** 2
        return sum(torch.exp(-0.5 * d / width) for width in BANDWIDTHS)

    def loss(p):
        z = algorithm.run_model(algorithm.model, p, batch.x, embedding=True)
        h = (z * context) @ p["cpn.0.weight"].T + p["cpn.0.bias"]
        h = torch.relu(torch.nn.functional.layer_norm(h, (64,), p["cpn.1.weight"], p["cpn.1.bias"]))
        policy = torch.softmax(h.view(-1, 2, 32) + noise, dim=1)
        logits = (z * policy[:, 0]) @ p["personal_head.weight"].T + p["personal_head.bias"]
        logits = logits + (z * policy[:, 1]) @ w["head.weight"].T + w["head.bias"]
        discrepancy = (kernel(z, z) + kernel(z0, z0) - 2 * kernel(z, z0)).mean()
        return torch.nn.functional.cross_entropy(logits, batch.y) + 2.0 * discrepancy

    trained = [k for k in w if not k.startswith("head.")]
    leaves = {k: (own[k] if k in own else w[k]).clone().requires_grad_() for k in trained}
    g = dict(zip(leaves, torch.autograd.grad(loss({**w, **leaves}), list(leaves.values()))))
    expected = {k: leaves[k].detach() - 0.1 * g[k] for k in trained}
    result = algorithm.local_update(
        w, algorithm.client_state(client.id, w), {"epochs": [batch], "seed": seed}
    )
    for k in trained:
        torch.testing.assert_close((result.state["own"] if k in own else result.params)[k], expected[k])
    for k in ("weight", "bias"):
        half = 0.5 * expected["personal_head." + k] + 0.5 * w["head." + k]
        torch.testing.assert_close(result.params["head." + k], half)
    assert not set(algorithm.personal_names) & set(result.params)  # the personalized head stays


def test_fedcp_noise_is_gumbel_its_clients_own_and_the_same_however_a_batch_is_padded():
    from fedmeta.algorithms.fedcp import gumbel

    seed = torch.tensor(7)
    draws = gumbel(seed, 3, (4000, 2, 32), torch.float64)
    assert draws.mean().item() == pytest.approx(0.5772, abs=0.01)  # the Euler–Mascheroni constant
    assert draws.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.01)
    assert torch.equal(gumbel(seed, 3, (10, 2, 32), torch.float64), draws[:10])  # padding adds rows after
    assert not torch.equal(gumbel(seed, 4, (10, 2, 32), torch.float64), draws[:10])  # another step
    assert not torch.equal(gumbel(torch.tensor(8), 3, (10, 2, 32), torch.float64), draws[:10])  # another seed


PFEDHN = [
    "method.local_lr=0.05",
    "method.local_epochs=1",
    "federation.num_clients=20",
    "federation.num_new_clients=5",
]


def test_pfedhn_learns_and_makes_a_model_for_each_client(trained):
    algorithm, federation, cfg, _ = learned(trained, "pfedhn", *PFEDHN)
    took_part = clients_that_took_part(federation)
    assert algorithm.client_states == {} and set(algorithm.took_part) == took_part
    assert algorithm.network.embeddings.weight.shape == (20, 4)  # 1 + 15/4: the authors' rule
    params = algorithm.global_params()
    made = [algorithm.client_state(c, params)["own"] for c in sorted(took_part)[:2]]
    assert not torch.equal(made[0]["head.weight"], made[1]["head.weight"])  # a model of its own each
    with torch.no_grad():  # the server's model: the one made for the mean embedding of those clients
        ids = torch.tensor(algorithm.took_part)
        mean = algorithm.network(algorithm.network.mlp(algorithm.network.embeddings(ids).mean(0)))
    assert all(torch.equal(params[n], mean[n]) for n in params)
    before = pooled_loss(algorithm, federation, starting_params("pfedhn", *PFEDHN))
    assert pooled_loss(algorithm, federation) < before - 0.05  # the network learned (measured 0.12)


def test_pfedhn_first_models_are_the_initial_one_and_a_step_is_the_papers_gradient(zoo_data):
    """Zero output weights, the initial model as biases: every client first gets the initial model.
    A step on client i with plain SGD moves each output layer along ∂⟨h(v_i), Δθ_i⟩: its bias by
    −η·Δθ_i, its weight by −η·Δθ_i ⊗ MLP(v_i); h(v_i) then moves toward the trained model."""
    from fedmeta.algorithms.base import ClientUpdate

    cfg = compose(
        [
            "method=pfedhn",
            *TINY,
            "method.server_lr=0.1",
            "method.server_momentum=0",
            "method.server_weight_decay=0",
        ]
    )
    make_fabric(cfg).seed_everything(0, verbose=False)
    algorithm = build_algorithm(cfg, 10).double()
    w = {k: p.clone() for k, p in algorithm.global_params().items()}
    for client_id in (0, 7):
        assert all(torch.equal(t, w[n]) for n, t in algorithm.client_state(client_id, w)["own"].items())
    torch.manual_seed(1)
    trained = {k: p + 0.001 * torch.randn_like(p) for k, p in w.items()}
    with torch.no_grad():
        features = algorithm.network.mlp(algorithm.network.embeddings(torch.tensor(3)))
    outputs = {n: algorithm.network.outputs[n.replace(".", "-")] for n in w}
    before = {n: (layer.weight.detach().clone(), layer.bias.detach().clone()) for n, layer in outputs.items()}
    algorithm.aggregate([ClientUpdate(3, trained, 1.0, 0.0)])
    for n, layer in outputs.items():
        change = (w[n] - trained[n]).flatten()
        torch.testing.assert_close(layer.bias.detach(), before[n][1] - 0.1 * change)
        torch.testing.assert_close(layer.weight.detach(), before[n][0] - 0.1 * torch.outer(change, features))
    now = algorithm.client_state(3, w)["own"]
    toward = sum(((now[n] - w[n]) * (trained[n] - w[n])).sum() for n in w)
    assert toward > 0
    assert algorithm.took_part == [3]


def test_pfedhn_network_and_optimizer_are_checkpointed(trained, tmp_path):
    algorithm, _, cfg, _ = trained("pfedhn", *PFEDHN)
    torch.save(algorithm.federation_state(), tmp_path / "state.pt")
    fresh = build_algorithm(cfg, 10)
    fresh.load_federation_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert fresh.took_part == algorithm.took_part
    client = algorithm.took_part[0]
    kept, back = (a.client_state(client, a.global_params())["own"] for a in (algorithm, fresh))
    assert all(torch.equal(kept[n], back[n]) for n in kept)
    momentum = [s["momentum_buffer"] for s in algorithm.optimizer.state.values()]
    restored = [s["momentum_buffer"] for s in fresh.optimizer.state.values()]
    assert momentum and all(torch.equal(a, b) for a, b in zip(momentum, restored))
    node = build_algorithm(cfg, 10)  # a Flower node: no network, only the θ_i that arrives
    node.load_broadcast_state(algorithm.broadcast_state(client), client)
    arrived = node.client_state(client, node.global_params())["own"]
    assert all(torch.equal(arrived[n], kept[n]) for n in kept)
