"""One local SGD step of L clients' batches of B, four ways, in one run: where a vmapped CPU round stands.

    .venv/bin/python benchmarks/cpu_round.py [--lanes 10] [--batch 10 30] [--repeats 10] [--threads 1] [--profile]
        [--glibc-thresholds]

The RMNIST CNN (conv 32-64, k5 → dense 512 → 10), forward and backward of a mean cross-entropy,
each client with its own parameters, timed four ways alternating A B C D (the best of --repeats
each, after two warm-up calls):

- ``sequential``: one client after another under plain autograd, NHWC (fedmeta's CPU default);
- ``vmap``: ``torch.func.vmap`` of ``torch.func.grad`` over the clients, fedmeta's vmapped path
  (convolutions as one grouped convolution, batch norm and pooling with lanes folded into channels:
  fedmeta.models.lanes);
- ``grouped``: the same computation written out by hand for plain autograd — one grouped NHWC
  convolution a layer (``groups = L``), lanes folded into the channels of batch norm and pooling,
  the linears as ``torch.baddbmm`` — the kernels vmap's rules call, without torch.func around them;
- ``shared``: the L·B samples as one batch through one model: the same FLOPs in one GEMM-shaped
  call, the bound a per-client computation could reach.

With and without batch norm (the peers' FedAvgCNN). Prints ms a step, the ratios to
``sequential`` and ``shared``, and the fraction of the fp32 matmul peak measured in the same run;
first, max-pooling of the first layer's activations in the two memory layouts. ``--profile`` adds,
per setting, each way's milliseconds a step in each ATen kernel (``torch.profiler``'s self CPU
time, the kernels with the most in any way): where a per-client step loses against the shared batch.
The process keeps freed memory as a fedmeta run on the CPU does (fedmeta.allocator) unless
``--glibc-thresholds``; each way's minor page faults a step are printed beside its time.
"""

from __future__ import annotations

import argparse
import resource
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


def ways(lanes: int, batch: int, batch_norm: bool):
    torch.manual_seed(0)
    net = ConvNet(1, 28, 10, [32, 64], 5, 0, [512], batch_norm=batch_norm)
    params = {k: v.detach() for k, v in net.named_parameters()}
    stacked = {k: v.expand(lanes, *v.shape).contiguous() for k, v in params.items()}
    x, y = torch.randn(lanes, batch, 1, 28, 28), torch.randint(0, 10, (lanes, batch))

    def loss(p, images, labels):
        return fn.cross_entropy(fn.call(net, p, images), labels).mean()

    def sequential():
        net.features.channels_last = True
        for lane in range(lanes):
            p = {k: v.detach().requires_grad_() for k, v in params.items()}
            torch.autograd.grad(loss(p, x[lane], y[lane]), list(p.values()))

    def vmap():
        net.features.channels_last = False  # vmap's own layout (fedmeta.engine sets it so)
        with fn.vmapped():
            torch.func.vmap(torch.func.grad(loss))(stacked, x, y)

    def shared():
        net.features.channels_last = True
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        torch.autograd.grad(loss(p, x.view(-1, 1, 28, 28), y.view(-1)), list(p.values()))

    def block(h, weight, bias, gamma, beta):
        h = F.conv2d(h, weight.flatten(0, 1).contiguous(memory_format=CL), bias.flatten(), groups=lanes)
        if batch_norm:
            h = F.batch_norm(h, None, None, gamma.flatten(), beta.flatten(), True, 0.0, 1e-5)
        return F.relu(F.max_pool2d(h, 2))

    def grouped():
        p = {k: v.detach().requires_grad_() for k, v in stacked.items()}
        names = [n for n in p if n.startswith("features.")]
        conv = [(p[n], p[n.replace("weight", "bias")]) for n in names if n.endswith("0.weight")]
        norm = (
            [(p[n], p[n.replace("weight", "bias")]) for n in names if n.endswith("1.weight")]
            if batch_norm
            else [(None, None)] * len(conv)
        )
        h = x.transpose(0, 1).reshape(batch, lanes, 28, 28).contiguous(memory_format=CL)
        for (w, b), (g, bt) in zip(conv, norm):
            h = block(h, w, b, g, bt)
        h = h.view(batch, lanes, -1, *h.shape[2:]).transpose(0, 1).flatten(2)  # (L, B, C·H·W)
        h = torch.baddbmm(p["dense.0.0.bias"][:, None], h, p["dense.0.0.weight"].transpose(1, 2))
        if batch_norm:
            h = (
                F.batch_norm(
                    h.transpose(0, 1).flatten(1),
                    None,
                    None,
                    p["dense.0.1.weight"].flatten(),
                    p["dense.0.1.bias"].flatten(),
                    True,
                    0.0,
                    1e-5,
                )
                .view(batch, lanes, -1)
                .transpose(0, 1)
            )
        h = torch.baddbmm(p["head.bias"][:, None], F.relu(h), p["head.weight"].transpose(1, 2))
        total = F.cross_entropy(h.flatten(0, 1), y.flatten(), reduction="sum") / batch
        torch.autograd.grad(total, list(p.values()), allow_unused=True)

    counter = FlopCounterMode(display=False)  # every way computes these FLOPs
    with counter:
        shared()
    flops = counter.get_total_flops()
    return {"sequential": sequential, "vmap": vmap, "grouped": grouped, "shared": shared}, flops


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=10)
    ap.add_argument("--batch", type=int, nargs="+", default=[10, 30])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (default 1: alone on one core)")
    ap.add_argument("--profile", action="store_true", help="each way's ms a step per kernel, side by side")
    ap.add_argument(
        "--glibc-thresholds",
        action="store_true",
        help="leave malloc's thresholds as glibc sets them (freed blocks go back to the OS)",
    )
    return ap


def kernel_times(fns: dict, steps: int = 5, rows: int = 10) -> str:
    """Each way's self CPU ms a step per ATen kernel (torch.profiler), the ``rows`` kernels with the
    most time in any way, and what the Python around them costs (the step's total less its kernels)."""
    per_way = {}
    for name, f in fns.items():
        with torch.profiler.profile() as prof:
            for _ in range(steps):
                f()
        events = prof.key_averages()
        per_way[name] = {
            e.key: e.self_cpu_time_total / 1e3 / steps for e in events if e.key.startswith("aten::")
        }
        per_way[name]["(everything else)"] = sum(e.self_cpu_time_total for e in events) / 1e3 / steps - sum(
            per_way[name].values()
        )
    kernels = sorted(
        {k for t in per_way.values() for k in t}, key=lambda k: -max(t.get(k, 0) for t in per_way.values())
    )
    lines = [f"{'kernel (self CPU ms a step)':42s}" + "".join(f"{w:>12s}" for w in fns)]
    for k in kernels[:rows] + ["(everything else)"] * ("(everything else)" not in kernels[:rows]):
        lines.append(f"{k:42s}" + "".join(f"{per_way[w].get(k, 0):12.2f}" for w in fns))
    return "\n".join(lines)


def main():
    a = arguments().parse_args()
    torch.set_num_threads(a.threads)
    kept = not a.glibc_thresholds and keep_freed_memory()
    peak = device_peaks(torch.device("cpu"), 2048)["fp32"]
    print(
        f"{hardware_name(torch.device('cpu'))}; fp32 matmul peak {peak:.0f} GFLOP/s; {a.lanes} clients a step; "
        + ("freed memory kept (fedmeta.allocator)" if kept else "glibc's malloc thresholds")
    )
    activations = torch.randn(a.lanes, 32, 24, 24)
    for name, t in (("NCHW", activations), ("NHWC", activations.contiguous(memory_format=CL))):
        F.max_pool2d(t, 2)
        start = time.perf_counter()
        for _ in range(20):
            F.max_pool2d(t, 2)
        print(
            f"max-pool 2×2 of {tuple(t.shape)} in {name}: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms"
        )
    print(
        "batch  bn   "
        + "".join(f"{w:>12s}" for w in ("sequential", "vmap", "grouped", "shared"))
        + "   ms a step; ratios; % peak"
    )
    for batch_norm in (True, False):
        for batch in a.batch:
            fns, flops = ways(a.lanes, batch, batch_norm)
            best = dict.fromkeys(fns, float("inf"))
            faults = dict.fromkeys(fns, 0)
            for f in fns.values():
                f(), f()
            for _ in range(a.repeats):
                for name, f in fns.items():
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    start = time.perf_counter()
                    f()
                    best[name] = min(best[name], time.perf_counter() - start)
                    faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            ms = "".join(f"{best[w] * 1e3:12.1f}" for w in fns)
            ratios = "  ".join(
                f"{w}/seq {best[w] / best['sequential']:.2f}" for w in ("vmap", "grouped", "shared")
            )
            bound = "  ".join(f"{w}/shared {best[w] / best['shared']:.2f}" for w in ("vmap", "grouped"))
            fraction = "  ".join(f"{w} {flops / best[w] / 1e9 / peak * 100:.0f} %" for w in fns)
            faulted = "  ".join(f"{w} {faults[w] / a.repeats:.0f}" for w in fns)
            print(
                f"{batch:5d}  {'yes' if batch_norm else 'no ':3s}{ms}   {ratios}  {bound}  {fraction}  "
                f"page faults a step: {faulted}",
                flush=True,
            )
            if a.profile:
                print(kernel_times(fns), flush=True)


if __name__ == "__main__":
    main()
