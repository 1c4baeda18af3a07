"""The federated modulator g_μ (paper Fig. 2) and the modulated network f_ψ|ζ.

g_μ reads a labelled batch D' = {(x_b, y_b)}: (A) z_b = h(h_x(x_b) ⊕ onehot(y_b)), (B) the mean
over the batch makes the context permutation-invariant, (C) an MLP maps it to one vector ζ^l
per hidden layer of f_ψ. With ``use_labels=False`` (the authors' code) it reads x alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# c1 (sigmoid gating) is the paper's; c2 (FiLM) and c0 (additive) are the alternatives it discusses.
MODULATIONS = {
    "c0": lambda a, z: a + z[0],
    "c1": lambda a, z: a * torch.sigmoid(z[0]),
    "c2": lambda a, z: a * z[0] + z[1],
}
VECTORS_PER_LAYER = {"c0": 1, "c1": 1, "c2": 2}


def modulate(activation: torch.Tensor, zeta: torch.Tensor, kind: str) -> torch.Tensor:
    """Apply ζ of shape (k, units) per channel (conv activations) or per unit (dense ones)."""
    zeta = zeta.view(*zeta.shape, *([1] * (activation.dim() - 2)))  # (k, C) → (k, C, 1, 1) for conv
    return MODULATIONS[kind](activation, zeta.unsqueeze(1))


def mlp(sizes: Sequence[int]) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return layers


class Modulator(nn.Module):
    """``extractor``: h_x, a feature stack with a ``flat_dim`` (the base network's kind: conv blocks
    for images, fedmeta.models.lstm's SequenceFeatures for text)."""

    def __init__(
        self,
        extractor: nn.Module,
        num_classes: int,
        before_mean: Sequence[int],
        after_mean: Sequence[int],
        layer_sizes: Sequence[int],
        modulation: str = "c1",
        use_labels: bool = True,
    ):
        super().__init__()
        self.extractor = extractor
        self.num_classes = num_classes
        self.use_labels = use_labels
        self.modulation = modulation
        self.layer_sizes = list(layer_sizes)
        k = VECTORS_PER_LAYER[modulation]
        self.per_sample = nn.Sequential(
            *mlp([self.extractor.flat_dim + (num_classes if use_labels else 0), *before_mean])
        )
        self.per_context = nn.Sequential(
            *mlp([before_mean[-1], *after_mean]), nn.Linear(after_mean[-1], k * sum(layer_sizes))
        )

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        features = self.extractor(x, mask=mask)
        if self.use_labels:
            if y is None:
                raise ValueError("this modulator reads labelled batches: pass the context labels")
            # one-hot by comparison: F.one_hot checks the label range, data-dependent control flow that vmap refuses
            one_hot = (y[:, None] == torch.arange(self.num_classes, device=y.device)).to(features.dtype)
            features = torch.cat([features, one_hot], dim=1)
        per_sample = self.per_sample(features)
        if mask is None:
            context = per_sample.mean(dim=0)
        else:  # the mean over the real samples of a padded batch
            weights = mask.to(per_sample.dtype)
            context = (per_sample * weights[:, None]).sum(0) / weights.sum()
        k = VECTORS_PER_LAYER[self.modulation]
        return list(self.per_context(context).view(k, -1).split(self.layer_sizes, dim=1))


class ModulatedNet(nn.Module):
    """ω = {μ, ψ}: ``forward(x, context_x, context_y)`` classifies x with f_ψ | g_μ(context); the
    masks mark the real samples of padded batches (fedmeta.models.cnn)."""

    def __init__(self, base: nn.Module, modulator: Modulator, modulate_flatten: bool = False):
        super().__init__()
        self.base = base
        self.modulator = modulator
        self.modulate_flatten = modulate_flatten

    def forward(
        self,
        x: torch.Tensor,
        context_x: torch.Tensor,
        context_y: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        zetas = self.modulator(context_x, context_y, context_mask)
        kind = self.modulator.modulation
        return self.base(
            x, lambda layer, a: modulate(a, zetas[layer], kind), gate_flatten=self.modulate_flatten, mask=mask
        )
