"""A step that may wait on the network says so, once, when it has been silent for a while: a
download from a mirror that accepted the connection and says nothing, W&B reaching its server."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable

NOTICE_S = 10.0  # seconds of silence before the line


@contextlib.contextmanager
def said_after(message: str, say: Callable[[str], None] | None = None):
    """Within the block: if it is still running after NOTICE_S seconds, ``say(message)`` once —
    by default the line ``fedmeta: <message>`` on stderr; a step with a progress bar shows it there."""

    def line(text: str) -> None:
        print(f"fedmeta: {text}", file=sys.stderr, flush=True)

    timer = threading.Timer(NOTICE_S, say or line, args=(message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
