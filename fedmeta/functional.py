"""Differentiable optimizer steps on parameter dicts, for inner loops (MAML-style)."""

from __future__ import annotations

import torch

Params = dict[str, torch.Tensor]


def sgd_step(params: Params, loss: torch.Tensor, lr: float, create_graph: bool) -> Params:
    """θ' = θ − lr·∇θ loss. With ``create_graph`` θ' stays differentiable in θ to second order;
    without it the gradient is a constant and only the identity path remains (first order)."""
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
    return {name: p - lr * g for (name, p), g in zip(params.items(), grads)}
