"""ResNet-18 (He et al. 2016) with the CIFAR stem: a 3×3 convolution of stride 1 and no max-pooling
in front of the four stages of two basic blocks (64, 128, 256, 512 channels), global average
pooling, a linear head — the network FL-bench and PFLlib run on CIFAR-100 and Tiny-ImageNet.
``width`` scales every stage (64: ResNet-18's own; narrower for a CPU or a test).

``norm`` picks the normalization after every convolution: ``batch`` (batch statistics only, as the
base CNN's: a model is its parameters, nothing to carry between clients; padded samples of stacked
clients are kept out of the statistics) or ``group`` (GroupNorm, per sample, which federated
ResNets often use because batch statistics differ from client to client; ``groups`` per layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedmeta.models.cnn import batch_norm
from fedmeta.models.lanes import conv2d

WIDENING = (1, 2, 4, 8)  # each stage's channels, in multiples of the first's (64 in ResNet-18)


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    return nn.GroupNorm(min(groups, channels), channels)


def _normalize(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return batch_norm(layer, x, mask) if isinstance(layer, nn.BatchNorm2d) else layer(x)


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(norm, out_channels, groups)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = _norm(norm, out_channels, groups)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:  # a projection where the shape changes
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                _norm(norm, out_channels, groups),
            )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        a = F.relu(_normalize(self.norm1, conv2d(x, self.conv1), mask))
        a = _normalize(self.norm2, conv2d(a, self.conv2), mask)
        skip = x if self.shortcut is None else _normalize(self.shortcut[1], self.shortcut[0](x), mask)
        return F.relu(a + skip)


class ResNet18(nn.Module):
    """The base network for images at ResNet-18's depth, with ConvNet's interface (``forward(x, gate,
    gate_flatten, mask, embedding)``, ``hidden_sizes`` — one gated layer per stage — and a classifier
    named ``head``), so every method runs on it."""

    def __init__(
        self, in_channels: int, num_classes: int, norm: str = "batch", groups: int = 2, width: int = 64
    ):
        super().__init__()
        self.stage_channels = [width * k for k in WIDENING]
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.stem_norm = _norm(norm, width, groups)
        widths = [width, *self.stage_channels]
        self.stages = nn.ModuleList(
            nn.ModuleList(
                [BasicBlock(a, b, 1 if i == 0 else 2, norm, groups), BasicBlock(b, b, 1, norm, groups)]
            )
            for i, (a, b) in enumerate(zip(widths, widths[1:]))
        )
        self.head = nn.Linear(self.stage_channels[-1], num_classes)

    def hidden_sizes(self, include_flatten: bool = False) -> list[int]:
        return self.stage_channels + ([self.stage_channels[-1]] if include_flatten else [])

    def forward(
        self,
        x: torch.Tensor,
        gate: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        gate_flatten: bool = False,
        mask: torch.Tensor | None = None,
        embedding: bool = False,
    ) -> torch.Tensor:
        keep = gate or (lambda _, a: a)
        a = F.relu(_normalize(self.stem_norm, conv2d(x, self.stem), mask))
        for i, stage in enumerate(self.stages):
            for block in stage:
                a = block(a, mask)
            a = keep(i, a)
        z = a.mean(dim=(2, 3))
        if gate_flatten:
            z = keep(len(self.stages), z)
        return z if embedding else self.head(z)
