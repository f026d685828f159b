"""A CPU worker whose C++ kernels are not built on its host yet serves first, on their torch
paths, and builds them behind its serving (kernels_local/cpp_build.py `deferring`,
workers/engine/build.py `BuiltEngine._kernels_behind`): the swap's order in-process, and a real
worker with an empty extension cache ready in seconds with the reference's greedy tokens."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest

from kernels_local import cpp_build
from tests.checkpoints import make_checkpoint
from tests.test_engine import make_engine, prompt, run_until_idle
from tests.test_worker_process import ROOT, client, solo_greedy, wait_state
from workers.engine import build as engine_build
from workers.engine.build import BuiltEngine, CpuPaths
from workers.engine.compiled import CompileDecision
from workers.sampling.params import SamplingParams


@dataclass(frozen=True)
class _State:
    available: bool
    reason: str


def test_forget_deferred_drops_only_deferred_answers():
    """Guards `forget_deferred` and `deferrable`: a load that answered `DEFERRED` is asked again
    after the kernels were built behind, one that answered for good keeps its answer."""
    answers = iter([_State(False, f"{cpp_build.DEFERRED}; x"), _State(True, "built")])
    calls = []

    @cpp_build.deferrable
    @functools.cache
    def deferred_load():
        calls.append(1)
        return next(answers)

    @cpp_build.deferrable
    @functools.cache
    def final_load():
        calls.append(2)
        return _State(True, "built at start")

    try:
        assert not deferred_load().available and final_load().available
        cpp_build.forget_deferred()
        assert deferred_load().available and final_load().available
        assert calls == [1, 2, 1]  # the deferred one loaded again, the other never
    finally:
        del cpp_build._FORGET[-2:]


def _held(lock) -> bool:
    """Whether some thread holds `lock` (an RLock: asked from a thread of its own)."""
    out = []

    def ask():
        got = lock.acquire(blocking=False)
        out.append(not got)
        if got:
            lock.release()

    asker = threading.Thread(target=ask)
    asker.start()
    asker.join()
    return out[0]


def test_kernels_built_behind_are_swapped_in_between_two_steps(monkeypatch):
    """Guards `BuiltEngine._kernels_behind`: the kernels build with steps running, the CPU paths
    are installed again while no step runs (`steps_held`), decode rows then read the pool in
    place, and `/capability` is told."""
    engine, _ = make_engine()
    engine.runner.mirror, engine.runner.in_place = None, False
    built_with_steps_free, seen = [], {}

    def build_deferred(pending, workers):
        built_with_steps_free.append(not engine._liveness.held)
        seen["preparing"] = built.preparing()
        return {name: None for name in pending}

    def reinstall():
        seen["held"] = engine._liveness.held and _held(engine._step_lock)
        return CpuPaths(in_place=True, kernels={"hetserve_cpu_rmsnorm": "built"})

    monkeypatch.setattr(engine_build, "build_deferred", build_deferred)
    changes = []
    built = BuiltEngine(engine, None, CompileDecision("auto", False, None, "a test: no compile"),
                        cpu=CpuPaths(pending={"hetserve_cpu_rmsnorm_x": ("hetserve_cpu_rmsnorm",)}),
                        reinstall=reinstall)
    said = built.compile(on_change=lambda: changes.append(built.cpu))
    assert "building in the background" in said
    stream = engine.submit(prompt(), SamplingParams.create(max_new_tokens=3))
    run_until_idle(engine)  # steps run while the kernels build
    built.behind.join(timeout=30)
    assert stream.events[-1].finish is not None
    assert built_with_steps_free == [True] and seen == {
        "held": True, "preparing": ["C++ kernels: torch paths, building hetserve_cpu_rmsnorm"]}
    assert built.preparing() == [] and built.fallbacks == {}
    assert engine.runner.in_place and built.cpu.kernels == {"hetserve_cpu_rmsnorm": "built"}
    assert changes and changes[-1] is built.cpu


def test_a_kernel_whose_build_fails_behind_the_serving_is_a_fallback_with_its_reason(monkeypatch):
    """Guards `self.fell_back(...)` in `BuiltEngine._kernels_behind`: a C++ kernel that fails to
    build behind the serving leaves its torch path in use, and `/capability` `fallbacks` and
    `/metrics` say which and why (before, only a log line did)."""
    engine, _ = make_engine()
    engine.runner.mirror, engine.runner.in_place = None, False
    monkeypatch.setattr(engine_build, "build_deferred", lambda pending, workers: {
        "hetserve_cpu_greedy_x": "g++ exited 1: no such header", "hetserve_cpu_rmsnorm_x": None})
    built = BuiltEngine(engine, None, CompileDecision("auto", False, None, "a test: no compile"),
                        cpu=CpuPaths(pending={"hetserve_cpu_greedy_x": ("hetserve_cpu_greedy",),
                                              "hetserve_cpu_rmsnorm_x": ("hetserve_cpu_rmsnorm",)}),
                        reinstall=lambda: CpuPaths(kernels={"hetserve_cpu_rmsnorm": "built"}))
    assert built.compile() and built.preparing() in (
        [], ["C++ kernels: torch paths, building hetserve_cpu_greedy, hetserve_cpu_rmsnorm"])
    built.behind.join(timeout=30)
    assert built.fallbacks == {"hetserve_cpu_greedy": "its C++ build failed: g++ exited 1: no such header"}
    assert built.preparing() == []
    assert 'layer="hetserve_cpu_greedy"' in engine.metrics.render().decode()


@pytest.mark.slow
def test_a_worker_with_no_kernels_built_serves_first_on_its_torch_paths(tmp_path):
    """Guards `behind=` in workers/main.py's `install_cpu_paths` call: with an empty extension
    cache a CPU worker was ready only after building every C++ kernel (minutes on a small host);
    now it answers with the reference's greedy tokens while they build."""
    model = make_checkpoint(tmp_path / "model")
    sock, status = tmp_path / "w.sock", tmp_path / "status.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSERVE_")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")  # empty: nothing built on this "host"
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "workers", "--socket", str(sock), "--worker-id", "cpu0",
                             "--model", str(model), "--status-file", str(status), "--threads", "1",
                             "--dtype", "float32"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its compiler children go with it
    proc.log_path = tmp_path / "worker.log"
    try:
        wait_state(proc, status, {"ready"}, timeout=120)
        with client(sock) as c:
            described = c.get("/capability").json()
            kernels = described["kernels"]
            assert cpp_build.DEFERRED in kernels["RMSNorm"]["cpu_kernel"], kernels["RMSNorm"]
            # what builds behind the serving is said in words, in /capability and in /health
            assert any(line.startswith("C++ kernels: torch paths, building ") and "hetserve_cpu_rmsnorm" in line
                       for line in described["preparing"]), described["preparing"]
            assert c.get("/health").json()["preparing"], "no longer preparing right after ready?"
            assert cpp_build.DEFERRED in kernels["PagedAttention"]["cpu_decode"], kernels["PagedAttention"]
            r = c.post("/generate", json={"inputs": "hello world", "parameters": {"max_new_tokens": 6}})
            assert r.status_code == 200, r.text
        want = solo_greedy(model, "hello world", 6)
        with client(sock) as c:
            ids = c.post("/generate", json={"inputs": "hello world", "parameters": {
                "max_new_tokens": 6, "details": True}}).json()["details"]["tokens"]
        assert [t["id"] for t in ids] == want
        said = proc.log_path.read_text()  # a first start is news, not trouble: INFO lines saying how long
        assert "build behind the serving (a minute or two" in said, said[-3000:]
        assert not [ln for ln in said.splitlines() if " WARNING " in ln or " ERROR " in ln], said[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
