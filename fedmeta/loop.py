"""A run from start to end: config → data → clients → rounds → metrics → runs/.

``train`` assembles the run's parts (fedmeta.assemble) — before any folder exists, so what the
config or the data refuses leaves nothing behind — opens each seed's run folder (``Run``: lock,
checkpoint to resume from, loggers), then loops over the rounds (fedmeta.rounds), evaluating the
new clients every ``eval_every`` rounds and at the end, checkpointing, and writes the summary.
"""

from __future__ import annotations

import logging
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lightning.fabric import Fabric
from omegaconf import DictConfig
from tqdm.auto import tqdm

from fedmeta import checkpoint
from fedmeta.assemble import build, hardware_name, make_engine, make_fabric, rehearse, seed_configs
from fedmeta.config import run_name, setting_name
from fedmeta.engine import Engine
from fedmeta.errors import FedmetaError, RunStopped
from fedmeta.evaluation import PersonalizationResult
from fedmeta.rounds import Federated, evaluate_on_ranks, federated_rounds, gather_updates
from fedmeta.runs import DeviceTurn, RunLock, RunRecorder, check_run_folder, check_wandb_login

log = logging.getLogger("fedmeta")


def train(
    cfg: DictConfig,
    show_progress: bool = True,
    on_evaluation: Callable[[int, float], None] | None = None,
    engine=None,
) -> dict | list[dict] | None:
    """Run one experiment end to end and return its summary (also written to summary.json; None
    on the other processes of a multi-process run). With ``seeds=[…]`` the seeds' federations run
    in lockstep in this process, their clients computed together, each in its own run folder
    exactly as a run of that seed alone; the summaries come back as a list.
    With ``output.resume=true`` an unfinished run continues from its last checkpoint.
    ``on_evaluation(round, accuracy)`` is called after each evaluation of a one-seed run (fedmeta
    tune reports to its pruner there; an exception it raises stops the run). ``engine`` computes
    the clients' work (default: fedmeta.engine's, from the config; fedmeta.flower's sends it to
    Flower SuperNodes)."""
    check_wandb_login(cfg)  # before any process, data or folder
    fabric = make_fabric(cfg)
    engine = engine or make_engine(
        cfg, fabric.device
    )  # a setting the device cannot run: refused before any folder
    configs = seed_configs(cfg)
    runs: list[Run] = []
    turn = DeviceTurn(cfg.output.turns) if cfg.output.get("turns") else None
    try:
        with Stopper(cfg.output.stop_at) as stopper:
            for one in configs:
                runs.append(Run(fabric, one, len(configs)))
            if turn is not None:
                _take(turn, cfg.output)
            return _train(fabric, cfg, runs, show_progress, on_evaluation, engine, stopper)
    finally:
        if turn is not None:
            turn.release()
        for run in runs:
            run.recorder.close(
                "failed"
            )  # a run that stopped early (error, pruner, Ctrl-C); after finish: nothing left
            run.lock.release()  # a run that failed to set up never took its lock


def _take(turn: DeviceTurn, output: DictConfig) -> None:
    """Wait, set up, for a turn on the device; stop in one line if the deadline comes first."""
    log.info("set up; waiting for a turn on the device (%s)", output.turns)
    waited = time.perf_counter()
    if not turn.wait(output.stop_at):
        raise RunStopped(
            "stopped before its first round in this job: output.stop_at passed while it waited "
            "for a turn on the device; continue with output.resume=true"
        )
    log.info("took a turn on the device after %.1f s", time.perf_counter() - waited)


def _evaluate(
    fabric: Fabric, runs: list, cfg: DictConfig, engine: Engine, show_progress: bool, round_: int
) -> list:
    """``evaluate_on_ranks`` with a progress bar of its own: an evaluation (every new client
    personalized for ``personalization.steps`` steps) may take longer than many rounds."""
    clients = sum(len(run.federation.new_clients[fabric.global_rank :: fabric.world_size]) for run in runs)
    with tqdm(
        total=clients,
        desc=f"round {round_}: personalizing the new clients",
        unit="client",
        leave=False,
        disable=not (show_progress and fabric.is_global_zero),
    ) as bar:
        return evaluate_on_ranks(fabric, runs, cfg.personalization, engine, bar.update)


def _row(round_: int, loss, seconds: float, dropped: int) -> dict:
    """A round's metrics.csv row, its evaluation's columns empty until there is one."""
    return {
        "round": round_,
        "train_loss": loss,
        "round_seconds": seconds,
        "clients_dropped": dropped,
        "eval_accuracy": "",
        "eval_accuracy_std": "",
        "eval_step0_accuracy": "",
    }


def _record(run: Run, row: dict, result, on_evaluation: Callable[[int, float], None] | None) -> None:
    """Log a trained round's row, and its evaluation (``result``) where it had one."""
    if result is not None:
        run.result = result
        row.update(
            eval_accuracy=result.accuracy,
            eval_accuracy_std=result.accuracy_std,
            eval_step0_accuracy=result.curve[0],
        )
        run.recorder.log_curve(row["round"], result.curve)
    run.recorder.log_round(row)
    if on_evaluation and result is not None:
        on_evaluation(row["round"], result.accuracy)


def _evaluate_or_stop(
    fabric: Fabric,
    evaluating: list[Run],
    cfg: DictConfig,
    engine: Engine,
    show_progress: bool,
    round_: int,
    stopper: Stopper,
    trained: list[tuple[Run, dict]],
    runs: list[Run],
) -> list:
    """The round's evaluation of ``evaluating`` — unless SIGTERM came during the round or comes
    during the evaluation: then each trained run is checkpointed at this round with its row held
    back (``pending_row``), the evaluation is left to the resume, and the run stops."""
    if not evaluating:
        return []
    tick = time.perf_counter()
    try:
        if stopper.signalled:
            raise RunStopped("SIGTERM")
        stopper.evaluating = True
        results = _evaluate(fabric, [run.federated for run in evaluating], cfg, engine, show_progress, round_)
    except RunStopped:
        stopper.evaluating = False
        for run, row in trained:
            run.pending_row = row
            run.save_checkpoint(round_)
        _stop(runs, round_, cfg.federation.rounds, "SIGTERM, before its evaluation", stopper)
    stopper.evaluating = False
    stopper.evaluation_seconds = time.perf_counter() - tick
    return results


def _evaluate_pending(
    fabric: Fabric, runs: list[Run], cfg: DictConfig, engine: Engine, show_progress: bool, on_evaluation
) -> None:
    """A resumed run that stopped before its round's evaluation does that evaluation first (a
    SIGTERM now stops at once: its checkpoint still holds the row)."""
    pending = [run for run in runs if run.pending_row is not None]
    for round_ in sorted({run.first_round - 1 for run in pending}):
        due = [run for run in pending if run.first_round - 1 == round_]
        results = _evaluate(fabric, [run.federated for run in due], cfg, engine, show_progress, round_)
        for run, result in zip(due, results):
            row, run.pending_row = run.pending_row, None
            _record(run, row, result, on_evaluation if len(runs) == 1 else None)
            run.save_checkpoint(round_)


def _train(
    fabric: Fabric,
    cfg: DictConfig,
    runs: list[Run],
    show_progress: bool,
    on_evaluation: Callable[[int, float], None] | None,
    engine: Engine,
    stopper: Stopper,
) -> dict | list[dict] | None:
    fed = cfg.federation
    shard, gather = (fabric.global_rank, fabric.world_size), gather_updates(fabric)
    first = min(run.first_round for run in runs)
    # a resumed run knows its rounds' time from before: the deadline is judged from the first round on
    stopper.round_seconds = [seconds * len(runs) for seconds in runs[0].round_seconds[-5:]]
    label = (
        f"{cfg.method.name} {cfg.dataset.name}-{cfg.partition.name}"
        + (f" ×{len(runs)} seeds" if len(runs) > 1 else "")
        + f" [{fabric.device.type}, {engine.label()}]"
    )  # how it runs, said once at the start
    bar = tqdm(
        range(first, fed.rounds + 1),
        desc=label,
        disable=not (show_progress and fabric.is_global_zero),
        unit="round",
        initial=first - 1,
        total=fed.rounds,
    )
    _evaluate_pending(fabric, runs, cfg, engine, show_progress, on_evaluation)
    for round_ in bar:
        active = [run for run in runs if run.error is None and run.first_round <= round_]
        if not active:
            break
        due = round_ % fed.eval_every == 0 or round_ == fed.rounds
        if why := stopper.reason(due):
            _stop(runs, round_ - 1, fed.rounds, why, stopper)
        stopper.rounds_started = True
        tick = time.perf_counter()
        outcomes = federated_rounds(
            [run.federated for run in active],
            round_,
            fed.clients_per_round,
            shard,
            gather,
            engine,
            fed.client_failure_rate,
        )
        stopper.round_seconds.append(time.perf_counter() - tick)
        seconds = (time.perf_counter() - tick) / len(active)  # a stacked seed's share of the lockstep round
        trained = []
        for run, outcome in zip(active, outcomes):
            if outcome.error:  # divergence: this run stops, its last good checkpoint stays as it is
                run.fail(outcome.error)
                continue
            run.round_seconds.append(seconds)
            if fabric.is_global_zero:
                for line in outcome.dropped:
                    log.warning(f"round {round_}: {line}; dropped from the aggregate")
            trained.append((run, _row(round_, outcome.loss, seconds, len(outcome.dropped))))
        evaluating = [run for run, _ in trained] if due else []
        results = _evaluate_or_stop(
            fabric, evaluating, cfg, engine, show_progress, round_, stopper, trained, runs
        )
        for (run, row), result in zip(trained, results or [None] * len(trained)):
            _record(run, row, result, on_evaluation if len(runs) == 1 else None)
            if round_ == fed.rounds or (fed.checkpoint_every and round_ % fed.checkpoint_every == 0):
                tick = time.perf_counter()
                run.save_checkpoint(round_)
                stopper.checkpoint_seconds = time.perf_counter() - tick
        shown = active[0]
        bar.set_postfix(
            loss=f"{outcomes[0].loss:.3f}",
            acc="-" if shown.result is None else f"{shown.result.accuracy:.3f}",
        )

    stopper.rounds_started = False  # from here a stop request stops at once: the last round is checkpointed
    final = [
        run
        for run in runs
        if run.error is None and (not run.recorder.curves or run.recorder.curves[-1][0] != fed.rounds)
    ]
    if (
        final
    ):  # resumed at its last round (rounds lowered to the checkpoint's): the final evaluation is still due
        for run, result in zip(
            final, _evaluate(fabric, [r.federated for r in final], cfg, engine, show_progress, fed.rounds)
        ):
            run.result = result
            run.recorder.log_curve(fed.rounds, result.curve)
            if (
                fed.rounds == 0
            ):  # a warm start evaluated as it is: its model is this run's, for evaluate and later runs
                run.save_checkpoint(0)
    summaries = []
    for run in runs:
        if run.error is None:
            summary = {**run.summary(), **engine.describe()}
            run.recorder.finish(summary, run.cfg)
            summaries.append(summary)
    failed = [run.error for run in runs if run.error]
    if failed:
        raise FedmetaError(
            failed[0]
            if len(failed) == 1
            else f"{len(failed)} of {len(runs)} seeds stopped: " + " | ".join(failed)
        )
    if not fabric.is_global_zero:
        return None
    return summaries if cfg.seeds else summaries[0]


def _stop(runs: list[Run], last: int, rounds: int, why: str, stopper: Stopper) -> None:
    """Checkpoint every running seed at round ``last`` (unless it is already) and stop the run."""
    saved = []
    for run in runs:
        if run.error is None and run.first_round <= last and run.saved_round != last:
            run.save_checkpoint(last)
        if run.saved_round:
            saved.append(run)
    where = (
        f"checkpointed in {saved[0].dir}" + (f" and {len(saved) - 1} more" if len(saved) > 1 else "")
        if saved
        else "no round was trained, nothing to keep"
    )
    stopper.restore()  # a second SIGTERM from here ends the process at once
    raise RunStopped(
        f"stopped after round {last} of {rounds} ({why}); {where}: continue with output.resume=true"
    )


class Stopper:
    """Ends a run early at a round boundary, checkpointed, so that it resumes where it stopped:
    on SIGTERM (what SLURM, ``timeout``, ``docker stop`` and a preempted job's host send) and before
    a round that would end past ``output.stop_at`` (a wall-clock Unix time: a job's deadline),
    judged from the last rounds', evaluation's and checkpoint's durations in this process.
    A SIGTERM during a round's evaluation, or during a round whose evaluation is due, stops before
    that evaluation, the trained round checkpointed: the resume evaluates it first. Outside the
    rounds (setting up) SIGTERM stops at once, as Ctrl-C does: every checkpoint on disk is
    complete, so nothing is lost."""

    MARGIN = 1.5  # a round may take longer than the median of the last ones

    def __init__(self, stop_at: float | None):
        self.stop_at, self.signalled, self.rounds_started = stop_at, False, False
        self.evaluating = False  # a round's evaluation is under way: SIGTERM ends it, the round is kept
        self.round_seconds: list[float] = []
        self.evaluation_seconds = self.checkpoint_seconds = 0.0
        self._previous = None

    def __enter__(self) -> Stopper:
        if threading.current_thread() is threading.main_thread():  # only the main thread takes signals
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        if not self.rounds_started or self.signalled or self.evaluating:
            self.signalled = True
            raise RunStopped(
                "stopped by SIGTERM; the last checkpoint is kept: continue with output.resume=true"
            )
        self.signalled = True  # the round under way finishes and is checkpointed

    def reason(self, evaluating: bool) -> str | None:
        """Why the next round must not start, or None."""
        if self.signalled:
            return "SIGTERM"
        if self.stop_at is None:
            return None
        recent = self.round_seconds[-5:]
        needed = (
            self.MARGIN * (statistics.median(recent) if recent else 0.0)
            + (self.evaluation_seconds if evaluating else 0.0)
            + self.checkpoint_seconds
        )
        late = time.time() + needed > self.stop_at
        return f"output.stop_at comes before another round's ~{needed:.1f} s would end" if late else None


class Run:
    """One federation's run: its folder, model, clients, checkpoint and the metrics so far."""

    def __init__(self, fabric: Fabric, cfg: DictConfig, stacked: int):
        self.cfg, self.fabric, self.stacked = cfg, fabric, stacked
        self.started = time.perf_counter()
        self.dir = Path(cfg.output.root) / run_name(cfg)
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
        curves = self.history.get("last_curves")
        self.result = PersonalizationResult(curves) if curves is not None else None
        self.resumed_at = state["round"] if state else None
        self.first_round = (state["round"] + 1) if state else 1
        self.saved_round = state["round"] if state else None
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
                "pending_row": self.pending_row,
                "wandb_id": self.recorder.wandb_id,
                "warm_start": self.warm_start,
                "seconds": self.history.get("seconds", 0.0) + time.perf_counter() - self.started,
            },
        )
        self.saved_round = round_

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
            "accuracy": self.result.accuracy,
            "accuracy_std": self.result.accuracy_std,
            "curve": self.result.curve,
            "rounds": cfg.federation.rounds,
            "seconds": self.history.get("seconds", 0.0) + time.perf_counter() - self.started,
            "seconds_per_round": statistics.median(self.round_seconds) if self.round_seconds else None,
            "resumed_at_round": self.resumed_at,
            "new_clients": len(self.result.curves),
            "device": str(fabric.device),
            "world_size": fabric.world_size,
            "seeds_stacked": self.stacked,
            "hardware": hardware_name(fabric.device),
            "init_from": self.warm_start,  # the run whose final model this one started from (model.init_from)
        }
