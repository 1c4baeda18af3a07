"""A job's output comes back from a machine the project does not control: collecting it trusts
nothing it did not check. Names are checked before any path is built from them, nothing is opened
through a link or a FIFO, a run is taken only if it is the campaign's run for its folder and
continues what is kept, two collects never run at once, and nothing is written through a link."""

import contextlib
import csv
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from test_campaign import tiny_campaign

from fedmeta import campaign, lease
from fedmeta.checkpoint import identity
from fedmeta.config import compose
from fedmeta.errors import FedmetaError
from fedmeta.runs import METRIC_FIELDS, recorded_rounds

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 3  # the tiny campaign's


@pytest.fixture(scope="module")
def plan(mnist_dir):
    return tiny_campaign(mnist_dir, methods=["local", "fedavg"])


@pytest.fixture(scope="module")
def configs(plan):
    """Each run folder of the tiny campaign → its config."""
    root = Path("kept")
    return {
        folder.relative_to(root).as_posix(): compose(list(job.overrides))
        for unit in campaign.units(plan, root)
        for job, folder in zip(unit.jobs, unit.folders(root))
    }


def metrics(rounds: int, loss: float = 1.0) -> tuple[bytes, list[dict]]:
    rows = [
        dict.fromkeys(METRIC_FIELDS, "") | {"round": r, "train_loss": loss / r} for r in range(1, rounds + 1)
    ]
    text = io.StringIO()
    writer = csv.DictWriter(text, METRIC_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue().encode(), rows


def finished(cfg, rounds: int = ROUNDS, loss: float = 1.0) -> dict[str, bytes]:
    """A finished run's files, as fedmeta train leaves them."""
    summary = {"accuracy": 0.8, "curve": [0.5, 0.8], "rounds": rounds, "seconds": 1.0}
    return {
        "config.yaml": OmegaConf.to_yaml(cfg).encode(),
        "metrics.csv": metrics(rounds, loss)[0],
        "curves.csv": b"round,step,accuracy\n",
        "summary.json": json.dumps(summary).encode(),
    }


def checkpointed(cfg, round_: int, loss: float = 1.0, ident: dict | None = None) -> dict[str, bytes]:
    """An unfinished run's files at ``round_``."""
    data, rows = metrics(round_, loss)
    buffer = io.BytesIO()
    saved = {"round": round_, "identity": ident or identity(cfg), "history": {"metrics": rows}}
    torch.save(saved, buffer)
    return {
        "config.yaml": OmegaConf.to_yaml(cfg).encode(),
        "metrics.csv": data,
        lease.CHECKPOINT: buffer.getvalue(),
    }


def output(out: Path, runs: dict[str, dict[str, bytes]], log: bytes | None = None, **job) -> Path:
    """A job's output folder whose manifest is right about an archive of ``runs``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for folder, files in runs.items():
            for name, data in files.items():
                member = tarfile.TarInfo(f"{folder}/{name}")
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
    chunk = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs-a.00").write_bytes(chunk)
    record = {"id": "0123456789ab", "started": "x", "hardware": "x", "budget_seconds": 1, "seconds": 1}
    record |= {"parallel": 1, "units": {}} | job
    part = {"name": "runs-a.00", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
    (out / lease.MANIFEST).write_text(json.dumps({"format": 1, "slot": "a", "parts": [part], "job": record}))
    if log is not None:
        (out / "job.log").write_bytes(log)
    return out


def keep(kept: Path, folder: str, files: dict[str, bytes]) -> None:
    (kept / folder).mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (kept / folder / name).write_bytes(data)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != lease.LOCK
    }


@contextlib.contextmanager
def no_hang(seconds: int = 20):
    """A FIFO opened for reading would wait for ever: fail instead."""

    def hung(*_):
        raise AssertionError("collect hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- names are data -----------------------------------------------------------------------------


@pytest.mark.parametrize("job_id", ["../../../../victim/k08_escaped", "", ".log", "a/b", "x" * 65, 7])
def test_a_job_id_that_is_not_a_plain_name_is_refused_before_anything_is_written(plan, tmp_path, job_id):
    kept = tmp_path / "project" / "results" / "runs" / "quick"
    logs = tmp_path / "project" / "results" / "gpu"
    out = output(tmp_path / "out", {}, log=b"machine: x; torch\n", id=job_id)
    with pytest.raises(FedmetaError, match="is not a plain name .*nothing collected") as error:
        campaign.collect(plan, out, kept, logs)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "project").exists() and sorted(tmp_path.rglob("*.log")) == [out / lease.LOG]


def test_the_job_script_builds_no_path_from_a_jobs_output(tmp_path):
    """The script once copied job.log to results/gpu/jobs/$id.log with the id from lease.json."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_job.sh", project / "scripts")
    (tmp_path / "victim").mkdir()
    out = output(tmp_path / "out", {}, log=b"equivalence: passed x\n", id="../../../../victim/k08_escaped")
    done = subprocess.run(
        ["bash", str(project / "scripts" / "gpu_job.sh"), "--collect", str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PY=sys.executable, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "is not a plain name" in done.stderr
    assert not list((tmp_path / "victim").iterdir()) and not (project / "results").exists()


@pytest.mark.parametrize("name", ["lease.json", "runs-a.00", "job.log"])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_link_or_a_fifo_in_the_output_is_refused_in_one_line_and_never_read(plan, tmp_path, name, kind):
    secret = tmp_path / "outside.txt"
    secret.write_text("an outside file's content\n")
    kept, logs = tmp_path / "results" / "runs" / "quick", tmp_path / "results" / "gpu"
    out = output(tmp_path / "out", {}, log=b"machine: x; torch\n")
    (out / name).unlink()
    if kind == "link":
        (out / name).symlink_to(secret)
    else:
        os.mkfifo(out / name)
    said = "is a symbolic link" if kind == "link" else "is not a regular file"
    with no_hang(), pytest.raises(FedmetaError, match=f"{said}.*nothing collected") as error:
        campaign.collect(plan, out, kept, logs)
    assert "\n" not in str(error.value)
    assert not kept.exists() and not logs.exists()


def test_sizes_are_bounded_by_kind_and_sparse_members_refused(plan, configs, tmp_path):
    folder = "rmnist-shards/local/seed0"
    runs = {folder: finished(configs[folder]) | {"summary.json": b" " * (lease.SMALL_FILE_BYTES + 1)}}
    with pytest.raises(FedmetaError, match="summary.json of 1048577 bytes, more than a run writes"):
        campaign.collect(plan, output(tmp_path / "big", runs), tmp_path / "kept")
    member = tarfile.TarInfo(f"{folder}/metrics.csv")
    member.type, member.size = tarfile.GNUTYPE_SPARSE, 200 * 2**20  # 200 MB planted from a few bytes
    out = tmp_path / "sparse"
    output(out, {})
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        archive.addfile(member)
    chunk = buffer.getvalue()
    (out / "runs-a.00").write_bytes(chunk)
    manifest = json.loads((out / lease.MANIFEST).read_text())
    manifest["parts"][0] |= {"bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
    (out / lease.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FedmetaError, match="which is not a run's file: nothing collected"):
        campaign.collect(plan, out, tmp_path / "kept")
    assert not list((tmp_path / "kept").rglob("metrics.csv"))


@pytest.mark.parametrize(
    "change, said",
    [
        ({"seconds": True}, "seconds True is not a number of seconds"),
        ({"seconds": 1e308}, "seconds 1e+308 is not a number of seconds"),
        ({"budget_seconds": "x"}, "budget_seconds 'x' is not a number of seconds"),
        ({"parallel": 0}, "parallel 0 is not a count"),
        ({"units": {"a": [[1], "x"]}}, "units are not"),
        ({"hardware": "a\nb"}, "hardware is not a line of text"),
    ],
)
def test_a_job_record_is_checked_field_by_field(plan, tmp_path, change, said):
    with pytest.raises(FedmetaError, match=re.escape(said)):
        campaign.collect(plan, output(tmp_path / "out", {}, **change), tmp_path / "kept")
    assert not (tmp_path / "kept" / "jobs.jsonl").exists()


def test_the_log_is_kept_and_only_a_well_formed_equivalence_line_is_recorded(plan, tmp_path):
    kept, logs = tmp_path / "kept", tmp_path / "gpu"
    log = b"machine: NVIDIA H200; torch 2\nequivalence: passed NVIDIA H200 sources 0123456789abcdef\n"
    said = campaign.collect(plan, output(tmp_path / "a", {}, log=log, id="aaaa"), kept, logs)
    assert (logs / "jobs" / "aaaa.log").read_bytes() == log
    assert (logs / "equivalence.txt").read_text() == "NVIDIA H200 sources 0123456789abcdef\n"
    assert any("recorded in" in line for line in said)
    forged = [
        b"machine: NVIDIA H200; t\nequivalence: passed NVIDIA H100 sources 0123456789abcdef\n",  # not its card
        b"machine: A; t\nequivalence: passed A sources 0123456789abcdef\n"
        b"equivalence: passed A sources 1111111111111111\n",  # two
        b"machine: A; t\nequivalence: passed A sources ../../etc\n",
    ]
    for i, log in enumerate(forged):
        said = campaign.collect(plan, output(tmp_path / f"f{i}", {}, log=log, id=f"f{i}"), kept, logs)
        assert any("are not the one a job writes for its card: not recorded" in line for line in said)
    assert (logs / "equivalence.txt").read_text() == "NVIDIA H200 sources 0123456789abcdef\n"


# --- a run is what it claims, and better than what is kept ----------------------------------------


def test_a_finished_run_without_a_finished_runs_files_deletes_nothing(plan, configs, tmp_path):
    kept, folder = tmp_path / "kept", "rmnist-shards/fedavg/seed0"
    keep(kept, folder, checkpointed(configs[folder], 2))
    before = snapshot(kept)
    only_summary = {"summary.json": finished(configs[folder])["summary.json"]}
    said = campaign.collect(plan, output(tmp_path / "out", {folder: only_summary}), kept)
    assert f"{folder}: finished, but without its config.yaml, metrics.csv, curves.csv" in said[0]
    assert snapshot(kept) == before | {"jobs.jsonl": (kept / "jobs.jsonl").read_bytes()}
    assert campaign.units(plan, kept)[1].rounds_done(kept)[0] == 2


def test_a_shorter_run_never_replaces_the_campaigns_progress(plan, configs, tmp_path):
    """A job that ran federation.rounds=2 (its record says so): its finished runs are of another protocol."""
    kept, folder = tmp_path / "kept", "rmnist-shards/fedavg/seed1"
    keep(kept, folder, checkpointed(configs[folder], 2))
    before = snapshot(kept)
    short = compose([*campaign.units(plan, kept)[1].jobs[1].overrides, "federation.rounds=2"])
    out = output(tmp_path / "out", {folder: finished(short, rounds=2)}, overrides=["federation.rounds=2"])
    said = campaign.collect(plan, out, kept)
    assert f"{folder}: its config.yaml is of 2 rounds, the campaign's 3: not taken" in said
    assert {k: v for k, v in snapshot(kept).items() if k != "jobs.jsonl"} == before


def test_a_run_of_another_method_or_one_that_does_not_continue_the_kept_run_is_refused(
    plan, configs, tmp_path
):
    kept = tmp_path / "kept"
    local, fedavg = "rmnist-shards/local/seed0", "rmnist-shards/fedavg/seed0"
    said = campaign.collect(plan, output(tmp_path / "a", {fedavg: finished(configs[local])}), kept)
    assert said[0].startswith(
        f"{fedavg}: its config.yaml is of other settings than the campaign's for this folder ("
    )
    assert "method.algorithm: 'local' there, 'fedavg' here" in said[0]
    keep(kept, fedavg, checkpointed(configs[fedavg], 1))
    before = snapshot(kept)
    # the right identity, another run's rounds (another method's weights under this method's name)
    runs = {fedavg: checkpointed(configs[fedavg], 2, loss=7.0)}
    said = campaign.collect(plan, output(tmp_path / "b", runs), kept)
    assert f"{fedavg}: its checkpoint does not continue the kept run" in said[0]
    runs = {fedavg: finished(configs[fedavg], loss=7.0)}
    said = campaign.collect(plan, output(tmp_path / "c", runs), kept)
    assert f"{fedavg}: finished, but does not continue the kept run" in said[0]
    assert {k: v for k, v in snapshot(kept).items() if k != "jobs.jsonl"} == {
        k: v for k, v in before.items() if k != "jobs.jsonl"
    }
    said = campaign.collect(plan, output(tmp_path / "d", {fedavg: checkpointed(configs[fedavg], 2)}), kept)
    assert said[0] == f"{fedavg}: round 1 → 2"  # the run it continues is taken


def forged(cfg, round_, history_rounds: int, loss: float = 1.0, dropped: str = "") -> dict[str, bytes]:
    """An unfinished run's files whose checkpoint says round ``round_`` over ``history_rounds`` rows."""
    files = checkpointed(cfg, history_rounds, loss)
    _, rows = metrics(history_rounds, loss)
    rows = [row | {"clients_dropped": dropped} for row in rows]
    buffer = io.BytesIO()
    torch.save({"round": round_, "identity": identity(cfg), "history": {"metrics": rows}}, buffer)
    return files | {lease.CHECKPOINT: buffer.getvalue()}


@pytest.mark.parametrize(
    "files, said",
    [
        (lambda cfg: forged(cfg, "2", 2), "its checkpoint's round '2' is no round of a 3-round run"),
        (lambda cfg: forged(cfg, True, 1), "its checkpoint's round True is no round of a 3-round run"),
        (lambda cfg: forged(cfg, 400, 2), "its checkpoint is at round 400, beyond the run's 3"),
        (lambda cfg: forged(cfg, 2, 1), "its checkpoint's history does not hold its rounds 1 to 2"),
        (
            lambda cfg: forged(cfg, 2, 2, float("nan")),
            "its checkpoint has a loss nan at round 1 that no round",
        ),
        (lambda cfg: forged(cfg, 2, 2, float("inf"), "3"), "its checkpoint has a loss inf at round 1"),
        (
            lambda cfg: checkpointed(cfg, 2) | {"metrics.csv": metrics(200)[0]},
            "its metrics.csv has a row 4 of a 3-round run",
        ),
    ],
    ids=["round a string", "round a bool", "round past the run", "history behind", "nan loss", "inf", "rows"],
)
def test_a_forged_checkpoint_or_metrics_file_is_refused_saying_why(plan, configs, tmp_path, files, said):
    """A checkpoint's round is an int within the run, its history holds exactly its rounds with
    losses a round reports, and metrics.csv has no row past the run's rounds: else not taken."""
    kept, fedavg = tmp_path / "kept", "rmnist-shards/fedavg/seed0"
    lines = campaign.collect(plan, output(tmp_path / "out", {fedavg: files(configs[fedavg])}), kept)
    assert lines[0].startswith(f"{fedavg}: {said}")
    assert lines[0].endswith(": not taken") and not (kept / fedavg).exists()


def test_a_round_whose_clients_all_dropped_out_has_a_nan_loss_and_is_taken(plan, configs, tmp_path):
    kept, fedavg = tmp_path / "kept", "rmnist-shards/fedavg/seed0"
    files = forged(configs[fedavg], 2, 2, float("nan"), dropped="5")
    files["metrics.csv"] = checkpointed(configs[fedavg], 2)["metrics.csv"]
    lines = campaign.collect(plan, output(tmp_path / "out", {fedavg: files}), kept)
    assert lines[0] == f"{fedavg}: round 0 → 2" and (kept / fedavg / lease.CHECKPOINT).exists()


def test_one_collect_at_a_time(plan, configs, tmp_path):
    kept, folder = tmp_path / "kept", "rmnist-shards/local/seed2"
    out = output(tmp_path / "out", {folder: checkpointed(configs[folder], 1)})
    with lease.collecting(kept):
        with pytest.raises(FedmetaError, match=f"another collect into {re.escape(str(kept))} .*is under way"):
            campaign.collect(plan, out, kept)
    assert not (kept / folder).exists()
    assert campaign.collect(plan, out, kept)[0] == f"{folder}: round 0 → 1"


def test_a_job_does_not_carry_its_runs_out_beside_a_collect(plan, tmp_path, monkeypatch):
    from fedmeta import grid

    monkeypatch.setattr(grid, "run", lambda *args, **kwargs: [])
    monkeypatch.setattr(campaign, "CARRY_OUT_WAIT", 0.3)
    kept = tmp_path / "kept"
    with lease.collecting(kept), pytest.raises(FedmetaError, match="is under way"):
        campaign.run(plan, 600, kept, tmp_path / "runs", parallel=1)
    assert not (kept / "jobs.jsonl").exists()


def test_a_job_ending_with_another_waits_for_its_carry_out_and_keeps_its_record(plan, tmp_path, monkeypatch):
    # two jobs, one a core, given the same deadline end in the same second: the second to reach
    # the kept runs used to be refused, and its record and its runs' carry-out were lost
    import threading

    from fedmeta import grid

    monkeypatch.setattr(grid, "run", lambda *args, **kwargs: [])
    kept, holding, done = tmp_path / "kept", threading.Event(), threading.Event()

    def other_jobs_carry_out():
        with lease.collecting(kept):
            holding.set()
            done.wait(10)

    other = threading.Thread(target=other_jobs_carry_out)
    other.start()
    holding.wait(10)
    threading.Timer(0.5, done.set).start()
    campaign.run(plan, 600, kept, tmp_path / "runs", parallel=1)
    other.join()
    assert done.is_set() and len((kept / "jobs.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("where", ["seed folder", "kept", "checkpoint", "jobs.jsonl"])
def test_a_link_already_in_the_kept_runs_is_refused_and_never_written_through(plan, configs, tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / lease.CHECKPOINT).write_bytes(b"outside")
    (outside / "jobs.jsonl").write_bytes(b"outside")
    kept, folder = tmp_path / "results" / "runs" / "quick", "rmnist-shards/local/seed0"
    link = {
        "seed folder": kept / folder,
        "kept": kept,
        "checkpoint": kept / folder / lease.CHECKPOINT,
        "jobs.jsonl": kept / "jobs.jsonl",
    }[where]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / link.name if link.name in ("jobs.jsonl", lease.CHECKPOINT) else outside)
    out = output(tmp_path / "out", {folder: checkpointed(configs[folder], 2)})
    with pytest.raises(
        FedmetaError, match=f"{link} is a symbolic link: collect writes only into real folders"
    ):
        campaign.collect(plan, out, kept)
    assert (outside / lease.CHECKPOINT).read_bytes() == b"outside"
    assert (outside / "jobs.jsonl").read_bytes() == b"outside" and len(list(outside.iterdir())) == 2


def test_a_full_disk_names_the_file_and_leaves_nothing_behind(plan, configs, tmp_path, monkeypatch):
    kept, folder = tmp_path / "kept", "rmnist-shards/local/seed0"
    real = os.fsync

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(FedmetaError, match=rf"cannot write {kept / folder}/\S+ \(No space left on device\)"):
        campaign.collect(plan, output(tmp_path / "out", {folder: checkpointed(configs[folder], 1)}), kept)
    monkeypatch.setattr(os, "fsync", real)
    assert not list(kept.rglob("*.collecting"))


# --- readers never crash on kept files ------------------------------------------------------------


def test_the_campaigns_state_skips_a_rounds_seconds_no_run_has(plan, tmp_path):
    kept = tmp_path / "kept"
    for unit in campaign.units(plan, kept):
        for folder in unit.folders(kept):
            folder.mkdir(parents=True)
            (folder / "metrics.csv").write_text("round,round_seconds\n1,1e308\n2,2.0\n")
    state = campaign.status(plan, kept)  # 1e308 s a round once overflowed the leases' count
    assert "of one command" in state and "| 2.0000 |" in state


def test_a_metrics_file_of_an_earlier_version_is_read_by_its_own_columns(tmp_path):
    """Columns are only ever added at the end: a run written before the last of them (beside_cores)
    is still one fedmeta wrote, read by its own header; a renamed column or a short row is not."""
    from fedmeta.runs import _foreign_metrics

    earlier = METRIC_FIELDS[:-1]
    row = ["1", "0.5", "2.0", "0"] + [""] * (len(earlier) - 4)
    text = ",".join(earlier) + "\n" + ",".join(row) + "\n"
    assert campaign._metrics(text.encode(), 1, 1) == ([(1, 0.5)], None)
    (tmp_path / "metrics.csv").write_text(text)
    assert not _foreign_metrics(tmp_path / "metrics.csv")
    renamed = text.replace("round_seconds", "seconds", 1)
    assert "does not begin with fedmeta's columns" in campaign._metrics(renamed.encode(), 1, 1)[1]
    (tmp_path / "metrics.csv").write_text(renamed)
    assert _foreign_metrics(tmp_path / "metrics.csv")
    short = ",".join(earlier) + "\n" + ",".join(row[:-1]) + "\n"
    assert "has a row 1 where row 1 belongs" in campaign._metrics(short.encode(), 1, 1)[1]


def test_a_kept_metrics_row_that_is_not_numbers_skips_that_run_in_the_report(tmp_path, caplog):
    from fedmeta import report

    run = tmp_path / "rmnist-shards" / "local" / "seed0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"accuracy": 0.8, "curve": [0.5, 0.8], "rounds": 2}))
    for bad in ("x,1.0,0.5,0,abc,,", "x,1.0,0.5,0,0.5,,", "1,1.0,0.5,0,7.5,,", "1,1.0,0.5,0,nan,,"):
        (run / "metrics.csv").write_text(",".join(METRIC_FIELDS) + "\n" + bad + "\n")
        assert report.collect(tmp_path) == {}
        assert "is not one a run writes" in caplog.text


# --- a property: whatever a job's output holds -----------------------------------------------------

HOSTILE = [
    "good checkpoint",
    "good finished",
    "summary only",
    "shorter run",
    "other method",
    "other run's rounds",
    "foreign identity",
    "bad metrics",
    "link in kept",
    "bad id",
    "history kept without checkpoint",
]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(
        st.tuples(st.sampled_from(HOSTILE), st.integers(0, 5), st.integers(1, 2)), min_size=1, max_size=6
    )
)
def test_whatever_a_job_brings_back_nothing_kept_rewinds_or_changes_identity(
    plan, configs, tmp_path_factory, jobs
):
    """Outputs built at random from the hostile kinds above, collected one after another: after each,
    nothing outside the kept runs changed, no kept run moved back or vanished, and every kept run is
    the campaign's run for its folder."""
    base = tmp_path_factory.mktemp("hostile")
    kept, outside = base / "results" / "runs" / "quick", base / "outside"
    outside.mkdir()
    (outside / lease.CHECKPOINT).write_bytes(b"outside")
    folders = sorted(configs)
    for i, (kind, which, round_) in enumerate(jobs):
        folder = folders[which]
        cfg, other = configs[folder], configs[folders[(which + 3) % 6]]
        runs, job = {}, {"id": f"job{i}"}
        if kind == "good checkpoint":
            runs = {folder: checkpointed(cfg, round_)}
        elif kind == "good finished":
            runs = {folder: finished(cfg)}
        elif kind == "summary only":
            runs = {folder: {"summary.json": finished(cfg)["summary.json"]}}
        elif kind == "shorter run":
            runs, job = (
                {folder: finished(cfg, rounds=2)},
                {"id": f"job{i}", "overrides": ["federation.rounds=2"]},
            )
        elif kind == "other method":
            runs = {folder: finished(other)}
        elif kind == "other run's rounds":
            runs = {folder: checkpointed(cfg, round_ + 1, loss=9.0)}
        elif kind == "foreign identity":
            runs = {folder: checkpointed(cfg, round_, ident=identity(other))}
        elif kind == "bad metrics":
            runs = {folder: checkpointed(cfg, round_) | {"metrics.csv": b"round,train_loss\nx,1\n"}}
        elif kind == "link in kept" and not (kept / folders[0]).exists():
            (kept / folders[0].rsplit("/", 1)[0]).mkdir(parents=True, exist_ok=True)
            (kept / folders[0]).symlink_to(outside)
            runs = {folders[0]: checkpointed(configs[folders[0]], round_)}
        elif kind == "bad id":
            job = {"id": "../../outside/escaped"}
        elif kind == "history kept without checkpoint" and not (kept / folder).exists():
            keep(kept, folder, {"config.yaml": OmegaConf.to_yaml(cfg).encode(), "metrics.csv": metrics(2)[0]})
            runs = {folder: checkpointed(cfg, 1)}
        before = {f: lease.run_state(kept / f, ROUNDS) if not (kept / f).is_symlink() else 0 for f in folders}
        recorded = {f: recorded_rounds(kept / f) if not (kept / f).is_symlink() else 0 for f in folders}
        try:
            campaign.collect(plan, output(base / f"out{i}", runs, **job), kept)
        except FedmetaError as exc:
            assert "\n" not in str(exc)
        assert sorted(p.name for p in outside.iterdir()) == [lease.CHECKPOINT]
        assert (outside / lease.CHECKPOINT).read_bytes() == b"outside"
        assert {p.name for p in base.iterdir() if not p.name.startswith("out")} <= {"outside", "results"}
        for f in folders:
            if (kept / f).is_symlink():
                continue
            assert lease.run_state(kept / f, ROUNDS) >= before[f], (f, jobs)
            assert recorded_rounds(kept / f) >= recorded[f], (f, jobs)
            if (kept / f / "config.yaml").exists():
                assert not campaign._config_problem((kept / f / "config.yaml").read_bytes(), configs[f])
            if (kept / f / lease.CHECKPOINT).exists():
                assert not campaign._foreign(kept / f / lease.CHECKPOINT, configs[f])


def test_the_lease_stand_in_writes_fedmetas_columns():
    from lease_standin import METRIC_FIELDS as standin_fields

    assert standin_fields == METRIC_FIELDS


# --- what presets, campaigns and overrides may say -------------------------------------------------


@pytest.mark.parametrize(
    "change, said",
    [
        ("evaluations: 0", "evaluations must be a count ≥ 1"),
        ("evaluations: {rmnist: 0}", "evaluations must be a count ≥ 1"),
        ("rounds: {rmnist: 0}", "rounds must map data sets to rounds ≥ 1"),
        ("methods: [local, local]", "methods lists local twice"),
        ("seeds: [0, 0]", "seeds lists 0 twice"),
        ("overrides: [output.root=/elsewhere]", "overrides may not set output.root"),
    ],
)
def test_a_preset_that_would_run_other_than_it_says_is_refused_in_one_line(
    tmp_path, monkeypatch, change, said
):
    from fedmeta import grid

    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "mine.yaml").write_text(f"inherits: quick\n{change}\n")
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path))
    with pytest.raises(FedmetaError, match=re.escape(f"preset 'mine': {said}")) as error:
        grid.load_preset("mine")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "override",
    [
        "method=pfedme method.beta=1e308",
        "method=ditto method.lam=1e308",
        "method=scaffold method.server_lr=1e308",
        "method=perfedavg method.delta=5e-324",
    ],
)
def test_a_value_inside_a_declared_range_that_float32_cannot_hold_is_refused_naming_the_key(override):
    key = override.split()[1].split("=")[0]
    with pytest.raises(FedmetaError, match=rf"^{re.escape(key)}=.* of magnitude 1e-08 to 1e\+08"):
        compose(override.split())


@pytest.mark.parametrize("override", ["method.lam=-1", "method.lam=1e308"])
def test_evaluate_checks_a_methods_declared_ranges_as_train_does(tmp_path, override):
    from fedmeta.reevaluate import evaluate_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(["method=ditto"])))
    (run / lease.CHECKPOINT).write_bytes(b"")
    (run / "summary.json").write_text("{}")
    with pytest.raises(FedmetaError, match=rf"^{re.escape(override.split('=')[0])}="):
        evaluate_run(run, [override])


@pytest.mark.parametrize(
    "change, said",
    [
        ({"order": ["rmnist-shards", "rmnist-iid", "rmnist-shards"]}, "order lists rmnist-shards twice"),
        ({"overrides": ["output.root=/elsewhere"]}, "overrides may not set output.root"),
    ],
)
def test_a_campaign_that_lists_a_unit_twice_or_moves_its_runs_is_refused(change, said):
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "campaign.yaml").read_text()) | change
    assert campaign._campaign_problem(raw).startswith(said)


def test_a_campaign_job_may_not_move_its_runs(monkeypatch, capsys):
    from fedmeta.cli import main

    assert main(["campaign", "--budget", "150", "output.root=/elsewhere"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop output.root=" in err


@pytest.mark.parametrize(
    "until, said",
    [
        (10, "--until must leave a number of seconds above the 25 s"),  # its own start is spent from it
        (float("nan"), "--until takes the job's end as a Unix time"),
    ],
)
def test_a_campaign_job_until_a_time_counts_its_own_start_against_it(until, said, capsys):
    import time

    from fedmeta.cli import main

    assert main(["campaign", "--until", str(time.time() + until)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err
    assert main(["campaign", "--until", "1e12", "--budget", "100"]) == 2  # one end, not two
    assert "instead of --budget" in capsys.readouterr().err


def test_a_symlinked_summary_is_not_read_through_the_link(tmp_path, caplog):
    from fedmeta import report

    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"accuracy": 0.99, "curve": [0.5, 0.99], "rounds": 2}))
    run = tmp_path / "kept" / "rmnist-shards" / "local" / "seed0"
    run.mkdir(parents=True)
    (run / "summary.json").symlink_to(outside)
    (run / "metrics.csv").write_text(",".join(METRIC_FIELDS) + "\n1,1.0,0.5,0,0.5,,\n")
    assert report.collect(tmp_path / "kept") == {}
    assert "a symbolic link there may lead anywhere" in caplog.text


def test_a_deployment_too_large_for_its_ports_blames_the_nodes(capsys):
    from fedmeta.cli import main

    assert main(["flower", "deploy", "--nodes", "70000", "--port", "9091"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nodes 70000 leaves no room for their ports" in err
    assert main(["flower", "deploy", "--nodes", "60000", "--port", "9091"]) == 2
    assert "e.g. --port 5532" in capsys.readouterr().err  # a port that fits, not the one refused
