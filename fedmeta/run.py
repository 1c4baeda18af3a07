"""One federation's run: its folder, model, clients, checkpoint and the metrics so far (a seed's,
when several seeds run in lockstep). fedmeta.loop opens one per seed and steps them together."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from lightning_fabric import Fabric
from omegaconf import DictConfig

from fedmeta import checkpoint
from fedmeta.assemble import build, rehearse
from fedmeta.config import run_name, setting_name
from fedmeta.errors import FedmetaError
from fedmeta.evaluation import PersonalizationResult
from fedmeta.fastest import hardware_name
from fedmeta.rounds import Federated
from fedmeta.runs import RunLock, RunRecorder, check_run_folder, start_refusal


class Run:
    """One federation's run: its folder, model, clients, checkpoint and the metrics so far."""

    def __init__(self, fabric: Fabric, cfg: DictConfig, stacked: int):
        self.cfg, self.fabric, self.stacked = cfg, fabric, stacked
        self.started = time.perf_counter()
        self.dir = Path(cfg.output.root) / run_name(cfg)
        if problem := start_refusal(self.dir, cfg):  # before seconds of reading data, not after
            raise FedmetaError(problem)
        self.federation, self.algorithm = build(
            fabric, cfg
        )  # bad data or settings: refused before anything is on disk
        resuming = (
            cfg.output.resume
            and (self.dir / "checkpoint.ckpt").exists()
            and not (self.dir / "summary.json").exists()
        )
        self.warm_start = (
            None if resuming else checkpoint.warm_start(self.algorithm, cfg)
        )  # a resume has its own model
        rehearse(self.algorithm, self.federation, cfg)
        self.lock = RunLock(self.dir)
        if fabric.is_global_zero:
            self.lock.acquire()
        try:
            self._open()
        except BaseException:
            self.lock.release()
            raise

    def _open(self) -> None:
        """The checkpoint to resume from, and the run folder's recorder."""
        cfg, fabric = self.cfg, self.fabric
        self.checkpoint_path = self.dir / "checkpoint.ckpt"
        check_run_folder(self.dir)  # before anything in it is read
        state = None
        if cfg.output.resume and not (self.dir / "summary.json").exists():
            if self.checkpoint_path.exists():
                state = checkpoint.load(fabric, self.checkpoint_path, self.algorithm, cfg)
            elif fabric.is_global_zero:
                print(f"fedmeta: no checkpoint in {self.dir}: starting at round 1", file=sys.stderr)
        self.history = state["history"] if state else {}
        self.warm_start = self.history.get("warm_start", self.warm_start)
        tags = [
            cfg.dataset.name,
            cfg.partition.name,
            cfg.method.name,
            cfg.variant,
            str(cfg.fabric.precision),
            hardware_name(fabric.device),
        ]
        self.recorder = RunRecorder(self.dir, cfg, fabric.is_global_zero, self.history or None, tags)
        self.round_seconds = list(self.history.get("round_seconds", []))
        self.result = _result_of(self.history, cfg.evaluation.protocol)
        self.resumed_at = state["round"] if state else None
        self.first_round = (state["round"] + 1) if state else 1
        self.saved_round = state["round"] if state else None
        self.saved_at = time.monotonic()  # checkpoints come by time too (federation.checkpoint_minutes)
        # the row of a round checkpointed before its evaluation, which the resume evaluates first
        self.pending_row: dict | None = self.history.get("pending_row")
        self.error: str | None = None

    @property
    def federated(self) -> Federated:
        return Federated(self.algorithm, self.federation, self.cfg.seed)

    def save_checkpoint(self, round_: int) -> None:
        checkpoint.save(
            self.fabric,
            self.checkpoint_path,
            self.algorithm,
            self.cfg,
            round_,
            {
                "metrics": self.recorder.rows,
                "curves": self.recorder.curves,
                "round_seconds": self.round_seconds,
                "last_curves": None if self.result is None else self.result.curves,
                **_history_of(self.result),
                "pending_row": self.pending_row,
                "wandb_id": self.recorder.wandb_id,
                "warm_start": self.warm_start,
                "seconds": self.history.get("seconds", 0.0) + time.perf_counter() - self.started,
            },
        )
        self.saved_round, self.saved_at = round_, time.monotonic()

    def keep_model(self) -> dict | None:
        """The final model, compact, beside the summary (``model.pt``): what re-scores the run once its
        checkpoint is gone (the kept tables' folders hold none); None with ``output.keep_model=none``."""
        if self.cfg.output.keep_model == "none" or not self.fabric.is_global_zero:
            return None
        return checkpoint.save_model(self.dir / checkpoint.MODEL, self.algorithm, self.cfg)

    def fail(self, error: str) -> None:
        kept = (
            (
                f"the last good checkpoint (round {self.saved_round}) is kept in {self.checkpoint_path}: "
                "lower the learning "
                "rates and resume with output.resume=true"
            )
            if self.saved_round
            else "no checkpoint was written yet"
        )
        self.error = f"{self.dir}: {error}; {kept}" if self.stacked > 1 else f"{error}; {kept}"

    def summary(self) -> dict:
        cfg, fabric = self.cfg, self.fabric
        return {
            "setting": setting_name(cfg),
            "dataset": cfg.dataset.name,
            "partition": cfg.partition.name,
            "method": cfg.method.name,
            "variant": cfg.variant,
            "seed": cfg.seed,
            "protocol": cfg.evaluation.protocol,  # accuracy: the new clients', unless only training ones are scored
            "accuracy": self.result.accuracy,
            "accuracy_std": self.result.accuracy_std,
            "curve": self.result.curve,
            **_training_summary(self.result),
            **_step_size_summary(self.result, cfg.personalization),
            "rounds": cfg.federation.rounds,
            "seconds": self.history.get("seconds", 0.0) + time.perf_counter() - self.started,
            "seconds_per_round": statistics.median(self.round_seconds) if self.round_seconds else None,
            "beside_cores": _beside(self.recorder.rows),
            "resumed_at_round": self.resumed_at,
            "new_clients": len(self.result.curves) if self.result.clients == "new" else 0,
            "device": str(fabric.device),
            "world_size": fabric.world_size,
            "seeds_stacked": self.stacked,
            "hardware": hardware_name(fabric.device),
            "init_from": self.warm_start,  # the run whose final model this one started from (model.init_from)
        }


def _history_of(result: PersonalizationResult | None) -> dict:
    """The last evaluation's step size (and its choice), and the training clients' last curves and
    sample counts, for a resumed run's summary."""
    if result is None:
        return {}
    chosen = {"last_lr": result.lr, "last_lr_selection": result.lr_selection}
    kept = {key: value for key, value in chosen.items() if value is not None}
    training = result.training_clients
    if training is None:
        return kept
    return kept | {"last_training_curves": training.curves, "last_training_samples": training.samples}


def _step_size_summary(result: PersonalizationResult, personalization) -> dict:
    """summary.json's test-time step size: the rule, the step size the last evaluation used and, where
    it was chosen by validation, each candidate's validation accuracy."""
    summary = {"lr_rule": personalization.lr_rule, "personalization_lr": result.lr}
    if result.lr_selection is not None:
        summary["lr_selection"] = {f"{lr:g}": accuracy for lr, accuracy in result.lr_selection.items()}
    return summary


def _result_of(history: dict, protocol: str) -> PersonalizationResult | None:
    """The last evaluation a checkpoint's history holds, as the protocol scored it."""
    curves, training = history.get("last_curves"), history.get("last_training_curves")
    if curves is None:
        return None
    chosen = {"lr": history.get("last_lr"), "lr_selection": history.get("last_lr_selection")}
    if protocol == "training_clients":
        return PersonalizationResult(curves, history.get("last_training_samples"), "training", **chosen)
    result = PersonalizationResult(curves, **chosen)
    if training is not None:
        result.training = PersonalizationResult(training, history.get("last_training_samples"), "training")
    return result


def _training_summary(result: PersonalizationResult) -> dict:
    """summary.json's training-clients block: mean and sd over clients, the sample-weighted accuracy
    the peer libraries print, the curve, how many clients."""
    training = result.training_clients
    if training is None:
        return {}
    return {
        "training_clients": {
            "accuracy": training.accuracy,
            "accuracy_std": training.accuracy_std,
            "weighted_accuracy": training.weighted_accuracy,
            "curve": training.curve,
            "clients": len(training.curves),
        }
    }


def _beside(rows: list[dict]) -> float | None:
    """The median over the run's rounds of the cores other processes kept busy beside it (rounds
    trained before fedmeta measured it have none)."""
    values = [float(row["beside_cores"]) for row in rows if row.get("beside_cores") not in (None, "")]
    return statistics.median(values) if values else None
