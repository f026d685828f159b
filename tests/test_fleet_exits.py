"""What the supervisor does when a worker exits (server/fleet/exits.py `decide_exit`), case by case,
without a process: failed to start, crashed, crashed too often before serving, backoff."""

from __future__ import annotations

import signal

import pytest

from server.fleet.exits import BACKOFF_RESET_AFTER_S, ExitHistory, RestartPolicy, decide_exit
from workers.contract import ExitCode, WorkerStatus

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, max_startup_crashes=3)


def fresh() -> ExitHistory:
    return ExitHistory.start(POLICY)


@pytest.mark.parametrize("returncode, status", [
    (ExitCode.FAILED_TO_START, {"step": "load", "reason": "ModelLoadError: no config.json"}),
    (1, {"state": WorkerStatus.FAILED, "step": "load", "reason": "ModelLoadError: no config.json"}),
])
def test_a_worker_that_failed_to_start_is_failed_with_its_step_and_never_restarted(returncode, status):
    """Guards the first branch of `decide_exit`: the same start would fail the same way, so a
    restart would only loop (exit code 3, or a status file that says `failed`)."""
    d = decide_exit(returncode, status, fresh(), POLICY, served_for_s=None)
    assert not d.restart and d.reason == "load: ModelLoadError: no config.json"
    assert d.last_exit == f"exited with code {int(returncode)}"


def test_a_failed_start_without_a_status_file_says_so():
    d = decide_exit(ExitCode.FAILED_TO_START, {}, fresh(), POLICY, served_for_s=None)
    assert not d.restart and d.reason == "startup: exited with code 3 without a status file"


def test_a_crash_while_serving_restarts_after_the_backoff_which_then_doubles_up_to_its_cap():
    history = fresh()
    waits = []
    for _ in range(5):
        d = decide_exit(-signal.SIGKILL, {}, history, POLICY, served_for_s=5.0)
        assert d.restart and d.last_exit == "killed by signal SIGKILL"
        waits.append(d.wait_s)
        history = d.history
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0] and history.restarts == 5
    assert d.reason == "killed by signal SIGKILL; restart 5 in 4.0s"


def test_a_worker_that_served_long_enough_restarts_with_the_initial_backoff():
    """Guards the reset to `initial_backoff_s` after `BACKOFF_RESET_AFTER_S` of service: without
    it one crash a day would wait the cap."""
    worn = ExitHistory(backoff_s=4.0, restarts=7)
    assert decide_exit(1, {}, worn, POLICY, served_for_s=BACKOFF_RESET_AFTER_S).wait_s == 0.5
    assert decide_exit(1, {}, worn, POLICY, served_for_s=BACKOFF_RESET_AFTER_S - 1).wait_s == 4.0


def test_crashes_before_ever_serving_are_given_up_on_after_the_limit():
    """Guards the startup-crash count: a worker that never becomes ready is failed after
    `max_startup_crashes` crashes in a row, not restarted forever; serving resets the count."""
    history = fresh()
    for n in (1, 2):
        d = decide_exit(1, {}, history, POLICY, served_for_s=None)
        assert d.restart and d.history.startup_crashes == n
        history = d.history
    d = decide_exit(1, {}, history, POLICY, served_for_s=None)
    assert not d.restart and d.reason == "crashed 3 times before becoming ready; last: exited with code 1"
    served = decide_exit(1, {}, history, POLICY, served_for_s=0.1)
    assert served.restart and served.history.startup_crashes == 0


def test_a_fatal_error_and_the_routers_own_cause_are_named_in_the_last_exit():
    status = {"state": WorkerStatus.FATAL, "reason": "RuntimeError: CUDA error: an illegal memory access"}
    d = decide_exit(ExitCode.FATAL, status, fresh(), POLICY, served_for_s=30.0)
    assert d.last_exit == "fatal error while serving: RuntimeError: CUDA error: an illegal memory access"
    hung = decide_exit(-signal.SIGTERM, {}, fresh(), POLICY, served_for_s=30.0,
                       stopped_because="hung: no engine step for 31.0s")
    assert hung.restart and hung.last_exit == "hung: no engine step for 31.0s; killed by signal SIGTERM"


def test_the_policy_comes_from_the_settings():
    from server.config.settings import RouterSettings

    s = RouterSettings(restart_backoff_initial_s=0.25, restart_backoff_max_s=8.0, max_startup_crashes=2)
    assert RestartPolicy.from_settings(s) == RestartPolicy(0.25, 8.0, 2)
