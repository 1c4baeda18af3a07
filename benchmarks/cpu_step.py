"""One client's SGD step on the CPU, computed the ways a CPU could: where a sequential step's time goes.

    .venv/bin/python benchmarks/cpu_step.py [--batch 10 30] [--repeats 15] [--no-compile]

The peers' CNN (fedmeta's ConvNet with ``batch_norm=false``: conv 32-64 k5, dense 512, 10 classes,
the shape of PFLlib's and FL-bench's FedAvgCNN), one client, one thread: forward, backward and an SGD
update of a batch, timed in blocks of 20 steps, the ways alternating A B C …, best and median of
``--repeats`` blocks. Every way computes the same gradients (checked to 1e-5 before timing):

- ``fedmeta``: fedmeta's sequential CPU step (``fedmeta.functional.call`` of the ConvNet, NHWC);
- ``im2col conv1`` / ``im2col both``: the first (one input channel) or both convolutions as an
  unfold of the NHWC activations and one matrix product;
- ``dense as conv``: the 1,024 → 512 dense layer as a 4×4 convolution of the pooled NHWC map
  (no flatten copy, oneDNN's kernel instead of MKL's);
- ``compiled``: ``torch.compile`` (Inductor's C++ backend) of the loss, the update eager.

Then fedmeta's step under ``torch.profiler`` with input shapes: each kernel's µs a step and GFLOP/s
against the fp32 matmul peak measured in the same process — which kernels are at the machine's
limit and which are not.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fedmeta import functional as fn
from fedmeta.allocator import keep_freed_memory
from fedmeta.bench import device_peaks
from fedmeta.fastest import hardware_name
from fedmeta.models import ConvNet

CL = torch.channels_last
STEPS = 20  # a timed block


def one_channel_nhwc(x: torch.Tensor) -> torch.Tensor:
    """A one-channel batch with NHWC strides, as fedmeta's ConvFeatures passes it (oneDNN then picks NHWC)."""
    x = x.contiguous(memory_format=CL)
    return x.as_strided(x.shape, (x.stride(0), 1, x.stride(2), x.stride(3)))


def conv_im2col(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A valid convolution as an unfold of the NHWC activations and one matrix product (NHWC out)."""
    n, _, height, width = h.shape
    k, out = weight.shape[-1], weight.shape[0]
    cols = h.permute(0, 2, 3, 1).unfold(1, k, 1).unfold(2, k, 1)  # n, H', W', c, k, k
    rows = torch.addmm(bias, cols.reshape(-1, cols.shape[3] * k * k), weight.reshape(out, -1).t())
    return rows.view(n, height - k + 1, width - k + 1, out).permute(0, 3, 1, 2)


def ways(batch: int, compile_too: bool):
    torch.manual_seed(0)
    net = ConvNet(1, 28, 10, [32, 64], 5, 0, [512], batch_norm=False)
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    w1, b1, w2, b2, w3, b3, w4, b4 = params.values()
    x, y = one_channel_nhwc(torch.randn(batch, 1, 28, 28)), torch.randint(0, 10, (batch,))

    def head(h):
        return F.linear(F.relu(F.linear(h.flatten(1), w3, b3)), w4, b4)

    def pool(h):
        return F.max_pool2d(F.relu(h), 2)

    def dense_as_conv(h):
        return F.linear(F.relu(F.conv2d(h, w3.view(512, 64, 4, 4), b3)).flatten(1), w4, b4)

    losses = {
        "fedmeta": lambda: fn.cross_entropy(fn.call(net, params, x), y).mean(),
        "im2col conv1": lambda: F.cross_entropy(
            head(pool(F.conv2d(pool(conv_im2col(x, w1, b1)), w2, b2))), y
        ),
        "im2col both": lambda: F.cross_entropy(
            head(pool(conv_im2col(pool(conv_im2col(x, w1, b1)), w2, b2))), y
        ),
        "dense as conv": lambda: F.cross_entropy(
            dense_as_conv(pool(F.conv2d(pool(F.conv2d(x, w1, b1)), w2, b2))), y
        ),
    }
    if compile_too:
        compiled = torch.compile(losses["fedmeta"])
        losses["compiled"] = compiled

    reference = torch.autograd.grad(losses["fedmeta"](), list(params.values()))
    for name, loss in losses.items():
        start = time.perf_counter()
        grads = torch.autograd.grad(loss(), list(params.values()))
        if name == "compiled":
            print(
                f"torch.compile's first step (compilation): {time.perf_counter() - start:.1f} s", flush=True
            )
        worst = max((a - b).abs().max().item() for a, b in zip(grads, reference))
        assert worst < 1e-5, f"{name}: gradients differ from fedmeta's by {worst}"

    def stepper(loss):
        def step():
            grads = torch.autograd.grad(loss(), list(params.values()))
            with torch.no_grad():
                torch._foreach_add_(list(params.values()), grads, alpha=-1e-3)

        return step

    return {name: stepper(loss) for name, loss in losses.items()}


def conv_flops(key: str, shapes: list, batch_shape: tuple) -> float:
    """A convolution kernel's FLOPs from its input shapes (the profiler counts only matrix products'):
    the forward's; the backward's weight gradient, and its input gradient unless the input is the batch."""
    if key not in ("aten::mkldnn_convolution", "aten::convolution_backward"):
        return 0.0
    weight = shapes[1] if key == "aten::mkldnn_convolution" else shapes[2]
    out = shapes[0] if key == "aten::convolution_backward" else None
    if out is None:
        n, _, height, width = shapes[0]
        out = (n, weight[0], height - weight[2] + 1, width - weight[3] + 1)
    one = 2 * out[0] * out[2] * out[3] * weight[0] * weight[1] * weight[2] * weight[3]
    if key == "aten::mkldnn_convolution":
        return one
    return one * (1 if tuple(shapes[1]) == batch_shape else 2)


def kernel_breakdown(step, peak: float, batch_shape: tuple, steps: int = 40) -> str:
    """Each kernel's µs a step in fedmeta's step (by input shapes) and its GFLOP/s where it multiplies."""
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events) / steps
    lines = [f"{'kernel':40s} {'µs a step':>10s} {'share':>6s} {'GFLOP/s':>8s} {'% peak':>7s}  input shapes"]
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
        us = e.self_cpu_time_total / steps
        flops = (e.flops or 0) / steps or conv_flops(e.key, e.input_shapes, batch_shape)
        rate = (
            f"{flops / us / 1e3:8.1f} {flops / us / 1e3 / peak * 100:6.0f} %"
            if flops
            else f"{'':8s} {'':7s} "
        )
        lines.append(
            f"{e.key[:40]:40s} {us:10.1f} {us / total * 100:5.1f}% {rate}  {str(e.input_shapes)[:80]}"
        )
    lines.append(f"{'(a step under the profiler)':40s} {total:10.1f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[10, 30])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--no-compile", action="store_true", help="leave out torch.compile (it compiles for ~30 s)"
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    peak = device_peaks(torch.device("cpu"), 2048)["fp32"]
    print(f"{hardware_name(torch.device('cpu'))}; fp32 matmul peak {peak:.0f} GFLOP/s; freed memory kept")
    for batch in a.batch:
        fns = ways(batch, not a.no_compile)
        with FlopCounterMode(display=False) as counter:
            fns["fedmeta"]()
        flops = counter.get_total_flops()
        times = {name: [] for name in fns}
        for f in fns.values():
            for _ in range(STEPS):
                f()
        for _ in range(a.repeats):
            for name, f in fns.items():
                start = time.perf_counter()
                for _ in range(STEPS):
                    f()
                times[name].append((time.perf_counter() - start) / STEPS * 1e3)
        print(
            f"\nbatch {batch}: {flops / 1e6:.0f} MFLOP a step; at the fp32 peak {flops / peak / 1e6:.3f} ms"
        )
        base = min(times["fedmeta"])
        for name, t in times.items():
            t.sort()
            print(
                f"  {name:14s} best {t[0]:7.3f} ms  median {t[len(t) // 2]:7.3f} ms  "
                f"× fedmeta {t[0] / base:5.2f}  {flops / t[0] / 1e6 / peak * 100:4.0f} % of peak"
            )
        print(kernel_breakdown(fns["fedmeta"], peak, (batch, 1, 28, 28)), flush=True)


if __name__ == "__main__":
    main()
