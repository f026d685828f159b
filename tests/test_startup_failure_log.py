"""A worker that fails at start says why once: one console line from the worker, one from the router
per worker, no chained tracebacks on the console (the traceback goes to the status file and the
debug log). Real processes: `python -m workers` alone, and `hetserve serve` with one CPU worker, on a
checkpoint whose safetensors file is corrupt (which the router's config.json check cannot see)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.router_harness import free_port
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REASON = "SafetensorError"


@pytest.fixture(scope="module")
def corrupt_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("corrupt") / "corrupt"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    for f in model.glob("*.safetensors"):
        f.write_bytes(b"\xff" * 100)  # a header length of ~1.8e19 bytes: safetensors refuses to read it
    return model


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "HETSERVE_COMPILE": "off", **env})


def test_the_worker_logs_its_start_failure_once_and_keeps_the_traceback_in_the_status_file(corrupt_model, tmp_path):
    """Guards `logger.error("failed to start at step %s: %s", ...)` in workers/main.py `run_worker`
    (it was `logger.exception`: three chained tracebacks per worker on the console)."""
    status = tmp_path / "status.json"
    proc = _run(["-m", "workers", "--socket", str(tmp_path / "w.sock"), "--worker-id", "cpu0", "--model",
                 str(corrupt_model), "--status-file", str(status)])
    assert proc.returncode == 3, proc.stderr  # ExitCode.FAILED_TO_START
    assert "Traceback" not in proc.stderr, proc.stderr
    failed = [line for line in proc.stderr.splitlines() if REASON in line]
    assert len(failed) == 1 and "failed to start at step load" in failed[0], proc.stderr
    body = json.loads(status.read_text())
    assert body["state"] == "failed" and body["step"] == "load" and REASON in body["reason"]
    assert "Traceback" in body["traceback"] and "safe_open" in body["traceback"], body["traceback"]


def test_the_debug_log_keeps_the_traceback(corrupt_model, tmp_path):
    proc = _run(["-m", "workers", "--socket", str(tmp_path / "w.sock"), "--model", str(corrupt_model)],
                HETSERVE_LOG_LEVEL="DEBUG")
    assert proc.returncode == 3 and "Traceback" in proc.stderr and "safe_open" in proc.stderr, proc.stderr[-2000:]


def test_serve_prints_the_reason_once_per_worker_in_a_bounded_log(corrupt_model):
    """Guards `logged=True` in server/fleet/supervisor.py `_lifecycle` (the state change repeated the
    reason beside `worker X failed:`) and the count in server/commands/serve.py `on_settled` (which
    repeated every reason once more)."""
    proc = _run(["-m", "server.cli", "serve", "--model", str(corrupt_model), "--port", str(free_port())])
    assert proc.returncode == 1, proc.stderr  # nothing to serve
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) <= 25, proc.stderr  # was 45 for one worker
    with_reason = [line for line in lines if REASON in line]
    worker = [line for line in with_reason if "[cpu0]" in line]
    router = [line for line in with_reason if "[cpu0]" not in line]
    assert len(worker) == 1 and len(router) == 1, with_reason
    assert "worker cpu0 failed: load: SafetensorError" in router[0]
    assert any("no worker could start (1 failed" in line for line in lines), proc.stderr
