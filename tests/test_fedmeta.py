"""FedMeta (MAML and Meta-SGD): the client's meta-gradient is learn2learn's, the server's step is
Algorithm 1's (or a kept Adam), Meta-SGD's learned rates are global state that new clients use."""

import learn2learn as l2l
import pytest
import torch
import torch.nn.functional as F

from fedmeta.algorithms import ClientUpdate, build_algorithm
from fedmeta.algorithms.fedmeta import META_GRAD
from fedmeta.config import compose
from fedmeta.data import Batch
from fedmeta.functional import grad_and_value

TINY = ["model.conv_channels=[4,8]", "model.dense_units=[16]", "wandb.mode=disabled"]


def tiny(method: str, *overrides: str):
    cfg = compose([f"method={method}", *TINY, *overrides])
    torch.manual_seed(0)
    return cfg, build_algorithm(cfg, 10).double()


def batches(count: int, size: int, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [
        Batch(
            torch.randn(size, 1, 28, 28, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (size,), generator=g),
        )
        for _ in range(count)
    ]


def random_rates(algorithm) -> None:
    """Learned rates that differ per weight, so that a test sees each one used where it belongs."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rate in algorithm.model.rates.parameters():
            rate.copy_(0.01 + 0.1 * torch.rand(rate.shape, generator=g, dtype=rate.dtype))


@pytest.mark.parametrize("first_order", [False, True])
@pytest.mark.parametrize("method", ["fedmeta_maml", "fedmeta_metasgd"])
def test_meta_gradient_is_learn2learns(method, first_order):
    """g_u — ∇θ (and Meta-SGD's ∇α) of the query loss after 2 support steps — equals learn2learn's
    MAML / MetaSGD on the same network, in float64, second order and first order."""
    _, algorithm = tiny(method, "method.inner_steps=2", f"method.first_order={str(first_order).lower()}")
    meta_sgd = method == "fedmeta_metasgd"
    if meta_sgd:
        random_rates(algorithm)
    support, (query,) = batches(2, 12, seed=0), batches(1, 9, seed=1)
    params = algorithm.global_params()
    ours, _ = grad_and_value(algorithm.meta_loss)(params, {"support": support, "query": query})

    net = algorithm.model.base if meta_sgd else algorithm.model
    if meta_sgd:
        lrs = torch.nn.ParameterList(
            [torch.nn.Parameter(r.detach().clone()) for r in algorithm.model.rates.parameters()]
        )
        learner = l2l.algorithms.MetaSGD(net, lrs=lrs, first_order=first_order).clone()
    else:
        learner = l2l.algorithms.MAML(net, lr=algorithm.cfg.inner_lr, first_order=first_order).clone()
    for batch in support:
        learner.adapt(F.cross_entropy(learner(batch.x), batch.y))
    F.cross_entropy(learner(query.x), query.y).backward()

    prefix = "base." if meta_sgd else ""
    for name, p in net.named_parameters():
        torch.testing.assert_close(ours[prefix + name], p.grad, rtol=1e-9, atol=1e-12)
    if meta_sgd:  # the learned rates' gradient: learn2learn's lrs hold it in the network's order
        for (name, _), lr in zip(net.named_parameters(), lrs):
            torch.testing.assert_close(ours["rates." + name], lr.grad, rtol=1e-9, atol=1e-12)
            assert lr.grad.abs().sum() > 0


def test_second_order_differs_from_first_order():
    support, (query,) = batches(1, 12, seed=0), batches(1, 9, seed=1)
    grads = []
    for first_order in ("false", "true"):
        _, algorithm = tiny("fedmeta_maml", f"method.first_order={first_order}")
        data = {"support": support, "query": query}
        grads.append(grad_and_value(algorithm.meta_loss)(algorithm.global_params(), data)[0])
    assert any(not torch.allclose(grads[0][k], grads[1][k]) for k in grads[0])


def updates_of(algorithm, gradients: list[dict]) -> list[ClientUpdate]:
    """What clients whose meta-gradients are ``gradients`` send, as local_update does: θ − β·g_u to a
    server that steps with SGD, g_u itself (``meta_grad.<name>``) to one that steps with Adam."""
    theta, beta = algorithm.global_params(), algorithm.cfg.outer_lr
    if algorithm.cfg.outer_optimizer == "adam":
        sent = [{META_GRAD + k: g[k] for k in theta} for g in gradients]
    else:
        sent = [{k: theta[k] - beta * g[k] for k in theta} for g in gradients]
    return [ClientUpdate(i, params, 1.0, torch.tensor(0.0)) for i, params in enumerate(sent)]


def random_gradients(algorithm, count: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in algorithm.global_params().items()}
        for _ in range(count)
    ]


def test_sgd_server_step_is_algorithm_1_on_theta_and_the_rates():
    """outer_optimizer=sgd: θ ← θ − β/m Σ g_u, and Meta-SGD's (θ, α) likewise (α averaged with θ)."""
    _, algorithm = tiny("fedmeta_metasgd", "method.outer_optimizer=sgd", "method.outer_lr=0.01")
    theta = {k: v.clone() for k, v in algorithm.global_params().items()}
    gradients = random_gradients(algorithm, 3, seed=0)
    algorithm.aggregate(updates_of(algorithm, gradients))
    after = algorithm.global_params()
    assert any(k.startswith("rates.") for k in after)
    for k in theta:
        mean = sum(g[k] for g in gradients) / 3
        torch.testing.assert_close(after[k], theta[k] - 0.01 * mean, rtol=1e-12, atol=1e-14)


def test_adam_server_step_is_torch_adam_kept_across_rounds_and_checkpoints():
    """outer_optimizer=adam: the server steps with torch.optim.Adam on the clients' mean gradient,
    one Adam across rounds, which the checkpoint (federation_state) carries to a resumed run."""
    cfg, algorithm = tiny("fedmeta_maml", "method.outer_lr=0.01")
    reference = torch.nn.ParameterDict(
        {k.replace(".", "-"): torch.nn.Parameter(v.clone()) for k, v in algorithm.global_params().items()}
    )
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    rounds = [random_gradients(algorithm, 2, seed=s) for s in range(3)]
    for gradients in rounds[:2]:
        algorithm.aggregate(updates_of(algorithm, gradients))
        for k, p in reference.items():
            p.grad = sum(g[k.replace("-", ".")] for g in gradients) / 2
        optimizer.step()
    resumed = build_algorithm(cfg, 10).double()
    resumed.load_federation_state(algorithm.federation_state())
    resumed.aggregate(updates_of(resumed, rounds[2]))
    for k, p in reference.items():
        p.grad = sum(g[k.replace("-", ".")] for g in rounds[2]) / 2
    optimizer.step()
    for k, p in resumed.global_params().items():
        torch.testing.assert_close(p, reference[k.replace(".", "-")].detach(), rtol=1e-9, atol=1e-12)
    assert resumed.client_states == {}  # the clients keep nothing


def test_a_new_client_adapts_with_the_learned_rates_and_the_shared_steps_leave_them():
    """Meta-SGD's new client: personal_params is θ − α ⊙ ∇L_S(θ) with the learned α (test_inner_steps=1);
    α stays as learned, and the shared procedure trains θ only."""
    _, algorithm = tiny("fedmeta_metasgd")
    random_rates(algorithm)
    params = algorithm.global_params()
    support = batches(1, 12, seed=3)
    start = algorithm.personal_params(params, {"support": support})
    weights = {k: v for k, v in params.items() if k.startswith("base.")}
    grads = torch.func.grad(algorithm.loss)(weights, support[0])
    for k in weights:
        expected = params[k] - params["rates." + k[len("base.") :]] * grads[k]
        torch.testing.assert_close(start[k], expected, rtol=1e-10, atol=1e-13)
    assert all(torch.equal(start[k], params[k]) for k in params if k.startswith("rates."))
    assert set(algorithm.adapted_names(0)) == set(weights)
    assert "rates.head.weight" in algorithm.federation_state()["model"]  # checkpointed with θ


def test_maml_new_client_steps_at_alpha_and_zero_steps_is_the_global_model():
    _, algorithm = tiny("fedmeta_maml")
    params, support = algorithm.global_params(), batches(1, 12, seed=3)
    start = algorithm.personal_params(params, {"support": support})
    grads = torch.func.grad(algorithm.loss)(params, support[0])
    for k in params:
        torch.testing.assert_close(start[k], params[k] - algorithm.cfg.inner_lr * grads[k])
    unmoved = algorithm.personal_params(params, {"support": []})  # test_inner_steps=0
    assert all(torch.equal(unmoved[k], params[k]) for k in params)
