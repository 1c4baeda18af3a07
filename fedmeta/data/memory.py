"""Sizes checked against the machine before they are allocated: a setting that asks for terabytes is
refused at once, in one line that names it, not met by a long allocation or a crash minutes later."""

from __future__ import annotations

import os
from pathlib import Path

from fedmeta.errors import FedmetaError

CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def machine_bytes() -> int:
    """The memory this process may use: the machine's RAM, or its container's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in CGROUP_LIMITS:
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (cgroup v2) or a huge number (v1) where there is no limit
            total = min(total, int(text))
    return total


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


def refuse_beyond_memory(nbytes: int, what: str, fix: str) -> None:
    """One line naming ``what`` (the key and its value first) and ``fix`` when ``nbytes`` exceed the
    machine's memory."""
    if nbytes > (available := machine_bytes()):
        raise FedmetaError(f"{what} would need {gb(nbytes)}, more than this machine's {gb(available)}: {fix}")
