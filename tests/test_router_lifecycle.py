"""`hetserve serve` as a process: drain on SIGTERM, no orphans, clear failures at startup."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.router_harness import FAKE_WORKER, ROOT, RouterProcess, alive, children_of, free_port

pytestmark = pytest.mark.slow


def test_sigterm_drains_in_flight_requests_and_leaves_no_process():
    r = RouterProcess(["--simulate", "sm_90"], env={"FAKE_TOKEN_S": "0.02"})
    result = {}

    def slow_request():
        with httpx.Client(timeout=30) as c:
            resp = c.post(f"{r.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 60}})
            result["status"], result["text"] = resp.status_code, resp.json().get("generated_text", "")

    t = threading.Thread(target=slow_request)
    t.start()
    time.sleep(0.4)  # the request is in flight (60 tokens x 20 ms)
    code = r.stop(signal.SIGTERM)
    t.join(30)
    assert result.get("status") == 200, (result, r.output())
    assert result["text"].count(" t") == 60
    assert code in (0, -signal.SIGTERM), r.output()
    assert not r.orphans, r.output()


def test_workers_exit_when_the_router_is_killed():
    r = RouterProcess(["--simulate", "sm_80,sm_90"])
    workers = list(r.worker_pids)
    assert len(workers) == 2 and all(alive(p) for p in workers)
    os.kill(r.proc.pid, signal.SIGKILL)
    r.proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in workers):
        time.sleep(0.1)
    left = [p for p in workers if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers outlived the router: {left}"


def _serve(args, env=None, timeout=60):
    full_env = {**os.environ, "HETSERVE_WORKER_CMD": f"{sys.executable} {FAKE_WORKER}", **(env or {})}
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", str(free_port()), *args],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_serve_exits_1_with_the_reasons_when_no_worker_can_start():
    p = _serve(["--simulate", "sm_80,sm_90"], env={"FAKE_FAIL_STEP": "bind"})
    assert p.returncode == 1, p.stderr
    assert "no worker could start" in p.stderr and "bind: fake failure at bind" in p.stderr


def test_port_in_use_is_a_one_line_usage_error_before_any_worker_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--simulate", "sm_90", "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HETSERVE_WORKER_CMD": f"{sys.executable} {FAKE_WORKER}"})
    assert p.returncode == 2
    assert f"`127.0.0.1:{port}`" in p.stderr and "started pid" not in p.stderr


def test_missing_model_dir_is_a_usage_error():
    p = _serve(["--simulate", "sm_90", "--model", "/nonexistent/model"])
    assert p.returncode == 2 and "`/nonexistent/model`" in p.stderr


def test_no_gpu_and_no_simulate_gives_one_cpu_worker():
    from server.commands.inventory import nvml_inventory

    if nvml_inventory():
        pytest.skip("this host has GPUs")
    r = RouterProcess([])
    try:
        workers = r.workers()
        assert [w["id"] for w in workers] == ["cpu0"] and workers[0]["device"]["type"] == "cpu"
        env = open(f"/proc/{workers[0]['pid']}/environ", "rb").read().split(b"\0")
        # The host CPU is a real device, not a simulated one: no simulate token, no GPU visible.
        assert not any(e.startswith(b"HETSERVE_SIMULATE=") for e in env) and b"CUDA_VISIBLE_DEVICES=" in env
        assert children_of(r.proc.pid) == [workers[0]["pid"]]
    finally:
        r.stop()
