"""Time one second-order MAML client update (5 inner steps, RMNIST CNN) with torch.func vs learn2learn.

.venv/bin/python benchmarks/inner_loop.py
"""

import time

import torch
import torch.nn.functional as F

from fedmeta.data.meta_dataset import learn2learn_data
from fedmeta.models import ConvNet

learn2learn_data()  # imports learn2learn without its notices about gym, which it does not need here
import learn2learn as l2l  # noqa: E402

STEPS, REPEATS = 5, 20
net = ConvNet(1, 28, 10, [32, 64], 5, 0, [512])
x, y = torch.randn(30, 1, 28, 28), torch.randint(0, 10, (30,))
xq, yq = torch.randn(180, 1, 28, 28), torch.randint(0, 10, (180,))


def loss(params, inputs, labels):
    return F.cross_entropy(torch.func.functional_call(net, params, (inputs,)), labels)


def meta_loss(params):
    for _ in range(STEPS):
        grads = torch.func.grad(loss)(params, x, y)
        params = {k: params[k] - 0.05 * grads[k] for k in params}
    return loss(params, xq, yq)


def with_torch_func():  # as fedmeta's CAFeMe computes it: nested torch.func.grad
    torch.func.grad(meta_loss)({k: p.detach() for k, p in net.named_parameters()})


maml = l2l.algorithms.MAML(net, lr=0.05, first_order=False)


def with_learn2learn():
    learner = maml.clone()
    for _ in range(STEPS):
        learner.adapt(F.cross_entropy(learner(x), y))
    F.cross_entropy(learner(xq), yq).backward()


for name, fn in [("torch.func", with_torch_func), ("learn2learn MAML", with_learn2learn)] * 2:
    fn()
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    print(f"{name:18s} {1000 * (time.perf_counter() - start) / REPEATS:7.1f} ms per client update")
