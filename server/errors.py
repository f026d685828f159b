"""User-facing errors of the command line: one line, exit code 2, no traceback."""


class UsageError(ValueError):
    """Bad command-line input. The message names the bad value and lists what is accepted."""

    exit_code = 2


def shown(value: str, limit: int = 64) -> str:
    """A client's value as an error message quotes it: at most `limit` characters, then how
    long it was, so a megabyte header or path is never echoed back whole."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} characters)"
