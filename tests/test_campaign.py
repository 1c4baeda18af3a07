"""Short jobs that may be cut off at any time: a run stops at its deadline or on SIGTERM at a round
boundary, checkpointed, and continues to the result it would have had; a campaign plans its units in
its order within what a job may carry, refuses a checkpoint of other settings, and a job on another
machine continues a carried checkpoint."""

import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fedmeta import campaign, grid
from fedmeta.clock import ALONE_CORES
from fedmeta.config import compose
from fedmeta.errors import FedmetaError, RunStopped
from fedmeta.loop import train
from fedmeta.stopping import Stopper

TINY = [
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "federation.rounds=4",
    "federation.eval_every=4",
    "federation.num_new_clients=2",
    "federation.clients_per_round=3",
    "personalization.steps=1",
    "logger=[]",
]


@pytest.mark.slow  # training processes: minutes on 2 cores
def test_a_run_past_its_deadline_stops_checkpointed_and_resumes_to_the_same_result(
    tmp_path, mnist_dir, monkeypatch
):
    args = ["method=fedavg", *TINY, f"dataset.dir={mnist_dir}"]
    whole = train(compose([*args, f"output.root={tmp_path / 'whole'}"]), show_progress=False)
    monkeypatch.setattr(Stopper, "MARGIN", 1e9)  # once a round is measured, no other fits before the deadline
    cut = [*args, f"output.root={tmp_path / 'cut'}"]
    with pytest.raises(RunStopped, match=r"stopped after round 1 of 4 \(output.stop_at .*output.resume=true"):
        train(compose([*cut, f"output.stop_at={time.time() + 3600:.0f}"]), show_progress=False)
    run = tmp_path / "cut" / "rmnist-shards" / "fedavg" / "seed0"
    assert (run / "checkpoint.ckpt").is_file() and not (run / "summary.json").exists()
    assert not (run.parent / "seed0.lock").exists()
    monkeypatch.undo()
    resumed = train(compose([*cut, "output.resume=true"]), show_progress=False)
    assert resumed["resumed_at_round"] == 1
    assert (resumed["accuracy"], resumed["curve"]) == (whole["accuracy"], whole["curve"])


@pytest.mark.slow  # training processes: minutes on 2 cores
def test_sigterm_stops_a_run_at_the_next_round_boundary_in_one_line(tmp_path, mnist_dir):
    """With the loggers a user gets (TensorBoard, W&B offline): SLURM, timeout and docker stop send SIGTERM."""
    tiny = [o for o in TINY if not o.startswith("logger=")]
    command = [sys.executable, "-m", "fedmeta.cli", "train", "method=fedavg", *tiny, "federation.rounds=1000"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [*command, f"dataset.dir={mnist_dir}", f"output.root={tmp_path}"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    metrics = tmp_path / "rmnist-shards" / "fedavg" / "seed0" / "metrics.csv"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    said = [line for line in err.splitlines() if line.startswith("fedmeta")]
    assert process.returncode == RunStopped.EXIT_STATUS, err
    assert len(said) == 1 and "(SIGTERM)" in said[0] and "output.resume=true" in said[0], said
    rounds = len(metrics.read_text().splitlines()) - 1
    assert f"stopped after round {rounds} of 1000" in said[0]  # every round it trained is checkpointed
    assert not (metrics.parent.parent / "seed0.lock").exists()


@pytest.fixture(scope="module")
def two_evaluated_rounds(tmp_path_factory, mnist_dir):
    """A 2-round run evaluated after each round, uninterrupted: (its arguments, summary, folder)."""
    args = [
        "method=fedavg",
        *TINY,
        "federation.rounds=2",
        "federation.eval_every=1",
        f"dataset.dir={mnist_dir}",
    ]
    root = tmp_path_factory.mktemp("whole")
    whole = train(compose([*args, f"output.root={root}"]), show_progress=False)
    return args, whole, root / "rmnist-shards" / "fedavg" / "seed0"


@pytest.mark.slow
@pytest.mark.parametrize("stopped_at", [1, 2])  # an evaluation on the way, and the last round's
def test_sigterm_during_an_evaluation_stops_before_it_and_the_resume_evaluates_that_round_first(
    tmp_path, two_evaluated_rounds, monkeypatch, stopped_at
):
    from fedmeta import loop

    args, whole, whole_run = two_evaluated_rounds
    real = loop._evaluate

    def sigterm_at_the_evaluation(fabric, runs, cfg, engine, show_progress, round_):
        if round_ == stopped_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(fabric, runs, cfg, engine, show_progress, round_)

    monkeypatch.setattr(loop, "_evaluate", sigterm_at_the_evaluation)
    cut = [*args, f"output.root={tmp_path}"]
    said = rf"stopped after round {stopped_at} of 2 \(SIGTERM, before its evaluation\); checkpointed in"
    with pytest.raises(RunStopped, match=said):
        train(compose(cut), show_progress=False)
    run = tmp_path / "rmnist-shards" / "fedavg" / "seed0"
    assert not (run / "summary.json").exists()
    assert torch.load(run / "checkpoint.ckpt", weights_only=True)["round"] == stopped_at
    monkeypatch.undo()
    resumed = train(compose([*cut, "output.resume=true"]), show_progress=False)
    assert resumed["resumed_at_round"] == stopped_at
    assert (resumed["accuracy"], resumed["curve"]) == (whole["accuracy"], whole["curve"])
    assert (run / "curves.csv").read_text() == (whole_run / "curves.csv").read_text()
    rows = [line.split(",") for line in (run / "metrics.csv").read_text().splitlines()]
    expected = [line.split(",") for line in (whole_run / "metrics.csv").read_text().splitlines()]
    timing = {rows[0].index("round_seconds"), rows[0].index("beside_cores")}  # what differs between two runs
    assert [[v for i, v in enumerate(r) if i not in timing] for r in rows] == [
        [v for i, v in enumerate(r) if i not in timing] for r in expected
    ]


def test_the_campaign_runs_the_table_first_in_the_papers_order():
    plan = campaign.load()
    units = campaign.units(plan, Path("runs/paper"))
    preset = grid.load_preset(plan.preset)
    assert [u.label for u in units[:9]] == [f"rmnist-shards/{m}" for m in preset.methods]
    assert len(units) == len(preset.settings) * len(preset.methods)  # every table cell and figure point
    grids = [preset.settings[u.setting].grid for u in units]
    assert grids == sorted(grids, key=lambda g: g != "table")  # the table before the figures' runs
    assert all(len(u.jobs) == len(preset.seeds) and u.rounds == 1000 for u in units[:9])


def tiny_campaign(mnist_dir, **changes):
    return OmegaConf.create(
        {
            "preset": "quick",
            "order": ["rmnist-shards"],
            "overrides": [
                *TINY,
                "federation.rounds=3",
                "federation.vectorize=true",
                f"dataset.dir={mnist_dir}",
            ],
            "carry_mib": 40,
            "parallel": {"cuda": 1, "cpu": 1},
            "reserve_seconds": 1,
        }
        | changes
    )


def under_way(kept: Path, unit: campaign.Unit) -> None:
    """Make ``unit`` look under way in ``kept``: its first seed at round 1."""
    folder = unit.folders(kept)[0]
    folder.mkdir(parents=True)
    torch.save({"round": 1}, folder / "checkpoint.ckpt")
    (folder / "metrics.csv").write_text("round,train_loss\n1,0.5\n2,0.4\n")  # ahead of the checkpoint


def test_a_job_continues_the_units_under_way_first_then_the_next_in_order(tmp_path, mnist_dir, monkeypatch):
    plan = tiny_campaign(mnist_dir)
    kept, root = tmp_path / "kept", tmp_path / "runs"
    all_units = campaign.units(plan, root)
    under_way(kept, all_units[5])
    assert all_units[5].rounds_done(kept) == [1, 0, 0]  # the checkpoint's round, not metrics.csv's
    started = []

    def record(jobs, root_, parallel, kept_, stop_at, **_):
        started.extend(jobs)
        return []

    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    monkeypatch.setattr(grid, "run", record)
    record_ = campaign.run(plan, 600, kept, root, parallel=1)
    # the unit under way, then six new ones in order (more than one job can run: it stops at its deadline)
    assert [(j.method, j.seed) for j in started][:3] == [(all_units[5].method, s) for s in (0, 1, 2)]
    following = [unit.method for unit in all_units[:7] if unit is not all_units[5]]
    assert [j.method for j in started[3:]] == [method for method in following for _ in range(3)]
    assert (kept / "jobs.jsonl").read_text().count("\n") == 1 and record_["parallel"] == 1


def test_the_runs_a_job_finishes_record_the_campaign_command_that_trained_them(
    tmp_path, mnist_dir, monkeypatch
):
    """TABLES.md names each cell's command: a campaign's runs name the campaign (its file and the
    overrides its command line added), not "command not recorded"."""
    plan = tiny_campaign(mnist_dir, file="configs/campaign_cpu.yaml", command_overrides=["seeds_stacked=1"])
    kept, root = tmp_path / "kept", tmp_path / "runs"

    def finish(jobs, root_, parallel, kept_, stop_at, **_):
        for folder in sorted({f for job in jobs[:2] for f in job.folders(root_)}):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "summary.json").write_text("{}")
        return []

    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    monkeypatch.setattr(grid, "run", finish)
    campaign.run(plan, 600, kept, root, parallel=1)
    commands = {p.read_text() for p in root.rglob("command.txt")}
    assert commands == {"fedmeta campaign --config configs/campaign_cpu.yaml seeds_stacked=1\n"}
    assert len(list(root.rglob("command.txt"))) == len(list(root.rglob("summary.json"))) >= 1


def test_a_cpu_job_whose_units_all_finish_before_its_deadline_goes_on_with_the_next(
    tmp_path, mnist_dir, monkeypatch, capsys
):
    """A job takes a few units; a CPU's deadline of hours outlasts them: the command runs the next
    job in the time left, until no unit is left; a job stopped short ends it."""
    from fedmeta.cli import main

    plan = tiny_campaign(mnist_dir, reserve_seconds=5)
    config = tmp_path / "campaign.yaml"
    OmegaConf.save(plan, config)
    monkeypatch.chdir(tmp_path)
    started = []

    def finish(jobs, root_, parallel, kept_, stop_at, **_):
        started.append([job.method for job in jobs])
        for folder in sorted({f for job in jobs for f in job.folders(root_)}):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "summary.json").write_text("{}")
        return []

    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    monkeypatch.setattr(grid, "run", finish)
    assert main(["campaign", "--config", str(config), "--budget", "600"]) == 0
    methods = [unit.method for unit in campaign.units(plan, Path("runs") / "quick")]
    jobs = -(-len(methods) // 6)  # a job takes six units (one at a time here): these jobs took them all
    assert len(methods) > 6 and len(started) == jobs
    assert [m for job in started for m in dict.fromkeys(job)] == methods
    jobs_run = (Path("results") / "runs" / "quick" / "jobs.jsonl").read_text().splitlines()
    assert len(jobs_run) == jobs  # each job recorded; no next one when nothing is left
    assert "a next job takes the next units" in capsys.readouterr().out

    shutil.rmtree("runs"), shutil.rmtree("results")
    started.clear()
    monkeypatch.setattr(
        grid, "run", lambda jobs, *a, **k: started.append(jobs) or ["stopped: at the deadline"]
    )
    assert main(["campaign", "--config", str(config), "--budget", "600"]) == 0
    assert len(started) == 1  # stopped short: no next job


def test_a_job_stopped_by_sigterm_stops_its_runs_and_still_archives_and_records_itself(
    tmp_path, mnist_dir, monkeypatch
):
    """``kill`` of the campaign's own process: its run checkpoints at a round boundary (here a
    stand-in that says so on SIGTERM), nothing more starts, and the job archives its runs and
    appends its record, as at its deadline, instead of dying with them unrecorded."""
    stand_in = tmp_path / "python"
    stand_in.write_text(  # a run that asks its campaign to stop, then stops at SIGTERM as a run does
        "#!/bin/sh\ntrap 'echo \"fedmeta: stopped after round 1 of 3 (SIGTERM)\"; exit 75' TERM\n"
        "kill -TERM $PPID\nsleep 60 & wait\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setattr(grid.sys, "executable", str(stand_in))
    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    kept, root = tmp_path / "kept", tmp_path / "runs"
    plan = tiny_campaign(mnist_dir)
    previous = signal.getsignal(signal.SIGTERM)
    record = campaign.run(plan, 3600, kept, root, parallel=1)
    assert signal.getsignal(signal.SIGTERM) is previous  # the job's handler goes with it
    stopped = [line for line in record["not_done"] if "not started" not in line]
    assert stopped == ["stopped: rmnist-shards/cafeme/seeds0-1-2: stopped after round 1 of 3 (SIGTERM)"]
    not_started = [line for line in record["not_done"] if line not in stopped]
    assert len(not_started) == 5  # the tiny campaign's other units, each of three stacked seeds
    assert all(line.endswith("not started: the grid was stopped by SIGTERM") for line in not_started)
    assert [json.loads(line)["not_done"] for line in (kept / "jobs.jsonl").read_text().splitlines()] == [
        record["not_done"]
    ]


@pytest.mark.slow  # the first SIGTERM's tests stay quick
def test_a_second_sigterm_kills_the_runs_at_once_and_the_job_still_records_itself(
    tmp_path, mnist_dir, monkeypatch
):
    """A run that does not stop (mid-round for long, or stuck) gets ``STOP_GRACE`` seconds after the
    first SIGTERM; a second kills it at once, and the job is archived and recorded all the same."""
    stand_in = tmp_path / "python"
    stand_in.write_text("#!/bin/sh\ntrap '' TERM\nkill -TERM $PPID\nsleep 1\nkill -TERM $PPID\nsleep 60\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(grid.sys, "executable", str(stand_in))
    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    record = campaign.run(tiny_campaign(mnist_dir), 3600, tmp_path / "kept", tmp_path / "runs", parallel=1)
    assert record["not_done"][-1] == (
        "stopped: rmnist-shards/cafeme/seeds0-1-2: setting up or in a round at SIGTERM, killed; "
        "its last checkpoint is kept"
    )
    assert (tmp_path / "kept" / "jobs.jsonl").read_text().count("\n") == 1


def test_sigterm_while_a_job_sets_up_starts_no_run_and_still_records_the_job(
    tmp_path, mnist_dir, monkeypatch
):
    units_to_run = campaign._units_to_run

    def signalled_while_planning(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return units_to_run(*args)

    monkeypatch.setattr(campaign, "_units_to_run", signalled_while_planning)
    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    monkeypatch.setattr(grid.sys, "executable", "/nonexistent: no run may start")
    record = campaign.run(tiny_campaign(mnist_dir), 3600, tmp_path / "kept", tmp_path / "runs", parallel=1)
    assert len(record["not_done"]) == 6
    assert all(line.endswith("not started: the grid was stopped by SIGTERM") for line in record["not_done"])
    assert json.loads((tmp_path / "kept" / "jobs.jsonl").read_text())["not_done"] == record["not_done"]


def _signal_main_thread(signum: int, handled=lambda: False) -> None:
    """Deliver ``signum`` to this thread and wait (up to 5 s) until ``handled()`` says its handler
    ran, so the next signal is not merged into it (pytest-xdist's workers have other threads, and a
    loaded machine can leave a signal pending past a fixed pause)."""
    signal.pthread_kill(threading.main_thread().ident, signum)
    deadline = time.monotonic() + 5
    while not handled() and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs here, raising from the sleep where it raises


def test_a_second_sigterm_to_a_run_lets_its_round_end_where_a_second_ctrl_c_does_not():
    """A signal to a grid's process group reaches its run twice (directly, and passed on by the
    grid): the round under way still ends and is checkpointed."""
    with Stopper(None) as stopper:
        stopper.rounds_started = True
        _signal_main_thread(signal.SIGTERM, lambda: stopper.signalled is not None)
        _signal_main_thread(signal.SIGTERM, lambda: True)
        time.sleep(0.05)  # a second SIGTERM's handler, had it raised, would have by now
        assert stopper.reason(evaluating=False) == "SIGTERM"
    with Stopper(None) as stopper, pytest.raises(KeyboardInterrupt):
        stopper.rounds_started = True
        _signal_main_thread(signal.SIGINT, lambda: stopper.signalled is not None)
        _signal_main_thread(signal.SIGINT)  # waits for the KeyboardInterrupt its handler raises


def test_two_jobs_at_once_each_take_only_the_settings_given_them(tmp_path, mnist_dir, monkeypatch, capsys):
    plan = tiny_campaign(mnist_dir, order=["rmnist-shards", "rmnist-dirichlet"])
    started = []
    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    monkeypatch.setattr(grid, "run", lambda jobs, *args, **kwargs: started.extend(jobs) or [])
    campaign.run(
        campaign.only(plan, " rmnist-dirichlet"), 600, tmp_path / "kept", tmp_path / "runs", parallel=1
    )
    assert started and {job.setting for job in started} == {"rmnist-dirichlet"}
    assert list(plan.order) == ["rmnist-shards", "rmnist-dirichlet"]  # the campaign itself is not changed
    for wrong in ("cifar10-shards", ","):
        with pytest.raises(
            FedmetaError, match="--settings takes some of .*its settings: rmnist-shards, rmnist"
        ):
            campaign.only(plan, wrong)
    from fedmeta.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parent.parent / "configs" / "campaign_cpu.yaml"
    assert main(["campaign", "--config", str(config), "--settings", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fedmeta: error: --settings narrows a job or a profile: give it --budget, --until or --profile"
    )


def test_methods_narrow_a_job_or_a_profile_to_units_that_are_not_next(
    tmp_path, mnist_dir, monkeypatch, capsys
):
    plan = tiny_campaign(mnist_dir, order=["rmnist-shards", "rmnist-dirichlet"])
    narrowed = campaign.only(plan, "rmnist-dirichlet", " fedrep,cafeme")
    labels = [unit.label for unit in campaign.units(narrowed, tmp_path)]
    assert labels == ["rmnist-dirichlet/cafeme", "rmnist-dirichlet/fedrep"]  # the preset's order
    assert campaign.next_unit(narrowed, tmp_path / "kept", tmp_path, None)[0] == "rmnist-dirichlet/cafeme"
    assert plan.get("methods") is None  # the campaign itself is not changed
    with pytest.raises(FedmetaError, match="--methods takes some of .*its methods: cafeme, fedavg,"):
        campaign.only(plan, None, "fedavg,telepathy")
    from fedmeta.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parent.parent / "configs" / "campaign_cpu.yaml"
    assert main(["campaign", "--config", str(config), "--methods", "fedavg"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fedmeta: error: --methods narrows a job or a profile: give it --budget, --until or --profile"
    )


def test_units_whose_data_is_not_here_are_skipped_in_one_line(tmp_path, mnist_dir, monkeypatch, capsys):
    plan = tiny_campaign(mnist_dir)
    plan.overrides = [o for o in plan.overrides if not o.startswith("dataset.dir=")] + [
        f"dataset.dir={tmp_path}"
    ]
    monkeypatch.setattr(grid, "run", lambda *args, **kwargs: pytest.fail("a unit without its data ran"))
    record = campaign.run(plan, 600, tmp_path / "kept", tmp_path / "runs", parallel=1)
    said = capsys.readouterr().out.splitlines()
    assert (
        said.count(f"skipped the units whose data is not on this machine: mnist.npz not in {tmp_path}") == 1
    )
    assert len(record["not_done"]) == len(campaign.units(plan, tmp_path)) and not record["units"]


def test_a_checkpoint_of_other_settings_is_refused_in_one_line_and_kept(
    tmp_path, mnist_dir, monkeypatch, capsys
):
    plan = tiny_campaign(mnist_dir)
    kept = tmp_path / "kept"
    unit = campaign.units(plan, tmp_path / "runs")[8]  # local: quick to run
    job = unit.jobs[0]
    monkeypatch.setattr(Stopper, "MARGIN", 1e9)
    with pytest.raises(RunStopped):
        train(
            compose(
                [
                    *job.overrides,
                    "method.batch_size=8",
                    f"output.root={kept}",
                    f"output.stop_at={time.time() + 600:.0f}",
                ]
            ),
            show_progress=False,
        )
    saved = (unit.folders(kept)[0] / "checkpoint.ckpt").read_bytes()
    problem = campaign.carry_in(unit, kept, tmp_path / "runs")
    assert "was written by other settings (method.batch_size: 8 there" in problem
    assert (unit.folders(kept)[0] / "checkpoint.ckpt").read_bytes() == saved
    assert not unit.folders(tmp_path / "runs")[0].exists()  # nothing carried in


@pytest.mark.slow
def test_a_carried_checkpoint_continues_in_the_next_job_on_another_machine(
    tmp_path, mnist_dir, monkeypatch, capsys
):
    """A job stops a unit at round 1 and carries its checkpoint out; the next job, in another runs
    folder (another machine, from the files a clone holds), carries it in and finishes it from there."""
    monkeypatch.chdir(tmp_path)
    plan = tiny_campaign(mnist_dir, methods=["local"])
    kept = tmp_path / "results" / "runs" / "quick"
    first_machine, second_machine = tmp_path / "one", tmp_path / "two"
    [unit] = campaign.units(plan, first_machine)
    stacked = grid.stacked(unit.jobs)[0]
    monkeypatch.setattr(Stopper, "MARGIN", 1e9)
    with pytest.raises(RunStopped):
        train(compose([*stacked.overrides, f"output.stop_at={time.time() + 600:.0f}"]), show_progress=False)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert campaign.carry_out([unit], first_machine, kept) > 0
    shutil.rmtree(first_machine)
    assert unit.rounds_done(kept) == [1, 1, 1]
    record = campaign.run(plan, 900, kept, second_machine, parallel=1)
    assert f"resuming {unit.label} at rounds [1, 1, 1]" in capsys.readouterr().out
    assert record["units"][unit.label] == [[1, 1, 1], [3, 3, 3]]
    for folder in unit.folders(kept):
        assert (folder / "summary.json").is_file() and not (folder / "checkpoint.ckpt").exists()
        assert '"resumed_at_round": 1' in (folder / "summary.json").read_text()
    assert "| 1 | rmnist-shards | local | done |" in campaign.status(plan, kept)


def test_the_state_speaks_in_leases_of_one_and_two_commands_from_speeds_measured_alone(
    tmp_path, mnist_dir, monkeypatch
):
    """Each unit's rounds measured alone (not those of a job that ran several units at once, nor those
    with other work busy beside them), and an
    evaluation's seconds from a job's profile line, give the card time left and the leases of one
    and of two commands; the units no lease reaches are named."""
    from fedmeta.profiling import MEASURED

    monkeypatch.chdir(tmp_path)  # results/gpu/ here: the repository's measurements are not read
    lease = {
        "device_seconds": 900,
        "start_seconds": 100,
        "command_seconds": 500,
        "between_commands_seconds": 50,
        "command_overhead_seconds": 100,
        "profile_seconds": 30,
    }
    plan = tiny_campaign(mnist_dir, lease=lease)
    kept = tmp_path / "kept"
    units = campaign.units(plan, kept)
    # every seed at 2 s a round alone; 9 s beside other units (round 1, a job of two at once) and 7 s
    # while other work kept more than a quarter of a core busy (rounds 3 and 6); none begun
    for unit in units:
        for folder in unit.folders(kept):
            folder.mkdir(parents=True)
            (folder / "metrics.csv").write_text(
                "round,round_seconds,beside_cores\n1,9.0,\n2,2.0,0.1\n3,7.0,1.5\n4,zz,\n5,2.0,\n6,7.0,0.3\n"
            )  # zz: skipped; no beside_cores: a round from before fedmeta measured it
    kept.joinpath("jobs.jsonl").write_text(
        json.dumps(
            {
                "id": "0123456789ab",
                "started": "2026-12-01T00:00:00+00:00",
                "hardware": "a card",
                "budget_seconds": 500.0,
                "seconds": 400.0,
                "parallel": 2,
                "units": {u.label: [[0] * len(u.jobs), [1] * len(u.jobs)] for u in units},
                "carry_mib": 28.0,
                "overrides": [],
                "not_done": [],
                "ended": True,
            }
        )
        + "\n"
    )
    logs = tmp_path / "results" / "gpu" / "jobs"
    logs.mkdir(parents=True)
    profiled = {
        "unit": units[0].label,
        "preset": "quick",
        "date": "2026-12-01",
        "seconds_per_seed_round": 5.0,
    }
    logs.joinpath("0123456789ab.log").write_text(
        "machine: a card\n" + MEASURED + json.dumps(profiled | {"evaluation_seconds": 30.0}) + "\n"
    )
    state = campaign.status(plan, kept)
    evaluations = [campaign._evaluations_left(u, 0) for u in units]  # the quick preset's, per unit
    assert evaluations[0] >= 1
    assert f"| 1 | rmnist-shards | {units[0].method} | to do | 2.0000 | {evaluations[0]} |" in state
    seconds = sum(len(u.jobs) * u.rounds * 2.0 for u in units) + evaluations[0] * 30.0  # its own rounds
    one, two = 500 - 100 - 30, 500 - 100 - 30 + (900 - 100 - 500 - 50 - 100)  # the profile: the first's
    assert (
        f"{len(units)} units need {seconds / 3600:.2f} h of a card: "
        f"**{campaign._count(math.ceil(seconds / one), 'lease')} of one command, {math.ceil(seconds / two)} of two**"
        in state
    )
    assert f"trains {one} s in one command of 500 s" in state and f"and {two} s in two" in state
    assert f"and {sum(evaluations[1:])} evaluations whose time is not measured yet" in state
    assert "Not reachable" not in state
    plan.not_in_leases = {"rmnist": "its data cannot travel"}
    state = campaign.status(plan, kept)
    assert (
        f"**Not reachable in leases: {len(units)} units of rmnist** (rmnist-shards): its data cannot travel."
        in state
    )
    assert "nothing is left that a lease can reach" in state


def test_a_unit_measured_only_beside_other_work_takes_that_speed_marked_as_such(
    tmp_path, mnist_dir, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # results/gpu/ here: the repository's measurements are not read
    plan = tiny_campaign(mnist_dir, lease=None)
    kept = tmp_path / "kept"
    unit = campaign.units(plan, kept)[0]
    for folder in unit.folders(kept):  # a second job on the other core all along: a core busy beside
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text("round,round_seconds,beside_cores\n1,3.0,1.02\n2,3.2,0.98\n")
    state = campaign.status(plan, kept)
    assert f"| 1 | rmnist-shards | {unit.method} | to do | ~3.1000 |" in state
    assert "~ marks a speed from rounds with other work beside them" in state
    logs = tmp_path / "results" / "gpu" / "jobs"  # a profile beside a job on the other core: its few
    logs.mkdir(parents=True)  # rounds count only where a job's rounds do not say
    profiled = {"unit": unit.label, "preset": "quick", "seconds_per_seed_round": 5.0, "beside_cores": 1.1}
    (logs / "profile.log").write_text(campaign.MEASURED + json.dumps(profiled) + "\n")
    assert f"| 1 | rmnist-shards | {unit.method} | to do | ~3.1000 |" in campaign.status(plan, kept)
    for folder in unit.folders(kept):
        (folder / "metrics.csv").unlink()
    assert f"| 1 | rmnist-shards | {unit.method} | to do | ~5.0000 |" in campaign.status(plan, kept)
    alone = profiled | {"beside_cores": 0.1, "seeds": 1, "evaluation_seconds": 600.0}
    (logs / "profile.log").write_text(campaign.MEASURED + json.dumps(alone) + "\n")
    [row] = [line for line in campaign.status(plan, kept).splitlines() if line.startswith("| 1 |")]
    assert row.startswith(f"| 1 | rmnist-shards | {unit.method} | to do | 5.0000 |")
    evaluations, hours = int(row.split("|")[6]), float(row.split("|")[7].removesuffix(" h "))
    seeds = len(unit.jobs)  # the profile evaluated one seed: the unit's seeds, one after another, cost each
    assert evaluations and hours == round((unit.rounds * seeds * 5.0 + evaluations * seeds * 600.0) / 3600, 2)


def test_a_unit_with_no_evaluation_measured_takes_its_methods_on_the_same_data_set(
    tmp_path, mnist_dir, monkeypatch
):
    """Its own rounds' speed, but the evaluation's seconds of the same method in the data set's
    other setting; with none measured anywhere, its evaluations are said to be unmeasured."""
    monkeypatch.chdir(tmp_path)
    plan = tiny_campaign(mnist_dir, methods=["fedavg"], order=["rmnist-shards", "rmnist-dirichlet"])
    kept = tmp_path / "kept"
    shards, dirichlet = campaign.units(plan, kept)[:2]
    assert dirichlet.setting == "rmnist-dirichlet" and shards.method == dirichlet.method
    for unit, seconds in ((shards, 2.0), (dirichlet, 3.0)):
        for folder in unit.folders(kept):
            folder.mkdir(parents=True)
            (folder / "metrics.csv").write_text(f"round,round_seconds,beside_cores\n1,{seconds},0.0\n")
    evaluations = campaign._evaluations_left(dirichlet, 0)
    both = evaluations + campaign._evaluations_left(shards, 0)
    assert evaluations >= 1
    assert f"and {both} evaluations whose time is not measured yet" in campaign.status(plan, kept)
    logs = tmp_path / "results" / "gpu" / "jobs"
    logs.mkdir(parents=True)
    profiled = {"unit": shards.label, "preset": "quick", "seconds_per_seed_round": 2.0}
    (logs / "profile.log").write_text(
        campaign.MEASURED + json.dumps(profiled | {"evaluation_seconds": 600.0}) + "\n"
    )
    state = campaign.status(plan, kept)
    assert "evaluations whose time is not measured yet" not in state
    [row] = [line for line in state.splitlines() if line.startswith("| 2 |")]
    assert row.startswith(f"| 2 | rmnist-dirichlet | {dirichlet.method} | to do | 3.0000 | {evaluations} |")
    seeds = len(dirichlet.jobs)
    assert float(row.split("|")[7].removesuffix(" h ")) == round(
        (dirichlet.rounds * seeds * 3.0 + evaluations * 600.0) / 3600, 2
    )


def test_an_evaluation_costs_what_a_finished_runs_wall_time_leaves_over_its_rounds(tmp_path):
    """A run that trained its seed alone in one process: (wall − its rounds' seconds) / evaluations;
    nothing from a stacked or a resumed run (whose wall time holds two setups)."""
    run = tmp_path / "seed0"
    run.mkdir()
    (run / "metrics.csv").write_text(
        "round,train_loss,round_seconds,eval_accuracy\n1,0.9,10.0,0.5\n2,0.8,10.0,\n3,0.7,10.0,0.6\n"
    )
    summary = {"accuracy": 0.6, "curve": [0.6], "rounds": 3, "seconds": 110.0, "seeds_stacked": 1}
    (run / "summary.json").write_text(json.dumps(summary))
    assert campaign._evaluation_seconds(run) == pytest.approx(40.0)
    for other in ({"seeds_stacked": 3}, {"resumed_at_round": 2}, {"seconds": 20.0}):
        (run / "summary.json").write_text(json.dumps(summary | other))
        assert campaign._evaluation_seconds(run) is None, other


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_a_jobs_profile_measures_the_next_unit_alone_and_the_state_reads_it_back(
    tmp_path, mnist_dir, monkeypatch, capsys
):
    """``fedmeta campaign --profile``: the unit a job would run first (the one under way) is timed
    alone, evaluated once and profiled; its ``measured alone`` line, kept in a job's log, is the
    speed and evaluation time the state counts with; its kept runs are not touched. Then the same
    method in the other setting of its data set shares its process: as lanes of one round (and, on a
    card, on a second CUDA stream), against the two one after the other."""
    from fedmeta.profiling import FILL, MEASURED, profile_unit

    monkeypatch.chdir(tmp_path)
    plan = tiny_campaign(mnist_dir, methods=["local", "fedavg"], order=["rmnist-shards", "rmnist-dirichlet"])
    kept = tmp_path / "kept"
    local, fedavg, *_ = campaign.units(plan, kept)
    folder = fedavg.folders(kept)[0]
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text(
        "round,round_seconds\n"
    )  # under way, no checkpoint yet: nothing to refuse
    torch.save({"round": 1}, tmp_path / "not-a-checkpoint")
    before = sorted((p, p.stat().st_mtime_ns) for p in kept.rglob("*"))
    label, overrides = campaign.next_unit(plan, kept, tmp_path / "runs", carry_mib=None)
    partner = campaign.fill_partner(plan, kept, tmp_path / "runs", None, (label, overrides))
    assert partner[0] == "rmnist-dirichlet/local"  # the same method and data, another setting
    profile_unit(label, plan.preset, overrides, seconds=600, partner=partner)
    out = capsys.readouterr().out
    assert sorted((p, p.stat().st_mtime_ns) for p in kept.rglob("*")) == before
    assert not (tmp_path / "runs").exists()  # set up in memory: no run folder written
    [line] = [line for line in out.splitlines() if line.startswith(MEASURED)]
    measured = json.loads(line[len(MEASURED) :])
    assert measured["unit"] == local.label  # the first unit: nothing is under way with a checkpoint
    assert (
        measured["seeds"] == 3
        and measured["seconds_per_seed_round"] > 0
        and measured["evaluation_seconds"] > 0
    )
    assert f"profile {local.label}: one round" in out and "TFLOP/s achieved" in out
    [line] = [line for line in out.splitlines() if line.startswith(FILL)]
    fill = json.loads(line[len(FILL) :])
    assert fill["partner"] == partner[0] and fill["seeds"] == [3, 3]
    assert fill["one_after_the_other"] > 0 and fill["lanes"] > 0 and fill["streams"] is None
    assert (
        fill["notes"] == []
    )  # every way's timed rounds were replays of the same computation, no client dropped
    assert "two CUDA streams: a card's only" in out
    logs = tmp_path / "results" / "gpu" / "jobs"
    logs.mkdir(parents=True)
    (logs / "0123456789ab.log").write_text(out)
    [record] = campaign.alone_records("quick")
    assert record["seconds_per_seed_round"] == measured["seconds_per_seed_round"]
    assert campaign.alone_records("paper") == []  # another preset's units are other runs
    state = campaign.status(plan, kept)
    mark = "~" if measured["beside_cores"] > ALONE_CORES else ""  # other tests on the other core
    assert f"| 1 | rmnist-shards | local | to do | {mark}{measured['seconds_per_seed_round']:.4f} |" in state
    [record] = campaign.fill_records("quick")
    assert record["lanes"] == fill["lanes"] and record["hardware"] == measured["hardware"]
    assert (
        f"| {measured['hardware']} | {local.label} + {partner[0]} | {fill['one_after_the_other']:.4f} | "
        f"{fill['lanes']:.4f} | - |" in state
    )


@pytest.mark.parametrize(
    "change, said",
    [
        ("preset: paper\norder: [rmnist-shards\n", "is not valid YAML (line"),
        ("- a\n- list\n", "holds no settings"),
        ("", "holds no settings"),
        ("DROP reserve_seconds", "lacks reserve_seconds"),
        ("reserve_seconds: -100", "reserve_seconds must be 5 to 600"),
        ("parallel: {cuda: 9, cpu: 0}", "parallel must be {cuda: N, cpu: N}"),
        ("carry_mib: abc", "carry_mib must be a size in MiB ≥ 0"),
        ("carry_mib: .nan", "carry_mib must be a size in MiB ≥ 0"),
        ("orders: [rmnist-shards]", "unknown setting 'orders'"),
        ("lease: {device_seconds: 60, start_seconds: 90, overhead: 0.1}", "lease must be"),
        (
            "lease: {device_seconds: 900, start_seconds: 45, command_seconds: 900, between_commands_seconds: 40, "
            "command_overhead_seconds: 100, profile_seconds: 75}",
            "lease must be",
        ),
        (
            "lease: {device_seconds: 900, start_seconds: 45, command_seconds: 580, between_commands_seconds: 40, "
            "command_overhead_seconds: 100}",
            "lease must be",
        ),
        ("methods: [bogus]", "names methods the preset paper lacks: ['bogus']"),
        ("methods: [local, local]", "methods lists local twice"),
    ],
)
def test_a_campaign_file_that_is_not_one_is_refused_in_one_line(tmp_path, change, said):
    lines = (Path(__file__).resolve().parent.parent / "configs" / "campaign.yaml").read_text().splitlines()
    if change.startswith("DROP "):
        text = "\n".join(line for line in lines if not line.startswith(change[5:] + ":"))
    elif change.startswith(("preset:", "- ")) or not change:  # a whole file
        text = change
    else:  # one setting changed, or added
        key = change.split(":")[0] + ":"
        text = "\n".join(change if line.startswith(key) else line for line in lines)
        text += "" if any(line.startswith(key) for line in lines) else "\n" + change
    path = tmp_path / "campaign.yaml"
    path.write_text(text)
    with pytest.raises(FedmetaError) as error:
        campaign.units(campaign.load(path), tmp_path)
    assert said in str(error.value) and "\n" not in str(error.value)


def test_a_unit_whose_seeds_cannot_travel_together_runs_in_chunks_that_can(mnist_dir):
    """IFCA keeps four models a seed (~10 MiB on RMNIST): within 28 MiB, its seeds stack two by two,
    so whatever a job leaves unfinished can come back and travel with the next."""
    plan = tiny_campaign(mnist_dir, methods=["ifca", "cafeme"])
    plan.overrides = [o for o in plan.overrides if not o.startswith("model.")]  # the paper's CNN
    ifca, cafeme = campaign.units(plan, Path("runs"))
    processes = grid.stacked(campaign.chunks(ifca, 28))
    assert [job.stacked_seeds or [job.seed] for job in processes] == [[0, 1], [2]]
    assert [job.stacked_seeds for job in grid.stacked(campaign.chunks(cafeme, 28))] == [[0, 1, 2]]
    assert [job.stacked_seeds for job in grid.stacked(campaign.chunks(ifca, None))] == [[0, 1, 2]]


def test_sigterm_while_the_data_loads_is_a_stop_not_a_corrupt_file(tmp_path, mnist_dir, monkeypatch):
    real = np.load

    def load_then_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    data = tmp_path / "data"  # a folder of its own: the data set is read here, not taken from the tests' memo
    data.mkdir()
    shutil.copy(mnist_dir / "mnist.npz", data)
    monkeypatch.setattr(np, "load", load_then_sigterm)
    with pytest.raises(RunStopped, match="stopped by SIGTERM"):
        train(
            compose(["method=fedavg", *TINY, f"dataset.dir={data}", f"output.root={tmp_path}"]),
            show_progress=False,
        )


def test_sigterm_while_a_run_starts_is_a_stop_in_one_line(tmp_path, monkeypatch, capsys):
    from fedmeta import cli, config

    def compose_then_sigterm(overrides):
        os.kill(os.getpid(), signal.SIGTERM)
        return compose(overrides)

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(config, "compose", compose_then_sigterm)  # the CLI imports it when it runs
    try:
        status = cli.main(["train", "method=fedavg", f"output.root={tmp_path}"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    said = capsys.readouterr().err.strip().splitlines()
    assert (
        status == RunStopped.EXIT_STATUS and len(said) == 1 and "stopped by SIGTERM while starting" in said[0]
    )


def test_a_turn_is_held_by_one_run_at_a_time_and_let_go_when_its_process_dies(tmp_path):
    from fedmeta.runs import DeviceTurn

    turns = DeviceTurn.make(tmp_path / "turns", 1)
    first, second = DeviceTurn(turns), DeviceTurn(turns)
    assert first.wait(None)
    assert not second.wait(time.time() + 0.5)  # its deadline passes while the other holds the turn
    first.release()
    assert second.wait(time.time() + 0.5)
    second.release()
    fork = multiprocessing.get_context("fork")  # another process, without importing torch again
    held = fork.Event()
    holder = fork.Process(target=hold_turn, args=(turns, held), daemon=True)
    holder.start()
    assert held.wait(60)
    assert not first.wait(time.time() + 0.5)
    holder.kill()  # as a lease's end kills a job (SIGKILL): the system lets its lock go
    holder.join()
    assert first.wait(time.time() + 5)


def hold_turn(turns: Path, held) -> None:
    from fedmeta.runs import DeviceTurn

    turn = DeviceTurn(turns)
    turn.wait(None)
    held.set()
    time.sleep(60)


def test_a_unit_started_ahead_starts_only_once_the_unit_before_it_holds_its_turn(tmp_path):
    """Turns go in the queue's order: the unit under way (whose checkpoint travels) is never overtaken
    by a later one that set up faster."""
    from fedmeta.runs import DeviceTurn

    turns = DeviceTurn.make(tmp_path / "turns", 1)
    may_start = grid.turn_gate(turns, parallel=1, ahead=1)
    assert may_start(0)  # the first unit starts at once
    assert not may_start(1)  # the next waits while the first sets up
    first = DeviceTurn(turns)
    assert first.wait(None) and DeviceTurn.held(turns) == 1
    assert may_start(1)  # the first trains: the next sets up beside it
    assert not may_start(2)  # and one setting up ahead is enough
    first.release()  # the first ended; the one set up ahead has not taken the turn yet
    assert DeviceTurn.held(turns) == 0 and not may_start(1)
    assert first.wait(None)  # the turn is free after each check: the waiting unit takes it
    first.release()


@pytest.mark.slow  # training processes: minutes on 2 cores
def test_a_run_sets_up_then_waits_for_its_turn_and_stops_in_one_line_at_its_deadline(tmp_path, mnist_dir):
    from fedmeta.runs import DeviceTurn

    turns = DeviceTurn.make(tmp_path / "turns", 1)
    busy = DeviceTurn(turns)
    assert busy.wait(None)  # another unit trains
    cfg = compose(
        [
            "method=fedavg",
            *TINY,
            f"dataset.dir={mnist_dir}",
            f"output.root={tmp_path / 'runs'}",
            f"output.turns={turns}",
            f"output.stop_at={time.time() + 3:.0f}",
        ]
    )
    with pytest.raises(RunStopped, match="waited for a turn on the device"):
        train(cfg, show_progress=False)
    assert not list((tmp_path / "runs").rglob("checkpoint.ckpt"))  # it trained nothing
    busy.release()
    summary = train(cfg | {"output": {"stop_at": None, "resume": True}}, show_progress=False)
    assert summary["rounds"] == 4  # with the turn free it runs


@pytest.mark.slow
def test_units_started_ahead_train_one_at_a_time_and_all_finish(tmp_path, mnist_dir):
    """Two units with one turn and one started ahead: the second sets up while the first trains,
    never trains beside it, and both finish."""
    jobs = grid.stacked(
        [
            job
            for unit in campaign.units(tiny_campaign(mnist_dir, methods=["fedavg", "fedavg_ft"]), tmp_path)
            for job in unit.jobs
        ]
    )
    assert grid.run(jobs, tmp_path, parallel=1, ahead=1) == []
    logs = {
        job.method: (tmp_path / "logs" / f"{job.label.replace('/', '-')}.log").read_text() for job in jobs
    }
    assert all("waiting for a turn on the device" in log for log in logs.values())
    waited = {
        method: float(re.search(r"took a turn on the device after ([\d.]+) s", log)[1])
        for method, log in logs.items()
    }
    # the queue's order: the first unit's turn at once; the second set up while it trained, then waited
    assert waited["fedavg"] < 1.0 and waited["fedavg"] < waited["fedavg_ft"]
    for job in jobs:
        assert (tmp_path / job.setting / job.method / "seed0" / "summary.json").is_file()


def test_the_cpu_campaign_runs_every_table_setting_then_the_heterogeneity_figures_four_methods():
    """configs/campaign_cpu.yaml: the six settings of the paper's table with the nine methods, then
    the heterogeneity figure's RMNIST points with the four methods the figure draws, at the CPU
    preset's round budgets, Meta-Dataset on the sources this machine has."""
    plan = campaign.load(Path("configs/campaign_cpu.yaml"))
    preset = grid.load_preset(plan.preset)
    units = campaign.units(plan, Path("runs/cpu"))
    table = [u for u in units if preset.settings[u.setting].grid == "table"]
    figure = [u for u in units if preset.settings[u.setting].grid == "heterogeneity"]
    assert units == table + figure and len(table) == 6 * 9
    assert {u.method for u in figure} == {"cafeme", "fedavg_ft", "ditto", "fedrep"} and len(figure) == 3 * 4
    assert all(len(u.jobs) == 3 and all(j.method == u.method for j in u.jobs) for u in units)
    rounds = {u.setting.split("-")[0]: u.rounds for u in units}
    assert rounds == {"rmnist": 50, "femnist": 50, "cifar10": 20, "meta_dataset": 20}
    meta = next(u for u in units if u.setting == "meta_dataset-sources")
    sources = compose(list(meta.jobs[0].overrides)).dataset.options.sources
    assert "fgvc_aircraft32" not in sources and "cifar_fs32" not in sources and len(sources) == 6
    assert "federation.vectorize=auto" in meta.jobs[0].overrides  # the faster way measured here


def test_a_setting_may_name_only_methods_of_its_preset(tmp_path):
    """A figure's setting that names a method its preset does not run is refused in one line."""
    bad = tmp_path / "preset"
    bad.mkdir()
    (bad / "odd.yaml").write_text(
        "inherits: quick\nsettings:\n  rmnist-iid: {grid: heterogeneity, methods: [fedsgd], "
        "overrides: [dataset=rmnist, partition=iid]}\n"
    )
    problem = grid._preset_problem(
        OmegaConf.merge(grid.load_preset("quick"), OmegaConf.load(bad / "odd.yaml"))
    )
    assert problem.startswith("settings.rmnist-iid.methods must list some of the preset's methods")


def test_a_campaign_on_a_machine_of_its_own_speaks_in_its_hours(tmp_path, mnist_dir, monkeypatch):
    """``lease: null``: what is left is the units' hours on this machine, one unit at a time; no
    leases and no card."""
    monkeypatch.chdir(tmp_path)
    plan = tiny_campaign(mnist_dir, lease=None)
    kept = tmp_path / "kept"
    units = campaign.units(plan, kept)
    for unit in units:  # every seed at 2 s a round alone, none begun
        for folder in unit.folders(kept):
            folder.mkdir(parents=True)
            (folder / "metrics.csv").write_text("round,round_seconds\n1,2.0\n2,2.0\n")
    state = campaign.status(plan, kept)
    seconds = sum(len(u.jobs) * u.rounds * 2.0 for u in units)
    assert f"{len(units)} units need **{seconds / 3600:.1f} h**" in state
    assert "| h left |" in state and "lease" not in state.lower() and "Filling the card" not in state


def test_profile_with_collect_is_refused_before_anything_is_collected(tmp_path, monkeypatch, capsys):
    """``--profile`` measures on its own: given with ``--collect`` it is refused in one line, and the
    folder it names is not collected first (nothing kept changes, no job recorded)."""
    from fedmeta.cli import main

    monkeypatch.chdir(tmp_path)
    collected = []
    monkeypatch.setattr(campaign, "collect", lambda *a, **k: collected.append(a) or [])
    config = Path(__file__).resolve().parent.parent / "configs" / "campaign.yaml"
    assert main(["campaign", "--config", str(config), "--profile", "30", "--collect", str(tmp_path)]) == 2
    assert collected == [] and not (tmp_path / "results").exists()
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "--profile measures the next unit on its own" in said[0]


def test_a_profile_speaks_as_it_goes_and_ends_at_its_seconds(tmp_path, mnist_dir, monkeypatch, capsys):
    """``--profile`` says what it is doing before each slow step, and its seconds bound it even
    inside a first round longer than all of them: one line then says they ran out."""
    from fedmeta.errors import FedmetaError
    from fedmeta.profiling import profile_unit

    monkeypatch.chdir(tmp_path)
    plan = tiny_campaign(mnist_dir, methods=["fedavg"])
    label, overrides = campaign.next_unit(plan, tmp_path / "kept", tmp_path / "runs", carry_mib=None)
    started = time.monotonic()
    with pytest.raises(FedmetaError, match=r"its 1 s ran out; what it measured is above") as raised:
        profile_unit(label, plan.preset, [*overrides, "method.local_epochs=50"], seconds=1.0)
    assert time.monotonic() - started < 10 and "\n" not in str(raised.value)
    assert capsys.readouterr().out.startswith(
        f"profile {label}: setting up its runs (data, model; 1 s in all)"
    )


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_a_profile_evaluates_by_the_protocol_its_runs_score_by(tmp_path, mnist_dir, monkeypatch, capsys):
    """A campaign whose runs score the training clients too (evaluation.protocol=both) is projected
    with that evaluation's seconds, not the new clients' alone."""
    from fedmeta import profiling, rounds
    from fedmeta.profiling import MEASURED, profile_unit

    class Evaluated(Exception):
        """The kernel profile that follows the evaluation: the test above's, not this one's."""

    monkeypatch.chdir(tmp_path)
    plan = tiny_campaign(mnist_dir, methods=["local"])
    label, overrides = campaign.next_unit(plan, tmp_path / "kept", tmp_path / "runs", carry_mib=None)
    asked = []
    evaluate = rounds.evaluate_on_ranks
    monkeypatch.setattr(
        rounds, "evaluate_on_ranks", lambda *a, **k: asked.append(k.get("protocol")) or evaluate(*a, **k)
    )
    monkeypatch.setattr(profiling, "_top_kernels", lambda *a: (_ for _ in ()).throw(Evaluated()))
    monkeypatch.setattr(profiling, "WARMUP_ROUNDS", 0)  # a round's seconds is all the evaluation needs
    monkeypatch.setattr(profiling, "TIMED_ROUNDS", 1)
    with pytest.raises(Evaluated):
        # 12 clients, not RMNIST's 100: every training client is scored, each taking the new clients' steps
        both = [*overrides, "evaluation.protocol=both", "federation.num_clients=12"]
        profile_unit(label, plan.preset, both, seconds=600)
    out = capsys.readouterr().out
    assert asked == ["both"] and f"profile {label}: one evaluation (both)" in out
    [line] = [line for line in out.splitlines() if line.startswith(MEASURED)]
    assert json.loads(line[len(MEASURED) :])["evaluation_seconds"] > 0


def test_a_jobs_record_counts_the_seeds_earlier_jobs_finished_and_the_state_lists_jobs_as_they_ran(
    tmp_path, mnist_dir, monkeypatch
):
    """A unit whose first seed an earlier job finished (its run kept, not in this job's folder) and
    whose second is checkpointed reads [3, 1, 0] → [3, 3, 0], not [0, 1, 0] → [0, 3, 0]; the state
    lists jobs in the order they started, each with the jobs that ran beside it."""
    plan = tiny_campaign(mnist_dir)
    kept, root = tmp_path / "kept", tmp_path / "runs"
    unit = campaign.units(plan, root)[0]
    first, second, _ = unit.folders(kept)
    first.mkdir(parents=True)
    (first / "summary.json").write_text("{}")
    second.mkdir(parents=True)
    torch.save({"round": 1}, second / "checkpoint.ckpt")

    def finish_the_second(jobs, root_, parallel, kept_, stop_at, **_):
        folder = unit.folders(root_)[1]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "summary.json").write_text("{}")
        return ["stopped: at the deadline"]

    monkeypatch.setattr(campaign, "carry_in", lambda unit, kept, root: None)
    monkeypatch.setattr(grid, "run", finish_the_second)
    record = campaign.run(plan, 600, kept, root, parallel=1)
    assert record["units"] == {unit.label: [[3, 1, 0], [3, 3, 0]]}

    late, early, apart = dict(record), dict(record), dict(record)
    late |= {"started": "2026-12-05T06:33:20+00:00", "seconds": 3830.0, "units": {"late": [[0], [1]]}}
    early |= {"started": "2026-12-05T06:31:00+00:00", "seconds": 3986.0, "units": {"early": [[0], [1]]}}
    apart |= {"started": "2026-12-05T09:00:00+00:00", "seconds": 60.0, "units": {"apart": [[0], [1]]}}
    (kept / "jobs.jsonl").write_text("".join(json.dumps(job) + "\n" for job in (late, early, apart)))
    jobs = campaign.status(plan, kept).split("## Jobs")[1]
    rows = [line for line in jobs.splitlines() if line.startswith("| 2026")]
    assert [row.split(" | ")[-1] for row in rows] == [
        "early: [0] → [1] |",
        "late: [0] → [1] |",
        "apart: [0] → [1] |",
    ]
    assert [row.split(" | ")[-2] for row in rows] == ["1", "1", "0"]
