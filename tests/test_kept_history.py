"""A kept run is never replaced by one with fewer rounds, by any command. A run folder whose
metrics.csv records rounds that no checkpoint can continue (a checkpoint that was not brought back,
a run stopped before its first) is refused by train, grid and campaign in one line that names the
run and the way out; archiving and carrying runs between folders never copy fewer recorded rounds
over more; and the campaign's own numbers are checked before anything runs."""

import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_campaign import tiny_campaign
from test_collect import metrics
from test_reliability import run_args

import fedmeta.run
from fedmeta import campaign, grid, report
from fedmeta.cli import main
from fedmeta.config import compose
from fedmeta.errors import FedmetaError
from fedmeta.runs import recorded_rounds, start_refusal


def history(folder: Path, rounds: int, checkpoint_round: int | None = None, finished: bool = False) -> None:
    """A run folder recording ``rounds`` rounds, with a checkpoint at ``checkpoint_round`` if given."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.csv").write_bytes(metrics(rounds)[0])
    (folder / "config.yaml").write_text(f"rounds: {rounds}\n")
    if checkpoint_round is not None:
        torch.save({"round": checkpoint_round}, folder / "checkpoint.ckpt")
    if finished:
        (folder / "summary.json").write_text('{"accuracy": 0.5}')


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_train_refuses_recorded_rounds_without_a_checkpoint_before_reading_data(
    tmp_path, mnist_dir, capsys, monkeypatch
):
    assert main(run_args(tmp_path, mnist_dir)) == 0
    run = tmp_path / "rmnist-shards" / "local" / "seed0"
    for name in ("summary.json", "checkpoint.ckpt"):
        (run / name).unlink()
    kept = files(run)
    assert recorded_rounds(run) == 2

    def no_data(*_):
        raise AssertionError("the data was read before the refusal")

    monkeypatch.setattr(fedmeta.run, "build", no_data)
    capsys.readouterr()
    for resume in ([], ["output.resume=true"]):  # resume has nothing to resume from
        assert main(run_args(tmp_path, mnist_dir, *resume)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert (
            f"{run} records 2 rounds but holds no checkpoint.ckpt" in err and "output.overwrite=true" in err
        )
        assert files(run) == kept
    monkeypatch.undo()
    assert main(run_args(tmp_path, mnist_dir, "output.overwrite=true")) == 0  # replacing them, as asked
    assert (run / "summary.json").is_file()


def test_a_campaign_job_refuses_a_unit_whose_kept_rounds_have_no_checkpoint_and_leaves_them(
    tmp_path, mnist_dir, monkeypatch, capsys
):
    """The probe: the committed paper runs hold 162 rounds of metrics and no checkpoint; a job counted
    them as round 0, trained from scratch and copied its shorter files over them."""
    plan = tiny_campaign(mnist_dir)
    kept, root = tmp_path / "kept", tmp_path / "runs"
    unit = campaign.units(plan, root)[0]
    for folder in unit.folders(kept):
        history(folder, 2)
    before = {folder: files(folder) for folder in unit.folders(kept)}
    started = []
    monkeypatch.setattr(grid, "run", lambda jobs, *_, **__: started.extend(jobs) or [])
    record = campaign.run(plan, 600, kept, root, parallel=1)
    assert unit.method not in {job.method for job in started}  # the other units ran
    refused = [line for line in record["not_done"] if line.startswith(unit.label)]
    assert refused == [
        f"{unit.label}: refused: {unit.folders(kept)[0]} records 2 rounds but holds no checkpoint.ckpt to "
        "continue them: bring its checkpoint back, or move the folder aside to start that unit over"
    ]
    assert {folder: files(folder) for folder in unit.folders(kept)} == before
    assert not any(folder.exists() for folder in unit.folders(root))
    state = campaign.status(plan, kept)
    assert "refused: rounds 2, 2, 2 recorded without a checkpoint" in state


def test_a_runs_folder_with_its_own_orphaned_rounds_is_refused_too(tmp_path, mnist_dir):
    plan = tiny_campaign(mnist_dir)
    kept, root = tmp_path / "kept", tmp_path / "runs"
    unit = campaign.units(plan, root)[0]
    history(unit.folders(root)[0], 2)  # a job cut off before its first checkpoint, say
    assert "records 2 rounds but holds no checkpoint" in campaign.carry_in(unit, kept, root)
    assert recorded_rounds(unit.folders(root)[0]) == 2


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    have=st.integers(0, 6),
    coming=st.integers(0, 6),
    kept_checkpoint=st.booleans(),
    writer=st.sampled_from(["archive", "carry", "start"]),
)
def test_history_only_grows_whichever_writer_touches_a_run_folder(
    tmp_path_factory, have, coming, kept_checkpoint, writer
):
    """Each writer of a run folder, given a folder recording ``have`` rounds and a run of ``coming``:
    the folder afterwards records at least ``have`` (or the writer refused in one line), and a run at
    least as long is taken whole."""
    base = tmp_path_factory.mktemp("writers")
    source, target = base / "runs" / "s" / "m" / "seed0", base / "kept" / "s" / "m" / "seed0"
    if have:
        history(target, have, checkpoint_round=have if kept_checkpoint else None)
    history(
        source, coming, checkpoint_round=None if writer == "archive" else coming, finished=writer == "archive"
    )
    if writer == "archive":
        copied = report.archive(base / "runs", base / "kept")
        assert copied == (coming >= have)
    elif writer == "carry":
        campaign._copy_run(source, target)
    else:  # a run starting over in the folder (train, grid and campaign processes)
        cfg = compose(["output.resume=true"])
        problem = start_refusal(target, cfg)
        if problem:
            assert "\n" not in problem and str(target) in problem
        else:
            assert have == 0 or kept_checkpoint  # nothing recorded, or a checkpoint to continue from
        return
    assert recorded_rounds(target) >= have
    if coming >= have:
        assert recorded_rounds(target) == coming


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--budget", "1e308"], "at most 2592000 (30 days), got 1e+308"),
        (["--budget", "nan"], "got nan"),
        (["--parallel", "0"], "--parallel must be 1 to 64"),
        (["--parallel", "-2"], "--parallel must be 1 to 64"),
        (["--start-ahead", "-1"], "--start-ahead must be 0 to 8"),
        (["--carry-mib", "inf"], "--carry-mib must be a size in MiB"),
        (["--profile", "0"], "--profile takes a number of seconds above 0"),
    ],
)
def test_a_campaigns_numbers_are_finite_positive_and_sane(flags, said, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing may be written: the state file would land here
    assert main(["campaign", "--config", str(campaign.DEFAULT), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("content", ["nested", "zero"])
def test_a_campaign_file_nested_too_deeply_or_endless_is_one_line(content, tmp_path):
    path = tmp_path / "campaign.yaml"
    if content == "nested":
        path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    else:
        path = Path("/dev/zero")
    with pytest.raises(FedmetaError) as error:
        campaign.load(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_archive_says_why_it_keeps_the_longer_run(tmp_path, caplog):
    history(tmp_path / "runs" / "s" / "m" / "seed0", 2, finished=True)
    history(tmp_path / "kept" / "s" / "m" / "seed0", 5)
    assert report.archive(tmp_path / "runs", tmp_path / "kept") == 0
    assert "records 5 rounds" in caplog.text and recorded_rounds(tmp_path / "kept" / "s" / "m" / "seed0") == 5
    shutil.rmtree(tmp_path / "kept")
    assert report.archive(tmp_path / "runs", tmp_path / "kept") == 1


def test_a_run_says_what_its_rounds_will_take_once_a_warm_round_is_measured(
    tmp_path, mnist_dir, caplog, monkeypatch
):
    """A long run (here: any, the threshold lowered) says it once; a short one's bar says enough."""
    import fedmeta.progress
    from fedmeta.loop import train

    monkeypatch.setattr(fedmeta.progress, "ANNOUNCED_AFTER_SECONDS", 0.0)

    args = ["method=local", "federation.rounds=12", "federation.eval_every=6", "federation.num_new_clients=2"]
    args += ["personalization.steps=1", "logger=[]", f"dataset.dir={mnist_dir}", f"output.root={tmp_path}"]
    caplog.set_level("INFO", logger="fedmeta")
    train(compose(args), show_progress=False)
    said = [r.getMessage() for r in caplog.records if "rounds left at" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("10 rounds left at ") and "and 2 evaluations" in said[0]


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_the_round_bars_rate_is_trainings_an_evaluation_has_its_own(tmp_path, mnist_dir, monkeypatch, capsys):
    """An evaluation (here held 2 s) is not counted in the rounds' rate: the last round's s/round was
    once the final evaluation's minutes."""
    import fedmeta.loop
    from fedmeta.loop import train

    honest = fedmeta.loop._evaluate

    def slow_evaluation(*args, **kwargs):
        time.sleep(2.0)
        return honest(*args, **kwargs)

    monkeypatch.setattr(fedmeta.loop, "_evaluate", slow_evaluation)
    args = ["method=local", "federation.rounds=3", "federation.eval_every=1", "federation.num_new_clients=2"]
    args += ["personalization.steps=0", "logger=[]", f"dataset.dir={mnist_dir}", f"output.root={tmp_path}"]
    train(compose(args), show_progress=True)
    shown = re.findall(r"([\d.]+)(s/round|round/s)", capsys.readouterr().err)
    seconds = [float(v) if unit == "s/round" else 1 / float(v) for v, unit in shown]
    assert seconds and seconds[-1] < 1.0, shown  # a local round here takes far less than the 2 s evaluations


def test_a_note_is_said_by_the_first_process_only_and_a_warning_by_every_one(capsys, monkeypatch):
    """DDP starts a process per device: a note (nothing to act on) once per run, not once per process."""
    import logging

    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from fedmeta.cli import Notes

    log = logging.getLogger("fedmeta.test-notes")
    log.propagate, log.handlers = False, [Notes()]
    log.setLevel(logging.INFO)
    for rank in (0, 1):
        monkeypatch.setattr(rank_zero_only, "rank", rank, raising=False)
        log.info("a note")
        log.warning("a warning")
    err = capsys.readouterr().err
    assert err.count("fedmeta: note: a note") == 1 and err.count("fedmeta: warning: a warning") == 2
