"""A real worker process (`python -m workers --simulate sm_89`) answering over its Unix socket."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def start_worker(tmp: Path, model: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    sock, status = tmp / "w.sock", tmp / "status.json"
    cmd = [sys.executable, "-m", "workers", "--socket", str(sock), "--worker-id", "gpu7", "--model", str(model),
           "--status-file", str(status), "--threads", "1", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSERVE_")}
    log = open(tmp / "worker.log", "w")  # a file, not a pipe: a full pipe would block the worker
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = tmp / "worker.log"
    return proc, sock, status


def read_status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def wait_state(proc, status: Path, states: set[str], timeout=90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = read_status(status)
        if s.get("state") in states:
            return s
        if proc.poll() is not None and s.get("state") not in states:
            break
        time.sleep(0.05)
    raise AssertionError(f"worker never reached {states}: {read_status(status)}; log:\n{proc.log_path.read_text()}")


def client(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://worker", timeout=60)


@contextlib.contextmanager
def ready_worker(tmp: Path, *flags: str):
    """A worker of a fresh tiny checkpoint under a stand-in parent, ready: {proc, sock, status,
    model, parent}; both processes are gone after the block."""
    model = make_checkpoint(tmp / "model")
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc, sock, status = start_worker(tmp, model, "--simulate", "sm_89", "--parent-pid", str(parent.pid), *flags)
    try:
        wait_state(proc, status, {"ready"})
        yield {"proc": proc, "sock": sock, "status": status, "model": model, "parent": parent}
    finally:
        parent.kill()
        parent.wait()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with ready_worker(tmp_path_factory.mktemp("worker"), "--max-batch", "4", "--max-queue", "2",
                      "--kv-block-size", "8", "--max-num-batched-tokens", "16") as w:  # longer prompts are chunked
        yield w


@functools.lru_cache(maxsize=1)
def _load(model_dir: Path):
    from workers.model.loader import load_model

    return load_model(model_dir, "float32")


def solo_greedy(model_dir: Path, prompt: str, n: int) -> list[int]:
    """Reference: greedy decoding with the model's full causal forward, no cache, no engine."""
    loaded = _load(model_dir)
    ids = loaded.tokenizer.encode(prompt).ids
    out = []
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(loaded.model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(nxt)
            if nxt in loaded.eos_token_ids:
                break
    return out


def test_socket_is_private_and_capability_is_the_simulated_device(worker):
    assert stat.S_IMODE(os.stat(worker["sock"]).st_mode) == 0o600
    with client(worker["sock"]) as c:
        assert c.get("/health").json()["status"] == "ready"
        cap = c.get("/capability").json()
    assert cap["worker_id"] == "gpu7" and cap["pid"] == worker["proc"].pid
    assert cap["device"]["capability"] == "8.9" and cap["device"]["simulated"] is True
    assert cap["fp8"]["convention"] == "native_e4m3"
    capacity = cap["capacity"]
    assert capacity["max_sequences"] == 4 and capacity["max_seq_len"] == 256
    # the CPU default budget: --max-batch sequences of the full context, in blocks of 8 tokens
    assert capacity["kv_block_size"] == 8 and capacity["kv_blocks_total"] == 4 * 256 // 8
    assert capacity["max_tokens"] == 4 * 256 and capacity["prefix_cache"] is True
    assert 0 <= capacity["kv_blocks_free"] <= capacity["kv_blocks_total"]
    assert cap["model"]["context_length"] == 256 and cap["model"]["eos_token"] == "</s>"
    # its decode rows on the host's CPU: the C++ kernel where it built (kernels_local/paged_attention/cpu.py), and why
    assert cap["kernels"]["PagedAttention"]["cpu_decode"].startswith(("C++ kernel", "C++ kernel unavailable"))


def test_concurrent_requests_each_match_their_solo_greedy_decoding(worker):
    prompts = ["Hello", "The quick brown fox", "Once upon a time there was", "def main():"]
    results: dict[str, dict] = {}

    def call(p: str):
        with client(worker["sock"]) as c:
            r = c.post("/generate", json={"inputs": p, "parameters": {"max_new_tokens": 12, "details": True}})
            results[p] = {"status": r.status_code, "body": r.json(), "headers": r.headers}

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in prompts:
        res = results[p]
        assert res["status"] == 200, res["body"]
        assert res["headers"]["x-worker-id"] == "gpu7" and res["headers"]["x-worker-capability"] == "8.9"
        assert res["headers"]["x-fp8-convention"] == "not used (float32)"  # no fp8 layers: the dtype that runs
        got = [t["id"] for t in res["body"]["details"]["tokens"]]
        assert got == solo_greedy(worker["model"], p, 12), p


def test_a_repeated_long_prompt_skips_its_cached_prefix_and_reports_it(worker):
    """Over HTTP: the second request with the same 40-token prompt finds its first blocks in
    the prefix cache (the metrics count them), is chunked like the first, and gives the same
    greedy tokens."""
    prompt = "The quick brown fox jumps over the lazy dog " * 4

    def metric(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    with client(worker["sock"]) as c:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 6, "details": True}}
        before = c.get("/metrics").text
        first = c.post("/generate", json=body).json()
        second = c.post("/generate", json=body).json()
        after = c.get("/metrics").text
        assert c.get("/health").json()["capacity"]["kv_blocks_free"] == 4 * 256 // 8  # all free again
    n_prompt = first["details"]["input_length"]
    assert n_prompt > 16 and first["generated_text"] == second["generated_text"]
    hits = metric(after, "hetserve_worker_prefix_cache_hits_tokens_total") - metric(
        before, "hetserve_worker_prefix_cache_hits_tokens_total")
    assert hits == (n_prompt - 1) // 8 * 8
    skipped = 'hetserve_worker_prefill_tokens_total{kind="skipped"}'
    assert metric(after, skipped) - metric(before, skipped) == hits
    for series in ("hetserve_worker_kv_cache_usage_ratio", "hetserve_worker_preemptions_total",
                   "hetserve_worker_prefix_cache_queries_tokens_total"):
        assert series in after


def test_too_long_request_is_422_naming_the_numbers(worker):
    with client(worker["sock"]) as c:
        r = c.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 1000}})
    assert r.status_code == 422
    assert "256" in r.json()["error"] and "1000 `max_new_tokens`" in r.json()["error"]


def test_disconnected_stream_frees_its_blocks(worker):
    with client(worker["sock"]) as c:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 250, "do_sample": True, "seed": 1}}
        with c.stream("POST", "/generate_stream", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["index"] == 0
        # the response is closed: the worker must notice and drop the sequence and its blocks
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            health = c.get("/health").json()
            if health["load"] == {"running": 0, "queued": 0}:
                break
            time.sleep(0.02)
        assert health["load"] == {"running": 0, "queued": 0} and health["capacity"]["kv_blocks_free"] == 128
        metrics = c.get("/metrics").text
    generated = [line for line in metrics.splitlines() if line.startswith("hetserve_worker_generated_tokens_total")]
    assert float(generated[0].split()[-1]) < 12 * 4 + 250  # the cancelled stream did not run to its end


def test_parent_death_shuts_the_worker_down_cleanly(worker):
    worker["parent"].kill()
    worker["parent"].wait()  # reaped, so its pid is gone
    assert worker["proc"].wait(timeout=30) == 0
    assert read_status(worker["status"])["state"] == "stopped"
    assert not worker["sock"].exists()


def test_failed_start_names_the_step_and_exits_3(tmp_path):
    proc, _, status = start_worker(tmp_path, tmp_path / "no-such-model", "--simulate", "sm_8x")
    assert proc.wait(timeout=60) == 3
    s = read_status(status)
    assert s["state"] == "failed" and s["step"] == "bind" and "`sm_8x`" in s["reason"]


def test_a_cpu_worker_started_by_hand_takes_its_devices_step_budget_and_says_what_its_kernels_run(tmp_path):
    """Guards the resolution after `bind` in workers/main.py `run_worker`: without
    `--max-num-batched-tokens` a worker's step budget is its device's (`step_token_budget`): 1024
    tokens a step on the CPU. Its `/capability` kernels say whether RMSNorm's and SiluAndMul's C++
    kernels built there (workers/engine/build.py `install_cpu_paths`, at start)."""
    from workers.contract import CPU_MAX_NUM_BATCHED_TOKENS

    proc, sock, status = start_worker(tmp_path, make_checkpoint(tmp_path / "model"), "--max-batch", "2",
                                      "--compile", "off")
    try:
        wait_state(proc, status, {"ready"})
        with client(sock) as c:
            cap = c.get("/capability").json()
        assert cap["device"]["type"] == "cpu"
        assert cap["capacity"]["max_num_batched_tokens"] == CPU_MAX_NUM_BATCHED_TOKENS
        for layer in ("RMSNorm", "SiluAndMul"):
            assert cap["kernels"][layer]["variant"] == "cpp"
            assert cap["kernels"][layer]["cpu_kernel"].startswith(("C++ kernel, one pass per row", "$HETSERVE_CPU_"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
