"""Stopping a run early at a round boundary, checkpointed, so that it resumes where it stopped:
on SIGTERM, on Ctrl-C, and before a round that would end past ``output.stop_at`` (fedmeta.loop asks
``Stopper.reason`` before each round and calls ``stop_runs``)."""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time

from fedmeta.errors import RunStopped


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc), else since this module was imported."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()
# said in a job's run log (output.stop_at set): how long a process takes to a round, which a job's
# last start must leave before its deadline (fedmeta.grid)
FIRST_ROUND_ENDED = "the first round in this process ended"


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
    complete, so nothing is lost. A second Ctrl-C stops at once; a second SIGTERM changes nothing (a
    group's signal reaches a grid's run twice: directly and passed on by its grid)."""

    MARGIN = 1.5  # a round may take longer than the median of the last ones
    SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}

    def __init__(self, stop_at: float | None):
        self.stop_at, self.rounds_started = stop_at, False
        self.signalled: str | None = None  # the stop asked for: "SIGTERM" or "Ctrl-C"
        self.evaluating = False  # a round's evaluation is under way: a stop ends it, the round is kept
        self.round_seconds: list[float] = []
        self.evaluation_seconds = self.checkpoint_seconds = 0.0
        self._previous: dict = {}

    def __enter__(self) -> Stopper:
        if threading.current_thread() is threading.main_thread():  # only the main thread takes signals
            self._previous = {
                number: signal.signal(number, self._on_signal)
                for number in self.SIGNALS
                if signal.getsignal(number)
                is not signal.SIG_IGN  # a process told to ignore Ctrl-C keeps to it
            }
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        name = self.SIGNALS[signum]
        if signum == signal.SIGINT and self.signalled:  # a second Ctrl-C: at once, the round under way lost
            self.restore()
            raise KeyboardInterrupt
        if signum == signal.SIGTERM and self.signalled and self.rounds_started and not self.evaluating:
            return  # sent again (to the process group, and by a grid passing it on): the round still ends
        if not self.rounds_started or self.signalled or self.evaluating:
            self.signalled = name
            raise RunStopped(
                f"stopped by {name}; the last checkpoint is kept: continue with output.resume=true"
            )
        self.signalled = name  # the round under way finishes and is checkpointed
        if signum == signal.SIGINT:
            print(
                "\nfedmeta: Ctrl-C: the round under way finishes and is checkpointed (Ctrl-C again: stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def reason(self, evaluating: bool) -> str | None:
        """Why the next round must not start, or None."""
        if self.signalled:
            return self.signalled
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
