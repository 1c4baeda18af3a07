"""``fedmeta bench`` / ``make bench``: how fast and how big each method's federated round is.

For every row of ``configs/bench.yaml`` (data set × method, plus the authors' variant and bf16
rows) a fresh process sets the run up as ``fedmeta train`` would, times rounds after a warm-up,
counts one round's FLOPs with ``torch.utils.flop_counter``, times the shared test-time
personalization and reports its peak resident memory. The machine's fp32 matmul peak is measured
the same way, so GFLOP/s can be read as a fraction of it. Results go to ``results/bench.json``.
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from fedmeta.config import CONFIG_DIR
from fedmeta.errors import FedmetaError

QUIET = ["wandb.mode=disabled"]
PROFILE_TOP = 8


def matmul_peak_gflops(size: int, dtype: torch.dtype = torch.float32, repeats: int = 10) -> float:
    """Best achieved GFLOP/s of a square matmul: the machine's practical peak at this precision."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - tick)
    return 2 * size**3 / best / 1e9


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
    return [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:PROFILE_TOP]]


def measure_round(overrides: list[str], warmup: int, rounds: int, personalize_clients: int, profile: bool = False) -> dict:
    """One row, in the calling process: seconds and FLOPs per round, personalization seconds per
    new client, peak memory. Meant to run in a fresh process (``run_isolated``)."""
    from fedmeta.config import compose
    from fedmeta.evaluation import evaluate_new_clients, sequential
    from fedmeta.loop import client_map, federated_round, hardware_name, setup

    cfg = compose([*overrides, *QUIET])
    fabric, federation, algorithm = setup(cfg)
    synchronize = torch.cuda.synchronize if fabric.device.type == "cuda" else (lambda: None)
    fed = cfg.federation

    def timed(fn) -> float:
        synchronize()
        tick = time.perf_counter()
        fn()
        synchronize()
        return time.perf_counter() - tick

    map_clients = client_map(fed.client_threads)

    def round_(r: int, run_clients=map_clients) -> None:
        federated_round(algorithm, federation, r, fed.clients_per_round, cfg.seed, map_clients=run_clients)

    seconds = [timed(lambda r=r: round_(r)) for r in range(1, warmup + rounds + 1)][warmup:]
    with flop_counter() as flops:  # a dispatch mode sees only its own thread: count a sequential round
        timed(lambda: round_(warmup + rounds + 1, sequential))
    new_clients = federation.new_clients[:personalize_clients]
    personalize = timed(lambda: evaluate_new_clients(algorithm, new_clients, cfg.personalization, federation.num_classes,
                                                     map_clients))
    seconds_per_round = statistics.median(seconds)
    gflop = flops.get_total_flops() / 1e9
    extra = {"profile": profile_round(lambda: round_(warmup + rounds + 2, sequential))} if profile else {}
    return {**extra, "dataset": cfg.dataset.name, "method": cfg.method.name, "variant": cfg.variant,
            "precision": cfg.fabric.precision, "client_threads": fed.client_threads, "seconds_per_round": seconds_per_round, "gflop_per_round": gflop,
            "gflops": gflop / seconds_per_round, "personalize_seconds_per_client": personalize / len(new_clients),
            "peak_rss_mb": peak_rss_mb(), "hardware": hardware_name(fabric.device)}


def measure_memory(overrides: list[str], rounds: int) -> dict:
    """Peak memory of a run with ``federation.num_clients`` clients: set up, ``rounds`` rounds,
    personalize two new clients. Also what the data and any per-client state take."""
    from fedmeta.config import compose
    from fedmeta.evaluation import evaluate_new_clients
    from fedmeta.loop import federated_round, setup

    cfg = compose([*overrides, *QUIET])
    fabric, federation, algorithm = setup(cfg)
    for r in range(1, rounds + 1):
        federated_round(algorithm, federation, r, cfg.federation.clients_per_round, cfg.seed)
    evaluate_new_clients(algorithm, federation.new_clients[:2], cfg.personalization, federation.num_classes)
    states = algorithm.client_states
    state_bytes = sum(_nbytes(state) for state in states.values())
    return {"dataset": cfg.dataset.name, "partition": cfg.partition.name, "method": cfg.method.name,
            "variant": cfg.variant, "num_clients": cfg.federation.num_clients,
            "samples_per_client": len(federation.x) // cfg.federation.num_clients,
            "data_mb": (federation.x.nbytes + federation.y.nbytes) / 2**20,
            "model_mb": sum(p.nbytes for p in algorithm.parameters()) / 2**20,
            "clients_with_state": len(states),
            "state_mb_per_client": state_bytes / len(states) / 2**20 if states else 0.0,
            "peak_rss_mb": peak_rss_mb()}


def _nbytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    return sum(_nbytes(v) for v in tree.values()) if isinstance(tree, dict) else 0


def run_isolated(fn, *args):
    """``fn(*args)`` in a fresh process (spawned, so nothing is inherited): its own peak memory."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def plan(bench: DictConfig, datasets: list[str] | None, methods: list[str] | None, extra: list[str]) -> list[list[str]]:
    """The overrides of every timing row: one per data set × method, then the extra rows."""
    rows = []
    for name, setting in bench.datasets.items():
        if datasets and name not in datasets:
            continue
        variants = [[f"method={m}"] for m in methods or bench.methods]
        variants += [list(r) for r in bench.extra_rows if not methods or r[0].split("=", 1)[1] in methods]
        rows += [[*setting, *v, *extra] for v in variants]
    return rows


def memory_plan(bench: DictConfig, extra: list[str]) -> list[list[str]]:
    memory = bench.memory
    variants = [[f"method={m}"] for m in memory.methods] + [list(r) for r in memory.extra_rows]
    return [[*memory.overrides, *v, f"federation.num_clients={n}", *extra]
            for v in variants for n in memory.num_clients]


def run(datasets: list[str] | None = None, methods: list[str] | None = None, extra: list[str] = (),
        memory: bool = True, out: Path = Path("results/bench.json"), config: Path = CONFIG_DIR / "bench.yaml",
        profile: bool = False) -> dict:
    from fedmeta.config import compose
    from fedmeta.loop import hardware_name

    bench = OmegaConf.load(config)
    rows = plan(bench, datasets, methods, list(extra))
    memory_rows = memory_plan(bench, list(extra)) if memory else []
    for overrides in rows + memory_rows:  # unknown names or bad values: one line before anything runs
        compose([*overrides, *QUIET])
    result = {"machine": hardware_name(torch.device("cpu")),
              "peak_gflops": matmul_peak_gflops(bench.matmul_size),
              "peak_gflops_bf16": matmul_peak_gflops(bench.matmul_size, torch.bfloat16),
              "rows": [], "memory": []}
    print(f"{result['machine']}: fp32 matmul peak {result['peak_gflops']:.0f} GFLOP/s, "
          f"bf16 {result['peak_gflops_bf16']:.0f} GFLOP/s")
    print(f"{'data set':9s} {'method':10s} {'variant':8s} {'precision':10s} {'cl.thr':>6s} {'s/round':>8s} {'GFLOP':>7s} "
          f"{'GFLOP/s':>8s} {'% peak':>6s} {'pers s/cl':>9s} {'peak MB':>8s}")
    for overrides in rows:
        try:
            row = run_isolated(measure_round, overrides, bench.warmup_rounds, bench.rounds, bench.personalize_clients,
                               profile)
        except FedmetaError as exc:  # e.g. a data set not on this machine: the other rows still count
            result.setdefault("skipped", []).append({"overrides": overrides, "reason": str(exc)})
            print(f"skipped {' '.join(overrides)}: {exc}", flush=True)
            continue
        result["rows"].append(row)
        print(f"{row['dataset']:9s} {row['method']:10s} {row['variant']:8s} {row['precision']:10s} "
              f"{row['client_threads']:6d} {row['seconds_per_round']:8.3f} {row['gflop_per_round']:7.1f} {row['gflops']:8.1f} "
              f"{100 * row['gflops'] / result['peak_gflops']:6.1f} {row['personalize_seconds_per_client']:9.2f} "
              f"{row['peak_rss_mb']:8.0f}", flush=True)
        for op in row.get("profile", []):
            print(f"    {100 * op['share']:5.1f} %  {op['op']} ×{op['calls']}")
    if memory_rows:
        print(f"\n{'clients':>8s} {'method':8s} {'variant':8s} {'img/client':>10s} {'data MB':>8s} {'state MB/client':>15s} {'peak MB':>8s}")
        for overrides in memory_rows:
            row = run_isolated(measure_memory, overrides, bench.memory.rounds)
            result["memory"].append(row)
            print(f"{row['num_clients']:8d} {row['method']:8s} {row['variant']:8s} {row['samples_per_client']:10d} "
                  f"{row['data_mb']:8.0f} {row['state_mb_per_client']:15.2f} {row['peak_rss_mb']:8.0f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result
