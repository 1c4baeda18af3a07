"""``fedmeta bench`` / ``make bench``: how fast and how big each method's federated round is.

For every row of ``configs/bench.yaml`` (data set × method, plus the authors' variant and bf16
rows) a fresh process sets the run up as ``fedmeta train`` would, times rounds after a warm-up,
counts one round's FLOPs with ``torch.utils.flop_counter``, times the shared test-time
personalization, counts one round's dispatched operators (and on a GPU its kernel launches, with
``torch.profiler``) and reports its peak resident memory. The fp32 matmul peak of the device each
row ran on (and its TF32 and bf16 peaks) is measured in the same run, so GFLOP/s reads as a
fraction of that device's peak. A row names how its clients ran — one at a time, vmapped, or
vmapped with the round recorded (``federation.capture``) — and the eager and recorded rows of one
run are compared. Rows go to ``results/bench.json`` as they finish.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from fedmeta.config import CONFIG_DIR
from fedmeta.errors import FedmetaError

QUIET = ["wandb.mode=disabled"]
PROFILE_TOP = 8


def matmul_peak_gflops(
    size: int,
    dtype: torch.dtype = torch.float32,
    repeats: int = 10,
    device: torch.device = torch.device("cpu"),
    matmul_precision: str = "highest",
) -> float:
    """Best achieved GFLOP/s of a square matmul: the device's practical peak at this precision
    (``matmul_precision=high``: float32 matmuls on TF32 tensor cores)."""
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            synchronize()
            tick = time.perf_counter()
            torch.mm(a, b)
            synchronize()
            best = min(best, time.perf_counter() - tick)
    finally:
        torch.set_float32_matmul_precision(before)
    return 2 * size**3 / best / 1e9


def device_peaks(device: torch.device, size: int) -> dict:
    """A device's matmul peaks in GFLOP/s: fp32, TF32 (CUDA only) and bf16."""
    # a CPU without bf16 units runs bf16 matmuls at ~1 GFLOP/s: a large one would take minutes
    bf16_size = size if device.type == "cuda" else min(size, 1024)
    peaks = {
        "fp32": matmul_peak_gflops(size, device=device),
        "bf16": matmul_peak_gflops(bf16_size, torch.bfloat16, device=device),
    }
    if device.type == "cuda":
        peaks["tf32"] = matmul_peak_gflops(size, device=device, matmul_precision="high")
    return peaks


LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)


class _OperatorCount:
    """Counts the operators dispatched while it is active (a dispatch mode sees them below vmap's
    batching: the operators that really run)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.calls += 1
                return func(*args, **(kwargs or {}))

        self.calls, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


class HostReads(TorchFunctionMode):
    """Counts the reads of a computed value by the host (``float(t)``, ``t.item()``, ``bool(t)``,
    ``t.tolist()``…): on a GPU each one waits for the device to finish everything queued before it.
    Integer tensors on the CPU are not counted: there they are the host's own data (the round's
    client sample), not values the computation produced."""

    READS = {"__float__", "__bool__", "__int__", "__index__", "item", "tolist", "numpy"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS and args and isinstance(args[0], torch.Tensor):
            tensor = args[0]
            if tensor.device.type != "cpu" or tensor.is_floating_point() or tensor.dtype == torch.bool:
                self.count += 1
        return func(*args, **(kwargs or {}))


def count_calls(run_round, device: torch.device) -> dict:
    """One round's dispatched operators — the host work a recorded round saves (a replayed graph
    dispatches none) — and its host reads of computed values (``HostReads``: each a sync on a GPU),
    and on a GPU a second round's kernel and graph launches (torch.profiler)."""
    with _OperatorCount() as ops, HostReads() as reads:
        run_round()
    counts = {"ops_per_round": ops.calls, "host_reads_per_round": reads.count}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_round()
        counts["launches_per_round"] = sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)
    return counts


class _GlobalCountsOnly:
    """Stands in for FlopCounterMode's module tracker, whose per-module hooks on the autograd graph
    break ``autograd.grad`` over leaf parameters (every inner loop here); totals are all we report."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def flop_counter() -> FlopCounterMode:
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _GlobalCountsOnly()
    return counter


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def profile_round(run_round) -> list[dict]:
    """Where one round's time goes: the operators with the most self time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run_round()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [
        {"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:PROFILE_TOP]
    ]


def device_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds a call takes, the device's queued work included (synchronized on a GPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        sync()
        tick = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - tick

    return timed


def stacked_runs(overrides: list[str]) -> tuple[DictConfig, object, list]:
    """The config of ``overrides`` (loggers off), its Fabric, and one ``Federated`` per seed, set up
    as ``fedmeta train`` sets them up (``seeds=[…]``: several, stepped in lockstep)."""
    from fedmeta.assemble import build, make_fabric, seed_configs
    from fedmeta.config import compose
    from fedmeta.rounds import Federated

    cfg = compose([*overrides, *QUIET])
    fabric = make_fabric(cfg)
    runs = [
        Federated(algorithm, federation, one.seed)
        for one in seed_configs(cfg)
        for federation, algorithm in [build(fabric, one)]
    ]
    return cfg, fabric, runs


def measure_round(
    overrides: list[str],
    warmup: int,
    rounds: int,
    personalize_clients: int,
    profile: bool = False,
    full_evaluation: bool = False,
    count_flops: bool = True,
) -> dict:
    """One row, in the calling process: seconds and FLOPs per round (per seed, with stacked seeds),
    personalization seconds per new client, optionally one whole evaluation (every new client,
    every step), peak memory. Meant to run in a fresh process (``run_isolated``)."""
    from fedmeta.assemble import make_engine
    from fedmeta.engine import Engine
    from fedmeta.fastest import hardware_name
    from fedmeta.rounds import Federated, evaluate_on_ranks, federated_rounds

    cfg, fabric, runs = stacked_runs(overrides)
    fed, engine = cfg.federation, make_engine(cfg, fabric.device)
    timed = device_timer(fabric.device)

    def round_(r: int, run_engine: Engine = engine) -> None:
        federated_rounds(runs, r, fed.clients_per_round, engine=run_engine)

    seconds = [timed(lambda r=r: round_(r)) for r in range(1, warmup + rounds + 1)][warmup:]
    calls = count_calls(lambda: round_(warmup + rounds + 1), fabric.device)
    gflop = float("nan")
    if count_flops:
        with (
            flop_counter() as flops
        ):  # a dispatch mode sees only its own thread: count one seed's sequential round
            timed(
                lambda: federated_rounds(
                    runs[:1], warmup + rounds + 2, fed.clients_per_round, engine=Engine()
                )
            )
        gflop = flops.get_total_flops() / 1e9
    first = runs[0]
    some = Federated(first.algorithm, _first_new_clients(first.federation, personalize_clients), first.seed)
    evaluate_on_ranks(fabric, [some], cfg.personalization, engine)  # warm-up: kernel selection, allocations
    personalize = timed(lambda: evaluate_on_ranks(fabric, [some], cfg.personalization, engine))
    evaluation = {}
    if full_evaluation:
        evaluation["evaluation_seconds"] = timed(
            lambda: evaluate_on_ranks(fabric, runs, cfg.personalization, engine)
        )
    seconds_per_round = statistics.median(seconds) / len(runs)
    extra = {"profile": profile_round(lambda: round_(warmup + rounds + 3))} if profile else {}
    ran = engine.describe()
    return {
        **extra,
        "dataset": cfg.dataset.name,
        "partition": cfg.partition.name,
        "method": cfg.method.name,
        "variant": cfg.variant,
        "precision": cfg.fabric.precision,
        "matmul_precision": cfg.fabric.matmul_precision,
        "client_threads": fed.client_threads,
        "lane_buckets": fed.lane_buckets,
        "clients": "vmap" if ran["vectorized"] else "sequential",
        "capture": ran["capture"] if ran["recorded"] or ran["capture"] == "static" else "none",
        "fallback": ran["fallback"],
        "seeds": len(runs),
        "seconds_per_round": seconds_per_round,
        "gflop_per_round": gflop,
        "gflops": gflop / seconds_per_round,
        "personalize_seconds_per_client": personalize / personalize_clients,
        **evaluation,
        "new_clients": sum(len(r.federation.new_clients) for r in runs),
        **{k: v / len(runs) for k, v in calls.items()},
        "peak_rss_mb": peak_rss_mb(),
        "device": fabric.device.type,
        "hardware": hardware_name(fabric.device),
    }


def _first_new_clients(federation, count: int):
    """A view of ``federation`` whose new clients are its first ``count``."""
    import copy

    view = copy.copy(federation)
    view.new_clients = federation.new_clients[:count]
    return view


def measure_memory(overrides: list[str], rounds: int) -> dict:
    """Peak memory of a run with ``federation.num_clients`` clients: set up, ``rounds`` rounds,
    personalize two new clients. Also what the data and any per-client state take."""
    from fedmeta.assemble import make_engine, setup
    from fedmeta.config import compose
    from fedmeta.evaluation import personalize_client
    from fedmeta.rounds import federated_round

    cfg = compose([*overrides, *QUIET])
    fabric, federation, algorithm = setup(cfg)
    for r in range(1, rounds + 1):
        federated_round(
            algorithm,
            federation,
            r,
            cfg.federation.clients_per_round,
            cfg.seed,
            engine=make_engine(cfg, fabric.device),
        )
    for client in federation.new_clients[:2]:
        personalize_client(algorithm, client, cfg.personalization)
    states = algorithm.client_states
    state_bytes = sum(_nbytes(state) for state in states.values())
    return {
        "dataset": cfg.dataset.name,
        "partition": cfg.partition.name,
        "method": cfg.method.name,
        "variant": cfg.variant,
        "num_clients": cfg.federation.num_clients,
        "samples_per_client": len(federation.x) // cfg.federation.num_clients,
        "data_mb": (federation.x.nbytes + federation.y.nbytes) / 2**20,
        "model_mb": sum(p.nbytes for p in algorithm.parameters()) / 2**20,
        "clients_with_state": len(states),
        "state_mb_per_client": state_bytes / len(states) / 2**20 if states else 0.0,
        "peak_rss_mb": peak_rss_mb(),
    }


def _nbytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    return sum(_nbytes(v) for v in tree.values()) if isinstance(tree, dict) else 0


def speedups(rows: list[dict]) -> list[dict]:
    """Each non-sequential row's speed-up over the sequential one-seed row of the same data set,
    method, variant, precision and client threads — seconds per round (per seed), per personalized
    client and per whole evaluation (per seed) — and a recorded row's over the eager vmapped row of
    the same seeds (``vs_eager``). All come from the same bench run."""
    key = ("dataset", "partition", "method", "variant", "precision", "matmul_precision", "client_threads")
    baseline: dict[tuple, dict] = {}
    eager: dict[tuple, dict] = {}
    for r in rows:
        if (
            r["clients"] == "sequential" and r["seeds"] == 1
        ):  # the first: a vmap row that fell back is sequential too
            baseline.setdefault(tuple(r.get(k) for k in key), r)
        if r["clients"] == "vmap" and r["capture"] == "none":
            eager.setdefault((*(r.get(k) for k in key), r["seeds"], r.get("lane_buckets", 1)), r)
    result = []
    for row in rows:
        base = baseline.get(tuple(row.get(k) for k in key))
        if base is None or (row["clients"] == "sequential" and row["seeds"] == 1):
            continue
        ratio = {
            "round": base["seconds_per_round"] / row["seconds_per_round"],
            "personalize": base["personalize_seconds_per_client"] / row["personalize_seconds_per_client"],
        }
        if "evaluation_seconds" in row and "evaluation_seconds" in base:
            ratio["evaluation"] = (base["evaluation_seconds"] / base["new_clients"]) / (
                row["evaluation_seconds"] / row["new_clients"]
            )
        same = eager.get((*(row.get(k) for k in key), row["seeds"], row.get("lane_buckets", 1)))
        if row["capture"] != "none" and same is not None:
            ratio["vs_eager"] = same["seconds_per_round"] / row["seconds_per_round"]
        result.append(
            {
                **{k: row.get(k) for k in key},
                "lane_buckets": row.get("lane_buckets", 1),
                "clients": row["clients"],
                "capture": row["capture"],
                "seeds": row["seeds"],
                **ratio,
            }
        )
    return result


def fastest(rows: list[dict], new_clients: int) -> tuple[float, float]:
    """The seconds of a round and of one evaluation of ``new_clients``, the fastest of bench rows."""
    per_client = min(
        r["evaluation_seconds"] / r["new_clients"]
        if "evaluation_seconds" in r
        else r["personalize_seconds_per_client"]
        for r in rows
    )
    return min(r["seconds_per_round"] for r in rows), per_client * new_clients


def project(result: dict, preset_name: str) -> list[str]:
    """Projected wall time of ``make table PRESET=preset_name`` on the machine of ``result``: per
    table setting whose data set was benched, every method × seed at its fastest measured way
    (sequential, vmap or stacked seeds; fp32), rounds × s/round per seed plus the preset's
    evaluations × one evaluation of the new clients. Partitions of one data set are costed alike."""
    from fedmeta.config import compose
    from fedmeta.grid import load_preset, preset_budget, setting_dataset

    preset = load_preset(preset_name)
    lines, total = [], 0.0
    for name, setting in preset.settings.items():
        if setting.grid != "table":
            continue
        dataset = setting_dataset(setting)
        rounds, evaluations = preset_budget(preset, dataset)
        new_clients = compose([f"dataset={dataset}"]).federation.num_new_clients
        seconds, missing = 0.0, []
        for method in preset.methods:
            rows = [
                r
                for r in result["rows"]
                if r["dataset"] == dataset
                and r["method"] == method
                and r["variant"] == "paper"
                and r["precision"] == "32-true"
                and r.get("matmul_precision", "highest") == "highest"
                and r["client_threads"] == 1
            ]
            if not rows:
                missing.append(method)
                continue
            per_round, evaluation = fastest(rows, new_clients)
            seconds += len(preset.seeds) * (rounds * per_round + evaluations * evaluation)
        total += seconds
        note = f" (not measured: {', '.join(missing)})" if missing else ""
        lines.append(f"{name}: {seconds / 3600:.1f} h{note}" if seconds else f"{name}: not measured")
    hardware = sorted({r["hardware"] for r in result["rows"]}) or ["?"]
    lines.append(f"total of the measured settings: {total / 3600:.1f} h on {', '.join(hardware)}")
    return lines


def run_isolated(fn, *args):
    """``fn(*args)`` in a fresh process (spawned, so nothing is inherited): its own peak memory."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


CLIENTS = {  # how a row runs a round's clients (configs/bench.yaml: clients)
    "sequential": ["federation.vectorize=false", "federation.capture=none"],
    "vmap": ["federation.vectorize=true", "federation.capture=none"],
    "static": ["federation.vectorize=true", "federation.capture=static"],  # the recorded layout, run eagerly
    "graph": ["federation.vectorize=true", "federation.capture=graph"],  # CUDA graphs
}


def plan(
    bench: DictConfig, datasets: list[str] | None, methods: list[str] | None, extra: list[str]
) -> list[dict]:
    """Every timing row: per data set, each method (and extra row) once per way of running clients
    (``bench.clients``), then the stacked-seed rows. A row: its overrides, and whether it also
    times a whole evaluation."""
    rows = []
    for name, setting in bench.datasets.items():
        if datasets and name not in datasets:
            continue
        variants = [[f"method={m}"] for m in methods or bench.methods]
        variants += [list(r) for r in bench.extra_rows if not methods or r[0].split("=", 1)[1] in methods]
        for variant in variants:
            evaluate = len(variant) == 1 and variant[0].split("=", 1)[1] in bench.evaluation_methods
            rows += [
                {"overrides": [*setting, *variant, *CLIENTS[way], *extra], "evaluate": evaluate}
                for way in bench.clients
            ]
        rows += [
            {"overrides": [*setting, *list(r), *extra], "evaluate": False}
            for r in bench.seed_rows
            if not methods or r[0].split("=", 1)[1] in methods
        ]
    return rows


def memory_plan(bench: DictConfig, extra: list[str]) -> list[list[str]]:
    memory = bench.memory
    variants = [[f"method={m}"] for m in memory.methods] + [list(r) for r in memory.extra_rows]
    return [
        [*memory.overrides, *v, f"federation.num_clients={n}", *extra]
        for v in variants
        for n in memory.num_clients
    ]


def checked_bench(config: Path, datasets: list[str] | None, methods: list[str] | None) -> DictConfig:
    """The bench config at ``config``, once ``--datasets`` and ``--methods`` are known to name its
    data sets and real methods (one line otherwise)."""
    from fedmeta.config import group_choices, load_mapping

    bench = load_mapping(config, "a bench config (see configs/bench.yaml)")
    if "datasets" not in bench:
        raise FedmetaError(
            f"{config} is not a bench config (a mapping with datasets, methods, rows: see configs/bench.yaml)"
        )
    unknown = sorted(set(datasets or ()) - set(bench.datasets))
    if unknown:
        raise FedmetaError(
            f"--datasets {' '.join(unknown)}: not a data set of {config.name}; choose from {', '.join(bench.datasets)}"
        )
    unknown = sorted(set(methods or ()) - set(group_choices("method")))
    if unknown:
        raise FedmetaError(
            f"--methods {' '.join(unknown)}: no such method; choose from {', '.join(group_choices('method'))}"
        )
    return bench


def _clients(row: dict) -> str:
    """How a row ran its clients: sequential, vmap, vmap in k size buckets, recorded."""
    way = row["clients"] if row["capture"] == "none" else f"{row['clients']}+{row['capture']}"
    return way + (f"/{row['lane_buckets']}b" if row.get("lane_buckets", 1) > 1 else "")


def _setting(row: dict) -> str:
    return f"{row['dataset']}/{row['partition']}" if row.get("partition") else row["dataset"]


ROW_HEADER = (
    f"{'setting':17s} {'method':10s} {'variant':8s} {'precision':10s} {'cl.thr':>6s} {'clients':>10s} "
    f"{'seeds':>5s} "
    f"{'s/round':>8s} {'GFLOP':>7s} {'GFLOP/s':>8s} {'% peak':>6s} {'ops/rnd':>8s} {'reads':>5s} {'launch':>7s} "
    f"{'pers s/cl':>9s} "
    f"{'eval s':>7s} {'peak MB':>8s}"
)


def _row_line(row: dict) -> str:
    """A measured row as a line under ``ROW_HEADER``."""
    evaluation = f"{row['evaluation_seconds']:7.1f}" if "evaluation_seconds" in row else f"{'-':>7s}"
    launches = f"{row['launches_per_round']:7.0f}" if "launches_per_round" in row else f"{'-':>7s}"
    return (
        f"{_setting(row):17s} {row['method']:10s} {row['variant']:8s} {row['precision']:10s} "
        f"{row['client_threads']:6d} {_clients(row):>13s} {row['seeds']:5d} {row['seconds_per_round']:8.3f} "
        f"{row['gflop_per_round']:7.1f} {row['gflops']:8.1f} {100 * row['peak_fraction']:6.1f} "
        f"{row['ops_per_round']:8.0f} {row['host_reads_per_round']:5.0f} {launches} "
        f"{row['personalize_seconds_per_client']:9.2f} {evaluation} "
        f"{row['peak_rss_mb']:8.0f}"
    )


def _print_speedups(rows: list[dict]) -> None:
    if not rows:
        return
    print(
        f"\n{'setting':17s} {'method':10s} {'variant':8s} {'precision':10s} {'clients':>13s} {'seeds':>5s} "
        f"{'round ×':>8s} {'pers ×':>7s} {'eval ×':>7s} {'vs eager':>8s}   (sequential ÷ this; vs eager: vmapped "
        "eager ÷ this; > 1 is faster)"
    )
    for s in rows:
        cells = [
            f"{s[key]:{width}.2f}" if s.get(key) else f"{'-':>{width}s}"
            for key, width in (("round", 8), ("personalize", 7), ("evaluation", 7), ("vs_eager", 8))
        ]
        print(
            f"{_setting(s):17s} {s['method']:10s} {s['variant']:8s} {s['precision']:10s} {_clients(s):>13s} "
            f"{s['seeds']:5d} {' '.join(cells)}"
        )


def _peak(result: dict, kind: str, matmul_size: int) -> float:
    """The fp32 matmul peak of a row's device, measured here once per device kind (kept in ``result``)."""
    from fedmeta.fastest import hardware_name

    if kind not in result["peaks"]:
        device = torch.device(kind)
        result["peaks"][kind] = {"hardware": hardware_name(device), **device_peaks(device, matmul_size)}
        shown = ", ".join(
            f"{name} {value:.0f}" for name, value in result["peaks"][kind].items() if name != "hardware"
        )
        print(f"{result['peaks'][kind]['hardware']}: matmul peaks (GFLOP/s) {shown}", flush=True)
    return result["peaks"][kind]["fp32"]


def _save(result: dict, out: Path) -> None:
    """The rows so far, atomically (a bench cut short by a lease's end keeps its rows); a bench that
    measured nothing leaves an earlier result as it is."""
    if not result["rows"] and not result["memory"]:
        print(f"no row was measured: {out} left as it was")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}", flush=True)


def _memory_rows(memory_rows: list[list[str]], rounds: int) -> list[dict]:
    """Each memory row measured in a process of its own, printed as it finishes."""
    print(
        f"\n{'clients':>8s} {'method':8s} {'variant':8s} {'img/client':>10s} {'data MB':>8s} "
        f"{'state MB/client':>15s} {'peak MB':>8s}"
    )
    measured = []
    for overrides in memory_rows:
        row = run_isolated(measure_memory, overrides, rounds)
        measured.append(row)
        print(
            f"{row['num_clients']:8d} {row['method']:8s} {row['variant']:8s} {row['samples_per_client']:10d} "
            f"{row['data_mb']:8.0f} {row['state_mb_per_client']:15.2f} {row['peak_rss_mb']:8.0f}",
            flush=True,
        )
    return measured


def run(
    datasets: list[str] | None = None,
    methods: list[str] | None = None,
    extra: list[str] = (),
    memory: bool = True,
    out: Path = Path("results/bench.json"),
    config: Path = CONFIG_DIR / "bench.yaml",
    profile: bool = False,
    projection: str | None = None,
) -> dict:
    from fedmeta.config import compose

    bench = checked_bench(config, datasets, methods)
    rows = plan(bench, datasets, methods, list(extra))
    if not rows and not (memory and bench.memory.num_clients):
        raise FedmetaError(f"no row of {config.name} is for these data sets and methods: nothing to measure")
    memory_rows = memory_plan(bench, list(extra)) if memory else []
    if projection:
        from fedmeta.grid import load_preset

        load_preset(projection)  # an unknown preset: one line before anything runs
    from fedmeta.assemble import check_accelerator

    for overrides in [
        row["overrides"] for row in rows
    ] + memory_rows:  # bad names or values, a GPU this machine lacks: one line before anything runs
        check_accelerator(compose([*overrides, *QUIET]))
    result = {"peaks": {}, "rows": [], "memory": []}

    def peak(kind: str) -> float:
        return _peak(result, kind, bench.matmul_size)

    peak("cpu")
    print(ROW_HEADER)
    for plan_row in rows:
        overrides = plan_row["overrides"]
        try:
            row = run_isolated(
                measure_round,
                overrides,
                bench.warmup_rounds,
                bench.rounds,
                bench.personalize_clients,
                profile,
                plan_row["evaluate"],
                bench.get("count_flops", True),
            )
        except FedmetaError as exc:  # e.g. a data set not on this machine: the other rows still count
            result.setdefault("skipped", []).append({"overrides": overrides, "reason": str(exc)})
            print(f"skipped {' '.join(overrides)}: {exc}", flush=True)
            continue
        row["peak_fraction"] = row["gflops"] / peak(row["device"])  # of the fp32 peak of the device it ran on
        result["rows"].append(row)
        print(_row_line(row), flush=True)
        if row["fallback"]:
            print(f"    fell back: {row['fallback']}")
        _save(result, out)
        for op in row.get("profile", []):
            print(f"    {100 * op['share']:5.1f} %  {op['op']} ×{op['calls']}")
    result["speedups"] = speedups(result["rows"])
    _print_speedups(result["speedups"])
    if memory_rows:
        result["memory"] = _memory_rows(memory_rows, bench.memory.rounds)
    if projection:
        result["projection"] = {"preset": projection, "lines": project(result, projection)}
        print(f"\nprojected wall time of make table PRESET={projection}, one run at a time on this machine:")
        print("\n".join(f"  {line}" for line in result["projection"]["lines"]))
    _save(result, out)
    return result
