"""The paper's table from short jobs that may be cut off at any time (a lent GPU for ten minutes, a
spot instance, a cluster's preemptible queue): ``fedmeta campaign --budget SECONDS``.

A unit is one setting × one method × the preset's seeds, stacked in one process
(``configs/campaign.yaml``: the preset, the order, what may be carried). A job

1. carries in the unfinished units' checkpoints kept in ``results/runs/<preset>/`` — each checked
   against the run it continues (a checkpoint of other settings is refused in one line, never
   resumed) — into the runs folder;
2. runs the unfinished units first, then the next ones in the campaign's order, while the running
   units' checkpoints fit ``carry_mib``; every run stops at the job's deadline at a round boundary,
   checkpointed (``output.stop_at``), so the budget is law and no unit's work is lost;
3. carries out: every finished run's small files and every unfinished run's checkpoint go to
   ``results/runs/<preset>/``, a line per job to its ``jobs.jsonl``, and the state of every unit
   with the projected time of the rest to ``results/campaign.md``.

The next job — on any machine, from a fresh clone holding those files — continues from there.
"""

from __future__ import annotations

import csv
import json
import shutil
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from fedmeta import grid, report
from fedmeta.checkpoint import differences, identity
from fedmeta.config import CONFIG_DIR, compose
from fedmeta.errors import FedmetaError

CARRIED = (*report.RUN_FILES, "checkpoint.ckpt")  # what an unfinished run leaves for the next job


def load(path: Path = CONFIG_DIR / "campaign.yaml") -> DictConfig:
    return OmegaConf.load(path)


@dataclass
class Unit:
    """One setting × method over the preset's seeds: a table cell or a figure point."""

    setting: str
    method: str
    jobs: list[grid.Job]  # one per seed
    rounds: int

    @property
    def label(self) -> str:
        return f"{self.setting}/{self.method}"

    def folders(self, root: Path) -> list[Path]:
        return [root / job.setting / job.method / f"seed{job.seed}" for job in self.jobs]

    def rounds_done(self, root: Path) -> list[int]:
        """Each seed's rounds: all of them when finished, else its checkpoint's round (0: not begun)."""
        return [_rounds_done(folder, self.rounds) for folder in self.folders(root)]


def _rounds_done(folder: Path, rounds: int) -> int:
    if (folder / "summary.json").is_file():
        return rounds
    if not (folder / "checkpoint.ckpt").is_file() or not (folder / "metrics.csv").is_file():
        return 0
    with open(folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return int(rows[-1]["round"]) if rows else 0


def units(campaign: DictConfig, root: Path) -> list[Unit]:
    """The campaign's units in its order: each setting's methods (the campaign's ``methods``, else
    all of the preset's) in the preset's order."""
    preset = grid.load_preset(campaign.preset)
    unknown = [name for name in campaign.order if name not in preset.settings]
    if unknown:
        raise FedmetaError(
            f"configs/campaign.yaml orders settings the preset {campaign.preset} lacks: {unknown}; "
            f"its settings: {sorted(preset.settings)}"
        )
    grids = sorted({setting.grid for setting in preset.settings.values()})
    found = []
    for name in campaign.order:
        jobs = grid.plan(preset, root, grids, [name], extra=list(campaign.overrides))
        rounds = compose(list(jobs[0].overrides)).federation.rounds  # the preset's, or the campaign's
        for method in campaign.get("methods") or preset.methods:
            found.append(Unit(name, method, [job for job in jobs if job.method == method], rounds))
    return found


def carry_in(unit: Unit, kept: Path, root: Path) -> str | None:
    """Copy the unit's unfinished runs kept in ``kept`` into ``root`` (unless ``root`` holds them
    as far or farther), each checkpoint checked first; returns why the unit is refused, or None."""
    for job, source, target in zip(unit.jobs, unit.folders(kept), unit.folders(root)):
        if not (source / "checkpoint.ckpt").is_file() or (source / "summary.json").is_file():
            continue
        problem = _foreign(source / "checkpoint.ckpt", compose(list(job.overrides)))
        if problem:
            return f"{source / 'checkpoint.ckpt'} {problem}: delete it to start that run over"
        if _rounds_done(target, unit.rounds) < _rounds_done(source, unit.rounds):
            _copy_run(source, target)
    return None


def _copy_run(source: Path, target: Path) -> None:
    """An unfinished run's files and checkpoint, from one runs folder to another."""
    target.mkdir(parents=True, exist_ok=True)
    for name in CARRIED:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


def _foreign(path: Path, cfg: DictConfig) -> str | None:
    """Why the checkpoint at ``path`` cannot continue ``cfg``'s run, or None."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        saved_identity, round_ = saved["identity"], int(saved["round"])
    except Exception as exc:  # noqa: BLE001 — whatever a cut-off or foreign file raises
        return f"cannot be read ({type(exc).__name__})"
    different = differences(saved_identity, identity(cfg))
    if different:
        return f"was written by other settings ({different[0]})"
    if round_ > cfg.federation.rounds:
        return f"is at round {round_}, beyond the run's {cfg.federation.rounds}"
    return None


def checkpoint_mib(job: grid.Job) -> float:
    """The size of the checkpoints a unit's process leaves: its global model(s) per seed, at their
    precision, with a tenth more for the clients' state (FedRep's heads, counters); built with
    FEMNIST's 62 classes, the most of any data set, so never less than the truth."""
    from fedmeta.algorithms import build_model

    cfg = compose(list(job.overrides))
    model = build_model(cfg, num_classes=62)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return 1.1 * size * len(job.stacked_seeds or [job.seed]) / 2**20


def run(campaign: DictConfig, budget: float, kept: Path, root: Path, parallel: int | None = None) -> dict:
    """One job of the campaign within ``budget`` seconds from now (see the module's docstring);
    returns its record (also appended to ``kept/jobs.jsonl``)."""
    started = time.time()
    stop_at = started + budget - campaign.reserve_seconds
    if parallel is None:
        parallel = campaign.parallel.cuda if torch.cuda.is_available() else campaign.parallel.cpu
    unfinished = [unit for unit in units(campaign, root) if min(unit.rounds_done(kept)) < unit.rounds]
    under_way = [unit for unit in unfinished if any(unit.rounds_done(kept))]
    # the units under way first, then as many new ones as can follow those that finish in this job
    todo, refused = [], []
    for unit in under_way + [u for u in unfinished if u not in under_way][: 2 * parallel]:
        problem = carry_in(unit, kept, root)
        if problem:
            refused.append(f"{unit.label}: refused: {problem}")
            print(refused[-1])
        else:
            todo.append(unit)
    before = {unit.label: unit.rounds_done(root) for unit in todo}
    for unit in todo:
        if any(before[unit.label]):
            print(f"resuming {unit.label} at rounds {before[unit.label]} (per seed) of {unit.rounds}")
    sizes: dict[grid.Job, float] = {}

    def admit(running: list[grid.Job], job: grid.Job) -> str | None:
        if campaign.carry_mib is None:  # a shared file system: nothing travels between jobs
            return None
        for one in (job, *running):
            sizes.setdefault(one, checkpoint_mib(one))
        total = sum(sizes[one] for one in running) + sizes[job]
        if total <= campaign.carry_mib:
            return None
        if not running:
            return (
                f"its checkpoints (~{sizes[job]:.0f} MiB) alone pass carry_mib={campaign.carry_mib}, what a "
                "job may leave for the next: run it where jobs share a disk (carry_mib: null in "
                "configs/campaign.yaml) or in a job long enough to finish it"
            )
        return (
            f"its checkpoints (~{sizes[job]:.0f} MiB) with the running units' would pass "
            f"carry_mib={campaign.carry_mib}"
        )

    jobs = [job for unit in todo for job in unit.jobs]
    lines = grid.run(jobs, root, parallel, kept, stop_at=stop_at, admit=admit) if jobs else []
    report.archive(root, kept)
    carried = carry_out(todo, root, kept)
    record = {
        "started": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "hardware": _hardware(),
        "budget_seconds": budget,
        "seconds": round(time.time() - started, 1),
        "parallel": parallel,
        "units": {
            unit.label: [before[unit.label], unit.rounds_done(kept)]
            for unit in todo
            if unit.rounds_done(kept) != before[unit.label]
        },
        "carried_mib": round(carried, 1),
        "not_done": lines + refused,
    }
    kept.mkdir(parents=True, exist_ok=True)
    with open(kept / "jobs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def carry_out(todo: list[Unit], root: Path, kept: Path) -> float:
    """Each unfinished run's files and checkpoint to ``kept``; a finished run's kept checkpoint is
    removed (its summary is there now). Returns the MiB of checkpoints kept."""
    total = 0.0
    for unit in todo:
        for source, target in zip(unit.folders(root), unit.folders(kept)):
            if (target / "summary.json").is_file():
                (target / "checkpoint.ckpt").unlink(missing_ok=True)
            elif (source / "checkpoint.ckpt").is_file() and not (source / "summary.json").is_file():
                _copy_run(source, target)
                total += (target / "checkpoint.ckpt").stat().st_size / 2**20
    return total


def _hardware() -> str:
    from fedmeta.assemble import hardware_name

    return hardware_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def status(campaign: DictConfig, kept: Path) -> str:
    """``results/campaign.md``: every unit's state, the speed it was measured at, and the projected
    time of what is left; then the jobs so far."""
    all_units = units(campaign, Path("runs") / campaign.preset)
    speeds = {unit.label: _seconds_per_seed_round(unit, kept) for unit in all_units}
    lines = [
        "# The paper's table as a campaign of short jobs",
        "",
        f"Written by `fedmeta campaign` from `{kept}` (configs/campaign.yaml: the order). A unit is a "
        "setting × method over the preset's seeds, stacked in one process; *s/seed-round* is the median "
        "of its rounds' seconds per seed, as measured by its own runs (with the other units of its "
        "job sharing the machine, see the jobs below).",
        "",
        "| # | setting | method | state | s/seed-round | left (h) |",
        "|---|---|---|---|---|---|",
    ]
    left_seconds, unmeasured, counts = 0.0, 0, {"done": 0, "under way": 0, "to do": 0}
    for i, unit in enumerate(all_units, 1):
        done = unit.rounds_done(kept)
        state = "done" if min(done) == unit.rounds else ("under way" if any(done) else "to do")
        counts[state] += 1
        speed = speeds[unit.label] or _same_method_speed(unit, all_units, speeds)
        remaining = sum(unit.rounds - d for d in done)
        if remaining and speed is None:
            unmeasured += 1
        left = None if speed is None else remaining * speed
        left_seconds += left or 0.0
        shown = state if state != "under way" else f"rounds {', '.join(map(str, done))} of {unit.rounds}"
        lines.append(
            f"| {i} | {unit.setting} | {unit.method} | {shown} | "
            f"{'-' if speeds[unit.label] is None else f'{speeds[unit.label]:.3f}'} | "
            f"{'-' if left is None else f'{left / 3600:.2f}'} |"
        )
    lines += [
        "",
        f"**{counts['done']} units done, {counts['under way']} under way, {counts['to do']} to do.** "
        + (
            "No unit has been measured yet: no projection."
            if unmeasured == counts["under way"] + counts["to do"]
            else f"Projected time left: {left_seconds / 3600:.2f} h at the measured speeds"
            + (f", plus {unmeasured} units not measured yet" if unmeasured else "")
            + " (a unit with no speed of its own takes its method's on the same data set, where measured)."
        ),
        "",
        "## Jobs",
        "",
        "| started (UTC) | hardware | budget s | wall s | units at once | rounds per seed: before → after |",
        "|---|---|---|---|---|---|",
    ]
    if not _jobs(kept):
        lines.append("| none yet | | | | | |")
    for job in _jobs(kept):
        moved = "; ".join(f"{label}: {b} → {a}" for label, (b, a) in job["units"].items()) or "none"
        lines.append(
            f"| {job['started']} | {job['hardware']} | {job['budget_seconds']:.0f} | {job['seconds']:.0f} | "
            f"{job['parallel']} | {moved} |"
        )
    return "\n".join(lines) + "\n"


def _jobs(kept: Path) -> list[dict]:
    path = kept / "jobs.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def _seconds_per_seed_round(unit: Unit, kept: Path) -> float | None:
    seconds = []
    for folder in unit.folders(kept):
        if (folder / "metrics.csv").is_file():
            with open(folder / "metrics.csv") as f:
                seconds += [float(row["round_seconds"]) for row in csv.DictReader(f) if row["round_seconds"]]
    return statistics.median(seconds) if seconds else None


def _same_method_speed(unit: Unit, all_units: list[Unit], speeds: dict) -> float | None:
    dataset = unit.setting.split("-")[0]
    return next(
        (
            speeds[other.label]
            for other in all_units
            if other.method == unit.method
            and other.setting.split("-")[0] == dataset
            and speeds[other.label] is not None
        ),
        None,
    )
