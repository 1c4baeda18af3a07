"""Stopping a run early at a round boundary, checkpointed, so that it resumes where it stopped:
on SIGTERM and before a round that would end past ``output.stop_at`` (fedmeta.loop asks
``Stopper.reason`` before each round and calls ``stop_runs``)."""

from __future__ import annotations

import signal
import statistics
import threading
import time

from fedmeta.errors import RunStopped


def stop_runs(runs: list, last: int, rounds: int, why: str, stopper: Stopper) -> None:
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
