"""The modulator and the differentiable inner loop, on tiny models in float64."""

import learn2learn as l2l
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from fedmeta.algorithms import CAFeMe
from fedmeta.algorithms.base import trainable_copy
from fedmeta.data import ImageDataset, build_federation
from fedmeta.functional import sgd_step
from fedmeta.models import ConvNet, ModulatedNet, Modulator, modulate

TINY = dict(in_channels=1, image_size=8, num_classes=3, conv_channels=[2], kernel_size=3, padding=1)


def tiny_cafeme(modulation="c1", use_labels=True, first_order=False, seed=0) -> CAFeMe:
    torch.manual_seed(seed)
    base = ConvNet(**TINY, dense_units=[4])
    modulator = Modulator(**TINY, before_mean=[5], after_mean=[5], layer_sizes=base.hidden_sizes(),
                          modulation=modulation, use_labels=use_labels)
    cfg = OmegaConf.create(dict(inner_steps=2, inner_lr=0.3, outer_lr=1e-3, batch_size=6, eval_batch_size=None,
                                context="labelled" if use_labels else "transductive", first_order=first_order,
                                client_optimizer_state=False, client_state_dtype="float32"))
    return CAFeMe(ModulatedNet(base, modulator).double(), cfg)


def tiny_client(seed=0):
    g = torch.Generator().manual_seed(seed)
    data = ImageDataset(x=torch.randn(40, 1, 8, 8, generator=g, dtype=torch.float64),
                        y=torch.randint(0, 3, (40,), generator=g), num_classes=3)
    return build_federation(data, {"name": "iid"}, 2, 1, 0.3, seed=seed).train_clients[0]


def test_context_is_permutation_invariant():
    model = tiny_cafeme().model
    x, y = torch.randn(10, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (10,))
    perm = torch.randperm(10)
    for a, b in zip(model.modulator(x, y), model.modulator(x[perm], y[perm])):
        torch.testing.assert_close(a, b)


def test_context_depends_on_labels_only_when_it_reads_them():
    x, y = torch.randn(10, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (10,))
    labelled, unlabelled = tiny_cafeme().model.modulator, tiny_cafeme(use_labels=False).model.modulator
    assert not torch.allclose(labelled(x, y)[0], labelled(x, (y + 1) % 3)[0])
    assert len(unlabelled(x)) == 2  # one ζ per hidden layer: conv block, dense block


def test_sigmoid_gating_keeps_activations_between_zero_and_themselves():
    activation = torch.relu(torch.randn(4, 3, 5, 5)) * 10
    zeta = torch.randn(1, 3) * 50  # extreme modulation parameters
    gated = modulate(activation, zeta, "c1")
    assert (gated >= 0).all() and (gated <= activation).all()
    assert modulate(torch.ones(2, 3), torch.zeros(1, 3), "c1").eq(0.5).all()
    film = modulate(torch.ones(2, 3), torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]]), "c2")
    assert film.eq(3.0).all()
    assert modulate(torch.ones(2, 3), torch.ones(1, 3), "c0").eq(2.0).all()


def _directional_derivative(algorithm, client, direction, eps=1e-5):
    def loss_at(t):
        omega = trainable_copy({k: v + t * direction[k] for k, v in algorithm.global_params().items()})
        return algorithm.meta_loss(omega, client, client.generator(1)).item()
    return (loss_at(eps) - loss_at(-eps)) / (2 * eps)


@pytest.mark.parametrize("modulation", ["c1", "c2"])
def test_second_order_outer_gradient_matches_finite_differences(modulation):
    client = tiny_client()
    exact = tiny_cafeme(modulation)
    omega = trainable_copy(exact.global_params())
    exact.meta_loss(omega, client, client.generator(1)).backward()
    g = torch.Generator().manual_seed(3)
    direction = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in omega.items()}
    # the gradient must reach the modulator μ through the inner loop
    assert any(omega[k].grad.abs().sum() > 0 for k in omega if k.startswith("modulator."))
    analytic = sum((omega[k].grad * direction[k]).sum() for k in omega).item()
    numeric = _directional_derivative(exact, client, direction)
    assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-8)

    first = tiny_cafeme(modulation, first_order=True)
    omega_fo = trainable_copy(first.global_params())
    first.meta_loss(omega_fo, client, client.generator(1)).backward()
    first_order = sum((omega_fo[k].grad * direction[k]).sum() for k in omega_fo).item()
    assert abs(first_order - numeric) > 100 * abs(analytic - numeric)  # second-order terms matter


def test_functional_inner_loop_matches_learn2learn_maml():
    torch.manual_seed(0)
    net = ConvNet(**TINY, dense_units=[4]).double()
    x, y = torch.randn(12, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (12,))
    xq, yq = torch.randn(9, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (9,))

    maml = l2l.algorithms.MAML(net, lr=0.2, first_order=False)
    learner = maml.clone()
    for _ in range(3):
        learner.adapt(F.cross_entropy(learner(x), y))
    F.cross_entropy(learner(xq), yq).backward()
    reference = {k: p.grad.clone() for k, p in net.named_parameters()}

    params = trainable_copy(dict(net.named_parameters()))
    adapted = params
    for _ in range(3):
        adapted = sgd_step(adapted, F.cross_entropy(torch.func.functional_call(net, adapted, (x,)), y), 0.2, create_graph=True)
    F.cross_entropy(torch.func.functional_call(net, adapted, (xq,)), yq).backward()
    for k, p in params.items():
        torch.testing.assert_close(p.grad, reference[k])


def test_conv_block_computes_the_spec_order_exactly():
    """SPEC §6 is conv → BN → ReLU → max-pool; the block pools first (cheaper). Same values, same gradients."""
    torch.manual_seed(0)
    net = ConvNet(**TINY, dense_units=[4]).double()
    conv, bn = net.features.blocks[0][0], net.features.blocks[0][1]
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    ours = net.features(x)
    spec = F.max_pool2d(F.relu(bn(conv(x))), 2).flatten(1)
    assert torch.equal(ours, spec)
    (g_ours,) = torch.autograd.grad(ours.square().sum(), conv.weight)
    (g_spec,) = torch.autograd.grad(spec.square().sum(), conv.weight)
    assert torch.allclose(g_ours, g_spec, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,bytes_per_number", [("float32", 4), ("bfloat16", 2)])
def test_authors_client_adam_state_is_kept_compactly_and_resumed(dtype, bytes_per_number):
    algorithm = tiny_cafeme()
    algorithm.model.float()
    algorithm.cfg.client_optimizer_state, algorithm.cfg.client_state_dtype = True, dtype
    client = tiny_client()
    client.data.x = client.data.x.float()
    algorithm.aggregate([algorithm.local_update(client, 1)])  # the server keeps what the client keeps
    state = algorithm.client_states[client.id]
    numbers = sum(p.numel() for p in algorithm.model.parameters())
    assert all(set(m) == {"step", "exp_avg", "exp_avg_sq"} and int(m["step"]) == 1 for m in state.values())
    assert sum(m["exp_avg"].nbytes + m["exp_avg_sq"].nbytes for m in state.values()) == 2 * numbers * bytes_per_number

    before = {k: p.detach().clone() for k, p in algorithm.model.named_parameters()}
    update = algorithm.local_update(client, 2)  # the second visit continues the client's Adam: step 2
    algorithm.aggregate([update])
    assert all(int(m["step"]) == 2 for m in algorithm.client_states[client.id].values())
    assert all(torch.isfinite(update.params[k]).all() and not torch.equal(update.params[k], before[k]) for k in before)
