"""What happens when a worker process exits: mark it failed, or restart it after a backoff.

A pure function of the exit and the worker's history, so each case has its own unit test
(tests/test_fleet_exits.py) and the supervisor only carries the decision out:
- a worker that *failed to start* (exit code 3, or its status file says `failed` at a step:
  bind, capability, load, kernelize, fp8) is marked `failed` with that step and reason, and
  not restarted: the same start would fail the same way;
- anything else (a crash, `kill -9`, a fatal error while serving, a hung worker the router
  stopped) is restarted after an exponential backoff, reset to its initial value once a
  process has served for `BACKOFF_RESET_AFTER_S`;
- a worker that keeps crashing before it ever becomes ready is given up on (`failed`) after
  `max_startup_crashes` tries in a row instead of being retried forever.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace

from workers.contract import ExitCode, WorkerStatus

BACKOFF_RESET_AFTER_S = 60.0  # a worker that served this long restarts with the initial backoff


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_startup_crashes: int = 5  # crashes in a row before ever becoming ready -> `failed`

    @classmethod
    def from_settings(cls, settings) -> RestartPolicy:
        return cls(settings.restart_backoff_initial_s, settings.restart_backoff_max_s, settings.max_startup_crashes)


@dataclass(frozen=True)
class ExitHistory:
    """What the lifecycle remembers from one process of a worker to the next."""

    backoff_s: float  # the wait before the next restart
    restarts: int = 0
    startup_crashes: int = 0  # crashes in a row before becoming ready

    @classmethod
    def start(cls, policy: RestartPolicy, restarts: int = 0) -> ExitHistory:
        return cls(policy.initial_backoff_s, restarts)


@dataclass(frozen=True)
class ExitDecision:
    restart: bool  # False: the worker is `failed` for good
    reason: str  # the worker's `reason` in `/workers` (`failed` or `restarting`)
    last_exit: str  # how the process ended, as `/workers` `last_exit` shows it
    wait_s: float = 0.0  # before the restart
    history: ExitHistory | None = None  # for the next process (when restarted)




def describe_exit(returncode: int, status: dict) -> str:
    """`killed by signal SIGKILL`, `fatal error while serving: ...`, `exited with code 1`."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    if returncode == ExitCode.FATAL or status.get("state") == WorkerStatus.FATAL:
        return f"fatal error while serving: {status.get('reason') or 'no reason given'}"
    return f"exited with code {returncode}"


def describe_failure(returncode: int, status: dict) -> str:
    """Why a start failed, as `/workers` shows it: `kernelize: <reason>`."""
    step = status.get("step") or "startup"
    reason = status.get("reason") or f"exited with code {returncode} without a status file"
    return f"{step}: {reason}"


def decide_exit(returncode: int, status: dict, history: ExitHistory, policy: RestartPolicy,
                served_for_s: float | None, stopped_because: str | None = None) -> ExitDecision:
    """The decision for one exited process. `status`: its status file ({} if none);
    `served_for_s`: how long it was ready (None: never); `stopped_because`: why the router
    stopped it itself (found hung, drained by the canary), said first in `last_exit`."""
    # 1. failed to start: the same start would fail again, so no loop
    if returncode == ExitCode.FAILED_TO_START or status.get("state") == WorkerStatus.FAILED:
        return ExitDecision(False, describe_failure(returncode, status), f"exited with code {returncode}")
    # 2. anything else ended it: how, and the router's own cause first
    last_exit = describe_exit(returncode, status)
    if stopped_because is not None:
        last_exit = f"{stopped_because}; {last_exit}"
    # 3. crashes before ever serving are counted; too many in a row and it is given up on
    crashes = 0 if served_for_s is not None else history.startup_crashes + 1
    if crashes >= policy.max_startup_crashes:
        return ExitDecision(False, f"crashed {crashes} times before becoming ready; last: {last_exit}", last_exit)
    # 4. restart after the backoff (its initial value again after a long enough life), then double it
    wait = history.backoff_s
    if served_for_s is not None and served_for_s >= BACKOFF_RESET_AFTER_S:
        wait = policy.initial_backoff_s
    restarts = history.restarts + 1
    after = replace(history, backoff_s=min(wait * 2, policy.max_backoff_s), restarts=restarts, startup_crashes=crashes)
    return ExitDecision(True, f"{last_exit}; restart {restarts} in {wait:.1f}s", last_exit, wait, after)
