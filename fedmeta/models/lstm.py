"""The character LSTM of LEAF's Shakespeare task: an 8-dimensional embedding, two LSTM layers of 256
units, a linear head on the last step's hidden state (next-character prediction).

The recurrence is written with plain tensor operations, one step at a time, rather than with
``nn.LSTM``: PyTorch's fused LSTM kernel has no ``torch.func.vmap`` rule, so vmapped clients (a lane
per client and seed, fedmeta.engine) would fall back to a Python loop over lanes. Here every step is
two matrix products and a few pointwise functions, which vmap batches over lanes like any layer. The
parameters have ``nn.LSTM``'s shapes, gate order (input, forget, cell, output) and initialization,
so a layer computes what ``nn.LSTM`` computes (tests/test_sequence_models.py, in float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class LSTMLayer(nn.Module):
    """One LSTM layer over a whole sequence: (B, T, input_size) → (B, T, hidden_size), zero state."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(4 * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(4 * hidden_size))
        bound = 1 / math.sqrt(hidden_size)  # nn.LSTM's initialization
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the input's share of every step's gates in one product, outside the recurrence
        inputs = F.linear(x, self.weight_ih, self.bias_ih + self.bias_hh).unbind(1)
        h = c = x.new_zeros(x.shape[0], self.hidden_size)
        outputs = []
        for step in inputs:
            i, f, g, o = (step + F.linear(h, self.weight_hh)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, dim=1)


class SequenceFeatures(nn.Module):
    """Embedding and LSTM layers: a sequence of character indices → the last step's hidden state.
    ``after_layer(i, a)`` sees each layer's outputs (B, units, T), units on dim 1 as a conv layer's
    channels are, which is where CAFeMe's gates sit."""

    def __init__(self, vocab_size: int, embedding_dim: int, hidden_sizes: list[int]):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        sizes = [embedding_dim, *hidden_sizes]
        self.layers = nn.ModuleList(LSTMLayer(a, b) for a, b in zip(sizes, sizes[1:]))
        self.flat_dim = sizes[-1]

    def forward(
        self, x: torch.Tensor, after_layer: Callable | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # stored as uint8 (a tenth of the memory of int64 windows); the mask is unused: nothing here
        # mixes the samples of a batch, so padding cannot reach a real sample's output
        a = self.embedding(x.long())
        for i, layer in enumerate(self.layers):
            a = layer(a)
            if after_layer is not None:
                a = after_layer(i, a.transpose(1, 2)).transpose(1, 2)
        return a[:, -1]


class CharLSTM(nn.Module):
    """The base network for text, with ConvNet's interface (``forward(x, gate, gate_flatten, mask,
    embedding)``, ``hidden_sizes``, a classifier named ``head``), so every method runs on it."""

    def __init__(self, vocab_size: int, num_classes: int, embedding_dim: int, hidden_sizes: list[int]):
        super().__init__()
        self.features = SequenceFeatures(vocab_size, embedding_dim, list(hidden_sizes))
        self.head = nn.Linear(self.features.flat_dim, num_classes)
        self.lstm_units = list(hidden_sizes)

    def hidden_sizes(self, include_flatten: bool = False) -> list[int]:
        return self.lstm_units + ([self.features.flat_dim] if include_flatten else [])

    def forward(
        self,
        x: torch.Tensor,
        gate: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        gate_flatten: bool = False,
        mask: torch.Tensor | None = None,
        embedding: bool = False,
    ) -> torch.Tensor:
        z = self.features(x, gate, mask)
        if gate_flatten and gate is not None:
            z = gate(len(self.lstm_units), z)
        return z if embedding else self.head(z)
