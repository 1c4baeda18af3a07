"""Experiment grids of a preset (``configs/preset/``): method × setting × seed, each a plain
``fedmeta train`` in its own process. Runs already finished in ``runs/<preset>/`` are skipped and
unfinished ones continue from their last checkpoint, so an interrupted grid resumes where it stopped; ``parallel`` processes go at once. When the runs are
vectorized (``federation.vectorize=true``), the unfinished seeds of a setting × method share one
process as stacked seeds (``seeds=[…]``), each still writing its own run folder."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig
from tqdm.auto import tqdm

from fedmeta.config import CONFIG_DIR, compose, load_group, run_name
from fedmeta.errors import FedmetaError


def load_preset(name: str) -> DictConfig:
    return load_group("preset", name, CONFIG_DIR)


@dataclass(frozen=True)
class Job:
    setting: str
    method: str
    seed: int
    overrides: tuple[str, ...]

    @property
    def label(self) -> str:
        seeds = next((o.split("=", 1)[1].strip("[]").replace(",", "-") for o in self.overrides if o.startswith("seeds=")), None)
        return f"{self.setting}/{self.method}/" + (f"seeds{seeds}" if seeds else f"seed{self.seed}")


def plan(preset: DictConfig, root: Path, grids: list[str], datasets: list[str] | None = None,
         methods: list[str] | None = None, seeds: list[int] | None = None, extra: list[str] = ()) -> list[Job]:
    """The runs of the chosen grids, seed by seed (all methods of seed 0 first, so a grid cut short
    still compares every method)."""
    settings = {name: s for name, s in preset.settings.items() if s.grid in grids}
    if datasets:  # data set names (cifar10) or setting names (cifar10-shards)
        settings = {name: s for name, s in settings.items() if name in datasets or setting_dataset(s) in datasets}
        unknown = set(datasets) - {setting_dataset(s) for s in preset.settings.values()} - set(preset.settings)
        if unknown:
            raise FedmetaError(f"no setting of the preset is or uses {sorted(unknown)}; settings: {sorted(preset.settings)}")
    jobs = []
    for name, setting in settings.items():
        dataset = setting_dataset(setting)
        rounds = preset.rounds.get(dataset) or compose([f"dataset={dataset}"]).federation.rounds
        evaluations = preset.evaluations.get(dataset) if isinstance(preset.evaluations, DictConfig) else preset.evaluations
        common = [*setting.overrides, f"federation.rounds={rounds}",
                  f"federation.eval_every={math.ceil(rounds / evaluations)}",
                  f"output.root={root}", f"output.setting={name}", "output.resume=true", *preset.overrides, *extra]
        for seed in seeds if seeds is not None else preset.seeds:
            for method in methods or preset.methods:
                jobs.append(Job(name, method, int(seed), (*common, f"method={method}", f"seed={seed}")))
    return jobs


def setting_dataset(setting: DictConfig) -> str:
    return next(o.split("=", 1)[1] for o in setting.overrides if o.startswith("dataset="))


def finished(job: Job, kept: Path | None = None) -> bool:
    """The run's summary is in its run folder, or among the kept run files (``results/runs/<preset>``,
    committed: a clone without the runs folder does not run them again)."""
    cfg = compose(list(job.overrides))
    return any((folder / run_name(cfg) / "summary.json").exists() for folder in (Path(cfg.output.root), kept) if folder)


def stacked(jobs: list[Job]) -> list[Job]:
    """Vectorized jobs of one setting and method merged into one job over their seeds."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        key = (job.setting, job.method) if compose(list(job.overrides)).federation.vectorize else (job.setting, job.method, job.seed)
        groups.setdefault(key, []).append(job)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        seeds = [job.seed for job in group]
        overrides = tuple(o for o in group[0].overrides if not o.startswith("seed="))
        merged.append(Job(group[0].setting, group[0].method, seeds[0], (*overrides, f"seeds=[{','.join(map(str, seeds))}]")))
    return merged


def run(jobs: list[Job], root: Path, parallel: int = 1, kept: Path | None = None) -> list[str]:
    """Run the jobs not yet finished; returns one line per failed run (its log holds the rest)."""
    remaining = [job for job in jobs if not finished(job, kept)]
    todo = stacked(remaining)
    print(f"{len(jobs) - len(remaining)} of {len(jobs)} runs already finished in {root}; {len(remaining)} to run "
          f"in {len(todo)} processes, {parallel} at a time")
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if parallel > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # OpenMP threads of parallel runs only fight each other

    def execute(job: Job) -> str | None:
        log = logs / f"{job.label.replace('/', '-')}.log"
        with open(log, "w") as out:
            code = subprocess.run([sys.executable, "-m", "fedmeta.cli", "train", *job.overrides],
                                  stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        if code == 0:
            return None
        last = [line for line in log.read_text().splitlines() if line.strip()][-1:] or ["(no output)"]
        return f"{job.label}: exit {code}: {last[0]} (log: {log})"

    failures = []
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(execute, job) for job in todo]
        for future in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run"):
            if (failure := future.result()) is not None:
                failures.append(failure)
                tqdm.write(failure)
    return failures
