"""Everything a run leaves in runs/<dataset>-<partition>/<method>/seed<seed>/:
config.yaml (fully resolved), metrics.csv (one row per round), curves.csv (the personalization
curve at every evaluation), summary.json, checkpoint.ckpt — and the W&B run (offline by default)."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedmeta.errors import FedmetaError

METRIC_FIELDS = ["round", "train_loss", "round_seconds", "eval_accuracy", "eval_accuracy_std", "eval_step0_accuracy"]


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wandb_logger(cfg: DictConfig, run_dir: Path, name: str):
    """Lightning's WandbLogger, offline unless asked otherwise ($WANDB_MODE wins); None if disabled."""
    mode = os.environ.get("WANDB_MODE", cfg.wandb.mode)
    if mode == "disabled":
        return None
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(project=cfg.wandb.project, name=name, group=f"{cfg.dataset.name}-{cfg.partition.name}",
                       save_dir=str(run_dir), offline=mode == "offline", config=OmegaConf.to_container(cfg))


class RunRecorder:
    """Writes the run folder (on the main process only) and forwards metrics to Fabric's loggers."""

    def __init__(self, run_dir: Path, cfg: DictConfig, fabric):
        self.dir = run_dir
        self.fabric = fabric
        self.main = fabric.is_global_zero
        if (run_dir / "summary.json").exists() and not cfg.output.overwrite:
            raise FedmetaError(f"{run_dir} already holds a finished run: pass output.overwrite=true to replace it")
        if self.main:
            if run_dir.exists():
                shutil.rmtree(run_dir)  # an unfinished earlier attempt: nothing in it is a result
            run_dir.mkdir(parents=True)
            atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
            with open(run_dir / "metrics.csv", "w", newline="") as f:
                csv.writer(f).writerow(METRIC_FIELDS)
            with open(run_dir / "curves.csv", "w", newline="") as f:
                csv.writer(f).writerow(["round", "step", "accuracy"])

    def log_round(self, row: dict) -> None:
        if self.main:
            with open(self.dir / "metrics.csv", "a", newline="") as f:
                csv.DictWriter(f, METRIC_FIELDS).writerow(row)
        self.fabric.log_dict({k: v for k, v in row.items() if k != "round" and v != ""}, step=row["round"])

    def log_curve(self, round_: int, curve: list[float]) -> None:
        if self.main:
            with open(self.dir / "curves.csv", "a", newline="") as f:
                csv.writer(f).writerows([round_, step, acc] for step, acc in enumerate(curve))
        for logger in self.fabric.loggers:
            if hasattr(logger, "experiment") and hasattr(logger.experiment, "log"):
                import wandb

                table = wandb.Table(data=[[s, a] for s, a in enumerate(curve)], columns=["step", "accuracy"])
                logger.experiment.log({f"personalization_curve/round_{round_}": wandb.plot.line(table, "step", "accuracy")})

    def save_summary(self, summary: dict) -> None:
        if self.main:
            atomic_write_text(self.dir / "summary.json", json.dumps(summary, indent=2))
