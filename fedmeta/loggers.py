"""A run's loggers: the metrics and curves fedmeta writes into its run folder, also logged to the
Fabric loggers ``logger`` names (CSV, TensorBoard, W&B). Imported only where a run trains or is
re-evaluated: Lightning's loggers bring PyTorch and Lightning with them, which the commands that only
read runs (table, figures, campaign's state) do without."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from pathlib import Path

from lightning_fabric.loggers import Logger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from fedmeta.config import method_label, setting_name
from fedmeta.errors import FedmetaError
from fedmeta.waiting import said_after

log = logging.getLogger("fedmeta")


# a metrics.csv column → its name in the loggers: one namespace per chart section
LOGGED_AS = {
    "train_loss": "train/loss",
    "round_seconds": "train/round_seconds",
    "beside_cores": "train/beside_cores",
    "clients_dropped": "train/clients_dropped",
    "eval_accuracy": "eval/accuracy",
    "eval_accuracy_std": "eval/accuracy_std",
    "eval_step0_accuracy": "eval/step0_accuracy",
    "training_clients_accuracy": "eval/training_clients_accuracy",
    "training_clients_accuracy_std": "eval/training_clients_accuracy_std",
    "training_clients_weighted_accuracy": "eval/training_clients_weighted_accuracy",
}


WANDB_INIT_TIMEOUT = 30  # seconds wandb.init may take to reach W&B online (its own default: 90)


def wandb_mode(cfg: DictConfig) -> str:
    """offline, online or disabled: $WANDB_MODE, else wandb.mode."""
    return os.environ.get("WANDB_MODE", cfg.wandb.mode)


def check_wandb_login(cfg: DictConfig) -> None:
    """A run that logs to W&B online needs an API key ($WANDB_API_KEY, ~/.netrc from ``wandb
    login``); without one, wandb.init fails deep inside the run (or asks for one in a terminal).
    Refused in one line before the run starts."""
    if "wandb" not in cfg.logger or wandb_mode(cfg) != "online":
        return
    import wandb

    if wandb.run is not None:  # a run of this process is online already: its key was found
        return
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # W&B's "Loaded credentials" notes
            found = wandb.login(prompt=False, verify=False)
    except wandb.errors.Error as exc:  # a key of the wrong form
        raise FedmetaError(
            f"W&B: {str(exc).strip().splitlines()[0]}: fix it, or log offline with wandb.mode=offline"
        ) from None
    if not found:
        raise FedmetaError(
            "wandb.mode=online needs a W&B API key and none is set ($WANDB_API_KEY, ~/.netrc): run "
            "`wandb login` first, or log offline with wandb.mode=offline (and `wandb sync` later)"
        )


def wandb_logger(cfg: DictConfig, run_dir: Path, tags: list[str], run_id: str | None = None):
    """A W&B run as a Fabric logger, offline unless asked otherwise ($WANDB_MODE wins); None if disabled.
    One W&B run per federation: grouped by setting, its job type the method (and variant), so W&B's
    mean ± std over a group's job type is over seeds only. A resumed run continues ``run_id``."""
    mode = wandb_mode(cfg)
    if mode == "disabled":
        return None
    import wandb

    # Our own wandb.init: Lightning's would set $WANDB_MODE for the whole process, reuse another
    # seed's open run, and pass options W&B warns about. reinit="create_new": stacked seeds hold
    # one W&B run each at the same time in this process.
    def start(resume_id: str | None):
        return wandb.init(
            project=cfg.wandb.project,
            name=f"{method_label(cfg)}-seed{cfg.seed}",  # as its folder: <method>[-<variant>]/seed<s>
            group=setting_name(cfg),
            job_type=method_label(cfg),
            tags=[t[:64] for t in tags],
            dir=str(run_dir.resolve()),
            mode=mode,
            reinit="create_new",
            config=OmegaConf.to_container(cfg),
            settings=wandb.Settings(silent=True, console="off", init_timeout=WANDB_INIT_TIMEOUT),
            **({"id": resume_id, "resume": "allow"} if resume_id else {}),
        )

    began = time.monotonic()
    waiting = f"waiting for W&B to start the run {mode} (at most {WANDB_INIT_TIMEOUT} s, then it says what went wrong)"
    try:
        try:
            with said_after(waiting):
                run = start(run_id)
        except Exception as exc:  # noqa: BLE001 — W&B refuses to continue a run (a killed process's run still "in use")
            # no network: the init timeout ran out, and a new run would wait as long to fail the same way
            if not run_id or time.monotonic() - began >= WANDB_INIT_TIMEOUT:
                raise
            log.warning(
                f"W&B run {run_id} could not be continued ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0][:160]}); "
                "the resumed rounds go to a new W&B run of the same name and group"
            )
            run = start(None)
    except wandb.errors.Error as exc:  # no network, W&B down, a key it refuses
        raise FedmetaError(
            f"W&B did not start the run {mode} ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]})"
            + (
                ": check the network, or log offline with wandb.mode=offline (and `wandb sync` later)"
                if mode == "online"
                else ""
            )
        ) from None
    run.define_metric("trainer/global_step")
    run.define_metric("*", step_metric="trainer/global_step", step_sync=True)  # x axis: the round
    return WandbRun(run)


class WandbRun(Logger):
    """The W&B run fedmeta started, as a Fabric logger: a round's metrics logged at its round
    (``trainer/global_step``, the x axis Lightning's WandbLogger uses too). Not Lightning's logger:
    that one lives in ``lightning.pytorch``, whose import (Trainer, torchmetrics, torchvision's
    models) would double every run's start."""

    def __init__(self, run):
        super().__init__()
        self.experiment = run

    @property
    def name(self) -> str:
        return "wandb"

    @property
    def version(self) -> str:
        return self.experiment.id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.experiment.log(metrics if step is None else {**metrics, "trainer/global_step": step})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self.experiment.config.update(dict(params), allow_val_change=True)


def run_loggers(
    cfg: DictConfig, run_dir: Path, tags: list[str], history: dict | None
) -> tuple[list, list, object]:
    """The Fabric loggers ``cfg.logger`` names, for the rounds' metrics (step = round) and for the
    personalization curves (step = personalization step, one series per evaluation), and the W&B
    logger among them (None without one). A resumed TensorBoard log drops what was logged after
    the checkpoint (``purge_step``); Fabric's CSVLogger starts its file again and is given the
    checkpoint's rows."""
    rounds, curves, wandb_run = [], [], None
    resumed_at = int(history["metrics"][-1]["round"]) + 1 if history and history["metrics"] else None
    if "csv" in cfg.logger:
        from lightning_fabric.loggers import CSVLogger

        csv_logger = CSVLogger(run_dir, name="csv", version="", flush_logs_every_n_steps=1)
        for row in history["metrics"] if history else []:
            csv_logger.log_metrics(logged(row), step=int(row["round"]))
        rounds.append(csv_logger)
    if "tensorboard" in cfg.logger:
        rounds.append(
            TensorBoardLogger(
                run_dir,
                name="tensorboard",
                version="rounds",
                **({"purge_step": resumed_at} if resumed_at else {}),
            )
        )
        curves.append(TensorBoardLogger(run_dir, name="tensorboard", version="personalization"))
    if "wandb" in cfg.logger:
        wandb_run = wandb_logger(cfg, run_dir, tags, history.get("wandb_id") if history else None)
        if wandb_run:
            rounds.append(wandb_run)
    return rounds, curves, wandb_run


def logged(row: dict) -> dict:
    """A metrics.csv row as the loggers name its values."""
    return {LOGGED_AS[k]: v for k, v in row.items() if k in LOGGED_AS and v != ""}
