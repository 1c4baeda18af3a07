"""Grids of runs: a preset's (``configs/preset/``: method × setting × seed) or a sweep's (every
combination of comma-separated values, ``fedmeta sweep method=cafeme,fedavg_ft seed=0,1``), each
run a plain ``fedmeta train`` in its own process. Runs already finished are skipped and unfinished
ones continue from their last checkpoint, so an interrupted grid resumes where it stopped. The
processes run on an executor: a local process pool (``pool``, ``parallel`` at once), or submitit's
``local`` executor (the same jobs as SLURM would get them, on this machine) or ``slurm`` (an array
job of at most ``parallel`` tasks at once). When the runs are vectorized
(``federation.vectorize=true``), the unfinished seeds of a setting × method share one process as
stacked seeds (``seeds=[…]``), each still writing its own run folder."""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm.auto import tqdm

from fedmeta.checkpoint import differences, identity
from fedmeta.config import CONFIG_DIR, GROUPS, compose, load_group, method_label, run_name, setting_name
from fedmeta.errors import FedmetaError, RunStopped
from fedmeta.runs import TOOK_A_TURN, WAITING_FOR_A_TURN, DeviceTurn, read_summary
from fedmeta.stopping import FIRST_ROUND_ENDED

EXECUTORS = ("pool", "local", "slurm")
STOPPED = "stopped"  # a failure line that starts with it: the run stopped early, checkpointed, to continue
LAST_START = 30  # at least: no run starts closer to the deadline (FirstRounds measures what a start needs)
KILL_AFTER = 15  # seconds a run has after SIGTERM at the deadline to checkpoint and exit, then it is killed
POLL_S = 0.5  # how often a waiting pool thread looks whether its grid was asked to stop
STOP_GRACE = 180  # seconds a run has after a SIGTERM to its grid to reach a round boundary (a stacked
# CIFAR-10 round on one core takes about a minute), then it is killed; a second SIGTERM kills at once


def load_preset(name: str) -> DictConfig:
    """A preset's file (a user's own may inherit one of the package's), with the keys every preset has."""
    preset = load_group("preset", name, CONFIG_DIR)
    shapes = {"settings": DictConfig, "methods": ListConfig, "seeds": ListConfig}
    wrong = [key for key, kind in shapes.items() if not isinstance(preset.get(key), kind)]
    if wrong:
        raise FedmetaError(
            f"preset {name!r} has no {', '.join(wrong)} (settings: a mapping; methods, seeds: lists): "
            "write them into its file, or inherit them (inherits: quick)"
        )
    problem = _preset_problem(preset)
    if problem:
        raise FedmetaError(f"preset {name!r}: {problem}")
    results = preset.get("results", "results")
    if not isinstance(results, str) or not results.strip():
        raise FedmetaError(
            f"preset {name!r}: results must be a folder (where its TABLES.md, kept runs and figures go), "
            f"got {results!r}"
        )
    return preset


def _preset_problem(preset: DictConfig) -> str | None:
    """What in a preset would make its grid run other than it says, or None: a 0 that silently
    means the default (rounds) or divides by zero (evaluations), a method or seed listed twice
    (its runs counted twice), an override that moves the runs' folder (its kept runs are not there)."""

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    rounds = preset.get("rounds")
    if not isinstance(rounds, DictConfig) or not all(count(v) for v in rounds.values()):
        return f"rounds must map data sets to rounds ≥ 1 (or be {{}}: each data set's own), got {rounds}"
    evaluations = preset.get("evaluations", 1)
    per_dataset = evaluations.values() if isinstance(evaluations, DictConfig) else [evaluations]
    if not all(count(v) for v in per_dataset):
        return f"evaluations must be a count ≥ 1 (or one per setting, data set or default), got {evaluations}"
    for key in ("methods", "seeds"):
        values = list(preset[key])
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            return f"{key} lists {', '.join(twice)} twice: list each once"
    for label, setting in preset.settings.items():
        own = setting.get("methods") if isinstance(setting, DictConfig) else None
        if own is not None and not (isinstance(own, ListConfig) and set(own) <= set(preset.methods)):
            return (
                f"settings.{label}.methods must list some of the preset's methods ({', '.join(preset.methods)}), "
                f"got {own}"
            )
    moved = [o for o in preset.get("overrides") or [] if str(o).split("=", 1)[0] == "output.root"]
    if moved:
        return f"overrides may not set output.root ({moved[0]}): the preset's runs go under runs/<preset>"
    return None


@dataclass(frozen=True)
class Job:
    setting: str
    method: str
    seed: int
    overrides: tuple[str, ...]
    point: str = ""  # a sweep's point: the swept values that the run folder's name does not hold
    stage: int = 0  # a preset's chain: 0 for a fresh start, one more than its source's otherwise
    source: str = ""  # a preset's chain: the method whose run (same setting and seed) this one starts from
    chunk: int = 0  # stacked seeds: jobs of one setting and method stack only within the same chunk

    @property
    def stacked_seeds(self) -> list | None:
        """The seeds of a run over several seeds at once (``seeds=[0,1,2]``), else None."""
        value = next((o.split("=", 1)[1] for o in self.overrides if o.startswith("seeds=")), None)
        seeds = yaml.safe_load(value) if value is not None else None
        return seeds if isinstance(seeds, list) else None

    def folders(self, root: Path) -> set[Path]:
        """The run folders under ``root`` this job writes: one per seed it runs."""
        return {
            root / self.setting / self.method / f"seed{seed}" for seed in self.stacked_seeds or [self.seed]
        }

    @property
    def label(self) -> str:
        seeds = self.stacked_seeds
        return (
            (f"{self.point}/" if self.point else "")
            + f"{self.setting}/{self.method}/"
            + (f"seeds{'-'.join(map(str, seeds))}" if seeds else f"seed{self.seed}")
        )


STEPS = "personalization.steps="


@functools.cache
def scored_as_trained(picks: tuple[str, ...]) -> bool:
    """Whether the method (and variant) ``picks`` names takes no test-time steps of its own (FedAvg,
    IFCA, …): a preset's or setting's ``personalization.steps`` sets how many steps the methods that
    fine-tune take, and leaves these at 0, or FedAvg would become FedAvg-FT."""
    return compose(list(picks)).personalization.steps == 0


def plan(
    preset: DictConfig,
    root: Path,
    grids: list[str],
    datasets: list[str] | None = None,
    methods: list[str] | None = None,
    seeds: list[int] | None = None,
    extra: list[str] = (),
) -> list[Job]:
    """The runs of the chosen grids, seed by seed (all methods of seed 0 first, so a grid cut short
    still compares every method)."""
    settings = {name: s for name, s in preset.settings.items() if s.grid in grids}
    check_names(preset, datasets, methods)
    chain, stages = chain_stages(preset)
    if chain and methods:  # a chained method needs the methods its model comes from
        needed = {link["from"] for method, link in chain.items() if method in methods} - set(methods)
        if needed:
            raise FedmetaError(
                f"--methods: the preset's chain starts them from {sorted(needed)}: add those too"
            )
    if datasets:  # data set names (cifar10) or setting names (cifar10-shards)
        settings = {
            name: s for name, s in settings.items() if name in datasets or setting_dataset(s) in datasets
        }
    jobs = []
    for label, setting in settings.items():
        dataset = setting_dataset(setting)
        rounds, evaluations = preset_budget(preset, dataset, label)
        common = [
            *setting.overrides,
            f"federation.rounds={rounds}",
            f"federation.eval_every={math.ceil(rounds / evaluations)}",
            f"output.root={root}",
            f"output.setting={label}",
            "output.resume=true",
            *preset.overrides,
            *extra,
        ]
        own = setting.get("methods")  # a setting only some methods run (a figure's)
        steps_set = any(str(o).startswith(STEPS) for o in common)
        for seed in seeds if seeds is not None else preset.seeds:
            for method in (  # "fedrep" or, with a variant, "fedrep-tuned" (its run folder's name)
                m for m in methods or preset.methods if own is None or m in own
            ):
                name, _, variant = method.partition("-")
                picks = (f"method={name}", *([f"variant={variant}"] if variant else []))
                link = chain.get(method)
                handed = (
                    (
                        f"model.init_from={root / label / link['from']}/seed{{seed}}",
                        *link.get("overrides", []),
                    )
                    if link
                    else ()
                )
                kept = common
                if steps_set and scored_as_trained(picks):  # a preset's steps are the fine-tuners' only
                    kept = [o for o in common if not str(o).startswith(STEPS)]
                jobs.append(
                    Job(
                        label,
                        method,
                        int(seed),
                        (*kept, *picks, f"seed={seed}", *handed),
                        stage=stages[method],
                        source=link["from"] if link else "",
                    )
                )
    return jobs


def preset_budget(preset: DictConfig, dataset: str, setting: str | None = None) -> tuple[int, int]:
    """A preset's rounds and evaluations per run of ``setting`` on ``dataset`` (rounds: the data set's
    own protocol where the preset names none). ``evaluations`` is a count, or a mapping whose keys are
    settings, data sets or ``default``, looked up in that order (1 where none applies: the table
    reads only the last evaluation, at the final round)."""
    rounds = preset.rounds.get(dataset) or compose([f"dataset={dataset}"]).federation.rounds
    evaluations = preset.get("evaluations", 1)
    if not isinstance(evaluations, DictConfig):
        return rounds, evaluations
    keys = [key for key in (setting, dataset, "default") if key is not None and key in evaluations]
    return rounds, evaluations[keys[0]] if keys else 1


def chain_stages(preset: DictConfig) -> tuple[dict, dict[str, int]]:
    """A preset's ``chain`` (method → the method whose final model it starts from, and its own
    overrides) and each method's stage: 0 for a fresh start, one more than its source's otherwise."""
    chain = {method: dict(link) for method, link in (preset.get("chain") or {}).items()}
    stages: dict[str, int] = {}

    def stage(method: str, seen: tuple = ()) -> int:
        if method in seen:
            raise FedmetaError(f"the preset's chain goes round in a circle: {' → '.join((*seen, method))}")
        if method not in stages:
            source = chain.get(method, {}).get("from")
            if source is not None and source not in preset.methods:
                raise FedmetaError(
                    f"the preset's chain starts {method} from {source}, which is not one of its methods"
                )
            stages[method] = 0 if source is None else stage(source, (*seen, method)) + 1
        return stages[method]

    for method in preset.methods:
        stage(method)
    return chain, stages


def check_names(
    preset: DictConfig, datasets: list[str] | None = None, methods: list[str] | None = None
) -> None:
    """Every data set or setting name is one of the preset's, every method a method (with an
    existing variant: ``fedrep-tuned``): a typo is one line before anything runs or is written."""
    unknown = (
        set(datasets or ()) - {setting_dataset(s) for s in preset.settings.values()} - set(preset.settings)
    )
    if unknown:
        raise FedmetaError(
            f"no setting of the preset is or uses {sorted(unknown)}; settings: {sorted(preset.settings)}"
        )
    for method in methods or ():
        name, _, variant = method.partition("-")
        compose(
            [f"method={name}", *([f"variant={variant}"] if variant else [])]
        )  # unknown: one line with the choices
        if method not in preset.methods:
            raise FedmetaError(
                f"--methods: {method} is not one of the preset's methods ({', '.join(preset.methods)}): "
                f"add it to the preset's methods: list (configs/preset/<preset>.yaml) to run it in its table"
            )


def setting_dataset(setting: DictConfig) -> str:
    return next(o.split("=", 1)[1] for o in setting.overrides if o.startswith("dataset="))


def finished(job: Job, kept: Path | None = None) -> bool:
    """The run's summary is in its run folder, or among the kept run files (``results/runs/<preset>``,
    committed: a clone without the runs folder does not run them again) — a kept run only if it ran
    the job's settings (a variant changed since, e.g. a new tuning study, makes it run again)."""
    cfg = compose(list(job.overrides))
    if (Path(cfg.output.root) / run_name(cfg) / "summary.json").exists():
        return True
    if kept is None or not (kept / run_name(cfg) / "summary.json").exists():
        return False
    changed = settings_changed(kept / run_name(cfg) / "config.yaml", cfg)
    if changed:
        print(f"{kept / run_name(cfg)} ran other settings ({changed[0]}): running it again", file=sys.stderr)
    return not changed


def settings_changed(saved_config: Path, cfg: DictConfig) -> list[str]:
    """Where the run whose config is ``saved_config`` differs from ``cfg``'s experiment (its identity
    and rounds). A key the saved config does not have was added since and is taken at its default."""
    if not saved_config.is_file():
        return []
    try:
        saved = OmegaConf.load(saved_config)
        theirs = {**identity(saved), "rounds": saved.federation.get("rounds")}
    except Exception:  # noqa: BLE001 — an unreadable or partial copy is not evidence of other settings
        return []
    ours = {**identity(cfg), "rounds": cfg.federation.rounds}
    # where a warm start's model lies follows the output root: not a setting
    return [d for d in differences(theirs, ours, added_ok=True) if not d.startswith("model.init_from")]


def vectorized_here(cfg: DictConfig) -> bool:
    """Whether a run of ``cfg`` started on this machine vmaps its clients (``auto``: where a GPU is)."""
    import torch

    from fedmeta.capture import resolve
    from fedmeta.fastest import vmap_measured_faster

    accelerator = cfg.fabric.accelerator
    gpu = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if gpu else "cpu")
    return resolve(
        cfg.federation.vectorize, cfg.federation.capture, device, vmap_measured_faster(cfg, device)
    )[0]


def stacked(jobs: list[Job]) -> list[Job]:
    """Vectorized jobs of one setting and method merged into one job over their seeds."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        together = vectorized_here(compose(list(job.overrides)))
        key = (job.point, job.setting, job.method, job.chunk) + (() if together else (job.seed,))
        groups.setdefault(key, []).append(job)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        seeds = [job.seed for job in group]
        overrides = tuple(o for o in group[0].overrides if not o.startswith("seed="))
        merged.append(
            Job(
                group[0].setting,
                group[0].method,
                seeds[0],
                (*overrides, f"seeds=[{','.join(map(str, seeds))}]"),
                group[0].point,
                group[0].stage,
                group[0].source,
                group[0].chunk,
            )
        )
    return merged


def split_values(value: str) -> list[str]:
    """``a,b,[1,2]`` → ``a``, ``b``, ``[1,2]``: commas inside brackets belong to a list value."""
    values, depth, current = [], 0, ""
    for char in value:
        depth += (char in "[{(") - (char in "]})")
        if char == "," and depth == 0:
            values.append(current)
            current = ""
        else:
            current += char
    return [*values, current]


IDENTITY = {*GROUPS, "seed"}  # keys the run folder's name already holds (setting/method-variant/seed)


def sweep_plan(overrides: list[str], root: Path) -> list[Job]:
    """Every combination of the comma-separated values (``key=a,b``), seed by seed. Points that
    differ in keys other than the data set, partition, method, variant and seed get a folder of
    their own under ``root``, named by those values."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise FedmetaError(f"sweep values must be key=value or key=a,b,c, got {bad[0]!r}")
    if any(o.split("=", 1)[0] == "output.root" for o in overrides):
        raise FedmetaError(
            "a sweep's runs go under --root (default runs/sweep), not output.root: give --root FOLDER"
        )
    axes = [(key, split_values(value)) for key, value in (o.split("=", 1) for o in overrides)]
    if any(not v for _, values in axes for v in values):
        raise FedmetaError("a sweep value is empty (two commas, or one at an end): write key=a,b,c")
    # a key's values multiply the points: a key given twice or a value repeated would run a point
    # twice (or stack a seed twice, which fails), or the later key silently replace the earlier's values
    given = [key for key, _ in axes]
    twice = next((key for key in given if given.count(key) > 1), None)
    if twice:
        words = " and ".join(o for o in overrides if o.split("=", 1)[0] == twice)
        raise FedmetaError(f"{twice} is given twice ({words}): give its values once, as {twice}=a,b,c")
    for key, values in axes:
        repeated = next((v for v in values if values.count(v) > 1), None)
        if repeated is not None:
            raise FedmetaError(
                f"{key}={','.join(values)} repeats {repeated}: give each value once, "
                f"e.g. {key}={','.join(dict.fromkeys(values))}"
            )
    jobs, points = [], {}
    for combination in itertools.product(*[[(key, v) for v in values] for key, values in axes]):
        folder = ",".join(
            f"{k}={v}"
            for (k, v), (_, values) in zip(combination, axes)
            if len(values) > 1 and k not in IDENTITY
        )
        folder = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", folder)
        job_root = root / folder if folder else root
        run_overrides = (
            *(f"{k}={v}" for k, v in combination),
            f"output.root={job_root}",
            "output.resume=true",
        )
        cfg = compose(list(run_overrides))  # every point is checked before anything runs
        point = " ".join(f"{k}={v}" for k, v in combination)
        # two spellings of one value (0.1 and 0.10) name two folders of one run
        settings = OmegaConf.to_container(cfg)
        del settings["output"]["root"]
        same = points.setdefault(repr(settings), point)
        if same != point:
            raise FedmetaError(
                f"the sweep's points {same} and {point} are the same run (equal values written "
                "differently): give each value once"
            )
        jobs.append(Job(setting_name(cfg), method_label(cfg), cfg.seed, run_overrides, folder))
    return sorted(jobs, key=lambda job: job.seed)  # every point of seed 0 first


def sweep_report(jobs: list[Job]) -> str:
    """Each point's new-client accuracy, mean ± std over the seeds that finished."""
    import statistics

    points: dict[str, list[float]] = {}
    for job in jobs:
        cfg = compose(list(job.overrides))
        path = Path(cfg.output.root) / run_name(cfg) / "summary.json"
        summary = read_summary(path) if path.exists() else None
        if summary:
            points.setdefault(f"{job.point or '-'} | {job.setting} | {job.method}", []).append(
                100 * summary["accuracy"]
            )
    lines = ["| point | setting | method | accuracy (%) | seeds |", "|---|---|---|---|---|"]
    for point, values in points.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"| {point} | {statistics.mean(values):.2f} ± {spread:.2f} | {len(values)} |")
    return "\n".join(lines) + "\n"


def default_parallel() -> int:
    """Processes at once when not asked: all of them on a GPU (the card is shared; one process alone
    leaves it mostly idle), one on a CPU."""
    import torch

    return 0 if torch.cuda.is_available() else 1


def run(
    jobs: list[Job],
    root: Path,
    parallel: int = 1,
    kept: Path | None = None,
    executor: str = "pool",
    slurm: list[str] = (),
    stop_at: float | None = None,
    ahead: int = 0,
    stop: GridStop | None = None,
) -> list[str]:
    """Run the jobs not yet finished on ``executor``; returns one line per run that failed or was
    stopped (its log holds the rest; a stopped one's line starts with ``STOPPED``).
    ``stop`` (pool): the caller's, installed over more than the runs (a campaign's job); by default
    the pool installs its own while its runs go.
    ``parallel`` 0: every process at once (a GPU shared by all of a setting's methods).
    ``ahead`` (pool): that many more processes start and set up while ``parallel`` train, each
    waiting for a turn (``output.turns``) before its first round.
    ``stop_at`` (a Unix time): every run stops at its last round boundary before it, checkpointed
    (``output.stop_at``), none starts after it, and one still running then is sent SIGTERM, then
    killed ``KILL_AFTER`` seconds later."""
    if executor not in EXECUTORS:
        raise FedmetaError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    remaining = [job for job in jobs if not finished(job, kept)]
    todo = stacked(remaining)
    print(
        f"{len(jobs) - len(remaining)} of {len(jobs)} runs already finished in {root}; {len(remaining)} to run "
        f"in {len(todo)} processes, {parallel or 'all'} at a time ({executor})"
    )
    parallel = parallel or max(1, len(todo))
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    threads = (
        1 if parallel > 1 and executor != "slurm" else 0
    )  # OpenMP threads of parallel runs only fight each other
    if stop_at is not None:
        todo = [replace(job, overrides=(*job.overrides, f"output.stop_at={int(stop_at)}")) for job in todo]
    if executor == "pool":
        if ahead and len(todo) > parallel:
            turns = DeviceTurn.make(root / "turns", parallel).resolve()
            todo = [replace(job, overrides=(*job.overrides, f"output.turns={turns}")) for job in todo]
            return _run_pool(
                todo, logs, parallel + ahead, threads, stop_at, turn_gate(turns, parallel, ahead), stop
            )
        return _run_pool(todo, logs, parallel, threads, stop_at, stop=stop)
    if executor == "local":
        return _run_submitit(todo, logs / "submitit", parallel, threads, executor, slurm)
    failures = []  # SLURM runs an array job's tasks in any order: a chain's stages go one array job each
    for stage in sorted({job.stage for job in todo}):
        wave = [job for job in todo if job.stage == stage]
        failures += _run_submitit(wave, logs / "submitit", parallel, threads, executor, slurm)
    return failures


def sources(job: Job, jobs: list[Job]) -> list[Job]:
    """The jobs among ``jobs`` whose final models ``job`` starts from: its chain source's runs of the
    same sweep point, setting and seeds."""
    return [
        other
        for other in jobs
        if job.source
        and (other.method, other.point, other.setting) == (job.source, job.point, job.setting)
        and set(other.stacked_seeds or [other.seed]) & set(job.stacked_seeds or [job.seed])
    ]


def dispatch(
    todo: list[Job],
    parallel: int,
    start,
    outcome,
    poll_s: float = 0.2,
    stop_at: float | None = None,
    may_start: Callable[[int], bool] = lambda running: True,
    lead: Callable[[], float] = lambda: LAST_START,
    stopped: Callable[[], bool] = lambda: False,
) -> list[str]:
    """Run ``todo`` at most ``parallel`` at a time, each as soon as the runs it starts from have
    finished (a chain on a fast setting does not wait for a slow setting's stage), never one whose
    source failed, none within ``lead()`` seconds of ``stop_at``, and each only when
    ``may_start(runs running)`` allows it.
    ``start(job)`` returns a handle with ``done()``; ``outcome(job, handle)`` a failure line or
    None; once ``stopped()``, nothing more starts. Returns the failure lines."""
    needs = {job: sources(job, todo) for job in todo}
    waiting, running, failures, succeeded, failed = list(todo), [], [], set(), set()
    with tqdm(total=len(todo), desc="runs", unit="run") as bar:
        while waiting or running:
            for job in [j for j in waiting if any(s in failed for s in needs[j])]:
                waiting.remove(job)
                failed.add(job)
                failures.append(f"{job.label}: not run: the run it starts from failed")
                tqdm.write(failures[-1])
                bar.update()
            if waiting and (stopped() or (stop_at is not None and time.time() >= stop_at - lead())):
                why = ": the grid was stopped by SIGTERM" if stopped() else " before the deadline"
                for (
                    job
                ) in waiting:  # near the deadline or stopped: what has not started stays for the next job
                    failures.append(f"{STOPPED}: {job.label}: not started{why}")
                    bar.update()
                waiting.clear()
            ready = [j for j in waiting if all(s in succeeded for s in needs[j])]
            for job in ready[: max(0, parallel - len(running))]:
                if not may_start(len(running)):
                    break
                waiting.remove(job)
                running.append((job, start(job)))
            time.sleep(poll_s)  # a chain has no circles (chain_stages): something is always running here
            for job, handle in [r for r in running if r[1].done()]:
                running.remove((job, handle))
                if (failure := outcome(job, handle)) is None:
                    succeeded.add(job)
                else:
                    failed.add(job)
                    failures.append(failure)
                    tqdm.write(failure)
                bar.update()
    return failures


def train_command(job: Job, threads: int = 0):
    """One run as a submitit job: ``fedmeta train`` in a process of its own on the node that runs it
    (with ``threads`` OpenMP threads), failing the job with its exit status."""
    from submitit.helpers import CommandFunction

    pinned = ["env", f"OMP_NUM_THREADS={threads}"] if threads else []
    return CommandFunction([*pinned, sys.executable, "-m", "fedmeta.cli", "train", *job.overrides])


def _last_line(text: str) -> str:
    """fedmeta's own error line where the text has one (a job's log ends with submitit's traceback),
    else its last line."""
    lines = [line for line in text.splitlines() if line.strip()]
    return next(
        (line for line in reversed(lines) if line.startswith("fedmeta: error:")),
        lines[-1] if lines else "(no output)",
    )


def _failure(job: Job, code, log: Path) -> str | None:
    if code == 0:
        return None
    said = _last_line(log.read_text() if log.exists() else "")
    if code == RunStopped.EXIT_STATUS:
        return f"{STOPPED}: {job.label}: {said.removeprefix('fedmeta: ')}"
    return f"{job.label}: exit {code}: {said} (log: {log})"


def turn_gate(turns: Path, parallel: int, ahead: int) -> Callable[[int], bool]:
    """Whether another process may start beside ``running`` ones sharing ``parallel`` turns: the first
    ``parallel`` at once, then one more only while fewer than ``ahead`` are setting up or waiting. So
    turns go in the queue's order — a unit started ahead never takes the turn from the unit before it
    (the one under way, whose checkpoint travels) while that one is still setting up."""
    return lambda running: running < parallel or running - DeviceTurn.held(turns) < ahead


class FirstRounds:
    """How close to the deadline a run is still worth starting: the longest time this job's runs
    took from their process's start to the end of their first round (the recording made in it, a
    turn's wait left out), read from their logs, or are taking still, with a margin; ``LAST_START``
    at least. On a card a start and a first round take seconds; at load 8 on 2 cores they took 43 and
    78 s, and runs started by a fixed lead only stole the cores of the one training."""

    MARGIN = 1.25
    READ_EVERY = 2.0  # seconds between two readings of the logs

    def __init__(self):
        self.longest, self._read = 0.0, 0.0
        self._pending: dict[Path, float] = {}  # a started run's log → its start

    def began(self, log: Path) -> None:
        self._pending[log] = time.time()

    def ended(self, log: Path) -> None:
        """The run's process has exited: its log is read a last time."""
        self._measure(log, running=False)
        self._pending.pop(log, None)

    def lead(self) -> float:
        if time.time() - self._read >= self.READ_EVERY:
            self._read = time.time()
            for log in list(self._pending):
                self._measure(log, running=True)
        return max(LAST_START, self.MARGIN * self.longest)

    def _measure(self, log: Path, running: bool) -> None:
        started = self._pending.get(log)
        if started is None:
            return
        text = log.read_text(errors="replace") if log.exists() else ""
        turn = re.search(TOOK_A_TURN + r" ([\d.]+) s", text)
        waited = float(turn[1]) if turn else 0.0
        if ended := re.search(FIRST_ROUND_ENDED + r" ([\d.]+) s", text):
            self.longest = max(self.longest, float(ended[1]) - waited)
            self._pending.pop(log, None)  # a worker thread may have let it go too
        elif running and (turn or WAITING_FOR_A_TURN not in text):  # setting up, or in its first round
            self.longest = max(self.longest, time.time() - started - waited)


def _run_pool(
    todo: list[Job],
    logs: Path,
    parallel: int,
    threads: int,
    stop_at: float | None = None,
    may_start: Callable[[int], bool] = lambda running: True,
    stop: GridStop | None = None,
) -> list[str]:
    if stop is None:
        with (stop := GridStop()).installed():
            return _run_pool(todo, logs, parallel, threads, stop_at, may_start, stop)
    env = dict(os.environ) | (
        {"OMP_NUM_THREADS": str(threads)} if threads and "OMP_NUM_THREADS" not in os.environ else {}
    )
    first_rounds = FirstRounds()

    def execute(job: Job) -> str | None:
        log = logs / f"{job.label.replace('/', '-')}.log"
        tqdm.write(f"started {job.label}: its output in {log}")  # a run may take minutes to its first round
        first_rounds.began(log)
        with open(log, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "fedmeta.cli", "train", *job.overrides],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
            code = _wait(process, stop_at, stop)
        first_rounds.ended(log)
        at_deadline = stop_at is not None and time.time() >= stop_at
        if (stop.asked.is_set() or at_deadline) and code in (-signal.SIGTERM, -signal.SIGKILL):
            return (  # a stop, not a failure: it had no round boundary before the deadline
                f"{STOPPED}: {job.label}: setting up or in a round at "
                f"{'SIGTERM' if stop.asked.is_set() else 'the deadline'}, "
                f"{'killed' if code == -signal.SIGKILL else 'stopped'}; its last checkpoint is kept"
            )
        return _failure(job, code, log)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return dispatch(
            todo,
            parallel,
            lambda job: pool.submit(execute, job),
            lambda job, future: future.result(),
            stop_at=stop_at,
            may_start=may_start,
            lead=first_rounds.lead,
            stopped=stop.asked.is_set,
        )


class GridStop:
    """SIGTERM to a grid's own process (``kill``, ``timeout``, a scheduler) stops its runs as its
    deadline does — each at its next round boundary, checkpointed, with ``STOP_GRACE`` seconds to get
    there, nothing more started — and the caller goes on to what follows them (a campaign archives its
    runs and records its job), where the default would end the process on the spot. A second SIGTERM
    kills the runs at once (their last checkpoints on disk are whole)."""

    def __init__(self):
        self.asked, self.hurried = threading.Event(), threading.Event()

    def _on_sigterm(self, signum, frame) -> None:
        (self.hurried if self.asked.is_set() else self.asked).set()

    @contextmanager
    def installed(self) -> Iterator[GridStop]:
        """While inside, SIGTERM to this process is this stop (the main thread only takes signals; a
        process told to ignore SIGTERM keeps to it)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:  # None: a handler set from C, kept as it is
            yield self
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)


def _wait(process: subprocess.Popen, stop_at: float | None, stop: GridStop) -> int:
    """The run's exit status. One still running at ``stop_at`` (its own deadline check misjudged a
    round) gets SIGTERM, to checkpoint at its next round boundary, and is killed if it has not
    exited ``KILL_AFTER`` seconds later; once ``stop`` is asked, the same with ``STOP_GRACE`` seconds
    (it is then mid-round), killed at once if hurried. Its last checkpoint on disk is whole."""
    while not stop.asked.is_set():
        left = POLL_S if stop_at is None else min(POLL_S, stop_at - time.time())
        if left <= 0:
            break
        try:
            return process.wait(left)
        except subprocess.TimeoutExpired:
            continue
    process.terminate()
    grace_ends = time.time() + (STOP_GRACE if stop.asked.is_set() else KILL_AFTER)
    while time.time() < grace_ends and not stop.hurried.is_set():
        try:
            return process.wait(min(POLL_S, max(0.0, grace_ends - time.time())))
        except subprocess.TimeoutExpired:
            continue
    process.kill()
    return process.wait()


def _run_submitit(
    todo: list[Job], folder: Path, parallel: int, threads: int, kind: str, slurm: list[str]
) -> list[str]:
    """The jobs through submitit: on SLURM one array job (``parallel`` tasks at once, ``slurm``:
    submitit's parameters as key=value, e.g. partition=gpu gpus_per_node=1 timeout_min=600); on
    this machine its local executor, ``parallel`` jobs at a time."""
    import submitit

    if kind == "slurm":
        if shutil.which("sbatch") is None:
            raise FedmetaError(
                "--executor slurm needs SLURM's sbatch, not found here: run it on the cluster's login "
                "node, or use --executor local to run the same jobs on this machine"
            )
        executor = submitit.AutoExecutor(folder / "%j", cluster="slurm")
        options = {"slurm_array_parallelism": parallel, "name": "fedmeta"}
    else:
        executor, options = submitit.LocalExecutor(folder / "%j"), {}
    for item in slurm:
        key, _, value = item.partition("=")
        if not value:
            raise FedmetaError(
                f"--slurm takes key=value (submitit's parameters, e.g. partition=gpu), got {item!r}"
            )
        options[key] = yaml.safe_load(value)
    try:
        executor.update_parameters(**options)
    except (ValueError, TypeError, NameError) as exc:
        raise FedmetaError(f"submitit refused the --slurm parameters ({str(exc).splitlines()[0]})") from None

    def outcome(job: Job, handle) -> str | None:
        try:
            handle.result()  # the command's output; its failure raises
            code = 0
        except Exception as exc:  # the run's exit status, or: killed, timed out, failed to start
            status = re.search(r"non-zero exit status (\d+)", str(exc))  # CommandFunction's failure
            code = int(status[1]) if status else f"{type(exc).__name__}: {_last_line(str(exc))}"
        return _failure(job, code, Path(handle.paths.stderr))

    if kind == "slurm":  # one array job, SLURM throttles it (a chain's stage: none starts from another)
        with executor.batch():
            submitted = [executor.submit(train_command(job, threads)) for job in todo]
        handles = dict(zip(todo, submitted))
        return dispatch(todo, len(todo), handles.__getitem__, outcome, poll_s=1.0)
    return dispatch(
        todo, parallel, lambda job: executor.submit(train_command(job, threads)), outcome, poll_s=1.0
    )
