"""Which way of computing a round's clients the machine at hand measured faster.

``make bench`` times every row both ways — one client at a time and vmapped — and writes each row
with the machine it ran on (``results/bench.json``: the CPU model and torch's threads, or the card).
``federation.vectorize=auto`` on a CPU asks here: the vmapped way where the bench's pair of rows for
the run's data set and partition, method, variant, precision and lane buckets, measured on this CPU
model with this many threads, shows it faster; one client at a time where it shows it slower or
where the bench has no such pair (a CPU it never ran on: the CPU's default, which the bench measured
faster for every method on the CPUs this project has). The rows are the data set's protocol (M = 5
clients a round, its batch size), so a run far from it (batches of 10, 50 clients a round) is better
served by measuring it: ``fedmeta bench`` with its overrides, or
``federation.vectorize=true|false``.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

BENCH_FILE = Path(__file__).resolve().parent.parent / "results" / "bench.json"
CPUINFO = Path("/proc/cpuinfo")


def hardware_name(device: torch.device) -> str:
    """The card's name, or the CPU and the threads torch uses: what a timing ran on. A virtual
    machine's CPU name is often only the vendor's line ("AMD EPYC"), shared by generations that differ
    in speed and in their kernels' last bits, so the CPU's family and model numbers and the
    instruction set torch's kernels use are named with it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    fields: dict[str, str] = {}
    for line in CPUINFO.read_text().splitlines() if CPUINFO.exists() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    generation = (
        f"family {fields['cpu family']} model {fields['model']}, "
        if "cpu family" in fields and "model" in fields
        else ""
    )
    name = fields.get("model name") or platform.processor()
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{name} ({generation}{capability}), {torch.get_num_threads()} thread(s)"


def _rows(path: Path) -> list[dict]:
    try:  # absent (an installed package has no results/), or not the bench's file
        rows = json.loads(path.read_text()).get("rows", [])
    except (OSError, ValueError, AttributeError, RecursionError):
        return []
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def vmap_measured_faster(cfg, device: torch.device, path: Path = BENCH_FILE) -> bool | None:
    """With ``vectorize=auto`` on a CPU: whether the bench measured this config's vmapped rounds
    faster than its sequential ones on this CPU (``hardware_name``); None where it has not measured
    both, or the config does not leave the choice to it."""
    if cfg.federation.vectorize != "auto" or device.type != "cpu":
        return None
    hardware = hardware_name(device)
    key = (cfg.dataset.name, cfg.method.name, cfg.variant, cfg.fabric.precision)
    seconds: dict[str, float] = {}
    for row in _rows(path):
        if (
            (row.get("dataset"), row.get("method"), row.get("variant"), row.get("precision")) == key
            and row.get("partition", cfg.partition.name) == cfg.partition.name  # rows before it was kept: any
            and row.get("lane_buckets", 1) == cfg.federation.get("lane_buckets", 1)
            and row.get("hardware") == hardware
            and row.get("seeds") == 1
            and row.get("client_threads") == 1
            and not row.get("fallback")
            and isinstance(row.get("seconds_per_round"), (int, float))
        ):
            seconds[row.get("clients")] = row["seconds_per_round"]
    if "vmap" not in seconds or "sequential" not in seconds:
        return None
    return seconds["vmap"] < seconds["sequential"]
