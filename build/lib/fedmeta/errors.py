"""The one error type users see: a single line that says what went wrong and what to do."""


class FedmetaError(Exception):
    """Bad input or an unrecoverable run condition, reported as one line by the CLI."""
