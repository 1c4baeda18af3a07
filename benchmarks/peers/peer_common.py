"""What every peer driver shares: the round clock, the model checks and the PEER_RESULT line.

Imported by the drivers (drive_pfllib.py, drive_flbench.py), which run inside a peer's own venv:
stdlib and torch only, nothing of fedmeta's and nothing of the peer's.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import resource
import statistics
import sys
import time

# The model of the experiment: conv(1→32, k5, no padding) → ReLU → maxpool 2 → conv(32→64, k5) → ReLU
# → maxpool 2 → flatten 1024 → linear 512 → ReLU → linear 10 (PFLlib's FedAvgCNN for MNIST, FL-bench's
# "avgcnn"). These are the numbers of that shape:
#   params  = (1·32·25+32) + (32·64·25+64) + (1024·512+512) + (512·10+10) = 582,026
#   MACs    = 24·24·32·25 + 8·8·64·800 + 1024·512 + 512·10 = 4,267,008 multiply-adds per sample (forward)
# (McMahan's "same"-padded variant, flatten 3136 and 1,663,370 parameters, ships in neither peer.)
EXPECTED_PARAMS = 582_026
EXPECTED_MACS_PER_SAMPLE = 4_267_008
INPUT_SHAPE = (1, 1, 28, 28)

RESULT_PREFIX = "PEER_RESULT "


def status_mb(field: str) -> float | None:
    """A field of /proc/self/status in MB (Linux; None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class AnonPeak:
    """The largest anonymous resident memory (``RssAnon``: what the process allocated itself) seen,
    sampled every ``interval`` s by a daemon thread. Peak RSS (``ru_maxrss``) also counts the pages of
    shared libraries mapped from the page cache, which for torch's CUDA build vary by hundreds of MB
    from one process to the next with what the cache holds; the anonymous part does not."""

    def __init__(self, interval: float = 0.05):
        import threading

        self.peak = status_mb("RssAnon")
        if self.peak is not None:
            threading.Thread(target=self._watch, args=(interval,), daemon=True).start()

    def _watch(self, interval: float):
        while True:
            self.peak = max(self.peak, status_mb("RssAnon") or 0.0)
            time.sleep(interval)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (its children excluded): getrusage, whose
    microsecond fields resolve finer than os.times()' clock ticks."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model, input_shape=INPUT_SHAPE) -> dict:
    """Multiply-adds of one forward of one sample, counted on the operators that run
    (``torch.utils.flop_counter``: convolutions and matrix products, 2 FLOPs a multiply-add), so a
    model that calls its layers' functions rather than the modules counts the same."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    net = copy.deepcopy(model).cpu().eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        net(torch.zeros(*input_shape))
    per_op = {str(op): int(n) // 2 for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return {"total": counter.get_total_flops() // 2, "layers": sorted(per_op.items())}


def check_model(model) -> dict:
    """The parameter count and forward MACs of the peer's model; SystemExit if they are not the
    experiment's."""
    params = count_params(model)
    macs = count_macs(model)
    info = {"params": params, "macs_per_sample": macs["total"], "macs_by_operator": dict(macs["layers"])}
    if params != EXPECTED_PARAMS or macs["total"] != EXPECTED_MACS_PER_SAMPLE:
        sys.stderr.write(
            f"MODEL MISMATCH: {type(model).__name__} has {params} parameters and {macs['total']} MACs/sample; "
            f"the experiment's model has {EXPECTED_PARAMS} and {EXPECTED_MACS_PER_SAMPLE}\n{model}\n"
        )
        raise SystemExit(3)
    return info


class RoundClock:
    """CPU (getrusage user+sys) and wall seconds at the round boundaries a driver hooks.

    round_start/round_end bracket one training round; eval_start/eval_end bracket the peer's
    evaluation, which is subtracted from a round it falls inside and recorded on its own. The first
    round_start also closes the setup: process start (the parent's spawn time, passed as
    PEER_SPAWN_WALL) until the first training round begins.
    """

    def __init__(self):
        self.spawn_wall = float(os.environ.get("PEER_SPAWN_WALL", "nan"))
        self.driver_start_wall = time.time()
        self.driver_start_cpu = cpu_seconds()
        self.setup = None
        self.rounds: list[dict] = []
        self.evals: list[dict] = []
        self._round = None
        self._eval = None
        self.anon = AnonPeak()

    def round_start(self):
        if self._round is not None:
            raise RuntimeError("round_start inside a round: the hooks do not fit this peer's loop")
        now_w, now_c = time.time(), cpu_seconds()
        if self.setup is None:
            self.setup = {
                "wall_s": now_w - self.spawn_wall,
                "cpu_s": now_c,  # the process's whole CPU until here (interpreter start included)
                "driver_start_wall_s": self.driver_start_wall - self.spawn_wall,
                "driver_start_cpu_s": self.driver_start_cpu,
            }
        self._round = {
            "index": len(self.rounds),
            "w0": now_w,
            "c0": now_c,
            "eval_wall_s": 0.0,
            "eval_cpu_s": 0.0,
        }

    def round_end(self):
        r = self._round
        if r is None:
            raise RuntimeError("round_end outside a round: the hooks do not fit this peer's loop")
        w, c = time.time(), cpu_seconds()
        self.rounds.append(
            {
                "index": r["index"],
                "cpu_s": c - r["c0"] - r["eval_cpu_s"],
                "wall_s": w - r["w0"] - r["eval_wall_s"],
                "eval_cpu_s": r["eval_cpu_s"],
                "eval_wall_s": r["eval_wall_s"],
            }
        )
        self._round = None

    def eval_start(self):
        self._eval = (time.time(), cpu_seconds())

    def eval_end(self, label=""):
        w0, c0 = self._eval
        w, c = time.time() - w0, cpu_seconds() - c0
        self._eval = None
        self.evals.append({"after_rounds": len(self.rounds), "label": label, "cpu_s": c, "wall_s": w})
        if self._round is not None:
            self._round["eval_cpu_s"] += c
            self._round["eval_wall_s"] += w


def wrap_method(cls, name, before=None, after=None):
    """Replace cls.name (looked up through the MRO) by a wrapper that calls before(self) and
    after(self) around it. Runtime only, in this process."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        if before is not None:
            before(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            if after is not None:
                after(self)

    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", name)
    setattr(cls, name, wrapper)
    return original


def limit_threads():
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def summarize(clock: RoundClock, warmup: int, rounds_total: int) -> dict:
    """Rounds 0..rounds_total-1 are the experiment's; the first `warmup` of them are not timed. Rounds
    a peer's loop ran beyond rounds_total are listed as tail_rounds and not counted."""
    rounds = [r for r in clock.rounds if r["index"] < rounds_total]
    timed = [r for r in rounds if r["index"] >= warmup]
    return {
        "setup": clock.setup,
        "rounds": rounds,
        "tail_rounds": [r for r in clock.rounds if r["index"] >= rounds_total],
        "evals": clock.evals,
        "warmup_rounds": warmup,
        "timed_rounds": [r["index"] for r in timed],
        "cpu_s_per_round": statistics.median(r["cpu_s"] for r in timed) if timed else None,
        "wall_s_per_round": statistics.median(r["wall_s"] for r in timed) if timed else None,
        "eval_cpu_s_total": sum(e["cpu_s"] for e in clock.evals),
        "eval_wall_s_total": sum(e["wall_s"] for e in clock.evals),
    }


def environment() -> dict:
    import numpy
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "executable": sys.executable,
    }


def emit(result: dict, clock: RoundClock | None = None):
    ru = resource.getrusage(resource.RUSAGE_SELF)
    result.setdefault("peak_rss_mb", ru.ru_maxrss / 1024.0)  # Linux: KiB
    if clock is not None and clock.anon.peak is not None:
        result.setdefault("peak_anon_mb", max(clock.anon.peak, status_mb("RssAnon") or 0.0))
        result.setdefault("rss_file_mb_end", status_mb("RssFile"))
    result.setdefault("process_cpu_s", cpu_seconds())
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)  # processes the peer started and reaped (none expected)
    result.setdefault("children", {"cpu_s": ch.ru_utime + ch.ru_stime, "maxrss_mb": ch.ru_maxrss / 1024.0})
    sys.stdout.flush()
    sys.stdout.write(RESULT_PREFIX + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
