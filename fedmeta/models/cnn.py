"""The base network f_ψ: conv blocks → dense blocks → linear head.

BatchNorm uses batch statistics only (``track_running_stats=False``), so a model is its
parameters alone: no buffers to carry between clients. Every forward takes an optional sample
``mask``: when the clients of a round are stacked (``federation.vectorize``), a client whose batch
is smaller than its neighbours' is padded, and the mask keeps the padding out of the batch
statistics — the statistics of the real samples are exactly those of the unpadded batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedmeta.models import lanes


def conv_block(
    in_channels: int, out_channels: int, kernel_size: int, padding: int | str, batch_norm: bool = True
) -> nn.Sequential:
    # conv → BN → ReLU → max-pool, computed with the pool first: max and ReLU commute
    # (both monotone), so the function and its gradients are the same and ReLU touches 4× fewer values.
    norm = [nn.BatchNorm2d(out_channels, track_running_stats=False)] if batch_norm else []
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding), *norm, nn.MaxPool2d(2), nn.ReLU()
    )


def batch_norm(layer: _BatchNorm, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``layer(x)`` with batch statistics over the samples where ``mask`` is 1 (all when None)."""
    if mask is None:
        return lanes.batch_norm(x, layer.weight, layer.bias, layer.eps)
    dims = [0, *range(2, x.dim())]
    weights = mask.to(x.dtype).view(-1, *[1] * (x.dim() - 1))
    count = weights.sum() * x[0, 0].numel()
    mean = (x * weights).sum(dims, keepdim=True) / count
    var = ((x - mean).square() * weights).sum(dims, keepdim=True) / count  # biased, as batch norm normalizes
    shape = [1, -1, *[1] * (x.dim() - 2)]
    return (x - mean) * torch.rsqrt(var + layer.eps) * layer.weight.view(shape) + layer.bias.view(shape)


def run_block(block: nn.Sequential, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    for layer in block:
        if isinstance(layer, nn.Conv2d):
            x = lanes.conv2d(x, layer)
        elif isinstance(layer, _BatchNorm):
            x = batch_norm(layer, x, mask)
        elif isinstance(layer, nn.MaxPool2d):  # conv_block's: non-overlapping windows
            x = lanes.max_pool2d(x, layer.kernel_size)
        else:
            x = layer(x)
    return x


def dense_block(in_units: int, out_units: int, batch_norm: bool = True) -> nn.Sequential:
    norm = [nn.BatchNorm1d(out_units, track_running_stats=False)] if batch_norm else []
    return nn.Sequential(nn.Linear(in_units, out_units), *norm, nn.ReLU())


class ConvStackError(ValueError):
    """The conv blocks shrink the images to nothing (a kernel larger than what is left of them)."""


class ConvFeatures(nn.Module):
    """The conv blocks shared in shape by the base network and the modulator's extractor h_x."""

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        conv_channels: Sequence[int],
        kernel_size: int,
        padding: int | str,
        batch_norm: bool = True,
    ):
        super().__init__()
        channels = [in_channels, *conv_channels]
        self.blocks = nn.ModuleList(
            conv_block(a, b, kernel_size, padding, batch_norm) for a, b in zip(channels, channels[1:])
        )
        self.channels_last = True
        self.flat_dim = self._probe(in_channels, image_size)

    def _probe(self, in_channels: int, image_size: int) -> int:
        """The features per image, from shapes alone: on the meta device, a probe costs no memory
        whatever the image size, and a shape error can only be the conv stack's."""
        params = {name: p.to("meta") for name, p in self.named_parameters()}
        try:
            with torch.no_grad():
                x = torch.func.functional_call(
                    self, params, (torch.zeros(2, in_channels, image_size, image_size, device="meta"),)
                )
        except RuntimeError as exc:
            raise ConvStackError(str(exc).splitlines()[0]) from None
        return x.shape[1]

    def forward(
        self, x: torch.Tensor, after_block: Callable | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.channels_last:  # NHWC: oneDNN's convolutions and pooling are markedly faster in it on CPU
            x = x.contiguous(memory_format=torch.channels_last)
            if x.shape[1] == 1 and not lanes._transformed(x):
                # one channel is NCHW and NHWC at once, and oneDNN then picks NCHW (pooling after it ~10×
                # slower): strides that say NHWC make it pick NHWC, with no copy
                x = x.as_strided(x.shape, (x.stride(0), 1, x.stride(2), x.stride(3)))
        for i, block in enumerate(self.blocks):
            x = run_block(block, x, mask)
            if after_block is not None:
                x = after_block(i, x)
        return x.flatten(1)


def set_channels_last(model: nn.Module, enabled: bool) -> None:
    """NHWC or NCHW activations in every conv stack of ``model``. Second-order MAML differentiates
    BatchNorm's backward, and PyTorch's double backward of batch norm is 2–4× slower on NHWC
    (docs/performance.md), so a second-order CAFeMe keeps NCHW."""
    for module in model.modules():
        if isinstance(module, ConvFeatures):
            module.channels_last = enabled


class ConvNet(nn.Module):
    """f_ψ. ``forward(x, gate)`` calls ``gate(layer, activation)`` after every hidden layer,
    which is where CAFeMe's modulation layers sit; without a gate it is a plain CNN."""

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        conv_channels: Sequence[int],
        kernel_size: int,
        padding: int | str,
        dense_units: Sequence[int],
        batch_norm: bool = True,
    ):
        super().__init__()
        self.features = ConvFeatures(in_channels, image_size, conv_channels, kernel_size, padding, batch_norm)
        units = [self.features.flat_dim, *dense_units]
        self.dense = nn.ModuleList(dense_block(a, b, batch_norm) for a, b in zip(units, units[1:]))
        self.head = nn.Linear(units[-1], num_classes)
        self.conv_channels = list(conv_channels)
        self.dense_units = list(dense_units)

    def hidden_sizes(self, include_flatten: bool = False) -> list[int]:
        """Width of each modulated layer, in forward order (channels for conv, units for dense)."""
        return self.conv_channels + ([self.features.flat_dim] if include_flatten else []) + self.dense_units

    def forward(
        self,
        x: torch.Tensor,
        gate: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        gate_flatten: bool = False,
        mask: torch.Tensor | None = None,
        embedding: bool = False,
    ) -> torch.Tensor:
        """The logits; with ``embedding`` the representation the classifier reads (FedProto's)."""
        keep = gate or (lambda _, a: a)
        x = self.features(x, keep, mask)
        layer = len(self.conv_channels)
        if gate_flatten:
            x = keep(layer, x)
            layer += 1
        for i, block in enumerate(self.dense):
            x = keep(layer + i, run_block(block, x, mask))
        return x if embedding else self.head(x)


# the parameter names of the base network's parts: its classifier and its dense block
CLASSIFIER, DENSE = "head.", "dense."


def build_base_net(model_cfg, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """The base network ``model.kind`` names (the values configs/config.yaml accepts): the data set's
    CNN (``cnn``), ResNet-18 with the CIFAR stem (``resnet18``, ``model.norm`` batch or group) or
    the character LSTM (``lstm``: its input alphabet is its classes, the next character's)."""
    kind = model_cfg.get("kind", "cnn")
    if kind == "resnet18":
        from fedmeta.models.resnet import ResNet18

        return ResNet18(
            in_channels,
            num_classes,
            model_cfg.get("norm", "batch"),
            int(model_cfg.get("groups", 2)),
            int(model_cfg.get("width", 64)),
        )
    if kind == "lstm":
        from fedmeta.models.lstm import CharLSTM

        return CharLSTM(
            num_classes, num_classes, int(model_cfg["embedding_dim"]), list(model_cfg["lstm_units"])
        )
    return ConvNet(
        in_channels,
        image_size,
        num_classes,
        model_cfg["conv_channels"],
        model_cfg["kernel_size"],
        model_cfg["padding"],
        model_cfg["dense_units"],
        model_cfg.get("batch_norm", True),
    )
