"""Busy is not hung (server/fleet/probe.py): a worker whose `/health` goes unanswered past the
probe timeout while its process computes keeps serving, and says so on `/workers`; a stopped
worker is still replaced at its first unanswered probe (tests/test_e2e_migration.py, SIGSTOP)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from server.fleet.probe import BUSY_CPU_SHARE, Probe, ProbeVerdict, cpu_seconds, probe
from tests.router_harness import ROOT, running_router

pytestmark = pytest.mark.slow


class _SlowClient:
    """A worker client whose `/health` times out after `work` (computing, or sleeping)."""

    def __init__(self, compute: bool, seconds: float):
        self.compute, self.seconds = compute, seconds

    async def health(self, timeout_s: float):
        if self.compute:
            end = time.process_time() + self.seconds
            while time.process_time() < end:
                pass
        else:
            time.sleep(self.seconds)
        raise TimeoutError


@pytest.mark.parametrize("compute, expected", [(True, Probe.BUSY), (False, Probe.HUNG)])
def test_an_unanswered_probe_is_busy_only_while_the_process_computes(compute, expected):
    """Guards the CPU-time test in `probe`: the same timeout is `busy` when the worker's process
    computed for at least `BUSY_CPU_SHARE` of it, `hung` when it did not."""
    timeout = 0.5
    client = _SlowClient(compute, timeout * BUSY_CPU_SHARE * 3)
    verdict: ProbeVerdict = asyncio.run(probe(client, timeout, 30.0, os.getpid()))
    assert verdict.kind == expected, verdict.why
    assert (verdict.kind == Probe.BUSY) == ("busy, not hung" in verdict.why)


def test_a_stopped_process_reads_as_not_computing():
    """Guards the stopped-state check in `cpu_seconds`: a SIGSTOPped worker is hung, never busy."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cpu_seconds(child.pid) is not None
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while cpu_seconds(child.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpu_seconds(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(child.pid) is None  # gone


@pytest.fixture(scope="module")
def router():
    yield from running_router(
        ["--simulate", "sm_90", "--health-timeout", "1"],  # a 1 s window: a loaded CI host's hiccups are shorter
        env={"HETSERVE_WORKER_CMD": f"{sys.executable} {ROOT / 'tests/busy_worker.py'}", "BUSY_PROBES": "3",
             "BUSY_SECONDS": "3"},
        fake=False, ready_timeout=240)


def test_a_worker_busy_past_the_probe_timeout_keeps_serving(router):
    seen = router.wait_for(lambda: ((router.worker("gpu0").get("health") or {}).get("probe") == "busy"), timeout=60)
    assert seen
    with router.client() as c:
        for _ in range(3):
            r = c.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text
    time.sleep(3)  # the busy answers run out; the probes answer again
    worker = router.worker("gpu0")
    assert worker["state"] == "ready" and worker.get("restarts", 0) == 0, worker
    assert (worker.get("health") or {}).get("probe") == "ok", worker
    assert "is hung" not in router.output()
