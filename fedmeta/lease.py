"""What a short job gains leaves its machine as it is made, and collecting it never loses, rewinds
or escapes.

A lent machine may be taken back at any moment, and only the files in its output folder come back
(at most 8, each below 16 MiB). So a job does not pack its runs at the end: while it runs, a
:class:`Packer` writes, after every checkpoint or summary its runs write and at least once a minute,
a whole archive of what the job has gained so far, in one of two slots (``runs-a.NN``,
``runs-b.NN``): the slot not named by ``lease.json``, then ``lease.json`` itself, replaced
atomically, naming the new slot's parts, their sizes and hashes, each run's round and the job's
record so far. A SIGKILL at any moment leaves the previous manifest and its parts whole.

``fedmeta.campaign.collect`` reads such a folder back into the kept runs (``results/runs/<preset>/``)
with what is here: everything that came back is data to check, never a path to follow. The
manifest, every part and the log are read only as regular files of bounded size (a link or a FIFO
is refused unopened), the job's record field by field (its id names a file: a plain name only),
the archive whole, every name in it checked against the campaign's run folders (no path elsewhere,
no link, a size limit per kind of file), unpacked aside; a run is then judged against the
campaign's own settings for its folder and taken only where it continues the kept one and is
further along. One collect at a time (:func:`collecting`), never writing through a link
(:func:`no_links`). The job's record is appended to ``jobs.jsonl`` (or replaces the earlier
collect of the same job, when further along). An older output collected after a newer one, the
same output twice, a truncated or tampered one: nothing kept is lost or moved back.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import math
import os
import re
import stat
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fedmeta.errors import FedmetaError

MANIFEST = "lease.json"
FORMAT = 1
SLOTS = ("a", "b")
PART_BYTES = 15 * 2**20  # below the 16 MiB a file may have to come back
PARTS_PER_SLOT = 2  # two slots of two parts, the manifest, its replacement and the log: 7 of the 8 files
ARCHIVE_BYTES = PART_BYTES * PARTS_PER_SLOT
CHECKPOINT = "checkpoint.ckpt"
PART_NAME = re.compile(r"runs-([ab])\.(\d\d)")
RUN_FOLDER = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+/seed\d+")
# A job's id names its log's file: a plain name, never a path (the campaign writes 12 hex digits).
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MANIFEST_BYTES = 2**20
LOG_BYTES = 16 * 2**20  # a file bigger than this cannot come back from a lent machine
MAX_PARTS = 8  # the files a lent machine brings back
MAX_SECONDS = 10**7  # a job's seconds beyond this (four months) are not a measurement
LOCK = ".collect.lock"


def checkpoint_round(path: Path) -> int | None:
    """The round a checkpoint was written after, or None where it cannot be read (memory-mapped:
    the weights are not read)."""
    import torch  # here: describing an output folder (scripts/gpu_job.sh's last step) needs no torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["round"])
    except Exception:  # noqa: BLE001 — whatever a cut-off or foreign file raises
        return None


def run_state(folder: Path, rounds: int) -> int:
    """A run folder's rounds done: all of them once its summary is written, else its checkpoint's
    round (its metrics.csv may be ahead of it: rows after the checkpoint are redone on resume), at
    most ``rounds - 1``: a run is done only once its summary is written."""
    if (folder / "summary.json").is_file():
        return rounds
    if not (folder / CHECKPOINT).is_file():
        return 0
    return min(checkpoint_round(folder / CHECKPOINT) or 0, rounds - 1)


class Packer:
    """Packs the run folders ``folders()`` names (relative to ``root``) into ``out`` as described
    above, each time one of their checkpoints or summaries changes (looked at every ``poll_s``) and
    at least every ``every_s``; ``record()`` is the job's record so far, written into the manifest.
    Finished runs go first; unfinished ones while the archive stays within ``limit_bytes``, a unit's
    seeds together, the furthest along first; what did not fit is named in the manifest, and only
    its small files go (its measured speed)."""

    def __init__(
        self,
        root: Path,
        out: Path,
        folders: Callable[[], list[Path]],
        record: Callable[[], dict],
        limit_bytes: int = ARCHIVE_BYTES,
        poll_s: float = 2.0,
        every_s: float = 60.0,
    ):
        self.root, self.out, self.folders, self.record = root, out, folders, record
        self.limit_bytes, self.poll_s, self.every_s = min(limit_bytes, ARCHIVE_BYTES), poll_s, every_s
        self.generation, self.slot, self.written = 0, None, 0.0
        self._seen: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)
        current = _read_json(out / MANIFEST)
        if isinstance(current, dict) and current.get("slot") in SLOTS:  # a second job into the same folder
            self.slot, self.generation = current["slot"], int(current.get("generation", 0))

    def start(self) -> Packer:
        self._thread = threading.Thread(target=self._loop, name="packer", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            seen = self._signature()
            if seen != self._seen or time.time() - self.written >= self.every_s:
                try:
                    self.pack()
                except Exception as exc:  # noqa: BLE001 — the runs go on; the next pack tries again
                    print(f"packer: could not pack ({type(exc).__name__}: {exc}); trying again", flush=True)

    def stop(self) -> dict:
        """The last pack, after the runs ended; returns its manifest."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.pack()

    def _signature(self) -> dict:
        found = {}
        for folder in self.folders():
            for name in ("summary.json", CHECKPOINT):
                try:
                    found[folder / name] = (self.root / folder / name).stat().st_mtime_ns
                except OSError:
                    pass
        return found

    def pack(self) -> dict:
        with self._lock:
            self._seen = self._signature()
            files, runs, left_out = self._snapshot()
            slot = SLOTS[1] if self.slot == SLOTS[0] else SLOTS[0]
            parts = _write_parts(self.out, slot, files)
            manifest = {
                "format": FORMAT,
                "generation": self.generation + 1,
                "written": round(time.time(), 1),
                "slot": slot,
                "parts": parts,
                "runs": runs,
                "left_out": left_out,
                "job": self.record(),
            }
            tmp = self.out / (MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out / MANIFEST)
            for stale in self.out.glob(f"runs-{slot}.*"):  # parts of this slot beyond the new count
                if stale.name not in {p["name"] for p in parts}:
                    stale.unlink(missing_ok=True)
            self.slot, self.generation, self.written = slot, manifest["generation"], time.time()
            return manifest

    def _snapshot(self) -> tuple[list[tuple[str, bytes]], dict, list[str]]:
        """Each run folder's files, read once each (a checkpoint is replaced by a rename: an open
        file is one whole checkpoint): finished runs first, then the unfinished ones by unit (a
        setting × method: its seeds resume together), the furthest along first."""
        finished, units = [], {}
        for folder in self.folders():
            path = self.root / folder
            if (path / "summary.json").is_file():
                finished.append((folder, None))
            elif (path / CHECKPOINT).is_file():
                units.setdefault(folder.parent, []).append((folder, checkpoint_round(path / CHECKPOINT)))
        ordered = sorted(units.values(), key=lambda runs: -min(r or 0 for _, r in runs))
        files, runs, left_out, total = [], {}, [], 0
        for group in [[run] for run in finished] + ordered:
            contents = {folder: self._read(folder, round_ is None) for folder, round_ in group}
            size = sum(len(data) + 1024 for found in contents.values() for _, data in found)
            carried = group[0][1] is None or total + size <= self.limit_bytes
            for folder, round_ in group:
                found = contents[folder]
                if carried:
                    runs[folder.as_posix()] = "finished" if round_ is None else round_
                else:  # its small files still travel: its rounds' seconds measure the unit for the next plan
                    left_out.append(f"{folder.as_posix()} (round {round_})")
                    found = [(name, data) for name, data in found if not name.endswith(CHECKPOINT)]
                total += sum(len(data) + 1024 for _, data in found)
                files += found
        return files, runs, left_out

    def _read(self, folder: Path, finished: bool) -> list[tuple[str, bytes]]:
        found = []
        for name in FINISHED_FILES if finished else UNFINISHED_FILES:
            try:
                found.append((f"{folder.as_posix()}/{name}", (self.root / folder / name).read_bytes()))
            except OSError:
                pass
        return found


def _write_parts(out: Path, slot: str, files: list[tuple[str, bytes]]) -> list[dict]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            archive.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    parts = []
    for i, start in enumerate(range(0, max(len(data), 1), PART_BYTES)):
        chunk, name = data[start : start + PART_BYTES], f"runs-{slot}.{i:02d}"
        with open(out / name, "wb") as f:
            f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return parts


# What travels of a run: a finished one's small files; an unfinished one's files and checkpoint.
FINISHED_FILES = (
    "config.yaml",
    "metrics.csv",
    "curves.csv",
    "summary.json",
    "evaluations.jsonl",
    "command.txt",
    "model.pt",  # the final model, compact (output.keep_model): what re-scores a kept run
)
UNFINISHED_FILES = ("config.yaml", "metrics.csv", "curves.csv", "evaluations.jsonl", CHECKPOINT)
ALLOWED = set(FINISHED_FILES) | set(UNFINISHED_FILES)
# What every finished run has written (evaluations.jsonl and command.txt come later, if at all).
FINISHED_REQUIRED = ("config.yaml", "metrics.csv", "curves.csv", "summary.json")
# The most a run's file may hold when collected: a 1,000-round metrics.csv is about 100 KB.
SMALL_FILE_BYTES = 2**20
FILE_BYTES = {
    CHECKPOINT: ARCHIVE_BYTES,
    "metrics.csv": 16 * 2**20,
    "curves.csv": 16 * 2**20,
    "evaluations.jsonl": 16 * 2**20,
    "model.pt": 16 * 2**20,
}


def _read_json(path: Path):
    try:
        return json.loads(read_regular(path, MANIFEST_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError, FedmetaError):  # nested past the parser's depth
        return None


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``. A link (it could lead anywhere), a FIFO (a read
    would wait for ever), a device or a file over ``limit`` bytes raises FedmetaError naming it;
    nothing but a regular file is opened for reading. A missing file raises FileNotFoundError."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise FedmetaError(f"{path} is a symbolic link")
    if not stat.S_ISREG(mode):
        raise FedmetaError(f"{path} is not a regular file (a FIFO, a device or a folder)")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the two looks
            raise FedmetaError(f"{path} is not a regular file (a FIFO, a device or a folder)")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FedmetaError(f"{path} holds more than {limit} bytes")
    return data


def read_output(source: Path) -> tuple[dict, dict[str, dict[str, bytes]]]:
    """A job's output folder → its manifest and, per run folder, its files. Everything is checked
    first; any fault is one line naming it, and nothing is returned."""
    if not source.is_dir():
        raise FedmetaError(f"{source} is not a folder: give the folder the job's files came back to")
    try:
        manifest = json.loads(read_regular(source / MANIFEST, MANIFEST_BYTES).decode("utf-8"))
    except FedmetaError as exc:
        raise FedmetaError(f"{exc}, not the manifest a job writes: nothing collected") from None
    except (OSError, ValueError, RecursionError):
        manifest = None
    if manifest is None:
        older = (
            " (it holds runs.tar.gz: a job of the older format, collect it with that version)"
            if any(source.glob("runs.tar.gz*"))
            else ""
        )
        raise FedmetaError(
            f"{source} holds no readable {MANIFEST}{older}: give the folder the job's files came back to"
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise FedmetaError(f"{source / MANIFEST} {problem}: nothing collected")
    chunks = []
    for part in manifest["parts"]:
        path = source / part["name"]
        try:
            chunk = read_regular(path, PART_BYTES)
        except FedmetaError as exc:
            raise FedmetaError(f"{exc}, not a part a job writes: nothing collected") from None
        except OSError:
            raise FedmetaError(
                f"{path} is missing: the job's output did not all come back; nothing collected"
            ) from None
        if len(chunk) != part["bytes"] or hashlib.sha256(chunk).hexdigest() != part["sha256"]:
            raise FedmetaError(
                f"{path} is not the part {MANIFEST} names ({len(chunk)} bytes, {part['bytes']} expected, or "
                "another hash): cut short or replaced; nothing collected"
            )
        chunks.append(chunk)
    runs: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r:") as archive:
            for member in archive:
                folder, _, name = member.name.rpartition("/")
                if (
                    not member.isfile()
                    or member.issparse()
                    or not RUN_FOLDER.fullmatch(folder)
                    or name not in ALLOWED
                ):
                    raise FedmetaError(
                        f"{source}'s archive holds {member.name!r}, which is not a run's file: nothing collected"
                    )
                if name in runs.get(folder, {}):
                    raise FedmetaError(f"{source}'s archive holds {member.name} twice: nothing collected")
                if member.size > FILE_BYTES.get(name, SMALL_FILE_BYTES):
                    raise FedmetaError(
                        f"{source}'s archive holds {member.name} of {member.size} bytes, more than a run "
                        f"writes ({FILE_BYTES.get(name, SMALL_FILE_BYTES)}): nothing collected"
                    )
                runs.setdefault(folder, {})[name] = archive.extractfile(member).read()
    except tarfile.TarError as exc:
        raise FedmetaError(f"{source}'s archive cannot be read ({exc}): nothing collected") from None
    return manifest, runs


def _manifest_problem(manifest) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"is not a manifest of format {FORMAT}"
    parts = manifest.get("parts")
    if manifest.get("slot") not in SLOTS or not isinstance(parts, list) or not parts:
        return "names no slot or no parts"
    if len(parts) > MAX_PARTS:
        return f"names {len(parts)} parts, more than the {MAX_PARTS} files a lent machine brings back"
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            return "names a part that is not a mapping"
        name = part.get("name")
        match = PART_NAME.fullmatch(name) if isinstance(name, str) else None
        if not match or match[1] != manifest["slot"] or int(match[2]) != i:
            return f"names a part {name!r} that is not part {i} of slot {manifest['slot']}"
        size = part.get("bytes")
        if not _count(size) or size > PART_BYTES or not isinstance(part.get("sha256"), str):
            return f"gives part {name} no size (at most {PART_BYTES} bytes) or no hash"
    job = manifest.get("job")
    if not isinstance(job, dict):
        return "holds no job record"
    return record_problem(job)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_SECONDS
    )


def record_problem(job: dict) -> str | None:
    """What makes ``job`` (a manifest's job record) not one a campaign writes, or None: it is read
    by every later ``fedmeta campaign``, so each field is checked, not just carried."""
    if not isinstance(job.get("id"), str) or not JOB_ID.fullmatch(job["id"]):
        return (
            f"holds a job id {job.get('id')!r} that is not a plain name (letters, digits, _ and -, "
            "at most 64): it would name a file elsewhere"
        )
    for key in ("seconds", "budget_seconds"):
        if not _seconds(job.get(key)):
            return f"holds a job record whose {key} {job.get(key)!r} is not a number of seconds (0 to {MAX_SECONDS})"
    for key in ("started", "hardware"):
        if not isinstance(job.get(key), str) or len(job[key]) > 200 or "\n" in job[key]:
            return f"holds a job record whose {key} is not a line of text"
    if "parallel" in job and not (_count(job["parallel"]) and job["parallel"] >= 1):
        return f"holds a job record whose parallel {job['parallel']!r} is not a count of units ≥ 1"
    units = job.get("units")
    if not isinstance(units, dict) or not all(
        isinstance(label, str)
        and isinstance(moved, list)
        and len(moved) == 2
        and all(isinstance(side, list) and all(_count(r) for r in side) for side in moved)
        for label, moved in units.items()
    ):
        return "holds a job record whose units are not {unit: [rounds before, rounds after]}"
    overrides = job.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        return "holds a job record whose overrides are not key=value strings"
    return None


def install(files: dict[str, bytes], target: Path) -> None:
    """Make ``target`` hold exactly ``files`` (a run's state, checked), each file written beside and
    renamed; summary.json, then the checkpoint, last, and what they replace removed only after, so
    that a stop in between leaves the kept run as far along as it was."""
    target.mkdir(parents=True, exist_ok=True)
    order = sorted(files, key=lambda name: (name == "summary.json", name == CHECKPOINT))
    for name in order:
        write_file(target / name, files[name])
    for stale in ALLOWED - set(files):
        (target / stale).unlink(missing_ok=True)


def write_file(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or what it held before: written beside it (never through a link
    planted there), synced, then renamed over it. A failure (a full disk) removes what it wrote and
    is one line naming the file."""
    tmp = path.with_name(path.name + ".collecting")
    try:
        tmp.unlink(missing_ok=True)  # a write cut off earlier; a link there is removed, not followed
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise FedmetaError(
            f"cannot write {path} ({exc.strerror or type(exc).__name__}): free space or make it writable, "
            "then collect again (what was kept there is as it was)"
        ) from None


def no_links(path: Path, base: Path) -> None:
    """Refuse, in one line, a symbolic link on the way from ``base`` to ``path`` (``base`` itself
    included, and every folder of a relative ``base``): a collect writes only into real folders of
    the project, never through a link that may lead anywhere."""
    parts = base.parts
    chain = [base] if base.is_absolute() else [Path(*parts[: i + 1]) for i in range(len(parts))]
    rest = path.relative_to(base).parts
    chain += [base.joinpath(*rest[: i + 1]) for i in range(len(rest))]
    for step in chain:
        if step.is_symlink():
            raise FedmetaError(
                f"{step} is a symbolic link: collect writes only into real folders of the project; "
                "replace it with a folder (or remove it) and collect again"
            )


@contextmanager
def collecting(kept: Path, wait: float = 0.0) -> Iterator[None]:
    """One writer at a time into ``kept`` (a collect, or a job carrying its runs out): two at once
    could each take a run the other replaced, and the slower one would rewind it. A second is
    refused in one line, after waiting up to ``wait`` seconds for the first (two jobs given the
    same deadline, one a core, end together)."""
    no_links(kept / LOCK, kept)
    kept.mkdir(parents=True, exist_ok=True)
    fd = os.open(kept / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FedmetaError(f"{kept / LOCK} is not a regular file: remove it and collect again")
        given_up = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= given_up:
                    raise FedmetaError(
                        f"another collect into {kept} (or a job carrying its runs out there) is under way: "
                        "run this one once it has ended"
                    ) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


LOG = "job.log"
EQUIVALENCE = re.compile(r"equivalence: passed ([A-Za-z0-9][A-Za-z0-9 ._()-]{0,79}) sources ([0-9a-f]{16})")
MACHINE = re.compile(r"machine: ([^;]{1,80});.*")


def read_log(source: Path) -> bytes | None:
    """The job's log, if it came back (a link, a FIFO or one over 16 MiB: one line, nothing collected)."""
    try:
        return read_regular(source / LOG, LOG_BYTES)
    except FileNotFoundError:
        return None
    except FedmetaError as exc:
        raise FedmetaError(f"{exc}, not the log a job writes: nothing collected") from None


def keep_log(log: bytes, job_id: str, logs: Path) -> list[str]:
    """The job's log kept as ``logs/jobs/<id>.log``, and its line saying that the card passed the
    recorded rounds' GPU tests with these sources added to ``logs/equivalence.txt`` (later jobs on
    that card model then skip them): only where the log holds one such line, of the form the job
    writes, for the card its first line names. Returns what was done, a line each."""
    target = logs / "jobs" / f"{job_id}.log"
    no_links(target, logs)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file(target, log)
    said = [f"job {job_id}: its log kept in {target}"]
    lines = log.decode("utf-8", errors="replace").splitlines()
    claims = [line for line in lines if line.startswith("equivalence: passed")]
    if not claims:
        return said
    machine = MACHINE.fullmatch(lines[0]) if lines else None
    passed = EQUIVALENCE.fullmatch(claims[0])
    if len(claims) > 1 or not passed or not machine or passed[1] != machine[1]:
        return [
            *said,
            f"job {job_id}: its log's 'equivalence: passed' lines are not the one a job writes for its "
            "card: not recorded",
        ]
    record = logs / "equivalence.txt"
    no_links(record, logs)
    try:
        known = read_regular(record, LOG_BYTES).decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        known = []
    entry = f"{passed[1]} sources {passed[2]}"
    if entry not in known:
        write_file(record, "".join(line + "\n" for line in [*known, entry]).encode("utf-8"))
        said.append(f"job {job_id}: {entry} recorded in {record}")
    return said


def unpack_checkpoint(data: bytes, workdir: Path) -> Path:
    """A checkpoint's bytes written to a file of ``workdir``, to be loaded (torch.load with
    weights_only: no code runs)."""
    fd, name = tempfile.mkstemp(suffix=".ckpt", dir=workdir)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(name)


def append_record(jobs: Path, record: dict) -> str:
    """Add the job's record to ``jobs`` (a JSON line each); a record of the same job already there
    is replaced only by one further along. Returns what was done, in a word."""
    try:
        lines = read_regular(jobs, LOG_BYTES).decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        lines = []
    kept, replaced, outcome = [], False, "appended"
    for line in lines:
        earlier = _parse(line)
        if isinstance(earlier, dict) and earlier.get("id") == record["id"]:
            earlier_seconds = earlier.get("seconds")
            if replaced or (_seconds(earlier_seconds) and earlier_seconds >= record["seconds"]):
                outcome = "already kept"
                kept.append(line)
            else:
                kept.append(json.dumps(record))
                outcome = "replaced"
            replaced = True
        else:
            kept.append(line)
    if not replaced:
        kept.append(json.dumps(record))
    jobs.parent.mkdir(parents=True, exist_ok=True)
    write_file(jobs, "".join(line + "\n" for line in kept).encode("utf-8"))
    return outcome


def _parse(line: str):
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def clear(out: Path) -> None:
    """An output folder emptied of an earlier job's manifest and parts."""
    for path in [out / MANIFEST, out / (MANIFEST + ".tmp"), *out.glob("runs-*.*")]:
        if path.is_file():
            path.unlink()


def describe(out: Path) -> str:
    """One line on the archive in ``out``: "final …" (the job's last pack), "partial …" (a pack made
    while its runs went on: the job was cut off after it) or "none"."""
    manifest = _read_json(out / MANIFEST)
    if _manifest_problem(manifest):
        return "none"
    runs = list(manifest.get("runs", {}).values())
    finished = sum(state == "finished" for state in runs)
    left_out = manifest.get("left_out") or []
    return (
        f"{'final' if manifest['job'].get('ended') else 'partial'} archive {manifest.get('generation')}: "
        f"{finished} finished runs, {len(runs) - finished} checkpoints, "
        f"{sum(p['bytes'] for p in manifest['parts']) / 2**20:.1f} MiB in {len(manifest['parts'])} parts"
        + (f"; not carried: {'; '.join(left_out)}" if left_out else "")
    )


if __name__ == "__main__":  # scripts/gpu_job.sh: what its OUT holds
    import sys

    print(describe(Path(sys.argv[1])))
