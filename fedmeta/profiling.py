"""``fedmeta campaign --profile SECONDS``: what a job learns, in its first seconds, about the unit it
runs next — so that every lease measures the speed the campaign's projection counts with and
points at the next change.

The unit's seeds are set up as its runs set them up (stacked, clients vmapped, rounds recorded on a
card) from scratch, apart from its kept runs, which nothing here touches. Then, each step only while
the budget lasts:

1. rounds until the recording is made, then a few timed ones: seconds per seed-round *alone* (the
   job has started nothing else yet), the process's start up to its first round, and that round
   (the recording made in it);
2. one evaluation of every seed's new clients, timed: what each of a cell's evaluations costs;
3. one round under ``torch.profiler`` (the device's kernels on a card, the host's operators on a
   CPU): the top kernels by time and their share;
4. one round counted by :mod:`fedmeta.census` without its recording (the same operators, eagerly),
   and its FLOPs one seed at a time: the bytes and FLOPs a round moves, over the profiled round's
   time, as achieved GB/s and TFLOP/s.

Each step prints as it ends (to the job's log, which ``fedmeta campaign --collect`` keeps in
``results/gpu/jobs/``); ``MEASURED`` starts the one line, a JSON object, that ``results/campaign.md``
reads its speed and evaluation time from (``fedmeta.campaign.alone_records``).
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import UTC, datetime

import torch

from fedmeta.bench import device_timer, stacked_runs
from fedmeta.campaign import MEASURED
from fedmeta.stopping import process_seconds

TOP_KERNELS = 20
WARMUP_ROUNDS = 3  # the recording is made in the first rounds (fedmeta.capture)
TIMED_ROUNDS = 5


def profile_unit(
    label: str, preset: str, overrides: list[str], seconds: float, top: int = TOP_KERNELS
) -> dict:
    """Steps 1–4 above for ``preset``'s unit ``label`` (its runs' ``overrides``), within ``seconds``
    from now; returns what was measured (steps not reached are absent)."""
    from fedmeta.assemble import hardware_name, make_engine
    from fedmeta.rounds import evaluate_on_ranks, federated_rounds

    deadline = time.monotonic() + seconds
    cfg, fabric, runs = stacked_runs(overrides)
    engine = make_engine(cfg, fabric.device)
    cuda = fabric.device.type == "cuda"
    timed = device_timer(fabric.device)
    clients, seeds = cfg.federation.clients_per_round, len(runs)
    measured = {
        "unit": label,
        "preset": preset,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hardware": hardware_name(fabric.device),
        "seeds": seeds,
    }
    started = process_seconds()
    round_number = 0

    def next_round(run_engine=engine) -> None:
        nonlocal round_number
        round_number += 1
        federated_rounds(runs, round_number, clients, engine=run_engine)

    def left() -> float:
        return deadline - time.monotonic()

    first = timed(next_round)
    measured["start_seconds"] = round(started, 2)  # imports, data, model: up to the first round
    measured["first_round_seconds"] = round(first, 2)  # the recording made in it
    laps = [first]
    while len(laps) < WARMUP_ROUNDS + TIMED_ROUNDS and left() > 2 * laps[-1]:
        laps.append(timed(next_round))
    timed_laps = laps[WARMUP_ROUNDS:] or laps[-1:]
    measured["seconds_per_seed_round"] = round(statistics.median(timed_laps) / seeds, 5)
    measured["timed_rounds"] = len(timed_laps)
    print(
        f"profile {label}: {measured['seconds_per_seed_round']:.4f} s per seed-round alone "
        f"({len(timed_laps)} rounds timed after {len(laps) - len(timed_laps)}); set up in "
        f"{measured['start_seconds']:.1f} s from the process's start, the first round {first:.1f} s",
        flush=True,
    )
    round_seconds = statistics.median(timed_laps)
    if left() > 20 * round_seconds:  # an evaluation personalizes 20 clients a seed for tens of steps
        evaluation = timed(lambda: evaluate_on_ranks(fabric, runs, cfg.personalization, engine))
        measured["evaluation_seconds"] = round(evaluation, 2)
        print(f"profile {label}: one evaluation of the {seeds} seeds' new clients took {evaluation:.1f} s")
    print(MEASURED + json.dumps(measured), flush=True)
    if left() > 3 * round_seconds:
        kernels, device_seconds = _top_kernels(next_round, cuda, top)
        measured["top_kernels"] = kernels
        measured["profiled_seconds"] = device_seconds
        _print_kernels(label, kernels, device_seconds, cuda)
    if "profiled_seconds" in measured and left() > 5 * round_seconds + 5:
        _print_rates(label, measured, cfg, fabric, runs, round_number + 1)
    return measured


def _top_kernels(run_round, cuda: bool, top: int) -> tuple[list[dict], float]:
    """One round under torch.profiler: the ``top`` kernels (a CPU's operators) by their own time, and
    the round's total of it in seconds."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_round()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        time_of = lambda e: e.self_device_time_total  # noqa: E731
    else:
        events = list(prof.key_averages())
        time_of = lambda e: e.self_cpu_time_total  # noqa: E731
    total = sum(time_of(e) for e in events) or 1
    events.sort(key=time_of, reverse=True)
    kernels = [
        {
            "name": e.key[:80],
            "calls": e.count,
            "ms": round(time_of(e) / 1e3, 3),
            "share": round(time_of(e) / total, 4),
        }
        for e in events[:top]
    ]
    return kernels, total / 1e6


def _print_kernels(label: str, kernels: list[dict], seconds: float, cuda: bool) -> None:
    print(
        f"profile {label}: one round, {seconds * 1e3:.1f} ms of {'device' if cuda else 'host'} time; "
        f"its top {len(kernels)} {'kernels' if cuda else 'operators'}:"
    )
    for kernel in kernels:
        print(f"  {kernel['share']:6.1%} {kernel['ms']:9.3f} ms {kernel['calls']:6d}×  {kernel['name']}")


def _print_rates(label: str, measured: dict, cfg, fabric, runs: list, round_number: int) -> None:
    """A round's bytes and kernels counted eagerly (fedmeta.census) and its FLOPs one seed at a
    time, over the profiled round's time."""
    from fedmeta.bench import flop_counter
    from fedmeta.census import Census
    from fedmeta.engine import Engine
    from fedmeta.rounds import federated_rounds

    eager = Engine(cfg.federation.vectorize, cfg.federation.client_threads, cfg.federation.vectorize_lanes)
    census = Census()
    with census:
        federated_rounds(runs, round_number, cfg.federation.clients_per_round, engine=eager)
    with flop_counter() as flops:  # a dispatch mode sees only its own thread: one seed, sequentially
        federated_rounds(runs[:1], round_number + 1, cfg.federation.clients_per_round, engine=Engine())
    seconds = measured["profiled_seconds"]
    gbytes = sum(census.bytes.values()) / 1e9
    tflop = flops.get_total_flops() * len(runs) / 1e12
    measured.update(
        kernels=sum(census.kernels.values()),
        gbytes=round(gbytes, 2),
        gb_per_s=round(gbytes / seconds, 1),
        tflop_per_s=round(tflop / seconds, 3),
    )
    print(
        f"profile {label}: {measured['kernels']} kernels, {gbytes:.1f} GB read and written, "
        f"{tflop * 1e3:.0f} GFLOP a round: {measured['gb_per_s']} GB/s and {measured['tflop_per_s']} TFLOP/s "
        "achieved over the profiled round's time",
        flush=True,
    )
