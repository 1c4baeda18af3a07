"""``fedmeta table`` / ``fedmeta figures``: a real (tiny) grid of runs, resumed, tabulated and drawn."""

import json
import os
import shlex
import shutil
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedmeta import grid
from fedmeta.cli import main
from fedmeta.errors import FedmetaError, RunStopped
from fedmeta.grid import Job, dispatch, load_preset, plan, preset_budget, sources
from fedmeta.runs import TOOK_A_TURN, WAITING_FOR_A_TURN
from fedmeta.stopping import FIRST_ROUND_ENDED

TINY = [
    "federation.rounds=2",
    "federation.eval_every=1",
    "personalization.steps=3",
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "logger=[]",
]


def test_presets_cover_the_papers_table_and_figures():
    quick, paper = load_preset("quick"), load_preset("paper")
    table = {name for name, s in paper.settings.items() if s.grid == "table"}
    assert table == {
        "cifar10-shards",
        "cifar10-dirichlet",
        "rmnist-shards",
        "rmnist-dirichlet",
        "femnist-writers",
        "meta_dataset-sources",
    }
    assert list(quick.settings) == list(paper.settings) and len(quick.seeds) >= 3
    jobs = plan(quick, root=Path("runs/quick"), grids=["table"], datasets=["rmnist"])
    assert len(jobs) == 2 * len(quick.methods) * len(quick.seeds)
    assert "federation.rounds=20" in jobs[0].overrides and "output.setting=rmnist-shards" in jobs[0].overrides
    assert [j.seed for j in jobs[: len(quick.methods)]] == [0] * len(
        quick.methods
    )  # every method of seed 0 first
    one_setting = plan(quick, root=Path("runs/quick"), grids=["table"], datasets=["cifar10-shards"])
    assert {j.setting for j in one_setting} == {"cifar10-shards"} and len(one_setting) == len(jobs) // 2
    with pytest.raises(FedmetaError, match="cifar100"):
        plan(quick, root=Path("runs/quick"), grids=["table"], datasets=["cifar100"])


@pytest.mark.slow
def test_table_runs_resumes_and_reports(tmp_path, monkeypatch, mnist_dir, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    args = [
        "table",
        "--datasets",
        "rmnist",
        "--methods",
        "local",
        "perfedavg",
        "--seeds",
        "0",
        "1",
        "--parallel",
        "2",
        *TINY,
    ]
    assert main(args) == 0
    runs = sorted(tmp_path.glob("runs/quick/*/*/seed*/summary.json"))
    assert len(runs) == 8
    table = (tmp_path / "results" / "TABLES.md").read_text()
    perfedavg = next(line for line in table.splitlines() if line.startswith("| Per-FedAvg"))
    accuracies = [
        json.loads(p.read_text())["accuracy"] for p in runs if "perfedavg" in str(p) and "shards" in str(p)
    ]
    mean = 100 * sum(accuracies) / 2
    assert f"{mean:.2f}" in perfedavg and "paper" not in perfedavg and "(n=2)" in perfedavg  # not its budget
    assert f"- `fedmeta {shlex.join(args)}` (8 runs)" in table
    assert "| rmnist-dirichlet | local | 0,1 | 2 |" in table

    # An interrupted grid: one run's results gone (never kept, as a run that did not finish) → only it runs again.
    runs[0].unlink()
    (tmp_path / "results" / runs[0].relative_to(tmp_path)).unlink()
    capsys.readouterr()
    assert main(args) == 0
    assert "7 of 8 runs already finished" in capsys.readouterr().out and runs[0].exists()

    assert main(["figures", "--datasets", "rmnist"]) == 0
    written = {p.name for p in (tmp_path / "results" / "figures" / "quick").iterdir()}
    # Heterogeneity from the two table settings on its axis; no Meta-Dataset runs, so no images-per-client
    # figure; 2-round runs have too few evaluations for a convergence figure; each figure's caption beside them
    assert written == {"fig_personalization.png", "fig_heterogeneity.png", "README.md"}

    # A fresh clone has results/runs/ (committed: small files and the compact final model, no checkpoint)
    # and no runs/: --no-run rebuilds the same table.
    kept = sorted(tmp_path.glob("results/runs/quick/*/*/seed*/*"))
    assert {p.name for p in kept} == {
        "config.yaml",
        "metrics.csv",
        "curves.csv",
        "summary.json",
        "command.txt",
        "model.pt",
    } and len(kept) == 48
    # the table as the rerun above left it (its rerun run has a wall time of its own)
    before = (tmp_path / "results" / "TABLES.md").read_text().split("Written")[1].split("\n", 1)[1]
    shutil.rmtree(tmp_path / "runs")
    assert main(["table", "--no-run"]) == 0
    assert (tmp_path / "results" / "TABLES.md").read_text().split("Written")[1].split("\n", 1)[1] == before
    capsys.readouterr()
    assert main(args) == 0  # and the grid counts the kept runs as finished: nothing runs again
    assert (
        "8 of 8 runs already finished" in capsys.readouterr().out
        and not (tmp_path / "runs" / "quick" / "rmnist-shards").exists()
    )


@pytest.mark.slow
def test_vectorized_grid_stacks_each_methods_seeds_in_one_process(tmp_path, monkeypatch, mnist_dir, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    args = [
        "table",
        "--datasets",
        "rmnist-shards",
        "--methods",
        "local",
        "perfedavg",
        "--seeds",
        "0",
        "1",
        "--parallel",
        "1",
        *TINY,
        "federation.vectorize=true",
    ]
    assert main(args) == 0
    assert "4 to run in 2 processes" in capsys.readouterr().out
    logs = sorted(p.name for p in tmp_path.glob("runs/quick/logs/*.log"))
    assert logs == ["rmnist-shards-local-seeds0-1.log", "rmnist-shards-perfedavg-seeds0-1.log"]
    summaries = [
        json.loads(p.read_text())
        for p in sorted(tmp_path.glob("runs/quick/rmnist-shards/*/seed*/summary.json"))
    ]
    assert [(s["method"], s["seed"], s["seeds_stacked"]) for s in summaries] == [
        ("local", 0, 2),
        ("local", 1, 2),
        ("perfedavg", 0, 2),
        ("perfedavg", 1, 2),
    ]
    assert "| Per-FedAvg |" in (tmp_path / "results" / "TABLES.md").read_text()


def test_parallel_must_be_positive(capsys):
    assert main(["table", "--parallel", "0"]) == 2
    assert "--parallel must be ≥ 1" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_runs_through_submitit_local_executor_skips_finished_and_reports_failures(
    tmp_path, monkeypatch, mnist_dir, capsys
):
    """fedmeta sweep: every combination of the comma-separated values, each point in its own
    folder, run as submitit jobs (its local executor: the jobs SLURM would get), a table of the
    points; run again, nothing runs; a point that fails is reported in one line with its log."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    args = [
        "sweep",
        "method=local",
        "personalization.lr=0.01,0.05",
        *TINY,
        "--executor",
        "local",
        "--parallel",
        "2",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2 to run in 2 processes, 2 at a time (local)" in out
    summaries = sorted(tmp_path.glob("runs/sweep/*/rmnist-shards/local/seed0/summary.json"))
    assert [p.parts[-5] for p in summaries] == ["personalization.lr=0.01", "personalization.lr=0.05"]
    assert [
        json.loads((p.parent / "config.yaml").read_text().split("lr: ")[1].split()[0]) for p in summaries
    ] == [0.01, 0.05]
    assert len(list(tmp_path.glob("runs/sweep/logs/submitit/*/*_result.pkl"))) == 2  # ran as submitit jobs
    table = (tmp_path / "runs" / "sweep" / "sweep.md").read_text()
    for path in summaries:
        accuracy = 100 * json.loads(path.read_text())["accuracy"]
        assert f"| {path.parts[-5]} | rmnist-shards | local | {accuracy:.2f} ± 0.00 | 1 |" in table

    assert main(args) == 0
    assert "2 of 2 runs already finished" in capsys.readouterr().out

    bad = [
        "sweep",
        "method=local",
        f"dataset.dir={mnist_dir},{tmp_path / 'nowhere'}",
        *TINY,
        "--executor",
        "local",
    ]
    assert main(bad) == 1
    err = capsys.readouterr().err
    assert err.count("fedmeta: failed run:") == 1 and "exit 2" in err and "nowhere" in err


def test_a_table_stopped_by_sigterm_stops_its_runs_writes_what_finished_and_says_so(
    tmp_path, monkeypatch, mnist_dir, capsys
):
    """SIGTERM to ``fedmeta table`` (here sent by its run, a stand-in that then stops as a run does):
    the run stops checkpointed, the table is written from what finished, and the exit status is a
    stop's (75), not success."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    stand_in = tmp_path / "python"
    stand_in.write_text(
        "#!/bin/sh\ntrap 'echo \"fedmeta: stopped after round 1 of 2 (SIGTERM)\"; exit 75' TERM\n"
        "kill -TERM $PPID\nsleep 60 & wait\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setattr(grid.sys, "executable", str(stand_in))
    args = ["table", "--datasets", "rmnist-shards", "--methods", "fedavg,local", "--seeds", "0", *TINY]
    assert main(args) == RunStopped.EXIT_STATUS
    err = capsys.readouterr().err
    assert "fedmeta: stopped: rmnist-shards/fedavg/seed0: stopped after round 1 of 2 (SIGTERM)" in err
    assert "not started: the grid was stopped by SIGTERM" in err and "failed run" not in err
    assert (tmp_path / "results" / "TABLES.md").is_file()


@pytest.mark.slow
def test_a_budget_stops_every_run_checkpointed_and_tables_keep_each_presets_section(
    tmp_path, monkeypatch, mnist_dir, capsys
):
    """fedmeta table --budget S: a run still going at the deadline stops at a round boundary,
    checkpointed, said in one line that is not a failure, and the same command without it continues;
    a preset's section of TABLES.md is written beside the other presets' sections, never over them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    args = ["table", "--datasets", "rmnist-shards", "--methods", "fedavg", "--seeds", "0", *TINY]
    assert main([*args, "federation.rounds=1000", "federation.eval_every=1000", "--budget", "60"]) == 0
    err = capsys.readouterr().err
    assert "fedmeta: stopped: rmnist-shards/fedavg/seed0: stopped after round" in err, err
    assert "failed run" not in err
    log = (tmp_path / "runs" / "quick" / "logs" / "rmnist-shards-fedavg-seed0.log").read_text()
    assert f"{FIRST_ROUND_ENDED} " in log  # what a job's last start leaves (fedmeta.grid.FirstRounds)
    run = tmp_path / "runs" / "quick" / "rmnist-shards" / "fedavg" / "seed0"
    assert (run / "checkpoint.ckpt").is_file() and not (run / "summary.json").exists()
    done = len((run / "metrics.csv").read_text().splitlines()) - 1
    assert main([*args, f"federation.rounds={done + 1}", "federation.eval_every=1000"]) == 0  # one more round
    assert f'"resumed_at_round": {done}' in (run / "summary.json").read_text()
    quick = (tmp_path / "results" / "TABLES.md").read_text()
    assert main(["table", "--preset", "paper", "--no-run"]) == 0
    both = (tmp_path / "results" / "TABLES.md").read_text()
    assert both.startswith("# Results\n") and "## Preset `quick`" in both and "## Preset `paper`" in both
    section = quick[quick.index("<!-- preset quick -->") : quick.index("<!-- end of preset quick -->")]
    assert section in both  # the quick section untouched by the paper one
    assert main(["table", "--no-run", "--budget", "-1"]) == 2
    assert "--budget must be a number of seconds > 0" in capsys.readouterr().err


def test_the_published_chain_hands_each_model_to_the_next_method_in_the_authors_order():
    """The authors' main.py trains one model object through every baseline in turn: each stage of
    the published preset starts from the final model of the one before, in their order."""
    preset = load_preset("published")
    jobs = plan(preset, root=Path("runs/published"), grids=["table"], datasets=["rmnist-shards"], seeds=[0])
    source = {
        j.method: next((o.split("/")[-2] for o in j.overrides if o.startswith("model.init_from=")), None)
        for j in jobs
    }
    assert source == {
        "cafeme-authors": None,
        "perfedavg-authors": None,
        "fedavg-authors": "perfedavg-authors",
        "fedavg_ft-authors": "fedavg-authors",
        "ifca-published": "fedavg-authors",
        "ifca_ft-published": "ifca-published",
        "ifca-published_sharing": "ifca-published",
        "ditto-authors": "ifca-published_sharing",
        "fedrep-authors": "ditto-authors",
    }
    stage = {j.method: j.stage for j in jobs}
    assert all(stage[m] == stage[s] + 1 for m, s in source.items() if s) and stage["fedrep-authors"] == 5
    init = next(
        o
        for j in jobs
        if j.method == "fedrep-authors"
        for o in j.overrides
        if o.startswith("model.init_from=")
    )
    assert (
        init == "model.init_from=runs/published/rmnist-shards/ditto-authors/seed{seed}"
    )  # the same seed's model
    scored_only = [j.method for j in jobs if j.overrides[-1] == "federation.rounds=0"]
    assert scored_only == ["fedavg_ft-authors", "ifca_ft-published"]  # FT scored on their source's model
    from fedmeta.config import compose

    ifca = compose(["method=ifca", "variant=published"])
    assert (ifca.method.clusters, ifca.method.share_body) == (1, False)  # their k references to one model
    with pytest.raises(FedmetaError, match="add those too"):
        plan(
            preset,
            root=Path("runs/published"),
            grids=["table"],
            datasets=["rmnist-shards"],
            methods=["fedrep-authors"],
        )


def test_a_chained_run_starts_when_its_own_source_has_finished_not_the_whole_stage():
    """A chain on a fast setting goes on while a slow setting's first stage still runs; a run whose
    source failed is not started; a stacked run waits for the source runs of its seeds."""
    fast, fast_next = Job("fast", "a", 0, ("seed=0",)), Job("fast", "b", 0, ("seed=0",), stage=1, source="a")
    slow, slow_next = Job("slow", "a", 0, ("seed=0",)), Job("slow", "b", 0, ("seed=0",), stage=1, source="a")
    broken = Job("broken", "a", 0, ("seed=0",))
    broken_next = Job("broken", "b", 0, ("seed=0",), stage=1, source="a")
    polls = {slow: 5}  # how many looks each run takes to finish; 1 for the others
    events = []

    class Handle:
        def __init__(self, job):
            self.job, self.looks = job, 0

        def done(self):
            self.looks += 1
            return self.looks >= polls.get(self.job, 1)

    def start(job):
        events.append(("start", job.label))
        return Handle(job)

    def outcome(job, handle):
        events.append(("end", job.label))
        return "broken/a/seed0: exit 1" if job is broken else None

    jobs = [fast, slow, broken, fast_next, slow_next, broken_next]
    failures = dispatch(jobs, 3, start, outcome, poll_s=0)
    assert events.index(("start", "fast/b/seed0")) < events.index(("end", "slow/a/seed0"))
    assert events.index(("start", "slow/b/seed0")) > events.index(("end", "slow/a/seed0"))
    assert ("start", "broken/b/seed0") not in events
    assert failures == ["broken/a/seed0: exit 1", "broken/b/seed0: not run: the run it starts from failed"]

    stacked = Job("s", "b", 0, ("seeds=[0,1]",), stage=1, source="a")
    source_runs = [
        Job("s", "a", 0, ("seeds=[0,1]",)),
        Job("s", "a", 2, ("seed=2",)),
        Job("t", "a", 0, ("seed=0",)),
    ]
    assert sources(stacked, source_runs) == source_runs[:1] and stacked.label == "s/b/seeds0-1"


def test_no_run_starts_closer_to_the_deadline_than_a_start_and_a_first_round_took_here(tmp_path, monkeypatch):
    """On a loaded machine a run's process took 43 s to set up and 78 s to record its first round: a
    run started by a fixed lead would never reach a round before the deadline, only take a core from
    the one training. The lead is what this job's runs took (or are taking), read from their logs."""
    clock = [1000.0]
    monkeypatch.setattr(grid.time, "time", lambda: clock[0])
    first_rounds = grid.FirstRounds()
    assert first_rounds.lead() == grid.LAST_START  # nothing measured yet
    slow, queued, failed = (tmp_path / f"{name}.log" for name in ("slow", "queued", "failed"))
    for log in (slow, queued, failed):
        first_rounds.began(log)
    queued.write_text(f"fedmeta: note: {WAITING_FOR_A_TURN} (turns)\n")  # set up, waiting: no measure yet
    clock[0] += 100.0  # the slow run is still setting up or in its first round after 100 s
    assert first_rounds.lead() == pytest.approx(grid.FirstRounds.MARGIN * 100.0)
    failed.write_text("fedmeta: error: no such data\n")
    first_rounds.ended(failed)  # a process that exited is measured no longer
    slow.write_text(f"fedmeta: note: {FIRST_ROUND_ENDED} 121.0 s after the process started\n")
    queued.write_text(
        f"fedmeta: note: {WAITING_FOR_A_TURN} (turns)\nfedmeta: note: {TOOK_A_TURN} 200.0 s\n"
        f"fedmeta: note: {FIRST_ROUND_ENDED} 230.0 s after the process started\n"
    )
    clock[0] += 500.0
    assert first_rounds.lead() == pytest.approx(
        grid.FirstRounds.MARGIN * 121.0
    )  # the wait for a turn left out

    # dispatch: a run that would start within the lead of the deadline stays for the next job
    started = []
    jobs = [Job("rmnist-shards", "fedavg", seed, (f"seed={seed}",)) for seed in (0, 1)]
    failures = dispatch(
        jobs,
        1,
        lambda job: started.append(job) or type("Done", (), {"done": lambda self: True})(),
        lambda job, handle: None,
        poll_s=0,
        stop_at=clock[0] + 100.0,
        lead=lambda: 151.0 if started else 0.0,
    )
    assert started == jobs[:1] and failures == [
        "stopped: rmnist-shards/fedavg/seed1: not started before the deadline"
    ]


def test_a_run_still_in_a_round_at_the_deadline_is_said_stopped_not_failed(tmp_path, monkeypatch):
    """A process that ignores SIGTERM at the deadline (a recorded first round under way) is killed
    KILL_AFTER later: a stop, said as one, its last checkpoint kept — not "exit -9"."""
    busy = tmp_path / "python"
    busy.write_text("#!/bin/sh\ntrap '' TERM\nsleep 30\n")
    busy.chmod(0o755)
    monkeypatch.setattr(grid.sys, "executable", str(busy))
    monkeypatch.setattr(grid, "KILL_AFTER", 0.5)
    monkeypatch.setattr(grid, "LAST_START", 0.0)
    job = Job("rmnist-shards", "cafeme", 0, ("seed=0",))
    (tmp_path / "logs").mkdir()
    lines = grid._run_pool([job], tmp_path / "logs", 1, 0, stop_at=time.time() + 1.0)
    assert lines == [
        "stopped: rmnist-shards/cafeme/seed0: setting up or in a round at the deadline, killed; "
        "its last checkpoint is kept"
    ]


@pytest.mark.slow
def test_the_published_chain_runs_stage_after_stage(tmp_path, monkeypatch, mnist_dir, capsys):
    import torch

    monkeypatch.chdir(tmp_path)
    tiny = [
        *TINY,
        "federation.num_new_clients=2",
        "federation.clients_per_round=2",
        "method.batch_size=10",
        "personalization.batch_size=10",
        f"dataset.dir={mnist_dir}",
    ]
    assert (
        main(
            [
                "table",
                "--preset",
                "published",
                "--datasets",
                "rmnist-shards",
                "--seeds",
                "0",
                "--parallel",
                "2",
                *tiny,
            ]
        )
        == 0
    )
    runs = tmp_path / "runs" / "published" / "rmnist-shards"
    summaries = {p.parent.parent.name: json.loads(p.read_text()) for p in runs.glob("*/seed0/summary.json")}
    assert len(summaries) == 9
    hops, method = [], "fedrep-authors"
    while summaries[method]["init_from"]:
        method = Path(summaries[method]["init_from"]["run"]).parent.name
        hops.append(method)
    assert hops == [
        "ditto-authors",
        "ifca-published_sharing",
        "ifca-published",
        "fedavg-authors",
        "perfedavg-authors",
    ]
    model = {
        m: torch.load(runs / m / "seed0" / "checkpoint.ckpt", weights_only=True)["federation"]["model"]
        for m in ("fedavg-authors", "fedavg_ft-authors")
    }
    assert summaries["fedavg_ft-authors"]["rounds"] == 0
    assert all(torch.equal(model["fedavg-authors"][k], v) for k, v in model["fedavg_ft-authors"].items())


def test_a_kept_run_counts_as_finished_only_if_it_ran_the_jobs_settings(tmp_path):
    """A committed run of `ditto-tuned` stays finished while tuned.yaml is unchanged; a new study's
    values make it run again; a key the kept config lacks (added since) is no difference."""
    from omegaconf import OmegaConf

    from fedmeta.config import compose, run_name
    from fedmeta.grid import Job, finished

    overrides = ("method=ditto", "seed=0", "federation.rounds=20", f"output.root={tmp_path / 'runs'}")
    cfg = compose(list(overrides))
    folder = tmp_path / "kept" / run_name(cfg)
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{}")
    saved = OmegaConf.to_container(cfg, resolve=True)
    del saved["method"]["shuffle"]  # a key added after the run
    saved["model"]["init_from"] = "elsewhere/fedavg/seed0"  # a warm start's path follows its root
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    job = Job("rmnist-shards", "ditto", 0, overrides)
    assert finished(job, tmp_path / "kept")
    longer = Job("rmnist-shards", "ditto", 0, (*overrides[:2], "federation.rounds=30", overrides[3]))
    assert not finished(longer, tmp_path / "kept")  # the kept run ran 20 rounds
    saved["method"]["local_lr"] = 0.05  # the run used other values than the config gives now
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert not finished(job, tmp_path / "kept")


def finished_run(folder: Path, accuracy: float, seed: int = 0, steps: int = 3, rounds: int = 2) -> None:
    """The files the reports read of a finished run (``rounds`` rounds, ``steps`` personalization steps)."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = {
        "accuracy": accuracy,
        "seed": seed,
        "rounds": rounds,
        "seconds": 60.0,
        "seconds_per_round": 1.0,
        "device": "cpu",
        "curve": [accuracy] * (steps + 1),
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.csv").write_text(f"round,eval_accuracy\n1,{accuracy}\n")


def test_rewriting_the_table_or_figures_writes_only_them(tmp_path, monkeypatch, caplog):
    """table --no-run and figures without --run read the kept runs and write their own files, nothing
    else (no W&B run, not even W&B's default offline one), each bad summary said once. In the table,
    bold marks the best mean among a column's cells of equal rounds and seeds (FedAvg and Per-FedAvg
    tie, both bold, against Local; IFCA, of two seeds, has no peer), one seed shows no spread, the runs
    without a recorded command are counted, and the caption's most steps are those of the methods that
    personalize (FedAvg's curve, first in the folder, has only step 0)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    kept = tmp_path / "results" / "runs" / "quick" / "rmnist-shards"
    finished_run(kept / "fedavg" / "seed0", 0.85, steps=0)
    for method, accuracies in (("ifca", (0.9, 0.8)), ("perfedavg", (0.85,)), ("local", (0.5,))):
        for seed, accuracy in enumerate(accuracies):
            finished_run(kept / method / f"seed{seed}", accuracy, seed)
    (kept / "fedrep" / "seed0").mkdir(parents=True)
    (kept / "fedrep" / "seed0" / "summary.json").write_text("{not json")
    before = set(tmp_path.rglob("*"))

    assert main(["table", "--no-run"]) == 0
    assert caplog.text.count("skipping ") == 1
    caplog.clear()
    assert main(["figures"]) == 0
    assert caplog.text.count("skipping ") == 1
    new = {str(p.relative_to(tmp_path)) for p in set(tmp_path.rglob("*")) - before}
    figures = "results/figures/quick"
    assert new == {
        "results/TABLES.md",
        "results/figures",
        figures,
        f"{figures}/fig_personalization.png",
        f"{figures}/README.md",
    }

    table = (tmp_path / "results" / "TABLES.md").read_text()
    rows = {
        line.split(" | ")[0].removeprefix("| "): line for line in table.splitlines() if line.startswith("| ")
    }
    assert "| 85.00 ± 7.07 (n=2) |" in rows["IFCA"]
    assert "**85.00** (n=1)" in rows["FedAvg"] and "**85.00** (n=1)" in rows["Per-FedAvg"]
    assert "| 50.00 (n=1) |" in rows["Local"] and "**" not in rows["Local"]
    assert "± 0.00" not in table and "\n- command not recorded (5 runs)\n" in table
    assert "test-time personalization of at most 3 steps" in table
    assert (
        "| rmnist-shards (2 rounds) |" in table and "paper " not in table
    )  # no Δ at another budget than the paper's


def test_the_table_sets_tuned_methods_apart_and_the_paper_beside_only_its_budget(tmp_path, monkeypatch):
    """Tuned rows are a block of their own, never bold against the others (nor a cell with no peer of
    its rounds, seeds and procedure); the paper's number and Δ appear only beside a cell whose runs
    trained the paper's rounds; a command recorded afterwards says so."""
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "results" / "runs" / "quick"
    finished_run(kept / "rmnist-shards" / "fedavg_ft" / "seed0", 0.80)
    finished_run(
        kept / "rmnist-shards" / "fedavg_ft-tuned" / "seed0", 0.95
    )  # n=1, better: compared only within its block
    finished_run(kept / "rmnist-dirichlet" / "perfedavg" / "seed0", 0.70, rounds=1000)  # the paper's budget
    (kept / "rmnist-shards" / "fedavg_ft" / "seed0" / "command.txt").write_text(
        "fedmeta table --preset quick --datasets rmnist-shards --methods fedavg_ft --seeds 0\n"
        "# recorded afterwards: this command composes the run's config.yaml\n"
    )
    assert main(["table", "--no-run"]) == 0
    table = (tmp_path / "results" / "TABLES.md").read_text()
    untuned, tuned = table.split("Tuned: ")[0], table.split("Tuned: ")[1].split("### Every cell")[0]
    assert "| 80.00 (n=1) |" in untuned and "95.00" not in untuned and "**" not in untuned
    assert "| 95.00 (n=1) |" in tuned and "FedAvg-FT (tuned" in tuned
    assert "| rmnist-shards (2 rounds) | rmnist-dirichlet (1000 rounds) |" in untuned
    perfedavg = next(line for line in untuned.splitlines() if line.startswith("| Per-FedAvg"))
    assert "| 70.00 (n=1)<br>paper 74.57 ± 3.12, Δ -4.57 |" in perfedavg
    fedavg_ft = next(line for line in untuned.splitlines() if line.startswith("| FedAvg-FT"))
    assert "paper" not in fedavg_ft  # 2 rounds: not the paper's budget
    assert "--methods fedavg_ft --seeds 0` (1 run; recorded afterwards:" in table


def scored_run(
    folder: Path,
    accuracies,
    lr: float,
    steps: int = 50,
    algorithm: str = "fedavg",
    training=None,
    chosen=None,
) -> None:
    """A cell of finished runs, one per accuracy (its seed), with the config.yaml the reports read its
    test-time procedure from (``steps`` steps at ``lr``, decayed ×0.8 every 5) and, where ``training``
    gives (accuracy, steps) per seed, its training clients' score too (evaluation.protocol=both), and
    where ``chosen`` gives a step size per seed, the one ``personalization.lr_rule=selected`` chose."""
    for seed, accuracy in enumerate(accuracies):
        run = folder / f"seed{seed}"
        finished_run(run, accuracy, seed, steps=steps)
        config = {
            "federation": {"rounds": 2},
            "personalization": {"steps": steps, "lr": lr, "decay": 0.8, "decay_every": 5},
            "method": {"algorithm": algorithm},
        }
        if chosen:
            config["personalization"] |= {"lr_rule": "selected", "lr_grid": [0.001, 0.01, 0.1]}
            summary = json.loads((run / "summary.json").read_text())
            summary |= {"lr_rule": "selected", "personalization_lr": chosen[seed]}
            summary["lr_selection"] = {"0.001": 0.5, "0.01": 0.6, "0.1": 0.7} if steps else None
            (run / "summary.json").write_text(json.dumps(summary))
        OmegaConf.save(OmegaConf.create(config), run / "config.yaml")
        if training:
            summary = json.loads((run / "summary.json").read_text())
            trained, taken = training[seed]
            summary["training_clients"] = {
                "accuracy": trained,
                "accuracy_std": 0.1,
                "weighted_accuracy": trained,
                "curve": [trained] * (taken + 1),
                "clients": 80,
            }
            (run / "summary.json").write_text(json.dumps(summary))


def table_rows(table: str, block: str = "| method | cifar10-shards") -> dict[str, str]:
    """The rows of the first table after ``block`` (its header's start): method name → its line."""
    lines = table.split(block, 1)[1].split("\n\n", 1)[0].splitlines()
    return {line.split(" | ")[0].removeprefix("| "): line for line in lines if line.startswith("| ")}


def test_the_bold_is_the_best_mean_whatever_the_procedure_and_a_dagger_marks_what_seeds_do_not_settle(
    tmp_path, monkeypatch
):
    """CAFeMe personalizes at a step size no other method takes (lr 0.01 where the baselines take
    0.001, FedAvg none): its best mean is bold all the same. A mean within its sd over seeds (2.00)
    gets a †, one further off nothing; a cell of another n (Local, 2 seeds) is not compared, however
    high. The sentence above the table says both rules, and the last column each method's steps and
    step size, with the decay once above."""
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "results" / "runs" / "quick" / "rmnist-shards"
    scored_run(kept / "cafeme", (0.95, 0.97, 0.99), lr=0.01, algorithm="cafeme")  # 97.00 ± 2.00
    scored_run(kept / "fedavg_ft", (0.955, 0.96, 0.965), lr=0.001)  # 96.00: 1.00 below, within 2.00
    scored_run(kept / "ditto", (0.90, 0.92, 0.94), lr=0.001, algorithm="ditto")  # 92.00: 5.00 below
    scored_run(kept / "fedavg", (0.5, 0.5, 0.5), lr=0.001, steps=0)
    scored_run(kept / "local", (0.99, 0.99), lr=0.001, algorithm="local")  # n=2: no peer

    assert main(["table", "--no-run"]) == 0
    table = (tmp_path / "results" / "TABLES.md").read_text()
    rows = table_rows(table)
    assert "| **97.00** ± 2.00 (n=3) |" in rows["CAFeMe"] and "| 50 steps at lr 0.01 |" in rows["CAFeMe"]
    assert "| 96.00† ± 0.50 (n=3) |" in rows["FedAvg-FT"] and rows["FedAvg-FT"].endswith(
        "| 50 steps at lr 0.001 |"
    )
    assert (
        "| 92.00 ± 2.00 (n=3) |" in rows["Ditto"] and "†" not in rows["Ditto"] and "**" not in rows["Ditto"]
    )
    assert "| 50.00 ± 0.00 (n=3) |" in rows["FedAvg"] and "| scored as trained (0 steps) |" in rows["FedAvg"]
    assert "| 99.00 ± 0.00 (n=2) |" in rows["Local"] and "**" not in rows["Local"]
    assert (
        "whatever their test-time procedure" in table and "† beside a mean: a cell of the same group" in table
    )
    assert "at most 50 steps" in table and "every step size decays ×0.8 every 5 steps" in table


def test_under_one_rule_a_cell_says_the_step_size_each_seed_chose_and_the_caption_says_one_rule(
    tmp_path, monkeypatch
):
    """Runs whose step size was chosen by validation: the caption says one rule chose every method's
    from one grid, and each cell the step size each seed chose (none for FedAvg, which takes no step).
    The default rule's caption says
    the step sizes differ and its bold is not a verdict under one rule."""
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "results" / "runs" / "quick" / "rmnist-shards"
    scored_run(kept / "cafeme", (0.97, 0.96), lr=0.01, algorithm="cafeme", chosen=(0.1, 0.01))
    scored_run(kept / "fedavg", (0.5, 0.5), lr=0.001, steps=0, chosen=(0.001, 0.001))
    assert main(["table", "--no-run"]) == 0
    table = (tmp_path / "results" / "TABLES.md").read_text()
    rows = table_rows(table)
    assert "**96.50** ± 0.71 (n=2)<br>chosen lr 0.1, 0.01 |" in rows["CAFeMe"]
    assert "50 steps at a step size chosen at each evaluation from 0.001, 0.01, 0.1" in rows["CAFeMe"]
    assert "chosen" not in rows["FedAvg"]
    assert "the step size one rule chose for it" in table and "which differ between methods" not in table

    scored_run(kept / "cafeme", (0.97, 0.96), lr=0.01, algorithm="cafeme")
    scored_run(kept / "fedavg", (0.5, 0.5), lr=0.001, steps=0)
    assert main(["table", "--no-run"]) == 0
    table = (tmp_path / "results" / "TABLES.md").read_text()
    assert "chosen lr" not in table and "which differ between methods" in table
    assert "its bold is the best at these step sizes, not under one rule" in table


def test_a_chains_scoring_stage_is_compared_with_the_stages_of_its_models_rounds(tmp_path, monkeypatch):
    """A stage of a chain that only scores (0 rounds) scores a model of 2 rounds: it is compared with
    the 2-round cells, so the column has one bold mean, not one per recorded round count."""
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "results" / "runs" / "quick" / "rmnist-shards"
    scored_run(kept / "cafeme", (0.97,), lr=0.01, algorithm="cafeme")
    scored_run(kept / "fedavg", (0.5,), lr=0.001, steps=0)
    for stage, accuracy in (("fedavg_ft", 0.8), ("ifca_ft", 0.85)):  # two of them: peers of each other
        scored_run(kept / stage, (accuracy,), lr=0.001)
        summary_file = kept / stage / "seed0" / "summary.json"
        summary = json.loads(summary_file.read_text())
        summary |= {"rounds": 0, "init_from": {"run": "runs/fedavg/seed0", "rounds": 2, "init_from": None}}
        summary_file.write_text(json.dumps(summary))
    assert main(["table", "--no-run"]) == 0
    rows = table_rows((tmp_path / "results" / "TABLES.md").read_text())
    assert "**97.00** (n=1)" in rows["CAFeMe"] and "| 85.00 (n=1) |" in rows["IFCA-FT"]


def test_the_training_clients_block_bolds_alike_and_names_the_methods_scored_as_trained(
    tmp_path, monkeypatch
):
    """Runs scored both ways: the training clients' block bolds its best mean over clients and marks
    a tie by the same rule, and names the methods whose training clients were scored as their method
    keeps a model for each (0 steps, where their new clients take 50)."""
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "results" / "runs" / "quick" / "rmnist-shards"
    scored_run(
        kept / "cafeme", (0.97, 0.97), lr=0.01, algorithm="cafeme", training=((0.90, 50), (0.94, 50))
    )  # 92.00 ± 2.83
    scored_run(kept / "fedrep", (0.8, 0.8), lr=0.001, algorithm="fedrep", training=((0.91, 0), (0.91, 0)))
    scored_run(kept / "fedavg", (0.5, 0.5), lr=0.001, steps=0, training=((0.6, 0), (0.6, 0)))

    assert main(["table", "--no-run"]) == 0
    table = (tmp_path / "results" / "TABLES.md").read_text()
    training = table_rows(table.split("**training clients**", 1)[1], "| method | ")
    assert training["CAFeMe"].startswith("| CAFeMe | – | – | **92.00** ± 2.83 / ")
    assert "| 91.00† ± 0.00 / " in training["FedRep"]
    assert "| 60.00 ± 0.00 / " in training["FedAvg"] and "†" not in training["FedAvg"]
    assert "Scored as trained, 0 steps: the methods that keep a model per client (FedRep);" in table


@pytest.fixture
def every_job_finishes(monkeypatch):
    """A grid whose every job leaves a finished run at once (no training)."""
    from fedmeta import grid

    def run(jobs, root, *_, **__):
        for job in jobs:
            finished_run(root / job.setting / job.method / f"seed{job.seed}", 0.5, job.seed)
        return []

    monkeypatch.setattr(grid, "run", run)


def test_each_section_names_the_commands_that_ran_its_cells(tmp_path, monkeypatch, every_job_finishes):
    """The grid command is kept beside each run it finished; the section lists the distinct ones,
    sorted, with their runs, and rewriting it from the same runs changes none of them. A run
    replaced since by another (its summary newer than its command) has no command."""
    from fedmeta import report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(report, "log_report", lambda *args: None)
    fedavg = ["table", "--datasets", "rmnist-shards", "--methods", "fedavg", "--seeds", "0", "logger=[csv]"]
    cafeme = ["table", "--datasets", "rmnist-shards", "--methods", "cafeme", "--seeds", "0", "1"]
    assert main(fedavg) == 0 and main(cafeme) == 0
    finished_run(tmp_path / "results" / "runs" / "quick" / "rmnist-shards" / "local" / "seed0", 0.5)
    assert main(["table", "--no-run"]) == 0
    table = (tmp_path / "results" / "TABLES.md").read_text()
    assert (
        "\n- `fedmeta table --datasets rmnist-shards --methods cafeme --seeds 0 1` (2 runs)"
        "\n- `fedmeta table --datasets rmnist-shards --methods fedavg --seeds 0 'logger=[csv]'` (1 run)"
        "\n- command not recorded (1 run)\n"
    ) in table
    assert main(["table", "--no-run"]) == 0
    after_written = table.split("Written")[1].split("\n", 1)[1]
    assert (tmp_path / "results" / "TABLES.md").read_text().split("Written")[1].split("\n", 1)[
        1
    ] == after_written

    summary = tmp_path / "runs" / "quick" / "rmnist-shards" / "fedavg" / "seed0" / "summary.json"
    later = (summary.parent / "command.txt").stat().st_mtime_ns + 10**9
    os.utime(summary, ns=(later, later))
    assert main(["table", "--no-run"]) == 0
    table = (tmp_path / "results" / "TABLES.md").read_text()
    assert "--methods fedavg" not in table and "\n- command not recorded (2 runs)\n" in table


def test_a_grid_claims_only_the_runs_it_ran_not_those_a_grid_beside_it_finished(tmp_path, monkeypatch):
    """Two grids in one runs folder: runs the other one finishes meanwhile keep their own command."""
    from fedmeta import grid, report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(report, "log_report", lambda *args: None)
    beside = tmp_path / "runs" / "quick" / "rmnist-shards" / "local" / "seed1"

    def run(jobs, root, *_, **__):
        for job in jobs:
            finished_run(root / job.setting / job.method / f"seed{job.seed}", 0.5, job.seed)
        finished_run(beside, 0.5, 1)  # the grid beside this one finishes its run meanwhile
        (beside / "command.txt").write_text("fedmeta table --methods local --seeds 1\n")
        return []

    monkeypatch.setattr(grid, "run", run)
    assert main(["table", "--datasets", "rmnist-shards", "--methods", "fedavg", "--seeds", "0", "1"]) == 0
    ran = tmp_path / "runs" / "quick" / "rmnist-shards" / "fedavg"
    assert {(ran / f"seed{s}" / "command.txt").read_text() for s in (0, 1)} == {
        "fedmeta table --datasets rmnist-shards --methods fedavg --seeds 0 1\n"
    }
    assert (beside / "command.txt").read_text() == "fedmeta table --methods local --seeds 1\n"
    stacked = Job("rmnist-shards", "fedavg", 0, ("seeds=[0,2]",))
    assert stacked.folders(Path("r")) == {
        Path("r/rmnist-shards/fedavg/seed0"),
        Path("r/rmnist-shards/fedavg/seed2"),
    }


def test_a_wandb_report_run_only_where_asked_or_after_runs_that_log_to_wandb(
    tmp_path, monkeypatch, every_job_finishes
):
    """--wandb asks for the report run; a grid whose runs ran with the wandb logger (a default one)
    starts it too, in the project those runs log to; nothing else does."""
    from fedmeta import report

    monkeypatch.chdir(tmp_path)
    logged = []
    monkeypatch.setattr(
        report,
        "log_report",
        lambda name, preset, runs, written, wandb: logged.append(
            (name, [p.name for p in written], wandb.project)
        ),
    )
    one_run = ["table", "--datasets", "rmnist-shards", "--methods", "fedavg", "--seeds", "0"]
    assert main([*one_run, "logger=[tensorboard]"]) == 0 and logged == []  # its runs logged nothing to W&B
    assert main(["table", "--no-run"]) == 0 and main(["figures"]) == 0 and logged == []
    assert main(one_run) == 0 and logged == [("quick", ["TABLES.md"], "fedmeta")]  # wandb: a default logger
    assert main(["table", "--no-run", "--wandb"]) == 0 and len(logged) == 2
    assert main(["figures", "--wandb", "wandb.project=elsewhere"]) == 0
    assert logged[-1] == ("quick", ["fig_personalization.png", "README.md"], "elsewhere")


def test_one_run_commands_that_differ_only_in_method_and_seed_are_one_item():
    """A queue of one-run commands (one method, one seed each) is listed once, with what each ran;
    a command with two seeds that finished one of them is not taken for a one-seed command."""
    from fedmeta.report import _commands

    zoo = "fedmeta table --preset zoo --datasets rmnist-shards --methods {} --seeds {} --parallel 1"
    ran = [
        zoo.format("fedbn", 2),
        zoo.format("apfl", 1),
        zoo.format("apfl", 0),
        "fedmeta table --methods a --seeds 0 1",
    ]
    assert _commands([{"command": c} for c in [*ran, None]]) == [
        "- `fedmeta table --methods a --seeds 0 1` (1 run)",
        f"- `{zoo.format('M', 'N')}` (3 runs, a command each; M N: apfl 0, 1; fedbn 2)",
        "- command not recorded (1 run)",
    ]


def test_the_tiny_preset_runs_only_what_its_table_shows_and_writes_outside_results():
    """The pipeline check of the README: every run it starts is a cell of its own table, and its
    table, kept runs and figures go under runs/ (ignored), never into the committed results/."""
    from fedmeta import grid

    preset = grid.load_preset("tiny")
    jobs = grid.plan(preset, Path("runs/tiny"), ["table"])
    table_settings = {name for name, s in preset.settings.items() if s.grid == "table"}
    assert {(job.setting, job.method) for job in jobs} == {
        (s, m) for s in table_settings for m in preset.methods
    }
    assert len(jobs) == 12 and Path(preset.results).parts[0] == "runs"


def test_a_presets_steps_are_the_fine_tuners_and_leave_the_methods_scored_as_trained_at_0():
    """The breadth preset's Shakespeare column takes 20 personalization steps where the others take
    50: FedAvg and IFCA, scored as trained, stay at 0 (else FedAvg would be FedAvg-FT), every method
    that fine-tunes takes the 20, and the other column leaves each method its own."""
    from fedmeta import grid
    from fedmeta.config import compose

    jobs = grid.plan(grid.load_preset("breadth"), Path("runs/breadth"), ["table"], seeds=[0])
    steps = {(job.setting, job.method): compose(list(job.overrides)).personalization.steps for job in jobs}
    assert steps[("shakespeare-writers", "fedavg")] == steps[("shakespeare-writers", "ifca")] == 0
    assert steps[("shakespeare-writers", "fedavg_ft")] == steps[("shakespeare-writers", "cafeme")] == 20
    assert steps[("mini_imagenet-dirichlet", "fedavg")] == 0
    assert steps[("mini_imagenet-dirichlet", "fedavg_ft")] == 50


def test_a_presets_results_folder_must_be_a_folder(tmp_path, monkeypatch):
    from fedmeta import grid

    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path))
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "mine.yaml").write_text("inherits: tiny\nresults: [a, b]\n")
    with pytest.raises(FedmetaError, match="preset 'mine': results must be a folder"):
        grid.load_preset("mine")


def test_the_paper_preset_evaluates_where_its_table_and_figures_read():
    """The table reads each run's last evaluation and the paper's figures its final models: a run
    is evaluated once, at its final round, except where the convergence figure reads its way there."""
    paper = load_preset("paper")
    jobs = {
        (job.setting, job.method): job
        for job in plan(paper, Path("runs/paper"), ["table"], datasets=["rmnist", "cifar10"], seeds=[0])
    }
    every = {
        setting: next(o for o in job.overrides if o.startswith("federation.eval_every=")).split("=")[1]
        for (setting, _), job in jobs.items()
    }
    assert every["rmnist-shards"] == "100"  # 10 evaluations of 1,000 rounds: the convergence figure
    assert every["rmnist-dirichlet"] == every["cifar10-shards"] == "1000"  # the final round only
    mine = OmegaConf.merge(
        paper, {"evaluations": {"rmnist": 4, "rmnist-iid": 2}}
    )  # kept: default, rmnist-shards
    assert preset_budget(mine, "rmnist", "rmnist-iid")[1] == 2  # a setting's own count first
    assert preset_budget(mine, "rmnist", "rmnist-shards")[1] == 10
    assert preset_budget(mine, "rmnist", "rmnist-dirichlet")[1] == 4  # then the data set's
    assert preset_budget(mine, "cifar10", "cifar10-shards")[1] == 1  # then default
