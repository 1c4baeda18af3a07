"""The modulator and the differentiable inner loop, on tiny models in float64."""

import itertools

import learn2learn as l2l
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from fedmeta.algorithms import CAFeMe
from fedmeta.data import ImageDataset, build_federation
from fedmeta.functional import adam, adam_first_step, adam_state, sgd
from fedmeta.models import ConvNet, ModulatedNet, Modulator, lanes, modulate
from fedmeta.models.cnn import ConvFeatures

TINY = dict(in_channels=1, image_size=8, num_classes=3, conv_channels=[2], kernel_size=3, padding=1)


def tiny_cafeme(
    modulation="c1",
    use_labels=True,
    first_order=False,
    seed=0,
    outer_optimizer="adam_fresh",
    batches="independent",
    eval_batch_size=None,
) -> CAFeMe:
    torch.manual_seed(seed)
    base = ConvNet(**TINY, dense_units=[4])
    features = ConvFeatures(**{k: v for k, v in TINY.items() if k != "num_classes"})
    modulator = Modulator(
        features,
        TINY["num_classes"],
        before_mean=[5],
        after_mean=[5],
        layer_sizes=base.hidden_sizes(),
        modulation=modulation,
        use_labels=use_labels,
    )
    cfg = OmegaConf.create(
        dict(
            inner_steps=2,
            inner_lr=0.3,
            outer_lr=1e-3,
            batch_size=6,
            eval_batch_size=eval_batch_size,
            context="labelled" if use_labels else "transductive",
            first_order=first_order,
            outer_optimizer=outer_optimizer,
            batches=batches,
            client_state_dtype="float32",
        )
    )
    return CAFeMe(ModulatedNet(base, modulator).double(), cfg)


def tiny_client(seed=0):
    g = torch.Generator().manual_seed(seed)
    data = ImageDataset(
        x=torch.randn(40, 1, 8, 8, generator=g, dtype=torch.float64),
        y=torch.randint(0, 3, (40,), generator=g),
        num_classes=3,
    )
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


def _meta_gradient(algorithm, client):
    data = algorithm.draw(client, 1)
    omega = algorithm.global_params()
    return omega, data, torch.func.grad(algorithm.meta_loss)(omega, data)


def _directional_derivative(algorithm, omega, data, direction, eps=1e-5):
    def loss_at(t):
        return algorithm.meta_loss({k: v + t * direction[k] for k, v in omega.items()}, data).item()

    return (loss_at(eps) - loss_at(-eps)) / (2 * eps)


@pytest.mark.parametrize("modulation", ["c1", "c2"])
def test_second_order_outer_gradient_matches_finite_differences(modulation):
    client = tiny_client()
    exact = tiny_cafeme(modulation)
    omega, data, grad = _meta_gradient(exact, client)
    g = torch.Generator().manual_seed(3)
    direction = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in omega.items()}
    # the gradient must reach the modulator μ through the inner loop
    assert any(grad[k].abs().sum() > 0 for k in grad if k.startswith("modulator."))
    analytic = sum((grad[k] * direction[k]).sum() for k in grad).item()
    numeric = _directional_derivative(exact, omega, data, direction)
    assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-8)

    first = tiny_cafeme(modulation, first_order=True)
    _, _, grad_fo = _meta_gradient(first, client)
    first_order = sum((grad_fo[k] * direction[k]).sum() for k in grad_fo).item()
    assert abs(first_order - numeric) > 100 * abs(analytic - numeric)  # second-order terms matter


def test_masked_batch_statistics_equal_those_of_the_unpadded_batch():
    """A padded client (vectorized rounds) computes exactly what it computes alone."""
    model = tiny_cafeme().model
    x, y = torch.randn(7, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (7,))
    padded_x, padded_y = (
        torch.cat([x, torch.zeros(3, 1, 8, 8, dtype=torch.float64)]),
        torch.cat([y, torch.zeros(3, dtype=torch.long)]),
    )
    mask = torch.arange(10) < 7
    alone = model(x, x, y)
    padded = model(padded_x, padded_x, padded_y, mask, mask)
    torch.testing.assert_close(padded[:7], alone, rtol=1e-12, atol=1e-12)


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

    def loss(params, inputs, labels):
        return F.cross_entropy(torch.func.functional_call(net, params, (inputs,)), labels)

    def meta_loss(params):  # the inner loop as CAFeMe writes it: nested torch.func.grad
        for _ in range(3):
            grads = torch.func.grad(loss)(params, x, y)
            params = {k: params[k] - 0.2 * grads[k] for k in params}
        return loss(params, xq, yq)

    ours = torch.func.grad(meta_loss)({k: p.detach() for k, p in net.named_parameters()})
    for k, g in ours.items():
        torch.testing.assert_close(g, reference[k])


def test_conv_block_computes_the_spec_order_exactly():
    """The paper's network is conv → BN → ReLU → max-pool; the block pools first (cheaper). Same values, "
    "same gradients."""
    torch.manual_seed(0)
    net = ConvNet(**TINY, dense_units=[4]).double()
    net.features.channels_last = False  # the spec below runs NCHW: the same layout, the same sums
    conv, bn = net.features.blocks[0][0], net.features.blocks[0][1]
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    ours = net.features(x)
    spec = F.max_pool2d(F.relu(bn(conv(x))), 2).flatten(1)
    assert torch.equal(ours, spec)
    (g_ours,) = torch.autograd.grad(ours.square().sum(), conv.weight)
    (g_spec,) = torch.autograd.grad(spec.square().sum(), conv.weight)
    assert torch.allclose(g_ours, g_spec, rtol=1e-12, atol=1e-12)


def _lane_layers():

    def ours(x, p):
        return lanes.max_pool2d(lanes.batch_norm(x, p["w"], p["b"], 1e-5), 2)

    def torchs(x, p):
        return F.max_pool2d(F.batch_norm(x, None, None, p["w"], p["b"], True, 0.0, 1e-5), 2)

    return ours, torchs


@pytest.mark.parametrize("order", [1, 2, "hvp"])
def test_lane_layers_equal_torchs_alone_and_vmapped_to_second_order(order):
    """Batch norm and max-pooling with the lanes folded into the channels (fedmeta.models.lanes) give
    PyTorch's values and gradients — one sample set alone and 4 lanes vmapped, first order, through
    MAML's differentiated inner step, and in forward mode (a Hessian-vector product as the jvp of a
    gradient, Per-FedAvg's exact one) — in float64."""
    torch.manual_seed(0)
    lanes_, batch, channels = 4, 6, 3
    params = {
        "w": torch.randn(lanes_, channels, dtype=torch.float64),
        "b": torch.randn(lanes_, channels, dtype=torch.float64),
    }
    xs = torch.randn(lanes_, batch, channels, 8, 8, dtype=torch.float64)
    weights = torch.randn(batch, channels, 4, 4, dtype=torch.float64)

    def objective(layers):
        def loss(p, x):
            return (layers(x, p).pow(3) * weights).sum()

        if order in (1, "hvp"):
            return loss

        def after_a_step(p, x):  # the loss after one differentiated SGD step on it (second order)
            grads = torch.func.grad(loss, argnums=(0, 1))(p, x)
            return loss({k: p[k] - 0.01 * grads[0][k] for k in p}, x - 0.01 * grads[1])

        return after_a_step

    values = {}
    for name, layers in zip(("ours", "torch"), _lane_layers()):
        f = objective(layers)
        derivative = torch.func.grad(f, argnums=(0, 1))
        if order == "hvp":  # H·(v, u) as the jvp of the gradient, the direction all ones

            def derivative(p, x, gradient=derivative):
                direction = ({k: torch.ones_like(t) for k, t in p.items()}, torch.ones_like(x))
                return torch.func.jvp(gradient, (p, x), direction)[1]

        vmapped = torch.func.vmap(derivative)(params, xs)
        alone = derivative({k: v[1] for k, v in params.items()}, xs[1])
        values[name] = (vmapped, alone)
    torch.testing.assert_close(values["ours"], values["torch"], rtol=1e-10, atol=1e-10)
    assert values["ours"][0][0]["w"].abs().sum() > 0  # the gradients are not trivially equal zeros


@pytest.mark.parametrize("defined", [m for m in itertools.product([False, True], repeat=3) if any(m)])
def test_batch_norm_double_backward_in_closed_form_equals_autograd_through_its_backward(defined):
    """The closed-form double backward equals autograd through the backward's plain formula, for
    every combination of upstream gradients an outer loss leaves defined (None: not reached)."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    grad_out, weight = torch.randn_like(x), torch.randn(3, dtype=torch.float64)
    var, mean = torch.var_mean(x, [0, 2, 3], correction=0)
    upstream = (torch.randn_like(x), torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64))
    _, vjp = torch.func.vjp(lambda *a: lanes._backward_formula(*a, 1e-5), grad_out, x, weight)
    expected = vjp(tuple(u if d else torch.zeros_like(u) for u, d in zip(upstream, defined)))
    got = lanes._double_backward(
        grad_out,
        x,
        weight,
        mean,
        torch.rsqrt(var + 1e-5),
        *(u if d else None for u, d in zip(upstream, defined)),
    )
    for value, reference in zip(got, expected):
        value = torch.zeros_like(reference) if value is None else value
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)


def test_lane_layers_run_as_one_kernel_each_way_under_vmap():
    """Vmapped, batch norm and max-pooling each launch PyTorch's one kernel forward and one backward:
    no separate affine, no ones or zeros, fewer copies into another layout (PyTorch's own batch
    rules launch 5 and 9 for batch norm, and copy around each pooling)."""
    from fedmeta.census import Census

    ours, torchs = _lane_layers()
    params = {"w": torch.randn(4, 3), "b": torch.randn(4, 3)}
    xs = torch.randn(6, 4, 3, 8, 8)  # the lanes at dim 1, where a vmapped convolution leaves them
    weights = torch.randn(6, 3, 4, 4)
    counted = {}
    for name, layers in (("ours", ours), ("torch", torchs)):
        census = Census()
        with census:
            loss = lambda p, x, layers=layers: (layers(x, p) * weights).sum()  # noqa: E731
            torch.func.vmap(torch.func.grad(loss), in_dims=(0, 1))(params, xs)
        counted[name] = census.names
    assert counted["ours"]["native_batch_norm"] == counted["ours"]["native_batch_norm_backward"] == 1
    assert (
        counted["ours"]["max_pool2d_with_indices"] == counted["ours"]["max_pool2d_with_indices_backward"] == 1
    )
    assert counted["ours"]["ones"] == counted["ours"]["zeros"] == 0, counted["ours"]
    assert counted["ours"]["clone"] < counted["torch"]["clone"], (counted["ours"], counted["torch"])
    assert sum(counted["ours"].values()) < sum(counted["torch"].values())


@pytest.mark.parametrize("dtype,bytes_per_number", [("float32", 4), ("bfloat16", 2)])
def test_authors_client_adam_state_is_kept_compactly_and_resumed(dtype, bytes_per_number):
    algorithm = tiny_cafeme(outer_optimizer="adam_kept")
    algorithm.model.float()
    algorithm.cfg.client_state_dtype = dtype
    client = tiny_client()
    client.data.x = client.data.x.float()
    algorithm.aggregate([algorithm.run_client(client, 1)])  # the server keeps what the client keeps
    state = algorithm.client_states[client.id]["adam"]
    numbers = sum(p.numel() for p in algorithm.model.parameters())
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and int(state["step"]) == 1
    assert (
        sum(m.nbytes for key in ("exp_avg", "exp_avg_sq") for m in state[key].values())
        == 2 * numbers * bytes_per_number
    )

    before = {k: p.detach().clone() for k, p in algorithm.model.named_parameters()}
    update = algorithm.run_client(client, 2)  # the second visit continues the client's Adam: step 2
    algorithm.aggregate([update])
    assert int(algorithm.client_states[client.id]["adam"]["step"]) == 2
    assert all(
        torch.isfinite(update.params[k]).all() and not torch.equal(update.params[k], before[k])
        for k in before
    )


def test_functional_adam_and_sgd_match_torch_optim():
    g = torch.Generator().manual_seed(0)
    start = {
        "w": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
    }
    grads = [
        {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in start.items()} for _ in range(3)
    ]
    for make, step in [
        (lambda p: torch.optim.Adam(p, lr=0.01), lambda p, gr, s: adam(p, gr, s, 0.01)),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p, gr, s: sgd(p, gr, 0.1, 0.9, s)),
    ]:
        leaves = {k: v.clone().requires_grad_() for k, v in start.items()}
        optimizer = make(leaves.values())
        params, state = (
            dict(start),
            adam_state(start)
            if "Adam" in str(make(leaves.values()))
            else {k: torch.zeros_like(v) for k, v in start.items()},
        )
        for gr in grads:
            for k, p in leaves.items():
                p.grad = gr[k].clone()
            optimizer.step()
            params, state = step(params, gr, state)
        for k in start:
            torch.testing.assert_close(params[k], leaves[k].detach(), rtol=1e-12, atol=1e-12)


def test_adam_first_step_in_closed_form_is_a_fresh_adams_step():
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64)}
    grads = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64) * torch.tensor([1e-9, 1e-3, 1.0])}
    leaf = params["w"].clone().requires_grad_()
    leaf.grad = grads["w"].clone()
    torch.optim.Adam([leaf], lr=0.01).step()  # the tiny gradients: where eps matters
    closed = adam_first_step(params, grads, 0.01)["w"]
    torch.testing.assert_close(closed, leaf.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(
        closed, adam(params, grads, adam_state(params), 0.01)[0]["w"], rtol=1e-13, atol=1e-15
    )


# ---- sizes that would take more than the machine: refused from shapes, before any allocation ----
@pytest.mark.parametrize(
    "overrides,key,fix",
    [
        (["model.dense_units=[1000000000]"], "model.dense_units=[1000000000]", "model.dense_units"),
        (["method=ifca", "model.dense_units=[1000000000]"], "model.dense_units=[1000000000]", "dense_units"),
        (
            ["model.conv_channels=[1000000,1000000]"],
            "model.conv_channels=[1000000, 1000000]",
            "conv_channels",
        ),
        (["dataset.image_size=100000"], "dataset.image_size=100000", "lower dataset.image_size"),
    ],
)
def test_a_model_beyond_the_machine_is_refused_in_one_line_naming_its_key(overrides, key, fix):
    from fedmeta.algorithms import build_model
    from fedmeta.config import compose
    from fedmeta.errors import FedmetaError

    with pytest.raises(FedmetaError) as refused:
        build_model(compose(overrides), num_classes=10)
    message = str(refused.value)
    assert message.startswith(f"{key}: the model's parameters (") and "\n" not in message
    assert " GB, more than this machine's " in message and fix in message
    assert "kernel" not in message  # the conv stack is not the cause


def test_a_dense_layer_fed_by_a_large_image_names_the_image_size(monkeypatch):
    """The largest parameter is the first dense layer's, wide because of the features the conv stack
    leaves of a 256×256 image: the image size is the key to change, not the dense units."""
    from fedmeta.algorithms import build_model
    from fedmeta.config import compose
    from fedmeta.data import memory
    from fedmeta.errors import FedmetaError

    cfg = compose(["method=fedavg_ft", "dataset.image_size=256", "method.batch_size=2"])
    build_model(cfg, num_classes=10)  # fits this machine
    monkeypatch.setattr(memory, "machine_bytes", lambda: 10**7)
    with pytest.raises(
        FedmetaError, match=r"^dataset.image_size=256: .* the conv stack leaves [0-9,]+ features"
    ):
        build_model(cfg, num_classes=10)


def test_a_model_that_ties_two_parameters_runs_with_the_given_one_under_both_names():
    """fedmeta.functional.call looks for tied parameters once per model (not on every call): a
    model that ties its embedding to its classifier still runs the given tensor in both places."""
    from torch import nn

    from fedmeta.functional import call

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    tied, plain = Tied(), nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    weight, x = torch.eye(3) * 2, torch.ones(1, 3)
    assert torch.equal(call(tied, {"a.weight": weight}, x), x * 4)  # both layers took the new weight
    assert torch.equal(call(plain, {"0.weight": weight, "1.weight": weight}, x), x * 4)


class _ConvLayer(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, dtype=dtype)

    def forward(self, x):
        return lanes.conv2d(x, self.conv)


def _conv_derivative(order, layers):
    def loss(p, x):
        return (layers(x, p).float().pow(3)).sum()

    if order == 1:
        return torch.func.grad(loss, argnums=(0, 1))

    def after_a_step(p, x):  # MAML's differentiated inner step
        grads = torch.func.grad(loss, argnums=(0, 1))(p, x)
        return loss({k: p[k] - 0.01 * grads[0][k] for k in p}, x - 0.01 * grads[1])

    if order == 2:
        return torch.func.grad(after_a_step, argnums=(0, 1))

    gradient = torch.func.grad(loss, argnums=(0, 1))  # a Hessian-vector product as a jvp

    def hvp(p, x):
        direction = ({k: torch.ones_like(t) for k, t in p.items()}, torch.ones_like(x))
        return torch.func.jvp(gradient, (p, x), direction)[1]

    return hvp


@pytest.mark.parametrize("order", [1, 2, "hvp"])
def test_vmapped_convolution_as_one_grouped_nhwc_kernel_equals_torchs_to_every_order(order):
    """A convolution under vmap on the CPU (lanes.conv2d: the lanes as the groups of one NHWC
    convolution) gives PyTorch's own values and derivatives: gradients, MAML's second order and a
    Hessian-vector product, 4 lanes, in float64."""
    torch.manual_seed(0)
    module = _ConvLayer(torch.float64)
    params = {
        "conv.weight": torch.randn(4, 4, 3, 3, 3, dtype=torch.float64),
        "conv.bias": torch.randn(4, 4, dtype=torch.float64),
    }
    xs = torch.randn(4, 5, 3, 6, 6, dtype=torch.float64)

    def ours(x, p):
        return torch.func.functional_call(module, p, (x,))

    def torchs(x, p):
        return F.conv2d(x, p["conv.weight"], p["conv.bias"], padding=1)

    got, expected = (
        torch.func.vmap(_conv_derivative(order, layers))(params, xs) for layers in (ours, torchs)
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert got[0]["conv.weight"].abs().sum() > 0


def test_vmapped_convolution_runs_under_cpu_bf16_autocast_as_torchs_does():
    """Under ``torch.autocast("cpu", bfloat16)`` (precision bf16-mixed) the grouped rule casts as
    autocast would and gives PyTorch's own rule's gradients to bf16's precision, in float32."""
    torch.manual_seed(0)
    module = _ConvLayer(torch.float32)
    params = {"conv.weight": torch.randn(4, 4, 3, 3, 3), "conv.bias": torch.randn(4, 4)}
    xs = torch.randn(4, 5, 3, 6, 6)

    def ours(x, p):
        return torch.func.functional_call(module, p, (x,))

    def torchs(x, p):
        return F.conv2d(x, p["conv.weight"], p["conv.bias"], padding=1)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = (
            torch.func.vmap(_conv_derivative(1, layers))(params, xs) for layers in (ours, torchs)
        )
    assert got[0]["conv.weight"].dtype == torch.float32
    torch.testing.assert_close(
        got, expected, rtol=2e-2, atol=2e-2 * expected[0]["conv.weight"].abs().max().item()
    )
