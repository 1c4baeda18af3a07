"""Convolution, batch normalization and max-pooling that stay one kernel each way when clients are
vmapped.

Under ``torch.func.vmap`` (fedmeta.engine: a lane per client and seed) PyTorch's batch rules run a
batch norm whose weight differs per lane as a normalization without the affine, the affine apart
(with ones and zeros made for the purpose) and a backward of a dozen kernels; max-pooling folds the
lanes into the batch, so the activations are copied into another layout before each pooling and
again before the convolution after it, and the same on the way back. Both layers are independent
per channel, though: lane l's channel c is channel l·C + c of one layer L times as wide. So each
rule here folds the lanes into the channels — where the convolutions' own rule keeps them, so the
conv stack never changes layout — and runs PyTorch's kernel once, forward and backward
(``torch.autograd.Function``'s ``vmap`` staticmethod,
https://pytorch.org/docs/stable/notes/extending.func.html). Per channel the arithmetic is PyTorch's
own, alone or vmapped: the same kernels on the same numbers.

Convolutions on the CPU get a rule of their own for the layout: PyTorch's batch rule folds the
lanes into a grouped convolution too, but in NCHW, where the max-pooling after it is about ten
times slower than in NHWC (measured in docs/performance.md). The rule here runs the grouped
convolution channels-last, so every layer of the conv stack — convolution, batch norm, pooling,
forward and backward — sees lanes × channels as the contiguous inner axis of one NHWC tensor. On a
GPU PyTorch's own rule stays (cuDNN picks its layouts).

Second order (MAML's inner steps differentiated) goes through each backward's backward: batch
norm's as the vector-Jacobian product of its backward's formula with the statistics recomputed from
the input (they depend on it), max-pooling's as the gather of the selected elements, as PyTorch's
own double backwards do. Forward mode over a gradient (a Hessian-vector product as the jvp of a
gradient: Per-FedAvg's exact one) goes through each layer's and each backward's ``jvp``; a gradient
of such a product (a third order) is not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _activations(x: torch.Tensor, dim: int | None, lanes: int) -> torch.Tensor:
    """(B, L, C, …) as (B, L·C, …): the lanes folded into the channels."""
    x = x.movedim(dim, 1) if dim is not None else x.unsqueeze(1).expand(x.shape[0], lanes, *x.shape[1:])
    return x.reshape(x.shape[0], lanes * x.shape[2], *x.shape[3:])


def _channels(p: torch.Tensor, dim: int | None, lanes: int) -> torch.Tensor:
    """(L, C) as (L·C,)."""
    p = p.movedim(dim, 0) if dim is not None else p.expand(lanes, *p.shape)
    return p.reshape(-1)


def _unfold(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """(B, L·C, …) back to (B, L, C, …), the lanes at dim 1."""
    return x.view(x.shape[0], lanes, x.shape[1] // lanes, *x.shape[2:])


def _backward_formula(grad_out, x, weight, eps: float):
    """Batch norm's gradients (input, weight, bias) in plain differentiable operations, the batch
    statistics recomputed from ``x``: what the double backward differentiates."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1, *[1] * (x.dim() - 2)]
    count = x.numel() // x.shape[1]
    var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
    invstd = torch.rsqrt(var + eps)
    x_hat = (x - mean) * invstd
    grad_bias = grad_out.sum(dims)
    grad_weight = (grad_out * x_hat).sum(dims)
    grad_x = (weight.view(shape) * invstd / count) * (
        count * grad_out - grad_bias.view(shape) - x_hat * grad_weight.view(shape)
    )
    return grad_x, grad_weight, grad_bias


def _double_backward(grad_out, x, weight, mean, invstd, a, a_weight, a_bias):
    """Batch norm's backward differentiated: the gradients (grad_out, x, weight) of
    ⟨a, grad_x⟩ + ⟨a_weight, grad_weight⟩ + ⟨a_bias, grad_bias⟩, in closed form (about 33 kernels,
    where autograd through ``_backward_formula`` launches about 50).

    With x̂ = (x − μ)·s, s = 1/√(var + ε), ⟨·⟩ a channel's mean and P(v) = v − ⟨v⟩ − x̂⟨x̂v⟩ (the
    normalization's Jacobian over s, self-adjoint): grad_x = w·s·P(grad_out), so its adjoint in
    grad_out is w·s·P(a); in w it is s·Σ a·P(grad_out). In x, x̂ moves by s·P(δx) and s by
    −s²⟨x̂δx⟩, which gives s·P(u) − s²·w·k·x̂, with u the terms multiplying x̂ and k = ⟨a·P(grad_out)⟩."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1, *[1] * (x.dim() - 2)]

    def mean_of(t):
        return t.mean(dims, keepdim=True)

    s = invstd.view(shape)
    x_hat = (x - mean.view(shape)) * s
    grad_out_x_hat = mean_of(grad_out * x_hat)
    grad_grad_out = grad_weight = u = None
    if a is not None:
        w_s = weight.view(shape) * s
        a_mean, a_x_hat = mean_of(a), mean_of(a * x_hat)
        k = torch.addcmul(
            torch.addcmul(mean_of(a * grad_out), a_mean, mean_of(grad_out), value=-1),
            a_x_hat,
            grad_out_x_hat,
            value=-1,
        )
        grad_grad_out = torch.addcmul(a - a_mean, x_hat, a_x_hat, value=-1) * w_s
        grad_weight = (s * k).view(-1) * (x.numel() // x.shape[1])
        u = torch.addcmul((w_s * a_x_hat).neg_() * grad_out, w_s * grad_out_x_hat, a, value=-1)
    if a_weight is not None:
        a_weight = a_weight.view(shape)
        grad_grad_out = (
            a_weight * x_hat if grad_grad_out is None else torch.addcmul(grad_grad_out, a_weight, x_hat)
        )
        u = a_weight * grad_out if u is None else torch.addcmul(u, a_weight, grad_out)
    if a_bias is not None:
        a_bias = a_bias.view(shape)
        grad_grad_out = a_bias.expand_as(x) if grad_grad_out is None else grad_grad_out + a_bias
    grad_x = None
    if u is not None:
        grad_x = torch.addcmul(u - mean_of(u), x_hat, mean_of(u * x_hat), value=-1) * s
        if a is not None:
            grad_x = torch.addcmul(grad_x, s * w_s * k, x_hat, value=-1)
    return grad_grad_out, grad_x, grad_weight


class _BatchNormBackward(torch.autograd.Function):
    @staticmethod
    def forward(grad_out, x, weight, mean, invstd, eps):
        return aten.native_batch_norm_backward(
            grad_out, x, weight, None, None, mean, invstd, True, eps, [True, True, True]
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, weight, mean, invstd, eps = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad_out, x, weight, mean, invstd)
        ctx.save_for_forward(grad_out, x, weight)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, grad_grad_x, grad_grad_weight, grad_grad_bias):
        return (
            *_double_backward(*ctx.saved_tensors, grad_grad_x, grad_grad_weight, grad_grad_bias),
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx, *tangents):
        primals = ctx.saved_tensors[:3]
        tangents = [torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents[:3])]
        _, tangent_out = torch.func.jvp(
            lambda g, x, w: _backward_formula(g, x, w, ctx.eps), primals, tuple(tangents)
        )
        return tangent_out

    @staticmethod
    def vmap(info, in_dims, grad_out, x, weight, mean, invstd, eps):
        lanes = info.batch_size
        grad_x, grad_weight, grad_bias = _BatchNormBackward.apply(
            _activations(grad_out, in_dims[0], lanes),
            _activations(x, in_dims[1], lanes),
            *(_channels(p, d, lanes) for p, d in zip((weight, mean, invstd), in_dims[2:5])),
            eps,
        )
        return (
            (_unfold(grad_x, lanes), grad_weight.view(lanes, -1), grad_bias.view(lanes, -1)),
            (1, 0, 0),
        )


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, bias, eps):
        return aten.native_batch_norm(x, weight, bias, None, None, True, 0.0, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, eps = inputs
        _, mean, invstd = output
        ctx.mark_non_differentiable(mean, invstd)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.save_for_forward(x, weight, mean, invstd)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, grad_out, _mean, _invstd):
        x, weight, mean, invstd = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None
        return (*_BatchNormBackward.apply(grad_out, x, weight, mean, invstd, ctx.eps), None)

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t, _eps):
        """Forward mode (a Hessian-vector product as the jvp of a gradient): the normalized input's
        tangent with the statistics' own, then the affine's."""
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [0, *range(2, x.dim())]
        shape = [1, -1, *[1] * (x.dim() - 2)]
        x_hat = (x - mean.view(shape)) * invstd.view(shape)
        out_t = torch.zeros_like(x)
        if x_t is not None:
            centered = x_t - x_t.mean(dims, keepdim=True)
            x_hat_t = invstd.view(shape) * (centered - x_hat * (x_t * x_hat).mean(dims, keepdim=True))
            out_t = out_t + weight.view(shape) * x_hat_t
        if weight_t is not None:
            out_t = out_t + weight_t.view(shape) * x_hat
        if bias_t is not None:
            out_t = out_t + bias_t.view(shape)
        return out_t, None, None

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, eps):
        lanes = info.batch_size
        out, mean, invstd = _BatchNorm.apply(
            _activations(x, in_dims[0], lanes),
            *(_channels(p, d, lanes) for p, d in zip((weight, bias), in_dims[1:3])),
            eps,
        )
        return (_unfold(out, lanes), mean.view(lanes, -1), invstd.view(lanes, -1)), (1, 0, 0)


def _transformed(x: torch.Tensor) -> bool:
    """Whether ``x`` is under a torch.func transform (vmap, grad, jvp). Outside them — one client at
    a time under plain autograd, fedmeta's CPU default — PyTorch's own layers run: the same kernels,
    and batch norm's double backward in C++, measured 10 % faster for CAFeMe's second order than
    the formula here (docs/performance.md)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x)


def batch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.batch_norm(x, None, None, weight, bias, training=True, eps=eps)``: normalized with the
    batch's own statistics, then scaled and shifted per channel."""
    if not _transformed(x):
        return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
    return _BatchNorm.apply(x, weight, bias, eps)[0]


class _MaxPoolBackward(torch.autograd.Function):
    @staticmethod
    def forward(grad_out, x, indices, size):
        return aten.max_pool2d_with_indices_backward(grad_out, x, size, size, 0, 1, False, indices)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.save_for_forward(inputs[1], inputs[2])
        ctx.size = inputs[3]

    @staticmethod
    def backward(ctx, grad_grad_x):
        (indices,) = ctx.saved_tensors  # linear in grad_out: the gradient picks what was selected
        picked = grad_grad_x.flatten(-2).gather(-1, indices.flatten(-2)).view_as(indices)
        return picked, None, None, None

    @staticmethod
    def jvp(ctx, grad_out_t, _x_t, _indices_t, _size):
        x, indices = ctx.saved_tensors  # linear in grad_out, and the selection is fixed
        if grad_out_t is None:
            return torch.zeros_like(x)
        return aten.max_pool2d_with_indices_backward(grad_out_t, x, ctx.size, ctx.size, 0, 1, False, indices)

    @staticmethod
    def vmap(info, in_dims, grad_out, x, indices, size):
        lanes = info.batch_size
        grad_x = _MaxPoolBackward.apply(
            *(_activations(t, d, lanes) for t, d in zip((grad_out, x, indices), in_dims[:3])), size
        )
        return _unfold(grad_x, lanes), 1


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(x, size):
        return aten.max_pool2d_with_indices(x, size, size)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(inputs[0], output[1])
        ctx.save_for_forward(output[1])
        ctx.size = inputs[1]

    @staticmethod
    def backward(ctx, grad_out, _indices):
        x, indices = ctx.saved_tensors
        return _MaxPoolBackward.apply(grad_out, x, indices, ctx.size), None

    @staticmethod
    def jvp(ctx, x_t, _size):
        if x_t is None:
            return None, None
        (indices,) = ctx.saved_tensors  # the tangent of what each window selected
        return x_t.flatten(-2).gather(-1, indices.flatten(-2)).view_as(indices), None

    @staticmethod
    def vmap(info, in_dims, x, size):
        lanes = info.batch_size
        out, indices = _MaxPool.apply(_activations(x, in_dims[0], lanes), size)
        return (_unfold(out, lanes), _unfold(indices, lanes)), (1, 1)


def max_pool2d(x: torch.Tensor, size: int) -> torch.Tensor:
    """``F.max_pool2d(x, size)``: non-overlapping ``size``×``size`` windows."""
    if not _transformed(x):
        return F.max_pool2d(x, size)
    return _MaxPool.apply(x, size)[0]


# ---- convolution ----------------------------------------------------------------------------------
CHANNELS_LAST = torch.channels_last


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=CHANNELS_LAST)


def _conv(x, weight, bias, padding, groups):
    # F's, not aten's: autocast casts F.conv2d's inputs (aten.convolution is not on its list)
    return F.conv2d(x, weight, bias, padding=padding, groups=groups)


class _ConvBackward(torch.autograd.Function):
    """A convolution's gradients (input, weight, bias) for ``grad_out``: bilinear in (grad_out,
    weight) and in (grad_out, input), so each derivative of it is a convolution or a convolution's
    gradient again — every order goes through these two functions."""

    @staticmethod
    def forward(grad_out, x, weight, padding, groups, mask):
        bias_sizes = [weight.shape[0]] if mask[2] else None
        return aten.convolution_backward(
            grad_out, x, weight, bias_sizes, [1, 1], padding, [1, 1], False, [0, 0], groups, list(mask)
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, weight, padding, groups, mask = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad_out, x, weight)
        ctx.save_for_forward(grad_out, x, weight)
        ctx.padding, ctx.groups, ctx.mask = padding, groups, mask

    @staticmethod
    def backward(ctx, a_x, a_weight, a_bias):
        """⟨a_x, grad_x(g, w)⟩ = ⟨g, conv(a_x, w)⟩ and ⟨a_w, grad_w(g, x)⟩ = ⟨g, conv(x, a_w)⟩."""
        grad_out, x, weight = ctx.saved_tensors
        padding, groups = ctx.padding, ctx.groups
        grad_grad_out = grad_x = grad_weight = None
        if a_x is not None:
            grad_grad_out = _Conv.apply(a_x, weight, None, padding, groups)
            grad_weight = _ConvBackward.apply(grad_out, a_x, weight, padding, groups, (False, True, False))[1]
        if a_weight is not None:
            through_weight = _Conv.apply(x, a_weight, None, padding, groups)
            grad_grad_out = through_weight if grad_grad_out is None else grad_grad_out + through_weight
            grad_x = _ConvBackward.apply(grad_out, x, a_weight, padding, groups, (True, False, False))[0]
        if a_bias is not None:
            through_bias = a_bias.view(1, -1, 1, 1)
            grad_grad_out = (
                through_bias.expand_as(grad_out) if grad_grad_out is None else grad_grad_out + through_bias
            )
        return grad_grad_out, grad_x, grad_weight, None, None, None

    @staticmethod
    def jvp(ctx, grad_out_t, x_t, weight_t, *_):
        """grad_x moves with (grad_out, weight), grad_weight with (grad_out, input), grad_bias with
        grad_out; only the terms whose tangents exist are computed."""
        grad_out, x, weight = ctx.saved_tensors
        padding, groups, mask = ctx.padding, ctx.groups, ctx.mask
        out = [None, None, None]
        if grad_out_t is not None:
            out = list(_ConvBackward.apply(grad_out_t, x, weight, padding, groups, mask))
        if weight_t is not None and mask[0]:
            through = _ConvBackward.apply(grad_out, x, weight_t, padding, groups, (True, False, False))[0]
            out[0] = through if out[0] is None else out[0] + through
        if x_t is not None and mask[1]:
            through = _ConvBackward.apply(grad_out, x_t, weight, padding, groups, (False, True, False))[1]
            out[1] = through if out[1] is None else out[1] + through
        shapes = (x, weight, weight.new_empty(weight.shape[0]))  # a tangent for every output asked for
        return tuple(
            torch.zeros_like(like) if asked and o is None else o for o, asked, like in zip(out, mask, shapes)
        )

    @staticmethod
    def vmap(info, in_dims, grad_out, x, weight, padding, groups, mask):
        lanes = info.batch_size
        grad_x, grad_weight, grad_bias = _ConvBackward.apply(
            _nhwc(_activations(grad_out, in_dims[0], lanes)),
            _nhwc(_activations(x, in_dims[1], lanes)),
            _kernels(weight, in_dims[2], lanes),
            padding,
            groups * lanes,
            mask,
        )
        return (
            (
                None if grad_x is None else _unfold(grad_x, lanes),
                None if grad_weight is None else grad_weight.view(lanes, -1, *grad_weight.shape[1:]),
                None if grad_bias is None else grad_bias.view(lanes, -1),
            ),
            (
                None if grad_x is None else 1,
                None if grad_weight is None else 0,
                None if grad_bias is None else 0,
            ),
        )


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, bias, padding, groups):
        return _conv(x, weight, bias, padding, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, padding, groups = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight)
        ctx.save_for_forward(x, weight)
        ctx.padding, ctx.groups, ctx.has_bias = padding, groups, bias is not None

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:
            return None, None, None, None, None
        x, weight = ctx.saved_tensors
        mask = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        return (*_ConvBackward.apply(grad_out, x, weight, ctx.padding, ctx.groups, mask), None, None)

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t, _padding, _groups):
        x, weight = ctx.saved_tensors
        out_t = None
        if x_t is not None:
            out_t = _Conv.apply(x_t, weight, None, ctx.padding, ctx.groups)
        if weight_t is not None:
            through_weight = _Conv.apply(x, weight_t, None, ctx.padding, ctx.groups)
            out_t = through_weight if out_t is None else out_t + through_weight
        if bias_t is not None:
            out_t = bias_t.view(1, -1, 1, 1) if out_t is None else out_t + bias_t.view(1, -1, 1, 1)
        return out_t

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, padding, groups):
        lanes = info.batch_size
        out = _Conv.apply(
            _nhwc(_activations(x, in_dims[0], lanes)),
            _kernels(weight, in_dims[1], lanes),
            None if bias is None else _channels(bias, in_dims[2], lanes),
            padding,
            groups * lanes,
        )
        return _unfold(out, lanes), 1


def _kernels(weight: torch.Tensor, dim: int | None, lanes: int) -> torch.Tensor:
    """(L, O, C, k, k) as (L·O, C, k, k): each lane's kernels one group of a grouped convolution."""
    weight = weight.movedim(dim, 0) if dim is not None else weight.expand(lanes, *weight.shape)
    return weight.reshape(-1, *weight.shape[2:])


def _symmetric_padding(padding: int | tuple | str, kernel_size: tuple[int, int]) -> list[int] | None:
    """``nn.Conv2d``'s padding as aten's two numbers (stride 1); None where "same" pads one side
    more than the other (an even kernel), which only F.conv2d expresses."""
    if padding == "valid":
        return [0, 0]
    if padding == "same":
        return [(k - 1) // 2 for k in kernel_size] if all(k % 2 for k in kernel_size) else None
    return [padding, padding] if isinstance(padding, int) else list(padding)


def conv2d(x: torch.Tensor, layer: torch.nn.Conv2d) -> torch.Tensor:
    """``layer(x)``; under torch.func on the CPU through the rule above where the layer is what it
    covers (stride 1, no dilation or groups, symmetric padding), else through PyTorch's own."""
    padding = _symmetric_padding(layer.padding, layer.kernel_size)
    plain = layer.stride == (1, 1) and layer.dilation == (1, 1) and layer.groups == 1
    if plain and padding is not None and _transformed(x) and x.device.type == "cpu":
        weight, bias = layer.weight, layer.bias
        if torch.is_autocast_enabled("cpu"):
            # autocast's cast of a convolution's operands, made before the rule rather than inside
            # it, so its backward sees one dtype (convolution_backward refuses a mix)
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        return _Conv.apply(x, weight, bias, padding, 1)
    return layer(x)
