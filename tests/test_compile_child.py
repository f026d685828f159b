"""The decode step compiled in a child process (workers/engine/warm_caches.py, workers/compile_child.py):
the worker's own compile of each bucket is then a load from the caches the child filled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.checkpoints import make_checkpoint
from tests.test_worker_process import ROOT, client, solo_greedy, wait_state
from workers.engine.warm_caches import ChildCompile, fill_caches
from workers.kv.groups import KVGroup


def _child(tmp_path) -> ChildCompile:
    from workers.contract import WorkerConfig

    return ChildCompile(WorkerConfig(socket=str(tmp_path / "w.sock")), (KVGroup(None, (0, 1), 9),), 16, (1, 2))


def test_the_child_says_each_bucket_and_a_failed_child_says_why(tmp_path):
    """Guards `fill_caches`: the buckets the child reports reach `on_bucket`, its spec carries what
    the child rebuilds (no pickled module), and a child that fails is a reason, not an exception
    (the worker then compiles in-process)."""
    child = _child(tmp_path)
    spec = child.spec(in_place=True)
    assert spec["buckets"] == [1, 2] and spec["in_place"] is True and spec["block_size"] == 16
    assert json.loads(json.dumps(spec))["groups"] == [  # JSON only: the child builds the pool again
        {"window": None, "layers": [0, 1], "num_blocks": 9, "kv_heads": 0, "head_dim": 0}]

    seen = []
    script = "import json, sys; spec = json.load(open(sys.argv[1])); [print(json.dumps({'done': i + 1})) " \
             "for i in range(len(spec['buckets']))]"
    assert fill_caches(child, True, seen.append, command=(sys.executable, "-c", script)) is None
    assert seen == [1, 2]
    why = fill_caches(child, True, seen.append, command=(sys.executable, "-c", "import sys; "
                                                         "print('no such model', file=sys.stderr); sys.exit(3)"))
    assert why == "the compile child exited 3: no such model"


@pytest.mark.slow
def test_a_cpu_worker_loads_each_bucket_the_child_compiled_from_the_cache(tmp_path):
    """Guards `fill_caches(...)` in `BuiltEngine._compile_behind`: with empty Inductor caches a CPU
    worker under `--compile auto` has a child compile its buckets, then finds every bucket in the
    caches (`cache_hits`: no graph compiled in the worker, whose steps were held only for a load),
    says what it prepares meanwhile, and its compiled steps give the reference's greedy tokens."""
    model = make_checkpoint(tmp_path / "model", num_hidden_layers=1)
    sock, status = tmp_path / "w.sock", tmp_path / "status.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSERVE_") and not k.startswith("TORCHINDUCTOR")}
    env["HETSERVE_TRITON_CACHE"] = str(tmp_path / "triton")  # the Inductor cache beside it: empty
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "workers", "--socket", str(sock), "--worker-id", "cpu0",
                             "--model", str(model), "--status-file", str(status), "--threads", "1",
                             "--dtype", "float32", "--max-batch", "2"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # its compile child goes with it
    proc.log_path = tmp_path / "worker.log"
    try:
        wait_state(proc, status, {"ready"}, timeout=120)
        lines, deadline = set(), time.monotonic() + 600
        with client(sock) as c:
            while time.monotonic() < deadline:
                health = c.get("/health").json()
                lines.update(health["preparing"])
                if health["compile"]["state"] != "compiling":
                    break
                time.sleep(0.2)
            compile_ = c.get("/capability").json()["compile"]
        assert compile_["state"] == "ready", (compile_, proc.log_path.read_text()[-3000:])
        assert compile_["cache_hits"] == len(compile_["buckets"]) == 2, compile_
        assert any(line.endswith("buckets (in a child process)") for line in lines), lines
        said = proc.log_path.read_text()
        assert "a child process compiled buckets [1, 2] into the Inductor cache" in said, said[-3000:]
        with client(sock) as c:
            ids = c.post("/generate", json={"inputs": "hello world", "parameters": {
                "max_new_tokens": 6, "details": True}}).json()["details"]["tokens"]
        assert [t["id"] for t in ids] == solo_greedy(model, "hello world", 6)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
