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
   time, as achieved GB/s and TFLOP/s;
5. with a partner (``fedmeta.campaign.fill_partner``: the same method on the same data in another
   setting), whether one process fills the card better than one unit at a time: the partner's rounds
   timed alone, then both units' seeds as the lanes of one vmapped round, then (a card's only) each
   unit's rounds on a CUDA stream of its own from a thread of its own — per seed-round, the three
   side by side. A card time-slices processes, so what fills it must share a process.

Each step prints as it ends (to the job's log, which ``fedmeta campaign --collect`` keeps in
``results/gpu/jobs/``); ``MEASURED`` starts the one line, a JSON object, that ``results/campaign.md``
reads its speed and evaluation time from (``fedmeta.campaign.alone_records``); ``FILL`` starts step
5's, the input of the choice between one unit at a time and several in one process, which
``results/campaign.md`` lists (``fedmeta.campaign.fill_records``; docs/reproducing.md).
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import torch

from fedmeta.bench import device_timer, stacked_runs
from fedmeta.campaign import FILL, MEASURED
from fedmeta.clock import RoundClock
from fedmeta.errors import FedmetaError
from fedmeta.stopping import process_seconds

TOP_KERNELS = 20
WARMUP_ROUNDS = 3  # the recording is made in the first rounds (fedmeta.capture)
TIMED_ROUNDS = 5


def profile_unit(
    label: str,
    preset: str,
    overrides: list[str],
    seconds: float,
    top: int = TOP_KERNELS,
    partner: tuple[str, list[str]] | None = None,
) -> dict:
    """Steps 1–5 above for ``preset``'s unit ``label`` (its runs' ``overrides``; ``partner``: step 5's
    unit, as a label and overrides), within ``seconds`` from now; returns what was measured (steps not
    reached are absent). Bounded by ``seconds``: past them it raises, saying so."""
    deadline = time.monotonic() + seconds
    with _bounded(seconds, label):
        print(f"profile {label}: setting up its runs (data, model; {seconds:.0f} s in all) …", flush=True)
        return _profile(label, preset, overrides, deadline, top, partner)


@contextlib.contextmanager
def _bounded(seconds: float, label: str):
    """Ends what runs inside after ``seconds`` (between two operators: a CPU's first round can
    outlast a whole budget) with one line saying so; what was measured was printed as it ended."""

    def ran_out(*_):
        raise FedmetaError(
            f"profile {label}: its {seconds:.0f} s ran out; what it measured is above (none: a first "
            "round here takes longer, give it more seconds)"
        )

    previous = signal.signal(signal.SIGALRM, ran_out)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _profile(label, preset, overrides, deadline, top, partner) -> dict:
    from fedmeta.assemble import make_engine
    from fedmeta.fastest import hardware_name
    from fedmeta.rounds import evaluate_on_ranks, federated_rounds, scored_clients

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

    print(f"profile {label}: set up {started:.1f} s after the process started; its first round …", flush=True)
    clock = RoundClock()
    first = timed(next_round)
    measured["start_seconds"] = round(started, 2)  # imports, data, model: up to the first round
    measured["first_round_seconds"] = round(first, 2)  # the recording made in it
    laps = [first]
    while len(laps) < WARMUP_ROUNDS + TIMED_ROUNDS and left() > 2 * laps[-1]:
        laps.append(timed(next_round))
    beside = clock.read()[1]
    if beside is not None:  # the cores other processes kept busy during its rounds (fedmeta.clock)
        measured["beside_cores"] = beside
    timed_laps = laps[WARMUP_ROUNDS:] or laps[-1:]
    measured["seconds_per_seed_round"] = round(statistics.median(timed_laps) / seeds, 5)
    measured["timed_rounds"] = len(timed_laps)
    print(
        f"profile {label}: {measured['seconds_per_seed_round']:.4f} s per seed-round alone "
        f"({len(timed_laps)} rounds timed after {len(laps) - len(timed_laps)}); set up in "
        f"{measured['start_seconds']:.1f} s from the process's start, the first round {first:.1f} s; "
        f"{beside if beside is not None else 'unknown'} cores busy beside its rounds",
        flush=True,
    )
    round_seconds = statistics.median(timed_laps)
    protocol = cfg.evaluation.protocol  # the runs' own: the training clients' too where they score them
    scored, _ = scored_clients(runs, protocol, fabric.global_rank, fabric.world_size)
    if left() > scored / seeds * round_seconds:  # a client personalized for tens of steps: about a round
        evaluation = timed(
            lambda: evaluate_on_ranks(fabric, runs, cfg.personalization, engine, protocol=protocol)
        )
        measured["evaluation_seconds"] = round(evaluation, 2)
        print(
            f"profile {label}: one evaluation ({protocol}) of the {seeds} seeds' clients took {evaluation:.1f} s"
        )
    print(MEASURED + json.dumps(measured), flush=True)
    if left() > 3 * round_seconds:
        kernels, device_seconds = _top_kernels(next_round, cuda, top)
        measured["top_kernels"] = kernels
        measured["profiled_seconds"] = device_seconds
        _print_kernels(label, kernels, device_seconds, cuda)
    if "profiled_seconds" in measured and left() > 5 * round_seconds + 5:
        _print_rates(label, measured, cfg, fabric, runs, round_number + 1)
        round_number += 2
    if partner is not None and left() > 2 * first + 2 * (WARMUP_ROUNDS + TIMED_ROUNDS) * round_seconds:
        fill = _fill(label, partner, cfg, runs, (engine, first, round_seconds), round_number + 1, left, timed)
        if fill is not None:
            measured["fill"] = fill
            print(
                FILL + json.dumps({key: measured[key] for key in ("date", "hardware", "preset")} | fill),
                flush=True,
            )
    return measured


def _fill(
    label: str, partner: tuple[str, list[str]], cfg, runs: list, timed_alone, first_round: int, left, timed
):
    """Step 5: the partner's rounds alone, the unit's again, both units as lanes (the unit's method
    settings for all: a proxy where the partner's differ), then on two streams (a card's); each
    timed after the rounds that make its recordings, over the same round numbers. A way whose timed
    rounds recorded again, fell back, or dropped a client is not counted (why, in ``notes``).
    ``timed_alone``: the unit's engine, its first round's and a round's seconds (step 1). None where
    the two cannot share rounds or the partner cannot be set up."""
    from fedmeta.assemble import make_engine
    from fedmeta.rounds import federated_rounds

    partner_label, partner_overrides = partner
    engine, first, round_seconds = timed_alone
    try:
        partner_cfg, fabric, partner_runs = stacked_runs(partner_overrides)
    except Exception as exc:  # noqa: BLE001 — the step is a measurement: what failed is said, not raised
        print(f"fill {label}: {partner_label} could not be set up ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    clients = cfg.federation.clients_per_round
    if partner_cfg.federation.clients_per_round != clients:
        print(f"fill {label}: {partner_label} trains another number of clients a round: not measured")
        return None
    cuda = fabric.device.type == "cuda"
    ways = _Ways(first_round, left, timed)
    partner_engine = make_engine(partner_cfg, fabric.device)
    alone = ways.time(
        "partner",
        lambda r: federated_rounds(partner_runs, r, clients, engine=partner_engine),
        [partner_engine],
        (first, round_seconds),
    )
    # the unit again, recorded already (step 1): its time alone at the same moment as the others'
    mine = ways.time(
        "unit", lambda r: federated_rounds(runs, r, clients, engine=engine), [engine], (0, round_seconds), 1
    )
    both = runs + partner_runs
    lanes_engine = make_engine(cfg, fabric.device)
    lanes = ways.time(
        "lanes",
        lambda r: federated_rounds(both, r, clients, engine=lanes_engine),
        [lanes_engine],
        (2 * first, 2 * round_seconds),
    )
    streams = None
    if cuda and alone is not None and mine is not None:
        try:  # only rounds both engines have run: no recording while the other stream works
            pair = [(runs, engine), (partner_runs, partner_engine)]
            seen = min(ways.ran["partner"] - WARMUP_ROUNDS + 1, ways.ran["unit"])
            streams = ways.time(
                "streams",
                _two_streams(pair, clients),
                [engine, partner_engine],
                (0, 2 * round_seconds),
                1,
                seen,
            )
        except Exception as exc:  # noqa: BLE001 — untried on every card: what failed is the finding
            ways.notes.append(f"streams: {type(exc).__name__}: {str(exc)[:200]}")
    seeds = len(both)

    def per_seed(lap: float | None) -> float | None:
        return None if lap is None else round(lap / seeds, 5)

    fill = {
        "unit": label,
        "partner": partner_label,
        "seeds": [len(runs), len(partner_runs)],
        "one_after_the_other": per_seed(None if alone is None or mine is None else alone + mine),
        "lanes": per_seed(lanes),
        "streams": per_seed(streams),
        "notes": ways.notes,
    }
    _print_fill(fill, cuda)
    return fill


def _print_fill(fill: dict, cuda: bool) -> None:
    said = {key: "not measured" if fill[key] is None else f"{fill[key]:.4f}" for key in list(fill)[3:6]}
    notes = fill["notes"]
    print(
        f"fill {fill['unit']} + {fill['partner']}, s per seed-round: {said['one_after_the_other']} one unit "
        f"after the other, {said['lanes']} as lanes of one round, "
        + (f"{said['streams']} on two CUDA streams" if cuda else "two CUDA streams: a card's only")
        + (f" ({'; '.join(notes)})" if notes else ""),
        flush=True,
    )


class _Ways:
    """Step 5's timings: each way over the same round numbers (the same clients: with clients of
    different sizes a round's lanes are padded to its largest), and why a way was not counted."""

    def __init__(self, first_round: int, left, timed):
        self.first_round, self.left, self.timed = first_round, left, timed
        self.notes: list[str] = []
        self.ran: dict[str, int] = {}  # rounds each way ran, from first_round + WARMUP_ROUNDS − its warm-up

    def time(
        self, way: str, one_round, engines: list, needs: tuple, warmup: int = WARMUP_ROUNDS, most: int = 0
    ) -> float | None:
        """The median of the timed rounds after ``warmup`` (the ones that record), ``most`` rounds in
        all at most (0: as many as are timed); None if the time ran out first or the timed rounds were
        not the steady state (they recorded again, fell back or dropped a client). ``needs``: the
        first round's seconds (its recording) and a round's, as step 1 measured them."""
        recording, a_round = needs
        if self.left() < recording + (warmup + 1) * a_round:
            self.notes.append(f"{way}: not begun, {self.left():.0f} s left")
            return None
        start = self.first_round + WARMUP_ROUNDS - warmup
        numbers = iter(range(start, self.first_round + WARMUP_ROUNDS + TIMED_ROUNDS))
        most = min(most or warmup + TIMED_ROUNDS, warmup + TIMED_ROUNDS)
        dropped: list[str] = []

        def lap() -> float:
            outcomes: list = []
            seconds = self.timed(lambda: outcomes.extend(one_round(next(numbers))))
            dropped.extend(o.error or o.dropped[0] for o in outcomes if o.error or o.dropped)
            return seconds

        made = [lap() for _ in range(max(warmup, 1))]
        steady = [_steady_state(e) for e in engines]
        while len(made) < most and self.left() > 2 * made[-1]:
            made.append(lap())
        self.ran[way] = len(made)
        if dropped or steady != [_steady_state(e) for e in engines]:
            self.notes.append(
                f"{way}: {dropped[0] if dropped else 'its timed rounds recorded again or fell back'}"
            )
            return None
        if len(made) <= warmup:
            self.notes.append(f"{way}: the time ran out after the rounds that record")
            return None
        return statistics.median(made[warmup:])


def _steady_state(engine) -> tuple:
    """What changes when a round is not a replay of what was recorded before it: a fallback, and on
    a card the recordings (a new layout) and the calls run eagerly."""
    capture = engine.capture
    if not capture.records:
        return (engine.describe()["fallback"],)
    recordings = frozenset((key, layout) for key, layouts in capture.recordings.items() for layout in layouts)
    return engine.describe()["fallback"], recordings, capture.eager


def _two_streams(units: list[tuple[list, object]], clients: int):
    """One lockstep round of each unit (its runs and engine), each from a thread of its own on a CUDA
    stream of its own, both finished when it returns: what two units sharing a process would run.
    (Their graphs were captured on one stream and so share its cuBLAS workspace: fine for timing; a
    campaign that trained this way would capture each unit's on its own stream.)"""
    from fedmeta.rounds import federated_rounds

    sides = [torch.cuda.Stream() for _ in units]
    torch.cuda.synchronize()  # what the default stream made is ready for both
    pool = ThreadPoolExecutor(len(units), thread_name_prefix="stream")

    def on_stream(side, unit_runs, unit_engine, round_: int) -> list:
        with torch.cuda.stream(side):
            return federated_rounds(unit_runs, round_, clients, engine=unit_engine)

    def side_by_side(round_: int) -> list:
        started = [pool.submit(on_stream, side, *unit, round_) for side, unit in zip(sides, units)]
        return [outcome for done in started for outcome in done.result()]

    return side_by_side


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
