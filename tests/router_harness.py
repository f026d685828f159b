"""Starts a real `hetserve serve` process for tests and benchmarks (loopback, free port).

`RouterProcess` runs `python -m server.cli serve ...` with the given extra arguments and
environment, waits until `/health` says every worker is ready, and on `stop()` sends
SIGTERM and checks that the router and all its workers are gone. With `fake=True` the
workers are `tests/router_fake_worker.py` (no model, no torch) instead of `python -m workers`.
`running_router(...)` is the same as a module fixture's body; `sse_events` parses a stream.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
FAKE_WORKER = ROOT / "tests" / "router_fake_worker.py"


CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update", "--disable-default-apps"]


def chromium_path() -> str:
    """The system Chromium, or a skip that says why there is none."""
    path = os.environ.get("HETSERVE_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if path is None:
        import pytest

        note = ROOT / ".venv" / ".browser-unavailable"
        why = note.read_text().strip() if note.exists() else "no chromium on PATH (scripts/browser.sh installs it)"
        pytest.skip(f"status page browser test: {why}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class RouterProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, fake: bool = True,
                 ready_timeout: float = 120.0, expect_ready: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, **(env or {})}
        if fake:
            full_env["HETSERVE_WORKER_CMD"] = f"{sys.executable} {FAKE_WORKER}"
        elif "HETSERVE_WORKER_CMD" not in (env or {}):  # the real worker, unless the test starts its own
            full_env.pop("HETSERVE_WORKER_CMD", None)
        self.log = tempfile.NamedTemporaryFile(prefix="hetserve-router-", suffix=".log", delete=False)
        if not fake and not any(a.startswith("--canary-interval") for a in args):
            # real workers: no canary unless the test asks for one (its startup round generates on every
            # worker beside the test's own requests; tests/test_e2e_canary.py runs it on purpose)
            args = [*args, "--canary-interval", "0"]
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT)
        self.worker_pids: list[int] = []
        self._wait_ready(ready_timeout, expect_ready)

    def _wait_ready(self, timeout: float, expect_ready: int | None) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                last = r.json()
                want = expect_ready if expect_ready is not None else last.get("total")
                settled = all(s in ("ready", "failed") for s in last.get("workers", {}).values())
                if last.get("ready", 0) >= (want or 1) and settled:
                    self.worker_pids = children_of(self.proc.pid)
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router not ready after {timeout}s (last /health {last}):\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=10).json()["workers"]

    def worker(self, wid: str) -> dict:
        return next(w for w in self.workers() if w["id"] == wid)

    def metric(self, name: str, **labels: str) -> float | None:
        """The first `/metrics` sample named `name` carrying `labels`, or None."""
        return metric_value(httpx.get(f"{self.url}/metrics", timeout=10).text, name, **labels)

    def wait_for(self, predicate, timeout: float = 30.0, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise AssertionError(f"condition not met within {timeout}s")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stop the router; returns its exit code. Kills leftovers (and reports them) on timeout."""
        pids = set(self.worker_pids) | set(children_of(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        self.orphans = [p for p in pids if alive(p)]
        for p in self.orphans:
            os.kill(p, signal.SIGKILL)
        self.log.close()
        return self.proc.returncode


def running_router(*args, **kwargs):
    """A module fixture's body: a started `RouterProcess`, stopped afterwards with no worker left."""
    r = RouterProcess(*args, **kwargs)
    yield r
    r.stop()
    assert not r.orphans, f"workers left running: {r.orphans}"


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The first sample named `name` carrying `labels` in Prometheus `text`, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def sse_events(text: str) -> list[dict]:
    """The JSON events of an SSE body (`[DONE]` left out)."""
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line]
