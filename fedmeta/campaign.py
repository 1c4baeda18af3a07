"""The paper's table from short jobs that may be cut off at any time (a lent GPU for ten minutes, a
spot instance, a cluster's preemptible queue): ``fedmeta campaign --budget SECONDS``.

A unit is one setting × one method × the preset's seeds, stacked in one process
(``configs/campaign.yaml``: the preset, the order, what may be carried). A job

1. skips, in one line, the units whose data is not on the machine (a job never downloads), and
   carries in the unfinished units' checkpoints kept in ``results/runs/<preset>/`` — each checked
   against the run it continues (a checkpoint of other settings is refused in one line, never
   resumed) — into the runs folder;
2. runs the unfinished units first, then the next ones in the campaign's order, ``parallel`` at a
   time; every run stops at the job's deadline at a round boundary, checkpointed
   (``output.stop_at``), so the budget is law;
3. with ``--pack OUT`` (a lent machine whose files come back only from OUT), keeps in OUT from the
   first checkpoint on a whole archive of what it has gained (:mod:`fedmeta.lease`): finished runs'
   small files, and unfinished runs' checkpoints within ``carry_mib``, the furthest along first;
   ``fedmeta campaign --collect OUT`` takes it back, never losing or rewinding a kept run;
4. carries out: every finished run's small files and every unfinished run's checkpoint go to
   ``results/runs/<preset>/``, a line per job to its ``jobs.jsonl``, and the state of every unit
   with the projected time of the rest, in short leases too, to ``results/campaign.md``.

The next job — on any machine, from a fresh clone holding those files — continues from there.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from fedmeta import grid, lease, report
from fedmeta.checkpoint import differences, identity, identity_differences
from fedmeta.clock import ALONE_CORES
from fedmeta.config import CONFIG_DIR, compose
from fedmeta.errors import FedmetaError
from fedmeta.runs import history_without_checkpoint, read_summary, recorded_rounds, rewinds, summary_problem

CARRIED = lease.UNFINISHED_FILES  # what an unfinished run leaves for the next job
# a job's carry-out waits this long for another writer into the kept runs: the other job's
# carry-out when both ended at one deadline takes seconds; a collect of a card's archive, minutes
CARRY_OUT_WAIT = 600.0


DEFAULT = CONFIG_DIR / "campaign.yaml"  # the paper's table; another campaign: fedmeta campaign --config FILE
MAX_FILE_BYTES = 256 * 1024  # a campaign's file is a few KiB


def load(path: Path = DEFAULT) -> DictConfig:
    """A campaign's file (configs/campaign.yaml unless given), checked: each fault is one line naming
    the key and what it takes."""
    import yaml

    try:
        with open(path, "rb") as f:  # at most a campaign's size: /dev/zero is not read forever
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise FedmetaError(
                f"{path} passes {MAX_FILE_BYTES // 1024} KiB, no campaign's size: give a campaign's YAML file"
            )
        raw = yaml.safe_load(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise FedmetaError(
            f"{path} cannot be read ({type(exc).__name__}): restore it from the repository"
        ) from None
    except RecursionError:
        raise FedmetaError(f"{path} is nested too deeply for a campaign's settings: correct it") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise FedmetaError(
            f"{path} is not valid YAML{where}: correct it or restore it from the repository"
        ) from None
    problem = _campaign_problem(raw)
    if problem:
        raise FedmetaError(f"{path}: {problem}")
    plan = OmegaConf.create(raw)
    plan.file = "configs/campaign.yaml" if path == DEFAULT else str(path)  # what messages name
    return plan


def _file(campaign: DictConfig) -> str:
    return campaign.get("file") or "configs/campaign.yaml"


def only(campaign: DictConfig, settings: str | None = None, methods: str | None = None) -> DictConfig:
    """The campaign narrowed to some of its settings (``--settings a,b``) and methods (``--methods
    a,b``), in its own order: two jobs at once — two cores, two machines — each on settings of its
    own, never on the same units; or a profile of one unit that is not next."""
    narrowed = campaign.copy()
    if settings is not None:
        narrowed.order = _some(settings, list(campaign.order), "--settings", "settings", campaign)
    if methods is not None:
        preset = grid.load_preset(campaign.preset)
        narrowed.methods = _some(
            methods, list(campaign.get("methods") or preset.methods), "--methods", "methods", campaign
        )
    return narrowed


def _some(given: str, names: list[str], flag: str, what: str, campaign: DictConfig) -> list[str]:
    """Those of ``names`` that ``given`` (comma-separated) names, in their order; one line if it names
    none or one that is not there."""
    wanted = [name.strip() for name in given.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in names]
    if unknown or not wanted:
        raise FedmetaError(
            f"{flag} takes some of {_file(campaign)}'s {what}, comma-separated, got {given!r}; "
            f"its {what}: {', '.join(names)}"
        )
    return [name for name in names if name in wanted]


SETTINGS = {
    "preset",
    "order",
    "methods",
    "overrides",
    "carry_mib",
    "parallel",
    "start_ahead",
    "reserve_seconds",
    "lease",
    "not_in_leases",
}
REQUIRED = {"preset", "order", "overrides", "carry_mib", "parallel", "reserve_seconds"}
# A lease as lent here, when configs/campaign.yaml names none: see the comment there.
LEASE = {
    "device_seconds": 900,
    "start_seconds": 45,
    "command_seconds": 580,
    "between_commands_seconds": 40,
    "command_overhead_seconds": 100,
    "profile_seconds": 75,
}
# Speeds measured alone: by hand (a line per measurement, with its command), and by a job's profile
# step (fedmeta.profiling), whose lines its log brings back into JOB_LOGS.
ALONE_RECORDS = Path("results") / "gpu" / "alone.jsonl"
JOB_LOGS = Path("results") / "gpu" / "jobs"
MEASURED = "measured alone: "  # starts a profile's line in a job's log: a JSON object (fedmeta.profiling)
FILL = "fill measured: "  # starts the line of a profile's fill step: two units in one process


def _campaign_problem(raw) -> str | None:
    """What is wrong with a campaign's settings (parsed YAML), or None."""
    if not isinstance(raw, dict):
        return "holds no settings (a mapping of preset, order, methods, overrides, carry_mib, parallel, …)"
    unknown = sorted(set(raw) - SETTINGS)
    if unknown:
        return f"unknown setting {unknown[0]!r}: the settings are {', '.join(sorted(SETTINGS))}"
    missing = sorted(REQUIRED - set(raw))
    if missing:
        return f"lacks {', '.join(missing)}: restore it from the repository"
    return next((why for ok, why in _setting_checks(raw) if not ok), None)


def _setting_checks(raw: dict) -> list[tuple[bool, str]]:
    """Each setting's check, with the line that says what it must be."""
    number = _number

    def words(value) -> bool:
        return isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)

    checks = [
        (isinstance(raw["preset"], str) and raw["preset"], "preset must be a preset's name, e.g. paper"),
        (words(raw["order"]), "order must be a list of the preset's settings, e.g. [rmnist-shards]"),
        (
            raw.get("methods") is None or words(raw["methods"]),
            "methods must be null (every method) or a list of names",
        ),
        (
            isinstance(raw["overrides"], list)
            and all(isinstance(o, str) and "=" in o for o in raw["overrides"]),
            "overrides must be a list of key=value",
        ),
        (
            raw["carry_mib"] is None or (number(raw["carry_mib"]) and raw["carry_mib"] >= 0),
            f"carry_mib must be a size in MiB ≥ 0 (or null: nothing travels), got {raw['carry_mib']!r}",
        ),
        (
            isinstance(raw["parallel"], dict)
            and set(raw["parallel"]) == {"cuda", "cpu"}
            and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in raw["parallel"].values()
            ),
            f"parallel must be {{cuda: N, cpu: N}}, units at once, each ≥ 1, got {raw['parallel']!r}",
        ),
        (
            isinstance(ahead := raw.get("start_ahead", {"cuda": 0, "cpu": 0}), dict)
            and set(ahead) == {"cuda", "cpu"}
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 8 for v in ahead.values()),
            f"start_ahead must be {{cuda: N, cpu: N}}, units that set up while others train, each 0 to 8, "
            f"got {raw.get('start_ahead')!r}",
        ),
        (
            number(raw["reserve_seconds"]) and 5 <= raw["reserve_seconds"] <= 600,
            f"reserve_seconds must be 5 to 600 (a straggler's stop, the last pack), got {raw['reserve_seconds']!r}",
        ),
    ]
    lease_plan = raw.get("lease", LEASE)
    checks.append(
        (
            lease_plan is None  # a machine of one's own: what is left is said in its hours
            or isinstance(lease_plan, dict)
            and set(lease_plan) == set(LEASE)
            and all(number(v) and v >= 0 for v in lease_plan.values())
            and lease_plan["start_seconds"] + lease_plan["command_seconds"] <= lease_plan["device_seconds"]
            and lease_plan["command_overhead_seconds"] + lease_plan["profile_seconds"]
            < lease_plan["command_seconds"],
            "lease must be {device_seconds: S, start_seconds: s, command_seconds: c ≤ S − s, "
            "between_commands_seconds: b, command_overhead_seconds: o, profile_seconds: p, o + p < c}, all ≥ 0; "
            "or null (a machine that is not lent)",
        )
    )
    not_in_leases = raw.get("not_in_leases") or {}
    checks.append(
        (
            isinstance(not_in_leases, dict) and all(isinstance(v, str) for v in not_in_leases.values()),
            "not_in_leases must map a data set to why no lease can run it",
        )
    )
    for key in ("order", "methods"):
        values = raw.get(key) if isinstance(raw.get(key), list) else []
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        checks.append((not twice, f"{key} lists {', '.join(twice)} twice: list each once"))
    checks.append(
        (
            not isinstance(raw["overrides"], list)
            or not any(isinstance(o, str) and o.split("=", 1)[0] == "output.root" for o in raw["overrides"]),
            "overrides may not set output.root: a campaign's runs go under runs/<preset>, where its jobs resume them",
        )
    )
    return checks


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
        return [lease.run_state(folder, self.rounds) for folder in self.folders(root)]


def units(campaign: DictConfig, root: Path) -> list[Unit]:
    """The campaign's units in its order: each setting's methods (the campaign's ``methods``, else
    all of the preset's) in the preset's order."""
    preset = grid.load_preset(campaign.preset)
    unknown = [name for name in campaign.order if name not in preset.settings]
    if unknown:
        raise FedmetaError(
            f"{_file(campaign)} orders settings the preset {campaign.preset} lacks: {unknown}; "
            f"its settings: {sorted(preset.settings)}"
        )
    unknown = [name for name in campaign.get("methods") or [] if name not in preset.methods]
    if unknown:
        raise FedmetaError(
            f"{_file(campaign)} names methods the preset {campaign.preset} lacks: {unknown}; "
            f"its methods: {list(preset.methods)}"
        )
    grids = sorted({setting.grid for setting in preset.settings.values()})
    found = []
    for name in campaign.order:
        jobs = grid.plan(preset, root, grids, [name], extra=list(campaign.overrides))
        rounds = compose(list(jobs[0].overrides)).federation.rounds  # the preset's, or the campaign's
        for method in campaign.get("methods") or preset.methods:
            if any(job.method == method for job in jobs):  # a setting may name the methods it runs
                found.append(Unit(name, method, [job for job in jobs if job.method == method], rounds))
    return found


def refusal(unit: Unit, kept: Path) -> str | None:
    """Why the unit's unfinished runs kept in ``kept`` cannot be continued (a checkpoint of other
    settings, or one that cannot be read), or None."""
    for folder in unit.folders(kept):
        if problem := history_without_checkpoint(folder):
            return f"{problem}: bring its checkpoint back, or move the folder aside to start that unit over"
    for job, source in zip(unit.jobs, unit.folders(kept)):
        if not (source / "checkpoint.ckpt").is_file() or (source / "summary.json").is_file():
            continue
        problem = _foreign(source / "checkpoint.ckpt", compose(list(job.overrides)))
        if problem:
            return f"{source / 'checkpoint.ckpt'} {problem}: delete it to start that run over"
    return None


def carry_in(unit: Unit, kept: Path, root: Path) -> str | None:
    """Copy the unit's unfinished runs kept in ``kept`` into ``root`` (unless ``root`` holds them
    as far or farther), each checkpoint checked first; returns why the unit is refused, or None."""
    problem = refusal(unit, kept)
    if problem:
        return problem
    for source, target in zip(unit.folders(kept), unit.folders(root)):
        if problem := history_without_checkpoint(target):  # the runs folder's own, not the kept one's
            return f"{problem}: bring its checkpoint back, or move the folder aside to start that unit over"
        if (source / "checkpoint.ckpt").is_file() and not (source / "summary.json").is_file():
            if lease.run_state(target, unit.rounds) < lease.run_state(source, unit.rounds):
                _copy_run(source, target)
    return None


def _copy_run(source: Path, target: Path) -> None:
    """An unfinished run's files and checkpoint, from one runs folder to another — never over more
    recorded rounds than it has (said, and left as it is)."""
    if problem := rewinds(source, target):
        print(problem)
        return
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
    different = identity_differences(saved_identity, cfg)
    if different:
        return f"was written by other settings ({different[0]})"
    if round_ > cfg.federation.rounds:
        return f"is at round {round_}, beyond the run's {cfg.federation.rounds}"
    return None


def chunks(unit: Unit, carry_mib: float | None) -> list[grid.Job]:
    """The unit's jobs, its seeds stacked in chunks whose checkpoints fit ``carry_mib`` (IFCA's four
    models a seed: 5 seeds would be ~47 MiB), so that whatever a job leaves unfinished can travel."""
    if carry_mib is None:
        return unit.jobs
    per_seed = checkpoint_mib(unit.jobs[0])
    size = max(1, int(carry_mib // per_seed))
    if per_seed > carry_mib:
        print(
            f"{unit.label}: a seed's checkpoint (~{per_seed:.0f} MiB) passes carry_mib={carry_mib}: "
            "it must finish within the job"
        )
    return [replace(job, chunk=i // size) for i, job in enumerate(unit.jobs)]


def checkpoint_mib(job: grid.Job) -> float:
    """An estimate of the checkpoints a job's process leaves: its global model(s) per seed, at their
    precision, with a tenth more for the clients' state, built with FEMNIST's 62 classes. Clients'
    state can weigh more (FedRep's heads: 3.9 MiB a seed on RMNIST after 173 rounds, estimated 2.6):
    what a job carries is measured when it is packed (fedmeta.lease), this only chunks the seeds."""
    from fedmeta.algorithms import build_model

    cfg = compose(list(job.overrides))
    model = build_model(cfg, num_classes=62)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return 1.1 * size * len(job.stacked_seeds or [job.seed]) / 2**20


def run(
    campaign: DictConfig,
    budget: float,
    kept: Path,
    root: Path,
    parallel: int | None = None,
    out: Path | None = None,
    carry_mib: float | None = None,
    ahead: int | None = None,
) -> dict:
    """One job of the campaign within ``budget`` seconds from now (see the module's docstring);
    returns its record (also appended to ``kept/jobs.jsonl``). ``out``: a folder that holds, from
    the first checkpoint on, a whole archive of what the job has gained (:mod:`fedmeta.lease`),
    its unfinished runs within ``carry_mib`` (default: configs/campaign.yaml's). ``parallel`` and
    ``ahead`` (units that set up while others train) default to configs/campaign.yaml's for this
    machine's device. SIGTERM to this process from its start to its record stops the job as its
    deadline does (``grid.GridStop``): what its runs reached is archived and recorded."""
    with grid.GridStop().installed() as stop:
        return _job(campaign, budget, kept, root, parallel, out, carry_mib, ahead, stop)


def _job(campaign, budget, kept, root, parallel, out, carry_mib, ahead, stop: grid.GridStop) -> dict:
    """``run``'s job, ``stop`` installed."""
    started = time.time()
    stop_at = started + budget - campaign.reserve_seconds
    carry = campaign.carry_mib if carry_mib is None else carry_mib
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if parallel is None:
        parallel = campaign.parallel[device]
    if ahead is None:
        ahead = campaign.get("start_ahead", {}).get(device, 0)
    todo, refused = _units_to_run(campaign, kept, root, parallel)

    def rounds_done(unit: Unit) -> list[int]:  # a seed finished by an earlier job is kept, not here
        return [max(here, kept_) for here, kept_ in zip(unit.rounds_done(root), unit.rounds_done(kept))]

    before = {unit.label: rounds_done(unit) for unit in todo}
    for unit in todo:
        if any(before[unit.label]):
            print(f"resuming {unit.label} at rounds {before[unit.label]} (per seed) of {unit.rounds}")
    record = {
        "id": uuid.uuid4().hex[:12],
        "started": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "hardware": _hardware(),
        "budget_seconds": budget,
        "seconds": 0.0,
        "parallel": parallel,
        "units": {},
        "carry_mib": carry,
        "overrides": list(campaign.overrides),  # what collect checks the job's checkpoints against
        "not_done": [],
        "ended": False,
    }

    def progress() -> dict:
        record["seconds"] = round(time.time() - started, 1)
        now = {unit.label: rounds_done(unit) for unit in todo}
        record["units"] = {label: [before[label], now[label]] for label in now if now[label] != before[label]}
        return dict(record)

    packer = None
    if out is not None:
        folders = [folder.relative_to(root) for unit in todo for folder in unit.folders(root)]
        limit = lease.ARCHIVE_BYTES if carry is None else int(carry * 2**20)
        packer = lease.Packer(root, out, lambda: folders, progress, limit_bytes=limit).start()
    jobs = [job for unit in todo for job in chunks(unit, carry)]
    finished_before = report.finished_runs(root)
    lines = None
    try:
        lines = grid.run(jobs, root, parallel, kept, stop_at=stop_at, ahead=ahead, stop=stop) if jobs else []
        _record_command(campaign, jobs, root, finished_before)
    finally:  # a stop of the campaign itself still packs what its runs left
        record["ended"] = lines is not None
        record["not_done"] = (lines or []) + refused
        if packer is not None:
            manifest = packer.stop()
            if manifest["left_out"]:
                print(f"not carried (over carry_mib={carry}): {'; '.join(manifest['left_out'])}")
        if (over := time.time() - started - budget) > 0:  # what the next job's reserve must hold
            print(
                f"the job's end came {over:.0f} s past its budget: a straggler's {grid.KILL_AFTER} s after "
                f"SIGTERM and the last pack need more than reserve_seconds={campaign.reserve_seconds} "
                f"({_file(campaign)})"
            )
    if packer is None:  # here the kept runs are what the next job reads; a packing job's go with its archive
        with lease.collecting(kept, wait=CARRY_OUT_WAIT):  # not beside a collect into the same runs
            report.archive(root, kept)
            carry_out(todo, root, kept)
            progress()
            lease.append_record(kept / "jobs.jsonl", record)
    return record


def finished_early(record: dict) -> bool:
    """Whether a job (``run``'s record) ended with every unit it took finished — nothing stopped,
    refused or skipped — so that a next job could take the next units in the time left."""
    return bool(record["ended"] and record["units"] and not record["not_done"])


def _record_command(campaign: DictConfig, jobs: list[grid.Job], root: Path, finished_before: dict) -> None:
    """Beside each run the job finished, the command TABLES.md names for its cell: the campaign
    that trained it (its file and the overrides its command line added)."""
    extra = campaign.get("command_overrides") or []
    command = shlex.join(["fedmeta", "campaign", "--config", _file(campaign), *extra])
    report.record_command(root, finished_before, command, {f for job in jobs for f in job.folders(root)})


def _units_to_run(
    campaign: DictConfig, kept: Path, root: Path, parallel: int
) -> tuple[list[Unit], list[str]]:
    """The units a job takes: those under way, then the next unfinished ones (more than its
    ``parallel`` can finish: it stops at its deadline), each whose data is here and whose kept runs
    carry in; and a line for each unit skipped or refused."""
    unfinished = [unit for unit in units(campaign, root) if min(unit.rounds_done(kept)) < unit.rounds]
    missing = {}  # per setting: its methods read the same data
    for unit in unfinished:
        if unit.setting not in missing:
            missing[unit.setting] = missing_data(unit)
    refused = [
        f"{unit.label}: skipped: {missing[unit.setting]}" for unit in unfinished if missing[unit.setting]
    ]
    for problem in dict.fromkeys(problem for problem in missing.values() if problem):
        print(f"skipped the units whose data is not on this machine: {problem}")
    reachable = [unit for unit in unfinished if not missing[unit.setting]]
    todo = []
    under_way = [unit for unit in reachable if any(unit.rounds_done(kept))]
    # the units under way first, then the next ones: more than one job can run (it stops at its deadline)
    for unit in under_way + [u for u in reachable if u not in under_way][: 6 * parallel]:
        problem = carry_in(unit, kept, root)
        if problem:
            refused.append(f"{unit.label}: refused: {problem}")
            print(refused[-1])
        else:
            todo.append(unit)
    return todo, refused


def next_unit(
    campaign: DictConfig, kept: Path, root: Path, carry_mib: float | None
) -> tuple[str, list[str]] | None:
    """The unit a job would run first — the first under way, else the next, whose data is here and
    whose kept runs it can continue — as its label and the overrides of its first chunk of seeds,
    stacked as that job would stack them (its output folders left out); None if there is none."""
    return next(_runnable(campaign, kept, root, carry_mib), None)


def fill_partner(
    campaign: DictConfig, kept: Path, root: Path, carry_mib: float | None, unit: tuple[str, list[str]]
) -> tuple[str, list[str]] | None:
    """The next unit a job could run beside ``unit`` (``next_unit``'s label and overrides) in one
    process: the same method on the same data set in another setting (RMNIST shards and Dirichlet:
    the same model, the same images), as ``next_unit`` gives it; None if there is none."""
    label, overrides = unit
    setting, method = label.split("/")
    dataset = compose(list(overrides)).dataset.name
    for other, other_overrides in _runnable(campaign, kept, root, carry_mib):
        other_setting, other_method = other.split("/")
        if other_method == method and other_setting != setting:
            if compose(list(other_overrides)).dataset.name == dataset:
                return other, other_overrides
    return None


def _runnable(campaign: DictConfig, kept: Path, root: Path, carry_mib: float | None):
    """``next_unit``'s candidates in the order a job takes them."""
    unfinished = [unit for unit in units(campaign, root) if min(unit.rounds_done(kept)) < unit.rounds]
    under_way = [unit for unit in unfinished if any(unit.rounds_done(kept))]
    missing: dict[str, str | None] = {}  # per setting: its methods read the same data
    for unit in under_way + [unit for unit in unfinished if unit not in under_way]:
        if unit.setting not in missing:
            missing[unit.setting] = missing_data(unit)
        if missing[unit.setting] is None and refusal(unit, kept) is None:
            first = grid.stacked(chunks(unit, campaign.carry_mib if carry_mib is None else carry_mib))[0]
            yield unit.label, [o for o in first.overrides if not o.startswith("output.")]


def missing_data(unit: Unit) -> str | None:
    """Why the unit's data set cannot be read on this machine (never downloaded in a job), or None."""
    from fedmeta.data.sources import missing_files

    cfg = compose(list(unit.jobs[0].overrides))
    return missing_files(cfg.dataset)


def collect(campaign: DictConfig, source: Path, kept: Path, logs: Path | None = None) -> list[str]:
    """A job's output folder (:mod:`fedmeta.lease`) into the kept runs, one collect at a time. Each
    run is judged against the campaign's own settings for its folder (never the job's word): its
    config, its metrics, a finished run's files and summary, an unfinished one's checkpoint, and that
    it continues the kept run; it is taken only where all of that holds and it is further along.
    The job's record goes to ``kept/jobs.jsonl``; with ``logs``, its log to ``logs/jobs/<id>.log``.
    Returns a line per run."""
    manifest, runs = lease.read_output(source)
    log = lease.read_log(source)
    job_id = manifest["job"]["id"]
    known = {
        folder.relative_to(kept).as_posix(): (unit, job)
        for unit in units(campaign, kept)
        for job, folder in zip(unit.jobs, unit.folders(kept))
    }
    unknown = sorted(set(runs) - set(known))
    if unknown:
        raise FedmetaError(
            f"{source}'s archive holds {unknown[0]}, not a run of this campaign: nothing collected"
        )
    said, taken = [], []
    with lease.collecting(kept):
        for path in [
            kept / "jobs.jsonl",
            *(kept / folder / name for folder in runs for name in lease.ALLOWED),
        ]:
            lease.no_links(path, kept)
        with tempfile.TemporaryDirectory(prefix="fedmeta-collect-") as scratch:
            for folder, files in sorted(runs.items()):
                unit, job = known[folder]
                line, take = _judge(files, unit, compose(list(job.overrides)), kept / folder, Path(scratch))
                if line:
                    said.append(f"{folder}: {line}")
                if take:
                    taken.append((folder, files))
        for folder, files in taken:
            lease.install(files, kept / folder)
        said.append(f"job {job_id}: record {lease.append_record(kept / 'jobs.jsonl', manifest['job'])}")
        if logs is not None and log is not None:
            said += lease.keep_log(log, job_id, logs)
    return said


def _judge(
    files: dict[str, bytes], unit: Unit, cfg: DictConfig, kept: Path, scratch: Path
) -> tuple[str, bool]:
    """What to say of a run the job brought back for the kept folder ``kept`` (of ``cfg``'s run),
    and whether to take it."""
    have = lease.run_state(kept, unit.rounds)
    finished = "summary.json" in files
    if finished:
        missing = [name for name in lease.FINISHED_REQUIRED if name not in files]
        if missing:
            return (
                f"finished, but without its {', '.join(missing)} (a finished run has them all): not taken",
                False,
            )
    elif lease.CHECKPOINT not in files and any(
        (kept / name).exists() for name in ("summary.json", lease.CHECKPOINT, "metrics.csv")
    ):
        return "", False  # not carried: only its measured rounds came, and more is kept
    problem = _config_problem(files.get("config.yaml"), cfg)
    if problem:
        return f"its config.yaml {problem}: not taken", False
    rows, problem = _metrics(files.get("metrics.csv"), unit.rounds if finished else None, unit.rounds)
    if problem:
        return f"its metrics.csv {problem}: not taken", False
    if finished:
        try:
            problem = summary_problem(json.loads(files["summary.json"].decode("utf-8")), unit.rounds)
        except (ValueError, RecursionError):
            problem = "cannot be read"
        if problem:
            return f"its summary.json {problem}: not taken", False
        if have >= unit.rounds:
            return "finished (already kept)", False
        problem = _continues(kept, have, rows)
        return ("finished", True) if not problem else (f"finished, but {problem}: not taken", False)
    if lease.CHECKPOINT not in files:
        return "not carried; its measured rounds kept", True
    path = lease.unpack_checkpoint(files[lease.CHECKPOINT], scratch)
    problem = _foreign(path, cfg)
    if problem:
        return f"its checkpoint {problem}: not taken", False
    saved = torch.load(path, map_location="cpu", weights_only=True)
    round_ = saved.get("round") if isinstance(saved, dict) else None
    if type(round_) is not int or not 0 < round_ <= unit.rounds:  # bool and "400" are not rounds
        return f"its checkpoint's round {round_!r} is no round of a {unit.rounds}-round run: not taken", False
    if round_ <= have:
        return f"round {round_}, not beyond the kept {have}: kept as it was", False
    if round_ < (recorded := recorded_rounds(kept)):
        return f"round {round_}, where the kept run records {recorded}: kept as it was", False
    history, problem = _history(saved)
    if problem:
        return f"its checkpoint {problem}: not taken", False
    if [r for r, _ in history] != list(range(1, round_ + 1)):
        return f"its checkpoint's history does not hold its rounds 1 to {round_}: not taken", False
    problem = _continues(kept, have, history)
    return (
        (f"round {have} → {round_}", True) if not problem else (f"its checkpoint {problem}: not taken", False)
    )


def _history(saved: dict) -> tuple[list[tuple[int, float]], str | None]:
    """A checkpoint's (round, train_loss) history and None, or why it is not one fedmeta writes: a
    round's loss is finite, or NaN where clients dropped out and none sent an update."""
    try:
        rows = saved["history"]["metrics"]
        history = [(int(row["round"]), float(row["train_loss"])) for row in rows]
        dropped = [float(row.get("clients_dropped") or 0) for row in rows]
    except (KeyError, TypeError, ValueError, AttributeError):
        return [], "holds no history of its rounds"
    for (round_, loss), lost in zip(history, dropped):
        if not (math.isfinite(loss) or (math.isnan(loss) and lost > 0)):
            return [], f"has a loss {loss} at round {round_} that no round reports"
    return history, None


def _config_problem(data: bytes | None, cfg: DictConfig) -> str | None:
    """Why a run's config.yaml is not ``cfg``'s run (the campaign's for that folder), or None."""
    import yaml

    if data is None:
        return "is missing"
    try:
        raw = yaml.safe_load(data.decode("utf-8"))
        theirs, rounds = identity(OmegaConf.create(raw)), raw["federation"]["rounds"]
    except Exception:  # noqa: BLE001 — whatever a cut-off, edited or foreign file raises
        return "cannot be read"
    different = differences(theirs, identity(cfg))
    if different:
        return f"is of other settings than the campaign's for this folder ({different[0]})"
    if rounds != cfg.federation.rounds:
        return f"is of {rounds!r} rounds, the campaign's {cfg.federation.rounds}"
    return None


ROUND_SECONDS = 24 * 3600  # a round's seconds beyond a day are not a measurement


def _metrics(
    data: bytes | None, rounds: int | None, limit: int
) -> tuple[list[tuple[int, float]], str | None]:
    """A run's metrics.csv → its (round, train_loss) rows and None, or why it is not one fedmeta
    writes (``rounds``: a finished run's, which its last row must reach; ``limit``: the run's
    rounds, which no row passes)."""
    from fedmeta.runs import METRIC_FIELDS

    if data is None:
        return [], "is missing"
    try:
        table = list(csv.reader(io.StringIO(data.decode("utf-8"))))
    except (UnicodeDecodeError, csv.Error):
        return [], "cannot be read"
    # columns are only ever added at the end: a run of an earlier version has the first of them
    header = table[0] if table else []
    if len(header) < 4 or header != METRIC_FIELDS[: len(header)]:
        return [], f"does not begin with fedmeta's columns ({','.join(METRIC_FIELDS)})"
    rows = []
    for row in table[1:]:
        values = dict(zip(header, row))
        try:
            round_, loss = int(values["round"]), float(values["train_loss"])
            numbers = {key: float(values[key]) for key in header[2:] if values.get(key)}
        except (KeyError, ValueError):
            return [], f"has a row that is not numbers ({','.join(row)[:60]})"
        if len(row) != len(header) or round_ != len(rows) + 1:
            return [], f"has a row {round_} where row {len(rows) + 1} belongs"
        if round_ > limit:
            return [], f"has a row {round_} of a {limit}-round run"
        if not 0 <= numbers.get("round_seconds", 0) <= ROUND_SECONDS or not all(
            0 <= numbers[key] <= 1 for key in numbers if key.startswith("eval_")
        ):
            return [], f"has a row {round_} with a duration or accuracy no run has"
        rows.append((round_, loss))
    if rounds is not None and len(rows) != rounds:
        return [], f"holds {len(rows)} rounds, not the run's {rounds}"
    return rows, None


def _continues(kept: Path, have: int, rows: list[tuple[int, float]]) -> str | None:
    """Why ``rows`` (a run's rounds and losses) do not continue the kept run, whose checkpoint is at
    round ``have`` (0: nothing to continue), or None: a run resumed from it repeats its rounds exactly."""
    try:
        saved = torch.load(kept / lease.CHECKPOINT, map_location="cpu", weights_only=True)
        ours = [(int(row["round"]), float(row["train_loss"])) for row in saved["history"]["metrics"]]
    except Exception:  # noqa: BLE001 — nothing kept (have 0), or a kept checkpoint without its history
        return None
    theirs = [(r, loss) for r, loss in rows if r <= have]
    if [(r, repr(x)) for r, x in theirs] != [(r, repr(x)) for r, x in ours[:have]]:
        return f"does not continue the kept run (its first {have} rounds differ from the kept checkpoint's)"
    return None


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
    from fedmeta.fastest import hardware_name

    return hardware_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def status(campaign: DictConfig, kept: Path) -> str:
    """``results/campaign.md``: every unit's state, its speed measured alone, what is left in card
    time and in leases of one and of two commands (configs/campaign.yaml: ``lease``), and which units
    no lease can run; then the jobs so far."""
    jobs = _jobs(kept)
    rows, left = _unit_rows(campaign, kept, jobs)
    lent = _lent(campaign)
    lines = [
        "# The paper's table as a campaign of short jobs"
        if lent
        else f"# The preset {campaign.preset} as a campaign of jobs on this machine",
        "",
        f"Written by `fedmeta campaign` from `{kept}` ({_file(campaign)}: the order). A unit is a "
        "setting × method over the preset's seeds, stacked in one process where its clients are vmapped "
        "(else its seeds run one after another). *s/seed-round alone* is the "
        "median of a lockstep round's seconds per seed with nothing else on the machine: the unit's own "
        "rounds in jobs that ran one unit at a time, else a job's profile step or a measurement by hand "
        f"(`{JOB_LOGS}/`, `{ALONE_RECORDS}`); ≈ marks a unit that takes its method's speed on the same "
        "data set. Rounds trained beside other units are not used (a card time-slices processes, and "
        "two processes on a CPU's cores can slow each other), nor rounds during which other processes "
        f"kept more than {ALONE_CORES} of a core busy on average (their `beside_cores` in metrics.csv), "
        "except where a unit has no other measure: ~ marks a speed from rounds with other work beside "
        "them (a second job on the other core; a profile's rounds likewise, by its `beside_cores`), "
        "taken as it is. "
        f"*evals left* are the new-client evaluations still due (the preset's `evaluations`); *{_hours(lent)}* "
        "is what is left of the unit's training and evaluations at those speeds, an evaluation's seconds "
        "from a job's profile, else from the unit's finished runs that trained one seed a process: their "
        "wall time less their rounds', over their evaluations, for each of its seeds; else, as for "
        "speeds, the same method's on the same data set.",
        "",
        f"| # | setting | method | state | s/seed-round alone | evals left | {_hours(lent)} |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *_projection(campaign, left),
        "",
        *(_fill_lines(campaign.preset) + [""] if lent else []),
        "## Jobs",
        "",
        "Jobs in the order they started; *units at once*: in the job's own process pool; *other jobs "
        "meanwhile*: jobs whose time overlapped this one's (`--settings` splits a CPU's units between cores).",
        "",
        "| started (UTC) | hardware | budget s | wall s | units at once | other jobs meanwhile "
        "| rounds per seed: before → after |",
        "|---|---|---|---|---|---|---|",
    ]
    if not jobs:
        lines.append("| none yet | | | | | | |")
    spans = [(_started(job), _started(job) + job["seconds"]) for job in jobs]
    for job, (start, end) in sorted(zip(jobs, spans), key=lambda pair: pair[1][0]):
        beside = sum(1 for s, e in spans if s < end and start < e) - 1
        moved = "; ".join(f"{label}: {b} → {a}" for label, (b, a) in job["units"].items()) or "none"
        lines.append(
            f"| {job['started']} | {job['hardware']} | {job['budget_seconds']:.0f} | {job['seconds']:.0f} | "
            f"{job['parallel']} | {beside} | {moved} |"
        )
    return "\n".join(lines) + "\n"


def _started(job: dict) -> float:
    return datetime.fromisoformat(job["started"]).timestamp()


def _unit_rows(campaign: DictConfig, kept: Path, jobs: list[dict]) -> tuple[list[str], dict]:
    """A table row per unit, and what is left: card seconds and units per part of the preset (the
    paper's table, the figures' runs), units and evaluations not measured yet, units no lease
    reaches, and the units' states counted."""
    all_units = units(campaign, Path("runs") / campaign.preset)
    records = alone_records(campaign.preset)
    speeds = {unit.label: _alone(unit, kept, jobs, records) for unit in all_units}
    preset = grid.load_preset(campaign.preset)
    not_in_leases = dict(campaign.get("not_in_leases") or {})
    left = {"parts": {}, "states": {"done": 0, "under way": 0, "to do": 0}, "unreachable": {}}
    rows = []
    for i, unit in enumerate(all_units, 1):
        done = unit.rounds_done(kept)
        state = "done" if min(done) == unit.rounds else ("under way" if any(done) else "to do")
        left["states"][state] += 1
        own = speeds[unit.label]
        speed = own if own.get("seconds_per_seed_round") else _same_method(unit, all_units, speeds)
        per_seed_round = speed.get("seconds_per_seed_round")
        remaining = sum(unit.rounds - d for d in done)
        evaluations = _evaluations_left(unit, min(done))
        evaluation_seconds = (  # partitions of one data set evaluate alike, as they train alike
            speed.get("evaluation_seconds")
            or _same_method(unit, all_units, speeds, "evaluation_seconds").get("evaluation_seconds")
        )
        seconds = None
        if per_seed_round:
            seconds = remaining * per_seed_round + evaluations * (evaluation_seconds or 0)
        part = left["parts"].setdefault(
            "the paper's table" if preset.settings[unit.setting].grid == "table" else "the figures' runs",
            {"seconds": 0.0, "units": 0, "unmeasured": [], "evaluations_unmeasured": 0},
        )
        dataset = unit.setting.split("-")[0]
        if remaining and dataset in not_in_leases:
            left["unreachable"].setdefault(dataset, []).append(unit)
        elif remaining and seconds is None:
            part["unmeasured"].append(unit)
        elif remaining:
            part["seconds"] += seconds
            part["units"] += 1
            part["evaluations_unmeasured"] += evaluations if evaluation_seconds is None else 0
        shown = state if state != "under way" else f"rounds {', '.join(map(str, done))} of {unit.rounds}"
        if orphaned := [recorded_rounds(f) for f in unit.folders(kept) if history_without_checkpoint(f)]:
            shown = f"refused: rounds {', '.join(map(str, orphaned))} recorded without a checkpoint"
        mark = ("" if speed is own else "≈") + ("~" if speed.get("beside") else "")
        speed_shown = "-" if not per_seed_round else f"{mark}{per_seed_round:.4f}"
        rows.append(
            f"| {i} | {unit.setting} | {unit.method} | {shown} | {speed_shown} | {evaluations} | "
            f"{'-' if seconds is None else f'{seconds / 3600:.2f} h'} |"  # a projection: its unit beside it
        )
    return rows, left


def training_per_lease(lease_plan: dict) -> tuple[float, float]:
    """Training seconds in a lease of one command and in one of two: a command less its job's own
    work (setup, the first unit's start, the last pack) and, in the first, the profile step; the
    second command gets the device time the first and the moves between them leave."""
    one = (
        lease_plan["command_seconds"] - lease_plan["command_overhead_seconds"] - lease_plan["profile_seconds"]
    )
    second = (
        lease_plan["device_seconds"]
        - lease_plan["start_seconds"]
        - lease_plan["command_seconds"]
        - lease_plan["between_commands_seconds"]
        - lease_plan["command_overhead_seconds"]
    )
    return one, one + max(0.0, second)


def _lent(campaign: DictConfig) -> bool:
    """Whether the campaign runs in leases (its file's ``lease``; null: on a machine of one's own)."""
    return campaign.get("lease", LEASE) is not None


def _hours(lent: bool) -> str:
    return "card h" if lent else "h left"


def _projection(campaign: DictConfig, left: dict) -> list[str]:
    """What is left, in leases of one and of two commands (or in hours of the machine, one unit at a
    time), part by part; then the units no lease can run, and why."""
    if not _lent(campaign):
        return _machine_projection(left)
    lease_plan = {**LEASE, **(campaign.get("lease") or {})}
    one, two = training_per_lease(lease_plan)
    not_in_leases = dict(campaign.get("not_in_leases") or {})
    states = left["states"]
    lines = [
        f"**{_count(states['done'], 'unit')} done, {states['under way']} under way, {states['to do']} to do.** A "
        f"lease ({lease_plan['device_seconds']} s of device time, the machine's start "
        f"{lease_plan['start_seconds']} s) trains {one:.0f} s in one command of {lease_plan['command_seconds']} s "
        f"(less {lease_plan['command_overhead_seconds']} s of the job's own: setup, the first unit's start, the "
        f"last pack; and {lease_plan['profile_seconds']} s of its profile step) and {two:.0f} s in two (the "
        f"second gets what is left after {lease_plan['between_commands_seconds']} s of collecting between "
        "them): configs/campaign.yaml, lease. "
        "At the speeds measured alone:",
        "",
    ]
    lines += _part_lines(
        left,
        "nothing is left that a lease can reach",
        lambda part: (
            f"{_count(part['units'], 'unit')} need {part['seconds'] / 3600:.2f} h of a card: "
            f"**{_count(math.ceil(part['seconds'] / one), 'lease')} of one command, "
            f"{math.ceil(part['seconds'] / two)} of two**"
        ),
    )
    for dataset, left_units in left["unreachable"].items():
        lines += [
            "",
            f"**Not reachable in leases: {len(left_units)} units of {dataset}** "
            f"({', '.join(sorted({u.setting for u in left_units}))}): {not_in_leases[dataset]}.",
        ]
    return lines


def _machine_projection(left: dict) -> list[str]:
    """What is left in hours of this machine, one unit at a time, part by part."""
    states = left["states"]
    return [
        f"**{_count(states['done'], 'unit')} done, {states['under way']} under way, {states['to do']} to do.** "
        "At the speeds measured alone, one unit at a time:",
        "",
        *_part_lines(
            left,
            "nothing is left",
            lambda part: f"{_count(part['units'], 'unit')} need **{part['seconds'] / 3600:.1f} h**",
        ),
    ]


def _part_lines(left: dict, nothing: str, need) -> list[str]:
    """A line per part of the preset: what its measured units need (``need(part)``), the
    evaluations not counted, the units not measured yet."""
    lines = []
    for name, part in left["parts"].items():
        unmeasured = part["unmeasured"]
        if not part["units"] and not unmeasured:
            lines.append(f"- **{name}:** {nothing}.")
            continue
        projection = need(part) if part["units"] else "no unit measured alone yet: no projection"
        if part["evaluations_unmeasured"]:
            projection += (
                f" (and {part['evaluations_unmeasured']} evaluations whose time is not measured yet, "
                "not counted)"
            )
        if unmeasured:
            projection += (
                f"; {len(unmeasured)} more not measured yet ({', '.join(u.label for u in unmeasured[:3])}"
                f"{' …' if len(unmeasured) > 3 else ''})"
            )
        lines.append(f"- **{name}:** {projection}.")
    return lines


def _count(count: int, thing: str) -> str:
    return f"{count} {thing}{'' if count == 1 else 's'}"


def _evaluations_left(unit: Unit, done: int) -> int:
    """The new-client evaluations of the unit's runs after round ``done``: every ``eval_every``
    rounds and at the last."""
    every = next(
        (int(o.split("=", 1)[1]) for o in unit.jobs[0].overrides if o.startswith("federation.eval_every=")), 0
    )
    points = set(range(every, unit.rounds + 1, every)) if every > 0 else set()
    return len({p for p in points | {unit.rounds} if p > done})


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _jobs(kept: Path) -> list[dict]:
    """The jobs' records in ``kept/jobs.jsonl``; a line that is not one (cut short, edited) is skipped
    with one warning naming it."""
    path = kept / "jobs.jsonl"
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            units_moved = record["units"]
            valid = (
                isinstance(record, dict)
                and lease.record_problem(record | {"parallel": record.get("parallel", 1)}) is None
                and isinstance(units_moved, dict)
            )
        except (ValueError, KeyError, TypeError, RecursionError):
            valid = False
        if valid:
            records.append(record | {"parallel": record.get("parallel", 1)})
        else:
            print(f"warning: {path}:{number} is not a job's record: skipped")
    return records


def fill_records(preset: str, logs: Path | None = None) -> list[dict]:
    """The ``FILL`` lines of ``preset``'s job logs in ``logs`` (``JOB_LOGS``), oldest first; a line
    that is not one (cut short, edited) is skipped."""
    found = []
    for line in _logged(FILL, logs or JOB_LOGS):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if (
            isinstance(record, dict)
            and record.get("preset") == preset
            and isinstance(record.get("unit"), str)
        ):
            found.append(record)
    return found


def _logged(prefix: str, logs: Path) -> list[str]:
    """What follows ``prefix`` on the lines of the job logs in ``logs`` that start with it, oldest first."""
    lines = []
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        text = log.read_text(encoding="utf-8", errors="replace")
        lines += [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]
    return lines


def _fill_lines(preset: str) -> list[str]:
    """``status``'s section on filling the card: every fill step a job's profile measured."""
    lines = [
        "## Filling the card",
        "",
        "A card time-slices processes: what fills it shares one process. A job's profile times the unit it "
        "runs next and its partner (the same method on the same data, another setting) one after the "
        "other, as the lanes of one round, and on two CUDA streams, over the same rounds "
        "(docs/reproducing.md, *Filling the card*). The campaign runs one unit at a time until a card "
        "measures a faster way. Seconds per seed-round:",
        "",
        "| date | hardware | units | one after the other | as lanes of one round | on two streams |",
        "|---|---|---|---|---|---|",
    ]
    records = fill_records(preset)

    def cell(value) -> str:
        return f"{value:.4f}" if _number(value) else "-"

    lines += [
        f"| {r.get('date', '')} | {r.get('hardware', '')} | {r['unit']} + {r.get('partner', '?')} | "
        f"{cell(r.get('one_after_the_other'))} | {cell(r.get('lanes'))} | {cell(r.get('streams'))} |"
        for r in records
    ] or ["| none yet | | | | | |"]
    return lines


def alone_records(preset: str, records: Path | None = None, logs: Path | None = None) -> list[dict]:
    """The speeds of ``preset``'s units measured alone: the lines of ``records`` (default
    ``ALONE_RECORDS``) and the ``MEASURED`` lines of the job logs in ``logs`` (``JOB_LOGS``), oldest
    first; a line that is not one (cut short, edited) is skipped."""
    records, logs = records or ALONE_RECORDS, logs or JOB_LOGS
    lines = []
    if records.is_file():
        lines += records.read_text(encoding="utf-8", errors="replace").splitlines()
    lines += _logged(MEASURED, logs)
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("unit"), str):
            continue
        if record.get("preset", "paper") != preset:
            continue
        speed = record.get("seconds_per_seed_round")
        if not (_number(speed) and 0 < speed <= ROUND_SECONDS):
            continue
        evaluation, beside, seeds = (record.get(k) for k in ("evaluation_seconds", "beside_cores", "seeds"))
        found.append(
            {
                "unit": record["unit"],
                "date": str(record.get("date", "")),
                "seconds_per_seed_round": float(speed),
                "evaluation_seconds": float(evaluation) if _number(evaluation) and evaluation >= 0 else None,
            }
            | ({"beside": True} if _number(beside) and beside > ALONE_CORES else {})
            | ({"seeds": int(seeds)} if isinstance(seeds, int) and seeds > 0 else {})
        )
    return sorted(found, key=lambda r: r["date"])


def _alone(unit: Unit, kept: Path, jobs: list[dict], records: list[dict]) -> dict:
    """The unit's speed alone and an evaluation's seconds: its own rounds outside jobs that ran
    several units at once and with no other work busy beside them (their ``beside_cores``), else
    the latest measurement of it (``alone_records``; marked ``beside`` where other work was busy
    beside it too), else, marked ``beside``, its rounds that had other work beside them in a job of
    its own (two jobs at once, one a core) — a job's many rounds before a profile's few; {} if none."""
    shared = [
        (min(moved[0]), max(moved[1]))
        for job in jobs
        if job["parallel"] > 1 and (moved := job["units"].get(unit.label))
    ]
    seconds, beside_seconds, evaluating = [], [], []
    for folder in unit.folders(kept):
        if (spent := _evaluation_seconds(folder)) is not None:
            evaluating.append(spent)
        try:
            with open(folder / "metrics.csv", encoding="utf-8") as f:
                for row in csv.DictReader(f):
                    try:
                        round_, value = int(row.get("round") or 0), float(row.get("round_seconds") or "nan")
                        beside = float(row.get("beside_cores") or 0)
                    except ValueError:
                        continue
                    # 1e308 would overflow what is left, nan compares false
                    if not 0 < value <= ROUND_SECONDS or any(lo < round_ <= hi for lo, hi in shared):
                        continue
                    (seconds if beside <= ALONE_CORES else beside_seconds).append(value)
        except (OSError, UnicodeDecodeError, csv.Error):
            continue
    mine = [r for r in records if r["unit"] == unit.label]
    speed = dict(mine[-1]) if mine else {}
    if speed.get("evaluation_seconds") and speed.get("seeds"):  # a profile of one seed of a unit of three
        speed["evaluation_seconds"] *= len(unit.jobs) / speed["seeds"]  # whose seeds run one after another
    if seconds:
        speed["seconds_per_seed_round"] = statistics.median(seconds)
        speed.pop("beside", None)
    elif beside_seconds and (not mine or speed.get("beside")):  # a job's rounds over a profile's few
        speed |= {"seconds_per_seed_round": statistics.median(beside_seconds), "beside": True}
    if evaluating and speed.get("evaluation_seconds") is None:  # the unit's seeds, one after another
        speed["evaluation_seconds"] = statistics.median(evaluating) * len(unit.jobs)
    return speed


def _evaluation_seconds(folder: Path) -> float | None:
    """What one evaluation of a finished run that trained its seed alone in its process cost: its
    wall seconds less its rounds', over its evaluations (its setup and checkpoints counted in, a few
    seconds of them); None for a stacked or unfinished run, or files that do not say."""
    summary = read_summary(folder / "summary.json") if (folder / "summary.json").is_file() else None
    if summary is None or summary.get("seeds_stacked", 1) != 1 or summary.get("resumed_at_round"):
        return None  # a resumed run's wall time counts its setup twice
    try:
        with open(folder / "metrics.csv", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        trained = sum(float(row["round_seconds"]) for row in rows)
    except (OSError, UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError):
        return None
    evaluations = sum(1 for row in rows if row.get("eval_accuracy"))
    if not evaluations or not _number(summary.get("seconds")) or summary["seconds"] < trained:
        return None
    return (summary["seconds"] - trained) / evaluations


def _same_method(
    unit: Unit, all_units: list[Unit], speeds: dict, key: str = "seconds_per_seed_round"
) -> dict:
    """The speed of a unit of the same method on the same data set that measured ``key``, or {}."""
    dataset = unit.setting.split("-")[0]
    return next(
        (
            speeds[other.label]
            for other in all_units
            if other.method == unit.method
            and other.setting.split("-")[0] == dataset
            and speeds[other.label].get(key)
        ),
        {},
    )
