"""A worker's life as both processes name it: startup steps, status-file states, exit codes,
and the states the router shows in `/workers`.

The worker writes a status file at each startup step and exits with a code that tells the
router what to do next: `FAILED_TO_START` (3) means the same start would fail the same way,
so the worker is marked `failed` and not restarted; `FATAL` (4), a crash or a signal means
restart with backoff. Both sides compare these values, never bare literals; they are `str` /
`int` enums so that they read and serialize as the plain values in JSON and logs.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

# The mission, in order: the worker's entry point runs them top-down (`kv_cache` and `engine`:
# the engine built for this device; `compile`: the decode step per batch bucket, once the server
# is built and before its socket listens). A pipeline's stage also reports `pipeline` (its plan,
# then joining the other stages).
STARTUP_STEPS = ("bind", "capability", "load", "kernelize", "fp8", "kv_cache", "engine", "serve", "compile")


class ExitCode(IntEnum):
    OK = 0
    FAILED_TO_START = 3  # a startup step failed; the status file names it
    FATAL = 4  # a fatal error while serving


class WorkerStatus(StrEnum):
    """What the worker writes in its status file."""

    STARTING = "starting"  # with `step`: the startup step under way
    READY = "ready"
    FAILED = "failed"  # with `step` and `reason`; exits with `ExitCode.FAILED_TO_START`
    FATAL = "fatal"  # with `reason`; exits with `ExitCode.FATAL`
    STOPPED = "stopped"  # a clean shutdown


class WorkerState(StrEnum):
    """A worker as the router shows it (`/workers` `state`)."""

    STARTING = "starting"  # first start, not ready yet
    READY = "ready"
    UNHEALTHY = "unhealthy"  # alive but failing health checks: not routed to
    RESTARTING = "restarting"  # crashed; restarting with backoff
    FAILED = "failed"  # failed to start at a step, or kept crashing: not restarted
    STOPPING = "stopping"  # its model is unloading: it finishes what it has, then exits (not routed to)
