"""User-facing errors of the command line: one line, exit code 2, no traceback."""


class UsageError(ValueError):
    """Bad command-line input. The message names the bad value and lists what is accepted."""

    exit_code = 2
