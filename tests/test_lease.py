"""The lease simulator: a job's output is killed at random moments, collected in and out of order,
repeated, truncated and tampered with; what a collected job reported is never lost, a kept run
never moves back, every kept checkpoint loads, and nothing is written outside the kept runs."""

import hashlib
import io
import json
import multiprocessing
import random
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import lease_standin
import pytest
import torch
from test_campaign import tiny_campaign

from fedmeta import campaign, lease
from fedmeta.checkpoint import identity
from fedmeta.config import compose
from fedmeta.errors import FedmetaError


@pytest.fixture(scope="module")
def plan(mnist_dir):
    return tiny_campaign(mnist_dir, methods=["local", "fedavg"])


@pytest.fixture(scope="module")
def identities(plan, tmp_path_factory):
    """Each run folder of the tiny campaign → the identity its checkpoints carry."""
    root = tmp_path_factory.mktemp("kept")
    found = {}
    for unit in campaign.units(plan, root):
        for job, folder in zip(unit.jobs, unit.folders(root)):
            found[folder.relative_to(root).as_posix()] = identity(compose(list(job.overrides)))
    return found


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def kept_rounds(plan, kept: Path) -> dict[str, int]:
    return {
        folder.relative_to(kept).as_posix(): done
        for unit in campaign.units(plan, kept)
        for folder, done in zip(unit.folders(kept), unit.rounds_done(kept))
    }


def start_job(
    tmp_path: Path,
    name: str,
    identities: dict,
    starts: dict[str, int],
    rounds: int = 3,
    step_s=0.1,
    configs: dict | None = None,
):
    """A stand-in job; its runs' config.yaml hold ``configs`` (identities, default: theirs) of 3 rounds."""
    plan = {
        "id": name,
        "root": str(tmp_path / name / "runs"),
        "out": str(tmp_path / name / "out"),
        "rounds": rounds,
        "step_s": step_s,
        "runs": {
            folder: [identities[folder], starts.get(folder, 0), (configs or identities)[folder]]
            for folder in identities
        },
    }
    (tmp_path / f"{name}.json").write_text(json.dumps(plan))
    # forked: a process of its own that a SIGKILL ends, without importing torch again (seconds each)
    process = multiprocessing.get_context("fork").Process(
        target=lease_standin.main, args=(str(tmp_path / f"{name}.json"),)
    )
    process.start()
    return process, tmp_path / name / "out"


def killed_job(tmp_path: Path, name: str, identities: dict, delay: float, **options) -> Path:
    """A stand-in job SIGKILLed ``delay`` seconds after its first archive (or ended by then)."""
    process, out = start_job(tmp_path, name, identities, {}, **options)
    deadline = time.time() + 60
    while not (out / lease.MANIFEST).exists() and process.is_alive() and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    process.kill()  # SIGKILL
    process.join()
    return out


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_jobs_killed_at_random_moments_and_collected_in_any_order_never_lose_or_rewind(
    plan, identities, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # collect writes results/… only under the kept folder given
    kept = tmp_path / "kept"
    rng = random.Random(0)
    outputs = []
    for i in range(5):  # a stand-in job's three rounds take about 0.3 s: some are killed, some end
        out = killed_job(tmp_path, f"job{i}", identities, rng.uniform(0.0, 0.4))
        if (out / lease.MANIFEST).is_file():
            outputs.append(out)
    assert len(outputs) == 5  # each packed before its kill
    rng.shuffle(outputs)
    outputs += outputs[:2]  # the same outputs twice more
    reported_max: dict[str, int] = {}
    for out in outputs:
        manifest, _ = lease.read_output(out)
        before = kept_rounds(plan, kept)
        lines = campaign.collect(plan, out, kept)
        after = kept_rounds(plan, kept)
        for folder, was in before.items():
            assert after[folder] >= was, (folder, was, after[folder], lines)  # never rewinds
        for folder, state in manifest["runs"].items():
            reported = 3 if state == "finished" else state
            reported_max[folder] = max(reported_max.get(folder, 0), reported)
            assert after[folder] >= reported_max[folder]  # what any collected job reported is kept
        for checkpoint in kept.rglob("checkpoint.ckpt"):  # every kept checkpoint loads, whole
            assert lease.checkpoint_round(checkpoint) is not None
            assert torch.load(checkpoint, weights_only=True)["weights"].numel() == 20_000
    records = [json.loads(line) for line in (kept / "jobs.jsonl").read_text().splitlines()]
    assert len({r["id"] for r in records}) == len(records) == len(set(map(str, outputs)))


def test_a_kill_while_packing_leaves_the_previous_archive_whole(plan, identities, tmp_path):
    """Killed within a few milliseconds of a pack, again and again: the manifest found always names
    whole parts (or there is none yet)."""
    readable, rng = 0, random.Random(1)
    for i in range(8):
        out = killed_job(tmp_path, f"kill{i}", identities, rng.uniform(0.0, 0.2), step_s=0.01)
        if (out / lease.MANIFEST).is_file():
            lease.read_output(out)  # raises on a part that is not whole
            readable += 1
        assert len(list(out.iterdir())) <= 7  # within the 8 files a lease brings back, the log aside
    assert readable == 8


def finished_output(plan, identities, tmp_path, name="whole") -> Path:
    process, out = start_job(tmp_path, name, identities, {})
    process.join(timeout=60)
    assert process.exitcode == 0
    return out


def test_a_truncated_or_replaced_part_is_refused_and_nothing_kept_changes(plan, identities, tmp_path):
    kept = tmp_path / "kept"
    older = finished_output(plan, identities, tmp_path, "older")
    campaign.collect(plan, older, kept)
    before = snapshot(kept)
    out = finished_output(plan, identities, tmp_path)
    part = out / lease.read_output(out)[0]["parts"][0]["name"]
    whole = part.read_bytes()
    part.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(FedmetaError, match="cut short or replaced; nothing collected"):
        campaign.collect(plan, out, kept)
    part.write_bytes(whole[:-1] + b"x")  # same size, other bytes
    with pytest.raises(FedmetaError, match="cut short or replaced"):
        campaign.collect(plan, out, kept)
    part.unlink()
    with pytest.raises(FedmetaError, match="is missing"):
        campaign.collect(plan, out, kept)
    for unreadable in ("{not json", "[" * 200_000 + "]" * 200_000):  # nested past the parser's depth
        (out / lease.MANIFEST).write_text(unreadable)
        with pytest.raises(FedmetaError, match="holds no readable lease.json"):
            campaign.collect(plan, out, kept)
    assert lease._read_json(out / lease.MANIFEST) is None and lease._parse("[" * 200_000) is None
    assert snapshot(kept) == before


def forge(out: Path, members: list[tarfile.TarInfo], data: bytes = b"x") -> None:
    """An output folder whose manifest is right about an archive holding ``members``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for member in members:
            archive.addfile(member, io.BytesIO(data) if member.isfile() else None)
    chunk = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs-a.00").write_bytes(chunk)
    job = {"id": "forged", "started": "x", "hardware": "x", "budget_seconds": 1, "seconds": 1, "units": {}}
    part = {"name": "runs-a.00", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
    (out / lease.MANIFEST).write_text(json.dumps({"format": 1, "slot": "a", "parts": [part], "job": job}))


@pytest.mark.parametrize(
    "name, kind",
    [
        ("../../escaped.txt", tarfile.REGTYPE),
        ("/tmp/escaped.txt", tarfile.REGTYPE),
        ("rmnist-shards/local/seed0/checkpoint.ckpt", tarfile.SYMTYPE),
        ("rmnist-shards/local/seed0/evil.py", tarfile.REGTYPE),
        ("rmnist-shards/../../seed0/summary.json", tarfile.REGTYPE),
        ("other-setting/local/seed0/summary.json", tarfile.REGTYPE),
    ],
)
def test_a_tampered_archive_is_refused_before_anything_is_written(plan, tmp_path, name, kind):
    member = tarfile.TarInfo(name)
    member.type, member.size = kind, 1 if kind == tarfile.REGTYPE else 0
    if kind == tarfile.SYMTYPE:
        member.linkname = "/etc/passwd"
    forge(tmp_path / "out", [member])
    kept = tmp_path / "results" / "kept"
    with pytest.raises(FedmetaError, match="nothing collected"):
        campaign.collect(plan, tmp_path / "out", kept)
    assert not kept.exists() or not any(kept.rglob("*"))
    assert not (tmp_path / "escaped.txt").exists() and not Path("/tmp/escaped.txt").exists()


def test_a_checkpoint_of_other_settings_or_a_wrong_summary_is_not_taken(plan, identities, tmp_path):
    kept = tmp_path / "kept"
    foreign = {folder: dict(ident, seed=99) for folder, ident in identities.items()}
    out = killed_job(tmp_path, "foreign", foreign, 0.2, rounds=50, configs=identities)
    lines = campaign.collect(plan, out, kept)
    assert any("was written by other settings" in line for line in lines)
    assert not list(kept.rglob("checkpoint.ckpt"))
    # a summary claiming an accuracy no run can have
    out = finished_output(plan, identities, tmp_path)
    _, runs = lease.read_output(out)
    folder = sorted(runs)[0]
    summary = json.loads(runs[folder]["summary.json"])
    for bad in (7.5, float("nan")):
        edited = tmp_path / f"edited-{bad}"
        shutil.rmtree(edited, ignore_errors=True)
        forged_runs = {
            folder: dict(runs[folder], **{"summary.json": json.dumps(summary | {"accuracy": bad}).encode()})
        }
        _repack(forged_runs, edited)
        lines = campaign.collect(plan, edited, kept)
        assert any("not a fraction in [0, 1]: not taken" in line for line in lines)
        assert not (kept / folder / "summary.json").exists()


def _repack(runs: dict[str, dict[str, bytes]], out: Path) -> None:
    members = []
    for folder, files in runs.items():
        for name, data in files.items():
            member = tarfile.TarInfo(f"{folder}/{name}")
            member.size = len(data)
            members.append((member, data))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for member, data in members:
            archive.addfile(member, io.BytesIO(data))
    chunk = buffer.getvalue()
    out.mkdir(parents=True)
    (out / "runs-b.00").write_bytes(chunk)
    job = {
        "id": f"edited-{out.name}".replace(".", "_"),
        "started": "x",
        "hardware": "x",
        "budget_seconds": 1,
        "seconds": 1,
        "units": {},
    }
    part = {"name": "runs-b.00", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
    (out / lease.MANIFEST).write_text(json.dumps({"format": 1, "slot": "b", "parts": [part], "job": job}))


def test_an_archive_over_its_limit_keeps_the_finished_runs_and_the_furthest_along_units_whole(tmp_path):
    """Three units of two seeds (~200 KB a checkpoint): within 900 KB, the finished run and the two
    units furthest along (by their slowest seed) travel whole; the third sends only its metrics."""
    root, out = tmp_path / "runs", tmp_path / "out"
    folders = []
    for method, rounds in (("a", (5, 6)), ("b", (9, 3)), ("c", (7, 8))):
        for seed, round_ in enumerate(rounds):
            folder = root / "s" / method / f"seed{seed}"
            folder.mkdir(parents=True)
            torch.save({"round": round_, "weights": torch.zeros(50_000)}, folder / "checkpoint.ckpt")
            (folder / "metrics.csv").write_text("round,round_seconds\n1,0.5\n")
            folders.append(folder.relative_to(root))
    (root / "s" / "d" / "seed0").mkdir(parents=True)
    (root / "s" / "d" / "seed0" / "summary.json").write_text('{"accuracy": 0.5}')
    folders.append(Path("s/d/seed0"))
    job = {"id": "x", "started": "x", "hardware": "x", "budget_seconds": 1, "seconds": 0.0, "units": {}}
    manifest = lease.Packer(root, out, lambda: folders, lambda: job, limit_bytes=900_000).pack()
    assert manifest["runs"] == {
        "s/d/seed0": "finished",
        "s/c/seed0": 7,
        "s/c/seed1": 8,
        "s/a/seed0": 5,
        "s/a/seed1": 6,
    }
    assert manifest["left_out"] == ["s/b/seed0 (round 9)", "s/b/seed1 (round 3)"]
    _, runs = lease.read_output(out)
    assert set(runs["s/b/seed0"]) == {"metrics.csv"}  # its speed travels, not its checkpoint
    assert set(runs["s/c/seed1"]) == {"metrics.csv", "checkpoint.ckpt"}


def test_a_job_that_could_pass_the_leases_per_command_limit_is_refused_in_one_line():
    job = Path(__file__).resolve().parent.parent / "scripts" / "gpu_job.sh"
    for seconds, limit in (("595", "600"), ("600", "600"), ("400", "300")):
        done = subprocess.run(
            ["bash", str(job), seconds],
            capture_output=True,
            text=True,
            env={"COMMAND_LIMIT": limit, "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done
        assert f"the lease's per-command limit {limit} s less 10" in done.stderr
