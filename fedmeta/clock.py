"""A round's wall time, and what else kept the machine's CPUs busy meanwhile: two processes on two
cores can slow each other several times over, so a speed means little without what ran beside it."""

from __future__ import annotations

import os
import time

ALONE_CORES = 0.25  # a round with other work averaging at most this many cores beside it ran alone


def machine_busy_seconds() -> float | None:
    """CPU-seconds the whole machine has been busy since it started (Linux ``/proc/stat``: user, nice,
    system, irq and softirq over every core; idle, I/O wait and time stolen by a hypervisor are not
    work done here), or None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class RoundClock:
    """Started when a round starts; ``read()`` gives its wall seconds so far and the cores that other
    processes kept busy on average meanwhile — the machine's busy time less this process's (every
    thread of it), over the wall time; None where the machine's busy time cannot be read."""

    def __init__(self):
        self.wall, self.own, self.busy = time.perf_counter(), time.process_time(), machine_busy_seconds()

    def read(self) -> tuple[float, float | None]:
        wall = time.perf_counter() - self.wall
        busy = machine_busy_seconds()
        if busy is None or self.busy is None or wall <= 0:
            return wall, None
        others = busy - self.busy - (time.process_time() - self.own)
        return wall, round(max(0.0, others) / wall, 2)  # ticks of 10 ms: a short round reads a little below 0
