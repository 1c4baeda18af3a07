"""Everything a run leaves in runs/<dataset>-<partition>/<method>/seed<seed>/:
config.yaml (fully resolved), metrics.csv (one row per round), curves.csv (the personalization
curve at every evaluation), summary.json, checkpoint.ckpt — and the W&B run (offline by default)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedmeta.config import setting_name
from fedmeta.errors import FedmetaError

METRIC_FIELDS = ["round", "train_loss", "round_seconds", "clients_dropped", "eval_accuracy", "eval_accuracy_std",
                 "eval_step0_accuracy"]


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
                    raise FedmetaError(f"{self.path.with_suffix('')} is in use by another fedmeta process ({holder}): "
                                       f"wait for it to finish, or delete {self.path} if that process is gone") from None
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


def wandb_logger(cfg: DictConfig, run_dir: Path, name: str, run_id: str | None = None):
    """Lightning's WandbLogger, offline unless asked otherwise ($WANDB_MODE wins); None if disabled.
    A resumed run continues the W&B run ``run_id``."""
    mode = os.environ.get("WANDB_MODE", cfg.wandb.mode)
    if mode == "disabled":
        return None
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    resume = {"id": run_id, "resume": "allow"} if run_id else {}
    # reinit="create_new": stacked seeds hold one W&B run each at the same time in this process
    return WandbLogger(project=cfg.wandb.project, name=name, group=setting_name(cfg), reinit="create_new",
                       save_dir=str(run_dir), offline=mode == "offline", config=OmegaConf.to_container(cfg), **resume)


class RunRecorder:
    """Writes the run folder and the W&B run, on the main process only. ``history`` (from a
    checkpoint) continues a run: its rows so far are written back and new ones follow."""

    def __init__(self, run_dir: Path, cfg: DictConfig, main_process: bool, history: dict | None = None):
        self.dir = run_dir
        self.main = main_process
        if (run_dir / "summary.json").exists() and not cfg.output.overwrite:
            raise FedmetaError(f"{run_dir} already holds a finished run: pass output.overwrite=true to replace it")
        self.rows: list[dict] = list(history["metrics"]) if history else []
        self.curves: list[list] = list(history["curves"]) if history else []
        self.logger = None
        if self.main:
            if run_dir.exists() and history is None:
                kept = [name for name in ("checkpoint.ckpt", "metrics.csv", "summary.json") if (run_dir / name).exists()]
                if kept and not (cfg.output.overwrite or cfg.output.resume):  # resume without a checkpoint: nothing to keep
                    raise FedmetaError(f"{run_dir} holds an unfinished run ({', '.join(kept)}): continue it with "
                                       "output.resume=true (make train RESUME=1), or replace it with output.overwrite=true")
                shutil.rmtree(run_dir)  # empty of results, or replacing them was asked for
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoint.ckpt.tmp").unlink(missing_ok=True)  # a checkpoint write cut off by a kill
            atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
            with open(run_dir / "metrics.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, METRIC_FIELDS)
                writer.writeheader()
                writer.writerows(self.rows)
            with open(run_dir / "curves.csv", "w", newline="") as f:
                csv.writer(f).writerows([["round", "step", "accuracy"],
                                         *([r, step, acc] for r, curve in self.curves for step, acc in enumerate(curve))])
            self.logger = wandb_logger(cfg, run_dir, f"{cfg.method.name}-{cfg.variant}-seed{cfg.seed}",
                                       history.get("wandb_id") if history else None)

    @property
    def wandb_id(self) -> str | None:
        return self.logger.experiment.id if self.logger else None

    def log_round(self, row: dict) -> None:
        self.rows.append(row)
        if not self.main:
            return
        with open(self.dir / "metrics.csv", "a", newline="") as f:
            csv.DictWriter(f, METRIC_FIELDS).writerow(row)
        if self.logger:
            self.logger.log_metrics({k: v for k, v in row.items() if k != "round" and v != ""}, step=row["round"])

    def log_curve(self, round_: int, curve: list[float]) -> None:
        self.curves.append([round_, curve])
        if not self.main:
            return
        with open(self.dir / "curves.csv", "a", newline="") as f:
            csv.writer(f).writerows([round_, step, acc] for step, acc in enumerate(curve))
        if self.logger:
            import wandb

            table = wandb.Table(data=[[s, a] for s, a in enumerate(curve)], columns=["step", "accuracy"])
            self.logger.experiment.log({"personalization_curve": wandb.plot.line(table, "step", "accuracy",
                                                                                 title=f"round {round_}")})

    def finish(self, summary: dict) -> None:
        if not self.main:
            return
        atomic_write_text(self.dir / "summary.json", json.dumps(summary, indent=2))
        if self.logger:
            self.logger.experiment.summary.update({k: v for k, v in summary.items() if k != "curve"})
            self.logger.finalize("success")
            self.logger.experiment.finish()  # so a later run in this process starts its own W&B run
