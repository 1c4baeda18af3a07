"""The one error type users see: a single line that says what went wrong and what to do."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


class FedmetaError(Exception):
    """Bad input or an unrecoverable run condition, reported as one line by the CLI."""


class RunStopped(BaseException):
    """A run stopped early on purpose (SIGTERM, or its deadline ``output.stop_at``), its last round
    checkpointed: not a failure, it continues with ``output.resume=true``. Not an ``Exception``, as
    KeyboardInterrupt is not: a stop that arrives inside a guarded step (reading a data file) is
    never taken for that step's failure."""

    EXIT_STATUS = 75  # fedmeta train's status for it (sysexits' EX_TEMPFAIL: try again later)


def write_failure(path: Path, tmp: Path, exc: OSError) -> OSError:
    """The error of a write of ``path`` through the temporary file ``tmp`` that failed (a full disk):
    ``tmp`` removed, so no half-written file is left, and the error under ``path``'s own name."""
    with contextlib.suppress(OSError):  # a read-only folder: nothing there to remove
        tmp.unlink(missing_ok=True)
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def atomic_write(path: Path, data: str | bytes) -> None:
    """``path`` holds ``data`` whole, or what it held before: written beside it, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise write_failure(path, tmp, exc) from None
