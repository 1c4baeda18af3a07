"""What the model of a config would take in memory, found from shapes alone (built on the meta
device, where a tensor has a shape and no storage) and checked before anything is allocated."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedmeta.data.memory import gb, refuse_beyond_memory
from fedmeta.models.cnn import ConvFeatures, ConvStackError

# a federated round holds at least the global model, a client's copy, its gradient and its update
TRAINING_COPIES = 4


def refuse_oversized(build: Callable[[], nn.Module], cfg, num_classes: int) -> None:
    """One line, naming the key responsible, when the parameters of ``build()``'s model (as many
    times as training holds them) and one batch of images (with its activations after the first conv
    layer) exceed the machine's memory."""
    try:
        with torch.device("meta"):
            model = build()
    except ConvStackError:
        raise
    except Exception:  # noqa: BLE001 — a model of one's own that needs real storage to be built: its real build decides
        return
    size, channels = int(cfg.dataset.image_size), int(cfg.dataset.in_channels)
    batch_size = int(cfg.method.get("batch_size") or 1)
    conv = list(cfg.model.get("conv_channels") or [])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = batch_size * (channels + (conv[0] if conv else 0)) * size**2 * 4
    key, fix = _responsible(model, cfg, num_classes, batch >= TRAINING_COPIES * params)
    refuse_beyond_memory(
        TRAINING_COPIES * params + batch,
        f"{key}: the model's parameters ({gb(params)}, held {TRAINING_COPIES} times in training: model, "
        f"client copy, gradient, update) and one batch of {batch_size} {size}×{size} images through its "
        f"first conv layer ({gb(batch)})",
        fix,
    )


def _responsible(model: nn.Module, cfg, num_classes: int, images: bool) -> tuple[str, str]:
    """The key whose value makes the model large, and what to do: the image size when the batch
    outweighs the parameters, else the key that sets the widest dimension of the largest parameter."""
    size = cfg.dataset.image_size
    if images:
        return f"dataset.image_size={size}", "lower dataset.image_size or method.batch_size"
    name, largest = max(model.named_parameters(), key=lambda item: item[1].numel())
    wide = max(largest.shape)
    flat = {
        m.flat_dim + extra
        for m in model.modules()
        if isinstance(m, ConvFeatures)
        for extra in (0, num_classes)
    }
    m = cfg.model
    if largest.dim() == 2 and wide in flat:
        return (
            f"dataset.image_size={size}",
            f"the conv stack leaves {wide:,} features per image for a dense layer: lower dataset.image_size "
            "or add conv blocks to model.conv_channels",
        )
    for key in ("dense_units", "modulator.before_mean", "modulator.after_mean", "conv_channels"):
        values = m.get(key) if "." not in key else (m.get("modulator") or {}).get(key.split(".")[1])
        if values and wide in list(values):
            return f"model.{key}={list(values)}", f"use smaller values in model.{key}"
    return (
        f"the parameter {name} of shape {tuple(largest.shape)}",
        "use a smaller model (model.*) or image size (dataset.image_size)",
    )
