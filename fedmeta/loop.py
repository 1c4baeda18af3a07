"""A run from start to end: config → data → clients → rounds → metrics → runs/.

``train`` assembles the run's parts (fedmeta.assemble) — before any folder exists, so what the
config or the data refuses leaves nothing behind — opens each seed's run folder (``Run``: lock,
checkpoint to resume from, loggers), then loops over the rounds (fedmeta.rounds), evaluating the
new clients every ``eval_every`` rounds and at the end, checkpointing, and writes the summary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lightning_fabric import Fabric
from omegaconf import DictConfig
from tqdm.auto import tqdm

from fedmeta.allocator import give_back_setup_memory
from fedmeta.assemble import make_engine, make_fabric, seed_configs
from fedmeta.clock import RoundClock
from fedmeta.engine import Engine
from fedmeta.errors import FedmetaError, RunStopped
from fedmeta.loggers import check_wandb_login
from fedmeta.progress import announce, leave_out, round_bar
from fedmeta.rounds import evaluate_on_ranks, federated_rounds, gather_updates, scored_clients
from fedmeta.run import Run
from fedmeta.runs import TOOK_A_TURN, WAITING_FOR_A_TURN, DeviceTurn, metrics_row
from fedmeta.stopping import FIRST_ROUND_ENDED, Stopper, process_seconds, stop_runs

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
    # a setting the device cannot run: refused before any folder
    engine = engine or make_engine(cfg, fabric.device)
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
            # a run that stopped early (error, pruner, Ctrl-C); after finish: nothing left
            run.recorder.close("failed")
            run.lock.release()  # a run that failed to set up never took its lock


def _take(turn: DeviceTurn, output: DictConfig) -> None:
    """Wait, set up, for a turn on the device; stop in one line if the deadline comes first."""
    log.info(f"{WAITING_FOR_A_TURN} ({output.turns})")
    waited = time.perf_counter()
    if not turn.wait(output.stop_at):
        raise RunStopped(
            "stopped before its first round in this job: output.stop_at passed while it waited "
            "for a turn on the device; continue with output.resume=true"
        )
    log.info(f"{TOOK_A_TURN} {time.perf_counter() - waited:.1f} s")


def _evaluate(
    fabric: Fabric, runs: list, cfg: DictConfig, engine: Engine, show_progress: bool, round_: int
) -> list:
    """``evaluate_on_ranks`` with a progress bar of its own: an evaluation (every new client
    personalized for ``personalization.steps`` steps) may take longer than many rounds."""
    protocol = cfg.evaluation.protocol
    clients, what = scored_clients(runs, protocol, fabric.global_rank, fabric.world_size, cfg.personalization)
    with tqdm(
        total=clients,
        desc=f"round {round_}: {what}",
        unit="client",
        leave=False,
        disable=not (show_progress and fabric.is_global_zero),
    ) as bar:
        return evaluate_on_ranks(fabric, runs, cfg.personalization, engine, bar.update, protocol)


def _record(run: Run, row: dict, result, on_evaluation: Callable[[int, float], None] | None) -> None:
    """Log a trained round's row, and its evaluation (``result``) where it had one."""
    if result is not None:
        run.result = result
        row.update(
            eval_accuracy=result.accuracy,
            eval_accuracy_std=result.accuracy_std,
            eval_step0_accuracy=result.curve[0],
            personalization_lr=result.lr,
        )
        if (training := result.training_clients) is not None:
            row.update(
                training_clients_accuracy=training.accuracy,
                training_clients_accuracy_std=training.accuracy_std,
                training_clients_weighted_accuracy=training.weighted_accuracy,
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
    """The round's evaluation of ``evaluating`` — unless a stop (SIGTERM, Ctrl-C) came during the round
    or comes during the evaluation: then each trained run is checkpointed at this round with its row held
    back (``pending_row``), the evaluation is left to the resume, and the run stops."""
    if not evaluating:
        return []
    tick = time.perf_counter()
    try:
        if stopper.signalled:
            raise RunStopped(stopper.signalled)
        stopper.evaluating = True
        results = _evaluate(fabric, [run.federated for run in evaluating], cfg, engine, show_progress, round_)
    except RunStopped:
        stopper.evaluating = False
        for run, row in trained:
            run.pending_row = row
            run.save_checkpoint(round_)
        stop_runs(runs, round_, cfg.federation.rounds, f"{stopper.signalled}, before its evaluation", stopper)
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
    first = min(run.first_round for run in runs)
    # a resumed run knows its rounds' time from before: the deadline is judged from the first round on
    stopper.round_seconds = [seconds * len(runs) for seconds in runs[0].round_seconds[-5:]]
    bar = round_bar(fabric, cfg, len(runs), engine, first, show_progress)
    if first > 1 and fabric.is_global_zero:
        log.info(f"resumed from round {first - 1} of {fed.rounds} ({runs[0].checkpoint_path})")
    _evaluate_pending(fabric, runs, cfg, engine, show_progress, on_evaluation)
    give_back_setup_memory()
    for round_ in bar:
        active = [run for run in runs if run.error is None and run.first_round <= round_]
        if not active:
            break
        due = round_ % fed.eval_every == 0 or round_ == fed.rounds
        if why := stopper.reason(due):
            stop_runs(runs, round_ - 1, fed.rounds, why, stopper)
        stopper.rounds_started = True
        outcomes, trained = _train_round(fabric, cfg, active, round_, engine, stopper)
        if round_ == first and cfg.output.stop_at:  # a job's last start leaves this much (fedmeta.grid)
            log.info(f"{FIRST_ROUND_ENDED} {process_seconds():.1f} s after the process started")
        if round_ == first + 1 and fabric.is_global_zero:
            announce(cfg, round_, stopper.round_seconds[-1])
        evaluating = [run for run, _ in trained] if due else []
        results = _evaluate_or_stop(
            fabric, evaluating, cfg, engine, show_progress, round_, stopper, trained, runs
        )
        if evaluating:
            leave_out(bar, stopper.evaluation_seconds)
        for (run, row), result in zip(trained, results or [None] * len(trained)):
            _record(run, row, result, on_evaluation if len(runs) == 1 else None)
            if (
                round_ == fed.rounds
                or (fed.checkpoint_every and round_ % fed.checkpoint_every == 0)
                or (fed.checkpoint_minutes and time.monotonic() - run.saved_at >= 60 * fed.checkpoint_minutes)
            ):
                tick = time.perf_counter()
                run.save_checkpoint(round_)
                stopper.checkpoint_seconds = time.perf_counter() - tick
        shown = active[0]
        bar.set_postfix(
            loss=f"{outcomes[0].loss:.3f}",
            acc="-" if shown.result is None else f"{shown.result.accuracy:.3f}",
        )

    stopper.rounds_started = False  # from here a stop request stops at once: the last round is checkpointed
    return _finish(fabric, cfg, runs, show_progress, engine)


def _train_round(
    fabric: Fabric, cfg: DictConfig, active: list[Run], round_: int, engine: Engine, stopper: Stopper
) -> tuple[list, list[tuple[Run, dict]]]:
    """One lockstep round of the ``active`` runs: their outcomes, and each run that trained it with
    its metrics row (a diverged run fails here, its last good checkpoint kept as it is)."""
    fed = cfg.federation
    clock = RoundClock()
    outcomes = federated_rounds(
        [run.federated for run in active],
        round_,
        fed.clients_per_round,
        (fabric.global_rank, fabric.world_size),
        gather_updates(fabric),
        engine,
        fed.client_failure_rate,
    )
    wall, beside = clock.read()
    stopper.round_seconds.append(wall)
    seconds = wall / len(active)  # a stacked seed's share of the lockstep round
    trained = []
    for run, outcome in zip(active, outcomes):
        if outcome.error:
            run.fail(outcome.error)
            continue
        run.round_seconds.append(seconds)
        if fabric.is_global_zero:
            for line in outcome.dropped:
                log.warning(f"round {round_}: {line}; dropped from the aggregate")
        trained.append((run, metrics_row(round_, outcome.loss, seconds, len(outcome.dropped), beside)))
    return outcomes, trained


def _finish(
    fabric: Fabric, cfg: DictConfig, runs: list[Run], show_progress: bool, engine: Engine
) -> dict | list[dict] | None:
    """The final evaluation where it is still due, each run's summary written; one line if a seed
    failed."""
    fed = cfg.federation
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
            summary = {**run.summary(), **engine.describe(), "kept_model": run.keep_model()}
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
