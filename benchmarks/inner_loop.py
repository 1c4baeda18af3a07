"""Time one second-order MAML client update (5 inner steps, RMNIST CNN) with torch.func vs learn2learn.

    .venv/bin/python benchmarks/inner_loop.py
"""

import time

import learn2learn as l2l
import torch
import torch.nn.functional as F

from fedmeta.algorithms.base import trainable_copy
from fedmeta.functional import sgd_step
from fedmeta.models import ConvNet

STEPS, REPEATS = 5, 20
net = ConvNet(1, 28, 10, [32, 64], 5, 0, [512])
x, y = torch.randn(30, 1, 28, 28), torch.randint(0, 10, (30,))
xq, yq = torch.randn(180, 1, 28, 28), torch.randint(0, 10, (180,))


def with_torch_func():
    params = trainable_copy(dict(net.named_parameters()))
    adapted = params
    for _ in range(STEPS):
        adapted = sgd_step(adapted, F.cross_entropy(torch.func.functional_call(net, adapted, (x,)), y), 0.05, True)
    F.cross_entropy(torch.func.functional_call(net, adapted, (xq,)), yq).backward()


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
