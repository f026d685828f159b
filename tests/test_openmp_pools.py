"""One thread computes: a worker's other threads give their OpenMP pools back (workers/engine/openmp.py).

Each case runs in a child interpreter of its own, so the threads it counts (`/proc/self/task`) are
its own: the OpenMP runtime keeps one pool thread per thread that has started a two-thread region,
and a pool given back takes its thread with it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers.engine.openmp import loaded_runtimes, release_pool

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
                                reason="counts threads through Linux's /proc on a host of two CPUs or more")

PRELUDE = """
import os, threading, time
import torch
torch.set_num_threads(2)
from workers.engine.openmp import release_pool

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(expected, timeout=10.0):
    # a released pool thread leaves the process a moment after the call returns
    deadline = time.monotonic() + timeout
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

def region():
    # a reduction over 4M elements: a parallel region of two threads
    torch.ones(1 << 22).sum()
"""


def _child(body: str) -> str:
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_the_runtime_torch_computes_with_is_found():
    import torch  # noqa: F401

    assert any(os.path.basename(p).startswith(("libgomp", "libomp", "libiomp5")) for p in loaded_runtimes())
    assert release_pool().startswith("this thread's OpenMP pool released")


def test_loaded_runtimes_reads_the_maps_and_names_each_library_once(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 1 /opt/torch/lib/libgomp-a34b3233.so.1\n"
        "7f01-7f02 r-xp 00001000 08:01 1 /opt/torch/lib/libgomp-a34b3233.so.1\n"
        "7f02-7f03 r--p 00000000 08:01 2 /usr/lib/libomp.so.5\n"
        "7f03-7f04 r--p 00000000 08:01 3 /usr/lib/libgompish.txt\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert loaded_runtimes(str(maps)) == ["/opt/torch/lib/libgomp-a34b3233.so.1", "/usr/lib/libomp.so.5"]
    assert loaded_runtimes(str(tmp_path / "absent")) == []


def test_a_released_pool_takes_its_thread_with_it():
    """Guards `release_pool`'s call of `omp_pause_resource_all`: a thread that ran a two-thread region
    keeps a pool thread until it gives the pool back, on the main thread and on any other."""
    out = _child("""
        base = threads()
        region()
        kept = threads()
        release_pool()
        main_after = settled(base)
        seen = {}
        def other():
            region()
            seen["kept"] = threads()
            release_pool()
            seen["after"] = settled(base + 1)  # this thread itself still runs
        t = threading.Thread(target=other)
        t.start(); t.join()
        print(base, kept, main_after, seen["kept"], seen["after"])
    """)
    base, kept, main_after, other_kept, other_after = map(int, out.split())
    assert kept == base + 1 and main_after == base
    assert other_kept == base + 2 and other_after == base + 1


def test_the_first_step_on_the_submitting_thread_leaves_no_pool_behind():
    """Guards the `pool_released()` around `Engine._first_step_here`'s step: a short prompt's first
    step runs on the thread that submits it (the worker's event loop), and that thread's pool, left
    behind, would make the runtime's threads outnumber the CPUs, so every region the engine thread
    starts from then on would wait for its threads to be woken through the kernel."""
    out = _child("""
        import asyncio
        from tests.test_engine import make_engine, prompt
        from workers.sampling.params import SamplingParams
        engine, runner = make_engine()
        execute = runner.execute
        def computing(out):
            region()
            return execute(out)
        runner.execute = computing
        engine.start()
        base = threads()

        async def main():
            stream = engine.submit(prompt(), SamplingParams.create(max_new_tokens=1), asyncio.get_running_loop())
            return [e async for e in stream]

        events = asyncio.run(main())
        after = settled(base)
        engine.shutdown()
        print(runner.threads[0], events[-1].finish.generated_tokens, base, after)
    """)
    thread, generated, base, after = out.split()
    assert thread == "MainThread" and generated == "1"  # the step ran inline, on the submitting thread
    assert int(after) == int(base)
