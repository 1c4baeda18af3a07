"""Models as functions of parameter dicts, and differentiable optimizer steps on them (MAML-style)."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

Params = dict[str, torch.Tensor]


def sgd_step(params: Params, loss: torch.Tensor, lr: float, create_graph: bool) -> Params:
    """θ' = θ − lr·∇θ loss. With ``create_graph`` θ' stays differentiable in θ to second order;
    without it the gradient is a constant and only the identity path remains (first order)."""
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
    return {name: p - lr * g for (name, p), g in zip(params.items(), grads)}


_thread_modules = threading.local()


def call(module: nn.Module, params: Params, *args) -> torch.Tensor:
    """``module`` run with ``params`` (``torch.func.functional_call``). functional_call swaps the
    module's attributes while it runs, so a thread that runs clients beside the main thread
    (``federation.client_threads``) calls its own replica, which shares the module's tensors."""
    if threading.current_thread() is threading.main_thread():
        return torch.func.functional_call(module, params, args)
    replicas = _thread_modules.__dict__.setdefault("replicas", {})
    original, replica = replicas.get(id(module), (None, None))
    if original is not module:
        shared = {id(t): t for t in (*module.parameters(), *module.buffers())}
        original, replica = replicas[id(module)] = (module, copy.deepcopy(module, shared))
    return torch.func.functional_call(replica, params, args)
