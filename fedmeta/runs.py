"""Everything a run leaves in runs/<dataset>-<partition>/<method>/seed<seed>/:
config.yaml (fully resolved), metrics.csv (one row per round), curves.csv (the personalization
curve at every evaluation), summary.json, checkpoint.ckpt — and what its Fabric loggers write
(``logger=[tensorboard,wandb]`` by default): tensorboard/, wandb/ (offline by default), csv/."""

from __future__ import annotations

import csv
import fcntl
import io
import json
import logging
import math
import os
import shutil
import socket
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedmeta.errors import FedmetaError, atomic_write

log = logging.getLogger("fedmeta")

METRIC_FIELDS = [
    "round",
    "train_loss",
    "round_seconds",
    "clients_dropped",
    "eval_accuracy",
    "eval_accuracy_std",
    "eval_step0_accuracy",
    "training_clients_accuracy",  # the training-clients protocol (evaluation.protocol both or training_clients)
    "training_clients_accuracy_std",
    "training_clients_weighted_accuracy",
    "beside_cores",  # the cores other processes kept busy during the round, on average (fedmeta.clock)
    "personalization_lr",  # the step size the evaluation personalized at (chosen by personalization.lr_rule)
]


def metrics_row(round_: int, loss, seconds: float, dropped: int, beside: float | None) -> dict:
    """A trained round's metrics.csv row, its evaluation's columns empty until there is one."""
    return dict.fromkeys(METRIC_FIELDS, "") | {
        "round": round_,
        "train_loss": loss,
        "round_seconds": seconds,
        "beside_cores": "" if beside is None else beside,
        "clients_dropped": dropped,
    }


def atomic_write_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or what it held before: written beside it, then renamed."""
    atomic_write(path, text)


def summary_problem(summary, rounds: int | None = None) -> str | None:
    """What makes ``summary`` (a parsed summary.json) not one a run can write, or None: an accuracy
    or curve point outside [0, 1] or not a number, rounds not a count (or not ``rounds``), a duration
    or a median of seconds or cores that is not a number ≥ 0."""
    if not isinstance(summary, dict):
        return "is not a mapping"

    def fraction(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0

    if not fraction(summary.get("accuracy")):
        return f"has accuracy {summary.get('accuracy')!r}, not a fraction in [0, 1]"
    curve = summary.get("curve", [])
    if not isinstance(curve, list) or not all(fraction(point) for point in curve):
        return "has a curve with a point that is not a fraction in [0, 1]"
    done = summary.get("rounds")
    if done is not None and (not isinstance(done, int) or isinstance(done, bool) or done < 0):
        return f"has rounds {done!r}, not a count"
    if rounds is not None and done != rounds:
        return f"has rounds {done!r}, not the run's {rounds}"
    seconds = summary.get("seconds")
    if seconds is not None and not (
        isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0
    ):
        return f"has seconds {seconds!r}, not a duration"
    for key in ("seconds_per_round", "beside_cores"):  # medians the tables print
        value = summary.get(key)
        if value is not None and not (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        ):
            return f"has {key} {value!r}, not a number ≥ 0"
    return None


def read_summary(path: Path) -> dict | None:
    """A finished run's summary.json, or None (said in one line) where the file is not one — cut
    short, emptied, edited, or holding values no run writes: reports skip that run rather than stop
    or print them."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning(
            f"skipping {path}: not a finished run's summary ({type(exc).__name__}); delete it and run that run again"
        )
        return None
    problem = summary_problem(summary)
    if problem:
        log.warning(f"skipping {path}: it {problem}; delete it and run that run again")
        return None
    return summary


RUN_ENTRIES = (
    "config.yaml",
    "metrics.csv",
    "curves.csv",
    "summary.json",
    "evaluations.jsonl",
    "checkpoint.ckpt",
    "model.pt",
    *(
        f"{name}.tmp"
        for name in ("config.yaml", "metrics.csv", "curves.csv", "summary.json", "checkpoint.ckpt")
    ),
    "tensorboard",
    "wandb",
    "csv",
)  # everything a run writes in its folder
LOG_FOLDERS = ("tensorboard", "wandb", "csv")


def clear_run_folder(run_dir: Path) -> None:
    """Removes what a run writes in ``run_dir`` and nothing else: a file that fedmeta did not write
    there stays (and a symbolic link is removed, never followed)."""
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


def check_run_folder(run_dir: Path) -> None:
    """Each file a run reads or writes in its folder is a plain file (or absent): a symbolic link would
    send a write elsewhere, a FIFO would block a read forever."""
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_symlink() or (
            path.exists() and not (path.is_file() or (path.is_dir() and name in LOG_FOLDERS))
        ):
            kind = "a symbolic link" if path.is_symlink() else "not a regular file"
            raise FedmetaError(
                f"{path} is {kind}: a run folder holds only the files fedmeta writes; move it away and run again"
            )


def append_text(path: Path, text: str) -> None:
    """Appends to a file of a run folder without following a symbolic link put there since."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "a", newline="") as f:
            f.write(text)
    except OSError as exc:  # a full disk fails the write, which names no file
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None


class RunLock:
    """An exclusive claim on a run folder: ``<folder>.lock`` beside it holds the owner's pid and
    host. A second process that wants the folder is refused in one line; a lock whose process is
    gone (same host) is stale and taken over."""

    def __init__(self, run_dir: Path):
        self.path = run_dir.with_name(run_dir.name + ".lock")
        self.held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owner = f"{os.getpid()}@{socket.gethostname()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self.path.read_text().strip() if self.path.exists() else ""
                if not self._stale(holder):
                    raise FedmetaError(
                        f"{self.path.with_suffix('')} is in use by another fedmeta process ({holder}): "
                        f"wait for it to finish, or delete {self.path} if that process is gone"
                    ) from None
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(owner)
            self.held = True
            return self
        raise FedmetaError(f"could not lock {self.path}: another process keeps taking it")

    @staticmethod
    def _stale(holder: str) -> bool:
        pid, _, host = holder.partition("@")
        if host != socket.gethostname() or not pid.isdigit():
            return not holder  # another machine's lock is trusted; an empty one is debris
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


# in a run's log: set up, it waits for a turn; it took one, after so many seconds
WAITING_FOR_A_TURN = "set up; waiting for a turn on the device"
TOOK_A_TURN = "took a turn on the device after"


class DeviceTurn:
    """A turn on a shared device: one of the ``turn-*`` files of a folder (``output.turns``), held
    with ``flock`` from a run's first round until its process ends — the system lets it go even
    when the process is killed. A campaign on a card starts the next unit while one trains: the
    next one reads its data, builds its model and loads its checkpoint, then waits here, so no
    turn passes in a process's start."""

    POLL_SECONDS = 0.2

    def __init__(self, folder: Path):
        self.paths = sorted(Path(folder).glob("turn-*"))
        self.held = None

    @staticmethod
    def make(folder: Path, turns: int) -> Path:
        """``folder`` with ``turns`` turn files (runs at once on the device)."""
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("turn-*"):
            old.unlink()
        for k in range(turns):
            (folder / f"turn-{k}").touch()
        return folder

    @staticmethod
    def held(folder: Path) -> int:
        """How many of ``folder``'s turns are held now (each one tried, and let go at once if free)."""
        count = 0
        for path in Path(folder).glob("turn-*"):
            with open(path, "a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    count += 1
        return count

    def wait(self, stop_at: float | None) -> bool:
        """Block until a turn is held (True) or ``stop_at`` has passed (False: the run then stops
        before its first round, at its deadline)."""
        while True:
            for path in self.paths:
                handle = open(path, "a")  # noqa: SIM115 — held until the process ends or release()
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                self.held = handle
                return True
            if stop_at is not None and time.time() >= stop_at:
                return False
            time.sleep(self.POLL_SECONDS)

    def release(self) -> None:
        if self.held is not None:
            self.held.close()  # closing the file lets its lock go
            self.held = None


def recorded_rounds(folder: Path) -> int:
    """The rounds a run folder's metrics.csv records: its last row's round (0: no file, no rows, or a
    file fedmeta did not write)."""
    path = folder / "metrics.csv"
    if not path.is_file() or path.is_symlink() or _foreign_metrics(path):
        return 0
    try:
        with open(path, newline="", encoding="utf-8") as f:
            last = None
            for row in csv.reader(f):
                last = row or last
        return int(last[0]) if last and last[0].isdigit() else 0
    except (UnicodeDecodeError, csv.Error, OSError):
        return 0


def history_without_checkpoint(folder: Path) -> str | None:
    """What an unfinished run folder records that nothing can continue — rounds in its metrics.csv and
    no checkpoint (one not brought back, a run stopped before its first) — or None. A run started over
    there would write fewer rounds over them, and a job may stop before it has them back: every writer
    of a run folder refuses it (history only grows) unless replacing it was asked for."""
    rounds = recorded_rounds(folder)
    if not rounds or (folder / "summary.json").is_file() or (folder / "checkpoint.ckpt").is_file():
        return None
    return f"{folder} records {rounds} rounds but holds no checkpoint.ckpt to continue them"


def rewinds(source: Path, target: Path) -> str | None:
    """Why copying the run in ``source`` over the one in ``target`` would lose recorded rounds, or None."""
    have, coming = recorded_rounds(target), recorded_rounds(source)
    if coming >= have:
        return None
    return f"{target} records {have} rounds, {source} only {coming}: not copied over them"


def _foreign_metrics(path: Path) -> bool:
    """A metrics.csv that does not read as one fedmeta wrote: kept unless replacing it was asked for
    (fedmeta's own rows are kept too: ``history_without_checkpoint``)."""
    if not path.is_file():
        return False
    try:
        with open(path, newline="") as f:  # an earlier version's: the first of today's columns
            header = next(csv.reader(f), METRIC_FIELDS)
            return len(header) < 4 or header != METRIC_FIELDS[: len(header)]
    except (UnicodeDecodeError, csv.Error):
        return True


def start_refusal(run_dir: Path, cfg: DictConfig) -> str | None:
    """Why a run may not start in ``run_dir`` (what it holds would be lost), or None — asked before the
    data is read, and again by the recorder before anything is written. A resume from its checkpoint
    is a start that loses nothing."""
    if (run_dir / "summary.json").exists():
        if not cfg.output.overwrite:
            return f"{run_dir} already holds a finished run: pass output.overwrite=true to replace it"
        return None
    if cfg.output.overwrite or (cfg.output.resume and (run_dir / "checkpoint.ckpt").is_file()):
        return None
    orphaned = history_without_checkpoint(run_dir)
    if orphaned:  # output.resume=true has nothing to resume from
        return (
            f"{orphaned}: bring its checkpoint back and resume, or start it over with output.overwrite=true"
        )
    kept = ["checkpoint.ckpt"] if (run_dir / "checkpoint.ckpt").exists() else []
    kept += ["metrics.csv"] if _foreign_metrics(run_dir / "metrics.csv") else []
    if kept and not cfg.output.resume:
        return (
            f"{run_dir} holds an unfinished run ({', '.join(kept)}): continue it with "
            "output.resume=true (make train RESUME=1), or replace it with output.overwrite=true"
        )
    return None


class RunRecorder:
    """Writes the run folder (metrics.csv, curves.csv, summary.json: the files every tool reads)
    and logs the same metrics to the run's Fabric loggers, on the main process only. ``history``
    (from a checkpoint) continues a run: its rows so far are written back and new ones follow."""

    def __init__(
        self,
        run_dir: Path,
        cfg: DictConfig,
        main_process: bool,
        history: dict | None = None,
        tags: list[str] = (),
    ):
        self.dir = run_dir
        self.main = main_process
        self.log_model = cfg.wandb.log_model
        if history is None and (problem := start_refusal(run_dir, cfg)):
            raise FedmetaError(problem)
        self.rows: list[dict] = list(history["metrics"]) if history else []
        self.curves: list[list] = list(history["curves"]) if history else []
        self.loggers, self.curve_loggers, self.wandb = [], [], None
        if self.main:
            if run_dir.exists() and history is None:
                clear_run_folder(run_dir)  # empty of results, or replacing them was asked for
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoint.ckpt.tmp").unlink(missing_ok=True)  # a checkpoint write cut off by a kill
            atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
            metrics, curves = io.StringIO(), io.StringIO()
            writer = csv.DictWriter(metrics, METRIC_FIELDS)
            writer.writeheader()
            writer.writerows(self.rows)
            csv.writer(curves).writerows(
                [
                    ["round", "step", "accuracy"],
                    *([r, step, acc] for r, curve in self.curves for step, acc in enumerate(curve)),
                ]
            )
            atomic_write_text(run_dir / "metrics.csv", metrics.getvalue())
            atomic_write_text(run_dir / "curves.csv", curves.getvalue())
            from fedmeta.loggers import (
                run_loggers,
            )  # here: the commands that only read runs need no Lightning

            self.loggers, self.curve_loggers, self.wandb = run_loggers(cfg, run_dir, list(tags), history)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.experiment.id if self.wandb else None

    def log_round(self, row: dict) -> None:
        self.rows.append(row)
        if not self.main:
            return
        line = io.StringIO()
        csv.DictWriter(line, METRIC_FIELDS).writerow(row)
        append_text(self.dir / "metrics.csv", line.getvalue())
        if self.loggers:
            from fedmeta.loggers import logged

            for logger in self.loggers:
                logger.log_metrics(logged(row), step=row["round"])

    def log_curve(self, round_: int, curve: list[float]) -> None:
        """The personalization curve of the evaluation at ``round_``: a series of its own in
        TensorBoard (``personalization/round_<r>``, x = step); in W&B the table of every curve so
        far and its line plot, one line per evaluation round, so curves at round 100, 500 and 1000
        overlay."""
        self.curves.append([round_, curve])
        if not self.main:
            return
        lines = io.StringIO()
        csv.writer(lines).writerows([round_, step, acc] for step, acc in enumerate(curve))
        append_text(self.dir / "curves.csv", lines.getvalue())
        for logger in self.curve_loggers:
            for step, accuracy in enumerate(curve):
                logger.log_metrics({f"personalization/round_{round_:05d}": accuracy}, step=step)
        if self.wandb:
            import wandb

            table = wandb.Table(
                columns=["round", "step", "accuracy"],
                data=[[r, step, acc] for r, points in self.curves for step, acc in enumerate(points)],
            )
            self.wandb.experiment.log(
                {
                    "personalization/curves": table,
                    "trainer/global_step": round_,
                    "personalization/plot": wandb.plot.line(
                        table,
                        "step",
                        "accuracy",
                        stroke="round",
                        title="accuracy after k personalization steps",
                    ),
                }
            )

    def finish(self, summary: dict, cfg: DictConfig) -> None:
        if not self.main:
            return
        atomic_write_text(self.dir / "summary.json", json.dumps(summary, indent=2))
        final = {
            "final/accuracy": summary["accuracy"],
            "final/accuracy_std": summary["accuracy_std"],
            "final/step0_accuracy": summary["curve"][0],
        }
        for logger in self.loggers:  # TensorBoard's HParams tab: every run's settings beside its result
            if logger.name == "tensorboard":
                logger.log_hyperparams(_flat(OmegaConf.to_container(cfg)), metrics=final)
        if self.wandb:
            import wandb

            run = self.wandb.experiment
            run.summary.update({k: v for k, v in summary.items() if k != "curve"} | final)
            if self.log_model and (self.dir / "checkpoint.ckpt").exists():
                model = wandb.Artifact(
                    f"model-{run.id}",
                    type="model",
                    metadata={k: v for k, v in summary.items() if k != "curve"},
                )
                model.add_file(str(self.dir / "checkpoint.ckpt"))
                run.log_artifact(model)
        self.close("success")

    def close(self, status: str) -> None:
        """Flush and close the loggers (``failed``: a run stopped by an error or a pruner)."""
        for logger in [*self.loggers, *self.curve_loggers]:
            logger.finalize(status)
        if self.wandb:
            self.wandb.experiment.finish(
                exit_code=0 if status == "success" else 1
            )  # a later run here starts its own
        self.loggers, self.curve_loggers, self.wandb = [], [], None


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested config as ``a.b.c`` keys with scalar values (TensorBoard's hyperparameters)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
