"""The one error type users see: a single line that says what went wrong and what to do."""


class FedmetaError(Exception):
    """Bad input or an unrecoverable run condition, reported as one line by the CLI."""


class RunStopped(FedmetaError):
    """A run stopped early on purpose (SIGTERM, or its deadline ``output.stop_at``), its last round
    checkpointed: not a failure, it continues with ``output.resume=true``."""

    EXIT_STATUS = 75  # fedmeta train's status for it (sysexits' EX_TEMPFAIL: try again later)
