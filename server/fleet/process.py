"""A worker's operating-system process: started so that it dies with the router, checked, killed.

Design: workers run in their own session (a Ctrl-C in the terminal reaches only the router,
which drains and stops them in order) and, on Linux, with `PR_SET_PDEATHSIG`, so they exit even
when the router is killed with SIGKILL. The supervisor (server/fleet/supervisor.py) decides
when; this module only does it. Trade-off: `prctl` through ctypes rather than a dependency;
elsewhere than Linux the parent-death signal is absent and `--parent-pid` alone covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal

from server.fleet.handle import WorkerHandle

_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _PRCTL = _LIBC.prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _child_setup() -> None:
    """Runs in the child between fork and exec: die with the router (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def spawn(argv, environ: dict) -> asyncio.subprocess.Process:
    """Start a worker: its own session, no stdin, the parent-death signal set."""
    return await asyncio.create_subprocess_exec(
        *argv,
        env=environ,
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_child_setup,
    )


def alive(handle: WorkerHandle) -> bool:
    return handle.process is not None and handle.process.returncode is None


def kill(handle: WorkerHandle) -> None:
    """SIGKILL the worker's process, if it still runs."""
    if alive(handle):
        with contextlib.suppress(ProcessLookupError):
            handle.process.kill()
