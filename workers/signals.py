"""How a worker process ends: SIGTERM before and during serving, and the router's death.

Design: before serving, SIGTERM ends startup at once by raising `ShutdownRequested` out of
whatever step runs (the startup steps clean up on the way out); once serving, uvicorn owns
SIGTERM and drains. A daemon thread polls the router's pid, so a worker never outlives its
router even where PR_SET_PDEATHSIG does not reach it (a re-parented process). Trade-off: the
poll costs a wake-up every `PARENT_POLL_S` seconds for the worker's whole life.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


class ShutdownRequested(BaseException):
    """SIGTERM (or the parent's death) before serving started."""


def install_sigterm(phase: dict) -> None:
    """Before serving, SIGTERM ends startup at once; while serving, uvicorn owns SIGTERM (graceful
    drain) and afterwards re-raises it into this handler, which then has nothing left to do."""

    def on_sigterm(signum, frame):
        server = phase.get("server")
        if server is not None:
            server.should_exit = True  # between the serve step and uvicorn taking over SIGTERM
        elif not phase.get("stopping"):
            # Once only: the parent's death may signal twice (PR_SET_PDEATHSIG and the parent
            # watch); a second raise would interrupt the shutdown that the first one started.
            phase["stopping"] = True
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already, through exit
            raise ShutdownRequested()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def watch_parent(parent_pid: int | None) -> None:
    """A daemon thread that sends this process SIGTERM once `parent_pid` is gone."""
    if not parent_pid:
        return
    was_parent = os.getppid() == parent_pid

    def alive() -> bool:
        if was_parent and os.getppid() != parent_pid:  # re-parented: our parent exited
            return False
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch():
        while alive():
            time.sleep(PARENT_POLL_S)
        logger.warning("parent process %s is gone; shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
