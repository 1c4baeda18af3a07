"""Parameters and FLOPs per sample of each model kind (docs/models.md's table): matrix products,
convolutions and recurrences as torch.utils.flop_counter counts them, 2 FLOPs a multiply-add."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from fedmeta.algorithms import build_model
from fedmeta.config import compose

MODELS = [  # name, overrides, one sample's shape (None: 80 characters), classes
    ("RMNIST/FEMNIST CNN (28×28, the paper's)", ["dataset=rmnist"], (1, 28, 28), 10),
    ("CIFAR-10 CNN (32×32, the paper's)", ["dataset=cifar10"], (3, 32, 32), 10),
    ("CIFAR-100 CNN (the same, 100 classes)", ["dataset=cifar100"], (3, 32, 32), 100),
    (
        "ResNet-18, CIFAR-100 (batch or group norm)",
        ["dataset=cifar100", "model.kind=resnet18"],
        (3, 32, 32),
        100,
    ),
    (
        "ResNet-18, Tiny-ImageNet (64×64, 200 classes)",
        ["dataset=tiny_imagenet", "model.kind=resnet18"],
        (3, 64, 64),
        200,
    ),
    ("char LSTM, Shakespeare (80 characters in)", ["dataset=shakespeare"], None, 80),
]


def flops(model: torch.nn.Module, x: torch.Tensor, backward: bool) -> float:
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        if backward:
            out.sum().backward()
    return counter.get_total_flops() / len(x)


def main() -> None:
    print("| model | parameters | forward MFLOP | forward + backward MFLOP |\n|---|---|---|---|")
    for name, overrides, shape, classes in MODELS:
        model = build_model(compose(["method=fedavg", *overrides]), classes)
        x = torch.randint(0, classes, (2, 80), dtype=torch.uint8) if shape is None else torch.randn(2, *shape)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(
            f"| {name} | {params:.2f} M | {flops(model, x, False) / 1e6:,.1f} | {flops(model, x, True) / 1e6:,.1f} |"
        )


if __name__ == "__main__":
    main()
