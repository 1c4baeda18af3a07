"""Each baseline's defining property, on small real data (RMNIST) and tiny models."""

import pytest
import torch
from torch import nn

from fedmeta.algorithms import PerFedAvg, build_algorithm
from fedmeta.config import compose
from fedmeta.data import Batch, ImageDataset, build_federation
from fedmeta.evaluation import personalize_client
from fedmeta.loop import train
from fedmeta.rounds import federated_round

SMALL_MODEL = ["model.conv_channels=[8,16]", "model.dense_units=[32]"]


def algorithm_for(method, *overrides):
    cfg = compose([f"method={method}", "wandb.mode=disabled", *SMALL_MODEL, *overrides])
    torch.manual_seed(0)
    return cfg, build_algorithm(cfg, 10)


@pytest.fixture(scope="module")
def two_concepts(rmnist):
    """Upright digits with true labels vs the same digits with labels shifted by 5: two clearly
    different distributions (concept shift), four clients each."""
    upright = torch.nonzero(rmnist.groups == 0).squeeze(1)[:2400]
    x = torch.cat([rmnist.x[upright], rmnist.x[upright]])
    y = torch.cat([rmnist.y[upright], (rmnist.y[upright] + 5) % 10])
    data = ImageDataset(
        x=x, y=y, num_classes=10, groups=torch.cat([torch.zeros(2400), torch.ones(2400)]).long()
    )
    return build_federation(data, {"name": "groups"}, 10, 2, 0.2, seed=0)


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_ifca_assigns_different_distributions_to_different_models(two_concepts):
    _, ifca = algorithm_for("ifca", "method.clusters=2", "method.local_epochs=1", "method.local_lr=0.05")
    for round_ in range(1, 13):
        federated_round(ifca, two_concepts, round_, 4, seed=0)
    clients = two_concepts.train_clients + two_concepts.new_clients
    concept = {c.id: int(c.pers[0] >= 2400) for c in clients}  # the second half holds shifted labels
    chosen = {c.id: ifca.choose_cluster(c, "pers") for c in clients}
    by_concept = {k: {chosen[i] for i in chosen if concept[i] == k} for k in (0, 1)}
    assert len(by_concept[0]) == 1 and len(by_concept[1]) == 1  # each distribution picks one model
    assert by_concept[0] != by_concept[1]  # and not the same one


def test_ifca_averages_each_model_over_the_clients_that_chose_it(two_concepts):
    _, ifca = algorithm_for("ifca", "method.clusters=3", "method.local_epochs=1")
    before = {k: v.clone() for k, v in ifca.global_params().items()}
    clients = two_concepts.sample_round(1, 4, seed=0)
    chosen = {ifca.choose_cluster(c, "all") for c in clients}
    federated_round(ifca, two_concepts, 1, 4, seed=0)
    after = ifca.global_params()
    for j in range(3):
        changed = not torch.equal(before[f"nets.{j}.head.weight"], after[f"nets.{j}.head.weight"])
        assert changed == (j in chosen)


def test_ifca_weight_sharing_keeps_one_body(two_concepts):
    _, ifca = algorithm_for("ifca", "method.clusters=3", "method.share_body=true", "method.local_epochs=1")
    federated_round(ifca, two_concepts, 1, 4, seed=0)
    params = ifca.global_params()
    for name in (n for n in params if n.startswith("nets.0.") and ".head." not in n):
        for j in (1, 2):
            torch.testing.assert_close(params[name], params[name.replace("nets.0.", f"nets.{j}.")])


def test_ditto_personal_model_moves_toward_global_as_lambda_grows(two_concepts):
    distances = []
    client = two_concepts.new_clients[0]
    for lam in (0.0, 0.1, 10.0):
        cfg, ditto = algorithm_for(
            "ditto", f"method.lam={lam}", "personalization.steps=15", "personalization.lr=0.05"
        )
        personal, _ = personalize_client(ditto, client, cfg.personalization)
        w = ditto.global_params()
        distances.append(sum(((personal[k] - w[k]) ** 2).sum() for k in w).sqrt().item())
    assert distances[0] > distances[1] > distances[2] > 0


def test_fedrep_never_averages_heads(two_concepts):
    _, fedrep = algorithm_for("fedrep", "method.head_epochs=1", "method.local_lr=0.05")
    before = {k: v.clone() for k, v in fedrep.global_params().items()}
    for round_ in (1, 2):
        federated_round(fedrep, two_concepts, round_, 4, seed=0)
    after = fedrep.global_params()
    for name in fedrep.head_names:
        assert torch.equal(before[name], after[name])
    assert all(not torch.equal(before[n], after[n]) for n in fedrep.body_names)
    assert len(fedrep.client_states) >= 4
    kept = next(iter(fedrep.client_states.values()))
    assert not torch.equal(
        kept["head.weight"], after["head.weight"]
    )  # the trained head stayed with its client


@pytest.mark.parametrize("head_steps", [0, 3])
def test_fedrep_new_client_fits_its_head_on_the_frozen_body_first(two_concepts, head_steps):
    steps = ["personalization.steps=5", "personalization.lr=0.05", f"method.test_head_steps={head_steps}"]
    cfg, fedrep = algorithm_for("fedrep", *steps)
    w = fedrep.global_params()
    client = two_concepts.new_clients[0]
    after = {}
    for k in (head_steps, 5):  # the parameters after the head-only steps, and after all 5
        personal, curve = personalize_client(
            fedrep,
            client,
            compose(["method=fedrep", *SMALL_MODEL, *steps, f"personalization.steps={k}"]).personalization,
        )
        after[k] = personal
    moved = {n for n in w if not torch.equal(after[head_steps][n], w[n])}
    assert moved == (set(fedrep.head_names) if head_steps else set())  # the body stays frozen
    assert all(not torch.equal(after[5][n], w[n]) for n in fedrep.body_names)  # then every layer trains
    assert curve[-1] > curve[0]  # and the new client learns


def test_perfedavg_first_order_drops_the_hessian_term(two_concepts):
    _, hf = algorithm_for("perfedavg")
    _, fo = algorithm_for("perfedavg", "method.first_order=true")
    client = two_concepts.train_clients[0]
    batches = [client.batch("all", 30, client.generator(1)) for _ in range(3)]
    w = hf.global_params()
    hf_grad, fo_grad = hf.meta_gradient(w, batches), fo.meta_gradient(w, batches)
    assert any(not torch.allclose(hf_grad[k], fo_grad[k]) for k in w)


@pytest.mark.parametrize("model", ["smooth", "cnn"])
def test_perfedavg_exact_hvp_is_autograds_and_the_finite_differences_limit(two_concepts, model):
    """method.hessian=exact (forward-over-reverse) equals torch.autograd.functional.hvp in float64 on
    the CNN itself (BatchNorm, max-pool), and where finite differences converge (a smooth model)
    the default finite-difference product is within δ² of it. The default stays finite_difference."""
    cfg, default = algorithm_for("perfedavg")
    assert cfg.method.hessian == "finite_difference"
    cfg, exact = algorithm_for("perfedavg", "method.hessian=exact")
    if model == "smooth":  # across ReLU/max-pool kinks the gradient jumps: no finite difference converges
        torch.manual_seed(0)
        net = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.Tanh(), nn.Linear(16, 10))
        exact, default = PerFedAvg(net, cfg.method), PerFedAvg(net, default.cfg)
    exact.double()
    client = two_concepts.train_clients[0]
    x, y = client.batch("all", 20, client.generator(1))[:2]
    batch = Batch(x.double(), y)
    w = {k: v.detach() for k, v in exact.global_params().items()}
    g = torch.Generator().manual_seed(0)
    v = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in w.items()}
    norm = torch.sqrt(sum((t**2).sum() for t in v.values()))
    v = {k: t / norm for k, t in v.items()}

    ours = exact.hessian_vector_product(w, v, batch)
    names = list(w)
    _, reference = torch.autograd.functional.hvp(
        lambda *p: exact.loss(dict(zip(names, p)), batch), tuple(w.values()), tuple(v.values())
    )
    for k, r in zip(names, reference):
        torch.testing.assert_close(ours[k], r, rtol=1e-9, atol=1e-12)
    if model == "smooth":
        finite = default.hessian_vector_product(w, v, batch)
        for k in names:
            torch.testing.assert_close(finite[k], ours[k], rtol=1e-5, atol=1e-8)


def test_local_never_communicates(two_concepts):
    _, local = algorithm_for("local")
    before = {k: v.clone() for k, v in local.global_params().items()}
    clients = two_concepts.sample_round(1, 4, seed=0)
    assert all(local.run_client(c, 1).params == {} for c in clients)
    for round_ in (1, 2, 3):
        federated_round(local, two_concepts, round_, 4, seed=0)
    assert all(torch.equal(before[k], v) for k, v in local.global_params().items())


FAST = {
    "fedavg": ["method.local_epochs=1"],
    "ifca": ["method.local_epochs=1"],
    "ifca_ft": ["method.local_epochs=1"],
    "ditto": ["method.local_epochs=1"],
    "fedrep": ["method.head_epochs=1"],
    "fedper": ["method.local_epochs=1"],
    "lgfedavg": ["method.local_epochs=1"],
    "fedbabu": ["method.local_epochs=1"],
    "fedbn": ["method.local_epochs=1"],
    "perfedavg": [],
    "fedmeta_maml": [],
    "fedmeta_metasgd": [],
    "pfedme": ["method.local_rounds=3"],
    "apfl": ["method.local_epochs=1"],
    "fedprox": ["method.local_epochs=1"],
    "scaffold": ["method.local_epochs=1"],
    "feddyn": ["method.local_epochs=1"],
    "fedproto": ["method.local_epochs=1"],
    "fedrod": ["method.local_epochs=1"],
    "fedpac": ["method.local_epochs=1"],
    "fedala": ["method.local_epochs=1", "method.first_epochs=2"],
    "local": [],
    "moon": ["method.local_epochs=1"],
    "fednova": ["method.local_epochs=1"],
    "fedfomo": ["method.local_epochs=1"],
    "fedamp": ["method.local_epochs=1"],
    "fedgh": ["method.local_epochs=1"],
    "feddbe": ["method.local_epochs=1"],
    "gpfl": ["method.local_epochs=1"],
    "fedcp": ["method.local_epochs=1"],
    "pfedhn": ["method.local_epochs=1"],
}


@pytest.mark.parametrize("method", sorted(FAST))
def test_every_baseline_trains_end_to_end(method, tmp_path, mnist_dir):
    cfg = compose(
        [
            f"method={method}",
            f"dataset.dir={mnist_dir}",
            f"output.root={tmp_path}",
            "wandb.mode=disabled",
            "federation.rounds=2",
            "federation.num_new_clients=4",
            "personalization.steps=5",
            *SMALL_MODEL,
            *FAST[method],
        ]
    )
    summary = train(cfg, show_progress=False)
    assert len(summary["curve"]) == cfg.personalization.steps + 1
    assert 0 <= summary["accuracy"] <= 1
