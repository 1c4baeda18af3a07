"""A round's clock: its wall seconds, and the cores other processes kept busy beside it — the
machine's busy CPU time less the round's own process's, over the wall time."""

import subprocess
import sys
import time

from fedmeta import clock


def test_the_cores_beside_a_round_are_the_machines_busy_time_less_its_own_over_its_wall_time(monkeypatch):
    readings = {"busy": [100.0, 103.0], "own": [10.0, 11.0], "wall": [50.0, 52.0]}
    monkeypatch.setattr(clock, "machine_busy_seconds", lambda: readings["busy"].pop(0))
    monkeypatch.setattr(clock.time, "process_time", lambda: readings["own"].pop(0))
    monkeypatch.setattr(clock.time, "perf_counter", lambda: readings["wall"].pop(0))
    # 3 CPU-seconds busy over 2 s, 1 of them this process's own: one core's worth of other work
    assert clock.RoundClock().read() == (2.0, 1.0)


def test_without_the_machines_busy_time_a_round_has_its_seconds_and_no_beside(monkeypatch):
    monkeypatch.setattr(clock, "machine_busy_seconds", lambda: None)
    wall, beside = clock.RoundClock().read()
    assert wall >= 0 and beside is None


def test_a_process_spinning_beside_a_round_reads_as_about_a_core():
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.5)  # the spinner has started
        round_clock = clock.RoundClock()
        time.sleep(1.5)  # this "round" sleeps: what is busy is someone else
        wall, beside = round_clock.read()
    finally:
        spinner.wait()
    # at least the spinner's core (less a tick's rounding and a scheduler's share), whatever else runs
    assert wall >= 1.5 and beside is not None and beside >= 0.8
