"""The first stage starts the other stages of its pipeline and watches them.

Design: the router writes the replica's plan (workers/contract/pipeline.py: each stage's layers,
`WorkerConfig` and environment, built as for any worker on that device) and starts only the first
stage; the first stage starts the others at once (so every stage loads its layers at the same
time), each from its configuration written beside the plan with its rank and told to exit with
it (`parent_pid`), after a fresh rendezvous for this start (workers/pipeline/rendezvous.py),
and then waits for all of them in the process group. A stage that exits takes
the first stage down with it (`watch`): before serving a start failure naming the stage and its
reason (from its status file), while serving a fatal error, so the router restarts the whole
replica. The trade-off: the router supervises one process per replica, and a stage's own restart
is its replica's."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from workers.contract.pipeline import PipelinePlan
from workers.pipeline.rendezvous import Rendezvous

logger = logging.getLogger(__name__)

POLL_S = 0.2


class Stages:
    """The follower processes of one pipeline, started by its first stage."""

    def __init__(self, plan: PipelinePlan, plan_path: str):
        self.plan, self.procs = plan, {}
        self.rendezvous = Rendezvous.fresh(plan_path)  # before any stage starts: each reads it to join
        for rank, stage in enumerate(plan.stages[1:], start=1):
            config = replace(stage.config, pipeline_plan=plan_path, pipeline_rank=rank, parent_pid=os.getpid())
            path = config.write(Path(plan_path).with_name(f"{Path(plan_path).stem}.stage{rank}.json"))
            env = dict(stage.env) or dict(os.environ)
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "workers", "--config", str(path)], env=env,
                                                stdin=subprocess.DEVNULL)
            logger.info("pipeline stage %d (layers %d:%d, %s) started: pid %d", rank, stage.start, stage.end,
                        stage.device or "device", self.procs[rank].pid)

    def status_files(self) -> list[str | None]:
        """Each later stage's status file (where it reports its steps: workers/pipeline/metrics.py)."""
        return [stage.config.status_file for stage in self.plan.stages[1:]]

    def exited(self) -> str | None:
        """Why a stage is gone (its rank, exit code and reported reason), or None while all run."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return f"pipeline stage {rank} ({self.plan.stages[rank].device or 'its device'}) exited with code " \
                       f"{code}{self._reason(rank)}"
        return None

    def _reason(self, rank: int) -> str:
        path = self.plan.stages[rank].config.status_file
        try:
            with open(path) as f:
                status = json.load(f)
        except (OSError, TypeError, ValueError):
            return ""
        step, reason = status.get("step"), status.get("reason")
        return f": failed at {step}: {reason}" if step and reason else (f": {reason}" if reason else "")

    def wait_for(self, join: Callable[[], object]):
        """`join()` (the process group) on a thread, failing as soon as a stage exits."""
        result: dict = {}

        def run():
            try:
                result["value"] = join()
            except BaseException as e:  # noqa: BLE001 (reported to the caller)
                result["error"] = e

        t = threading.Thread(target=run, name="pipeline-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(POLL_S)
            if t.is_alive() and (why := self.exited()) is not None:
                raise RuntimeError(why)
        if "error" in result:
            raise result["error"]
        return result["value"]

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """A daemon thread that calls `on_exit(reason)` once, when any stage exits."""

        def run():
            while (why := self.exited()) is None:
                time.sleep(POLL_S)
            on_exit(why)

        threading.Thread(target=run, name="pipeline-watch", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the stages to leave (they were told to stop), then terminate what remains."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.rendezvous.remove()
