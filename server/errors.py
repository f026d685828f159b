"""User-facing errors of the command line: one line, exit code 2, no traceback; and how any
error quotes a client's value (`shown`, the contract's: workers/contract/errors.py)."""

from workers.contract.errors import shown

__all__ = ["UsageError", "shown"]


class UsageError(ValueError):
    """Bad command-line input. The message names the bad value and lists what is accepted."""

    exit_code = 2
